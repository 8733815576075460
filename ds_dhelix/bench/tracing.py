"""Execution trace of a few training steps: the engine's own trace (``"dhelix": {"trace": ...}``)
on a CPU gloo world, optionally behind an emulated link, merged into one Chrome/Perfetto JSON.

    rank 0  compute      |attn.qkv F1|mlp.down B0|attn.core F1|...
            comm:tp:B          |mlp.rs B0 ......|
            comm:tp:F    |attn.ag F1 ...|
    rank 1  ...

``summarize_trace`` turns a loaded trace into per-rank, per-lane span counts and busy time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .options import BenchOptions


@dataclass(frozen=True)
class TraceOptions:
    """A traced run: ``steps`` optimizer steps of ``schedule`` on ``tp`` ranks."""

    out: str = "trace.json"
    model: str = "tiny-llama"
    tp: int = 2
    schedule: str = "si"
    steps: int = 3
    micro_batches: int = 4
    micro_batch_size: int = 4
    seq_len: int = 256
    num_layers: int | None = None
    link_gbps: float | None = None
    timeout: float = 600.0

    def __post_init__(self):
        if self.schedule not in ("si", "sequential"):
            raise ValueError(f"--schedule {self.schedule!r}: choose 'si' or 'sequential'")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.link_gbps is not None and not self.link_gbps > 0:
            raise ValueError(f"--link-gbps {self.link_gbps} must be > 0 (or 'unshaped')")
        self.bench_options()  # shape checks

    def bench_options(self) -> BenchOptions:
        return BenchOptions(model=self.model, tp=self.tp, modes=(self.schedule,), link_gbps=(self.link_gbps,),
                            micro_batches=self.micro_batches, micro_batch_size=self.micro_batch_size,
                            seq_len=self.seq_len, num_layers=self.num_layers, timeout=self.timeout)


def _rank_main(rank: int, world: int, opts: TraceOptions) -> dict:
    import ds_dhelix
    from hf_models.registry import load_config

    from .modes import build_model
    from .world import make_batches
    bench = opts.bench_options()
    trace = {"enabled": True, "path": os.path.abspath(opts.out), "steps": opts.steps}
    bench = replace(bench, extra_dhelix={"trace": trace})
    batches = make_batches(bench, load_config(opts.model).vocab_size)
    config = bench.dhelix_ds_config(opts.schedule, opts.link_gbps)
    engine, *_ = ds_dhelix.initialize(model=build_model(bench), config=config, example_batch=batches[0])
    steps = []
    for _ in range(opts.steps):
        engine.train_batch(iter(batches))
        s = engine.last_stats
        steps.append({"step_s": s.step_s, "compute_s": s.compute_s, "comm_s": s.comm_s,
                      "exposed_s": s.exposed_s, "num_comms": s.num_comms})
    engine.destroy()
    return {"rank": rank, "steps": steps}


def _link_main(opts: TraceOptions) -> list[dict]:
    from ds_dhelix.spawn import run_ranks
    return run_ranks(_rank_main, opts.tp, args=(opts,), timeout=opts.timeout)


def record_trace(opts: TraceOptions) -> dict:
    """Run the traced steps; return ``{"path", "shaped", "per_rank_steps"}``. The trace file is
    written by the engine (rank 0 merges every rank's spans)."""
    from ds_dhelix.linkemu import link_emulation_available, run_in_link
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    per_rank = run_in_link(_link_main, opts.link_gbps, args=(opts,), timeout=opts.timeout + 30)
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
