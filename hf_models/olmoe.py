"""OLMoE adapter: ``OlmoeForCausalLM`` -> ``ModelGraph`` with expert parallelism (EP), through the
shared MoE layer machinery (``moe_family.py``): the router is HF's softmax top-k (``mlp.gate``;
renormalised when ``norm_topk_prob``), q and k get an RMSNorm over the whole projection (every
head at once, so TP would need a norm across ranks: TP = 1 only), files store one
``gate_proj``/``up_proj``/``down_proj`` per expert under ``mlp``. ``clip_qkv`` is refused."""
from __future__ import annotations

from transformers.models.olmoe import modeling_olmoe as hf

from ds_dhelix.moe.experts import check_ep as _check_ep

from . import moe_family
from .moe_family import MoeFamily

DROPOUT_KEYS = ("attention_dropout",)
FAMILY = MoeFamily(name="OLMoE", family="olmoe", hf=hf, router="gate", block_jitter=None,
                   experts_key="num_experts", files_block="mlp", files_router="gate",
                   files_experts=("gate_proj", "up_proj", "down_proj"), qk_norm="full")


def check_tp(config, tp: int, world: int | None = None) -> None:
    if tp > 1:
        raise ValueError(f"tensor_parallel.size {tp} with OLMoE: its q/k RMSNorm runs over all heads at once, which "
                         f"a TP shard does not hold; use tensor_parallel.size 1 and expert_parallel for the experts")
    moe_family.check_tp(config, tp, world)
    check_moe(config)


def check_moe(config) -> None:
    num, top_k = config.num_experts, config.num_experts_per_tok
    if not 1 <= top_k <= num:
        raise ValueError(f"num_experts_per_tok {top_k} with num_experts {num}: a token goes to between 1 and "
                         f"{num} experts")
    if getattr(config, "clip_qkv", None) is not None:
        raise ValueError(f"OLMoE clip_qkv {config.clip_qkv} is not supported yet; use a checkpoint with clip_qkv null")


def check_ep(config, ep: int, dp_size: int | None = None) -> None:
    """``ValueError`` unless ``ep`` divides the number of experts (and the DP size), listing valid sizes."""
    check_moe(config)
    _check_ep(config.num_experts, config.num_experts_per_tok, ep, dp_size, key="num_experts")


def checkpoint_source(name: str, config):
    return moe_family.checkpoint_source(FAMILY, name, config)


def shard(model, tp: int, tp_rank: int, ep_groups) -> None:
    moe_family.shard(model, tp, tp_rank, ep_groups)


def build_graph(model, tp: int = 1, tp_rank: int = 0, tp_group=None, tp_grad_group=None, **options):
    """Shard ``model`` in place for this EP rank and return its op graph (options: see
    ``moe_family.build_graph``)."""
    return moe_family.build_graph(FAMILY, model, tp, tp_rank, tp_group, tp_grad_group, check_ep=check_ep, **options)
