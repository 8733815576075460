"""Pipeline parity: PP=p with a folded schedule against PP=1 sequential (same TP, DP, data)."""

from __future__ import annotations

from .batches import make_batches
from .judge import compare, judge_resume_and_export
from .legs import first_step, hf_cannot_take_the_mask, result_note, train_hf, train_leg, train_schedule
from .options import ParityOptions
from .tolerances import PP_TOLERANCE


def train_pipeline(opts: ParityOptions, schedule: str, batches, workdir: str | None = None) -> dict | None:
    """On every rank of a PP x DP x TP world: train; global rank 0 returns losses and full params
    (``workdir``: ``train_leg``'s stop-and-resume and export go there)."""
    from ..pipe.module import gather_hf_state_dict

    out = train_leg(
        opts,
        schedule,
        batches,
        lambda engine: gather_hf_state_dict(engine.module, engine.groups.tp_grad_group, engine.groups.tp_size),
        workdir,
    )
    return out if out["rank"] == 0 else None


def _rank_pipeline(rank, world, opts: ParityOptions, workdir: str):
    from hf_models.registry import load_config

    result_note(opts)
    return train_pipeline(opts, opts.schedule, make_batches(opts, load_config(opts.model).vocab_size), workdir)


def _rank_reference(rank, world, opts: ParityOptions):
    from hf_models.registry import load_config

    note = result_note(opts)
    batches = make_batches(opts, load_config(opts.model).vocab_size)
    seq = train_schedule(opts, "sequential", batches)
    hf = None
    if opts.dtype == "fp32":
        seq["first_step"] = first_step(opts, batches)
        hf = None if hf_cannot_take_the_mask(opts) else train_hf(opts, batches)
    return {"sequential": seq, "hf": hf, "note": note} if rank == 0 else None


def pipe_label(opts: ParityOptions) -> str:
    """Key of the pipelined run in the parity result, e.g. "pp2-w"."""
    return f"pp{opts.pp}-{opts.schedule}"


def run_pipe_parity(opts: ParityOptions, timeout: float = 600.0) -> dict:
    """Two worlds: PP=1 sequential (TP x CP x DP ranks, plus unsharded HF) and PP=p with
    ``opts.schedule`` (PP x TP x DP ranks); same data, same seed."""
    import shutil
    import tempfile
    from dataclasses import replace

    from ..runtime.spawn import run_ranks

    ref = run_ranks(
        _rank_reference,
        opts.tp * opts.dp * opts.cp,
        args=(replace(opts, pp=1, schedule="sequential"),),
        timeout=timeout,
    )[0]
    workdir = tempfile.mkdtemp(prefix="dhelix-pipe-parity-")
    try:
        pipe = run_ranks(_rank_pipeline, opts.world, args=(opts, workdir), timeout=timeout)[0]
        out = compare(opts, ref["sequential"], pipe, ref["hf"], label=pipe_label(opts), note=ref["note"])
        out["pp_tolerance"] = PP_TOLERANCE
        # the pipeline is judged against PP=1 sequential; HF closeness is the sequential run's (reported)
        out["ok"] = out["bitwise_equal"] or out["max_abs_diff_vs_sequential"] <= PP_TOLERANCE
        judge_resume_and_export(opts, out, pipe)
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
