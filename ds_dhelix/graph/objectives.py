"""What the head's loss is: the objective that turns a micro-batch's per-token log-probabilities
into its loss (``dhelix.objective``; guide: post-training).

The head (``hf_models.common.head_ops``, ``hf_models.vocab.head_ops``) ends in each token's
log-probability of its label, ``log p(target) = target logit - log-sum-exp`` over the vocabulary
(``[n, b]``: this rank's sequence shard, 0 where the label is -100). Next-token cross-entropy keeps
its own exact path; a preference objective gets those log-probabilities here:

    rows = sum over the sequence shards (TP x CP ranks) of [log p, label count]   # [2, b]
    chosen, rejected = first half of the rows, second half   (as TRL's DPOTrainer concatenates)
    loss = sum over pairs of the objective's per-pair loss / denominator

The row sums are one differentiable all-reduce on the ranks of a sequence (``reduce``); every
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
(length-normalised for simpo / orpo) without; accuracy: chosen reward > rejected reward.
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


class ObjectiveMetrics:
    """The step's sums of ``METRICS`` and its pair count, kept on the device (read once a step)."""

    def __init__(self):
        self.sums: torch.Tensor | None = None

    def reset(self) -> None:
        self.sums = None

    def record(self, values: torch.Tensor, pairs: int) -> None:
        """``values`` [len(METRICS)]: sums over ``pairs`` pairs."""
        row = torch.cat([values.detach().double(), values.new_tensor([pairs], dtype=torch.float64)])
        self.sums = row if self.sums is None else self.sums + row

    def means(self, sums: torch.Tensor) -> dict[str, float]:
        """The metrics' means from ``sums`` (``self.sums`` summed over the replicas)."""
        values = sums.tolist()
        pairs = max(values[-1], 1.0)
        return {name: v / pairs for name, v in zip(METRICS, values[:-1])}


class PreferenceObjective:
    """A paired objective of ``dhelix.objective`` (``ObjectiveConfig``), bound to the ranks of one
    sequence by ``bind``; called by the head as ``objective(side, logps)`` -> this rank's share."""

    def __init__(self, config):
        self.name, self.beta = config.name, config.default_beta
        self.smoothing, self.gamma = config.label_smoothing, config.simpo_gamma
        self.metrics = ObjectiveMetrics()
        self.ranks, self.group = 1, None
        self.capture: list | None = None  # a reference pass: each micro-batch's row sums, no loss

    @property
    def needs_reference(self) -> bool:
        return self.name in ("dpo", "ipo")

    def bind(self, ranks: int, group) -> PreferenceObjective:
        """The ``ranks`` ranks (``group``) holding shards of one sequence (TP x CP; 1: no sum)."""
        self.ranks, self.group = ranks, group
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
            ref = side.get(REFERENCE_KEY)
            if ref is None:
                raise ValueError(
                    f"dhelix.objective {self.name!r} compares with a reference model: give each row's "
                    f"reference log-probability sum as the batch's {REFERENCE_KEY!r} [rows], or train LoRA "
                    f"(the engine then computes it with the adapter off)"
                )
            rc, rr = ref.to(rows.dtype).chunk(2)
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
            self.metrics.record(values, pairs)


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


def make_objective(config):
    """The objective of ``dhelix.objective`` (an ``ObjectiveConfig``); None for cross-entropy (the
    head's own path)."""
    return PreferenceObjective(config) if config.paired else None
