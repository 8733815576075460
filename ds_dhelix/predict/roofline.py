"""What each op of the op graph does, per rank and micro-batch: the kernels of its forward, its
backward (a linear op's input-gradient part) and its weight gradient (FLOPs and bytes moved), or
the collective it runs (kind, group, bytes). Keyed by the op names the adapters use.

Per rank, with ``t`` TP, ``c`` CP, ``b`` sequences of ``s`` tokens, ``e`` bytes per element::

    tokens   n_loc = b s / (t c)   (sequence shard: norms, residuals, the head, the MoE block)
             n_tp  = b s / c       (after TP's all-gather: the projections)
    heads    nq = heads / t, nk = max(kv heads / t, 1)   (Ulysses: attention on nq / c heads, all s)
    GEMM m x k x n        2mkn FLOPs, (mk + kn + mn) e bytes; backward: input gradient and weight
                          gradient the same FLOPs each
    attention             2 (d_qk + d_v) FLOPs per (query, key) pair over the causal (or sliding)
                          pairs; backward 2.5x (FlashAttention-2's count: 5 matmuls against 2)
    memory-bound ops      bytes read and written (norms: 2 passes forward, 3 backward)
    MoE                   routing balanced: each rank's experts receive n_loc x top-k rows

Plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape, RunLayout


@dataclass(frozen=True)
class Kernel:
    """One kernel: FLOPs of a ``kind`` ("gemm", "attn"; "mem": none) and bytes moved."""

    kind: str
    flops: float = 0.0
    bytes: float = 0.0


@dataclass(frozen=True)
class Collective:
    """What a COMM op runs: ``fwd`` / ``bwd`` collective kinds on ``group`` ("tp", "cp", "ep") over
    a buffer of ``nbytes`` per rank (all-gather: the gathered buffer; reduce-scatter: the whole
    input; all-to-all and all-reduce: the buffer)."""

    group: str
    fwd: str
    bwd: str
    nbytes: float


@dataclass(frozen=True)
class OpWork:
    fwd: tuple[Kernel, ...] = ()
    bwd: tuple[Kernel, ...] = ()
    wgrad: tuple[Kernel, ...] = ()  # a linear op's weight gradient (its deferrable part)
    comm: Collective | None = None


@dataclass(frozen=True)
class BlockContext:
    """The sizes one block's ops are priced at."""

    shape: ModelShape
    layout: RunLayout
    window: int | None = None  # this layer's sliding window
    tp_attention: bool = True  # the attention projections run on TP-gathered tokens, weights cut by TP
    tp_mlp: bool = True  # the dense MLP likewise (False: a dense layer among MoE ones, whole on n_loc)

    @property
    def e(self) -> int:
        return self.layout.bytes

    @property
    def n_loc(self) -> float:
        d = self.layout.dims
        return self.layout.micro_batch_size * self.layout.seq_len / (d.tp * d.cp)

    @property
    def n_tp(self) -> float:
        return self.n_loc * self.layout.dims.tp

    def heads(self) -> tuple[int, int]:
        """(query heads, kv heads) of this TP rank."""
        t, sh = self.layout.dims.tp, self.shape
        return sh.heads // t, max(sh.kv_heads // t, 1)


def gemm(m: float, k: float, n: float, e: int) -> Kernel:
    return Kernel("gemm", 2.0 * m * k * n, (m * k + k * n + m * n) * e)


def mem(nbytes: float) -> Kernel:
    return Kernel("mem", 0.0, nbytes)


def linear(m: float, k: float, n: float, e: int, before=(), after=()) -> OpWork:
    """A projection [m, k] x [k, n] with memory-bound kernels ``before`` / ``after`` it (forward;
    the backward runs them again, reversed); weight gradient deferrable."""
    g = gemm(m, k, n, e)
    return OpWork(fwd=(*before, g, *after), bwd=(*after, g, *before), wgrad=(g,))


def causal_pairs(s: float, window: int | None) -> float:
    """(query, key) pairs a causal attention over ``s`` tokens scores (``window``: keys per query at most)."""
    if window is None or window >= s:
        return s * (s + 1) / 2
    return window * (window + 1) / 2 + (s - window) * window


# ---------------------------------------------------------------------------- ops by name
def _vocab(ctx: BlockContext) -> float:
    """Vocabulary rows on this rank (split over TP: ``hf_models.vocab``)."""
    return ctx.shape.vocab / ctx.layout.dims.tp


def _embed(ctx: BlockContext) -> OpWork:
    sh, e = ctx.shape, ctx.e
    # TP: every token of the TP group looked up in this rank's rows (the positions added after the
    # reduce-scatter, ``embed.add``); backward: the dense [V/t, h] gradient written, then added to
    # the parameter's (read twice, write)
    n, rows = (ctx.n_tp, 1) if ctx.layout.dims.tp > 1 else (ctx.n_loc, 2 if sh.learned_positions else 1)
    return OpWork(
        fwd=(mem(2 * rows * n * sh.hidden * e),), bwd=(mem(n * sh.hidden * e + 4 * _vocab(ctx) * sh.hidden * e),)
    )


def _norm(passes_fwd: int, passes_bwd: int):
    def work(ctx: BlockContext) -> OpWork:
        size = ctx.n_loc * ctx.shape.hidden * ctx.e
        return OpWork(fwd=(mem(passes_fwd * size),), bwd=(mem(passes_bwd * size),))

    return work


def _head_logits(ctx: BlockContext) -> OpWork:
    # TP: the group's tokens against this rank's vocabulary columns; TP 1: the whole vocabulary
    return linear(ctx.n_tp, ctx.shape.hidden, _vocab(ctx), ctx.e)


def _logit_passes(ctx: BlockContext) -> OpWork:
    # the logits read, cast to fp32, log-softmax (or log-sum-exp) read and written; backward the same
    size = ctx.n_tp * _vocab(ctx) * (ctx.e + 12)
    return OpWork(fwd=(mem(size),), bwd=(mem(size),))


def _head_loss(ctx: BlockContext) -> OpWork:
    if ctx.layout.dims.tp > 1:  # the statistics of this rank's tokens only (``head.lse`` read the logits)
        return OpWork(fwd=(mem(ctx.n_tp * 8 * 2),), bwd=(mem(ctx.n_tp * 8 * 2),))
    return _logit_passes(ctx)


def _lse_a2a(ctx: BlockContext) -> OpWork:
    return OpWork(comm=Collective("tp", "all_to_all", "all_to_all", ctx.n_tp * 2 * 4))


def _qkv(ctx: BlockContext) -> OpWork:
    sh, e = ctx.shape, ctx.e
    n = ctx.n_tp if ctx.tp_attention else ctx.n_loc
    nq, nk = ctx.heads()
    if not sh.mla:
        return linear(n, sh.hidden, (nq + 2 * nk) * sh.head_dim, e)
    q = (
        [gemm(n, sh.hidden, sh.q_lora_rank, e), gemm(n, sh.q_lora_rank, nq * sh.qk_dim, e)]
        if sh.q_lora_rank
        else [gemm(n, sh.hidden, nq * sh.qk_dim, e)]
    )
    kv = [
        gemm(n, sh.hidden, sh.kv_lora_rank + sh.qk_rope_dim, e),
        gemm(n, sh.kv_lora_rank, nq * (sh.qk_nope_dim + sh.v_dim), e),
    ]
    return OpWork(fwd=tuple(q + kv), bwd=tuple(q + kv), wgrad=tuple(q + kv))


def _core(ctx: BlockContext) -> OpWork:
    sh, lay, e = ctx.shape, ctx.layout, ctx.e
    nq, nk = ctx.heads()
    c = lay.dims.cp
    heads, s = nq / c, lay.seq_len  # Ulysses: 1/c of the heads over the whole sequence
    pairs = lay.micro_batch_size * heads * causal_pairs(s, ctx.window)
    flops = 2.0 * (sh.qk_dim + sh.v_dim) * pairs
    io = lay.micro_batch_size * s * (nq * (sh.qk_dim + sh.v_dim) + nk * (sh.qk_dim + sh.v_dim)) / c * e
    return OpWork(fwd=(Kernel("attn", flops, io),), bwd=(Kernel("attn", 2.5 * flops, 2.5 * io),))


def _out(ctx: BlockContext) -> OpWork:
    nq, _ = ctx.heads()
    n = ctx.n_tp if ctx.tp_attention else ctx.n_loc
    return linear(n, nq * ctx.shape.v_dim, ctx.shape.hidden, ctx.e)


def _tp_seq(fwd: str, bwd: str):
    def work(ctx: BlockContext) -> OpWork:
        return OpWork(comm=Collective("tp", fwd, bwd, ctx.n_tp * ctx.shape.hidden * ctx.e))

    return work


def _qk_ss(ctx: BlockContext) -> OpWork:
    nq, nk = ctx.heads()
    size = ctx.n_tp * (nq + nk) * ctx.shape.head_dim * ctx.e
    return OpWork(fwd=(mem(size),), bwd=(mem(2 * size),))


def _qk_ar(ctx: BlockContext) -> OpWork:
    return OpWork(comm=Collective("tp", "all_reduce", "all_reduce", 2 * ctx.n_tp * 4))


def _a2a_in(ctx: BlockContext) -> OpWork:
    nq, nk = ctx.heads()
    width = max(ctx.shape.qk_dim, ctx.shape.v_dim)
    return OpWork(comm=Collective("cp", "all_to_all", "all_to_all", ctx.n_tp * (nq + 2 * nk) * width * ctx.e))


def _a2a_out(ctx: BlockContext) -> OpWork:
    nq, _ = ctx.heads()
    return OpWork(comm=Collective("cp", "all_to_all", "all_to_all", ctx.n_tp * nq * ctx.shape.v_dim * ctx.e))


def _mlp_width(ctx: BlockContext) -> tuple[float, float]:
    """(tokens, width on this rank) of the dense MLP."""
    if ctx.tp_mlp:
        return ctx.n_tp, ctx.shape.intermediate / ctx.layout.dims.tp
    return ctx.n_loc, ctx.shape.intermediate


def _mlp_up(ctx: BlockContext) -> OpWork:
    n, width = _mlp_width(ctx)
    return linear(n, ctx.shape.hidden, (2 if ctx.shape.gated else 1) * width, ctx.e)


def _mlp_down(ctx: BlockContext) -> OpWork:
    n, width = _mlp_width(ctx)
    act = mem((3 if ctx.shape.gated else 2) * n * width * ctx.e)  # act(gate) x up, before the projection
    return linear(n, width, ctx.shape.hidden, ctx.e, before=(act,))


def _router(ctx: BlockContext) -> OpWork:
    sh, n = ctx.shape, ctx.n_loc
    g, pick = gemm(n, sh.hidden, sh.experts, 4), mem(3 * n * sh.experts * 4 + 2 * n * sh.top_k * sh.hidden * ctx.e)
    return OpWork(fwd=(g, pick), bwd=(pick, g, g))  # (the router is not deferred: input and weight gradient)


def _moe_rows(ctx: BlockContext) -> float:
    return ctx.n_loc * ctx.shape.top_k


def _dispatch(ctx: BlockContext) -> OpWork:
    return OpWork(comm=Collective("ep", "all_to_all", "all_to_all", _moe_rows(ctx) * ctx.shape.hidden * ctx.e))


def _counts(ctx: BlockContext) -> OpWork:
    return OpWork(comm=Collective("ep", "all_to_all", "all_to_all", ctx.shape.experts * 8))


def _experts_gemm(ctx: BlockContext, k: float, n: float) -> Kernel:
    local = ctx.shape.experts / ctx.layout.dims.ep
    rows = _moe_rows(ctx)
    return Kernel("gemm", 2.0 * rows * k * n, (rows * k + local * k * n + rows * n) * ctx.e)


def _experts_up(ctx: BlockContext) -> OpWork:
    g = _experts_gemm(ctx, ctx.shape.hidden, 2 * ctx.shape.expert_intermediate)
    return OpWork(fwd=(g,), bwd=(g,), wgrad=(g,))


def _experts_act(ctx: BlockContext) -> OpWork:
    size = 3 * _moe_rows(ctx) * ctx.shape.expert_intermediate * ctx.e
    return OpWork(fwd=(mem(size),), bwd=(mem(1.5 * size),))


def _experts_down(ctx: BlockContext) -> OpWork:
    g = _experts_gemm(ctx, ctx.shape.expert_intermediate, ctx.shape.hidden)
    return OpWork(fwd=(g,), bwd=(g,), wgrad=(g,))


def _shared(ctx: BlockContext) -> OpWork:
    sh, n, e = ctx.shape, ctx.n_loc, ctx.e
    up, down = gemm(n, sh.hidden, 2 * sh.shared_intermediate, e), gemm(n, sh.shared_intermediate, sh.hidden, e)
    act = mem(3 * n * sh.shared_intermediate * e)
    gate = (gemm(n, sh.hidden, 1, e),) if sh.shared_gate else ()
    return OpWork(fwd=(up, act, down, *gate), bwd=(*gate, *gate, down, down, act, up, up))


def _moe_add(ctx: BlockContext) -> OpWork:
    size = ctx.n_loc * (ctx.shape.top_k + 2) * ctx.shape.hidden * ctx.e
    return OpWork(fwd=(mem(size),), bwd=(mem(size),))


OPS = {
    "embed": _embed,
    "embed.rs": _tp_seq("reduce_scatter", "all_gather"),
    "embed.add": _norm(3, 1),
    "head.norm": _norm(2, 3),
    "head.ag": _tp_seq("all_gather", "reduce_scatter"),
    "head.logits": _head_logits,
    "head.lse": _logit_passes,
    "head.lse_a2a": _lse_a2a,
    "head.loss": _head_loss,
    "attn.norm": _norm(2, 3),
    "attn.ag": _tp_seq("all_gather", "reduce_scatter"),
    "attn.qkv": _qkv,
    "attn.qk_ss": _qk_ss,
    "attn.qk_ar": _qk_ar,
    "attn.a2a_in": _a2a_in,
    "attn.core": _core,
    "attn.a2a_out": _a2a_out,
    "attn.out": _out,
    "attn.rs": _tp_seq("reduce_scatter", "all_gather"),
    "mlp.norm": _norm(4, 5),
    "mlp.ag": _tp_seq("all_gather", "reduce_scatter"),
    "mlp.up": _mlp_up,
    "mlp.down": _mlp_down,
    "mlp.rs": _tp_seq("reduce_scatter", "all_gather"),
    "mlp.add": _norm(3, 3),
    "moe.router": _router,
    "moe.counts": _counts,
    "moe.dispatch": _dispatch,
    "moe.shared": _shared,
    "moe.experts.up": _experts_up,
    "moe.experts.act": _experts_act,
    "moe.experts.down": _experts_down,
    "moe.combine": _dispatch,
    "moe.add": _moe_add,
}
"""Op name -> its work. An op of the outline with no entry here is refused (``op_work``)."""


def line_work(line, ctx: BlockContext) -> OpWork:
    """The work of op line ``line`` (a ``shapes.OpLine``) at ``ctx`` as the executor runs it: the
    weight gradient of an op that is not ``linear`` is part of its backward (only a linear op's is
    deferrable); a fused run's work is its members' kernels in order."""
    parts = [_as_run(op_work(m.name, ctx), m.linear) for m in line.members or (line,)]
    if len(parts) == 1:
        return parts[0]
    return OpWork(*(tuple(k for w in parts for k in getattr(w, f)) for f in ("fwd", "bwd", "wgrad")))


def _as_run(work: OpWork, linear: bool) -> OpWork:
    return work if linear or not work.wgrad else OpWork(work.fwd, (*work.bwd, *work.wgrad), (), work.comm)


def op_work(name: str, ctx: BlockContext) -> OpWork:
    """The work of op ``name`` in a block priced at ``ctx``; ValueError for an op the model lacks."""
    if name not in OPS:
        raise ValueError(
            f"op {name!r} has no cost model in dhelix predict (ring attention and custom ops are "
            f"not modelled); modelled ops: {', '.join(OPS)}"
        )
    return OPS[name](ctx)
