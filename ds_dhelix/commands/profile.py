"""``dhelix profile``: measure the operator overlap table of one decoder layer."""

from __future__ import annotations

import json

from .common import add_layout_flags


def register(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="profile operator overlap (segments alone and co-executed)",
        description="Measure the overlap table of one decoder layer on tp x cp x ep ranks: every "
        "candidate segment alone and every allowed pair co-executed.",
    )
    add_layout_flags(p, ("model", "tp", "ep", "cp", "cp_comm", "micro_batch_size", "seq_len", "link_gbps"))
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per table entry")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per table entry (median and robust spread kept; noisy entries get more)",
    )
    p.add_argument(
        "--unfused",
        action="store_true",
        help="time the adapter's ops one by one (fuse_ops false; dhelix predict --hardware cpu then takes "
        "--unfused too); by default the layer's ops run as the engine runs them, fused between collectives",
    )
    p.add_argument("--out", required=True, help="where to write the table (JSON)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the world is killed")
    p.set_defaults(func=run)


def options(args) -> dict:
    if min(args.tp, args.cp, args.micro_batch_size, args.seq_len, args.repeats) < 1:
        raise ValueError("--tp, --cp, --micro-batch-size, --seq-len and --repeats must be >= 1")
    from ds_dhelix.config.dims import ParallelDims
    from hf_models.adapters import check_model
    from hf_models.registry import load_config

    dims = ParallelDims(args.tp * args.cp * args.ep, tp=args.tp, ep=args.ep, cp=args.cp, cp_comm=args.cp_comm)
    check_model(dims, load_config(args.model))
    dims.check_seq_len(args.seq_len, "--seq-len")
    return {
        "model": args.model,
        "tp": args.tp,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "link_gbps": args.link_gbps,
        "ep": args.ep,
        "cp": args.cp,
        "cp_comm": args.cp_comm,
        "unfused": args.unfused,
    }


def run(args) -> int:
    from ds_dhelix.bench.profile_runs import profile_world
    from ds_dhelix.planning.planner import OverlapTable
    from ds_dhelix.runtime.linkemu import run_in_link

    o = options(args)
    if args.link_gbps:
        table, seconds = run_in_link(profile_world, args.link_gbps, args=(o, args.timeout))
    else:
        table, seconds = profile_world(o, args.timeout)
    table.save(args.out)
    print(
        f"profiled {len(table.fwd_alone_ms)} forward + {len(table.bwd_alone_ms)} backward segments and "
        f"{len(table.pair_ms)} pairs in {seconds:.1f} s -> {args.out}"
    )
    i = table.info
    print(
        f"timed runs {i['timed_runs']} ({i['repeats']} per entry, then {i['noisy_remeasured_runs']} more of noisy "
        f"entries and {i['plan_refinements']} re-measurement(s) of the plan's entries)"
    )
    print(json.dumps(table.meta))
    OverlapTable.load(args.out)  # round trip check
    return 0
