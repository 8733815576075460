"""``dhelix plan``: search the SI plan for an overlap table and print it.

dhelix plan --table TABLE.json [--exhaustive] [--json] [--out PLAN.json]
dhelix plan --synthetic llama70b|llama70b-fine|tiny [--seed N] ...
"""

from __future__ import annotations

import argparse
import json
import random
import time

from ds_dhelix.planning import planner
from ds_dhelix.planning.plan import default_plan, sequential_plan

SYNTHETIC = ("llama70b", "llama70b-fine", "tiny")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="search the SI plan (DP) for an overlap table",
        description="Search the optimal strand-interleaving plan for an overlap table with the exact "
        "DP, print it as a two-lane timeline with its predicted time, and optionally check "
        "it against exhaustive search.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--table", metavar="TABLE.json", help="overlap table written by `dhelix profile`")
    source.add_argument(
        "--synthetic", choices=SYNTHETIC, help="demo on a synthetic table (illustrative times, not measurements)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the synthetic table")
    parser.add_argument(
        "--exhaustive", action="store_true", help="also run the brute-force reference search and report its optimum"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--out", metavar="PLAN.json", help="write the plan here (JSON)")
    parser.set_defaults(func=run)


def load_table(args: argparse.Namespace) -> planner.OverlapTable:
    if args.table:
        return planner.OverlapTable.load(args.table)
    rng = random.Random(args.seed)
    if args.synthetic == "tiny":
        ops = planner.TINY_LAYER_OPS
        return planner.synthetic_table(ops, tuple(reversed(ops)), rng, meta={"device": "synthetic", "model": "tiny"})
    return planner.llama70b_table(rng, fine=args.synthetic == "llama70b-fine")


def run(args: argparse.Namespace) -> int:
    table = load_table(args)
    t0 = time.perf_counter()
    plan = planner.plan_dp(table)
    result = {
        "predicted_ms": plan.predicted_ms,
        "dp_seconds": time.perf_counter() - t0,
        "default_ms": planner.predict_ms(table, default_plan(table.fwd_ops, table.bwd_ops)),
        "sequential_ms": planner.predict_ms(table, sequential_plan(table.fwd_ops, table.bwd_ops)),
        "fingerprint": plan.fingerprint(),
    }
    if args.exhaustive:
        t0 = time.perf_counter()
        reference = planner.plan_exhaustive(table)
        result["exhaustive_seconds"] = time.perf_counter() - t0
        result["exhaustive_ms"] = reference.predicted_ms
    if args.out:
        plan.save(args.out)
    if args.json:
        print(json.dumps(dict(result, plan=plan.to_dict()), indent=1), file=args.stdout)
        return 0
    print(plan.render_text(planner.round_costs(table, plan)))
    for key, value in result.items():
        print(f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}")
    return 0
