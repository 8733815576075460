"""Execution trace of a few training steps: the engine's own trace (``"dhelix": {"trace": ...}``)
on a CPU gloo world, optionally behind an emulated link, merged into one Chrome/Perfetto JSON.

    rank 0  compute      |attn.qkv F1|mlp.down B0|attn.core F1|...
            comm:tp:B          |mlp.rs B0 ......|
            comm:tp:F    |attn.ag F1 ...|
    rank 1  ...

``summarize_trace`` turns a loaded trace into per-rank, per-lane span counts and busy time;
``idle_breakdown`` says where the compute lane waited: in which phase of the step (forward alone,
co-executed pairs, backward alone) and on which collective.
"""
from __future__ import annotations

import bisect
import os
from collections import defaultdict
from dataclasses import dataclass, replace

from .options import BenchOptions


@dataclass(frozen=True)
class TraceOptions:
    """A traced run: ``steps`` optimizer steps of ``schedule`` on ``tp x ep`` ranks."""

    out: str = "trace.json"
    model: str = "tiny-llama"
    tp: int = 2
    ep: int = 1
    schedule: str = "si"
    planned: bool = False
    """SI with the planner's plan (``planner.profile = "auto"``) instead of the default plan."""
    planner_cache: str | None = None
    """Overlap-table cache of the planner (None: its default, ~/.cache/ds_dhelix)."""
    steps: int = 3
    micro_batches: int = BenchOptions.micro_batches
    micro_batch_size: int = BenchOptions.micro_batch_size
    seq_len: int = BenchOptions.seq_len
    num_layers: int | None = None
    link_gbps: float | None = None
    link_burst_kb: int = BenchOptions.link_burst_kb
    timeout: float = 600.0

    def __post_init__(self):
        if self.schedule not in ("si", "si-ends", "si-plan", "sequential"):
            raise ValueError(f"--schedule {self.schedule!r}: choose 'si', 'si-ends', 'si-plan' or 'sequential'")
        if self.planned and self.schedule == "sequential":
            raise ValueError("--planned applies to --schedule si or si-plan only")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.link_gbps is not None and not self.link_gbps > 0:
            raise ValueError(f"--link-gbps {self.link_gbps} must be > 0 (or 'unshaped')")
        self.bench_options()  # shape checks

    def bench_options(self) -> BenchOptions:
        return BenchOptions(model=self.model, tp=self.tp, ep=self.ep, modes=(self.schedule,), link_gbps=(self.link_gbps,),
                            micro_batches=self.micro_batches, micro_batch_size=self.micro_batch_size,
                            seq_len=self.seq_len, num_layers=self.num_layers, timeout=self.timeout,
                            link_burst_kb=self.link_burst_kb)


def _rank_main(rank: int, world: int, opts: TraceOptions) -> dict:
    import ds_dhelix
    from hf_models.registry import load_config

    from .modes import build_model
    from .world import make_batches
    bench = opts.bench_options()
    trace = {"enabled": True, "path": os.path.abspath(opts.out), "steps": opts.steps}
    extra = {"trace": trace}
    if opts.planner_cache:
        extra["planner"] = {"cache_dir": os.path.abspath(opts.planner_cache)}
    bench = replace(bench, extra_dhelix=extra)
    batches = make_batches(bench, load_config(opts.model).vocab_size)
    mode = "si-planned" if opts.planned else opts.schedule
    config = bench.dhelix_ds_config(mode, opts.link_gbps)
    engine, *_ = ds_dhelix.initialize(model=build_model(bench), config=config, example_batch=batches[0])
    steps = []
    share = len(batches) // engine.layout.dp_size  # this data-parallel group's micro-batches
    mine = batches[engine.layout.dp_rank * share:(engine.layout.dp_rank + 1) * share]
    for _ in range(opts.steps):
        engine.train_batch(iter(mine))
        s = engine.last_stats
        steps.append({"step_s": s.step_s, "compute_s": s.compute_s, "comm_s": s.comm_s,
                      "exposed_s": s.exposed_s, "num_comms": s.num_comms})
    engine.destroy()
    return {"rank": rank, "steps": steps}


def _link_main(opts: TraceOptions) -> list[dict]:
    from ds_dhelix.spawn import run_ranks
    return run_ranks(_rank_main, opts.tp * opts.ep, args=(opts,), timeout=opts.timeout)


def record_trace(opts: TraceOptions) -> dict:
    """Run the traced steps; return ``{"path", "shaped", "per_rank_steps"}``. The trace file is
    written by the engine (rank 0 merges every rank's spans)."""
    from ds_dhelix.linkemu import link_emulation_available, run_in_link
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    per_rank = run_in_link(_link_main, opts.link_gbps, args=(opts,), timeout=opts.timeout + 30,
                           burst_kb=opts.link_burst_kb)
    shaped = opts.link_gbps is not None and link_emulation_available()[0]
    return {"path": os.path.abspath(opts.out), "shaped": shaped, "per_rank_steps": per_rank}


def summarize_trace(trace: dict) -> dict:
    """``{rank: {lane: {"spans": n, "busy_ms": ..., "ops": sorted op names}}}`` plus the trace span
    ``wall_ms`` (first start to last end over all ranks)."""
    lane_names, ranks = {}, {}
    starts, ends = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            lane_names[(e["pid"], e.get("tid"))] = e["args"]["name"]
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        lane = lane_names.get((e["pid"], e.get("tid")), f"tid {e.get('tid')}")
        entry = ranks.setdefault(e["pid"], {}).setdefault(lane, {"spans": 0, "busy_ms": 0.0, "ops": set()})
        entry["spans"] += 1
        entry["busy_ms"] += e["dur"] / 1e3
        entry["ops"].add(e["name"])
        starts.append(e["ts"])
        ends.append(e["ts"] + e["dur"])
    for lanes in ranks.values():
        for entry in lanes.values():
            entry["ops"] = sorted(entry["ops"])
    wall = (max(ends) - min(starts)) / 1e3 if starts else 0.0
    return {"ranks": {pid: ranks[pid] for pid in sorted(ranks)}, "wall_ms": wall}


def _lane_names(trace: dict) -> dict:
    return {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace.get("traceEvents", [])
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


def _split_steps(compute: list[dict]) -> list[list[dict]]:
    """Spans of one rank, by start time -> one list per optimizer step (a step starts at the
    forward of micro-batch 0's first block)."""
    steps: list[list[dict]] = []
    for e in compute:
        a = e.get("args", {})
        if not steps or (a.get("microbatch") == 0 and a.get("block") == 0 and a.get("strand") == "F"
                         and any(x["args"].get("strand") == "B" for x in steps[-1])):
            steps.append([])
        steps[-1].append(e)
    return steps


def idle_breakdown(trace: dict, min_gap_us: float = 50.0) -> dict:
    """Per rank, ms of compute-lane idle time per step: ``{"phases": {"forward_alone",
    "co_executed", "backward_alone"}, "waited_on": {"<op> <strand>": ms}}``, averaged over steps.
    The phases are: before the step's first backward op, while forwards and backwards interleave,
    after its last forward op (with ``pair_ends`` the first and last are the F0xF1 and
    B(m-2)xB(m-1) pairs).

    A gap ends when the collective the executor waited for completes; it is charged to the
    collective(s) whose span ends inside the gap (``"none"``: no collective, e.g. bookkeeping).
    """
    lanes = _lane_names(trace)
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    out = {}
    for pid in sorted({e["pid"] for e in spans}):
        mine = [e for e in spans if e["pid"] == pid]
        compute = sorted((e for e in mine if lanes.get((pid, e.get("tid"))) == "compute"), key=lambda e: e["ts"])
        comm_ends = sorted((e["ts"] + e["dur"], f"{e['name']} {e['args'].get('strand')}") for e in mine
                           if str(lanes.get((pid, e.get("tid")), "")).startswith("comm"))
        ends = [t for t, _ in comm_ends]
        phases, waited = defaultdict(float), defaultdict(float)
        steps = _split_steps(compute)
        for step in steps:
            f_end = max((e["ts"] + e["dur"] for e in step if e["args"].get("strand") == "F"), default=0)
            b_start = min((e["ts"] for e in step if e["args"].get("strand") == "B"), default=float("inf"))
            for a, b in zip(step, step[1:]):
                gap = b["ts"] - (a["ts"] + a["dur"])
                if gap < min_gap_us:
                    continue
                phase = ("forward_alone" if b["ts"] <= b_start else
                         "backward_alone" if a["ts"] >= f_end else "co_executed")
                phases[phase] += gap / 1e3
                lo, hi = bisect.bisect_left(ends, a["ts"] + a["dur"]), bisect.bisect_right(ends, b["ts"] + 20)
                names = sorted({name for _, name in comm_ends[lo:hi]}) or ["none"]
                for name in names:
                    waited[name] += gap / 1e3 / len(names)
        n = max(len(steps), 1)
        out[pid] = {"steps": len(steps),
                    "phases": {k: phases[k] / n for k in ("forward_alone", "co_executed", "backward_alone")},
                    "waited_on": {k: v / n for k, v in sorted(waited.items(), key=lambda kv: -kv[1])}}
    return out
