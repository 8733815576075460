"""Qwen3.5-MoE (text) adapter: ``Qwen3_5MoeForCausalLM`` (``model_type`` ``qwen3_5_moe_text``) through
the shared MoE layer machinery (``moe_family.py``): Gated DeltaNet linear-attention layers
(``deltanet.py``) among output-gated full-attention layers (``gated_attention.py``), every layer
sparse: HF's softmax top-k router (top-k weights always renormalised), a shared-expert MLP gated
by ``sigmoid(shared_expert_gate(x))`` (``moe.shared``), experts of ``moe_intermediate_size``;
files store one ``gate_proj``/``up_proj``/``down_proj`` per expert under ``mlp``. A multimodal
``qwen3_5_moe`` checkpoint is refused in one line (``adapters.REFUSED``)."""

from __future__ import annotations

from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from .moe_family import MoeAdapter, check_top_k
from .qwen3_5 import check_layer_types
from .qwen3_moe import FAMILY as QWEN3_MOE

# Qwen3-MoE with a gated shared expert, output-gated attention and Gated DeltaNet layers
FAMILY = QWEN3_MOE.like(
    name="Qwen3.5-MoE", family="qwen3_5_moe", hf=hf, shared_expert="gated", attention="gated", linear_attention=True
)


def check_moe(config) -> None:
    check_top_k(config, FAMILY.experts_key)
    check_layer_types(config, FAMILY.name)


ADAPTER = MoeAdapter(FAMILY, check_moe)
