"""GLM-4.5 / GLM-4.6 adapter: ``Glm4MoeForCausalLM`` -> ``ModelGraph`` through the shared MoE layer
machinery (``moe_family.py``): grouped-query attention with q/k/v biases, partial RoPE
(``partial_rotary_factor``, HF's own ``apply_rotary_pos_emb``) and, with ``use_qk_norm``, an RMSNorm
of q and k per head; DeepSeek-V3's group-limited sigmoid router and ungated shared experts; dense MLP
layers before ``first_k_dense_replace``. Files store one ``gate_proj``/``up_proj``/``down_proj`` per
expert under ``mlp``. Like HF's model: no load-balancing loss, ``e_score_correction_bias`` fixed."""

from __future__ import annotations

from transformers.models.glm4_moe import modeling_glm4_moe as hf

from .deepseek_v3 import FAMILY as DEEPSEEK_V3
from .moe_family import MoeAdapter, check_groups, check_layers

# DeepSeek-V3's router, shared experts and files, with grouped-query attention and q/k norm per head
FAMILY = DEEPSEEK_V3.like(name="GLM-4.5", family="glm4_moe", hf=hf, attention="mha", qk_norm="head")


def check_moe(config) -> None:
    check_groups(config, FAMILY.name)
    check_layers(config, FAMILY.name)


ADAPTER = MoeAdapter(FAMILY, check_moe)
