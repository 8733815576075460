"""Predicted times of every op of every block for one micro-batch (``StepTimes``), from the
roofline on a GPU (``roofline_times``); ``cpu.table_times`` makes the same from a profiled table.

A kernel takes ``max(FLOPs / (peak x efficiency), bytes / (memory bandwidth x efficiency))``; an
op's time is the sum of its kernels'; a collective's is ``links.collective_ms`` on its group's
placement. A step adds, once: the all-reduce of TP-replicated weights' gradients (norms,
embedding, head), the data-parallel gradient reduction (dense weights over DP x CP, experts over
expert-data-parallel ranks; ZeRO-1/2's reduce-scatter and all-gather move as much) and the
optimizer's memory-bound update, after the step's last backward. On one stage the engine drives the
data-parallel reduction during that backward (``overlap_grad_reduction``): ``overlap_dp_grads``
launches each block's share of it as the block's backward ends (the TP-replicated weights' share
last) on the link one after another, and only what runs past the backward's end counts.
Plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..pipe.folding import fold_layers
from .hardware import Hardware
from .links import collective_ms, placement
from .roofline import BlockContext, Kernel, OpWork, line_work
from .shapes import ModelOutline, ModelShape, RunLayout, op_names


@dataclass(frozen=True)
class OpTime:
    """One op of one block, ms per micro-batch: forward, backward (a linear op's input-gradient
    part) and weight gradient (deferred under reactive SI when ``linear``); a collective's group
    and link."""

    name: str
    comm: bool
    fwd_ms: float
    bwd_ms: float
    wgrad_ms: float = 0.0
    linear: bool = False
    group: str = ""
    link: str = ""


@dataclass(frozen=True)
class StepTimes:
    """Every block's op times for one micro-batch, what a step adds once (``tail``, ms by name),
    one stage-to-stage transfer (``p2p_ms``) and how the executor runs on this device
    (``slowdown`` of compute while collectives fly; ``reacts``: a completed collective lets its
    strand go at once, as on CPU; on CUDA the host does not see completions)."""

    blocks: tuple[tuple[OpTime, ...], ...]
    tail: dict = field(default_factory=dict)
    p2p_ms: float = 0.0
    slowdown: float = 0.0
    reacts: bool = False
    notes: dict = field(default_factory=dict)  # how the times were derived (reported with the assumptions)

    def compute_ms(self, blocks=None) -> float:
        """Compute of one micro-batch's forward and backward (over ``blocks``, default all)."""
        return sum(o.fwd_ms + o.bwd_ms + o.wgrad_ms for b in self._pick(blocks) for o in b if not o.comm)

    def comm_ms(self, blocks=None) -> float:
        """Collectives of one micro-batch's forward and backward (over ``blocks``, default all)."""
        return sum(o.fwd_ms + o.bwd_ms for b in self._pick(blocks) for o in b if o.comm)

    def _pick(self, blocks):
        return self.blocks if blocks is None else [self.blocks[b] for b in blocks]


def kernel_ms(hw: Hardware, k: Kernel, dtype: str) -> float:
    a, gpu = hw.assumptions, hw.gpu
    memory = k.bytes / (gpu.memory_gbs * 1e9 * a.memory_efficiency)
    if k.kind == "mem":
        return memory * 1e3
    eff = a.attention_efficiency if k.kind == "attn" else a.gemm_efficiency
    return max(k.flops / (gpu.peak_flops(dtype) * eff), memory) * 1e3


def _sum(hw: Hardware, kernels, dtype: str) -> float:
    return sum(kernel_ms(hw, k, dtype) for k in kernels)


def block_context(shape: ModelShape, layout: RunLayout, outline: ModelOutline, b: int) -> BlockContext:
    names = op_names(outline.blocks[b])
    layer = 0 < b < len(outline.blocks) - 1
    tp1 = layout.dims.tp == 1
    return BlockContext(
        shape,
        layout,
        window=outline.windows[b - 1] if layer else None,
        tp_attention=tp1 or "attn.ag" in names,
        tp_mlp=tp1 or "mlp.ag" in names,
    )


def roofline_times(outline: ModelOutline, shape: ModelShape, layout: RunLayout, hw: Hardware) -> StepTimes:
    """``StepTimes`` of the roofline model on ``hw`` (see the module docstring)."""
    places = {k: placement(layout.dims, k, hw.gpus_per_node) for k in ("tp", "cp", "ep", "replica", "edp", "pp")}
    blocks = []
    for b, ops in enumerate(outline.blocks):
        ctx = block_context(shape, layout, outline, b)
        blocks.append(tuple(_op_time(hw, op, line_work(op, ctx), places, layout.dtype) for op in ops))
    tail = step_tail(hw, shape, outline, layout, places)
    if layout.zero_stage == 3:  # each block's gathers and reduce-scatters are ops of the block
        blocks = zero3_blocks(hw, blocks, shape, outline, layout, places)
        tail = {**tail, "dp_grads": 0.0}
    tail, notes = overlap_dp_grads(tail, blocks, shape, outline, layout)
    p2p = (
        collective_ms(hw, places["pp"], "p2p", BlockContext(shape, layout).n_loc * shape.hidden * layout.bytes)
        if layout.dims.pp > 1
        else 0.0
    )
    return StepTimes(tuple(blocks), tail, p2p, hw.assumptions.comm_slowdown, reacts=False, notes=notes)


def _op_time(hw: Hardware, op, work: OpWork, places: dict, dtype: str) -> OpTime:
    """``op``'s times from its ``work`` (``line_work``: a weight gradient that is not deferrable is
    in the backward already)."""
    if work.comm is not None:
        c, p = work.comm, places[work.comm.group]
        link = f"{c.group}:{'net' if p.crosses_nodes else hw.intra_link.kind}"
        return OpTime(
            op.name,
            True,
            collective_ms(hw, p, c.fwd, c.nbytes),
            collective_ms(hw, p, c.bwd, c.nbytes),
            group=c.group,
            link=link,
        )
    fwd, bwd, wgrad = (_sum(hw, ks, dtype) for ks in (work.fwd, work.bwd, work.wgrad))
    return OpTime(op.name, False, fwd, bwd, wgrad, linear=op.linear)


# ----------------------------------------------------------------------------- once per step
@dataclass(frozen=True)
class RankParams:
    """Parameters on the busiest rank (pipeline rank 0: embedding and head): ``sharded`` (cut by
    TP), ``replicated`` (whole on every TP rank: gradients all-reduced over TP), ``experts``."""

    sharded: float
    replicated: float
    experts: float


def _layer_params(shape: ModelShape, ops, tp: int) -> tuple[float, float, float]:
    h, names = shape.hidden, op_names(ops)
    if shape.mla:
        q_rep = h * shape.q_lora_rank if shape.q_lora_rank else 0.0
        q_cut = (shape.q_lora_rank or h) * shape.heads * shape.qk_dim
        rep = q_rep + h * (shape.kv_lora_rank + shape.qk_rope_dim)
        cut = (
            q_cut + shape.kv_lora_rank * shape.heads * (shape.qk_nope_dim + shape.v_dim) + shape.heads * shape.v_dim * h
        )
    else:
        rep = 0.0
        cut = h * (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim
    rep += 2 * h  # norms
    experts = 0.0
    if "moe.router" in names:
        rep += h * shape.experts + 3 * h * shape.shared_intermediate
        experts = shape.experts * 3 * h * shape.expert_intermediate
    else:
        mlp = (3 if shape.gated else 2) * h * shape.intermediate
        cut, rep = (cut + mlp, rep) if "mlp.ag" in names or tp == 1 else (cut, rep + mlp)
    return cut / tp, rep, experts


def rank_params(shape: ModelShape, outline: ModelOutline, layout: RunLayout) -> RankParams:
    dims = layout.dims
    layers = range(shape.num_layers) if dims.pp == 1 else fold_layers(shape.num_layers, dims.pp).rank_layers(0)
    cut = rep = experts = 0.0
    for layer in layers:
        c, r, e = _layer_params(shape, outline.blocks[layer + 1], dims.tp)
        cut, rep, experts = cut + c, rep + r, experts + e / dims.ep
    vocab = shape.vocab * shape.hidden * (1 if shape.tied else 2)  # split over TP (``hf_models.vocab``)
    return RankParams(cut + vocab / dims.tp, rep + shape.hidden, experts)


def step_tail(hw: Hardware, shape: ModelShape, outline: ModelOutline, layout: RunLayout, places: dict) -> dict:
    """ms a step adds once: ``tp_grads``, ``dp_grads``, ``optimizer`` (see the module docstring)."""
    p, e, dims = rank_params(shape, outline, layout), layout.bytes, layout.dims
    replica, edp = places["replica"], places["edp"]
    dense = p.sharded + p.replicated
    shards = (replica.size, edp.size) if layout.zero_stage else (1, 1)
    update = (dense / shards[0] + p.experts / shards[1]) * hw.assumptions.optimizer_bytes_per_param
    return {
        "tp_grads": collective_ms(hw, places["tp"], "all_reduce", p.replicated * e) if dims.tp > 1 else 0.0,
        "dp_grads": collective_ms(hw, replica, "all_reduce", dense * e)
        + (collective_ms(hw, edp, "all_reduce", p.experts * e) if p.experts else 0.0),
        "optimizer": update / (hw.gpu.memory_gbs * 1e9 * hw.assumptions.memory_efficiency) * 1e3,
    }


def block_params(shape: ModelShape, outline: ModelOutline, layout: RunLayout) -> list[float]:
    """Trained parameters of one rank by the block whose backward makes their gradients final
    (``[pre, layers.., post]``; a tied head's matrix with the embedding), the TP-replicated ones
    (reduced over TP after the backward) appended as one more entry."""
    dims, h = layout.dims, shape.hidden
    vocab = shape.vocab * h / dims.tp
    out, replicated = [vocab], h  # the embedding; the final norm
    for layer in range(shape.num_layers):
        cut, rep, experts = _layer_params(shape, outline.blocks[layer + 1], dims.tp)
        out.append(cut + experts / dims.ep)
        replicated += rep
    out.append(0.0 if shape.tied else vocab)
    return [*out, replicated]


def overlap_dp_grads(tail: dict, blocks, shape: ModelShape, outline: ModelOutline, layout: RunLayout):
    """``tail`` with ``dp_grads`` cut to what the step waits for when the reduction runs during the
    last backward (module docstring), and notes of the whole and the exposed part (ms); unchanged
    (and no notes) for a pipeline or ``overlap_grad_reduction`` off."""
    whole = tail.get("dp_grads", 0.0)
    if layout.dims.pp > 1 or not layout.overlap_grad_reduction or not whole:
        return tail, {}
    params = block_params(shape, outline, layout)
    total = sum(params) or 1.0
    clock = done = 0.0  # the backward's clock; when the link is free
    for b in reversed(range(len(blocks))):
        clock += sum(o.bwd_ms + o.wgrad_ms for o in blocks[b])
        done = max(done, clock) + whole * params[b] / total
    exposed = done + whole * params[-1] / total - clock  # (done >= clock: the embedding's share starts at the end)
    return {**tail, "dp_grads": exposed}, {"dp_grads_ms": {"whole": whole, "exposed": exposed}}


def zero3_blocks(hw: Hardware, blocks: list, shape: ModelShape, outline: ModelOutline, layout: RunLayout, places):
    """ZeRO-3 (``engine/zero3.py``): every block between ``z3.in`` (forward: gather the block's
    parameters; backward: reduce-scatter its gradients) and ``z3.out`` (backward: gather again), on
    the data-parallel group (expert shards on their expert-data-parallel group, one after the
    other). Projected without the engine's prefetch (``dhelix.zero3_prefetch`` 0): a strand's
    gather waits at its block, hidden only by the other strand."""
    dims, replica, edp = layout.dims, places["replica"], places["edp"]
    per_block = block_params(shape, outline, layout)
    counts = per_block[:-1]
    counts[-1] += per_block[-1]  # (TP-replicated weights: counted with the head, a small share)
    experts = [0.0] * len(counts)
    for layer in range(shape.num_layers):
        experts[layer + 1] = _layer_params(shape, outline.blocks[layer + 1], dims.tp)[2] / dims.ep

    def both(kind: str, b: int) -> float:
        dense, shards = (counts[b] - experts[b]) * layout.bytes, experts[b] * layout.bytes
        return collective_ms(hw, replica, kind, dense) + (collective_ms(hw, edp, kind, shards) if shards else 0.0)

    out = []
    for b, ops in enumerate(blocks):
        gather = both("all_gather", b)
        link = f"replica:{'net' if replica.crosses_nodes else hw.intra_link.kind}"
        z_in = OpTime("z3.in", True, gather, both("reduce_scatter", b), group="replica", link=link)
        z_out = OpTime("z3.out", True, 0.0, gather, group="replica", link=link)
        out.append((z_in, *ops, z_out))
    return out
