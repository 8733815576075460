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

from . import qwen3_moe
from .moe_family import MoeAdapter

# Qwen3-MoE's router, experts and files, with a gated shared expert and no q/k norm
FAMILY = qwen3_moe.FAMILY.like(name="Qwen2-MoE", family="qwen2_moe", hf=hf, shared_expert="gated", qk_norm=None)


def check_moe(config) -> None:
    qwen3_moe.check_moe(config, FAMILY)


ADAPTER = MoeAdapter(FAMILY, check_moe)
