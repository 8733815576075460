"""dhelix trace: a few SI steps give one valid Chrome trace with a compute lane and per-strand
communication lanes on every rank, spans ordered and non-overlapping within each lane."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.pair_retime import retime_trace
from benchmarks.trace_analysis import idle_breakdown
from benchmarks.trace_analysis import main as analysis_main
from ds_dhelix.bench.tracing import summarize_trace
from ds_dhelix.runtime.linkemu import link_emulation_available
from ds_dhelix.runtime.trace import validate_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER_OPS = {"attn.norm", "attn.qkv", "attn.core", "attn.out", "mlp.norm", "mlp.up", "mlp.down", "mlp.add"}
# fused runs (dhelix.fuse_ops, the default): the COMP ops between two collectives are one span
FUSED_LAYER_OPS = {"attn.norm", "attn.qkv+attn.core+attn.out", "mlp.norm", "mlp.up+mlp.down", "mlp.add"}
COMM_OPS = {"attn.ag", "attn.rs", "mlp.ag", "mlp.rs"}
BLOCK_COMM_OPS = {"embed.rs", "head.ag", "head.lse_a2a"}  # the vocabulary split over TP (hf_models/vocab.py)


@pytest.mark.parametrize("unfused", [False, True], ids=["fused", "unfused"])
def test_trace_of_si_steps(tmp_path, unfused):
    out = tmp_path / "trace.json"
    # behind an emulated link where this machine can (root + iproute2), else on plain loopback
    link = ["--link-gbps", "5"] if link_emulation_available()[0] else []
    argv = [
        sys.executable,
        "-m",
        "ds_dhelix.cli",
        "trace",
        "--model",
        "tiny-llama",
        "--tp",
        "2",
        "--steps",
        "2",
        "--num-layers",
        "2",
        "--seq-len",
        "64",
        "--micro-batch-size",
        "2",
        "--micro-batches",
        "3",
        "--out",
        str(out),
        "--timeout",
        "150",
        "--json",
        *link,
        *(["--unfused"] if unfused else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    assert printed["problems"] == [] and printed["shaped"] == bool(link)

    trace = json.loads(out.read_text())
    assert validate_trace(trace, lanes=("compute", "comm:tp:F", "comm:tp:B")) == []
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    lanes = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    by_lane = {}
    for e in spans:
        by_lane.setdefault((e["pid"], lanes[(e["pid"], e["tid"])]), []).append(e)
    for rank in (0, 1):
        compute = by_lane[(rank, "compute")]
        names = {e["name"] for e in compute}
        assert (LAYER_OPS if unfused else FUSED_LAYER_OPS) <= names
        assert not (names & (FUSED_LAYER_OPS - LAYER_OPS if unfused else LAYER_OPS - FUSED_LAYER_OPS))
        for strand in ("F", "B"):
            comm = by_lane[(rank, f"comm:tp:{strand}")]
            assert {e["name"] for e in comm} == COMM_OPS | BLOCK_COMM_OPS
            assert {e["args"]["strand"] for e in comm} == {strand}
        for lane_spans in (by_lane[(rank, lane)] for lane in ("compute", "comm:tp:F", "comm:tp:B")):
            starts = [e["ts"] for e in lane_spans]
            assert starts == sorted(starts)
            for a, b in zip(lane_spans, lane_spans[1:]):
                assert b["ts"] >= a["ts"] + a["dur"] - 1e-3  # no overlap within a lane
    # 2 steps x 3 micro-batches, every span says which micro-batch and strand it belongs to
    assert {e["args"]["microbatch"] for e in spans} == {0, 1, 2}
    assert {e["args"]["strand"] for e in spans} == {"F", "B"}
    # SI co-executes: some forward comm runs while the compute lane works on a backward op
    b_compute = [(e["ts"], e["ts"] + e["dur"]) for e in by_lane[(0, "compute")] if e["args"]["strand"] == "B"]
    f_comm = [(e["ts"], e["ts"] + e["dur"]) for e in by_lane[(0, "comm:tp:F")]]
    assert any(c0 < b1 and b0 < c1 for c0, c1 in f_comm for b0, b1 in b_compute)
    summary = summarize_trace(trace)
    assert set(summary["ranks"]) == {0, 1} and summary["wall_ms"] > 0
    # 2 steps x 3 micro-batches x (2 layers' collectives + the embedding's and the head's)
    assert summary["ranks"][0]["comm:tp:F"]["spans"] == 2 * 3 * (2 * len(COMM_OPS) + len(BLOCK_COMM_OPS))
    idle = idle_breakdown(trace)
    assert set(idle) == {0, 1}
    for entry in idle.values():  # where the compute lane waited: per period, per collective
        assert entry["steps"] == 2
        assert set(entry["periods"]) == {"forward_alone", "co_executed", "backward_alone"}
        assert all(v >= 0 for v in entry["periods"].values())
        waits = {f"{op} {s}" for op in COMM_OPS | BLOCK_COMM_OPS for s in "FB"}
        assert set(entry["waited_on"]) <= waits | {"none"}
        assert sum(entry["waited_on"].values()) == pytest.approx(sum(entry["periods"].values()))
    # pair re-timing: 2 steps x 2 pairs per rank; perfect overlap never beats a schedule, a schedule
    # never beats doing everything one after another
    retimed = retime_trace(trace)
    assert set(retimed) == {0, 1}
    for pid, r in retimed.items():
        assert r["pairs"] == 4, (pid, r)
        assert r["bound_ms"] <= r["retime_ms"] + 1e-6 <= r["compute_ms"] + r["wire_ms"] + 1e-3
        assert r["bound_ms"] - 1e-6 <= r["search_ms"] <= r["retime_ms"] + 1e-6


def test_trace_analysis_command_reads_a_trace(tmp_path, capsys):
    """The research CLI over a trace file (a tiny synthetic one: one rank, one step, one pair)."""
    from ds_dhelix.runtime.trace import TraceRecorder

    rec = TraceRecorder(0, record_function=False)

    def args(strand, mb, block, op):
        return {
            "strand": strand,
            "microbatch": mb,
            "block": block,
            "op": op,
            "direction": "backward" if strand == "B" else "forward",
        }

    rec.add_span("compute", "embed", 0.000, 0.001, args("F", 0, 0, "embed"))
    rec.add_span("compute", "head.loss", 0.001, 0.002, args("F", 0, 1, "head.loss"))
    rec.add_span("compute", "embed", 0.004, 0.005, args("F", 1, 0, "embed"))
    rec.add_span("compute", "head.loss", 0.005, 0.006, args("B", 0, 1, "head.loss"))
    rec.add_span("comm:tp:F", "attn.ag", 0.0021, 0.0039, args("F", 1, 0, "attn.ag"))
    path = tmp_path / "t.json"
    rec.dump(path)
    assert analysis_main([str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["idle"]["0"]["steps"] == 1 and out["idle"]["0"]["periods"]["forward_alone"] == pytest.approx(2.0)
    # one op's share of the step (the delta rule of Qwen3.5's linear layers: attn.core in their blocks)
    assert analysis_main([str(path), "--op", "head.loss", "--blocks", "1"]) == 0
    share = json.loads(capsys.readouterr().out)["0"]
    assert share["steps"] == 1 and share["op_ms"] == pytest.approx(2.0) and share["step_ms"] == pytest.approx(6.0)
    assert share["share_of_step"] == pytest.approx(1 / 3) and share["share_of_compute"] == pytest.approx(0.5)
