"""``dhelix predict``: will SI pay on my cluster? Step time, exposed communication and tokens/s of
sequential, SI, intra and the pipeline schedules, projected from the model, the layout and the
hardware, without a GPU and without processes (``ds_dhelix.predict``).

    dhelix predict --model /ckpt/llama-70b --tp 8 --pp 2 --dp 4 --seq-len 4096 --micro-batch-size 1 \\
        --micro-batches 16 --hardware H100
    dhelix predict --model tiny-llama --tp 2 --hardware cpu --table T.json --link-gbps 2

GPUs: per-op costs from a roofline (GEMM and attention FLOPs at a stated fraction of peak,
memory-bound ops at memory bandwidth, collectives on the link their group crosses), then the
executor's order, the planner and the pipeline replay the engine would use. ``--hardware cpu``:
the same, fed by this machine's overlap table (``dhelix profile``) and an emulated link, to check
the projection against ``dhelix bench`` here. Context parallelism is projected as Ulysses. What it
assumes and cannot know: docs/guides/predict.md.
"""

from __future__ import annotations

import argparse
import json

from ds_dhelix.config.flags import RawDescriptionDefaultsFormatter
from ds_dhelix.predict.pipeline import PIPE_MODES
from ds_dhelix.predict.step import MODES

from .common import Default, add_layout_flags

MODE_NAMES = tuple(dict.fromkeys(MODES + PIPE_MODES))


def register(sub) -> None:
    p = sub.add_parser(
        "predict",
        help="project step time / tokens/s of sequential, SI, intra and pipeline "
        "schedules on a cluster (roofline) or on this CPU (profiled table)",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsFormatter,
    )
    add_layout_flags(
        p,
        ("model", "tp", "ep", "cp", "pp", "dp", "seq_len", "micro_batch_size", "micro_batches"),
        notes={"model": ", or a config.json file (the prediction needs only the shapes)"},
    )
    p.add_argument(
        "--schedule",
        nargs="+",
        default=None,
        metavar="MODE",
        choices=MODE_NAMES,
        help=f"schedules to project (default: all that apply): {' '.join(MODES)}; with --pp > 1: "
        f"{' '.join(PIPE_MODES)}",
    )
    p.add_argument(
        "--hardware",
        required=True,
        help="a preset (A40, A800, H100, H200), a YAML file of one system, or cpu (with --table)",
    )
    p.add_argument(
        "--intra-link",
        default=None,
        help="replace the system's link inside a node (nvlink3, nvlink4, nvlink-a800, pcie4, pcie5)",
    )
    p.add_argument(
        "--network", default=None, help="replace the system's network (ib100, ib200, ib400, eth25, eth50, eth100)"
    )
    p.add_argument("--nics-per-node", type=int, default=None, help="replace the system's network ports per node")
    p.add_argument("--gpus-per-node", type=int, default=None, help="replace the system's GPUs per node")
    p.add_argument(
        "--table",
        default=None,
        metavar="T.json",
        help="--hardware cpu: this machine's overlap table (dhelix profile, unshaped or at --link-gbps)",
    )
    add_layout_flags(
        p,
        ("link_gbps",),
        {"link_gbps": Default(argparse.SUPPRESS, "none; --hardware cpu needs it: the link the table is used at")},
    )
    _add_training_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=run)


def _add_training_flags(p) -> None:
    """How the projected run trains: dtype, ZeRO stage, where the data-parallel reduction runs."""
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="activations and weights (default bf16 on GPUs, fp32 with cpu)",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=0,
        help="ZeRO stage: 1 and 2 split the optimizer's update over the data-parallel ranks; 3 adds each "
        "block's parameter gathers and gradient reduce-scatters on the data-parallel group (default 0)",
    )
    p.add_argument(
        "--dp-end",
        action="store_true",
        help="the data-parallel gradient reduction after the last backward, as with "
        '"overlap_grad_reduction": false (default: during it, as the engine runs it on one stage)',
    )
    p.add_argument(
        "--unfused",
        action="store_true",
        help='price every op on its own, as with "fuse_ops": false (default: the COMP ops between two '
        "collectives as one op, as the engine runs them); with --hardware cpu the table must be timed the same way",
    )


def check_args(args) -> None:
    """Flags that do not go together: ValueError naming them, before anything is built."""
    args.link_given = "link_gbps" in vars(args)  # (--link-gbps unshaped is None too)
    args.link_gbps = getattr(args, "link_gbps", None)
    cpu = args.hardware == "cpu"
    gpu_only = [
        f"--{k.replace('_', '-')}"
        for k in ("intra_link", "network", "nics_per_node", "gpus_per_node")
        if getattr(args, k) is not None
    ]
    if cpu and gpu_only:
        raise ValueError(
            f"{', '.join(gpu_only)}: these describe a GPU system; --hardware cpu has one emulated link (--link-gbps)"
        )
    if cpu and not args.table:
        raise ValueError("--hardware cpu needs --table T.json (dhelix profile on this machine) and --link-gbps")
    if cpu and not args.link_given:
        raise ValueError("--hardware cpu needs --link-gbps G (Gbit/s of the emulated link, or 'unshaped')")
    if not cpu and (args.table or args.link_given):
        raise ValueError(
            "--table and --link-gbps feed --hardware cpu; a GPU system's links come from --hardware "
            "(and --intra-link, --network, --nics-per-node)"
        )
    if cpu and args.zero_stage == 3:
        raise ValueError(
            "--zero-stage 3 with --hardware cpu: the overlap table holds no gather times; project ZeRO-3 on a GPU "
            "system (--hardware), or measure it here with dhelix bench --zero 3"
        )
    if cpu and args.dtype not in (None, "fp32"):
        raise ValueError(f"--dtype {args.dtype} with --hardware cpu: the CPU world runs fp32")


def layout_of(args, config):
    from ds_dhelix.config.dims import ParallelDims
    from ds_dhelix.predict.shapes import RunLayout

    dp = args.ep if args.dp is None else args.dp
    if dp < 1:
        raise ValueError(f"--dp {dp} must be >= 1")
    dims = ParallelDims(args.tp * args.cp * args.pp * dp, tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit and args.seq_len > limit:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's {limit} positions")
    dtype = args.dtype or ("fp32" if args.hardware == "cpu" else "bf16")
    return RunLayout(
        dims,
        args.seq_len,
        args.micro_batch_size,
        args.micro_batches,
        dtype,
        args.zero_stage,
        overlap_grad_reduction=not args.dp_end,
    )


def times_source(args, outline, shape, layout):
    """(``times_of(micro_batch_size)``, hardware description, plans from the table or None)."""
    from ds_dhelix.predict.costs import roofline_times

    if args.hardware != "cpu":
        from ds_dhelix.predict.hardware import load_hardware

        hw = load_hardware(
            args.hardware,
            intra_link=args.intra_link,
            network=args.network,
            nics_per_node=args.nics_per_node,
            gpus_per_node=args.gpus_per_node,
        )
        return (lambda b: roofline_times(outline, shape, layout.with_micro_batch(b), hw)), hw.describe(), None
    from ds_dhelix.planning.plan import default_plan
    from ds_dhelix.planning.planner import OverlapTable, plan_dp
    from ds_dhelix.predict.cpu import table_times

    table = OverlapTable.load(args.table)

    def times_of(b):
        if b != layout.micro_batch_size:
            raise ValueError(f"the table holds op times at micro-batch size {layout.micro_batch_size}, not {b}")
        return table_times(table, outline, shape, layout, args.link_gbps)

    plans = {"default": default_plan(table.fwd_ops, table.bwd_ops), "dp": plan_dp(table)}
    return times_of, {"name": "cpu", "table": args.table, "table_meta": table.meta, "link_gbps": args.link_gbps}, plans


def predict(args) -> dict:
    from ds_dhelix.predict.report import choose_modes, project
    from ds_dhelix.predict.shapes import model_shape
    from hf_models.outline import config_of, model_outline

    check_args(args)
    config = config_of(args.model)
    layout = layout_of(args, config)
    outline, shape = model_outline(config, layout.dims, fused=not args.unfused), model_shape(config)
    times_of, hardware, plans = times_source(args, outline, shape, layout)
    modes, skipped = choose_modes(args.schedule, layout, half_times=args.hardware != "cpu")
    result = project(shape, layout, times_of, modes, plans)
    notes = times_of(layout.micro_batch_size).notes
    return {
        "model": {"name": args.model, **vars(shape)},
        "layout": {
            "world": layout.dims.world,
            "tp": args.tp,
            "cp": args.cp,
            "ep": args.ep,
            "pp": args.pp,
            "dp": layout.dims.dp,
            "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch_size,
            "micro_batches": args.micro_batches,
            "dtype": layout.dtype,
            "zero_stage": args.zero_stage,
            "overlap_grad_reduction": layout.overlap_grad_reduction,
            "fuse_ops": not args.unfused,
            "tokens_per_step": layout.tokens_per_step,
        },
        "hardware": hardware,
        "assumptions": assumptions(hardware, notes),
        **result,
        "skipped": skipped,
    }


def assumptions(hardware: dict, notes: dict) -> dict:
    """What the projection assumed (GPU: the hardware's assumptions; CPU: what was fitted here)."""
    common = {
        "routing": "MoE routing balanced: every rank's experts receive its tokens x top-k rows",
        "step_end": "the TP-replicated gradients' all-reduce and the optimizer run after the step's last "
        "backward; the data-parallel reduction on one stage during it, each block's share launched as its "
        "backward ends, one after another on the link (its own link: no contention with TP's collectives "
        "modelled), unless --dp-end; on a pipeline after it",
    }
    if hardware.get("name") == "cpu":
        return {**common, **notes, "link": "one loopback shaped to --link-gbps carries every rank's traffic"}
    return {**common, **hardware["assumptions"]}


def run(args) -> int:
    result = predict(args)
    if args.json:
        print(json.dumps(result, indent=1, default=str), file=args.stdout)
        return 0
    print_text(result)
    return 0


def print_text(r: dict) -> None:
    lay, hw = r["layout"], r["hardware"]
    where = (
        f"cpu, table {hw['table']}, link {hw['link_gbps'] or 'unshaped'} Gbit/s"
        if hw["name"] == "cpu"
        else f"{hw['name']}: {hw['gpu']['name']} x {hw['gpus_per_node']} per node, {hw['intra_link']['name']}, "
        f"{hw['nics_per_node']} x {hw['network']['name']}"
    )
    print(
        f"{r['model']['name']}: world {lay['world']} = tp {lay['tp']} x cp {lay['cp']} x pp {lay['pp']} x dp "
        f"{lay['dp']} (ep {lay['ep']}), {lay['micro_batches']} x {lay['micro_batch_size']} x {lay['seq_len']} "
        f"tokens per data-parallel group, {lay['dtype']}{'' if lay['fuse_ops'] else ', unfused'}; {where}"
    )
    print(f"{'mode':<14}{'step ms':>11}{'exposed comm ms':>17}{'tokens/s':>14}{'vs sequential':>15}")
    for mode, m in r["modes"].items():
        vs = f"{m['speedup_vs_sequential']:.3f}x" if "speedup_vs_sequential" in m else "-"
        bubble = f"  bubble {m['bubble_fraction']:.3f}" if "bubble_fraction" in m else ""
        print(
            f"{mode:<14}{m['step_time_s'] * 1e3:>11.1f}{m['exposed_comm_s'] * 1e3:>17.1f}"
            f"{m['tokens_per_s']:>14.0f}{vs:>15}{bubble}"
        )
    g = r["si_gain"]
    if g:
        print(f"SI's predicted gain: {g['mode']} {g['speedup']:.3f}x the tokens/s of {g['baseline']}")
    step = r["per_step"]
    print(
        f"per step: compute {step['compute_s'] * 1e3:.1f} ms, collectives {step['comm_s'] * 1e3:.1f} ms "
        f"(ideal overlap {step['ideal_speedup']:.2f}x), once per step "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in step["tail_s"].items())
    )
    whole, exposed = step["dp_grads_whole_s"], step["tail_s"].get("dp_grads", 0.0)
    if whole > exposed:
        print(
            f"data-parallel gradient reduction: {whole * 1e3:.1f} ms, {exposed * 1e3:.1f} ms of it after the "
            f"last backward (the rest during it; --dp-end: all after)"
        )
    for mode, why in r["skipped"].items():
        print(f"not projected: {mode}: {why}")
    print("assumptions: " + "; ".join(f"{k} {v}" for k, v in r["assumptions"].items()))
