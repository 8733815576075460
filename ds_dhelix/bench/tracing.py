"""Execution trace of a few training steps: the engine's own trace (``"dhelix": {"trace": ...}``)
on a CPU gloo world, optionally behind an emulated link, merged into one Chrome/Perfetto JSON.

    rank 0  compute      |attn.qkv F1|mlp.down B0|attn.core F1|...
            comm:tp:B          |mlp.rs B0 ......|
            comm:tp:F    |attn.ag F1 ...|
    rank 1  ...

``summarize_trace`` turns a loaded trace into per-rank, per-lane span counts and busy time;
``lane_names`` and ``split_steps`` read a trace back for further analysis
(``benchmarks/trace_analysis.py``: where the compute lane waited, each pair re-timed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .options import BenchOptions


@dataclass(frozen=True)
class TraceOptions:
    """A traced run: ``steps`` optimizer steps of ``schedule`` on ``tp x cp x ep`` ranks."""

    out: str = "trace.json"
    model: str = "tiny-llama"
    tp: int = 2
    ep: int = 1
    cp: int = 1
    cp_comm: str = "ulysses"
    schedule: str = "si"
    planned: bool = False
    """SI with the planner's plan (``planner.profile = "auto"``) instead of the default plan."""
    planner_cache: str | None = None
    """Overlap-table cache of the planner (None: its default, ~/.cache/ds_dhelix)."""
    unfused: bool = False
    """Every op of the adapter on its own (``"fuse_ops": false``): a span per op instead of per run."""
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
        return BenchOptions(
            model=self.model,
            tp=self.tp,
            ep=self.ep,
            cp=self.cp,
            cp_comm=self.cp_comm,
            modes=(self.schedule,),
            link_gbps=(self.link_gbps,),
            micro_batches=self.micro_batches,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            timeout=self.timeout,
            link_burst_kb=self.link_burst_kb,
        )


def _rank_main(rank: int, world: int, opts: TraceOptions) -> dict:
    from ds_dhelix.engine.build import build_engine
    from hf_models.registry import load_config

    from .modes import build_model
    from .world import make_batches

    bench = opts.bench_options()
    trace = {"enabled": True, "path": os.path.abspath(opts.out), "steps": opts.steps}
    extra = {"trace": trace, **({"fuse_ops": False} if opts.unfused else {})}
    if opts.planner_cache:
        extra["planner"] = {"cache_dir": os.path.abspath(opts.planner_cache)}
    bench = replace(bench, extra_dhelix=extra)
    batches = make_batches(bench, load_config(opts.model).vocab_size)
    mode = "si-planned" if opts.planned else opts.schedule
    config = bench.dhelix_ds_config(mode, opts.link_gbps)
    engine = build_engine(build_model(bench), config, example_batch=batches[0])
    steps = []
    share = len(batches) // engine.groups.dp_size  # this data-parallel group's micro-batches
    mine = batches[engine.groups.dp_rank * share : (engine.groups.dp_rank + 1) * share]
    for _ in range(opts.steps):
        engine.train_batch(iter(mine))
        s = engine.last_stats
        comm, exposed = s.comm_and_exposed  # CUDA: from CUDA events
        steps.append(
            {
                "step_s": s.step_s,
                "compute_s": s.compute_s,
                "comm_s": comm,
                "exposed_s": exposed,
                "num_comms": s.num_comms,
            }
        )
    engine.destroy()
    return {"rank": rank, "steps": steps}


def _link_main(opts: TraceOptions) -> list[dict]:
    from ds_dhelix.runtime.spawn import run_ranks

    return run_ranks(_rank_main, opts.bench_options().world, args=(opts,), timeout=opts.timeout)


def record_trace(opts: TraceOptions) -> dict:
    """Run the traced steps; return ``{"path", "shaped", "per_rank_steps"}``. The trace file is
    written by the engine (rank 0 merges every rank's spans)."""
    from ds_dhelix.runtime.linkemu import link_emulation_available, run_in_link

    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    per_rank = run_in_link(
        _link_main, opts.link_gbps, args=(opts,), timeout=opts.timeout + 30, burst_kb=opts.link_burst_kb
    )
    shaped = opts.link_gbps is not None and link_emulation_available()[0]
    return {"path": os.path.abspath(opts.out), "shaped": shaped, "per_rank_steps": per_rank}


def summarize_trace(trace: dict) -> dict:
    """``{rank: {lane: {"spans": n, "busy_ms": ..., "ops": sorted op names}}}`` plus the trace span
    ``wall_ms`` (first start to last end over all ranks)."""
    lanes, ranks = lane_names(trace), {}
    starts, ends = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        lane = lanes.get((e["pid"], e.get("tid")), f"tid {e.get('tid')}")
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


def lane_names(trace: dict) -> dict:
    """``{(pid, tid): lane name}`` of a loaded trace."""
    return {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }


def split_steps(compute: list[dict]) -> list[list[dict]]:
    """Spans of one rank, by start time -> one list per optimizer step (a step starts at the
    forward of micro-batch 0's first block)."""
    steps: list[list[dict]] = []
    for e in compute:
        a = e.get("args", {})
        if not steps or (
            a.get("microbatch") == 0
            and a.get("block") == 0
            and a.get("strand") == "F"
            and any(x["args"].get("strand") == "B" for x in steps[-1])
        ):
            steps.append([])
        steps[-1].append(e)
    return steps
