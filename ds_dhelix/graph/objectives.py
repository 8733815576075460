"""What the head's loss is: the objective that turns a micro-batch's per-token log-probabilities
into its loss (``dhelix.objective``; guide: post-training).

The head (``hf_models.common.head_ops``, ``hf_models.vocab.head_ops``) ends in each token's
log-probability of its label, ``log p(target) = target logit - log-sum-exp`` over the vocabulary
(``[n, b]``: this rank's sequence shard, 0 where the label is -100). Next-token cross-entropy keeps
its own exact path; every other objective gets those log-probabilities here. The preference
objectives (and KTO, whose rows are its completions then their KL rows):

    rows = sum over the sequence shards (TP x CP ranks) of [log p, label count]   # [2, b]
    chosen, rejected = first half of the rows, second half   (as TRL's DPOTrainer concatenates)
    loss = sum over pairs of the objective's per-pair loss / denominator

The row sums are one differentiable all-reduce on the ranks of a sequence (``sum_over_ranks``); every
rank then holds the whole micro-batch's loss and returns ``1 / ranks`` of it, so the shares sum to
the loss, as the cross-entropy's do, and the all-reduce's backward sums the ranks' gradients of the
row sums back into each rank's tokens. The denominator is the micro-batch's pair count, or the
``loss_denominator`` the caller gives (pairs per micro-batch over a step on every replica), so the
engine's mean over micro-batches and replicas is the step's mean over its pairs.

Formulas (``pc`` / ``pr``: a pair's chosen / rejected log-probability sums, ``rc`` / ``rr`` the
reference's, ``n*`` their label counts; TRL's definitions and defaults):

    dpo     -logsigmoid(beta d) (1 - ls) - logsigmoid(-beta d) ls,   d = (pc - rc) - (pr - rr)
    ipo     ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 beta))^2
    simpo   -logsigmoid(beta (pc / nc - pr / nr) - gamma) (1 - ls) - logsigmoid(-(...)) ls
    orpo    NLL(chosen) - beta logsigmoid(log odds(pc / nc) - log odds(pr / nr)),
            NLL(chosen) = -sum of the chosen rows' log p / their labels (the micro-batch's)

Rewards as TRL logs them (``ObjectiveMetrics``): ``beta x (p - r)`` with a reference, ``beta x p``
(length-normalised for simpo / orpo) without; accuracy: chosen reward > rejected reward. KTO and
GRPO's update: ``KtoObjective``, ``PolicyGradientObjective``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REFERENCE_KEY = "ref_logps"
"""The batch column of the reference log-probability sums, one per row ([b]: the chosen rows'
then the rejected rows', as TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` concatenated)."""

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""What a preference objective reports per step (means over the step's pairs on every replica)."""
GRPO_METRICS = ("kl", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region", "advantages", "completions/length")
"""What GRPO reports per step: means over the step's completion tokens (advantages, length: over
its completions) on every replica; ``clip_ratio/*`` as TRL counts them (the share of tokens whose
ratio was clipped below / above / either, where the advantage made the clip bite)."""
KTO_METRICS = ("rewards/chosen", "rewards/rejected", "kl", "logps/chosen", "logps/rejected")
"""What KTO reports per step: means over the step's desirable (chosen) / undesirable (rejected)
completions, and over its micro-batches (the KL estimate)."""
TOKEN_KEYS = ("old_logps", "ref_token_logps")
"""Batch columns with one value per token ([b, s], aligned with ``labels``: the value at position
t is about token t): the sampling policy's log-probabilities and the reference's (GRPO)."""
ROW_KEYS = (REFERENCE_KEY, "advantages", "kto_label")
"""Batch columns with one value per row ([b])."""


class ObjectiveMetrics:
    """The step's sums of ``names`` and of the counts they are means over, kept on the device (read
    once a step). ``over[k]``: which count metric k is a mean over. Each objective records on one
    rank of a sequence's ranks the row values (the same on all of them), on every rank its own
    tokens' values; the step sums them over the sequence's ranks and the replicas."""

    def __init__(self, names: tuple[str, ...] = METRICS, over: tuple[int, ...] | None = None):
        self.names, self.over, self.sums = names, over or (0,) * len(names), None

    def reset(self) -> None:
        self.sums = None

    def record(self, values: torch.Tensor, counts: torch.Tensor) -> None:
        """``values`` [len(names)] sums over ``counts`` items."""
        row = torch.cat([values.detach().double(), counts.detach().double()])
        self.sums = row if self.sums is None else self.sums + row

    def means(self, sums: torch.Tensor) -> dict[str, float]:
        """The metrics' means from ``sums`` (``self.sums`` summed over the ranks)."""
        values = sums.tolist()
        counts = [max(c, 1.0) for c in values[len(self.names) :]]
        return {name: values[k] / counts[self.over[k]] for k, name in enumerate(self.names)}


def loss_denominator(side: dict):
    """The divisor of a micro-batch's summed loss: ``loss_denominator`` when the batch gave one,
    else its valid target count (at least 1)."""
    given = side.get("loss_denominator")
    return given if given is not None else max(side["num_valid"], 1)


class PreferenceObjective:
    """A paired objective of ``dhelix.objective`` (``ObjectiveConfig``), bound to the ranks of one
    sequence by ``bind``; called by the head as ``objective(side, logps)`` -> this rank's share."""

    def __init__(self, config):
        self.name, self.beta = config.name, config.default_beta
        self.smoothing, self.gamma = config.label_smoothing, config.simpo_gamma
        self.metrics = ObjectiveMetrics()
        self.ranks, self.group, self.first = 1, None, True
        self.capture: list | None = None  # a reference pass: each micro-batch's row sums, no loss

    @property
    def needs_reference(self) -> bool:
        return self.name in ("dpo", "ipo", "kto")

    def bind(self, ranks: int, group):
        """The ``ranks`` ranks (``group``) holding shards of one sequence (TP x CP; 1: no sum)."""
        import torch.distributed as dist

        self.ranks, self.group = ranks, group
        self.first = ranks == 1 or dist.get_rank(group) == 0  # records the rows' metrics
        return self

    def row_sums(self, side: dict, logps: torch.Tensor) -> torch.Tensor:
        """[2, b]: each row's log-probability sum and label count over the whole sequence."""
        valid = (side["targets"] != -100).to(logps.dtype)
        rows = torch.stack([logps.sum(0), valid.sum(0)])
        return sum_over_ranks(rows, self.group) if self.ranks > 1 else rows

    def __call__(self, side: dict, logps: torch.Tensor) -> torch.Tensor:
        rows = self.row_sums(side, logps.float())
        b = rows.shape[1]
        if b % 2:
            raise ValueError(
                f"dhelix.objective {self.name!r} pairs the rows of a micro-batch (chosen, then rejected); "
                f"this one has {b} rows"
            )
        if self.capture is not None:
            self.capture.append(rows[0].detach().clone())
            return logps.sum() * 0
        per_pair, rewards = self.pair_losses(side, rows)
        pairs = b // 2
        self.record(rows, rewards, pairs)
        denominator = side.get("loss_denominator") or pairs
        return per_pair.sum() / denominator / self.ranks

    def pair_losses(self, side: dict, rows: torch.Tensor):
        """(each pair's loss [p], (chosen rewards, rejected rewards) [p] each)."""
        (pc, pr), (nc, nr) = rows[0].chunk(2), rows[1].clamp(min=1).chunk(2)
        beta = self.beta
        if self.needs_reference:
            rc, rr = self.reference(side, rows).chunk(2)
            chosen, rejected = pc - rc, pr - rr
            if self.name == "dpo":
                return self.smoothed(beta * (chosen - rejected)), (beta * chosen, beta * rejected)
            delta = chosen / nc - rejected / nr  # ipo
            return (delta - 1 / (2 * beta)) ** 2, (beta * chosen, beta * rejected)
        ac, ar = pc / nc, pr / nr
        if self.name == "simpo":
            return self.smoothed(beta * (ac - ar) - self.gamma), (beta * ac, beta * ar)
        odds = (ac - ar) - (_log1mexp(ac) - _log1mexp(ar))  # orpo
        nll = -pc.sum() / nc.sum()
        return nll - beta * F.logsigmoid(odds), (beta * ac, beta * ar)

    def reference(self, side: dict, rows: torch.Tensor) -> torch.Tensor:
        """Each row's reference log-probability sum ([b], from the batch's ``ref_logps``)."""
        ref = side.get(REFERENCE_KEY)
        if ref is None:
            raise ValueError(
                f"dhelix.objective {self.name!r} compares with a reference model: give each row's "
                f"reference log-probability sum as the batch's {REFERENCE_KEY!r} [rows], or train LoRA "
                f"(the engine then computes it with the adapter off)"
            )
        return ref.to(rows.dtype)

    def smoothed(self, logits: torch.Tensor) -> torch.Tensor:
        loss = -F.logsigmoid(logits)
        if self.smoothing:
            loss = loss * (1 - self.smoothing) - F.logsigmoid(-logits) * self.smoothing
        return loss

    def record(self, rows: torch.Tensor, rewards, pairs: int) -> None:
        with torch.no_grad():
            chosen, rejected = (r.detach() for r in rewards)
            pc, pr = rows[0].detach().chunk(2)
            values = torch.stack(
                [
                    chosen.sum(),
                    rejected.sum(),
                    (chosen > rejected).to(chosen.dtype).sum(),
                    (chosen - rejected).sum(),
                    pc.sum(),
                    pr.sum(),
                ]
            )
            self.metrics.record(values * self.first, values.new_tensor([pairs * self.first]))


class _SumOverRanks(torch.autograd.Function):
    """``x`` summed over ``group``; the backward sums the ranks' gradients (each rank's loss used
    the sum, so each of its terms feeds every rank's loss)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over the ranks of ``group``, differentiable (a small blocking all-reduce both ways)."""
    return _SumOverRanks.apply(x, group)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class KtoObjective(PreferenceObjective):
    """KTO (``dhelix.objective`` "kto", TRL's ``loss_type="kto"``) on unpaired completions labelled
    desirable or not (``kto_label``). A micro-batch holds its completions, then their KL rows (each
    prompt with another record's completion, ``data/preference.py``); with ``lr`` a completion's
    log-ratio to the reference and ``z`` the micro-batch's KL estimate, ``mean(log p - ref log p)``
    over its KL rows, clamped at 0 and not differentiated::

        desirable     w_d (1 - sigmoid(beta (lr - z)))
        undesirable   w_u (1 - sigmoid(beta (z - lr)))

    averaged over the completions. (TRL also averages ``z`` over the data-parallel processes; here
    each replica's micro-batch has its own.)"""

    def __init__(self, config):
        super().__init__(config)
        self.weights = (config.desirable_weight, config.undesirable_weight)
        self.metrics = ObjectiveMetrics(KTO_METRICS, (0, 1, 2, 0, 1))

    def pair_losses(self, side: dict, rows: torch.Tensor):
        p, p_kl = rows[0].chunk(2)
        ref, ref_kl = self.reference(side, rows).chunk(2)
        if "kto_label" not in side:
            raise ValueError("dhelix.objective 'kto' needs each completion's label: the batch's 'kto_label' [rows]")
        desirable = side["kto_label"].chunk(2)[0].to(torch.bool)
        z = (p_kl - ref_kl).mean().detach().clamp(min=0)
        lr = p - ref
        w_d, w_u = self.weights
        losses = torch.where(
            desirable, w_d * (1 - torch.sigmoid(self.beta * (lr - z))), w_u * (1 - torch.sigmoid(self.beta * (z - lr)))
        )
        return losses, (self.beta * lr, desirable, z)

    def record(self, rows: torch.Tensor, rewards, pairs: int) -> None:
        with torch.no_grad():
            reward, desirable, z = rewards
            d = desirable.to(reward.dtype)
            p = rows[0].detach().chunk(2)[0]
            r = reward.detach()
            values = torch.stack([(r * d).sum(), (r * (1 - d)).sum(), z, (p * d).sum(), (p * (1 - d)).sum()])
            counts = torch.stack([d.sum(), (1 - d).sum(), d.new_tensor(1.0)])
            self.metrics.record(values * self.first, counts * self.first)


class PolicyGradientObjective:
    """GRPO's update (``dhelix.objective`` "grpo"): per completion token, with the row's advantage
    ``A``, the ratio ``r = exp(log p - old log p)`` to the sampling policy (1 with its gradient when
    the batch has no ``old_logps``: one update per generation) and the reference's ``ref`` log p::

        loss_t = -min(r A, clip(r, 1 - eps, 1 + eps_high) A) + beta (exp(ref - log p) - (ref - log p) - 1)

    averaged as ``loss_type`` says (``ObjectiveConfig.loss_type``; the "grpo" type's per-completion
    means need each row's sums over the sequence's ranks, one all-reduce; the others are token
    sums over a count, no collective). Each rank returns its share, as the cross-entropy does."""

    needs_reference = False

    def __init__(self, config):
        self.name, self.beta, self.loss_type = config.name, config.default_beta, config.loss_type
        self.low, self.high = config.epsilon, config.epsilon_high or config.epsilon
        self.max_length = config.max_completion_length
        self.metrics = ObjectiveMetrics(GRPO_METRICS, (0, 0, 0, 0, 1, 1))
        self.ranks, self.group, self.first = 1, None, True

    bind = PreferenceObjective.bind

    def __call__(self, side: dict, logps: torch.Tensor) -> torch.Tensor:
        logps = logps.float()
        valid = side["targets"] != -100
        if "advantages" not in side:
            raise ValueError("dhelix.objective 'grpo' needs each row's advantage: the batch's 'advantages' [rows]")
        adv = side["advantages"].to(logps.dtype).unsqueeze(0)  # [1, b]
        old = side.get("old_logps")
        old = logps.detach() if old is None else torch.where(valid, old.to(logps.dtype), logps.detach())
        ratio = torch.exp(logps - old)
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - self.low, 1 + self.high) * adv)
        kl = None
        if self.beta:
            if "ref_token_logps" not in side:
                raise ValueError(
                    "dhelix.objective 'grpo' with beta > 0 needs the reference's per-token log-probabilities: "
                    "the batch's 'ref_token_logps' [rows, sequence] (or beta 0: no KL term)"
                )
            d = torch.where(valid, side["ref_token_logps"].to(logps.dtype), logps.detach()) - logps
            kl = torch.exp(d) - d - 1
            per_token = per_token + self.beta * kl
        per_token = per_token.masked_fill(~valid, 0)
        self.record(valid, ratio, adv, kl)
        return self.average(side, per_token, valid)

    def average(self, side: dict, per_token: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """This rank's share of the micro-batch's loss (``loss_type``)."""
        rows = per_token.shape[1]
        if self.loss_type == "grpo":
            sums = torch.stack([per_token.sum(0), valid.to(per_token.dtype).sum(0)])
            sums = sum_over_ranks(sums, self.group) if self.ranks > 1 else sums
            return (sums[0] / sums[1].clamp(min=1)).sum() / rows / self.ranks
        if self.loss_type == "dr_grpo":
            return per_token.sum() / (rows * (self.max_length or side["seq_len"]))
        # bnpo / dapo: over the micro-batch's completion tokens, or the count the caller gives (train.py
        # gives dapo the step's on every replica)
        return per_token.sum() / loss_denominator(side)

    def record(self, valid, ratio, adv, kl) -> None:
        with torch.no_grad():
            f = valid.to(ratio.dtype)
            low = ((ratio < 1 - self.low) & (adv < 0)).to(f.dtype) * f
            high = ((ratio > 1 + self.high) & (adv > 0)).to(f.dtype) * f
            rows = adv.sum() * self.first, adv.new_tensor(adv.numel() * self.first)
            kl = (kl * f).sum() if kl is not None else f.new_zeros(())
            values = torch.stack([kl, low.sum(), high.sum(), (low + high).sum(), rows[0], f.sum()])
            self.metrics.record(values, torch.stack([f.sum(), rows[1]]))


def make_objective(config):
    """The objective of ``dhelix.objective`` (an ``ObjectiveConfig``); None for cross-entropy (the
    head's own path)."""
    if config.name == "grpo":
        return PolicyGradientObjective(config)
    if config.name == "kto":
        return KtoObjective(config)
    return PreferenceObjective(config) if config.paired else None
