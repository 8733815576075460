"""Judging a parity run: sequential against the other schedule (bitwise) and against HF (within
``tolerances``), tutel's kernels against torch's, intra against its half-size reference."""

from __future__ import annotations

from dataclasses import asdict

import torch

from .options import ParityOptions, trained_stochastic
from .tolerances import (
    EXPORT_LOSS_TOLERANCE,
    HF_GRAD_TOLERANCE,
    HF_LOSS_TOLERANCE,
    INTRA_LOSS_TOLERANCE_LOW_PRECISION,
    KERNELS_GRAD_TOLERANCE,
)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def settle_params(seq: dict, other: dict) -> None:
    """Compare the two legs' trained parameters now and drop them (``compare`` reads the verdict):
    the run then holds no whole copy of the model while the first step and HF legs run."""
    if "params" in seq and seq is not other:
        seq["params_vs_other"] = _params_verdict(seq, other)
        del seq["params"], other["params"]


def _params_verdict(seq: dict, other: dict) -> tuple[bool, float]:
    equal = all(torch.equal(seq["params"][k], other["params"][k]) for k in seq["params"])
    return equal, max_diff(other["params"], seq["params"])


def compare(opts, seq, other, hf, label: str | None = None, note: str = "") -> dict:
    """``seq`` (sequential, with its ``first_step``) against ``other`` (bitwise) and ``hf``
    (within tolerances; None: not compared, e.g. under bf16/fp16). ``label``: the key of ``other``
    in "losses" / "peak_activation_bytes" (default: the schedule)."""
    label = label or opts.schedule
    verdict = _params_verdict(seq, other) if "params" in seq else seq.get("params_vs_other", (True, 0.0))
    equal, diff = verdict  # (settled before, or other is seq: sequential against itself)
    bitwise = seq["losses"] == other["losses"] and equal
    out = {
        "options": {k: v for k, v in asdict(opts).items() if k != "extra"},
        "bitwise_equal": bitwise,
        "max_abs_diff_vs_sequential": diff,
        "losses": {"sequential": seq["losses"], label: other["losses"]},
        "peak_activation_bytes": {"sequential": seq["peak_activation_bytes"], label: other["peak_activation_bytes"]},
        "note": note,
    }
    if hf is None:
        why = (
            f"dtype {opts.dtype} (the HF reference runs fp32)"
            if opts.dtype != "fp32"
            else "packed documents with MoE layers (HF's load-balancing loss cannot take a 4-D attention mask)"
        )
        out.update(
            hf_comparison=f"skipped: {why}",
            hf_close=None,
            hf_stochastic_off=None,
            max_abs_diff_vs_hf=None,
            max_loss_diff_vs_hf=None,
            ok=bitwise,
        )
        if label == "intra":
            _judge_intra(opts, out, seq, other, None)
        return out
    grad_scale = _judge_hf(opts, out, seq, other, hf)
    if label == "intra":
        _judge_intra(opts, out, seq, other, grad_scale)
    return out


def _judge_hf(opts, out: dict, seq: dict, other: dict, hf: dict) -> float:
    """``out`` gains the HF comparison: the first step's gradients against HF's (within
    ``HF_GRAD_TOLERANCE`` of the largest), the losses (every step's, or the first's when the trained
    legs draw masks / noise HF does not). Returns the gradients' scale."""
    first = seq["first_step"]
    grad_diff = max_diff(hf["grads"], first["grads"])  # HF's trained parameters (a LoRA model's factors)
    grad_scale = max(1.0, max(float(g.abs().max()) for g in hf["grads"].values()))
    stochastic = trained_stochastic(opts)
    if stochastic:  # only the first step, with all of it off
        loss_diff = abs(first["loss"] - hf["losses"][0])
        what = (
            f"first-step gradients (before clipping) and loss, with {stochastic_kinds(opts, stochastic)} off "
            f"({describe_settings(stochastic)} in the trained legs)"
        )
    elif hf.get("first_only"):  # no reference of the optimizer: the step before it
        loss_diff = abs(first["loss"] - hf["losses"][0])
        what = f"first-step gradients (before clipping) and loss ({hf['first_only']})"
    else:
        loss_diff = max(abs(a - b) for a, b in zip(other["losses"], hf["losses"]))
        what = "first-step gradients (before clipping) and every step's loss"
    if opts.packing == "docs":
        what += "; HF given the packed documents' position_ids and block-diagonal causal mask"
    close = grad_diff <= HF_GRAD_TOLERANCE * grad_scale and loss_diff <= HF_LOSS_TOLERANCE
    out["losses"]["hf"] = hf["losses"]
    out.update(max_abs_diff_vs_hf=grad_diff, max_loss_diff_vs_hf=loss_diff, hf_comparison=what,
               hf_grad_tolerance=HF_GRAD_TOLERANCE * grad_scale, hf_loss_tolerance=HF_LOSS_TOLERANCE,
               hf_close=close, hf_stochastic_off=stochastic, ok=out["bitwise_equal"] and close)  # fmt: skip
    return grad_scale


def compare_kernels(out: dict, first: dict, reference: dict, kernels: str) -> None:
    """``out["vs_torch_kernels"]``: the first step on ``kernels`` against the same step on torch's
    kernels (loss bitwise or not, gradients within ``KERNELS_GRAD_TOLERANCE``); ``ok`` requires it."""
    scale = max(1.0, max(float(g.abs().max()) for g in reference["grads"].values()))
    grad_diff = max_diff(first["grads"], reference["grads"])
    bitwise = all(torch.equal(first["grads"][k], reference["grads"][k]) for k in reference["grads"])
    close = grad_diff <= KERNELS_GRAD_TOLERANCE * scale and abs(first["loss"] - reference["loss"]) <= HF_LOSS_TOLERANCE
    out["vs_torch_kernels"] = {
        "kernels": kernels,
        "first_step_loss": first["loss"],
        "torch_first_step_loss": reference["loss"],
        "loss_bitwise_equal": first["loss"] == reference["loss"],
        "grads_bitwise_equal": bitwise,
        "max_first_step_grad_diff": grad_diff,
        "grad_tolerance": KERNELS_GRAD_TOLERANCE * scale,
        "close": close,
    }
    out["ok"] = out["ok"] and close


def judge_halves(out: dict, intra: dict, halves: dict | None) -> dict:
    """``intra`` against sequential over half-size micro-batches (``halves``: that run, or None
    where there is none): bitwise required; where nothing else held intra to anything (MoE balance
    loss, dropout or router noise in bf16/fp16) and there is no such run, the result is not judged
    and not ok."""
    if halves is not None:
        out["bitwise_equal_to_half_microbatches"] = all(
            torch.equal(halves["params"][k], intra["params"][k]) for k in intra["params"]
        )
        out["losses"]["sequential-halves"] = halves["losses"]
        out["ok"] = out["ok"] and out["bitwise_equal_to_half_microbatches"]
    elif out.pop("intra_needs_halves", False):
        out["ok"] = False
        out["intra_tolerance"] += (
            "; NOT JUDGED: no half-size reference here (it needs an even --micro-batch-size and --packing concat)"
        )
    out.pop("intra_needs_halves", None)
    return out


def describe_settings(settings: dict[str, float]) -> str:
    """``{"resid_pdrop": 0.1, ...}`` -> ``"resid_pdrop 0.1, ..."``."""
    return ", ".join(f"{key} {value:g}" for key, value in settings.items())


def stochastic_kinds(opts: ParityOptions, settings: dict[str, float]) -> str:
    """What ``settings`` (config keys of ``opts.model``) are, in words: "dropout", "router noise"
    or "dropout and router noise"."""
    from hf_models.adapters import adapter_for
    from hf_models.registry import load_config

    dropout_keys = adapter_for(load_config(opts.model)).DROPOUT_KEYS
    kinds = [
        kind
        for kind, keys in (
            ("dropout", [k for k in settings if k in dropout_keys]),
            ("router noise", [k for k in settings if k not in dropout_keys]),
        )
        if keys
    ]
    return " and ".join(kinds)


def _judge_intra(opts: ParityOptions, out: dict, seq: dict, intra: dict, grad_scale: float | None) -> None:
    """``intra`` is held to sequential within tolerances (see INTRA_LOSS_TOLERANCE_LOW_PRECISION's
    comment), not bitwise; the HF comparison (fp32) still has to pass. Where the math differs
    from sequential's on purpose it is held to the half-size micro-batches' run only (the caller
    adds that): with dropout or router noise (other draws: the losses are not compared, the first
    step runs without them) and with an MoE balance loss (each half's own)."""
    from hf_models.adapters import is_moe
    from hf_models.moe_family import default_aux_loss_coef
    from hf_models.registry import load_config

    config = load_config(opts.model)
    coef = opts.extra.get("expert_parallel", {}).get("aux_loss_coef")
    aux = is_moe(config) and (default_aux_loss_coef(config) if coef is None else coef) > 0
    loss_diff = max(abs(a - b) for a, b in zip(seq["losses"], intra["losses"]))
    out["max_loss_diff_vs_sequential"] = loss_diff
    stochastic = trained_stochastic(opts)
    if aux:
        out["intra_tolerance"] = (
            "not compared with sequential: each half's own load-balancing loss (held to the "
            "half-size micro-batches' run)"
        )
        out["ok"], out["intra_needs_halves"] = True, True
        if out.get("hf_close") is not None:
            out["hf_close"] = None
            out["hf_comparison"] = "skipped: HF's load-balancing loss is over whole micro-batches"
        return
    if "first_step" not in intra:  # bf16 / fp16: losses only (with dropout not even those)
        if stochastic:
            out["ok"], out["intra_needs_halves"] = True, True
            out["intra_tolerance"] = (
                f"not compared with sequential: other draws of {', '.join(stochastic)} (held to the half-size run)"
            )
            return
        out["ok"] = loss_diff <= INTRA_LOSS_TOLERANCE_LOW_PRECISION
        out["intra_tolerance"] = f"losses within {INTRA_LOSS_TOLERANCE_LOW_PRECISION:g} of sequential"
        return
    if grad_scale is None:  # no HF reference: scale by sequential's own gradients
        grad_scale = max(1.0, max(float(g.abs().max()) for g in seq["first_step"]["grads"].values()))
    grad_diff = max_diff(intra["first_step"]["grads"], seq["first_step"]["grads"])
    out["max_grad_diff_vs_sequential"] = grad_diff
    out["intra_tolerance"] = (
        f"first-step gradients within {HF_GRAD_TOLERANCE * grad_scale:.3g}"
        + (
            f" ({stochastic_kinds(opts, stochastic)} off; the trained legs draw other masks / noise)"
            if stochastic
            else f" and losses within {HF_LOSS_TOLERANCE:g}"
        )
        + " of sequential"
    )
    out["ok"] = (
        out["hf_close"] is not False
        and grad_diff <= HF_GRAD_TOLERANCE * grad_scale
        and (bool(stochastic) or loss_diff <= HF_LOSS_TOLERANCE)
    )


def judge_resume_and_export(opts: ParityOptions, out: dict, other: dict) -> None:
    """``out`` says how the schedule's leg ran when it was stopped and resumed (its bitwise / tolerance
    verdict against the straight sequential run already holds the resume to that run), and gains
    the export's verdict: reloaded by transformers / PEFT, its loss on the probe within
    ``EXPORT_LOSS_TOLERANCE`` of the engine's; ``ok`` requires it."""
    if other.get("resumed_at"):
        out["resume"] = f"stopped after step {other['resumed_at']} with a checkpoint, resumed by a new engine"
    exported = other.get("export")
    if not opts.export:
        return
    if exported is None:
        out.update(export_close=False, ok=False)
        return
    loss = reloaded_probe_loss(opts, exported["path"])
    tolerance = EXPORT_LOSS_TOLERANCE[opts.dtype]
    close = abs(loss - exported["probe_loss"]) <= tolerance
    out.update(
        export=("PEFT adapter" if opts.lora else "HF checkpoint") + " reloaded in fp32",
        export_probe_loss=loss,
        engine_probe_loss=exported["probe_loss"],
        export_tolerance=tolerance,
        export_close=close,
        ok=out["ok"] and close,
    )


def reloaded_probe_loss(opts: ParityOptions, path: str) -> float:
    """The probe loss of the export at ``path`` as a user loads it: ``AutoModelForCausalLM`` (fp32),
    or a PEFT adapter over the run's base model."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from hf_models.common import hf_mask_windows
    from hf_models.registry import load_config

    from ..data import hf_model_inputs
    from .batches import make_batches
    from .legs import probe_of
    from .options import build

    if opts.lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(build(replace(opts, lora={}), stochastic=False), path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    probe = probe_of(make_batches(opts, load_config(opts.model).vocab_size))
    with torch.no_grad():
        return float(model(**hf_model_inputs(probe, windows=hf_mask_windows(model.config))).loss)
