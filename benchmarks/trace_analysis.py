"""Analyses of a ``dhelix trace`` file (research, not product): where each rank's compute lane
waited, and every reactive SI pair re-timed on an idealised machine (``pair_retime``).

    python -m benchmarks.trace_analysis runs/trace.json [--json]
    python -m benchmarks.trace_analysis runs/trace.json --op attn.core --blocks 1 3   # one op's share of the step

The periods of ``idle_breakdown``: before the step's first backward op (forward alone), while
forwards and backwards interleave (co-executed), after its last forward op (backward alone).
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict

from ds_dhelix.bench.tracing import lane_names, split_steps

from .pair_retime import retime_trace


def idle_breakdown(trace: dict, min_gap_us: float = 50.0) -> dict:
    """Per rank, ms of compute-lane idle time per step: ``{"periods": {"forward_alone",
    "co_executed", "backward_alone"}, "waited_on": {"<op> <strand>": ms}}``, averaged over steps.
    The periods are: before the step's first backward op, while forwards and backwards interleave,
    after its last forward op (with ``pair_ends`` the first and last are the F0xF1 and
    B(m-2)xB(m-1) pairs).

    A gap ends when the collective the executor waited for completes; it is charged to the
    collective(s) whose span ends inside the gap (``"none"``: no collective, e.g. bookkeeping).
    """
    lanes = lane_names(trace)
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    out = {}
    for pid in sorted({e["pid"] for e in spans}):
        mine = [e for e in spans if e["pid"] == pid]
        compute = sorted((e for e in mine if lanes.get((pid, e.get("tid"))) == "compute"), key=lambda e: e["ts"])
        comm_ends = sorted(
            (e["ts"] + e["dur"], f"{e['name']} {e['args'].get('strand')}")
            for e in mine
            if str(lanes.get((pid, e.get("tid")), "")).startswith("comm")
        )
        ends = [t for t, _ in comm_ends]
        periods, waited = defaultdict(float), defaultdict(float)
        steps = split_steps(compute)
        for step in steps:
            f_end = max((e["ts"] + e["dur"] for e in step if e["args"].get("strand") == "F"), default=0)
            b_start = min((e["ts"] for e in step if e["args"].get("strand") == "B"), default=float("inf"))
            for a, b in zip(step, step[1:]):
                gap = b["ts"] - (a["ts"] + a["dur"])
                if gap < min_gap_us:
                    continue
                period = (
                    "forward_alone" if b["ts"] <= b_start else "backward_alone" if a["ts"] >= f_end else "co_executed"
                )
                periods[period] += gap / 1e3
                lo, hi = bisect.bisect_left(ends, a["ts"] + a["dur"]), bisect.bisect_right(ends, b["ts"] + 20)
                names = sorted({name for _, name in comm_ends[lo:hi]}) or ["none"]
                for name in names:
                    waited[name] += gap / 1e3 / len(names)
        n = max(len(steps), 1)
        out[pid] = {
            "steps": len(steps),
            "periods": {k: periods[k] / n for k in ("forward_alone", "co_executed", "backward_alone")},
            "waited_on": {k: v / n for k, v in sorted(waited.items(), key=lambda kv: -kv[1])},
        }
    return out


def op_share(trace: dict, op: str, blocks=None) -> dict:
    """Per rank, the compute-lane time of ``op`` (forward, backward, recomputed and deferred
    weight-gradient spans of that name) in ``blocks`` (None: every block), per step, against the
    step's wall time (first to last compute span of the step): ``{"steps", "op_ms", "step_ms",
    "compute_ms", "share_of_step", "share_of_compute"}``, means over the trace's steps. E.g. the
    delta rule of Qwen3.5's Gated DeltaNet layers: ``op="attn.core"``, ``blocks`` = the linear
    layers' blocks (layer i is block i + 1)."""
    lanes = lane_names(trace)
    wanted = {op, f"{op}.wgrad"}
    out = {}
    for pid in sorted({e["pid"] for e in trace.get("traceEvents", []) if e.get("ph") == "X"}):
        compute = sorted(
            (
                e
                for e in trace["traceEvents"]
                if e.get("ph") == "X" and e["pid"] == pid and lanes.get((pid, e.get("tid"))) == "compute"
            ),
            key=lambda e: e["ts"],
        )
        steps = split_steps(compute)
        op_ms = step_ms = busy_ms = 0.0
        for step in steps:
            op_ms += (
                sum(
                    e["dur"]
                    for e in step
                    if e["name"] in wanted and (blocks is None or e["args"].get("block") in blocks)
                )
                / 1e3
            )
            step_ms += (max(e["ts"] + e["dur"] for e in step) - step[0]["ts"]) / 1e3
            busy_ms += sum(e["dur"] for e in step) / 1e3
        n = max(len(steps), 1)
        out[pid] = {
            "steps": len(steps),
            "op_ms": op_ms / n,
            "step_ms": step_ms / n,
            "compute_ms": busy_ms / n,
            "share_of_step": op_ms / step_ms if step_ms else 0.0,
            "share_of_compute": op_ms / busy_ms if busy_ms else 0.0,
        }
    return out


def print_report(trace: dict) -> None:
    """The idle breakdown and (reactive SI traces) the pair re-timing, per rank, as text."""
    for rank, entry in idle_breakdown(trace).items():
        ph = entry["periods"]
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(entry["waited_on"].items())[:4])
        print(
            f"rank {rank} compute lane idle per step (ms): F alone {ph['forward_alone']:.0f}, "
            f"co-executed {ph['co_executed']:.0f}, B alone {ph['backward_alone']:.0f}; waiting on {top}"
        )
    for rank, r in retime_trace(trace).items():
        print(
            f"rank {rank} pairs (median of {r['pairs']}): measured {r['measured_ms']:.1f} ms, re-timed without "
            f"rank skew {r['retime_ms']:.1f} ms, best order searched {r['search_ms']:.1f} ms, bound "
            f"{r['bound_ms']:.1f} ms (compute {r['compute_ms']:.1f}, wire {r['wire_ms']:.1f}); schedule reaches "
            f"{r['bound_ms'] / r['retime_ms']:.0%} of the bound (searched order {r['bound_ms'] / r['search_ms']:.0%}), "
            f"the run {r['retime_ms'] / r['measured_ms']:.0%} of the re-timing"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="idle breakdown and pair re-timing of a dhelix trace")
    p.add_argument("trace", help="trace JSON written by `dhelix trace` or the engine's trace option")
    p.add_argument("--json", action="store_true", help="print {idle, pair_retime} as JSON")
    p.add_argument("--op", default=None, help="print this op's share of the step instead (op_share)")
    p.add_argument("--blocks", type=int, nargs="+", default=None, help="with --op: only these blocks (layer i: i + 1)")
    args = p.parse_args(argv)
    with open(args.trace) as f:
        trace = json.load(f)
    if args.op is not None:
        print(json.dumps(op_share(trace, args.op, args.blocks), indent=1))
    elif args.json:
        print(json.dumps({"idle": idle_breakdown(trace), "pair_retime": retime_trace(trace)}, indent=1))
    else:
        print_report(trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
