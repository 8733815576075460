"""``dhelix validate-plan``: is the cost model additive, and is the DP plan the best one?"""

from __future__ import annotations

import json

from .common import add_layout_flags, link_text


def register(sub) -> None:
    p = sub.add_parser("validate-plan", help="run the DP plan and alternatives for real; predicted vs measured")
    add_layout_flags(p, ("model", "tp", "ep", "cp", "cp_comm", "link_gbps"))
    p.add_argument(
        "--table",
        required=True,
        help="overlap table from `dhelix profile`, run with the same model, layout flags and --link-gbps",
    )
    p.add_argument("--alternatives", type=int, default=8, help="random valid plans to compare")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs of each plan first")
    p.add_argument(
        "--repeats",
        type=int,
        default=60,
        help="timed runs of every plan, in an order shuffled each repetition (9 left one plan "
        "timed 4-8%% apart on a 2-core machine; 60 take ~30 s for tiny-llama's layer)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random plans and of the shuffled order")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the world is killed")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ds_dhelix.bench.profile_runs import validate_world
    from ds_dhelix.planning.planner import OverlapTable
    from ds_dhelix.runtime.linkemu import run_in_link

    table = OverlapTable.load(args.table)
    if table.meta.get("link_gbps") != args.link_gbps:
        raise ValueError(
            f"the table was profiled at --link-gbps {link_text(table.meta.get('link_gbps'))}, "
            f"this run has --link-gbps {link_text(args.link_gbps)}: use the same link or re-profile"
        )
    o = {
        "model": args.model,
        "tp": args.tp,
        "ep": args.ep,
        "cp": args.cp,
        "cp_comm": args.cp_comm,
        "table": table.to_dict(),
        "alternatives": args.alternatives,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "seed": args.seed,
    }
    if args.link_gbps:
        res = run_in_link(validate_world, args.link_gbps, args=(o, args.timeout))
    else:
        res = validate_world(o, args.timeout)
    res["link_gbps"] = args.link_gbps
    if args.json:
        print(json.dumps(res, indent=1), file=args.stdout)
        return 0
    print(f"{'plan':<12}{'rounds':>7}{'predicted ms':>20}{'measured ms':>20}{'error %':>9}")
    for r in sorted(res["rows"], key=lambda r: r["measured_ms"]):
        pred = f"{r['predicted_ms']:.3f} +-{r['predicted_spread_ms']:.3f}"
        meas = f"{r['measured_ms']:.3f} +-{r['measured_spread_ms']:.3f}"
        print(f"{r['plan']:<12}{r['rounds']:>7}{pred:>20}{meas:>20}{r['error_pct']:>9.1f}")
    print(
        "(+-: one run's spread; predicted: the table's entries' spreads in quadrature, measured: robust sigma "
        "of the timed runs)"
    )
    print(f"spearman(predicted, measured) = {res['spearman']:.3f}; mean |error| = {res['mean_abs_error_pct']:.1f}%")
    if res["dp_source"] != "dp":
        print("the planner kept the default plan: its DP plan was not faster by more than the error bars")
    print(
        f"DP plan: measured {res['dp_measured_ms']:.3f} ms, rank {res['dp_rank']}/{res['num_plans']}, "
        f"{res['dp_vs_best_pct']:+.1f}% vs best measured ({res['best_measured_plan']})"
    )
    if res["best_other_plan"] is not None:
        print(
            f"         {res['dp_vs_best_other_pct']:+.1f}% vs the best plan with other rounds ({res['best_other_plan']})"
        )
    if res["same_plan_gap_pct"] is not None:
        print(
            f"the default plan is the DP plan: the same plan measured {res['same_plan_gap_pct']:.1f}% apart "
            "(how finely this run resolves plans)"
        )
    return 0
