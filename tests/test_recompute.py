"""Activation recompute (``dhelix.recompute``) through the DeepSpeed engine on gloo ranks.

    selective / full: losses and parameters after every step bitwise equal to none, under SI and
    sequential (tiny-llama TP=2, tiny-gpt2 TP=2 with dropout 0.1, tiny-phimoe EP=2) and the folded
    pipeline (PP=2, W and DualPipeV+SI); each mode's peak activation bytes printed, and smaller
    than none's; SI's peak within 3% of sequential's with none and selective
    full on tiny-llama at seq 256: SI peak at most half of none's
    the recomputed forward runs on the backward strand's channel, once per layer, whatever the
    plan's rounds
    DeepSpeed's activation_checkpointing asking for anything: refused naming dhelix.recompute; an
    all-off section is accepted

Recomputed values are the same ops on the same inputs (dropout masks seeded by micro-batch, layer
and op), so every comparison here is exact. Fused runs (``dhelix.fuse_ops``, the default) cut a
layer where selective recompute keeps its ops apart; where that moves an op boundary (the PP=2 case,
TP=1) selective agrees with none to rounding only, so that case runs unfused.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ds_dhelix.verify import ParityOptions
from tests.conftest import run_ranks

MODES = ("none", "selective", "full")


def _train_modes(rank, world, opts: ParityOptions, schedules, modes=MODES):
    from ds_dhelix.verify import make_batches, train_pipeline, train_schedule
    from hf_models.registry import load_config

    batches = make_batches(opts, load_config(opts.model).vocab_size)
    out = {}
    for schedule in schedules:
        for mode in modes:
            leg = replace(opts, recompute=mode)
            out[schedule, mode] = (
                train_pipeline(leg, schedule, batches) if opts.pp > 1 else train_schedule(leg, schedule, batches)
            )
    return out if rank == 0 else None


CASES = {
    "llama-tp2": (ParityOptions(model="tiny-llama", tp=2, num_layers=2, seq_len=32, steps=2), ("sequential", "si")),
    "gpt2-tp2-dropout": (
        ParityOptions(model="tiny-gpt2", tp=2, num_layers=2, seq_len=32, steps=2, dropout=0.1),
        ("sequential", "si"),
    ),
    "phimoe-ep2": (
        ParityOptions(
            model="tiny-phimoe", tp=1, dp=2, num_layers=2, seq_len=32, steps=2, extra={"expert_parallel": {"size": 2}}
        ),
        ("sequential", "si"),
    ),
    # unfused: at TP = 1 "none" runs a whole layer as one fused op where "selective" runs its
    # selective ops apart (``graph/fuse.py``), and other op boundaries may round otherwise
    "pp2": (
        ParityOptions(model="tiny-llama", tp=1, pp=2, seq_len=32, steps=2, extra={"fuse_ops": False}),
        ("w", "dualpipev"),
    ),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_recompute_is_bitwise_none(case):
    opts, schedules = CASES[case]
    out = run_ranks(_train_modes, opts.world, args=(opts, schedules), timeout=580)[0]
    for schedule in schedules:
        ref = out[schedule, "none"]
        peaks = {mode: out[schedule, mode]["peak_activation_bytes"] for mode in MODES}
        print(f"{case} {schedule} peak activation bytes: {peaks}")
        for mode in ("selective", "full"):
            got = out[schedule, mode]
            assert got["losses"] == ref["losses"], (schedule, mode, got["losses"], ref["losses"])
            differ = [k for k in ref["params"] if not torch.equal(got["params"][k], ref["params"][k])]
            assert not differ, (schedule, mode, differ[:5])
            assert peaks[mode] < peaks["none"], (schedule, peaks)
        assert peaks["full"] < peaks["selective"], (schedule, peaks)
    if {"sequential", "si"} <= set(schedules):  # the second strand costs at most 3%, recompute or not
        for mode in ("none", "selective"):
            seq, si = (out[s, mode]["peak_activation_bytes"] for s in ("sequential", "si"))
            assert si <= 1.03 * seq, (mode, si / seq)


@pytest.mark.timeout(300)
def test_full_recompute_halves_the_peak_at_seq_256():
    opts = ParityOptions(model="tiny-llama", tp=2, seq_len=256, steps=1, micro_batches=2)
    out = run_ranks(_train_modes, opts.world, args=(opts, ("si",), ("none", "full")), timeout=280)[0]
    none, full = (out["si", m]["peak_activation_bytes"] for m in ("none", "full"))
    print(f"tiny-llama TP=2 seq 256 SI peak activation bytes: none {none}, full {full} ({full / none:.3f}x)")
    assert full <= 0.5 * none, (none, full)


def test_recomputed_forward_runs_once_on_the_backward_strand():
    from ds_dhelix.runtime.executor import Executor, MicroBatch
    from hf_models.adapters import adapter_for
    from tests.conftest import make_batches, make_config, make_model

    config = make_config("tiny-llama")
    model = make_model(config)
    graph = adapter_for(config).build_graph(model)
    ex = Executor(graph, recompute="full")
    mb = MicroBatch(0, graph.make_side(make_batches(config.vocab_size, 1)[0], 0))
    ops = graph.blocks[1]
    assert ex.tasks(mb, 1, True, 0, 0) == []  # a plan round with no backward ops of the layer yet
    tasks = ex.tasks(mb, 1, True, 0, 2)
    again = [t for t in tasks if t.recompute]
    assert [t.op.name for t in again] == [op.name for op in ops] and tasks[: len(ops)] == again
    assert {(t.strand, t.channel) for t in again} == {("B", 1)}
    assert not any(t.recompute for t in ex.tasks(mb, 1, True, 2, None))  # later rounds: backward only
    assert {t.channel for t in ex.tasks(mb, 1, True, swapped=True) if t.recompute} == {0}
    assert not any(t.recompute for t in ex.tasks(mb, 0, True) + ex.tasks(mb, len(graph.blocks) - 1, True))


def test_activation_checkpointing_section():
    from ds_dhelix.engine.build import check_setup
    from hf_models.registry import load_config

    opts = ParityOptions(tp=1)
    config = opts.ds_config("si")
    check_setup(
        {**config, "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False}},
        load_config("tiny-llama"),
        1,
    )
    with pytest.raises(ValueError, match=r"sets partition_activations .*dhelix.*recompute"):
        check_setup(
            {**config, "activation_checkpointing": {"partition_activations": True}}, load_config("tiny-llama"), 1
        )
