"""Mistral adapter: Llama without biases and with sliding-window attention on every layer
(``sliding_window``; None: full causal attention)."""

from __future__ import annotations

from transformers.models.mistral import modeling_mistral as hf

from .dense_family import DenseAdapter
from .llama import FAMILY as LLAMA

FAMILY = LLAMA.like(name="Mistral", family="mistral", hf=hf)
ADAPTER = DenseAdapter(FAMILY)
