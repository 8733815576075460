"""Qwen2 / Qwen2.5 adapter: Llama with biases on q/k/v (read off the modules) and, where
``use_sliding_window`` is on, sliding-window layers from ``max_window_layers`` (``layer_types``)."""

from __future__ import annotations

from transformers.models.qwen2 import modeling_qwen2 as hf

from .dense_family import DenseAdapter
from .llama import FAMILY as LLAMA

FAMILY = LLAMA.like(name="Qwen2", family="qwen2", hf=hf)
ADAPTER = DenseAdapter(FAMILY)
