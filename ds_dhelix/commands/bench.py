"""``dhelix bench``: plain DeepSpeed, DeepSpeed AutoTP and ds_dhelix sequential / SI / planned SI on
the same model and world, at emulated link rates, in one run (``ds_dhelix.bench``).

    dhelix bench --link-gbps 1 2 5 10 unshaped --out benchmarks/results
    dhelix bench --quick --json

Each link rate runs the whole world in a private network namespace whose loopback is shaped by a
token-bucket filter (real TCP through gloo; needs root + iproute2, otherwise it runs unshaped and
says so). Modes alternate step by step; rows report medians.
"""

from __future__ import annotations

import sys

from ds_dhelix.bench.options import (
    DEEPSPEED_MODES,
    DEFAULT_MODES,
    MIN_REPEATS,
    MODES,
    PP_MODES,
    BenchOptions,
    check_modes_fit,
    quick,
)
from ds_dhelix.config.flags import RawDescriptionDefaultsFormatter

from .common import Default, add_layout_flags, check_model, link_text, stdout_to_stderr


def register(sub) -> None:
    d = BenchOptions()
    p = sub.add_parser(
        "bench",
        help="side-by-side throughput: DeepSpeed, AutoTP, sequential, SI (emulated links)",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsFormatter,
    )
    layout = ("model", "tp", "pp", "ep", "dp", "cp", "cp_comm", "link_gbps", "link_burst_kb", "micro_batches",
              "micro_batch_size", "seq_len", "num_layers")  # fmt: skip
    add_layout_flags(
        p,
        layout,
        {"link_gbps": Default(None, " ".join(map(link_text, d.link_gbps)))},
        sweep=True,
        given_only=True,
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        metavar="MODE",
        help=f"modes to measure, of {' '.join(MODES)} (default: {' '.join(DEFAULT_MODES)}); with "
        f"--pp: {' '.join(PP_MODES)} (default: all but auto). A ds_dhelix mode takes its activation recompute after "
        f"'+': si+full, sequential+selective; and flags: +dp-end (data-parallel reduction after the last "
        f"backward), +unfused (every op on its own, fuse_ops false): si+unfused",
    )
    _add_run_flags(p, d)
    p.set_defaults(func=run)


def _add_run_flags(p, d: BenchOptions) -> None:
    """How each mode runs (steps, ZeRO, LoRA, MoE kernels) and where the report goes."""
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps per mode (default {d.warmup})")
    p.add_argument("--repeats", type=int, default=None, help=f"timed steps per mode (default {d.repeats})")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3], help="ZeRO stage (default 0)")
    p.add_argument(
        "--lora-r",
        type=int,
        default=None,
        metavar="R",
        help="train a LoRA adapter of rank R on the frozen model in every mode (default 0: full fine-tune)",
    )
    p.add_argument(
        "--moe-kernels",
        default=None,
        choices=["torch", "tutel"],
        help="MoE dispatch / combine kernels of the ds_dhelix modes (dhelix.moe.kernels; default torch)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per link rate before the world is killed")
    p.add_argument(
        "--planner-cache",
        default=None,
        metavar="DIR",
        help="cache dir of the overlap tables si-planned profiles (default: the planner's, ~/.cache/ds_dhelix)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 layers, 4 micro-batches of seq 128, 2 Gbit/s only, 1+3 steps (< 3 min); flags given keep their values",
    )
    p.add_argument("--out", default=None, help="write bench.json/.csv/.md/.png here")
    p.add_argument("--json", action="store_true", help="print the report as JSON (progress goes to stderr)")


def options_from_args(args) -> BenchOptions:
    given = {
        "model": args.model,
        "tp": args.tp,
        "pp": args.pp,
        "ep": args.ep,
        "cp": args.cp,
        "cp_comm": args.cp_comm,
        "data_parallel": args.dp,
        "modes": args.modes,
        "link_gbps": args.link_gbps,
        "link_burst_kb": args.link_burst_kb,
        "micro_batches": args.micro_batches,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "num_layers": args.num_layers,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "zero_stage": args.zero,
        "timeout": args.timeout,
        "lora_r": args.lora_r,
        "moe_kernels": args.moe_kernels,
    }
    if args.planner_cache:
        given["extra_dhelix"] = {"planner": {"cache_dir": args.planner_cache}}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    if args.quick:
        return quick(BenchOptions(), **given)
    return BenchOptions(**given)


def check_bench_model(opts: BenchOptions, log) -> None:
    """Bad model / layout for the modes asked for: ``ValueError`` before any process starts. A model
    without a ds_dhelix adapter still runs DeepSpeed's own modes (deepspeed, autotp, autoep) when some
    are asked for; the ds_dhelix modes then become rows carrying the adapter error."""
    from hf_models.adapters import ADAPTERS
    from hf_models.registry import load_config

    config = load_config(opts.model)
    check_modes_fit(opts, config)
    if opts.moe_kernels != "torch":
        from deepspeed.accelerator import get_accelerator

        from ds_dhelix.moe.kernels import check_kernels
        from hf_models.adapters import is_moe

        check_kernels(
            opts.moe_kernels,
            moe=is_moe(config),
            fp16=False,
            device=get_accelerator().device_name(),
            hidden_size=config.hidden_size,
        )
    theirs = [m for m in opts.modes if m in DEEPSPEED_MODES]
    if opts.pp > 1 or config.model_type in ADAPTERS or not theirs:
        check_model(opts)
        return
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit and opts.seq_len > limit:
        raise ValueError(f"--seq-len {opts.seq_len} exceeds the model's {limit} positions")
    ours = [m for m in opts.modes if m not in DEEPSPEED_MODES]
    if ours:
        log(
            f"[bench] note: no ds_dhelix adapter for model_type {config.model_type!r}: {', '.join(ours)} will "
            f"report that error; {', '.join(theirs)} run on DeepSpeed alone"
        )


def run(args) -> int:
    from ds_dhelix.bench import run_bench
    from ds_dhelix.bench.report import dumps, markdown_table, write_outputs

    opts = options_from_args(args)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    check_bench_model(opts, log)
    if opts.repeats < MIN_REPEATS:
        log(
            f"[bench] note: {opts.repeats} timed steps per mode, fewer than the {MIN_REPEATS} a reported row needs: "
            f"the rows are marked repeats_below_minimum (n={opts.repeats} in the table)"
        )
    with stdout_to_stderr(args.json):  # --json: stdout carries the JSON and nothing else
        report = run_bench(opts, progress=log)
    if args.out:
        paths = write_outputs(report, args.out)
        log(f"[bench] wrote {', '.join(paths.values())}")
    if args.json:
        print(dumps(report), file=args.stdout)
    else:
        print()
        print(report["title"])
        print(markdown_table(report), end="")
        print(
            "ideal = (comp + comm) / max(comp, comm) of the sequential run; achieved/ideal = "
            "speedup vs sequential / ideal; CPU bound (CPU devices) = sequential step / the mode's "
            "CPU time per step spread over the cores: what no schedule of the mode beats here"
        )
    ok = all(r["status"] != "error" for r in report["results"] if r["mode"] in ("sequential", "si"))
    return 0 if ok else 1
