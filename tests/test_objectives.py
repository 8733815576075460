"""Objectives on the op graph's head (``ds_dhelix/graph/objectives.py``, ``dhelix.objective``).

first step = direct     the sharded model's first-step loss and every full gradient (TP=2 dense
                        through the vocabulary-parallel head, TP=2 with ``head_chunk``, EP=2 MoE
                        through the plain head) equal a direct computation with the unsharded
                        transformers model and TRL's formulas written out here, within 1e-5: dpo
                        (with label smoothing too), ipo, simpo, orpo, kto, and grpo's four averages
                        (sequence mean with its KL term, dapo with clip-higher, dr_grpo, bnpo)
SI = sequential         two engine steps, losses, trained parameters and metrics bitwise equal:
                        DPO (TP=2, EP=2), LoRA with the engine's reference pass (DPO TP=2, IPO EP=2,
                        KTO TP=2: its first loss = the direct computation with PEFT's
                        ``disable_adapter``), GRPO (TP=2, EP=2)
train.py                DPO + LoRA: rewards/accuracies rise well above 0.5, TensorBoard has TRL's
                        metrics, PEFT's model from the adapter reproduces the probe loss; GRPO on
                        rollouts with rewards: the exported model prefers the rewarded completions
records                 rollouts (TRL's reward normalisation, per-token alignment), conversational
                        pairs (ChatML: the loss on the answer), KTO's unpaired records (KL rows)
pipeline                DPO (reference columns) and GRPO on the folded W pipeline (PP=2) equal PP=1
                        sequential bitwise, losses and parameters
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_dhelix.graph.objectives import GRPO_METRICS, KTO_METRICS, METRICS
from ds_dhelix.runtime.spawn import run_ranks

PAIRS, SEQ = 2, 16


def pair_batches(
    vocab: int, num: int, pairs: int = PAIRS, seq: int = SEQ, seed: int = 5, ref: bool = True, kto: bool = False
):
    """``num`` micro-batches of ``pairs`` preference pairs: rows [chosen x pairs; rejected x pairs],
    a shared prompt of 3-5 tokens (labels -100), completions of random lengths, right padding
    (labels -100); ``ref``: a ``ref_logps`` column (as TRL precomputes it); ``kto``: the rows read
    as KTO's [completions; their KL rows] with a ``kto_label`` (desirable or not) per completion."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = torch.zeros(2 * pairs, seq, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for i in range(pairs):
            prompt = torch.randint(3, vocab, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g)
            for row in (i, pairs + i):
                n = int(torch.randint(4, seq - len(prompt) + 1, (1,), generator=g))
                completion = torch.randint(3, vocab, (n,), generator=g)
                ids[row, : len(prompt)] = prompt
                ids[row, len(prompt) : len(prompt) + n] = completion
                labels[row, len(prompt) : len(prompt) + n] = completion
        batch = {"input_ids": ids, "labels": labels}
        if ref:
            batch["ref_logps"] = -30 - 10 * torch.rand(2 * pairs, generator=g, dtype=torch.float32)
        if kto:
            label = (torch.rand(pairs, generator=g) < 0.5).float()
            label[0], label[-1] = 1.0, 0.0  # (both kinds in every micro-batch)
            batch["kto_label"] = torch.cat([label, label])
        out.append(batch)
    return out


def direct_loss(name: str, sums, counts, ref, beta: float, smoothing: float = 0.0, gamma: float = 0.5):
    """A micro-batch's loss from its rows' log-probability sums and label counts (TRL's formulas)."""
    pc, pr = sums.chunk(2)
    nc, nr = counts.chunk(2)
    if name in ("dpo", "ipo"):
        rc, rr = ref.chunk(2)
        if name == "dpo":
            d = beta * ((pc - rc) - (pr - rr))
            return (-F.logsigmoid(d) * (1 - smoothing) - F.logsigmoid(-d) * smoothing).mean()
        return (((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2).mean()
    if name == "simpo":
        d = beta * (pc / nc - pr / nr) - gamma
        return (-F.logsigmoid(d) * (1 - smoothing) - F.logsigmoid(-d) * smoothing).mean()
    ac, ar = pc / nc, pr / nr
    odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
    return -pc.sum() / nc.sum() - beta * F.logsigmoid(odds).mean()


def direct_kto(sums, ref, label, beta: float, objective: dict):
    """KTO's loss of one micro-batch ([completions; KL rows]), as TRL's ``_compute_loss`` forms it."""
    p, p_kl = sums.chunk(2)
    r, r_kl = ref.chunk(2)
    z = (p_kl - r_kl).mean().detach().clamp(min=0)
    lr = p - r
    desirable = label.chunk(2)[0].bool()
    w_d, w_u = objective.get("desirable_weight", 1.0), objective.get("undesirable_weight", 1.0)
    chosen = w_d * (1 - torch.sigmoid(beta * (lr[desirable] - z)))
    rejected = w_u * (1 - torch.sigmoid(beta * (z - lr[~desirable])))
    return torch.cat([chosen, rejected]).mean()


def row_sums(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits.float()[:, :-1]
    labels = batch["labels"][:, 1:]
    valid = labels != -100
    tok = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (tok * valid).sum(1), valid.sum(1).float()


def direct_first_step(opts, step, objective: dict):
    """The unsharded model's first step on ``step`` (every micro-batch of every replica): mean loss
    and gradients; LoRA without a ``ref_logps`` column: the reference is PEFT's adapter switched off."""
    from ds_dhelix.verify.options import build
    from hf_models.lora import our_name

    model = build(opts, stochastic=False)
    model.train()
    beta = objective.get("beta", {"simpo": 2.0}.get(objective["name"], 0.1))
    total = 0.0
    for b in step:
        if objective["name"] == "grpo":
            loss = direct_grpo(model, b, objective) / len(step)
            loss.backward()
            total += loss.item()
            continue
        ref = b.get("ref_logps")
        if ref is None and objective["name"] in ("dpo", "ipo", "kto"):
            with torch.no_grad(), model.disable_adapter():
                ref = row_sums(model, b)[0]
        sums, counts = row_sums(model, b)
        if objective["name"] == "kto":
            loss = direct_kto(sums, ref, b["kto_label"], beta, objective) / len(step)
        else:
            loss = direct_loss(objective["name"], sums, counts, ref, beta, objective.get("label_smoothing", 0.0))
            loss = loss / len(step)
        loss.backward()
        total += loss.item()
    grads = {our_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return total, grads


def _opts(model: str, layout: dict, objective: dict):
    from ds_dhelix.verify import ParityOptions

    layout = dict(layout)
    ep, extra = layout.pop("ep", 0), layout.pop("extra", {})
    opts = ParityOptions(model=model, seq_len=SEQ, num_layers=2, micro_batches=2, micro_batch_size=2 * PAIRS, **layout)
    moe = {"expert_parallel": {"size": ep, "capacity_factor": None, "aux_loss_coef": 0.0}} if ep else {}
    opts.extra = {**extra, **moe, "objective": objective}
    return opts


def _first_step_world(rank, world, cases):
    from ds_dhelix.verify.legs import first_step

    out = {}
    for name, (model, layout, objective, ref) in cases.items():
        opts = _opts(model, layout, objective)
        if objective["name"] == "grpo":
            steps = [rollout_batches(opts, opts.dp * opts.micro_batches, kl=bool(objective.get("beta")))]
        else:
            steps = [pair_batches(512, opts.dp * opts.micro_batches, ref=ref, kto=objective["name"] == "kto")]
        ours = first_step(opts, steps)
        direct = direct_first_step(opts, steps[0], objective) if rank == 0 else None
        out[name] = (ours, direct)
    return out


def rollout_batches(opts, num: int, kl: bool, rows: int = 4, seed: int = 9):
    """``num`` micro-batches of ``rows`` sampled completions (random prompts and completions, right
    padding), each with an advantage, the sampling policy's per-token log-probabilities (the start
    model's plus noise: ratios around 1, some clipped) and with ``kl`` the reference's."""
    from ds_dhelix.verify.options import build

    model = build(opts, stochastic=False)
    g = torch.Generator().manual_seed(seed)
    out = []
    for batch in pair_batches(512, num, pairs=rows // 2, seed=seed, ref=False):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits.float()
        tok = logits.log_softmax(-1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        aligned = torch.cat([torch.zeros(rows, 1), tok], dim=1)  # the value of token t at position t
        batch["advantages"] = torch.randn(rows, generator=g)
        batch["old_logps"] = aligned + 0.3 * torch.randn(aligned.shape, generator=g)
        if kl:
            batch["ref_token_logps"] = aligned + 0.2 * torch.randn(aligned.shape, generator=g)
        out.append(batch)
    return out


def direct_grpo(model, batch, objective: dict):
    """GRPO's loss of one micro-batch, as TRL's ``_compute_loss`` forms it."""
    logits = model(input_ids=batch["input_ids"]).logits.float()[:, :-1]
    labels = batch["labels"][:, 1:]
    mask = (labels != -100).float()
    tok = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    adv = batch["advantages"].unsqueeze(1)
    eps, high = objective.get("epsilon", 0.2), objective.get("epsilon_high") or objective.get("epsilon", 0.2)
    ratio = torch.exp(tok - batch["old_logps"][:, 1:])
    per = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + high) * adv)
    beta = objective.get("beta", 0.0)
    if beta:
        d = batch["ref_token_logps"][:, 1:] - tok
        per = per + beta * (torch.exp(d) - d - 1)
    kind = objective.get("loss_type", "dapo")
    if kind == "grpo":
        return ((per * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if kind == "dr_grpo":
        return (per * mask).sum() / (per.shape[0] * objective["max_completion_length"])
    return (per * mask).sum() / mask.sum().clamp(min=1.0)  # bnpo; dapo over one micro-batch's tokens


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
ATTN_LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]}
FIRST_STEP = {
    "dpo-tp2": ("tiny-llama", {"tp": 2}, {"name": "dpo"}, True),
    "dpo-smoothing-tp2": ("tiny-llama", {"tp": 2}, {"name": "dpo", "beta": 0.3, "label_smoothing": 0.1}, True),
    "ipo-tp2": ("tiny-llama", {"tp": 2}, {"name": "ipo", "beta": 0.5}, True),
    "simpo-tp2-chunked": ("tiny-llama", {"tp": 2, "extra": {"head_chunk": 8}}, {"name": "simpo"}, False),
    "orpo-tp2": ("tiny-llama", {"tp": 2}, {"name": "orpo", "beta": 0.2}, False),
    "dpo-ep2": ("tiny-qwen3-moe", {"tp": 1, "dp": 2, "ep": 2}, {"name": "dpo"}, True),
    "orpo-ep2": ("tiny-qwen3-moe", {"tp": 1, "dp": 2, "ep": 2}, {"name": "orpo"}, False),
    "kto-tp2": ("tiny-llama", {"tp": 2}, {"name": "kto", "desirable_weight": 1.5}, True),
    "kto-ep2": ("tiny-qwen3-moe", {"tp": 1, "dp": 2, "ep": 2}, {"name": "kto", "beta": 0.3}, True),
    "grpo-seq-kl-tp2": ("tiny-llama", {"tp": 2}, {"name": "grpo", "loss_type": "grpo", "beta": 0.04}, False),
    "grpo-dapo-clip-higher-tp2": (
        "tiny-llama",
        {"tp": 2},
        {"name": "grpo", "loss_type": "dapo", "epsilon": 0.1, "epsilon_high": 0.28},
        False,
    ),
    "grpo-dr-ep2": (
        "tiny-qwen3-moe",
        {"tp": 1, "dp": 2, "ep": 2},
        {"name": "grpo", "loss_type": "dr_grpo", "max_completion_length": 12},
        False,
    ),
    "grpo-bnpo-kl-ep2": (
        "tiny-qwen3-moe",
        {"tp": 1, "dp": 2, "ep": 2},
        {"name": "grpo", "loss_type": "bnpo", "beta": 0.1},
        False,
    ),
}


@pytest.mark.timeout(600)
def test_first_step_equals_the_direct_computation():
    results = run_ranks(_first_step_world, 2, args=(FIRST_STEP,), timeout=580)
    for name, (ours, (loss, grads)) in results[0].items():
        assert abs(ours["loss"] - loss) < 1e-5, (name, ours["loss"], loss)
        assert ours["grads"].keys() >= grads.keys(), name
        for n, g in grads.items():
            diff = (ours["grads"][n] - g).abs().max().item()
            assert diff < 1e-5, (name, n, diff)  # fp32; the sums' order differs (sharded, chunked)
        assert any(g.abs().max() > 0 for g in grads.values()), name


def _train(opts, schedule: str, steps: list[list[dict]]):
    """Engine steps of ``schedule``: the losses, the trained parameters, each step's metrics."""
    import ds_dhelix
    from ds_dhelix.verify import build

    cfg = opts.ds_config(schedule)
    engine, *_ = ds_dhelix.initialize(model=build(opts), config=cfg)
    losses, metrics = [], []
    for step in steps:
        losses.append(float(engine.train_batch(iter([dict(b) for b in step]))))
        metrics.append(engine.objective_metrics)
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    engine.destroy()
    return losses, params, metrics


def _engine_world(rank, world, cases):
    from ds_dhelix.verify.options import my_share

    out = {}
    for name, (model, layout, objective, ref) in cases.items():
        opts = _opts(model, layout, objective)
        if objective["name"] == "grpo":
            steps = [rollout_batches(opts, opts.dp * opts.micro_batches, kl=True, seed=9 + k) for k in range(2)]
        else:
            kto = objective["name"] == "kto"
            steps = [pair_batches(512, opts.dp * opts.micro_batches, ref=ref, seed=5 + k, kto=kto) for k in range(2)]
        mine = [my_share(opts, s, rank % opts.dp) for s in steps]
        seq = _train(opts, "sequential", mine)
        si = _train(opts, "si", mine)
        direct = direct_first_step(opts, steps[0], objective)[0] if rank == 0 and not ref else None
        out[name] = (seq, si, direct)
    return out


ENGINE = {
    "dpo-tp2": ("tiny-llama", {"tp": 2}, {"name": "dpo"}, True),
    "dpo-ep2": ("tiny-qwen3-moe", {"tp": 1, "dp": 2, "ep": 2}, {"name": "dpo"}, True),
    "dpo-lora-tp2": ("tiny-llama", {"tp": 2, "lora": LORA}, {"name": "dpo"}, False),  # reference: adapter off
    "ipo-lora-ep2": ("tiny-qwen3-moe", {"tp": 1, "dp": 2, "ep": 2, "lora": ATTN_LORA}, {"name": "ipo"}, False),
    "grpo-tp2": ("tiny-llama", {"tp": 2}, {"name": "grpo", "loss_type": "grpo", "beta": 0.04}, True),
    "kto-lora-tp2": ("tiny-llama", {"tp": 2, "lora": LORA}, {"name": "kto"}, False),  # reference: adapter off
    "grpo-ep2": ("tiny-qwen3-moe", {"tp": 1, "dp": 2, "ep": 2}, {"name": "grpo", "beta": 0.04}, True),
}


@pytest.mark.timeout(600)
def test_si_equals_sequential_and_the_reference_pass():
    results = run_ranks(_engine_world, 2, args=(ENGINE,), timeout=580)
    for rank, out in enumerate(results):
        for name, (seq, si, direct) in out.items():
            (losses, params, metrics), (si_losses, si_params, si_metrics) = seq, si
            assert losses == si_losses, (name, rank, losses, si_losses)
            for n in params:
                assert torch.equal(params[n], si_params[n]), (name, rank, n)
            names = GRPO_METRICS if name.startswith("grpo") else KTO_METRICS if name.startswith("kto") else METRICS
            assert metrics == si_metrics and set(metrics[0]) == set(names), (name, metrics, si_metrics)
            m = metrics[0]
            if name.startswith("grpo"):
                assert m["kl"] > 0 and 0 < m["clip_ratio/region"] < 1 and m["completions/length"] > 3, (name, m)
            elif not name.startswith("kto"):
                assert abs(m["rewards/margins"] - (m["rewards/chosen"] - m["rewards/rejected"])) < 1e-6, (name, m)
            if direct is not None:  # LoRA: the engine's reference pass = PEFT's disable_adapter
                assert abs(losses[0] - direct) < 1e-5, (name, losses[0], direct)


def preference_file(path, records: int = 64, seed: int = 0) -> str:
    """Pairs whose chosen completion starts with "yes" and uses the first five words, the rejected
    one the others: a preference a small model learns in a few steps."""
    import json
    import random

    rng = random.Random(seed)
    words = "the cat dog sat on mat ran far away big small red blue tree house".split()
    with open(path, "w") as f:
        for _ in range(records):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 6)))
            chosen = "yes " + " ".join(rng.choice(words[:5]) for _ in range(rng.randint(2, 5)))
            rejected = " ".join(rng.choice(words[5:]) for _ in range(rng.randint(2, 6)))
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return str(path)


@pytest.mark.slow
def test_train_py_dpo_with_lora_learns_and_its_adapter_reproduces_the_probe(tmp_path):
    """train.py --objective dpo --lora (TP=2, SI): rewards/accuracies rise well above 0.5 and the
    summary and TensorBoard carry TRL's metrics; PEFT's model from the written adapter, with
    ``disable_adapter`` as the reference, gives the run's probe loss on its first pairs."""
    import json

    from peft import PeftModel
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hf_models.registry import build_model
    from tests.test_train_e2e import run_train

    data = preference_file(tmp_path / "pairs.jsonl")
    summary, proc = run_train(tmp_path, steps=50, extra=("--data", data, "--objective", "dpo", "--lora"))
    objective = summary["objective"]
    assert objective["name"] == "dpo" and len(objective["steps"]) == 50
    assert objective["last"]["rewards/accuracies"] > 0.8 > objective["first"]["rewards/accuracies"], objective
    assert objective["last"]["rewards/margins"] > 0.5, objective
    assert "dpo: rewards/accuracies" in proc.stdout
    events = EventAccumulator(str(next((tmp_path / "tb").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert {"Train/rewards/accuracies", "Train/rewards/margins"} <= set(events.Tags()["scalars"])

    base, _ = build_model("tiny-llama", seed=1234)
    model = PeftModel.from_pretrained(base, str(tmp_path / "hf")).eval()
    ids, labels = torch.tensor(summary["probe_input_ids"]), torch.tensor(summary["probe_labels"])
    batch = {"input_ids": ids, "labels": labels}
    with torch.no_grad():
        sums, counts = row_sums(model, batch)
        with model.disable_adapter():
            ref, _ = row_sums(model, batch)
    loss = direct_loss("dpo", sums, counts, ref, 0.1)
    assert abs(float(loss) - summary["probe_loss"]) < 1e-5, (float(loss), summary["probe_loss"])
    json.dumps(summary)  # (the summary stays JSON)


def rollout_file(path, records: int = 32, seed: int = 0) -> str:
    """Groups of four completions per prompt: two start with "yes" and use the first five words
    (reward 1), two use the others (reward 0)."""
    import json
    import random

    rng = random.Random(seed)
    words = "the cat dog sat on mat ran far away big small red blue tree house".split()
    with open(path, "w") as f:
        for _ in range(records):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 6)))
            good = ["yes " + " ".join(rng.choice(words[:5]) for _ in range(rng.randint(2, 5))) for _ in range(2)]
            bad = [" ".join(rng.choice(words[5:]) for _ in range(rng.randint(2, 6))) for _ in range(2)]
            f.write(json.dumps({"prompt": prompt, "completions": good + bad, "rewards": [1, 1, 0, 0]}) + "\n")
    return str(path)


def reward_gap(model, tokenizer, path) -> float:
    """Mean per-token log-probability of the rewarded completions minus the others'."""
    import json

    sums = {True: [], False: []}
    for line in open(path):
        r = json.loads(line)
        p = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        for c, reward in zip(r["completions"], r["rewards"]):
            ids = tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([p + ids])).logits.float()[0, len(p) - 1 : -1]
            sums[bool(reward)].append(float(logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).mean()))
    return sum(sums[True]) / len(sums[True]) - sum(sums[False]) / len(sums[False])


@pytest.mark.slow
def test_train_py_grpo_raises_the_rewarded_completions(tmp_path):
    """train.py --objective grpo on rollouts with rewards (TP=2, SI, full fine-tune, DAPO's token
    average): the exported model prefers the rewarded completions (their mean token log-probability
    rises by more than 1 nat over the others', from about 0); the summary carries GRPO's metrics."""
    from transformers import AutoModelForCausalLM

    from hf_models.registry import build_model, load_tokenizer_for
    from tests.test_train_e2e import run_train

    data = rollout_file(tmp_path / "rollouts.jsonl")
    summary, proc = run_train(tmp_path, steps=20, extra=("--data", data, "--objective", "grpo"))
    assert summary["objective"]["name"] == "grpo" and set(summary["objective"]["last"]) == set(GRPO_METRICS)
    assert summary["data"]["loss_average"] == "tokens" and summary["data"]["format"] == "rollouts"
    assert "grpo: kl" in proc.stdout
    tokenizer = load_tokenizer_for("tiny-llama")
    before = reward_gap(build_model("tiny-llama", seed=1234)[0].eval(), tokenizer, data)
    after = reward_gap(AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval(), tokenizer, data)
    assert abs(before) < 0.2 and after > before + 1.0, (before, after)


def test_rollouts_are_rows_with_their_advantages_and_aligned_log_probabilities():
    """``rollouts.py``: rewards normalised per group as TRL does (unbiased std + 1e-4, or only the
    mean with scale_rewards none), per-token values at their tokens' positions, cut rows counted."""
    from ds_dhelix.data.rollouts import RolloutEncoder, load_rollouts
    from hf_models.registry import load_tokenizer_for

    tok = load_tokenizer_for("tiny-llama")
    record = {
        "prompt_ids": [5, 6, 7],
        "completion_ids": [[8, 9], [10, 11, 12], [13]],
        "rewards": [1.0, 0.0, 0.5],
        "old_logps": [[-1.0, -2.0], [-3.0, -4.0, -5.0], [-6.0]],
        "ref_logps": [[-1.5, -2.5], [-3.5, -4.5, -5.5], [-6.5]],
    }
    data = load_rollouts([record], RolloutEncoder(tok), seq_len=6, pad_id=0)
    f = data.fields
    r = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    assert torch.allclose(f["advantages"], ((r - r.mean()) / (r.std() + 1e-4)).float())
    assert f["input_ids"][1].tolist() == [5, 6, 7, 10, 11, 12]
    assert f["labels"][1].tolist() == [-100, -100, -100, 10, 11, 12]
    assert f["old_logps"][1].tolist() == [0, 0, 0, -3.0, -4.0, -5.0]
    assert f["ref_token_logps"][2].tolist() == [0, 0, 0, -6.5, 0, 0]
    assert f["labels"][2].tolist() == [-100, -100, -100, 13, -100, -100]
    cut = load_rollouts([record], RolloutEncoder(tok, scale_rewards="none"), seq_len=5, pad_id=0)
    assert cut.stats.truncated == 1 and cut.fields["old_logps"][1].tolist() == [0, 0, 0, -3.0, -4.0]
    assert torch.allclose(cut.fields["advantages"], (r - r.mean()).float())
    with pytest.raises(ValueError, match="'rewards' or their 'advantages'"):
        load_rollouts([{**record, "advantages": [0, 0, 0]}], RolloutEncoder(tok), 6, 0)
    with pytest.raises(ValueError, match="of its length"):
        load_rollouts([{**record, "old_logps": [[-1.0], [-3.0, -4.0, -5.0], [-6.0]]}], RolloutEncoder(tok), 6, 0)


def _pipeline_world(rank, world, cases):
    from ds_dhelix.verify import ParityOptions, train_pipeline, train_schedule

    out = {}
    for name, objective in cases.items():
        common = dict(model="tiny-llama", tp=1, seq_len=SEQ, micro_batches=4, steps=2, clip=0.0, num_layers=4)
        ref_opts = ParityOptions(**common, dp=2)  # PP=1 sequential as 2 replicas fed the same micro-batches
        pp_opts = ParityOptions(**common, pp=2)
        for opts in (ref_opts, pp_opts):
            opts.micro_batch_size, opts.extra = 2 * PAIRS, {"objective": objective}
        if objective["name"] == "grpo":
            steps = [rollout_batches(pp_opts, 4, kl=True, seed=9 + k) for k in range(2)]
        else:
            steps = [pair_batches(512, 4, seed=5 + k) for k in range(2)]
        ref = train_schedule(ref_opts, "sequential", [step + step for step in steps])
        out[name] = (ref, train_pipeline(pp_opts, "w", steps))
    return out if rank == 0 else None


@pytest.mark.timeout(600)
def test_objectives_on_the_folded_pipeline_equal_pp1_sequential():
    results = run_ranks(
        _pipeline_world, 2, args=({"dpo": {"name": "dpo"}, "grpo": {"name": "grpo", "beta": 0.04}},), timeout=580
    )
    for name, (ref, got) in results[0].items():
        assert got["losses"] == ref["losses"], (name, got["losses"], ref["losses"])
        for n, p in ref["params"].items():
            assert torch.equal(got["params"][n], p), (name, n)


def test_preference_and_unpaired_records_become_rows():
    """``preference.py``: a conversational pair rendered with ChatML, the loss on the assistant's
    answer only; KTO's unpaired records, each with the next record's completion as its KL row, the
    references and labels in place."""
    from ds_dhelix.data.preference import PairEncoder, load_pairs, load_unpaired
    from ds_dhelix.data.records import CHATML_TEMPLATE
    from hf_models.registry import load_tokenizer_for

    tok = load_tokenizer_for("tiny-llama")
    chat = {
        "prompt": [{"role": "user", "content": "hi there"}],
        "chosen": [{"role": "assistant", "content": "hello"}],
        "rejected": [{"role": "assistant", "content": "go away now"}],
    }
    pairs = load_pairs([chat], PairEncoder(tok, CHATML_TEMPLATE), seq_len=48, pad_id=0)
    ids, labels = pairs.rows(torch.tensor([0]))["input_ids"], pairs.rows(torch.tensor([0]))["labels"]
    prompt = tok.apply_chat_template(
        chat["prompt"], chat_template=CHATML_TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    for row, answer in ((0, "hello"), (1, "go away now")):
        kept = labels[row][labels[row] != -100].tolist()
        assert ids[row, : len(prompt)].tolist() == list(prompt) and (labels[row, : len(prompt)] == -100).all()
        assert tok.decode(kept).startswith(answer) and "<|im_end|>" in tok.decode(kept), tok.decode(kept)
    records = [
        {
            "prompt": f"q{k}",
            "completion": f"answer {k}",
            "label": k != 1,
            "ref_logps": -float(k),
            "ref_KL_logps": -10.0 - k,
        }
        for k in range(3)
    ]
    kto = load_unpaired(records, PairEncoder(tok), seq_len=16, pad_id=0)
    rows = kto.rows(torch.arange(3))
    decoded = [tok.decode(r[r != -100].tolist(), skip_special_tokens=True).strip() for r in rows["labels"]]
    assert decoded == ["answer 0", "answer 1", "answer 2", "answer 1", "answer 2", "answer 0"], decoded
    assert all(int(r[r != -100][-1]) == tok.eos_token_id for r in rows["labels"])  # (EOS appended, in the loss)
    assert rows["kto_label"].tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert rows["ref_logps"].tolist() == [0.0, -1.0, -2.0, -10.0, -11.0, -12.0]
