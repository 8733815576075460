"""Phi-3 / Phi-4 adapter: fused ``qkv_proj`` (rows [q | k | v], cut per head group under TP) and
``gate_up_proj`` (rows [gate | up], cut per half), partial rotary (``partial_rotary_factor``) and
LongRoPE through HF's own rotary embedding, dropout on the attention and MLP outputs
(``resid_pdrop``)."""

from __future__ import annotations

from transformers.models.phi3 import modeling_phi3 as hf

from .dense_family import DenseAdapter, warn_unused
from .llama import FAMILY as LLAMA

FAMILY = LLAMA.like(name="Phi-3", family="phi3", hf=hf, fused_qkv=True, fused_gate_up=True, resid_dropout="resid_pdrop")


def check(config) -> None:
    warn_unused(config, "embd_pdrop", "Phi-3")


ADAPTER = DenseAdapter(FAMILY, check)
