"""Qwen3.5 (text) adapter: ``Qwen3_5ForCausalLM`` (``model_type`` ``qwen3_5_text``) through the dense
family machinery: Gated DeltaNet linear-attention layers (``deltanet.py``) among full-attention
layers with an output gate, q/k norm per head and partial rotary (``gated_attention.py``), as
``config.layer_types`` says; zero-centred RMSNorms (1 + w: HF's own modules), pre-norm, SwiGLU.
A multimodal ``qwen3_5`` checkpoint is refused in one line (``adapters.REFUSED``)."""

from __future__ import annotations

from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from .dense_family import DenseAdapter
from .qwen3 import FAMILY as QWEN3

KINDS = ("linear_attention", "full_attention")


def check_layer_types(config, name: str) -> None:
    """``ValueError`` for a layer kind transformers' Qwen3.5 model does not build."""
    bad = sorted(set(config.layer_types or []) - set(KINDS))
    if bad:
        raise ValueError(f"{name} layer_types {bad}: only {list(KINDS)} exist")


# Qwen3 (q/k norm per head) with output-gated attention and Gated DeltaNet layers
FAMILY = QWEN3.like(name="Qwen3.5", family="qwen3_5", hf=hf, attention="gated", linear_attention=True)
ADAPTER = DenseAdapter(FAMILY, lambda config: check_layer_types(config, FAMILY.name))
