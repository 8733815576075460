"""Qwen2-MoE adapter: ``Qwen2MoeForCausalLM`` -> ``ModelGraph`` with expert parallelism (EP) and
tensor/sequence parallel (TP) attention, through the shared MoE layer machinery
(``moe_family.py``): the router is HF's softmax top-k (``mlp.gate``; the top-k weights renormalised
when ``norm_topk_prob``), a shared-expert MLP gated by ``sigmoid(shared_expert_gate(x))`` runs as
``moe.shared`` while the routed tokens are in flight, q/k/v have biases, experts have
``moe_intermediate_size``, files store one ``gate_proj``/``up_proj``/``down_proj`` per expert under
``mlp``. Every decoder layer must be sparse (dense MLP layers among them are refused)."""
from __future__ import annotations

from transformers.models.qwen2_moe import modeling_qwen2_moe as hf

from ds_dhelix.moe.experts import check_ep as _check_ep

from . import moe_family
from .moe_family import MoeFamily

DROPOUT_KEYS = ("attention_dropout",)
FAMILY = MoeFamily(name="Qwen2-MoE", family="qwen2_moe", hf=hf, router="gate", block_jitter=None,
                   experts_key="num_experts", files_block="mlp", files_router="gate",
                   files_experts=("gate_proj", "up_proj", "down_proj"), inter_key="moe_intermediate_size",
                   shared_expert=True)


def check_tp(config, tp: int, world: int | None = None) -> None:
    moe_family.check_tp(config, tp, world)
    check_moe(config)


def check_moe(config) -> None:
    num, top_k = config.num_experts, config.num_experts_per_tok
    if not 1 <= top_k <= num:
        raise ValueError(f"num_experts_per_tok {top_k} with num_experts {num}: a token goes to between 1 and "
                         f"{num} experts")
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1)
    if dense or step != 1:
        raise ValueError(f"Qwen2-MoE with dense MLP layers (mlp_only_layers {dense}, decoder_sparse_step {step}) is "
                         f"not supported yet: every layer must be an MoE layer (mlp_only_layers [], "
                         f"decoder_sparse_step 1)")


def check_ep(config, ep: int, dp_size: int | None = None) -> None:
    """``ValueError`` unless ``ep`` divides the number of experts (and the DP size), listing valid sizes."""
    check_moe(config)
    _check_ep(config.num_experts, config.num_experts_per_tok, ep, dp_size, key="num_experts")


def checkpoint_source(name: str, config):
    return moe_family.checkpoint_source(FAMILY, name, config)


def shard(model, tp: int, tp_rank: int, ep_groups) -> None:
    moe_family.shard(model, tp, tp_rank, ep_groups)


def build_graph(model, tp: int = 1, tp_rank: int = 0, tp_group=None, tp_grad_group=None, **options):
    """Shard ``model`` in place for this TP and EP rank and return its op graph (options: see
    ``moe_family.build_graph``)."""
    return moe_family.build_graph(FAMILY, model, tp, tp_rank, tp_group, tp_grad_group, check_ep=check_ep, **options)
