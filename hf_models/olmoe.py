"""OLMoE adapter: ``OlmoeForCausalLM`` -> ``ModelGraph`` with expert parallelism (EP), through the
shared MoE layer machinery (``moe_family.py``): the router is HF's softmax top-k (``mlp.gate``;
renormalised when ``norm_topk_prob``), q and k get an RMSNorm over the whole projection (every
head at once, so TP would need a norm across ranks: TP = 1 only), files store one
``gate_proj``/``up_proj``/``down_proj`` per expert under ``mlp``. ``clip_qkv`` is refused."""

from __future__ import annotations

from transformers.models.olmoe import modeling_olmoe as hf

from .moe_family import MoeAdapter, check_top_k
from .qwen3_moe import FAMILY as QWEN3_MOE

# Qwen3-MoE's router and files; experts of intermediate_size, q/k norm over the whole projection
FAMILY = QWEN3_MOE.like(name="OLMoE", family="olmoe", hf=hf, inter_key="intermediate_size", qk_norm="full")


def check_moe(config) -> None:
    check_top_k(config, FAMILY.experts_key)
    if getattr(config, "clip_qkv", None) is not None:
        raise ValueError(f"OLMoE clip_qkv {config.clip_qkv} is not supported yet; use a checkpoint with clip_qkv null")


ADAPTER = MoeAdapter(
    FAMILY,
    check_moe,
    max_tp=(
        1,
        "its q/k RMSNorm runs over all heads at once, which a TP shard "
        "does not hold; use tensor_parallel.size 1 and expert_parallel "
        "for the experts",
    ),
)
