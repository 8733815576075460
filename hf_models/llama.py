"""Llama adapter: ``LlamaForCausalLM`` -> sharded ``ModelGraph`` (TP + sequence parallel), through
the dense family machinery (``dense_family.py``, where the layer's ops are listed): pre-norm,
separate q/k/v and gate/up projections, biases where ``attention_bias`` / ``mlp_bias`` put them,
RoPE of any ``rope_type`` transformers computes (``llama3`` included)."""

from __future__ import annotations

from transformers.models.llama import modeling_llama as hf

from .dense_family import DenseAdapter, DenseFamily

FAMILY = DenseFamily(name="Llama", family="llama", hf=hf)
ADAPTER = DenseAdapter(FAMILY)
