"""Qwen2-MoE adapter: ``Qwen2MoeForCausalLM`` -> ``ModelGraph`` with expert parallelism (EP) and
tensor/sequence parallel (TP) attention, through the shared MoE layer machinery
(``moe_family.py``): the router is HF's softmax top-k (``mlp.gate``; the top-k weights renormalised
when ``norm_topk_prob``), a shared-expert MLP gated by ``sigmoid(shared_expert_gate(x))`` runs as
``moe.shared`` while the routed tokens are in flight, q/k/v have biases, experts have
``moe_intermediate_size``, files store one ``gate_proj``/``up_proj``/``down_proj`` per expert under
``mlp``. Dense MLP layers (``mlp_only_layers``,
``decoder_sparse_step``) run as ``moe_family.dense_mlp_ops``."""

from __future__ import annotations

from transformers.models.qwen2_moe import modeling_qwen2_moe as hf

from .moe_family import MoeAdapter, MoeFamily, check_layers, check_top_k

FAMILY = MoeFamily(
    name="Qwen2-MoE",
    family="qwen2_moe",
    hf=hf,
    router="gate",
    block_jitter=None,
    experts_key="num_experts",
    files_block="mlp",
    files_router="gate",
    files_experts=("gate_proj", "up_proj", "down_proj"),
    inter_key="moe_intermediate_size",
    shared_expert="gated",
)


def check_moe(config) -> None:
    check_top_k(config, FAMILY.experts_key)
    check_layers(config, FAMILY.name)


ADAPTER = MoeAdapter(FAMILY, check_moe)
