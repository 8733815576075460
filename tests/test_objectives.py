"""Preference objectives on the op graph's head (``ds_dhelix/graph/objectives.py``, ``dhelix.objective``).

first step = direct     the sharded model's first-step loss and every full gradient (TP=2 dense
                        through the vocabulary-parallel head, EP=2 MoE through the plain head,
                        TP=2 with ``head_chunk``) equal a direct computation with the unsharded
                        transformers model and the formulas written out here (TRL's definitions),
                        within 1e-5: dpo (with label smoothing too), ipo, simpo, orpo; LoRA without
                        reference columns (the engine's pass with the adapter off = PEFT's
                        ``disable_adapter``)
SI = sequential         two engine steps of DPO, losses and trained parameters bitwise equal (TP=2,
                        EP=2)
learning                DPO steps on pairs whose chosen completion follows a pattern raise
                        rewards/accuracies well above 0.5
refusals                the config's one-line errors
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_dhelix.graph.objectives import METRICS
from ds_dhelix.runtime.spawn import run_ranks

PAIRS, SEQ = 2, 16


def pair_batches(vocab: int, num: int, pairs: int = PAIRS, seq: int = SEQ, seed: int = 5, ref: bool = True):
    """``num`` micro-batches of ``pairs`` preference pairs: rows [chosen x pairs; rejected x pairs],
    a shared prompt of 3-5 tokens (labels -100), completions of random lengths, right padding
    (labels -100); ``ref``: a ``ref_logps`` column (as TRL precomputes it)."""
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
        ref = b.get("ref_logps")
        if ref is None and objective["name"] in ("dpo", "ipo"):
            with torch.no_grad(), model.disable_adapter():
                ref = row_sums(model, b)[0]
        sums, counts = row_sums(model, b)
        loss = direct_loss(objective["name"], sums, counts, ref, beta, objective.get("label_smoothing", 0.0)) / len(
            step
        )
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
        steps = [pair_batches(512, opts.dp * opts.micro_batches, ref=ref)]
        ours = first_step(opts, steps)
        direct = direct_first_step(opts, steps[0], objective) if rank == 0 else None
        out[name] = (ours, direct)
    return out


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
        steps = [pair_batches(512, opts.dp * opts.micro_batches, ref=ref, seed=5 + k) for k in range(2)]
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
            assert metrics == si_metrics and set(metrics[0]) == set(METRICS), (name, metrics, si_metrics)
            m = metrics[0]
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
    summary, proc = run_train(tmp_path, steps=30, extra=("--data", data, "--objective", "dpo", "--lora"))
    objective = summary["objective"]
    assert objective["name"] == "dpo" and len(objective["steps"]) == 30
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
