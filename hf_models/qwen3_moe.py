"""Qwen3-MoE adapter: ``Qwen3MoeForCausalLM`` -> ``ModelGraph`` with expert parallelism (EP) and
tensor/sequence parallel (TP) attention, through the shared MoE layer machinery
(``moe_family.py``): the router is HF's softmax top-k (``mlp.gate``; the top-k weights renormalised
when ``norm_topk_prob``), q and k get an RMSNorm per head, experts have ``moe_intermediate_size``,
files store one ``gate_proj``/``up_proj``/``down_proj`` per expert under ``mlp``. Dense MLP layers
(``mlp_only_layers``, ``decoder_sparse_step``) run as ``moe_family.dense_mlp_ops``."""

from __future__ import annotations

from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from .moe_family import MoeAdapter, MoeFamily, check_layers, check_top_k

FAMILY = MoeFamily(
    name="Qwen3-MoE",
    family="qwen3_moe",
    hf=hf,
    router="gate",
    block_jitter=None,
    experts_key="num_experts",
    files_block="mlp",
    files_router="gate",
    files_experts=("gate_proj", "up_proj", "down_proj"),
    inter_key="moe_intermediate_size",
    qk_norm="head",
)


def check_moe(config, family: MoeFamily = FAMILY) -> None:
    """Top-k and dense-layer settings ``family`` (Qwen3-MoE or one derived from it) cannot run."""
    check_top_k(config, family.experts_key)
    check_layers(config, family.name)


ADAPTER = MoeAdapter(FAMILY, check_moe)
