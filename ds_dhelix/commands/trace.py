"""``dhelix trace``: run a few SI (or sequential) steps on a CPU gloo world of tp x cp x ep ranks
with the engine's trace on, write the merged Chrome/Perfetto trace and print its lanes and spans.

    dhelix trace --model tiny-llama --tp 2 --steps 3 --out trace.json --link-gbps 2

Open the file in ui.perfetto.dev or chrome://tracing: one process per rank, a ``compute`` lane and
one communication lane per strand (``comm:tp:F``, ``comm:tp:B``); spans are named by op, with the
strand and micro-batch in their args. ``python -m benchmarks.trace_analysis trace.json`` (research)
says where the compute lane waited and re-times each pair on an idealised machine.
"""

from __future__ import annotations

import json

from ds_dhelix.bench.tracing import TraceOptions
from ds_dhelix.config.flags import RawDescriptionDefaultsFormatter

from .common import add_layout_flags, check_model, stdout_to_stderr


def register(sub) -> None:
    p = sub.add_parser(
        "trace",
        help="Chrome/Perfetto trace of a few SI steps (compute + comm lanes per rank)",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsFormatter,
    )
    add_layout_flags(p, ("model", "tp", "cp", "cp_comm", "ep"))
    p.add_argument(
        "--schedule",
        default="si",
        choices=["si", "si-ends", "si-plan", "sequential"],
        help="si: reactive pairs (default); si-ends: reactive, first two forwards and last two "
        "backwards paired too (pair_ends); si-plan: the default SI plan with barriers; "
        "sequential: no overlap",
    )
    p.add_argument(
        "--planned",
        action="store_true",
        help="SI run by the planner's plan (planner.profile=auto: profile, then DP search)",
    )
    p.add_argument(
        "--planner-cache",
        default=None,
        metavar="DIR",
        help="overlap-table cache for --planned (default: the planner's, ~/.cache/ds_dhelix)",
    )
    p.add_argument(
        "--unfused",
        action="store_true",
        help="run every op of the adapter on its own (fuse_ops false): a span per op (attn.core) instead of "
        "per run of ops between two collectives (attn.qkv+attn.core+attn.out)",
    )
    p.add_argument("--steps", type=int, default=3, help="optimizer steps to trace")
    add_layout_flags(p, ("micro_batches", "micro_batch_size", "seq_len", "num_layers", "link_gbps", "link_burst_kb"))
    p.add_argument("--out", default="trace.json", help="trace file to write")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the world is killed")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ds_dhelix.bench.tracing import record_trace, summarize_trace
    from ds_dhelix.runtime.trace import validate_trace

    opts = TraceOptions(
        out=args.out,
        model=args.model,
        tp=args.tp,
        ep=args.ep,
        cp=args.cp,
        cp_comm=args.cp_comm,
        schedule=args.schedule,
        planned=args.planned,
        planner_cache=args.planner_cache,
        unfused=args.unfused,
        steps=args.steps,
        micro_batches=args.micro_batches,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        num_layers=args.num_layers,
        link_gbps=args.link_gbps,
        link_burst_kb=args.link_burst_kb,
        timeout=args.timeout,
    )
    check_model(opts.bench_options())
    with stdout_to_stderr(args.json):
        run_info = record_trace(opts)
    with open(run_info["path"]) as f:
        trace = json.load(f)
    problems = validate_trace(trace, lanes=("compute",))
    summary = summarize_trace(trace)
    if args.json:
        print(json.dumps({**run_info, "summary": summary, "problems": problems}, indent=1), file=args.stdout)
        return 0 if not problems else 1
    _print_summary(opts, run_info, summary)
    if problems:
        print(f"  INVALID trace: {len(problems)} problem(s), first: {problems[0]}")
        return 1
    print("  valid Chrome trace (lanes named, spans ordered and non-overlapping); open in ui.perfetto.dev")
    return 0


def _print_summary(opts: TraceOptions, run_info: dict, summary: dict) -> None:
    link = (
        "unshaped loopback"
        if opts.link_gbps is None
        else f"{opts.link_gbps:g} Gbit/s" + ("" if run_info["shaped"] else " (emulation unavailable: ran UNSHAPED)")
    )
    what = f"{opts.schedule}{' (planned)' if opts.planned else ''}"
    print(f"trace of {opts.steps} {what} steps, {opts.model} TP={opts.tp}, {link}: {run_info['path']}")
    print(f"  {summary['wall_ms']:.0f} ms from first to last span")
    for rank, lanes in summary["ranks"].items():
        for lane, entry in lanes.items():
            ops = ", ".join(entry["ops"][:6]) + (", ..." if len(entry["ops"]) > 6 else "")
            print(f"  rank {rank}  {lane:<12} {entry['spans']:6d} spans  {entry['busy_ms']:9.1f} ms busy  ({ops})")
    for r in run_info["per_rank_steps"]:
        s = r["steps"][-1]
        print(
            f"  rank {r['rank']} last step: {s['step_s'] * 1e3:.0f} ms, compute {s['compute_s'] * 1e3:.0f} ms, "
            f"comm {s['comm_s'] * 1e3:.0f} ms ({s['exposed_s'] * 1e3:.0f} ms exposed), {s['num_comms']} collectives"
        )
