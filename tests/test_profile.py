"""Overlap profiling through the real executor, and the planner attached to ds_dhelix.initialize."""

import json

import pytest

from ds_dhelix.bench.profile_runs import plan_orders, profile_world, spearman, summarize_validation, validate_world
from ds_dhelix.planning.planner import OverlapTable, plan_dp

OPTS = {
    "model": "tiny-llama",
    "tp": 2,
    "micro_batch_size": 1,
    "seq_len": 16,
    "warmup": 0,
    "repeats": 1,
    "link_gbps": None,
}


@pytest.fixture(scope="module")
def table():
    t, seconds = profile_world(OPTS, timeout=240)
    return t


def test_profile_covers_every_candidate(table):
    from ds_dhelix.planning.planner import candidate_segments

    fc, bc = candidate_segments(table.fwd_ops), candidate_segments(table.bwd_ops)
    assert set(table.fwd_alone_ms) == set(fc) and set(table.bwd_alone_ms) == set(bc)
    comm_f = {s for s in fc if table.fwd_ops[s[0]].is_comm}
    comm_b = {s for s in bc if table.bwd_ops[s[0]].is_comm}
    assert len(table.pair_ms) == len(fc) * len(bc) - len(comm_f) * len(comm_b)
    assert all(ms > 0 for ms in table.pair_ms.values())
    plan = plan_dp(table)
    assert plan.predicted_ms > 0 and not plan.comm_conflicts()
    # the embedding and head blocks are timed op by op too (dhelix predict --hardware cpu reads them)
    # (TP=2: the vocabulary split over TP, its collectives in the blocks); the ops as the engine
    # runs them: fused between two collectives (dhelix profile --unfused: one by one)
    assert table.fused and table.meta["op_graph"].endswith("+fused")
    assert "attn.qkv+attn.core+attn.out" in [op.name for op in table.fwd_ops]
    assert table.block_ops["pre"]["ops"] == ["embed", "embed.rs"]
    assert table.block_ops["post"]["ops"] == [
        "head.norm",
        "head.ag",
        "head.logits+head.lse",
        "head.lse_a2a",
        "head.loss",
    ]
    assert all(ms > 0 for b in table.block_ops.values() for ms in b["fwd_ms"] + b["bwd_ms"])
    # and each collective's CPU time beside the main thread (None for compute ops)
    for direction, ops in (("fwd", table.fwd_ops), ("bwd", table.bwd_ops)):
        assert [ms is not None for ms in table.comm_cpu_ms[direction]] == [op.is_comm for op in ops]


def test_table_round_trip_and_refusal(table, tmp_path):
    path = tmp_path / "t.json"
    table.save(str(path))
    again = OverlapTable.load(str(path))
    assert again.pair_ms == table.pair_ms and again.meta == table.meta and again.block_ops == table.block_ops
    assert again.comm_cpu_ms == table.comm_cpu_ms
    other = dict(table.meta, batch_shape=[8, 512])
    with pytest.raises(ValueError, match="batch_shape"):
        again.check_matches(other)


def test_validate_reports_prediction_quality(table):
    from ds_dhelix.planning.plan import default_plan, sequential_plan
    from ds_dhelix.planning.planner import predict_ms

    res = validate_world(
        {
            "model": "tiny-llama",
            "tp": 2,
            "table": table.to_dict(),
            "alternatives": 2,
            "warmup": 0,
            "repeats": 1,
            "seed": 0,
        },
        timeout=240,
    )
    rows = {r["plan"]: r for r in res["rows"]}
    assert set(rows) == {"dp", "default", "sequential", "random0", "random1"}
    # each row's prediction is the table's for that plan; measured times are real and positive
    fixed = {
        "dp": plan_dp(table),
        "default": default_plan(table.fwd_ops, table.bwd_ops),
        "sequential": sequential_plan(table.fwd_ops, table.bwd_ops),
    }
    for name, plan in fixed.items():
        assert rows[name]["predicted_ms"] == pytest.approx(predict_ms(table, plan))
        assert rows[name]["rounds"] == len(plan.rounds)
        assert rows[name]["same_as_dp"] == (plan.rounds == fixed["dp"].rounds)
    for r in rows.values():
        assert r["measured_ms"] > 0
        assert r["error_pct"] == pytest.approx(100 * (r["predicted_ms"] / r["measured_ms"] - 1))
    ranked = sorted(rows.values(), key=lambda r: r["measured_ms"])
    assert res["best_measured_plan"] == ranked[0]["plan"] and res["best_measured_ms"] == ranked[0]["measured_ms"]
    assert res["dp_rank"] == 1 + [r["plan"] for r in ranked].index("dp")
    assert res["dp_measured_ms"] == rows["dp"]["measured_ms"]
    others = [r for r in ranked if not r["same_as_dp"]]
    if others:
        assert res["best_other_plan"] == others[0]["plan"]
        assert res["dp_vs_best_other_pct"] == pytest.approx(
            100 * (rows["dp"]["measured_ms"] / others[0]["measured_ms"] - 1)
        )
    else:
        assert res["best_other_plan"] is None and res["dp_vs_best_other_pct"] is None
    if rows["default"]["same_as_dp"]:  # one plan timed twice: how far apart the machine puts it
        assert res["same_plan_gap_pct"] == pytest.approx(
            100 * abs(rows["dp"]["measured_ms"] / rows["default"]["measured_ms"] - 1)
        )
    else:
        assert res["same_plan_gap_pct"] is None
    assert res["spearman"] == pytest.approx(
        spearman([r["predicted_ms"] for r in res["rows"]], [r["measured_ms"] for r in res["rows"]])
    )
    json.dumps(res)


def _row(plan, source, same_as_dp, predicted, measured):
    return {
        "plan": plan,
        "source": source,
        "same_as_dp": same_as_dp,
        "predicted_ms": predicted,
        "predicted_spread_ms": 1.0,
        "measured_ms": measured,
        "measured_spread_ms": 1.0,
    }


def test_validation_summary_tells_one_plan_timed_twice_from_another_plan():
    # the DP search found the default plan (source "dp", same rounds): its two timings give the gap
    rows = [
        _row("dp", "dp", True, 24.0, 25.3),
        _row("default", "default", True, 24.0, 24.6),
        _row("sequential", "sequential", False, 31.0, 30.0),
        _row("random0", "random", False, 29.0, 27.5),
        _row("random1", "random", True, 24.0, 26.0),
    ]  # a random draw equal to the DP plan
    res = summarize_validation(rows)
    assert res["best_measured_plan"] == "default" and res["dp_rank"] == 2
    assert res["dp_vs_best_pct"] == pytest.approx(100 * (25.3 / 24.6 - 1))
    assert res["same_plan_gap_pct"] == pytest.approx(100 * (25.3 / 24.6 - 1))
    assert res["best_other_plan"] == "random0"  # random1 has the DP plan's rounds: not "other"
    assert res["dp_vs_best_other_pct"] == pytest.approx(100 * (25.3 / 27.5 - 1))
    # a DP plan of its own: no same-plan gap; every plan the DP plan's: no other plan
    rows = [_row("dp", "dp", True, 22.0, 23.0), _row("default", "default", False, 24.0, 24.0)]
    res = summarize_validation(rows)
    assert res["same_plan_gap_pct"] is None and res["best_other_plan"] == "default"
    assert res["dp_vs_best_other_pct"] == pytest.approx(100 * (23.0 / 24.0 - 1))
    res = summarize_validation(
        [_row("dp", "default-within-noise", True, 24.0, 25.0), _row("default", "default", True, 24.0, 24.0)]
    )
    assert res["best_other_plan"] is None and res["dp_vs_best_other_pct"] is None
    assert res["same_plan_gap_pct"] == pytest.approx(100 * (25.0 / 24.0 - 1))


def test_plan_orders_are_shuffled_the_same_on_every_rank():
    names = ["dp", "default", "sequential"] + [f"random{k}" for k in range(8)]
    orders = plan_orders(names, 60, seed=0)
    assert orders == plan_orders(list(names), 60, seed=0)  # a pure function of names and seed
    assert orders != plan_orders(names, 60, seed=1)
    assert all(sorted(o) == sorted(names) for o in orders) and len(orders) == 60
    # no fixed predecessor: the default plan follows many different plans (rotation gave it one)
    before_default = {o[o.index("default") - 1] for o in orders if o.index("default") > 0}
    assert len(before_default) >= 5, before_default


def test_spearman():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def _engine_with_table(rank, world, path, meta_override):
    import torch

    import ds_dhelix
    from ds_dhelix.bench.profile_runs import example_batch
    from hf_models.registry import build_model

    model, _ = build_model("tiny-llama", seed=0)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "dhelix": {
            "enabled": True,
            "tensor_parallel": {"size": 2},
            "si_execution": "plan",
            "planner": {"profile": path},
        },
    }
    batch = example_batch(model.config.vocab_size, 1, 16)
    if meta_override:
        batch = example_batch(model.config.vocab_size, 1, 32)  # another shape than the table's
    try:
        engine, *_ = ds_dhelix.initialize(model=model, config=cfg, example_batch=batch)
    except ValueError as err:
        return f"ValueError: {err}"
    loss = engine.train_batch(iter([batch, batch]))
    return engine.executor.plan.source, float(loss), bool(torch.isfinite(loss))


def test_engine_uses_table_and_refuses_mismatch(table, tmp_path):
    from ds_dhelix.runtime.spawn import run_ranks

    path = str(tmp_path / "t.json")
    table.save(path)
    ok = run_ranks(_engine_with_table, 2, args=(path, False), timeout=180)
    # the DP plan confirmed by measurement against the default, or the default (measured slower,
    # or the DP plan's gain within the table's noise: planner.plan_dp)
    assert ok[0][0] in ("dp", "default", "default-within-noise") and ok[0][2]
    bad = run_ranks(_engine_with_table, 2, args=(path, True), timeout=180)
    assert bad[0].startswith("ValueError") and "batch_shape" in bad[0], bad[0]


def test_profile_moe_layer_with_expert_parallelism():
    opts = dict(OPTS, model="tiny-phimoe", tp=1, ep=2)
    t, _ = profile_world(opts, timeout=240)
    names = [op.name for op in t.fwd_ops]
    assert "moe.dispatch" in names and "moe.combine" in names
    assert t.meta["layout"] == "world=2,tp=1,ep=2"
    plan = plan_dp(t)
    assert plan.predicted_ms > 0 and not plan.comm_conflicts()


def _clock_rank(rank, world):
    import time

    from ds_dhelix.runtime.profiler import StreamClock

    clock = StreamClock("cpu")
    t0 = clock.start()
    time.sleep(0.01)
    waited = clock.stop(t0)
    return waited, clock.reduce_max([float(rank), 10.0 - rank])


def test_stream_clock_times_and_reduces_on_its_device():
    """The planner's timer and its world reduction, one interface (``StreamClock``): on CPU the
    host clock and a reduction on a CPU tensor; on CUDA, events and a CUDA tensor (the same calls;
    ``scripts/gpu_checks.py`` runs that branch when a GPU is lent)."""
    from ds_dhelix.runtime.spawn import run_ranks

    results = run_ranks(_clock_rank, world=2, timeout=120)
    for waited, reduced in results:
        assert waited >= 0.01
        assert reduced == [1.0, 10.0]  # each value's max over the two ranks


def test_layer_probe_clock_follows_the_batch_device():
    import torch

    from ds_dhelix.runtime.profiler import LayerProbe
    from hf_models.adapters import adapter_for
    from hf_models.registry import build_model

    model, _ = build_model("tiny-llama", seed=0, num_layers=2)
    graph = adapter_for(model.config).build_graph(model)
    batch = {"input_ids": torch.randint(0, 100, (1, 8)), "labels": torch.randint(0, 100, (1, 8))}
    probe = LayerProbe(graph, batch)
    assert probe.clock.device == batch["input_ids"].device and not probe.clock.cuda
    assert probe.time_round((0, 1), (0, 1)) > 0
