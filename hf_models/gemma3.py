"""Gemma 3 (text) adapter: ``Gemma3ForCausalLM``, through the dense family machinery: embeddings
scaled by sqrt(hidden) and RMSNorms with (1 + w) (HF's own modules), four norms per layer
(sandwich placement), q/k norm per head, ``query_pre_attn_scalar`` scaling, sliding and full
layers (``layer_types``) each with its own RoPE base, GeLU-tanh MLP, final-logit softcapping."""

from __future__ import annotations

from transformers.models.gemma3 import modeling_gemma3 as hf

from .dense_family import DenseAdapter, warn_unused
from .llama import FAMILY as LLAMA

FAMILY = LLAMA.like(
    name="Gemma 3", family="gemma3", hf=hf, qk_norm="head", norms="sandwich", softcap="final_logit_softcapping"
)


def check(config) -> None:
    warn_unused(config, "attn_logit_softcapping", "Gemma 3")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            "Gemma 3 with use_bidirectional_attention=True (an encoder) is not supported by the "
            "ds_dhelix adapter; use a causal (decoder) config"
        )


ADAPTER = DenseAdapter(FAMILY, check)
