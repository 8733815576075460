"""LoRA with ``lora_dropout`` > 0 (``hf_models.lora.use_dropout``): masks drawn from ``dhelix.seed``
by micro-batch, replica and module, never by schedule or TP rank.

SI = sequential    two engine steps with lora_dropout 0.1 (TP=2, ZeRO-2, full recompute; EP=2 MoE
                   attention): losses and adapter parameters bitwise equal, and different from the
                   same run without dropout (the masks are drawn)
= PEFT             the sharded first step at TP=2 (column- and row-parallel targets) equals PEFT's
                   own LoRA dropout given the same masks (its dropout modules replaced by the
                   engine's draw): loss and adapter gradients within 1e-5
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_dhelix.runtime.spawn import run_ranks

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}
ATTN = {**LORA, "target_modules": ["q_proj", "v_proj", "o_proj"]}


def _opts(model: str, layout: dict, lora: dict):
    from ds_dhelix.verify import ParityOptions

    layout = dict(layout)
    ep, extra = layout.pop("ep", 0), layout.pop("extra", {})
    opts = ParityOptions(model=model, steps=2, seq_len=16, num_layers=2, micro_batches=2, lora=lora, **layout)
    opts.extra = {**extra, **({"expert_parallel": {"size": ep, "capacity_factor": None}} if ep else {})}
    return opts


def _train(opts, schedule: str):
    import ds_dhelix
    from ds_dhelix.verify import build, make_batches
    from ds_dhelix.verify.options import my_share

    engine, *_ = ds_dhelix.initialize(model=build(opts), config=opts.ds_config(schedule))
    losses = []
    for step in make_batches(opts, 512):
        losses.append(float(engine.train_batch(iter(my_share(opts, step, engine.groups.dp_rank)))))
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    engine.destroy()
    return losses, params


def _bitwise_world(rank, world, cases):
    out = {}
    for name, (model, layout, lora) in cases.items():
        opts = _opts(model, layout, lora)
        out[name] = (
            _train(opts, "sequential"),
            _train(opts, "si"),
            _train(_opts(model, layout, {**lora, "lora_dropout": 0.0}), "si"),
        )
    return out


CASES = {
    "tp2-zero2-recompute": ("tiny-llama", {"tp": 2, "zero_stage": 2, "extra": {"recompute": "full"}}, LORA),
    "ep2-moe-attention": ("tiny-qwen3-moe", {"tp": 1, "dp": 2, "ep": 2}, ATTN),
}


@pytest.mark.timeout(600)
def test_lora_dropout_si_equals_sequential():
    results = run_ranks(_bitwise_world, 2, args=(CASES,), timeout=580)
    for rank, out in enumerate(results):
        for name, ((losses, params), (si_losses, si_params), (plain, _)) in out.items():
            assert losses == si_losses, (name, rank, losses, si_losses)
            for n in params:
                assert torch.equal(params[n], si_params[n]), (name, rank, n)
            assert losses[0] != plain[0], (name, losses, plain)  # the masks were drawn


class SameMasks(nn.Module):
    """PEFT's lora_dropout replaced by the engine's draw for module ``key`` (micro-batch ``state[0]``)."""

    def __init__(self, p: float, key: str, full_in: int, seed: int, state: list):
        super().__init__()
        self.p, self.key, self.full_in, self.seed, self.state = p, key, full_in, seed, state

    def forward(self, x):  # x [b, s, in]; the engine draws over [s, b, in]
        from ds_dhelix.graph.draws import draw_seed, seeded_rng

        with seeded_rng(x.device, draw_seed(self.seed, self.state[0], 0, 0, self.key)):
            keep = torch.empty((x.shape[1], x.shape[0], self.full_in), dtype=x.dtype).bernoulli_(1 - self.p)
        return x * keep.transpose(0, 1) / (1 - self.p)


def _peft_world(rank, world, opts):
    from ds_dhelix.verify.batches import make_batches
    from ds_dhelix.verify.legs import first_step
    from ds_dhelix.verify.options import build
    from hf_models.lora import our_name

    steps = make_batches(opts, 512)
    ours = first_step(opts, steps)
    if rank:
        return ours, None
    model, state = build(opts, stochastic=False), [0]
    for path, module in model.named_modules():
        if hasattr(module, "lora_dropout") and hasattr(module, "base_layer"):
            key = "lora:" + path.removeprefix("base_model.model.")
            full_in = module.lora_A["default"].weight.shape[1]
            module.lora_dropout["default"] = SameMasks(opts.lora["lora_dropout"], key, full_in, opts.seed, state)
    model.train()
    total = 0.0
    for serial, b in enumerate(steps[0]):
        state[0] = serial
        loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss / len(steps[0])
        loss.backward()
        total += loss.item()
    grads = {our_name(n): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return ours, (total, grads)


@pytest.mark.timeout(600)
def test_lora_dropout_equals_peft_with_the_same_masks():
    opts = _opts("tiny-llama", {"tp": 2}, LORA)
    (ours, (loss, grads)), _ = run_ranks(_peft_world, 2, args=(opts,), timeout=580)
    assert abs(ours["loss"] - loss) < 1e-5, (ours["loss"], loss)
    for n, g in grads.items():
        assert (ours["grads"][n] - g).abs().max() < 1e-5, n  # fp32; TP sums in another order
