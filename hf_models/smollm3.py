"""SmolLM3 adapter: Llama with NoPE layers (``no_rope_layers``: 0 = no rotary embedding in that
layer) and, where ``use_sliding_window`` is on, sliding-window layers (``layer_types``)."""

from __future__ import annotations

from transformers.models.smollm3 import modeling_smollm3 as hf

from .dense_family import DenseAdapter
from .llama import FAMILY as LLAMA

FAMILY = LLAMA.like(name="SmolLM3", family="smollm3", hf=hf)
ADAPTER = DenseAdapter(FAMILY)
