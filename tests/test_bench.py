"""dhelix bench: the metrics are computed as documented, and a tiny run of every mode produces
complete rows and output files. Speed is never asserted here (it belongs in benchmark output)."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from ds_dhelix.bench.metrics import comm_comp_ratio, ideal_speedup, summarize_link
from ds_dhelix.bench.options import DEFAULT_MODES, BenchOptions, quick
from ds_dhelix.bench.report import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ pure: formulas and options
def test_ideal_speedup_formula():
    assert ideal_speedup(3.0, 1.0) == pytest.approx(4.0 / 3.0)
    assert ideal_speedup(1.0, 1.0) == pytest.approx(2.0)
    assert ideal_speedup(0.5, 2.0) == pytest.approx(1.25)
    assert ideal_speedup(0.0, 0.0) == 1.0


def _steps(step_times, comp=None, comm=None, exposed=None):
    out = []
    for t in step_times:
        s = {"step_s": t, "peak_activation_bytes": 100}
        if comp is not None:
            s.update(compute_s=comp, comm_s=comm, exposed_s=exposed)
        out.append(s)
    return out


def test_rows_from_medians():
    opts = BenchOptions(
        modes=("deepspeed", "sequential", "si"), link_gbps=(2.0,), micro_batches=4, micro_batch_size=2, seq_len=64
    )
    result = {
        "shaped": True,
        "modes": {
            "deepspeed": {"status": "ok", "steps": _steps([0.5, 0.4, 9.0])},
            "sequential": {"status": "ok", "steps": _steps([1.0, 1.2, 1.1, 50.0], 0.6, 0.4, 0.4)},
            "si": {"status": "ok", "steps": _steps([0.8, 0.7, 0.75], 0.62, 0.5, 0.1)},
        },
    }
    rows = {r["mode"]: r for r in summarize_link(opts, 2.0, result)}
    seq_med = statistics.median([1.0, 1.2, 1.1, 50.0])
    assert rows["sequential"]["step_time_s"] == pytest.approx(seq_med)
    assert rows["si"]["speedup_vs_sequential"] == pytest.approx(seq_med / 0.75)
    assert rows["deepspeed"]["speedup_vs_sequential"] == pytest.approx(seq_med / 0.5)
    assert rows["si"]["ideal_speedup"] == pytest.approx((0.6 + 0.4) / 0.6)  # sequential comp/comm
    assert rows["si"]["achieved_over_ideal"] == pytest.approx(seq_med / 0.75 / (1.0 / 0.6))
    assert rows["si"]["hidden_of_hideable"] == pytest.approx((0.4 - 0.1) / 0.4)  # hidden / hideable
    assert rows["sequential"]["hidden_of_hideable"] == pytest.approx(0.0)
    assert rows["deepspeed"]["hidden_of_hideable"] is None and rows["deepspeed"]["mfu"] is None
    assert rows["si"]["tokens_per_s"] == pytest.approx(opts.tokens_per_step / 0.75)
    assert rows["si"]["cpu_bound_speedup"] is None  # no device / cores in this result
    assert rows["si"]["cpu_bound_over_ideal"] is None
    assert comm_comp_ratio(list(rows.values()))["value"] == pytest.approx(0.4 / 0.6)


def test_cpu_bound_on_cpu_devices():
    opts = BenchOptions(modes=("sequential", "si"), link_gbps=(2.0,), seq_len=64)  # world 2

    def steps(t, cpu, main):
        return [dict(s, cpu_s=cpu, main_thread_cpu_s=main) for s in _steps([t], 0.6, 0.4, 0.1)]

    result = {
        "shaped": True,
        "device": "cpu",
        "cpu_cores": 2,
        "modes": {
            "sequential": {"status": "ok", "steps": steps(1.2, 0.9, 0.7)},
            "si": {"status": "ok", "steps": steps(0.9, 0.8, 0.6)},
        },
    }
    rows = {r["mode"]: r for r in summarize_link(opts, 2.0, result)}
    assert rows["si"]["cpu_bound_speedup"] == pytest.approx(1.2 / 0.8)  # 2 ranks x 0.8 s on 2 cores
    ideal = (0.6 + 0.4) / 0.6
    assert rows["si"]["cpu_bound_over_ideal"] == pytest.approx(1.2 / 0.8 / ideal)
    assert rows["sequential"]["cpu_bound_over_ideal"] is None  # no achieved/ideal for the reference
    table = markdown_table({"results": list(rows.values())})
    assert f"si at 2 Gbit/s {1.2 / 0.8 / ideal:.2f}" in table
    assert rows["si"]["other_threads_cpu_s"] == pytest.approx(0.2)
    one_core = dict(result, cpu_cores=1)
    rows = {r["mode"]: r for r in summarize_link(opts, 2.0, one_core)}
    assert rows["si"]["cpu_bound_speedup"] == pytest.approx(1.2 / 1.6)
    cuda = dict(result, device="cuda")  # host CPU time says nothing about a GPU's compute
    assert all(r["cpu_bound_speedup"] is None for r in summarize_link(opts, 2.0, cuda))


def test_rows_carry_spread_and_flag_fewer_than_five_repeats():
    opts = BenchOptions(modes=("sequential", "si"), link_gbps=(2.0,), seq_len=64)
    result = {
        "shaped": True,
        "modes": {
            "sequential": {"status": "ok", "steps": _steps([1.0, 1.3, 1.1, 0.9, 1.2], 0.6, 0.4, 0.4)},
            "si": {"status": "ok", "steps": _steps([0.8, 0.7, 0.75], 0.62, 0.5, 0.1)},
        },
    }
    rows = {r["mode"]: r for r in summarize_link(opts, 2.0, result)}
    assert (rows["sequential"]["step_time_min_s"], rows["sequential"]["step_time_max_s"]) == (0.9, 1.3)
    assert not rows["sequential"]["repeats_below_minimum"] and rows["si"]["repeats_below_minimum"]
    table = markdown_table({"results": list(rows.values())})
    assert "| 1100 [900–1300] |" in table and "750 [700–800] (n=3 < 5)" in table


def test_failed_modes_become_rows():
    opts = BenchOptions(modes=("autotp", "sequential"), link_gbps=(None,), seq_len=64)
    rows = summarize_link(
        opts,
        None,
        {"error": "TimeoutError: hang", "modes": {"autotp": {"status": "skipped", "reason": "AutoTP does not apply"}}},
    )
    assert [(r["mode"], r["status"]) for r in rows] == [("autotp", "skipped"), ("sequential", "error")]
    assert "hang" in rows[1]["reason"] and rows[0]["link"] == "unshaped"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"modes": ("si", "fast")}, ["fast", "sequential"]),
        ({"modes": ("w",)}, ["pipeline"]),
        ({"link_gbps": (0.0,)}, ["0.0", "> 0"]),
        ({"seq_len": 63}, ["63", "tensor_parallel.size 2", "multiple of 2"]),
        ({"repeats": 0}, ["repeats"]),
        ({"link_burst_kb": 16}, ["16", "MTU"]),
        ({"pp": 2, "modes": ("si",)}, ["si", "drop --pp", "ds-1f1b"]),
        ({"pp": 2, "tp": 1, "ep": 2}, ["--pp 2", "--ep 2", "drop --ep"]),
        ({"ep": 0}, ["ep must be >= 1"]),
        ({"modes": ("si+fast",)}, ["si+fast", "none, selective, full"]),
        ({"modes": ("autotp+full",)}, ["autotp+full", "ds_dhelix mode"]),
        ({"modes": ("si", "si")}, ["twice"]),
        ({"model": "tiny-qwen3-moe", "tp": 1, "modes": ("autoep", "si")}, ["autoep", "--ep 1", "--ep 2"]),
    ],
)
def test_bad_options_name_the_value(kwargs, words):
    with pytest.raises(ValueError) as err:
        BenchOptions(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_autoep_refused_before_any_model_where_it_cannot_apply():
    """``--modes autoep`` on a model or layout AutoEP cannot run: one line naming the fix, from the
    config alone; in the default mode list the same reason becomes a skipped row instead."""
    from ds_dhelix.bench.options import autoep_preset, autoep_unfit, check_modes_fit
    from hf_models.registry import load_config

    dense = BenchOptions(model="tiny-llama", tp=1, ep=2, modes=("autoep", "deepspeed"))
    with pytest.raises(ValueError, match="autoep needs an MoE model: model_type 'llama' has no experts"):
        check_modes_fit(dense, load_config("tiny-llama"))
    phimoe = BenchOptions(model="tiny-phimoe", tp=1, ep=2, modes=("autoep", "si"))
    with pytest.raises(ValueError, match="no preset for model_type 'phimoe'.*drop autoep"):
        check_modes_fit(phimoe, load_config("tiny-phimoe"))
    default = BenchOptions()  # tiny-llama, TP=2, EP=1: autoep is in the list, not refused
    check_modes_fit(default, load_config("tiny-llama"))
    assert "--ep 1" in autoep_unfit(default, load_config("tiny-llama"))
    assert autoep_preset(load_config("tiny-qwen2-moe")) == "qwen3_moe"  # AutoEP's preset covers both
    moe = BenchOptions(model="tiny-qwen3-moe", tp=1, ep=2, modes=("autoep",))
    assert autoep_unfit(moe, load_config("tiny-qwen3-moe")) is None
    assert moe.autoep_ds_config("qwen3_moe")["expert_parallel"] == {
        "enabled": True,
        "autoep_size": 2,
        "preset_model": "qwen3_moe",
    }


def test_deepspeed_modes_run_without_a_ds_dhelix_adapter(monkeypatch):
    """A model type ds_dhelix has no adapter for yet still runs DeepSpeed's own modes (the ds_dhelix
    modes report the adapter error as rows); with ds_dhelix modes alone the bench is refused."""
    import hf_models.adapters
    from ds_dhelix.commands.bench import check_bench_model

    monkeypatch.setattr(
        hf_models.adapters, "ADAPTERS", {k: v for k, v in hf_models.adapters.ADAPTERS.items() if k != "qwen3_moe"}
    )
    notes = []
    check_bench_model(
        BenchOptions(model="tiny-qwen3-moe", tp=1, ep=2, modes=("autoep", "deepspeed", "si")), notes.append
    )
    assert len(notes) == 1 and "no ds_dhelix adapter for model_type 'qwen3_moe': si will report" in notes[0]
    with pytest.raises(ValueError, match="no ds_dhelix adapter"):
        check_bench_model(BenchOptions(model="tiny-qwen3-moe", tp=1, ep=2, modes=("si",)), notes.append)


def test_layouts_world_and_tokens():
    ep = BenchOptions(model="tiny-phimoe", tp=1, ep=2, micro_batches=8)
    assert ep.world == 2 and ep.dp == 2 and ep.step_micro_batches == 16
    assert ep.tokens_per_step == 16 * ep.micro_batch_size * ep.seq_len  # every mode, same tokens
    assert ep.dhelix_ds_config("si")["dhelix"]["expert_parallel"] == {"size": 2}
    assert ep.deepspeed_ds_config()["gradient_accumulation_steps"] == 8  # 16 over 2 DP ranks
    pp = BenchOptions(tp=1, pp=2)
    assert pp.modes == ("ds-1f1b", "ds-dualpipev", "sequential", "w", "dualpipev") and pp.world == 2
    section = pp.dhelix_ds_config("dualpipev")["dhelix"]
    assert section["schedule"] == "dualpipev" and section["pipeline"] == {"stages": 2}
    old = BenchOptions(tp=1, pp=2, modes=("w", "dualpipev-si"))  # the old name of the mode is read as its new one
    assert old.modes == ("w", "dualpipev")
    for mode, keys in (
        ("si-ends", {"schedule": "si", "pair_ends": True}),
        ("si-planned", {"schedule": "si", "si_execution": "plan"}),
    ):  # variants: the registry's keys
        got = BenchOptions().dhelix_ds_config(mode)["dhelix"]
        assert {k: got[k] for k in keys} == keys
    assert BenchOptions().dhelix_ds_config("si-planned")["dhelix"]["planner"]["profile"] == "auto"
    pptp = BenchOptions(tp=2, pp=2)  # TP inside the stages: 4 ranks, one data-parallel group
    assert pptp.world == 4 and pptp.dp == 1 and pptp.step_micro_batches == pptp.micro_batches
    assert pptp.dhelix_ds_config("w")["dhelix"]["tensor_parallel"] == {"size": 2}


def test_recompute_modes_side_by_side():
    """``--modes si si+full``: the same ds_dhelix mode with its dhelix.recompute, in one run
    (the command line accepts pipeline modes too)."""
    from ds_dhelix.cli import build_parser
    from ds_dhelix.commands.bench import options_from_args

    opts = BenchOptions(modes=("sequential", "si", "si+full", "si-plan+selective", "si+full+unfused"))
    assert "recompute" not in opts.dhelix_ds_config("si")["dhelix"]
    assert opts.dhelix_ds_config("si+full")["dhelix"]["recompute"] == "full"
    assert "fuse_ops" not in opts.dhelix_ds_config("si")["dhelix"]  # the default: fused
    unfused = opts.dhelix_ds_config("si+full+unfused")["dhelix"]
    assert (unfused["recompute"], unfused["fuse_ops"]) == ("full", False)
    plan = opts.dhelix_ds_config("si-plan+selective")["dhelix"]
    assert plan["recompute"] == "selective" and plan["si_execution"] == "plan"
    args = build_parser().parse_args(["bench", "--pp", "2", "--tp", "1", "--modes", "sequential", "w+full"])
    pp = options_from_args(args)
    assert pp.modes == ("sequential", "w+full")
    section = pp.dhelix_ds_config("w+full")["dhelix"]
    assert (section["schedule"], section["recompute"]) == ("w", "full")


def test_quick_keeps_explicit_values():
    q = quick(BenchOptions(), seq_len=64, link_gbps=(None,))
    assert q.seq_len == 64 and q.link_gbps == (None,) and q.num_layers == 2 and q.repeats == 3


# ------------------------------------------------------------------ end to end: every mode, tiny
def test_auto_row_says_why_it_chose_without_a_trial():
    """The auto row of a layout with nothing to hide (TP=1): sequential, no trial steps, no
    figures, and auto_reason (the progress line shows it too)."""
    from types import SimpleNamespace

    from ds_dhelix.bench import _progress_line
    from ds_dhelix.bench.modes import _Settling
    from ds_dhelix.planning.autoschedule import AutoSchedule

    runner = _Settling()
    runner.engine = SimpleNamespace(
        auto=AutoSchedule(("sequential", "si", "intra"), 3, 500, untimed_reason="nothing to hide: no collective")
    )
    assert runner.settling_steps == 0
    info = runner.settled_info()
    assert info == {
        "auto_chosen": "sequential",
        "auto_trial_steps": 0,
        "auto_figures": {},
        "auto_reason": "nothing to hide: no collective",
    }
    row = {"mode": "auto", "status": "ok", "step_time_s": 0.2, "tokens_per_s": 10.0, **info}
    assert "chose sequential without a trial (nothing to hide: no collective)" in _progress_line(row)
    timed = _Settling()
    timed.engine = SimpleNamespace(auto=AutoSchedule(("sequential", "si"), 1, 0))
    for step in range(1, 5):
        timed.engine.auto.schedule()
        timed.engine.auto.record(step, 1.0)
    assert timed.settled_info()["auto_reason"].startswith("the fastest median step time (1 timed step each")


def test_bench_quick_json_every_mode(tmp_path):
    # ~65 s on an idle 2-core machine; si-planned profiles its layer (fresh cache) and DeepSpeed
    # may JIT-build its CPU comm op on first use, so the bound leaves room for a busy machine.
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "ds_dhelix.cli",
        "bench",
        "--quick",
        "--json",
        "--num-layers",
        "1",
        "--seq-len",
        "64",
        "--micro-batch-size",
        "2",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--link-gbps",
        "unshaped",
        "--timeout",
        "200",
        "--planner-cache",
        str(tmp_path / "cache"),
        "--out",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = {r["mode"]: r for r in report["results"]}
    assert list(rows) == list(DEFAULT_MODES)
    for mode in ("deepspeed", "sequential", "si"):
        assert rows[mode]["status"] == "ok", rows[mode]
    seq = rows["sequential"]
    for mode, r in rows.items():
        assert r["link_gbps"] is None and r["link"] == "unshaped"
        if r["status"] != "ok":  # autotp / si-planned may not apply: then a reason says why
            assert r["status"] in ("skipped", "error") and r["reason"], r
            continue
        assert r["steps"] == 2 and r["step_time_s"] == pytest.approx(statistics.median(r["step_times_s"]))
        for key in ("step_time_s", "tokens_per_s", "speedup_vs_sequential", "ideal_speedup", "peak_activation_bytes"):
            assert r[key] > 0, (mode, key, r[key])
        assert r["speedup_vs_sequential"] == pytest.approx(seq["step_time_s"] / r["step_time_s"])
        assert r["ideal_speedup"] == pytest.approx(
            (seq["compute_s"] + seq["comm_s"]) / max(seq["compute_s"], seq["comm_s"])
        )
        assert r["mfu"] is None  # CPU: peak unknown
        assert r["cpu_bound_speedup"] > 0, (mode, r["cpu_bound_speedup"])
    for mode in ("sequential", "si"):
        r = rows[mode]
        assert r["compute_s"] > 0 and r["comm_s"] > 0 and 0 <= r["exposed_comm_s"]
        assert 0.0 <= r["hidden_of_hideable"] <= 1.0
    assert rows["si"]["achieved_over_ideal"] == pytest.approx(
        rows["si"]["speedup_vs_sequential"] / rows["si"]["ideal_speedup"]
    )
    assert report["comm_comp_ratio"]["value"] == pytest.approx(seq["comm_s"] / seq["compute_s"])
    for ext in ("json", "csv", "md", "png"):
        assert (out / f"bench.{ext}").stat().st_size > 0
    assert json.loads((out / "bench.json").read_text())["results"] == report["results"]


def _run_bench(tmp_path, *extra):
    argv = [
        sys.executable,
        "-m",
        "ds_dhelix.cli",
        "bench",
        "--json",
        "--seq-len",
        "64",
        "--micro-batch-size",
        "2",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--link-gbps",
        "unshaped",
        "--timeout",
        "150",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["mode"]: r for r in json.loads(proc.stdout)["results"]}


@pytest.mark.timeout(240)
def test_bench_moe_expert_parallel(tmp_path):
    rows = _run_bench(
        tmp_path,
        "--model",
        "tiny-phimoe",
        "--tp",
        "1",
        "--ep",
        "2",
        "--num-layers",
        "1",
        "--micro-batches",
        "2",
        "--modes",
        "deepspeed",
        "autotp",
        "sequential",
        "si",
        "si-ends",
    )
    assert rows["autotp"]["status"] == "skipped" and "AutoTP" in rows["autotp"]["reason"]
    for mode in ("deepspeed", "sequential", "si", "si-ends"):
        assert rows[mode]["status"] == "ok", rows[mode]
        assert rows[mode]["tokens_per_s"] > 0
    assert rows["si"]["comm_s"] > 0 and rows["si"]["ideal_speedup"] >= 1.0  # dispatch/combine timed
    # pair_ends (F0xF1 | B0xB1 here) holds both micro-batches' activations at once
    assert rows["si-ends"]["peak_activation_bytes"] > rows["si"]["peak_activation_bytes"]


@pytest.mark.timeout(240)
def test_bench_autoep_peer_on_its_preset_family(tmp_path):
    # DeepSpeed's own AutoEP (qwen3_moe preset) on the same model and tokens as ours: it must have
    # replaced every MoE block (else the row would be plain data parallel under AutoEP's name)
    rows = _run_bench(
        tmp_path,
        "--model",
        "tiny-qwen3-moe",
        "--tp",
        "1",
        "--ep",
        "2",
        "--num-layers",
        "2",
        "--micro-batches",
        "2",
        "--modes",
        "autoep",
        "sequential",
        "si",
    )
    autoep = rows["autoep"]
    assert autoep["status"] == "ok", autoep
    assert autoep["autoep_preset"] == "qwen3_moe" and autoep["autoep_layers"] == 2
    assert autoep["tokens_per_s"] > 0 and autoep["speedup_vs_sequential"] > 0
    assert rows["si"]["status"] == "ok" and rows["si"]["comm_s"] > 0


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, "hf_models", "presets", "tiny-deepseek-v3.json")),
    reason="the tiny-deepseek-v3 preset is not in this checkout",
)
def test_bench_autoep_on_deepseek_v3(tmp_path):
    # AutoEP's deepseek_v3 preset on 2 CPU gloo ranks: layer 0 is dense (first_k_dense_replace), so
    # of two layers AutoEP replaces one MoE block (routed experts over EP=2, the shared expert kept)
    rows = _run_bench(
        tmp_path,
        "--model",
        "tiny-deepseek-v3",
        "--tp",
        "1",
        "--ep",
        "2",
        "--num-layers",
        "2",
        "--micro-batches",
        "2",
        "--modes",
        "autoep",
    )
    autoep = rows["autoep"]
    assert autoep["status"] == "ok", autoep
    assert autoep["autoep_preset"] == "deepseek_v3" and autoep["autoep_layers"] == 1
    assert autoep["tokens_per_s"] > 0 and autoep["steps"] == 1


@pytest.mark.timeout(240)
def test_bench_pipeline_modes(tmp_path):
    # PP=2 x TP=2: DeepSpeed's pipelines on our TP layers, our fold, W and auto (4 ranks)
    rows = _run_bench(
        tmp_path,
        "--pp",
        "2",
        "--tp",
        "2",
        "--num-layers",
        "4",
        "--micro-batches",
        "4",
        "--modes",
        "ds-1f1b",
        "ds-dualpipev",
        "sequential",
        "w",
        "auto",
    )
    assert list(rows) == ["ds-1f1b", "ds-dualpipev", "sequential", "w", "auto"]
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["speedup_vs_sequential"] > 0 and row["ideal_speedup"] is None  # no comm bound for p2p
    assert rows["w"]["peak_activation_bytes"] > 0 and rows["ds-1f1b"]["peak_activation_bytes"] is None
    assert rows["w"]["comm_s"] > 0  # TP collectives inside the stages
    assert rows["auto"]["auto_chosen"] in ("sequential", "w", "dualpipev") and rows["auto"]["auto_trial_steps"] > 0


def test_matched_link_finds_the_rate_where_comm_equals_comp():
    from ds_dhelix.bench import match_link

    def ratio(comm_bits, latency=0.0, comp=4.0):  # a bandwidth-bound exchange: comm ~ 1/rate
        return lambda g: (latency + comm_bits / g) / comp

    rate, tried = match_link(ratio(40.0))  # 5.0 at 2 Gbit/s: one step to 10 Gbit/s
    assert rate == pytest.approx(10.0) and [round(r, 3) for _, r in tried] == [5.0, 1.0]
    rate, tried = match_link(ratio(8.0, latency=0.5))  # a latency share: still inside 0.9-1.1
    assert 0.9 <= tried[-1][1] <= 1.1 and rate == tried[-1][0]
    rate, tried = match_link(lambda g: 3.0 if g < 5 else 0.2, tries=3)  # never in range: the closest
    assert len(tried) == 3 and rate == min(tried, key=lambda t: abs(t[1] - 1))[0]
    with pytest.raises(ValueError, match="communicated nothing"):
        match_link(lambda g: 0.0)


def test_matched_is_a_bench_link_only():
    import argparse

    from ds_dhelix.commands.common import bench_link_rate, link_rate

    assert bench_link_rate("matched") == "matched" and bench_link_rate("2") == 2.0
    assert BenchOptions(link_gbps=("matched", 2.0)).link_gbps == ("matched", 2.0)
    with pytest.raises(argparse.ArgumentTypeError):
        link_rate("matched")  # dhelix trace / profile take a rate


def test_a_failed_world_is_named_by_its_error_not_its_shutdown_warnings():
    from ds_dhelix.bench.world import error_line

    text = (
        'rank 1 failed:\nTraceback (most recent call last):\n  File "x.py", line 3\n'
        "ValueError: tensor_parallel.size 3 does not divide num_attention_heads=4\n"
        "  warnings.warn('resource_tracker: There appear to be %d '"
    )
    assert error_line(text) == "ValueError: tensor_parallel.size 3 does not divide num_attention_heads=4"
    assert error_line("a\nb\n  warnings.warn('x')") == "b"
    assert error_line("") == ""
