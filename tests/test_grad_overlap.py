"""The data-parallel gradient reduction driven during the last backward (``engine/grad_reduction.py``).

overlapped = after   the same DeepSpeed engine trained 2 steps with ``overlap_grad_reduction`` on
                     (SI) and off (sequential, the whole reduction after the last backward): losses
                     and every trained parameter bitwise equal on each rank (2 data-parallel ranks:
                     each sum has two terms, so other buckets cannot change it) for ZeRO 0 / 1 / 2,
                     bf16 and fp16, an MoE model with EP=2 and with EP=1, LoRA, and the last two
                     backwards paired (pair_ends) with full recompute; the first step
                     reduces at the end, the second hands every parameter of the order on before
                     its ``ReduceGrads``; after a failed step the engine refuses to go on
the order            the parameters in the order a backward finalises them, TP-replicated ones left out
the bucket default   one layer's parameters when the ds_config leaves ``reduce_bucket_size`` out
"""

from __future__ import annotations

import pytest
import torch

from ds_dhelix.runtime.spawn import run_ranks

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _opts(model: str, layout: dict):
    from ds_dhelix.verify import ParityOptions

    layout = dict(layout)
    ep, extra = layout.pop("ep", 0), layout.pop("extra", {})
    opts = ParityOptions(model=model, steps=2, seq_len=16, num_layers=2, micro_batches=2, **layout)
    opts.extra = {**extra, **({"expert_parallel": {"size": ep, "capacity_factor": None}} if ep else {})}
    return opts


def _run(opts, schedule: str, overlap: bool):
    import ds_dhelix
    from ds_dhelix.verify import build, make_batches

    cfg = opts.ds_config(schedule)
    cfg["dhelix"]["overlap_grad_reduction"] = overlap
    if schedule == "sequential":
        cfg["dhelix"].pop("pair_ends", None)  # (an SI setting)
    engine, *_ = ds_dhelix.initialize(model=build(opts), config=cfg)
    assert engine.overlaps_grad_reduction == overlap
    losses, firsts = [], []
    for step in make_batches(opts, 2048)[: opts.steps]:
        losses.append(float(engine.train_batch(iter(step))))
        firsts.append(engine._overlap.handed_early if overlap else None)
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    stats = engine.last_stats
    early = (firsts[0], engine._overlap.handed_early, len(engine._overlap.order)) if overlap else None
    bucket = engine.zero_reduce_bucket_size()
    if overlap:  # a step that failed mid-reduction: the engine refuses to go on
        engine._overlap.abort()
        try:
            engine.train_batch(iter(make_batches(opts, 2048)[0]))
            raise AssertionError("a step ran after a failed reduction")
        except RuntimeError as err:
            assert "resume from the last checkpoint" in str(err)
    engine.destroy()
    return losses, params, early, (stats.dp_reduce_s, stats.dp_exposed_s), bucket


def _world(rank, world, cases):
    from ds_dhelix.engine.precision import force_fp16_capability

    force_fp16_capability()  # the fp16 cases on a CPU without DeepSpeed's fp16 support (torch runs it)
    out = {}
    for name, (model, layout) in cases.items():
        opts = _opts(model, layout)
        after = _run(opts, "sequential", overlap=False)
        overlapped = _run(opts, "si", overlap=True)
        out[name] = (after, overlapped)
    return out


CASES = {
    "zero0": ("tiny-llama", {"tp": 1, "dp": 2, "zero_stage": 0}),
    "zero1-bf16": ("tiny-llama", {"tp": 1, "dp": 2, "zero_stage": 1, "dtype": "bf16"}),
    "zero2": ("tiny-llama", {"tp": 1, "dp": 2, "zero_stage": 2}),
    "zero1-pair-ends-recompute": (  # the last two backwards paired; layers recomputed in the backward
        "tiny-llama",
        {"tp": 1, "dp": 2, "zero_stage": 1, "extra": {"pair_ends": True, "recompute": "full"}},
    ),
    "zero0-fp16": ("tiny-llama", {"tp": 1, "dp": 2, "zero_stage": 0, "dtype": "fp16"}),
    "zero1-fp16": ("tiny-llama", {"tp": 1, "dp": 2, "zero_stage": 1, "dtype": "fp16"}),
    "moe-ep2-zero1": ("tiny-qwen3-moe", {"tp": 1, "dp": 2, "ep": 2}),
    "moe-ep1-zero0": ("tiny-qwen3-moe", {"tp": 1, "dp": 2, "ep": 1, "zero_stage": 0}),
    "lora-zero2": ("tiny-llama", {"tp": 1, "dp": 2, "zero_stage": 2, "lora": LORA}),
}


@pytest.mark.timeout(600)
def test_overlapped_reduction_equals_the_reduction_after_the_backward():
    results = run_ranks(_world, 2, args=(CASES,), timeout=580)
    for rank, out in enumerate(results):
        for name, (after, overlapped) in out.items():
            losses, params, _, (reduce_s, exposed_s), bucket = after
            o_losses, o_params, (first, early, order), (o_reduce_s, o_exposed_s), o_bucket = overlapped
            where = f"{name}, rank {rank}"
            assert losses == o_losses, (where, losses, o_losses)
            assert params.keys() == o_params.keys()
            for n in params:
                assert torch.equal(params[n], o_params[n]), (where, n, (params[n] - o_params[n]).abs().max())
            assert first == 0, where  # the first step knows no order yet: all reduced at the end
            assert order > 0 and early == order, (where, early, order)  # then all handed on during the backward
            assert reduce_s == exposed_s > 0, where  # after the backward: all of it waited for
            assert 0 < o_exposed_s and o_reduce_s > 0, where
            assert o_bucket < bucket == 5e8, where  # overlapped: one layer's parameters (the ds_config leaves it out)


def test_order_is_the_backward_finalising_order_without_replicated_weights():
    from types import SimpleNamespace

    from ds_dhelix.engine.grad_reduction import reduction_order

    emb, w1, w2, norm, head = (torch.nn.Parameter(torch.zeros(2)) for _ in range(5))
    norm.tp_replicated = True
    ops = {(0, 0): (emb,), (1, 0): (w1, norm), (1, 1): (w2,), (2, 0): (head, emb)}  # emb tied to the head
    executor = SimpleNamespace(
        graph=SimpleNamespace(blocks=[[None], [None, None], [None]]), op_params=lambda key: ops.get(key, ())
    )
    order = reduction_order(executor, [emb, w1, w2, norm, head])
    assert [id(p) for p in order] == [id(head), id(w2), id(w1), id(emb)]


def test_bucket_default_is_one_layer_unless_the_config_sets_it():
    from ds_dhelix.config.dims import ParallelDims
    from ds_dhelix.config.ds_settings import DeepSpeedSettings
    from ds_dhelix.config.section import DhelixConfig
    from ds_dhelix.engine.build import Setup, deepspeed_view, default_reduce_bucket

    def view(cfg, dh):
        setup = Setup(dh, DeepSpeedSettings.from_ds_config(cfg), ParallelDims(1), None, None)
        return setup, deepspeed_view(cfg, setup, model, 4)

    model = torch.nn.Linear(10, 10)  # 110 trained elements
    cfg = {"zero_optimization": {"stage": 1}}
    setup, written = view(cfg, DhelixConfig(enabled=True))
    assert default_reduce_bucket(setup, model, 4) == 28 and written["zero_optimization"]["reduce_bucket_size"] == 28
    assert cfg == {"zero_optimization": {"stage": 1}}  # the caller's dict is left as it was
    cfg = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}}
    setup, written = view(cfg, DhelixConfig(enabled=True))
    assert default_reduce_bucket(setup, model, 4) is None and written["zero_optimization"]["reduce_bucket_size"] == 1000
    setup, written = view({}, DhelixConfig(enabled=True, overlap_grad_reduction=False))
    assert written == {}


def test_the_summary_reports_the_reduction_and_what_waited():
    from ds_dhelix.runtime.stats import StepStats
    from ds_dhelix.training.summary import _schedule_figures

    steps = [StepStats(dp_reduce_s=0.5, dp_exposed_s=0.4), StepStats(dp_reduce_s=0.2, dp_exposed_s=0.05)]
    figures, line = _schedule_figures(steps, "si")  # (the first step left out)
    assert figures["dp_reduce_ms_per_step"] == pytest.approx(200) and figures[
        "dp_exposed_ms_per_step"
    ] == pytest.approx(50)
    assert (
        line
        == "; schedule si: no collective inside the step's ops; data-parallel reduction 200 ms/step, 50 ms after the backward"
    )
    steps = [StepStats(comm_s=1.0, exposed_s=0.25, dp_reduce_s=0.2, dp_exposed_s=0.05)]
    assert _schedule_figures(steps, "si")[1].endswith(
        "(250 ms exposed); data-parallel reduction 200 ms/step, 50 ms after the backward"
    )
    assert "data-parallel" not in _schedule_figures([StepStats(comm_s=1.0, exposed_s=0.25)], "si")[1]
