"""Phi-MoE adapter: ``PhimoeForCausalLM`` -> ``ModelGraph`` with expert parallelism (EP) and
tensor/sequence parallel (TP) attention, through the shared MoE layer machinery
(``moe_family.py``, which lists the layer's ops): the router is HF's sparsemixer (``mlp.router``,
top-2, its own input jitter), norms are LayerNorms with biases, files store one ``w1``/``w2``/``w3``
per expert under ``block_sparse_moe``."""
from __future__ import annotations

from transformers.models.phimoe import modeling_phimoe as hf

from ds_dhelix.moe.experts import check_ep as _check_ep

from . import moe_family
from .moe_family import MoeFamily

DROPOUT_KEYS = ("attention_dropout",)
FAMILY = MoeFamily(name="Phi-MoE", family="phimoe", hf=hf, router="router", block_jitter="input_jitter_noise",
                   experts_key="num_local_experts", files_block="block_sparse_moe", files_router="gate",
                   files_experts=("w1", "w3", "w2"))


def check_tp(config, tp: int, world: int | None = None) -> None:
    moe_family.check_tp(config, tp, world)
    check_moe(config)


def check_moe(config) -> None:
    """Routing settings HF's sparsemixer can run: ``ValueError`` otherwise."""
    num, top_k = config.num_local_experts, config.num_experts_per_tok
    if top_k > num:
        raise ValueError(f"num_experts_per_tok {top_k} is larger than num_local_experts {num}: a token cannot "
                         f"be routed to more experts than exist; use num_experts_per_tok <= {num}")
    if num < 2:
        raise ValueError(f"num_local_experts {num}: Phi-MoE's sparsemixer routes every token to 2 experts; "
                         f"use at least 2 experts")


def check_ep(config, ep: int, dp_size: int | None = None) -> None:
    """``ValueError`` unless ``ep`` divides the number of experts (and the DP size), listing valid sizes."""
    check_moe(config)
    _check_ep(config.num_local_experts, config.num_experts_per_tok, ep, dp_size)


def checkpoint_source(name: str, config):
    return moe_family.checkpoint_source(FAMILY, name, config)


def shard(model, tp: int, tp_rank: int, ep_groups) -> None:
    moe_family.shard(model, tp, tp_rank, ep_groups)


def build_graph(model, tp: int = 1, tp_rank: int = 0, tp_group=None, tp_grad_group=None, **options):
    """Shard ``model`` in place for this TP and EP rank and return its op graph (options: see
    ``moe_family.build_graph``)."""
    return moe_family.build_graph(FAMILY, model, tp, tp_rank, tp_group, tp_grad_group, check_ep=check_ep, **options)
