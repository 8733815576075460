"""Evaluation loss, weighted by targets: the one number train.py reports as ``Eval/loss`` and
``DhelixTrainer.evaluate`` as ``eval_loss``.

    loss = sum_i loss_i x targets_i / sum_i targets_i     (i: every micro-batch on every DP replica)

``loss_i`` is micro-batch i's mean over its targets, forward only: ``eval_batch`` of a ds_dhelix
engine (TP and CP shares summed; pipelines included), or the HF model's forward under plain
DeepSpeed. ``targets_i`` is its count of labels the loss sees (``ds_dhelix.data.valid_targets``),
so a micro-batch of short answers weighs less than one of long answers; the two sums go over the
data-parallel replicas in one all-reduce. Also here, for any engine (ds_dhelix or plain
DeepSpeed): its data-parallel coordinates (``data_parallel``), its watchdog around a collective
action (``watched``) and the HF inputs of a batch under plain DeepSpeed (``plain_inputs``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator


def is_dhelix(engine) -> bool:
    """A ds_dhelix engine (one of ``DhelixStepMixin``'s), not plain DeepSpeed's."""
    from .stepping import DhelixStepMixin

    return isinstance(engine, DhelixStepMixin)


def data_parallel(engine) -> tuple[int, int, object]:
    """``(rank, size, group)`` of this rank's data-parallel replica: the engine's layout under
    ds_dhelix, the whole world (the default group, ``None``) under plain DeepSpeed."""
    import torch.distributed as dist

    if is_dhelix(engine):
        g = engine.groups
        return g.dp_rank, g.dp_size, g.dp_group
    return dist.get_rank(), dist.get_world_size(), None


def watched(engine, what: str):
    """The ds_dhelix engine's watchdog around ``what`` (plain DeepSpeed has none)."""
    return engine.watched(what) if hasattr(engine, "watched") else contextlib.nullcontext()


def evaluate_loss(
    engine, batches: Iterable[dict], weights: Iterable[int] | None = None, chunk: int | None = None
) -> tuple[float, int]:
    """``(loss, targets)`` over ``batches`` (this replica's micro-batches) on every data-parallel
    replica: the target-weighted mean (module docstring) and the target count. ``weights``: each
    micro-batch's count (default: its labels' ``valid_targets``; 0 leaves a micro-batch out, e.g.
    a replica's padding); ``chunk``: micro-batches per ``eval_batch`` call, which must share one
    shape (default ``gradient_accumulation_steps``). Collective: every replica calls it once; the
    ranks of a TP (CP, pipeline) group pass the same batches. No targets anywhere: loss nan."""
    import torch
    import torch.distributed as dist

    from ds_dhelix.data import valid_targets

    chunk = chunk or engine.gradient_accumulation_steps()
    if weights is None:
        weighed = ((b, valid_targets(b.get("labels", b["input_ids"]))) for b in batches)
    else:
        weighed = zip(batches, weights, strict=True)
    _, dp_size, group = data_parallel(engine)
    total = torch.zeros(2, dtype=torch.float64)
    with watched(engine, "evaluation"):
        for part in _chunks(weighed, chunk):
            losses = microbatch_losses(engine, [b for b, _ in part])
            for loss, w in zip(losses.tolist(), [w for _, w in part]):
                if w:
                    total += torch.tensor([loss * w, w], dtype=torch.float64)
        if dp_size > 1:  # on the engine's device: an NCCL group takes no CPU tensor
            total = total.to(engine.device)
            dist.all_reduce(total, group=group)
    total = total.cpu()
    return float(total[0] / total[1]), int(total[1])


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    part = []
    for item in items:
        part.append(item)
        if len(part) == size:
            yield part
            part = []
    if part:
        yield part


def microbatch_losses(engine, batches: list[dict]):
    """Each micro-batch's loss on this replica (a float tensor ``[len(batches)]``), forward only."""
    import torch

    if is_dhelix(engine):
        return engine.eval_batch(iter(batches), num_microbatches=len(batches), per_microbatch=True).cpu()
    return torch.stack([_plain_forward_loss(engine, b) for b in batches])


def _plain_forward_loss(engine, batch):
    import torch

    engine.eval()
    with torch.no_grad():
        out = engine(**plain_inputs(engine, batch))
    engine.train()
    return out.loss.detach().float().cpu()


def plain_inputs(engine, batch: dict) -> dict:
    """The HF model's keyword arguments for ``batch`` under plain DeepSpeed: the packed documents'
    mask (additive in the parameters' dtype for eager attention), and a ``loss_denominator`` as
    HF's ``num_items_in_batch``."""
    from ds_dhelix.data import hf_model_inputs
    from hf_models.common import hf_mask_windows

    module = engine.module
    eager = next(module.parameters()).dtype if module.config._attn_implementation == "eager" else None
    batch = dict(batch)
    denominator = batch.pop("loss_denominator", None)
    extra = {} if denominator is None else {"num_items_in_batch": denominator}
    return {**hf_model_inputs(batch, eager, hf_mask_windows(module.config)), **extra}
