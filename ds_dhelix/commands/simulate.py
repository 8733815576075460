"""``dhelix simulate``: replay a schedule's instruction lists for every rank and print the timeline.

Any schedule of the registry: a folded pipeline's (w, dualpipev, sequential with --pp) or a
one-stage one (sequential, si, si-ends, intra, ... without --pp; --stages and --microbatches, the
old spellings, still read). Checks deadlocks, send/recv matching, buffer use and work coverage
(:mod:`ds_dhelix.schedule.simulate`), and prints the bubble fraction, replayed and in closed form.
Exit status 0 when the replay finds no error, 1 otherwise.
"""

from __future__ import annotations

import json

from ds_dhelix.commands.common import Default, add_layout_flags
from ds_dhelix.config.flags import RawDescriptionDefaultsFormatter
from ds_dhelix.schedule.registry import ONE_STAGE, PIPELINE, REGISTRY, lookup, names
from ds_dhelix.schedule.simulate import replay, resolve_pair_cost, sequential_bubble_closed_form, w_bubble_closed_form

CLOSED_FORMS = {"w": "(p-1)c / (p(F+B) + (m-1)c)", "sequential": "1 - 1/p"}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a schedule's instruction lists (W, DualPipeV+SI, SI, intra, ...)",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsFormatter,
    )
    parser.add_argument(
        "--schedule",
        choices=names(built=True),
        default="w",
        help="; ".join(
            f"{row.name}: {row.summary}"
            for row in REGISTRY
            if row.build is not None and (row.layout == PIPELINE or row.name not in names(PIPELINE))
        )
        + " (default: w)",
    )
    add_layout_flags(
        parser,
        ("pp", "micro_batches"),
        {"pp": Default(None, "one stage: a one-stage schedule")},
        required=("micro_batches",),
        aliases={"pp": ("--stages",), "micro_batches": ("--microbatches",)},
    )
    parser.add_argument("--fwd-cost", type=float, default=1.0, help="forward time F of one chunk")
    parser.add_argument("--bwd-cost", type=float, default=2.0, help="backward time B of one chunk")
    parser.add_argument(
        "--pair-cost",
        default="max",
        help="time of one co-executed F/B pair: 'max' = max(F, B) (perfect "
        "overlap, default), 'sum' = F+B (no overlap), or a number",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.set_defaults(func=run)


def _pair_cost_arg(text: str):
    if text in ("max", "sum"):
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--pair-cost={text!r}: use 'max', 'sum' or a number") from None


def _closed_form(name: str, p: int, m: int, F: float, B: float, c: float) -> float | None:
    if name == "sequential":
        return sequential_bubble_closed_form(p, m, F, B)
    if name == "w" and c >= max(F, B):
        return w_bubble_closed_form(p, m, F, B, c)
    return None  # dualpipev: no closed form; w with c < max(F, B): outside the derivation


def run(args) -> int:
    F, B = args.fwd_cost, args.bwd_cost
    c = resolve_pair_cost(F, B, _pair_cost_arg(args.pair_cost))
    one_stage = args.pp is None
    if one_stage and args.schedule not in names(ONE_STAGE):
        raise ValueError(f"--schedule {args.schedule} is a pipeline schedule: pass --pp (pipeline stages)")
    p, m = (1 if one_stage else args.pp), args.micro_batches
    spec = lookup(args.schedule, ONE_STAGE if one_stage else PIPELINE)
    result = replay(spec.schedule(p, m), spec.units(m), F, B, c, one_stage=one_stage)
    closed = None if one_stage else _closed_form(args.schedule, p, m, F, B, c)
    if args.json:
        print(
            json.dumps(
                {
                    "schedule": args.schedule,
                    "stages": p,
                    "microbatches": m,
                    "fwd_cost": F,
                    "bwd_cost": B,
                    "pair_cost": c,
                    "ok": result.ok,
                    "errors": [str(e) for e in result.errors],
                    "makespan": result.makespan,
                    "bubble_fraction": result.bubble_fraction,
                    "bubble_closed_form": closed,
                    "closed_form": CLOSED_FORMS.get(args.schedule) if closed is not None else None,
                    "peak_activations": result.peak_activations,
                    "timeline": [
                        [{"start": ev.start, "end": ev.end, "label": ev.instruction.label()} for ev in events]
                        for events in result.events
                    ],
                },
                indent=1,
            ),
            file=args.stdout,
        )
        return 0 if result.ok else 1
    where = "one stage" if one_stage else f"p={p} stages"
    print(f"schedule {args.schedule}: {where}, m={m} micro-batches, F={F:g} B={B:g} pair={c:g}")
    print(result.render_timeline())
    print(f"makespan {result.makespan:g}; chunk activations held at peak per rank {result.peak_activations}")
    formula = f" = {CLOSED_FORMS[args.schedule]}" if closed is not None else ""
    closed_text = f"{closed:.4f}{formula}" if closed is not None else "n/a"
    print(f"bubble fraction: replayed {result.bubble_fraction:.4f}, closed form {closed_text}")
    for err in result.errors:
        print(f"error: {err}")
    print("ok" if result.ok else f"error: {len(result.errors)} problem(s) found")
    return 0 if result.ok else 1
