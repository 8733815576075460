"""Hugging Face checkpoints out of a (possibly TP-sharded) run.

``export_hf`` gathers every TP shard back into the full HF tensor, and global rank 0 writes a
``save_pretrained`` directory (safetensors, config, tokenizer) that plain transformers loads. The
directory is written under a temporary name and renamed at the end, so a crash never leaves a
half-written checkpoint where a good one was.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from hf_models.common import gather_param


def full_state_dict(model, tp_group=None, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """Every parameter as its full HF tensor (collective over the TP group when sharded; expert
    shards are gathered over their EP group by global expert id)."""
    from .moe.experts import gather_expert_param, is_expert_param
    return {name: gather_expert_param(p) if is_expert_param(p) else gather_param(p, tp_group, tp_size)
            for name, p in model.named_parameters()}


def full_grads(model, groups) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as its full HF tensor, averaged over the data-parallel replicas
    (DeepSpeed's convention: expert gradients summed over their expert-data-parallel group, then
    divided by the whole DP size); no gradient counts as zeros. Collective over the TP, DP and EP
    groups of ``groups`` (a ``ProcessGroups``)."""
    from .moe.experts import gather_expert_param, is_expert_param
    dp, out = groups.dp_size, {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        sharded_experts = is_expert_param(p) and p.ep_size > 1
        reduce_over = groups.edp_group if sharded_experts else groups.dp_group
        if dp > 1 and dist.get_world_size(reduce_over) > 1:
            dist.all_reduce(g, group=reduce_over)
        g /= dp
        out[name] = gather_expert_param(p, g) if sharded_experts else \
            gather_param(p, groups.tp_grad_group, groups.tp_size, data=g)
    return out


def export_hf(model, out_dir: str, tokenizer=None, tp_group=None, tp_size: int = 1) -> str | None:
    """Write an HF checkpoint of ``model`` to ``out_dir``; returns the path on rank 0, else None."""
    from transformers import AutoModelForCausalLM

    state = full_state_dict(model, tp_group, tp_size)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = None
    if rank == 0:
        fresh = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=next(iter(state.values())).dtype)
        missing, unexpected = fresh.load_state_dict(state, strict=False)
        tied = set(getattr(fresh, "_tied_weights_keys", None) or {})
        left = [k for k in missing if k not in tied]
        if left or unexpected:
            raise RuntimeError(f"state_dict mismatch on export: missing {left}, unexpected {unexpected}")
        fresh.tie_weights()
        parent = os.path.dirname(os.path.abspath(out_dir)) or "."
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-hf-", dir=parent)
        fresh.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if os.path.exists(out_dir):
            old = tmp + ".old"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
        path = out_dir
    if dist.is_initialized():
        dist.barrier()
    return path
