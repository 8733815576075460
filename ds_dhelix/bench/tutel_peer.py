"""The ``tutel`` bench modes: the same HF model with each MoE block replaced by tutel's MoE layer
(``tutel.moe.moe_layer``), on plain DeepSpeed, data parallel like ``autoep``.

    tutel           tutel's top-k gate over the family's own router logits, its fast_encode /
                    fast_decode, its all-to-alls over the EP group, this rank's experts (the same
                    weights as the other modes)
    tutel-overlap2  the same with ``a2a_ffn_overlap_degree`` 2: each all-to-all cut in 2 chunks, the
    tutel-overlap4  expert FFN of one chunk run while the next travels (4: in 4 chunks). Tutel does
                    this on CUDA only; on CPU the rows carry that reason

What tutel's gate can express: softmax over the router logits, the top-k, renormalised or not
(``normalize_gate``), so Mixtral, Qwen3-MoE, Qwen2-MoE and Qwen3.5-MoE (+ their sigmoid-gated
shared expert) and OLMoE route exactly as in HF; the other routers (Phi-MoE's sparsemixer, DeepSeek-V3 / GLM-4.5's
grouped sigmoid, gpt-oss's biased experts) are not expressible and their rows say so. The router
module is HF's own (called for its logits), so HF's load-balancing loss sees the same logits and
the objective is the model's. Tutel's capacity is dropless (``capacity_factor`` 0: every expert's
buffer as long as the busiest one, all-reduced over the EP group), as the other modes run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..moe.experts import expert_act
from ..moe.kernels import tutel_missing

TUTEL_MODES = {"tutel": 1, "tutel-overlap2": 2, "tutel-overlap4": 4}
"""Tutel bench modes -> their ``a2a_ffn_overlap_degree``."""

LOSS_TOLERANCE = 1e-5
"""|first-step loss of a tutel mode - sequential's| (fp32). The routing weights and the objective are
the same; tutel runs each rank's experts as one batched GEMM over padded buffers and combines in
its own kernel, so the loss differs by summation order: far below 1e-5 for these losses (~8), while a
routing or weight mistake moves it by more than 1e-3."""

FAMILIES = {"mixtral": True, "qwen3_moe": None, "qwen2_moe": None, "olmoe": None, "qwen3_5_moe_text": True}
"""model_type -> renormalise the top-k weights (None: the config's ``norm_topk_prob``)."""


def tutel_unfit(mode: str, ep: int, world: int, model_config, device: str) -> str | None:
    """Why ``mode`` cannot run on this model and layout, naming the fix (None: it can)."""
    missing = tutel_missing()
    if missing:
        return f"{missing}; install tutel (see the MoE guide) to measure the {mode} row"
    model_type = model_config.model_type
    if model_type not in FAMILIES:
        return (
            f"tutel's gate is a softmax top-k over the router's logits; the {model_type} router is not "
            f"(supported: {', '.join(FAMILIES)}), so a {mode} row would train another model"
        )
    if ep < 2 or world != ep:
        return (
            f"the {mode} mode shards the experts over the whole world (--tp 1 --ep N, data parallel N); got "
            f"ep {ep} on {world} ranks: use --tp 1 --ep 2"
        )
    if TUTEL_MODES[mode] > 1 and device != "cuda":
        return (
            f"tutel overlaps the all-to-all with the expert FFN (a2a_ffn_overlap_degree "
            f"{TUTEL_MODES[mode]}) only on CUDA; on {device} it falls back to no overlap, the tutel row"
        )
    return None


class TutelGate(nn.Module):
    """Tutel's custom gate: the family's router module's logits (HF records them for its aux loss)."""

    def __init__(self, router: nn.Module, top_k: int):
        super().__init__()
        self.router, self.top_k, self.capacity_factor, self.gate_noise = router, top_k, 0.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x)[0]


class TutelExperts(nn.Module):
    """Tutel's custom experts: this rank's slice of HF's fused ``gate_up_proj`` / ``down_proj``, on
    ``[local experts, rows, h]`` -> ``down(act(gate) x up)``; marked as DeepSpeed expert parameters."""

    def __init__(self, experts: nn.Module, rank: int, ep: int):
        super().__init__()
        local = experts.gate_up_proj.shape[0] // ep
        keep = slice(rank * local, (rank + 1) * local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.data[keep].clone())
        self.down_proj = nn.Parameter(experts.down_proj.data[keep].clone())
        self.act_fn = experts.act_fn
        for p in (self.gate_up_proj, self.down_proj):  # DeepSpeed reduces them over the expert-data-parallel group
            p.allreduce, p.group_name = False, f"ep_size_{ep}"

    def forward(self, x: torch.Tensor, _layer=None) -> torch.Tensor:
        h = expert_act(torch.bmm(x, self.gate_up_proj.transpose(1, 2)), self.act_fn)
        return torch.bmm(h, self.down_proj.transpose(1, 2))


class TutelBlock(nn.Module):
    """An HF sparse MoE block as tutel's MoE layer (+ Qwen2-MoE's / Qwen3.5-MoE's gated shared expert)."""

    def __init__(self, block: nn.Module, config, group, rank: int, ep: int, degree: int):
        from tutel import moe as tutel_moe

        super().__init__()
        renormalise = FAMILIES[config.model_type]
        renormalise = bool(config.norm_topk_prob) if renormalise is None else renormalise
        gate, experts = TutelGate(block.gate, config.num_experts_per_tok), TutelExperts(block.experts, rank, ep)
        local = experts.gate_up_proj.shape[0]
        self.moe = tutel_moe.moe_layer(
            gate_type={"type": "custom", "module": lambda **_: gate, "capacity_factor": 0.0},
            experts={"type": "custom", "module": lambda **_: experts, "num_experts_per_device": local},
            model_dim=config.hidden_size,
            group=group,
            a2a_ffn_overlap_degree=degree,
            normalize_gate=renormalise,
        )  # (its own balance loss, l_aux, is left out: HF's is trained)
        self.shared_expert = getattr(block, "shared_expert", None)
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.moe(hidden)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


def with_tutel_blocks(model: nn.Module, ep: int, degree: int) -> nn.Module:
    """``model`` with every sparse block (a block with ``experts``) replaced by a ``TutelBlock``
    over the world's ranks (EP = the world)."""
    rank = dist.get_rank()
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp = TutelBlock(layer.mlp, model.config, dist.group.WORLD, rank, ep, degree)
    return model


def tutel_engine(model: nn.Module, ep: int, config: dict):
    """Plain DeepSpeed on the tutel model (``DeepSpeedExpertEngine``: expert shards reduced over the
    expert-data-parallel group, DeepSpeed's MoE convention, after DeepSpeed's expert groups of ``ep``)."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import groups

    from ..engine.moe_engine import DeepSpeedExpertEngine

    deepspeed.init_distributed(dist_init_required=not dist.is_initialized())
    if f"ep_size_{ep}" not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep)
    return DeepSpeedExpertEngine(
        args=None, model=model, model_parameters=model.parameters(), config=config, config_class=DeepSpeedConfig(config)
    )
