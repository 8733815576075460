"""``dhelix parity``: sequential vs a schedule vs unsharded HF, on a CPU gloo world."""

from __future__ import annotations

import json

from .common import Default, add_layout_flags


def register(sub) -> None:
    p = sub.add_parser("parity", help="check that a schedule trains exactly like sequential (and close to HF)")
    add_layout_flags(
        p, ("model", "tp", "dp", "ep", "cp", "cp_comm"), {"tp": Default(None, "2; 1 with --pp > 1 or --ep > 1")}
    )
    p.add_argument(
        "--schedule",
        default="si",
        choices=["si", "sequential", "intra", "w", "dualpipev"],
        help="si/sequential/intra: one stage (intra is held to sequential within tolerances, not "
        "bitwise); w/dualpipev (or sequential): the folded pipeline with --pp",
    )
    add_layout_flags(p, ("pp",))
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0 = off)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps each leg trains")
    add_layout_flags(
        p, ("micro_batches", "micro_batch_size", "seq_len"), {"micro_batches": 4, "micro_batch_size": 2, "seq_len": 64}
    )
    _add_leg_flags(p)
    _add_lora_moe_flags(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the world is killed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def _add_leg_flags(p) -> None:
    """How the legs train: ZeRO stage, dropout, packing, recompute, precision."""
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2], help="ZeRO stage")
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="set every dropout rate of the model (SI vs sequential stays bitwise; HF is then compared "
        "with dropout off, on the first step). A model whose own config has dropout or router "
        "jitter / noise is compared the same way, and the output names what was switched off",
    )
    p.add_argument(
        "--packing",
        default="concat",
        choices=["concat", "docs"],
        help="docs: random documents of random lengths per row (position_ids restart, attention masked "
        "across documents; HF gets the same block-diagonal mask)",
    )
    p.add_argument(
        "--recompute",
        default="none",
        choices=["none", "selective", "full"],
        help="dhelix.recompute of both trained legs (peak_activation_bytes shows what it saves)",
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="DeepSpeed precision (bf16 / fp16 with its loss scaler; fp16 is forced on a CPU without it, "
        "and the output says so); the HF comparison runs in fp32 only",
    )
    p.add_argument(
        "--head-chunk",
        type=int,
        default=0,
        metavar="N",
        help="dhelix.head_chunk of the trained legs: the LM head and loss N tokens at a time (0: whole)",
    )


def _add_lora_moe_flags(p) -> None:
    """A PEFT LoRA model on every leg; MoE capacity and kernels."""
    p.add_argument(
        "--lora-r",
        type=int,
        default=0,
        metavar="R",
        help="every leg trains a PEFT LoRA of rank R (alpha 2R; B drawn, not zero, so the adapter's "
        "forward is compared) on --lora-targets; 0: the whole model",
    )
    p.add_argument(
        "--lora-targets",
        default=None,
        metavar="NAMES",
        help="comma-separated module names for --lora-r (default: every attention and MLP projection)",
    )
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        metavar="CF",
        help="MoE: expert capacity factor (copies past ceil(CF x tokens x top-k / experts) per expert "
        "are dropped); default: dropless",
    )
    p.add_argument(
        "--moe-kernels",
        default="torch",
        choices=["torch", "tutel"],
        help="MoE dispatch / combine kernels (dhelix.moe.kernels); tutel: the first step is also "
        "compared with torch's kernels (vs_torch_kernels)",
    )


def _lora(args) -> dict:
    """The legs' LoraConfig keys of --lora-r / --lora-targets ({}: no LoRA)."""
    if args.lora_r < 0:
        raise ValueError(f"--lora-r must be >= 1 (or 0: the whole model), got {args.lora_r}")
    if not args.lora_r:
        if args.lora_targets:
            raise ValueError("--lora-targets names LoRA's modules: add --lora-r R")
        return {}
    from hf_models.adapters import check_lora_targets
    from hf_models.registry import load_config

    names = [t.strip() for t in args.lora_targets.split(",") if t.strip()] if args.lora_targets else None
    targets = check_lora_targets(load_config(args.model), names, "--lora-targets")
    return {"r": args.lora_r, "lora_alpha": 2 * args.lora_r, "target_modules": targets}


def _moe_extra(args) -> dict:
    """The legs' expert_parallel / moe keys of --ep, --capacity-factor and --moe-kernels."""
    ep = {"size": args.ep} if args.ep > 1 else {}
    if args.capacity_factor is not None:
        if not args.capacity_factor > 0:
            raise ValueError(f"--capacity-factor {args.capacity_factor} must be > 0 (leave it out for dropless)")
        ep["capacity_factor"] = args.capacity_factor
    extra = {"expert_parallel": ep} if ep else {}
    if args.moe_kernels != "torch":
        extra["moe"] = {"kernels": args.moe_kernels}
    return extra


def run(args) -> int:
    from ds_dhelix.verify import ParityOptions, run_parity

    if args.tp is None:
        args.tp = 2 if args.pp == 1 and args.ep == 1 else 1
    if args.dp is None:
        args.dp = args.ep
    if not 0.0 <= args.dropout < 1.0:
        raise ValueError(f"--dropout {args.dropout}: a rate in [0, 1)")
    for name in ("tp", "dp", "ep", "pp", "cp", "steps", "micro_batches", "micro_batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.head_chunk < 0:
        raise ValueError(f"--head-chunk must be >= 0 (0: the logits whole), got {args.head_chunk}")
    opts = ParityOptions(
        model=args.model,
        tp=args.tp,
        dp=args.dp,
        schedule=args.schedule,
        steps=args.steps,
        micro_batches=args.micro_batches,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        zero_stage=args.zero,
        pp=args.pp,
        clip=args.clip,
        dtype=args.dtype,
        dropout=args.dropout,
        recompute=args.recompute,
        packing=args.packing,
        cp=args.cp,
        cp_comm=args.cp_comm,
        lora=_lora(args),
        extra={**_moe_extra(args), **({"head_chunk": args.head_chunk} if args.head_chunk else {})},
    )
    from ds_dhelix.verify.options import check_options

    check_options(opts)
    result = run_parity(opts, timeout=args.timeout)
    if args.json:
        print(json.dumps(result, indent=1), file=args.stdout)
    else:
        _print_result(args, opts, result)
    return 0 if result["ok"] else 1


def _print_result(args, opts, result: dict) -> None:
    """The text form of a parity result."""
    from ds_dhelix.verify import pipe_label

    s = args.schedule if args.pp == 1 else pipe_label(opts)
    print(
        f"{args.model} pp={args.pp} tp={args.tp} cp={args.cp}{' (ring)' if args.cp_comm == 'ring' else ''} dp={args.dp} ep={args.ep} zero={args.zero} {args.steps} steps x "
        f"{args.micro_batches} micro-batches"
    )
    print(f"  losses sequential: {result['losses']['sequential']}")
    print(f"  losses {s}:{' ' * (10 - len(s))} {result['losses'][s]}")
    if "hf" in result["losses"]:
        print(f"  losses hf:         {result['losses']['hf']}")
    ref = "PP=1 sequential" if args.pp > 1 else "sequential"
    same = "BITWISE EQUAL" if result["bitwise_equal"] else "DIFFERENT"
    print(f"  {s} vs {ref}: {same} (max |param diff| {result['max_abs_diff_vs_sequential']:.3g})")
    if "intra_tolerance" in result:
        grads = result.get("max_grad_diff_vs_sequential")
        print(
            f"  intra vs sequential: max |loss diff| {result['max_loss_diff_vs_sequential']:.3g}"
            + (f", max |first-step grad diff| {grads:.3g}" if grads is not None else "")
            + f" (held to: {result['intra_tolerance']})"
        )
    if "bitwise_equal_to_half_microbatches" in result:
        same = "BITWISE EQUAL" if result["bitwise_equal_to_half_microbatches"] else "DIFFERENT"
        print(f"  intra vs sequential over half-size micro-batches (2x as many): {same}")
    if result["hf_close"] is None:
        print(f"  vs unsharded HF: {result['hf_comparison']}")
    else:
        print(
            f"  vs unsharded HF: max |first-step grad diff| {result['max_abs_diff_vs_hf']:.3g}, "
            f"max |loss diff| {result['max_loss_diff_vs_hf']:.3g} (tolerances "
            f"{result['hf_grad_tolerance']:.3g} / {result['hf_loss_tolerance']:g}: "
            f"{'ok' if result['hf_close'] else 'EXCEEDED'})"
        )
        if result["hf_stochastic_off"]:
            from ds_dhelix.verify import describe_settings

            print(
                f"  HF compared with these switched off, on the first step only (the trained legs keep "
                f"them): {describe_settings(result['hf_stochastic_off'])}"
            )
    if "vs_torch_kernels" in result:
        k = result["vs_torch_kernels"]
        print(
            f"  {k['kernels']} kernels vs torch kernels (first step): loss "
            f"{'BITWISE EQUAL' if k['loss_bitwise_equal'] else 'DIFFERENT'}, max |grad diff| "
            f"{k['max_first_step_grad_diff']:.3g} (tolerance {k['grad_tolerance']:.3g}: "
            f"{'ok' if k['close'] else 'EXCEEDED'})"
        )
    if result["note"]:
        print(f"  note: {result['note']}")
    pk = result["peak_activation_bytes"]
    print(
        f"  peak activation bytes: sequential {pk['sequential']}, {s} {pk[s]} ({pk[s] / max(pk['sequential'], 1):.3f}x)"
    )
