"""Parity: train the same model with ``sequential`` and another schedule on a CPU gloo world, and
the unsharded HF model on one process; compare.

Sequential and SI run the same ops in a different interleaving, so losses and parameters after
every step must agree bit for bit. The sharded model differs from HF only in summation order (TP
partial sums, the sum-then-divide loss, DP averaging), so it is compared where that shows as
rounding: the first step's gradients (before clipping and the optimizer) and every step's loss.
Parameters after a few AdamW steps are not compared with HF: Adam divides by sqrt(v), so for a
weight whose gradient is ~0 a rounding-level gradient difference moves its update by a sizeable
part of the learning rate.

The trained legs run on a spawned gloo world (each leg's memory returned to the system before the
next); the unsharded HF reference runs after that world is gone, in the calling process, so a
parity run needs about the memory of a training run of the same layout, not that plus a whole model
with its optimizer.

Stochastic settings (dropout rates, MoE router jitter / noise; ``adapters.stochastic_settings``),
from ``--dropout`` or the model's own config (a checkpoint trained with dropout or router jitter):
the trained legs keep them (SI and sequential draw the same seeded masks, so they stay
bitwise), while HF draws from its own generator, so it is compared on the first step only, with
every one of them off on both sides (``hf_stochastic_off`` in the result names them).
"""

from __future__ import annotations

import os

import torch

from .batches import halve_batches, make_batches
from .judge import compare, compare_kernels, judge_halves, judge_resume_and_export, settle_params
from .legs import first_step, hf_cannot_take_the_mask, result_note, train_hf, train_schedule
from .options import ParityOptions, halved, intra_has_halves_reference, moe_kernels, with_moe_kernels
from .pipeline import run_pipe_parity


def _rank_legs(rank, world, opts: ParityOptions, path: str):
    """The trained legs on every rank; rank 0 writes what the judge needs to ``path``."""
    from hf_models.registry import load_config

    from ..runtime.memory import release_memory

    result_note(opts)  # (fp16 on a CPU without DeepSpeed's fp16 support: the capability override, on every rank)
    batches = make_batches(opts, load_config(opts.model).vocab_size)
    seq = train_schedule(opts, "sequential", batches)
    release_memory()
    again = opts.schedule != "sequential" or opts.resume_at or opts.export  # (a resumed or exported leg: its own)
    other = train_schedule(opts, opts.schedule, batches, path + ".d") if again else seq
    if rank == 0 and opts.schedule != "intra":  # (intra's halves compare their parameters too)
        settle_params(seq, other)
    release_memory()
    halves = None
    if opts.schedule == "intra":
        if opts.dtype == "fp32":
            other["first_step"] = first_step(opts, batches, "intra")
        if intra_has_halves_reference(opts):
            halves = train_schedule(halved(opts), "sequential", halve_batches(batches))
    torch_kernels = None
    if opts.dtype == "fp32":
        seq["first_step"] = first_step(opts, batches)
        if moe_kernels(opts) != "torch":  # the same first step on torch's dispatch / combine kernels
            torch_kernels = first_step(with_moe_kernels(opts, "torch"), batches)
    if rank == 0:
        torch.save({"seq": seq, "other": other, "halves": halves, "torch_kernels": torch_kernels}, path)
    release_memory()


def _judge(opts: ParityOptions, path: str) -> dict:
    """The HF leg and the verdicts, in this process after the world is gone: the unsharded
    reference never shares a machine's memory with the trained legs."""
    from hf_models.registry import load_config

    from ..runtime.memory import release_memory

    legs = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    seq, other = legs["seq"], legs["other"]
    batches = make_batches(opts, load_config(opts.model).vocab_size)
    hf = train_hf(opts, batches) if opts.dtype == "fp32" and not hf_cannot_take_the_mask(opts) else None
    out = compare(opts, seq, other, hf, note=result_note(opts))
    if legs["torch_kernels"] is not None:
        compare_kernels(out, seq["first_step"], legs["torch_kernels"], moe_kernels(opts))
    out = judge_halves(out, other, legs["halves"]) if opts.schedule == "intra" else out
    judge_resume_and_export(opts, out, other)
    del legs, seq, other, hf
    release_memory()
    return out


def run_parity(opts: ParityOptions, timeout: float = 600.0) -> dict:
    if opts.pp > 1:
        return run_pipe_parity(opts, timeout)
    return run_parities([opts], timeout)[0]


def _rank_many(rank, world, many: list[ParityOptions], paths: list[str]):
    for opts, path in zip(many, paths):
        _rank_legs(rank, world, opts, path)


def run_parities(many: list[ParityOptions], timeout: float = 900.0) -> list[dict]:
    """``run_parity`` of several one-stage option sets in one world (one start-up for all; every set
    must need the same world size), in order. The trained legs run in a spawned world; the HF
    reference and the verdicts here, after it."""
    import shutil
    import tempfile

    from ..runtime.spawn import run_ranks

    worlds = {opts.world for opts in many}
    if len(worlds) != 1 or any(opts.pp > 1 for opts in many):
        raise ValueError(f"run_parities needs one-stage option sets of one world size, got worlds {sorted(worlds)}")
    folder = tempfile.mkdtemp(prefix="dhelix-parity-")
    try:
        paths = [os.path.join(folder, f"legs{i}.pt") for i in range(len(many))]
        run_ranks(_rank_many, worlds.pop(), args=(list(many), paths), timeout=timeout)
        return [_judge(opts, path) for opts, path in zip(many, paths)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
