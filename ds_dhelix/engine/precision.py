"""Mixed precision around the executor: the loss scale an fp16 step's backward is seeded with, and
whether the device can run fp16 at all.

DeepSpeed applies the fp16 loss scale inside ``engine.backward``; the ds_dhelix executor runs
backward itself, so each micro-batch's loss gradient is seeded with ``loss_scale / m`` instead of
``1 / m``. DeepSpeed's optimizer then does the rest as it would: it finds overflows (inf/NaN in
any gradient, agreed over the data- and model-parallel groups), skips that step on every rank
and lowers the scale, or unscales, clips by the unscaled norm, steps and raises the scale after
``loss_scale_window`` good steps. bf16 needs no scale.
"""

from __future__ import annotations

FP16_UNSUPPORTED = 'fp16 is not supported on this device ({device}); use bf16 ("bf16": {{"enabled": true}})'


def fp16_supported() -> tuple[bool, str]:
    """(whether DeepSpeed's accelerator runs fp16 here, the device's name)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return bool(acc.is_fp16_supported()), acc.device_name()


def check_fp16(fp16: bool) -> None:
    """One clear line before any model is built when the config asks for fp16 (``fp16.enabled``)
    the device lacks."""
    if fp16:
        ok, device = fp16_supported()
        if not ok:
            raise ValueError(FP16_UNSUPPORTED.format(device=device))


def force_fp16_capability() -> str:
    """Let DeepSpeed's accelerator report fp16 support for the rest of this process (torch computes
    fp16 on CPU, slowly); for parity checks and tests of the fp16 path on CPU. Returns the note a
    report should carry."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if not acc.is_fp16_supported():
        acc.is_fp16_supported = lambda: True
        return f"fp16 forced on {acc.device_name()}: DeepSpeed's fp16 capability check overridden for this run"
    return ""


def loss_seed(engine, num_microbatches: int) -> float:
    """The gradient each micro-batch's loss is seeded with: ``loss_scale / m`` under fp16 (the
    optimizer's current scale), ``1 / m`` otherwise; times the context-parallel size: DeepSpeed
    averages gradients over DP x CP ranks, and each CP rank's gradient is its sequence shard's share
    of the sum over CP (``groups.py``)."""
    scale = engine._get_optimizer_loss_scale() if engine.fp16_enabled() else None
    cp = engine.groups.cp_size
    return (1.0 if scale is None else float(scale)) * cp / num_microbatches
