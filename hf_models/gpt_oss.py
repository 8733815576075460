"""gpt-oss adapter: ``GptOssForCausalLM`` -> ``ModelGraph`` through the shared MoE layer machinery
(``moe_family.py``): a linear router with a bias, softmax over each token's top-k logits only;
experts with biases, gate and up in alternate columns of ``gate_up_proj [E, h, 2I]`` and the
clamped SwiGLU (``ExpertLayout`` gpt-oss); attention with q/k/v/o biases, a learned sink logit
per head (eager attention: transformers has no sdpa kernel for sinks), and sliding-window layers
alternating with full ones (``layer_types``). Files hold the fused expert tensors under their own
names (no per-expert keys)."""

from __future__ import annotations

from transformers.models.gpt_oss import modeling_gpt_oss as hf

from ds_dhelix.moe.experts import GPT_OSS_LAYOUT

from .moe_family import MoeAdapter, MoeFamily, biased_softmax_route, check_top_k

FAMILY = MoeFamily(
    name="gpt-oss",
    family="gpt_oss",
    hf=hf,
    router="router",
    block_jitter=None,
    experts_key="num_local_experts",
    files_block="mlp",
    files_router="router",
    files_experts=None,
    route=biased_softmax_route,
    layout=GPT_OSS_LAYOUT,
    sinks=True,
    sliding=True,
)


def check_moe(config) -> None:
    check_top_k(config, FAMILY.experts_key)
    kinds = set(getattr(config, "layer_types", None) or []) - {"sliding_attention", "full_attention"}
    if kinds:
        raise ValueError(f"gpt-oss layer_types {sorted(kinds)}: only 'sliding_attention' and 'full_attention' exist")


ADAPTER = MoeAdapter(FAMILY, check_moe)
