"""The legs of a parity run, each on every rank of a gloo world: a schedule trained through the
engine (``train_schedule``), the sharded model's first step through the executor alone
(``first_step``), the unsharded HF model on one process (``train_hf``)."""

from __future__ import annotations

import torch

from .options import ParityOptions, build, my_share
from .tolerances import CAPACITY_NOTE


def train_leg(opts: ParityOptions, schedule: str, batches, gather, workdir: str | None = None) -> dict:
    """Build the engine for ``schedule`` and train on this rank's share of every step; ``gather``
    (engine -> full parameters or None) runs before the engine is destroyed. With ``workdir``:
    ``opts.resume_at`` stops the run there with a checkpoint that a new engine resumes
    (``stop_and_resume``), and ``opts.export`` writes the trained model's export with its probe
    loss (``export_with_probe``)."""
    from ..engine.build import build_engine

    engine = build_engine(build(opts), opts.ds_config(schedule))
    losses, peaks = [], []
    for k, step in enumerate(batches):
        if workdir and opts.resume_at > 0 and k == opts.resume_at:
            engine = stop_and_resume(engine, opts, schedule, workdir)
        losses.append(float(engine.train_batch(iter(my_share(opts, step, engine.groups.dp_rank)))))
        peaks.append(engine.last_stats.peak_activation_bytes)
    exported = export_with_probe(engine, opts, batches, workdir) if workdir and opts.export else None
    params = gather(engine)
    if engine.groups.rank != 0:  # (the gather is collective; rank 0 alone compares)
        params = None
    ops = [op.name for block in engine.graph.blocks for op in block]  # what the executor ran (fused or not)
    engine.destroy()
    out = {"losses": losses, "params": params, "peak_activation_bytes": max(peaks), "rank": engine.groups.rank}
    return {**out, "ops": ops, "resumed_at": opts.resume_at if workdir else 0, "export": exported}


def stop_and_resume(engine, opts: ParityOptions, schedule: str, workdir: str):
    """What ``--resume auto`` does after a stop: ``engine`` saves a checkpoint (``resume.save``) and
    is destroyed; a new engine, built as the first was, loads it (``resume.load``: optimizer, LR
    schedule, step counters, every rank's RNG state). Collective."""
    import os

    from ..engine import resume
    from ..engine.build import build_engine

    root = os.path.join(workdir, "checkpoints")
    tag = os.path.basename(resume.save(engine, root, {"step": engine.global_steps}, keep=1))
    engine.destroy()
    again = build_engine(build(opts), opts.ds_config(schedule))
    resume.load(again, root, tag)
    return again


def probe_of(batches) -> dict:
    """The micro-batch an export is probed with: the first step's first, as one causal stream
    (its ids and labels; a packed record's positions and mask left out, as a user's first
    ``model(input_ids, labels=...)`` of the reloaded export would; HF's MoE load-balancing loss
    cannot take a packed 4-D mask either)."""
    first = batches[0][0]
    return {"input_ids": first["input_ids"], "labels": first["labels"]}


def export_with_probe(engine, opts: ParityOptions, batches, workdir: str) -> dict:
    """The trained model's probe loss (the same micro-batch on every rank, forward only) and its
    export: the PEFT adapter of a LoRA run, else the HF checkpoint (collective; rank 0 writes)."""
    import os

    probe = probe_of(batches)
    loss = float(engine.eval_batch(iter([probe] * opts.micro_batches)))
    path = os.path.join(workdir, "export")
    (engine.export_adapter if opts.lora else engine.export_hf)(path)
    return {"probe_loss": loss, "path": path}


def train_schedule(opts: ParityOptions, schedule: str, batches, workdir: str | None = None) -> dict:
    """On every rank of the world: train with ``schedule``; return losses, full params, peak
    (``workdir``: ``train_leg``'s stop-and-resume and export go there)."""
    from ..engine.checkpoint import full_state_dict

    return train_leg(
        opts,
        schedule,
        batches,
        lambda engine: full_state_dict(engine.module, engine.groups.tp_grad_group, engine.groups.tp_size),
        workdir,
    )


def first_step(opts: ParityOptions, batches, schedule: str = "sequential") -> dict:
    """On every rank: the sharded model's first step (``schedule``, every stochastic setting off,
    before clipping and the optimizer) through the build path's sharding and the executor alone:
    its full gradients and its loss (mean over the micro-batches, TP and CP shares summed, DP averaged)."""
    import torch.distributed as dist

    from hf_models.adapters import unwrap_peft

    from ..engine.build import check_setup, shard_model
    from ..engine.checkpoint import full_grads
    from ..runtime.executor import Executor
    from ..runtime.groups import ProcessGroups

    model, lora = unwrap_peft(build(opts, stochastic=False))
    model.dhelix_lora = lora  # (its lora_dropout, if any)
    setup = check_setup(opts.ds_config("sequential"), model.config, dist.get_world_size())
    groups = ProcessGroups.create(setup.dims)
    graph = shard_model(model, setup.dh, setup.dims, groups)
    mine = my_share(opts, batches[0], groups.dp_rank)
    mbs = Executor(graph).run_microbatches(mine, schedule, 1.0 / len(mine))
    loss = torch.stack([mb.loss.detach().float() for mb in mbs]).mean()
    for group, size in (
        (groups.tp_grad_group, groups.tp_size),
        (groups.cp_group, groups.cp_size),
        (groups.dp_group, groups.dp_size),
    ):
        if size > 1:
            dist.all_reduce(loss, group=group)
    return {"grads": full_grads(model, groups), "loss": float(loss) / groups.dp_size}


def train_hf(opts: ParityOptions, batches) -> dict:
    """The unsharded HF model, one process, same data and optimizer, every stochastic setting off
    (``build(stochastic=False)``); also its first-step gradients."""
    from hf_models.common import hf_mask_windows
    from hf_models.lora import our_name

    from ..data import hf_model_inputs

    model = build(opts, stochastic=False)
    windows = hf_mask_windows(model.config)
    model.train()
    opt = reference_optimizer(opts, [p for p in model.parameters() if p.requires_grad])
    losses, grads = [], None
    for step in batches if opt is not None else batches[:1]:
        total = 0.0
        for b in step:
            loss = model(**hf_model_inputs(b, windows=windows)).loss / len(step)
            loss.backward()
            total += float(loss.detach())
        if grads is None:
            grads = {our_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        losses.append(total)
        if opt is None:
            break
        if opts.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], opts.clip)
        opt.step()
        opt.zero_grad()
    first_only = None if opt is not None else f"{opts.optimizer} has no one-process reference here"
    return {"losses": losses, "grads": grads, "first_only": first_only}


def reference_optimizer(opts: ParityOptions, params: list):
    """The optimizer the unsharded reference steps with: the trained legs' own, built on one process
    (``OPTIMIZERS``); None for Muon (DeepSpeed builds its Muon / Adam halves inside the engine), whose
    reference is then the first step only."""
    name = opts.optimizer
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.01)
    if name == "Adam":
        return torch.optim.Adam(params, lr=opts.lr, weight_decay=0.01)
    if name == "SGD":
        return torch.optim.SGD(params, lr=opts.lr, momentum=0.9)
    if name == "Lion":
        from deepspeed.ops.lion import DeepSpeedCPULion

        return DeepSpeedCPULion(params, lr=opts.lr, weight_decay=0.01)
    return None


def hf_cannot_take_the_mask(opts: ParityOptions) -> bool:
    """Packed documents on an MoE model: HF's load-balancing loss cannot take a 4-D mask."""
    from hf_models.adapters import is_moe
    from hf_models.registry import load_config

    return opts.packing == "docs" and is_moe(load_config(opts.model))


def result_note(opts: ParityOptions) -> str:
    """fp16 on a CPU without DeepSpeed's fp16 support: override the capability check (torch computes
    fp16 on CPU) and say so in the result. Capacity mode: say why HF may differ."""
    notes = []
    if opts.extra.get("expert_parallel", {}).get("capacity_factor") is not None:
        notes.append(CAPACITY_NOTE)
    if opts.dtype == "fp16":
        from ..engine.precision import force_fp16_capability

        notes.append(force_fp16_capability())
    return "; ".join(notes)
