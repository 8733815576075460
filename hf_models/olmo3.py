"""OLMo 3 adapter: post-norm layers (the norms after attention and after the MLP, none before),
q and k normalised over all heads of a token before RoPE (under TP their sums of squares are
all-reduced: ``dense_family.full_qk_norm``), sliding and full layers (``layer_types``) each with
its own RoPE."""

from __future__ import annotations

from transformers.models.olmo3 import modeling_olmo3 as hf

from .dense_family import DenseAdapter
from .llama import FAMILY as LLAMA

FAMILY = LLAMA.like(name="OLMo 3", family="olmo3", hf=hf, norms="post", qk_norm="full")
ADAPTER = DenseAdapter(FAMILY)
