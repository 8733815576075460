"""Mixtral adapter: ``MixtralForCausalLM`` -> ``ModelGraph`` with expert parallelism (EP) and
tensor/sequence parallel (TP) attention, through the shared MoE layer machinery
(``moe_family.py``): the router is HF's softmax top-k with the top-k weights renormalised
(``mlp.gate``), the sparse block jitters its input by ``router_jitter_noise``, norms are RMSNorms,
files store one ``w1``/``w2``/``w3`` per expert under ``block_sparse_moe``."""

from __future__ import annotations

from transformers.models.mixtral import modeling_mixtral as hf

from .moe_family import MoeAdapter, MoeFamily, check_top_k

FAMILY = MoeFamily(
    name="Mixtral",
    family="mixtral",
    hf=hf,
    router="gate",
    block_jitter="jitter_noise",
    experts_key="num_local_experts",
    files_block="block_sparse_moe",
    files_router="gate",
    files_experts=("w1", "w3", "w2"),
    noise_keys=("router_jitter_noise",),
)
ADAPTER = MoeAdapter(FAMILY, lambda config: check_top_k(config, FAMILY.experts_key))
