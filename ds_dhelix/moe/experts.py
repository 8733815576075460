"""Expert shards and their computation: HF's fused 3D expert tensors, sliced by global expert id.

EP rank r of ``ep`` holds experts ``[r*E/ep, (r+1)*E/ep)`` of ``gate_up_proj [E, 2I, h]`` and
``down_proj [E, h, I]`` (the HF parameter names stay, so state_dict keys do not change). Shards
are marked the DeepSpeed way (``allreduce = False``, ``group_name = "ep_size_<ep>"``) so ZeRO
reduces their gradients over the expert-data-parallel group, and carry ``expert_ids`` so that
``gather_expert_param`` rebuilds the full HF tensor with every expert at its global index.

Host reads while a step runs: none of their own. The regrouping of received rows by expert is a
permutation built on the device from the received counts (``expert_major_index``); a grouped GEMM
takes its offsets from a device tensor (``Route.expert_counts``); only the loop over experts needs
the rows per expert on the host, and takes them from the dispatch's one read of the split sizes
(``moe.dispatch.split_sizes``; with one EP rank the router's ``HostCopy``, read here). Capacity
mode's sizes are fixed (``ep * C`` rows per expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..graph.shards import select
from ..runtime.comm import HostCopy
from ..runtime.groups import ExpertGroups
from .router import Route

EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")  # (biases: gpt-oss)
# LoRA on the fused tensors (PEFT target_parameters), expert-major: hf_models/expert_lora.py
EXPERT_FACTORS = tuple(f"{t}_lora_{x}" for t in ("gate_up_proj", "down_proj") for x in "AB")


@dataclass(frozen=True)
class ExpertLayout:
    """How a family's fused expert tensors hold each expert's FFN.

    default   ``gate_up_proj [E, 2I, h]`` rows ``[gate | up]``, ``down_proj [E, h, I]`` (``F.linear``),
              ``act(gate) * up``: Mixtral, Qwen-MoE, OLMoE, DeepSeek-V3, GLM-4.5
    gpt-oss   ``gate_up_proj [E, h, 2I]`` (``x @ W``) with gate and up in alternate columns,
              ``down_proj [E, I, h]``, a bias per expert on both, the clamped SwiGLU
              ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=l)``
    """

    transposed: bool = False  # weights [E, in, out] (x @ W), else [E, out, in]
    bias: bool = False  # gate_up_proj_bias [E, 2I] and down_proj_bias [E, h]
    interleaved: bool = False  # gate = columns 0::2, up = 1::2 (else the two halves)
    clamped: bool = False  # the clamped SwiGLU (the experts' ``alpha`` and ``limit``)


DEFAULT_LAYOUT = ExpertLayout()
GPT_OSS_LAYOUT = ExpertLayout(transposed=True, bias=True, interleaved=True, clamped=True)


def valid_ep_sizes(num_experts: int, dp_size: int | None = None) -> list[int]:
    return [d for d in range(1, num_experts + 1) if num_experts % d == 0 and (dp_size is None or dp_size % d == 0)]


def check_ep(num_experts: int, top_k: int, ep: int, dp_size: int | None = None, key: str = "num_local_experts") -> None:
    """``ValueError`` for an expert-parallel size or top-k that cannot work, naming the valid ones
    (``key``: the config key of the expert count, for the message)."""
    if top_k > num_experts:
        raise ValueError(
            f"num_experts_per_tok {top_k} is larger than {key} {num_experts}: "
            f"a token cannot be routed to more experts than exist; use top-k <= {num_experts}"
        )
    if ep < 1 or num_experts % ep:
        raise ValueError(
            f"expert_parallel.size {ep} does not divide {key} {num_experts}; "
            f"valid EP sizes: {valid_ep_sizes(num_experts, dp_size)}"
        )
    if dp_size is not None and dp_size % ep:
        raise ValueError(
            f"expert_parallel.size {ep} does not divide the data-parallel size {dp_size} "
            f"(experts are sharded inside the DP group); valid EP sizes: "
            f"{valid_ep_sizes(num_experts, dp_size)}"
        )


def shard_experts(experts: nn.Module, groups: ExpertGroups) -> None:
    """Keep this EP rank's experts of every fused expert tensor, in place, and mark the shards."""
    num = getattr(experts, "num_experts", None) or experts.gate_up_proj.shape[0]
    local = num // groups.size
    lo = groups.rank * local
    for name in EXPERT_PARAMS + EXPERT_FACTORS:
        p = getattr(experts, name, None)
        if p is None:
            continue
        if groups.size > 1:
            part = select(p, 0, slice(lo, lo + local))
            p = nn.Parameter(p.data[lo : lo + local].clone(), requires_grad=p.requires_grad)
            p.hf_selection = part  # which experts of the full HF tensor (sharded loading)
            setattr(experts, name, p)
        if groups.size > 1:  # DeepSpeed: an expert parameter, reduced over the expert-DP group
            p.allreduce = False
            p.group_name = groups.name
        p.expert_ids = tuple(range(lo, lo + local))
        p.ep_size, p.ep_group = groups.size, groups.group.forward
    experts.local_expert_ids = tuple(range(lo, lo + local))


def is_expert_param(p) -> bool:
    return getattr(p, "expert_ids", None) is not None


def gather_expert_param(p: torch.Tensor, data: torch.Tensor | None = None) -> torch.Tensor:
    """The full HF tensor ``[E, ...]`` of an expert shard: all-gather over its EP group, placing
    every shard at its global expert ids (a shard claiming other ids is refused). ``data``: gather
    this tensor of ``p``'s shape (e.g. its gradient) instead of ``p`` itself."""
    data = p.data if data is None else data
    if getattr(p, "ep_size", 1) == 1:
        return data.detach().clone()
    group, ep = p.ep_group, p.ep_size
    parts = [torch.empty_like(data) for _ in range(ep)]
    dist.all_gather(parts, data.contiguous(), group=group)
    ids = torch.tensor(p.expert_ids, dtype=torch.long, device=p.device)
    all_ids = [torch.empty_like(ids) for _ in range(ep)]
    dist.all_gather(all_ids, ids, group=group)
    local = len(p.expert_ids)
    for r, got in enumerate(all_ids):
        want = list(range(r * local, (r + 1) * local))
        if got.tolist() != want:
            raise RuntimeError(
                f"EP rank {r} holds experts {got.tolist()}, expected {want}: "
                f"the expert shards do not match this EP layout"
            )
    return torch.cat(parts, dim=0)


# ---------------------------------------------------------------------------- computation
def expert_major_index(recv_counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Received rows come source-major ([src][local expert]); the permutation to expert-major order,
    on the device from ``recv_counts [ep, local]`` (``rows``: their sum, the received buffer's
    length): row ``i`` of expert-major block ``(e, s)`` is received row ``i + start(s, e) - start'(e, s)``."""
    ep, local = recv_counts.shape
    flat = recv_counts.reshape(-1)
    src_start = (torch.cumsum(flat, 0) - flat).view(ep, local).t().reshape(-1)  # per (e, s), received order
    cnt = recv_counts.t().reshape(-1)
    dst_start = torch.cumsum(cnt, 0) - cnt  # per (e, s), expert-major order
    shift = torch.repeat_interleave(src_start - dst_start, cnt, output_size=rows)
    return torch.arange(rows, device=recv_counts.device) + shift


def expert_linear(x, sizes, weight, grouped: bool, bias=None, transposed: bool = False) -> torch.Tensor:
    """Rows ``x`` grouped by local expert (``sizes`` rows each) times each expert's matrix of
    ``weight [E_local, out, in]``: the gate/up (``moe.experts.up``) and down (``moe.experts.down``)
    projections. A loop of ``F.linear`` per expert, as HF's ``PhimoeExperts`` (every expert runs,
    even on 0 rows, so every shard always gets a gradient; ``sizes`` a host list); ``grouped``: one
    ``torch.nn.functional.grouped_mm`` (``sizes`` a device tensor, or a list it copies there).
    ``transposed``: ``weight [E_local, in, out]`` (``x @ W``, gpt-oss); ``bias [E_local, out]``:
    each expert's bias added to its rows."""
    if grouped:
        counts = sizes if isinstance(sizes, torch.Tensor) else torch.tensor(sizes, device=x.device)
        offs = counts.cumsum(0).to(torch.int32)
        out = F.grouped_mm(x, weight if transposed else weight.transpose(1, 2), offs=offs)
        if bias is not None:
            out = out + bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return out
    if isinstance(sizes, torch.Tensor):
        raise TypeError("expert_linear: the loop over experts takes the rows per expert as a host list")
    outs, start = [], 0
    for e, n in enumerate(sizes):
        rows = x[start : start + n]
        if transposed:
            outs.append(rows @ weight[e] if bias is None else rows @ weight[e] + bias[e])
        else:
            outs.append(F.linear(rows, weight[e], None if bias is None else bias[e]))
        start += n
    return torch.cat(outs)


def expert_weight(experts: nn.Module, name: str, transposed: bool = False) -> torch.Tensor:
    """``experts.<name>`` [E_local, ...], with its LoRA update ``scaling x B_e @ A_e`` added per
    expert where PEFT's ``target_parameters`` put one (``hf_models.expert_lora``), as PEFT computes it."""
    weight = getattr(experts, name)
    a = getattr(experts, f"{name}_lora_A", None)
    if a is None:
        return weight
    delta = torch.bmm(getattr(experts, f"{name}_lora_B"), a) * experts.lora_scalings[name]
    return weight + (delta.transpose(1, 2) if transposed else delta).to(weight.dtype)


def expert_act(gate_up_out: torch.Tensor, act) -> torch.Tensor:
    """``moe.experts.act``: ``act(gate) * up`` (the only non-linear part of an expert)."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    return act(gate) * up


def clamped_swiglu(gate_up_out: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's ``moe.experts.act`` (gate and up in alternate columns): ``g = clamp(gate, max=limit)``,
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` (HF's ``GptOssExperts._apply_gate``)."""
    gate, up = gate_up_out[..., ::2], gate_up_out[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def layout_act(layout: ExpertLayout, experts: nn.Module):
    """``moe.experts.act``'s body for ``layout``: ``g -> activations``."""
    if layout.clamped:
        return lambda g: clamped_swiglu(g, experts.alpha, experts.limit)
    return lambda g: expert_act(g, experts.act_fn)


def expert_ffn(x, sizes, gate_up, down, act, grouped: bool) -> torch.Tensor:
    """Rows ``x`` grouped by local expert (``sizes`` rows each) -> ``down(act(gate) * up)``."""
    return expert_linear(expert_act(expert_linear(x, sizes, gate_up, grouped), act), sizes, down, grouped)


def use_grouped_mm(x: torch.Tensor, mode: bool | None) -> bool:
    """``mode`` None = auto: grouped GEMM on CUDA in bf16 where torch has it, else the loop."""
    if mode is not None:
        return mode
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


def expert_sizes(route: Route, ep: int, local: int, grouped: bool, device=None):
    """Rows per local expert after ``expert_rows``: for the grouped GEMM a device tensor (no host
    read), for the loop a host list (fixed with capacity buffers; dropless: the dispatch's read of
    the split sizes, or with one EP rank the router's ``HostCopy`` read now)."""
    if grouped:
        if route.expert_counts is None:
            route.expert_counts = (
                torch.full((local,), ep * route.capacity, dtype=torch.long, device=device)
                if route.padded
                else route.recv_counts.sum(dim=0)
            )
        return route.expert_counts
    if route.padded:
        return [ep * route.capacity] * local
    if route.expert_sizes is None:  # ep == 1 (ep > 1: read by the dispatch launch)
        host = route.host_counts or HostCopy(route.recv_counts)  # (the router started none: read in place)
        route.expert_sizes = [sum(col) for col in zip(*host.read())]
    return route.expert_sizes


def _expert_index(route: Route, rows: int) -> torch.Tensor:
    if route.expert_index is None:
        route.expert_index = expert_major_index(route.recv_counts, rows)
    return route.expert_index


def expert_rows(xr: torch.Tensor, route: Route, ep: int, local: int) -> torch.Tensor:
    """Received rows (source-major) -> rows grouped by local expert."""
    h = xr.shape[-1]
    if route.padded:  # [src][expert][slot] -> [expert][src][slot]
        return xr.view(ep, local, route.capacity, h).transpose(0, 1).reshape(-1, h)
    if ep == 1:
        return xr
    return xr.index_select(0, _expert_index(route, xr.shape[0]))


def source_rows(ye: torch.Tensor, route: Route, ep: int, local: int) -> torch.Tensor:
    """The inverse of ``expert_rows``: expert outputs back in the received (source-major) order."""
    h = ye.shape[-1]
    if route.padded:
        return ye.view(local, ep, route.capacity, h).transpose(0, 1).reshape(-1, h)
    if ep == 1:
        return ye
    index = _expert_index(route, ye.shape[0])
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return ye.index_select(0, inverse)


def run_expert_up(
    xr: torch.Tensor,
    route: Route,
    experts: nn.Module,
    ep: int,
    grouped: bool | None = None,
    layout: ExpertLayout = DEFAULT_LAYOUT,
) -> torch.Tensor:
    """``moe.experts.up``: received rows (source-major) -> regrouped by local expert -> gate/up
    pre-activations. The expert computation is three ops (``.up``, ``.act``, ``.down``) so that the
    two projections are linear ops whose weight gradients the SI executor may defer: the input
    gradient first, the backward's expert all-to-all launched sooner."""
    local, grouped = experts.gate_up_proj.shape[0], use_grouped_mm(xr, grouped)
    return expert_linear(
        expert_rows(xr, route, ep, local),
        expert_sizes(route, ep, local, grouped, xr.device),
        expert_weight(experts, "gate_up_proj", layout.transposed),
        grouped,
        experts.gate_up_proj_bias if layout.bias else None,
        layout.transposed,
    )


def run_expert_down(
    a: torch.Tensor,
    route: Route,
    experts: nn.Module,
    ep: int,
    grouped: bool | None = None,
    layout: ExpertLayout = DEFAULT_LAYOUT,
) -> torch.Tensor:
    """``moe.experts.down``: activations -> down projection -> rows back in the received order."""
    local, grouped = experts.down_proj.shape[0], use_grouped_mm(a, grouped)
    ye = expert_linear(
        a,
        expert_sizes(route, ep, local, grouped, a.device),
        expert_weight(experts, "down_proj", layout.transposed),
        grouped,
        experts.down_proj_bias if layout.bias else None,
        layout.transposed,
    )
    return source_rows(ye, route, ep, local)
