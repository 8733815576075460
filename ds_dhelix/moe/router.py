"""Routing bookkeeping of one MoE layer for one micro-batch: which token copies go to which expert,
the load-balancing loss pieces, and reproducible router noise.

A token routed to k experts becomes k *copies* (copy ``c = token * k + slot``). The router sorts
the copies by global expert id, so the copies for EP rank r (experts ``[r*E/ep, (r+1)*E/ep)``) are
one contiguous run: that is the all-to-all send buffer.

    dropless   xs [n = N*k, h]: copies sorted by expert; uneven splits after a count exchange
    capacity   xs [E*C, h]: C slots per expert (C = ceil(cf * N * k / E)); copies past C are dropped
               (their contribution is 0, counted in ``Route.dropped``); even splits, no exchange

The ``Route`` lives in the micro-batch's ``side`` between the router, dispatch, experts, combine
and add ops, and between forward and backward.

Host reads: none here. Every shape is known on the host from the token count alone (``rows``,
``capacity``); the counts, the rows of each copy, the capacity slots that hold a copy and the
dropped copies stay tensors on the device (no ``bincount``, no boolean mask indexing, no
``int(t)``: each would wait for the device). The split sizes the dropless all-to-all needs as
Python lists reach the host through a ``runtime.comm.HostCopy`` started after the count exchange
(``moe.dispatch``) or, with one EP rank and a loop over experts, right here (``local_counts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..runtime.comm import HostCopies, HostCopy


@dataclass
class Route:
    """One layer's routing of one micro-batch on this rank."""

    num_tokens: int  # N tokens routed on this rank
    top_k: int  # copies per token
    counts: torch.Tensor  # [E] copies sent to each global expert (before capacity)
    copy_row: torch.Tensor  # [N*k] row of the send buffer holding each copy (dropped: ``rows``)
    rows: int  # rows of the send buffer: N*k (dropless) or E*C (capacity)
    token_of: torch.Tensor  # token of each buffer row (capacity: of each slot; an empty slot's is any token)
    filled: torch.Tensor | None = None  # capacity mode: [E*C] which slots hold a copy (the others are zero)
    capacity: int | None = None  # slots per expert (capacity mode) or None (dropless)
    dropped: torch.Tensor | int = 0  # copies dropped by capacity (a device tensor in capacity mode)
    # dropless: filled when ``moe.counts`` completes (ep > 1) or by ``local_counts`` (ep == 1)
    recv_counts: torch.Tensor | None = None  # [ep, E/ep] copies this rank's experts get from each source
    host_counts: HostCopy | None = None  # those counts on their way to the host (``split_sizes``)
    # host lists, read from ``host_counts`` where first needed (the dispatch launch; ep == 1: the experts)
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    expert_sizes: list[int] | None = None  # received rows per local expert
    expert_index: torch.Tensor | None = None  # received rows -> expert-major order (device)
    expert_counts: torch.Tensor | None = None  # received rows per local expert (device: the grouped GEMM)

    @property
    def padded(self) -> bool:
        return self.capacity is not None


def capacity_for(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ``ceil(capacity_factor * tokens * top_k / experts)``, at least 1."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def route_tokens(
    x: torch.Tensor, selected: torch.Tensor, num_experts: int, capacity_factor: float | None = None, kernels=None
) -> tuple[torch.Tensor, Route]:
    """Token rows ``x [N, h]`` and expert ids ``selected [N, k]`` -> (send buffer, ``Route``).

    The send buffer holds the copies grouped by expert in ascending id order (stable: earlier tokens
    first), so gradients flow back to ``x`` through a plain ``index_select`` (capacity mode: and a
    mask of the empty slots); ``kernels`` (``moe.kernels``; None: torch's) writes it."""
    route = plan_route(selected, num_experts, capacity_factor)
    return (encode_rows if kernels is None else kernels.encode)(x, route), route


def encode_rows(x: torch.Tensor, route: Route) -> torch.Tensor:
    """Token rows ``x [N, h]`` -> the send buffer ``[rows, h]`` (torch's encode)."""
    rows = x.index_select(0, route.token_of)
    return rows if not route.padded else torch.where(route.filled.unsqueeze(-1), rows, 0)


def plan_route(selected: torch.Tensor, num_experts: int, capacity_factor: float | None = None) -> Route:
    """Expert ids ``selected [N, k]`` -> the ``Route``: each copy's row of the send buffer."""
    n_tok, k = selected.shape
    sel = selected.reshape(-1)
    order = torch.argsort(sel, stable=True)  # sorted position -> copy
    # (not bincount: on CUDA it reads the largest id on the host to size its output)
    counts = torch.zeros(num_experts, dtype=torch.long, device=sel.device).scatter_add_(0, sel, torch.ones_like(sel))
    if capacity_factor is None:
        copy_row = torch.empty_like(order)
        copy_row[order] = torch.arange(order.numel(), device=order.device)
        return Route(
            n_tok, k, counts, copy_row, rows=order.numel(), token_of=torch.div(order, k, rounding_mode="floor")
        )
    return capacity_route(n_tok, k, sel, order, counts, capacity_for(n_tok, k, num_experts, capacity_factor))


def capacity_route(n_tok: int, k: int, sel: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, cap: int) -> Route:
    """Capacity mode's ``Route`` (``cap`` slots per expert), with fixed shapes only: a copy past its
    expert's ``cap`` reads the zero pad row ``E*C``; slot ``e*C + p`` holds the ``p``-th copy of
    expert ``e`` in sorted order when ``p < counts[e]`` (``filled``), else a zero row."""
    num_experts, n = counts.numel(), order.numel()
    sorted_sel = sel[order]
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(n, device=order.device) - starts[sorted_sel]
    rows = num_experts * cap
    copy_row = torch.empty_like(order)
    copy_row[order] = torch.where(pos < cap, sorted_sel * cap + pos, rows)  # dropped copies read a zero pad row
    slot = torch.arange(rows, device=order.device)
    expert, p = torch.div(slot, cap, rounding_mode="floor"), slot % cap
    src = (starts[expert] + p).clamp(max=max(n - 1, 0))  # sorted position of the copy in each slot
    return Route(
        n_tok,
        k,
        counts,
        copy_row,
        rows=rows,
        token_of=torch.div(order[src], k, rounding_mode="floor"),
        filled=p < counts[expert],
        capacity=cap,
        dropped=(counts - cap).clamp(min=0).sum(),
    )


def combine_copies(ys: torch.Tensor, weights: torch.Tensor, route: Route) -> torch.Tensor:
    """Expert outputs back in the send layout ``ys`` -> per-token weighted sum ``[N, h]``.

    Per token: ``sum_slot y[copy] * weight[slot]``, as HF's ``PhimoeExperts`` (for k = 2 the sum of
    two products is exact in any order, so it matches HF's per-expert ``index_add_``)."""
    if route.padded:
        ys = torch.cat([ys, ys.new_zeros(1, ys.shape[-1])])
    yc = ys.index_select(0, route.copy_row).view(route.num_tokens, route.top_k, -1)
    return (yc * weights.unsqueeze(-1).to(yc.dtype)).sum(dim=1)


def local_counts(route: Route, ep: int, copies: HostCopies | None = None) -> None:
    """Split sizes when nothing is exchanged (ep == 1, or capacity mode with even splits): every
    copy stays (``rows`` of them). ``copies`` (a ``runtime.comm.HostCopies``): start the counts'
    way to the host now, for a loop over the experts that reads them at ``moe.experts.up``; None
    (a grouped GEMM, which takes its offsets on the device): nothing goes to the host."""
    if route.padded:
        return
    route.recv_counts = route.counts.view(ep, -1)
    route.send_splits = route.recv_splits = [route.rows]
    if copies is not None:
        route.host_counts = copies.start(route.recv_counts)


# ---------------------------------------------------------------------------- load-balancing loss
def aux_piece(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """One layer's share of HF's ``load_balancing_loss_func`` (no attention mask): ``[2, E]`` =
    (top-k assignment counts, summed router probabilities). Only the second row has a gradient."""
    probs = torch.softmax(router_logits, dim=-1)
    _, top = torch.topk(probs, top_k, dim=-1)
    num_experts = router_logits.shape[-1]
    dtype = torch.float32 if router_logits.device.type in ("cpu", "mps") else torch.int32
    counts = torch.histc(top.reshape(-1).to(dtype), bins=num_experts, min=0, max=num_experts)
    return torch.stack([counts.float(), probs.float().sum(dim=0)])


def load_balancing_loss(pieces, num_tokens: int, num_experts: int, reduce=None, world: int = 1) -> torch.Tensor:
    """HF's ``load_balancing_loss_func`` over all layers from the per-layer ``aux_piece`` s (same
    accumulation order, so the value is HF's bit for bit when the pieces are).

    ``reduce`` (e.g. a differentiable all-reduce over the TP group) sums the pieces of ``world``
    ranks that each routed ``num_tokens`` tokens of the same micro-batch."""
    tokens_sum = torch.zeros(num_experts, dtype=torch.float32, device=pieces[0].device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=pieces[0].device)
    total = 0.0
    for p in pieces:
        tokens_sum = tokens_sum + p[0]
        prob_sum = prob_sum + p[1]
        total = total + num_tokens
    if reduce is not None:
        tokens_sum, prob_sum = reduce(torch.stack([tokens_sum, prob_sum]))
        total = total * world
    return torch.sum((tokens_sum / total) * (prob_sum / total).unsqueeze(0)) * num_experts


# ---------------------------------------------------------------------------- router functions
def grouped_sigmoid_topk(
    logits: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-4.5 routing of router ``logits [N, E]`` (fp32): ``(weights [N, k], experts [N, k])``.

    Scores are ``sigmoid(logits)``. The choice reads ``scores + bias`` (``e_score_correction_bias``,
    aux-free balancing; it never weighs a token): the experts split into ``n_group`` groups, each
    group scores the sum of its two best experts, a token may only pick among its ``topk_group``
    best groups, then its ``top_k`` best experts there. The weights are the chosen experts' plain
    scores, renormalised to sum 1 when ``norm_topk_prob``, times ``scaling``
    (``routed_scaling_factor``). Same operations in the same order as HF's ``DeepseekV3TopkRouter``."""
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    n, num = choice.shape
    if n_group > 1 or topk_group < n_group:
        group_scores = choice.view(n, n_group, num // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1)
        keep = keep.unsqueeze(-1).expand(-1, n_group, num // n_group).reshape(n, num)
        choice = choice.masked_fill(~keep.bool(), float("-inf"))
    experts = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, experts


def softmax_after_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: the ``top_k`` largest logits per token, softmax over those only:
    ``(weights [N, k], experts [N, k])`` (HF's ``GptOssTopKRouter``)."""
    top, experts = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), experts
