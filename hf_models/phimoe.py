"""Phi-MoE adapter: ``PhimoeForCausalLM`` -> ``ModelGraph`` with expert parallelism (EP) and
tensor/sequence parallel (TP) attention, through the shared MoE layer machinery
(``moe_family.py``, which lists the layer's ops): the router is HF's sparsemixer (``mlp.router``,
top-2, its own input jitter), norms are LayerNorms with biases, files store one ``w1``/``w2``/``w3``
per expert under ``block_sparse_moe``."""

from __future__ import annotations

from transformers.models.phimoe import modeling_phimoe as hf

from .mixtral import FAMILY as MIXTRAL
from .moe_family import MoeAdapter

FAMILY = MIXTRAL.like(  # Mixtral's sparse block and files; the sparsemixer router
    name="Phi-MoE",
    family="phimoe",
    hf=hf,
    router="router",
    block_jitter="input_jitter_noise",
    # the sparsemixer samples among the experts within router_jitter_noise of the best
    # (0: the top ones, no draw), and the block jitters its input by input_jitter_noise
    noise_keys=("router_jitter_noise", "input_jitter_noise"),
)


def check_moe(config) -> None:
    """Routing settings HF's sparsemixer can run: ``ValueError`` otherwise."""
    num, top_k = config.num_local_experts, config.num_experts_per_tok
    if top_k > num:
        raise ValueError(
            f"num_experts_per_tok {top_k} is larger than num_local_experts {num}: a token cannot "
            f"be routed to more experts than exist; use num_experts_per_tok <= {num}"
        )
    if num < 2:
        raise ValueError(
            f"num_local_experts {num}: Phi-MoE's sparsemixer routes every token to 2 experts; use at least 2 experts"
        )


ADAPTER = MoeAdapter(FAMILY, check_moe)
