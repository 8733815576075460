"""What every adapter shares: TP size checks, Megatron-style sharding of HF projections, side
inputs of a micro-batch, the embedding/head blocks and gathering shards back into HF tensors.

Sharded parameters carry ``tp_partition_dim`` (the dim split over the TP group) and DeepSpeed's
``tensor_model_parallel`` flag; replicated parameters applied to a sequence shard get a gradient
hook that sums their gradient over the TP group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_dhelix.comm import allreduce_grad_hook
from ds_dhelix.graph import comp


def check_divisible(tp: int, world: int | None = None, **dims: int) -> None:
    """``ValueError`` naming every dimension that ``tp`` does not divide, with the valid TP sizes."""
    bad = {k: v for k, v in dims.items() if v % tp}
    if world is not None and world % tp:
        bad["world_size"] = world
    if bad:
        import math
        g = 0
        for v in list(dims.values()) + ([world] if world else []):
            g = math.gcd(g, v)
        valid = [d for d in range(1, g + 1) if g % d == 0]
        named = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(f"tensor_parallel.size {tp} does not divide {named}; valid TP sizes: {valid}")


def shard_param(module: nn.Module, name: str, dim: int, rank: int, tp: int, index=None) -> None:
    """Replace ``module.<name>`` by this rank's slice along ``dim`` (or by rows ``index``)."""
    p = getattr(module, name)
    if p is None or tp == 1:
        return
    if index is None:
        size = p.shape[dim] // tp
        data = p.data.narrow(dim, rank * size, size)
    else:
        data = p.data.index_select(dim, index)
    new = nn.Parameter(data.clone().contiguous(), requires_grad=p.requires_grad)
    new.tensor_model_parallel = True
    new.tp_partition_dim = dim
    if index is not None:
        new.tp_row_index = index  # rows of the full tensor this shard holds (fused layouts)
    setattr(module, name, new)


def mark_replicated(params, group) -> None:
    """Replicated weights used on a sequence shard: sum their gradients over the TP group."""
    seen = set()
    for p in params:
        if p is None or id(p) in seen or getattr(p, "tensor_model_parallel", False):
            continue
        seen.add(id(p))
        p.register_hook(allreduce_grad_hook(group))


def make_side_fn(tp: int, tp_rank: int, extra=None):
    """Side inputs of a micro-batch: this rank's sequence shard of ids and shifted targets.

    Targets follow HF's causal-LM loss: position t predicts labels[t+1]; the last position and
    labels of -100 are ignored; the loss is the sum over valid targets / their count.
    """

    def make_side(batch: dict) -> dict:
        ids, labels = batch["input_ids"], batch.get("labels", batch["input_ids"])
        b, s = ids.shape
        if s % tp:
            raise ValueError(f"sequence length {s} is not divisible by tensor_parallel.size {tp}")
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        n = s // tp
        sl = slice(tp_rank * n, (tp_rank + 1) * n)
        side = {
            "ids": ids[:, sl],
            "targets": targets[:, sl].t().contiguous(),  # [s/tp, b], sequence-first
            "num_valid": int((targets != -100).sum()),
            "positions": torch.arange(tp_rank * n, (tp_rank + 1) * n).unsqueeze(0).expand(b, n),
            "seq_len": s,
            "batch": b,
        }
        if extra is not None:
            side.update(extra(batch, side))
        return side

    return make_side


def embed_op(embed: nn.Module, pos_embed: nn.Module | None = None):
    """``embed``: token (+ learned position) embedding of this rank's shard -> ``h`` [s/tp, b, h]."""

    def fn(side):
        h = embed(side["ids"])
        if pos_embed is not None:
            h = h + pos_embed(side["positions"])
        return (h.transpose(0, 1).contiguous(),)

    return comp("embed", (), ("h",), fn)


def head_ops(norm: nn.Module, lm_head: nn.Module):
    """``head.norm``, ``head.logits``, ``head.loss``: this rank's share of the micro-batch loss."""

    def loss_fn(side, logits):
        loss = F.cross_entropy(logits.float().flatten(0, 1), side["targets"].flatten(),
                               ignore_index=-100, reduction="sum")
        return (loss / max(side["num_valid"], 1),)

    return [
        comp("head.norm", ("h",), ("y",), lambda side, h: (norm(h),)),
        comp("head.logits", ("y",), ("logits",), lambda side, y: (lm_head(y),)),
        comp("head.loss", ("logits",), ("loss",), loss_fn),
    ]


def gather_param(p: torch.Tensor, group, tp: int) -> torch.Tensor:
    """The full HF tensor of a (possibly sharded) parameter: all-gather along its partition dim."""
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return p.detach().clone()
    dim = p.tp_partition_dim
    parts = [torch.empty_like(p.data) for _ in range(tp)]
    dist.all_gather(parts, p.data.contiguous(), group=group)
    full = torch.cat(parts, dim=dim)
    index = getattr(p, "tp_row_index", None)
    if index is not None:  # rows were picked by index: put every rank's rows back in place
        idx = [torch.empty_like(index) for _ in range(tp)]
        dist.all_gather(idx, index, group=group)
        out = torch.empty_like(full)
        out.index_copy_(dim, torch.cat(idx), full)
        full = out
    return full
