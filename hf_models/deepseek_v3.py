"""DeepSeek-V3 / Kimi-K2 adapter: ``DeepseekV3ForCausalLM`` -> ``ModelGraph`` through the shared
MoE layer machinery (``moe_family.py``): multi-head latent attention (``mla.py``), the
group-limited sigmoid router (``e_score_correction_bias`` for the choice only, ``routed_scaling_factor``),
an ungated shared-expert MLP (``moe.shared``), and dense MLP layers before ``first_k_dense_replace``.
Files store one ``gate_proj``/``up_proj``/``down_proj`` per expert under ``mlp``.

HF's model has no load-balancing loss for this family and never updates ``e_score_correction_bias``
(DeepSeek's aux-free balancing nudges it between steps); neither do we: the bias is a buffer, kept
in fp32, loaded, checkpointed and exported as it is."""

from __future__ import annotations

from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from . import mla
from .moe_family import MoeAdapter, check_groups, check_layers, grouped_sigmoid_route
from .qwen3_moe import FAMILY as QWEN3_MOE

FAMILY = QWEN3_MOE.like(  # Qwen3-MoE's sparse block and files
    name="DeepSeek-V3",
    family="deepseek_v3",
    hf=hf,
    experts_key="n_routed_experts",
    shared_expert="plain",
    qk_norm=None,
    attention="mla",
    route=grouped_sigmoid_route,
    aux_loss=False,
)


def check_moe(config) -> None:
    check_groups(config, FAMILY.name)
    check_layers(config, FAMILY.name)
    mla.check_config(config, FAMILY.name)


ADAPTER = MoeAdapter(FAMILY, check_moe)
