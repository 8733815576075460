"""Qwen3 adapter: Llama with an RMSNorm of q and of k per head (``q_norm``, ``k_norm``, before
RoPE), an explicit ``head_dim`` and optional sliding-window layers (``layer_types``)."""

from __future__ import annotations

from transformers.models.qwen3 import modeling_qwen3 as hf

from .dense_family import DenseAdapter
from .llama import FAMILY as LLAMA

FAMILY = LLAMA.like(name="Qwen3", family="qwen3", hf=hf, qk_norm="head")
ADAPTER = DenseAdapter(FAMILY)
