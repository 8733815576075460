"""What every adapter shares: TP size checks, Megatron-style sharding of HF projections, side
inputs of a micro-batch, the embedding/head blocks and gathering shards back into HF tensors.

Sharded parameters carry ``tp_partition_dim`` (the dim split over the TP group) and DeepSpeed's
``tensor_model_parallel`` flag; replicated parameters applied to a sequence shard have their
gradients summed over the TP group once per step (``mark_replicated``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_dhelix.data.inputs import shifted_targets, valid_targets
from ds_dhelix.graph.model_graph import comm, comp
from ds_dhelix.graph.objectives import ROW_KEYS, TOKEN_KEYS, loss_denominator
from ds_dhelix.runtime.comm import ContextAllToAll, ReplicatedGrads, SeqAllGather, SeqReduceScatter
from ds_dhelix.runtime.groups import ContextShards

from . import vocab as vp
from .lora import has_lora, project, shard_factors
from .ring import AttentionCore


def check_divisible(tp: int, world: int | None = None, **dims: int) -> None:
    """``ValueError`` naming every dimension that ``tp`` does not divide, with the valid TP sizes."""
    bad = {k: v for k, v in dims.items() if v % tp}
    if world is not None and world % tp:
        bad["world_size"] = world
    if bad:
        import math

        g = 0
        for v in list(dims.values()) + ([world] if world else []):
            g = math.gcd(g, v)
        valid = [d for d in range(1, g + 1) if g % d == 0]
        named = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(f"tensor_parallel.size {tp} does not divide {named}; valid TP sizes: {valid}")


def shard_param(module: nn.Module, name: str, dim: int, rank: int, tp: int, index=None) -> None:
    """Replace ``module.<name>`` by this rank's slice along ``dim`` (or by rows ``index``)."""
    p = getattr(module, name)
    if p is None or tp == 1:
        return
    from ds_dhelix.graph.shards import select

    if index is None:
        size = p.shape[dim] // tp
        data = p.data.narrow(dim, rank * size, size)
        part = select(p, dim, slice(rank * size, (rank + 1) * size))
    else:
        data = p.data.index_select(dim, index.to(p.device))
        part = select(p, dim, index)
    new = nn.Parameter(data.clone().contiguous(), requires_grad=p.requires_grad)
    new.hf_selection = part  # which part of the full HF tensor this shard is (sharded loading)
    new.tensor_model_parallel = True
    new.tp_partition_dim = dim
    if index is not None:
        new.tp_row_index = index  # rows of the full tensor this shard holds (fused layouts)
    setattr(module, name, new)
    shard_factors(module, name, dim, rank, tp, index, shard_param)  # a LoRA factor is cut with its base


def mark_replicated(params, group) -> ReplicatedGrads:
    """Replicated weights used on a sequence shard: their gradients are summed over the TP group
    once per step (the executor calls ``ReplicatedGrads.all_reduce`` after the last backward)."""
    return ReplicatedGrads(params, group)


def make_side_fn(tp: int, tp_rank: int, extra=None, cp: ContextShards | None = None):
    """Side inputs of a micro-batch: this rank's sequence shard of ids and shifted targets, and
    ``serial``, the micro-batch's number in the run (random draws are seeded by it, so they do not
    depend on the schedule, and a resumed run draws what an uninterrupted one would).

    Targets follow HF's causal-LM loss: position t predicts labels[t+1]; the last position and
    labels of -100 are ignored; the loss is the sum over valid targets / their count. The targets
    are shifted on the whole sequence before it is cut into the tp x cp shards (``cp``: a
    ``ContextShards``, None without context parallelism). With ring attention a CP rank's tokens
    are the two chunks of the zig-zag split (``ring.zigzag_index``), cut by TP; the side then
    carries ``ring_index`` (the positions of the CP rank's tokens) and, for packed documents,
    ``segments`` (each position's document number). At TP > 1: ``tp_ids`` / ``tp_targets``, the
    TP group's tokens in TP rank order (the vocabulary-parallel embedding and loss, ``vocab.py``).
    """
    shards, index = (tp, tp_rank) if cp is None else (tp * cp.size, cp.rank * tp + tp_rank)
    ring = cp is not None and cp.comm == "ring"
    multiple = shards * (2 if ring else 1)

    def make_side(batch: dict, serial: int = 0) -> dict:
        ids, labels = batch["input_ids"], batch.get("labels", batch["input_ids"])
        b, s = ids.shape
        if s % multiple:
            from ds_dhelix.config.dims import ParallelDims

            ParallelDims(shards, tp=tp, cp=shards // tp, cp_comm=cp.comm if cp else "ulysses").check_seq_len(s)
        targets = shifted_targets(labels)
        n = s // shards
        sl = slice(index * n, (index + 1) * n)
        if ring:  # this CP rank's two zig-zag chunks, then this TP rank's part of them
            from .ring import zigzag_index

            local = zigzag_index(s, cp.size, cp.rank, ids.device)
            sl = local[tp_rank * n : (tp_rank + 1) * n]
        position_ids = batch.get("position_ids")  # packed documents: positions restart per document
        side = {
            "ids": ids[:, sl],
            "targets": targets[:, sl].t().contiguous(),  # [s/tp, b], sequence-first
            "num_valid": valid_targets(labels) if batch.get("loss_denominator") is None else None,  # (a host read)
            # what the loss sum is divided by: the valid targets, or the caller's share of a step's
            # count (DhelixTrainer: the Trainer's num_items_in_batch over the data-parallel ranks)
            "loss_denominator": batch.get("loss_denominator"),
            # this micro-batch's share of the rows of the one it was cut from (the intra schedule's
            # halves, ``interpreter.half_batches``): weighs a per-micro-batch loss term (MoE balance)
            "loss_share": batch.get("loss_share", 1.0),
            "positions": _positions(position_ids, s, sl, ids.device, b, n),
            "seq_len": s,
            "batch": b,
            "serial": serial,
        }
        _objective_columns(side, batch, sl)
        if tp > 1:  # the TP group's tokens, in TP rank order (the vocab-parallel embedding and loss)
            group = local if ring else slice(sl.start - tp_rank * n, sl.start + (tp - tp_rank) * n)
            side.update(tp_ids=ids[:, group], tp_targets=targets[:, group].t().contiguous())
        _add_documents(side, position_ids, local if ring else None)
        if extra is not None:
            side.update(extra(batch, side))
        return side

    return make_side


def _objective_columns(side: dict, batch: dict, sl) -> None:
    """An objective's batch columns into the side: per row as they are ([b]), per token shifted as
    the targets are and cut to this rank's shard ([n, b]: the value of the token each position predicts)."""
    for key in ROW_KEYS:
        if key in batch:
            side[key] = batch[key]
    for key in TOKEN_KEYS:
        if key in batch:
            x = batch[key]
            shifted = torch.cat([x[:, 1:], x.new_zeros(x.shape[0], 1)], dim=1)
            side[key] = shifted[:, sl].t().contiguous()


def _positions(position_ids, s: int, sl, device, b: int, n: int):
    """The shard's positions: packed documents' own (``position_ids``), else 0 .. s-1 cut by ``sl``."""
    if position_ids is None:
        return torch.arange(s, device=device)[sl].unsqueeze(0).expand(b, n)
    return position_ids[:, sl]


def _add_documents(side: dict, position_ids, ring_index) -> None:
    """Packed documents' ``position_ids`` (checked against the batch) and, on a ring, the CP rank's
    token positions (``ring_index``) and each position's document (``segments``)."""
    b, s = side["batch"], side["seq_len"]
    if position_ids is not None:
        if tuple(position_ids.shape) != (b, s):
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} does not match input_ids {(b, s)}")
        side["position_ids"] = position_ids
    if ring_index is not None:
        side["ring_index"] = ring_index
        if position_ids is not None:
            side["segments"] = (position_ids == 0).cumsum(dim=1)


def embed_op(embed: nn.Module, pos_embed: nn.Module | None = None, drop=None, vocab=None) -> list:
    """The embedding's ops -> ``h`` [s/tp, b, h]: at TP 1 (``vocab`` None) one ``embed`` op (token
    + learned position embedding, ``drop``: the embedding dropout, a ``Dropout`` or None); with the
    vocabulary split over TP (``vocab``: a ``vocab.VocabShard``) the ops of ``vocab.embed_ops``."""
    if vocab is not None:
        return vp.embed_ops(embed, vocab, pos_embed, drop)

    def fn(side):
        h = embed(side["ids"])
        if pos_embed is not None:
            h = h + pos_embed(side["positions"])
        if drop is not None:
            h = drop(h, side, "embed")
        return (h.transpose(0, 1).contiguous(),)

    return [comp("embed", (), ("h",), fn)]


class Dropout:
    """One layer's dropout of rate ``p`` through the graph's ``Draws`` (masks seeded by micro-batch,
    layer, op and rank, so every schedule draws the same); off while ``module`` is not training."""

    def __init__(self, draws, p: float, layer: int, module: nn.Module):
        self.draws, self.p, self.layer, self.module = draws, p, layer, module

    @classmethod
    def make(cls, draws, p: float, layer: int, module: nn.Module):
        """A ``Dropout``, or None when ``p`` is 0 (the graph then runs no dropout code at all)."""
        return cls(draws, p, layer, module) if p else None

    def __call__(self, x, side: dict, op: str):
        return self.draws.dropout(x, self.p, side, self.layer, op, self.module.training)

    def rng(self, device, side: dict, op: str):
        """The seeded stream of a kernel's own draws (sdpa's ``dropout_p``), while training."""
        return self.draws.rng(device, side, self.layer, op) if self.module.training else contextlib.nullcontext()


class CrossEntropy:
    """``head.loss``'s last step: a summed cross-entropy -> this rank's share of the micro-batch
    loss (over ``loss_denominator``). ``keys``: extra inputs of ``head.loss`` passed on to ``add``
    (``add(side, ce, *pieces)``: e.g. MoE load-balancing terms)."""

    def __init__(self, keys: tuple[str, ...] = (), add=None):
        self.keys, self.add = keys, add

    def __call__(self, side, ce_sum, *pieces):
        return self.combine(side, ce_sum / loss_denominator(side), *pieces)

    def combine(self, side, main, *pieces):
        """``main`` (this rank's share of the micro-batch's cross-entropy, or of another objective's
        loss) with the family's extra terms."""
        return main if self.add is None else self.add(side, main, *pieces)


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each token's log-probability of its target ([n, b] from logits [n, b, V] in fp32), 0 where
    the target is -100."""
    valid = targets != -100
    z = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return z.masked_fill(~valid, 0)


def head_ops(
    norm: nn.Module,
    lm_head: nn.Module,
    softcap: float | None = None,
    vocab=None,
    loss=None,
    chunk: int = 0,
    objective=None,
) -> list:
    """``head.norm``, ``head.logits``, ``head.loss``: this rank's share of the micro-batch loss;
    ``softcap``: the logits' tanh softcapping (``c * tanh(logits / c)``, before the loss); ``loss``:
    a ``CrossEntropy`` (default: the plain one). ``vocab`` (a ``vocab.VocabShard``): the
    vocabulary split over TP, the ops of ``vocab.head_ops`` (no rank holds the full logits);
    ``chunk`` > 0: the logits made and differentiated ``chunk`` tokens at a time (``dhelix.head_chunk``);
    ``objective``: another loss than cross-entropy (``ds_dhelix.graph.objectives``: called with each
    token's log-probability of its target, it gives this rank's share of the micro-batch's loss)."""
    loss = loss or CrossEntropy()
    if vocab is not None or chunk:
        vocab = vocab or vp.VocabShard(lm_head.weight.shape[0], 1, 0)
        return vp.head_ops(norm, lm_head, vocab, softcap, loss, chunk, objective)

    def loss_fn(side, logits, *pieces):
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if objective is not None:
            return (loss.combine(side, objective(side, token_logps(logits.float(), side["targets"])), *pieces),)
        ce = F.cross_entropy(
            logits.float().flatten(0, 1), side["targets"].flatten(), ignore_index=-100, reduction="sum"
        )
        return (loss(side, ce, *pieces),)

    return [
        comp("head.norm", ("h",), ("y",), lambda side, h: (norm(h),)),
        comp("head.logits", ("y",), ("logits",), lambda side, y: (project(lm_head, y),), linear=True),
        comp("head.loss", ("logits", *loss.keys), ("loss",), loss_fn),
    ]


def gather_param(p: torch.Tensor, group, tp: int, data: torch.Tensor | None = None) -> torch.Tensor:
    """The full HF tensor of a (possibly sharded) parameter: all-gather along its partition dim.
    ``data``: gather this tensor of ``p``'s shape (e.g. its gradient) instead of ``p`` itself."""
    data = p.data if data is None else data
    slot = getattr(p, "tp_replica_slot", None)
    if tp > 1 and slot is not None:  # a replicated kv head: every head once, from its group's first rank
        parts = [torch.empty_like(data) for _ in range(tp)]
        dist.all_gather(parts, data.contiguous(), group=group)
        rep = tp // slot[1]
        return torch.cat([parts[j * rep] for j in range(slot[1])], dim=p.tp_partition_dim)
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return data.detach().clone()
    dim = p.tp_partition_dim
    parts = [torch.empty_like(data) for _ in range(tp)]
    dist.all_gather(parts, data.contiguous(), group=group)
    full = torch.cat(parts, dim=dim)
    index = getattr(p, "tp_row_index", None)
    if index is not None:  # rows were picked by index: put every rank's rows back in place
        idx = [torch.empty_like(index) for _ in range(tp)]
        dist.all_gather(idx, index, group=group)
        out = torch.empty_like(full)
        out.index_copy_(dim, torch.cat(idx), full)
        full = out
    return vp.trim_padding(p, full)


# ---------------------------------------------------------------------------------- dense layers
class _Lean(torch.autograd.Function):
    """``fn(*xs)`` saving only ``xs``; its backward runs ``fn`` again under autograd."""

    @staticmethod
    def forward(ctx, fn, *xs):
        ctx.fn = fn
        ctx.save_for_backward(*xs)
        return fn(*xs)

    @staticmethod
    def backward(ctx, grad):
        xs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*xs)
        need = [x for x in xs if x.requires_grad]
        got = iter(torch.autograd.grad(out, need, grad))
        return (None, *(next(got) if x.requires_grad else None for x in xs))


def _act_backward(act):
    """``(forward, backward(grad, x))`` of an activation module whose derivative has its own kernel
    (SiLU, GELU exact or tanh), else None."""
    import functools

    import torch.nn.functional as F
    from transformers import activations as A

    if isinstance(act, (A.SiLUActivation, torch.nn.SiLU)):
        return F.silu, torch.ops.aten.silu_backward
    inner = (
        getattr(act, "act", None) if type(act).__name__ in ("GELUActivation", "GELUTanh", "PytorchGELUTanh") else act
    )
    approximate = None
    if isinstance(inner, torch.nn.GELU):
        approximate = inner.approximate
    elif inner is F.gelu:
        approximate = "none"
    elif isinstance(inner, functools.partial) and inner.func is F.gelu and not inner.args:
        approximate = inner.keywords.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        return None
    return (
        lambda x: F.gelu(x, approximate=approximate),
        lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate=approximate),
    )


class _LeanGlu(torch.autograd.Function):
    """``act(gate) * up`` saving only its inputs; the backward recomputes ``act(gate)`` and applies
    the activation's derivative kernel: the kernels autograd's own backward runs, so the gradients
    are bitwise plain autograd's, without a nested autograd pass."""

    @staticmethod
    def forward(ctx, gate, up, fns):
        ctx.save_for_backward(gate, up)
        ctx.fns = fns
        return fns[0](gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        forward, backward = ctx.fns
        d_up = grad * forward(gate) if ctx.needs_input_grad[1] else None
        d_gate = backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return d_gate, d_up, None


class _LeanAct(torch.autograd.Function):
    """``act(x)`` by its kernel, its backward by the derivative's kernel (as ``_LeanGlu``)."""

    @staticmethod
    def forward(ctx, x, fns):
        ctx.save_for_backward(x)
        ctx.fns = fns
        return fns[0](x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return ctx.fns[1](grad, x), None


def lean_act(act, x: torch.Tensor) -> torch.Tensor:
    """``act(x)`` keeping only ``x`` for backward: by the derivative's kernel where ``act`` has one
    (``_act_backward``), else recomputed under a nested autograd pass (``lean``)."""
    fns = _act_backward(act)
    if fns is None or not torch.is_grad_enabled() or not x.requires_grad:
        return lean(act, x)
    return _LeanAct.apply(x, fns)


def lean_glu(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` keeping only ``gate`` and ``up`` for backward (``lean``), with an explicit
    backward where ``act`` has a derivative kernel (``_LeanGlu``; no nested autograd pass)."""
    fns = _act_backward(act)
    if fns is None or not torch.is_grad_enabled() or not (gate.requires_grad or up.requires_grad):
        return lean(lambda g, u: act(g) * u, gate, up)
    return _LeanGlu.apply(gate, up, fns)


def lean(fn, *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)`` (an elementwise activation, ``act(gate) * up``) keeping only its inputs for
    backward, which runs ``fn`` again: a composite activation such as GPT-2's ``gelu_new`` would
    otherwise save every intermediate (four tensors of the MLP's width). The same kernels run
    again on the same inputs, so the gradients are bitwise those of plain autograd."""
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in xs):
        return fn(*xs)
    return _Lean.apply(fn, *xs)


def dense_layer_ops(tp: int, tp_group, *, attn_norm, residual, mlp_up, mlp_down, qkv=None, attn_core=None,
                    attn_out=None, mixer=None, mlp_hidden=("act",), cp: ContextShards | None = None,
                    heads: tuple[int, int] | None = None):  # fmt: skip
    """The op list of a dense decoder layer, COMM ops included when ``tp > 1``.

    The token mixer between ``attn.ag`` and ``attn.rs`` is attention from ``qkv``, ``attn_core``
    and ``attn_out``, or ``mixer(xin) -> ops`` (another op set reading ``xin`` and writing ``ao``:
    output-gated attention, Gated DeltaNet). Each argument except ``attn_core`` (an Op),
    ``residual`` and ``mixer`` is a COMP body ``fn(side, *inputs)``:
    ``attn_norm(h) -> x``, ``qkv(xf) -> q, k, v``, ``attn_out(o) -> ao`` (row-parallel partial
    sums, no bias), ``mlp_up(x2f) -> *hidden`` (the projections only, named ``mlp_hidden``),
    ``mlp_down(*hidden) -> mo`` (activation, then the row-parallel projection: the activation sits
    in ``mlp.down`` so that both MLP ops are linear on the way to their weights and reactive SI
    can defer both weight gradients; the projections and ``attn.qkv`` / ``attn.out`` are marked
    ``linear``). ``residual(ar, mr)`` returns the
    ``mlp.norm`` and ``mlp.add`` ops, which read the attention and MLP outputs under the keys given
    (the reduce-scattered ones when sharded) and add the row-parallel biases. ``cp`` / ``heads``:
    context parallelism (``context_attention``; ``heads``: this TP rank's query and kv heads).
    """
    sharded = tp > 1
    xin, x2in = ("xf", "x2f") if sharded else ("x", "x2")
    ar, mr = ("ar", "mr") if sharded else ("ao", "mo")
    gather, scatter = SeqAllGather(tp_group, tp), SeqReduceScatter(tp_group, tp)

    def when_sharded(op):
        return [op] if sharded else []

    def attention(xin):
        qkv_op = comp("attn.qkv", (xin,), ("q", "k", "v"), qkv, linear=True)
        return context_attention(cp, heads, qkv_op, attn_core, comp("attn.out", ("o",), ("ao",), attn_out, linear=True))

    mlp_norm, mlp_add = residual(ar, mr)
    return [
        comp("attn.norm", ("h",), ("x",), attn_norm),
        *when_sharded(comm("attn.ag", gather, "x", "xf")),
        *(mixer or attention)(xin),
        *when_sharded(comm("attn.rs", scatter, "ao", "ar")),
        mlp_norm,
        *when_sharded(comm("mlp.ag", gather, "x2", "x2f")),
        comp("mlp.up", (x2in,), mlp_hidden, mlp_up, linear=True),
        comp("mlp.down", mlp_hidden, ("mo",), mlp_down, linear=True, selective=True),
        *when_sharded(comm("mlp.rs", scatter, "mo", "mr")),
        mlp_add,
    ]


def context_attention(cp: ContextShards | None, heads, qkv, core, out, widths: tuple[int, int] | None = None) -> list:
    """The attention ops ``qkv -> core -> out`` as they are, or with context parallelism (Ulysses)::

        attn.qkv      COMP  xf[s/c] -> qkvs        projections; q, k, v heads cut into cp groups
        attn.a2a_in   COMM  qkvs -> qkvf           all-to-all: head group j to CP rank j
        attn.core     COMP  qkvf -> oc             whole sequence, 1/cp of the heads; output cut by sequence
        attn.a2a_out  COMM  oc -> of               all-to-all: sequence chunk j back to CP rank j
        attn.out      COMP  of -> ao[s/c]          all heads of this TP rank again, projection

    ``heads``: (query heads, kv heads) of this TP rank. With fewer kv heads than CP ranks each
    group carries the one kv head its query heads use (``kv_heads_of_groups``); the copies'
    gradients add up in ``attn.qkv``'s backward. Packing and unpacking are views, slices and
    concatenations, so ``attn.qkv`` and ``attn.out`` stay linear on the way to their weights.
    ``cp.comm == "ring"``: ring attention instead (``ring.ring_attention``). ``widths``: (q/k head
    width, v head width) when they differ (MLA): the narrower is zero-padded for the all-to-all and
    cut back before ``core``."""
    if cp is None or cp.size == 1:
        return [qkv, core, out]
    if cp.comm == "ring":
        from .ring import ring_attention

        return ring_attention(cp, qkv, core, out)
    c, (nq, nk) = cp.size, heads
    kv = kv_heads_of_groups(nq, nk, c)
    nkc = kv[0].stop - kv[0].start
    split = (nq // c, nkc, nkc)
    dqk, dv = widths or (None, None)
    wide = max(dqk, dv) if widths else None

    def pad(t):
        return t if wide is None or t.shape[-1] == wide else F.pad(t, (0, wide - t.shape[-1]))

    def pack(side, xf):  # [b, n, s/c, d] each -> [c, b, H/c, s/c, d], chunk j: head group j's q, k, v
        q, k, v = (pad(t) for t in qkv.fn(side, xf))
        qs = q.reshape(q.shape[0], c, nq // c, *q.shape[2:]).transpose(0, 1)
        groups = [torch.cat([qs[j], k[:, kv[j]], v[:, kv[j]]], dim=1) for j in range(c)]
        return (torch.stack(groups),)

    def attend(side, qkvf):  # [c (sequence chunk), b, H/c, s/c, d] -> the whole sequence's heads
        full = qkvf.permute(1, 2, 0, 3, 4).flatten(2, 3)  # [b, H/c, s, d]
        q, k, v = full.split(split, dim=1)
        if wide is not None:
            q, k, v = q[..., :dqk], k[..., :dqk], v[..., :dv]
        (o,) = core.fn(side, q, k, v)  # [s, b, nq/c * d]
        return (o.unflatten(0, (c, o.shape[0] // c)),)  # [c (sequence chunk), s/c, b, nq/c * d]

    def merge_heads(side, of):  # [c (head group), s/c, b, nq/c * d] -> [s/c, b, nq * d]
        return out.fn(side, of.permute(1, 2, 0, 3).flatten(2))

    a2a = ContextAllToAll(cp.groups, c)
    return [
        comp("attn.qkv", qkv.inputs, ("qkvs",), pack, linear=qkv.linear),
        comm("attn.a2a_in", a2a, "qkvs", "qkvf"),
        comp("attn.core", ("qkvf",), ("oc",), attend, selective=core.selective),
        comm("attn.a2a_out", a2a, "oc", "of"),
        comp("attn.out", ("of",), out.outputs, merge_heads, linear=out.linear),
    ]


def kv_heads_of_groups(nq: int, nk: int, cp: int) -> list[slice]:
    """The kv heads (a slice) each of ``cp`` query-head groups attends with: ``nk/cp`` of their own,
    or, with fewer kv heads than groups (``cp`` a multiple of ``nk``), the one their queries share."""
    if nk % cp == 0:
        return [slice(j * nk // cp, (j + 1) * nk // cp) for j in range(cp)]
    per = cp // nk  # groups per kv head
    return [slice(j // per, j // per + 1) for j in range(cp)]


class HeadGroupView:
    """An attention module as a group of its heads sees it: ``num_key_value_groups`` queries per kv
    head (HF's attention functions read it), everything else the module's own."""

    def __init__(self, module: nn.Module, kv_groups: int):
        self._module, self.num_key_value_groups = module, kv_groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def cp_heads(config, tp: int) -> tuple[int, int]:
    """(query heads, kv heads) of one TP rank (one kv head when TP replicates them: TP > kv heads)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads // tp, max(kv // tp, 1)


def shard_kv_replica(module: nn.Module, name: str, head_dim: int, num_kv: int, rank: int, tp: int) -> None:
    """KV-head replication (TP a multiple of the ``num_kv`` kv heads, as Megatron-LM does): replace
    ``module.<name>`` (k_proj / v_proj weight or bias) by the rows of kv head ``rank // (tp / num_kv)``,
    which the ``tp / num_kv`` ranks of its replica group each hold. ``tp_replica_slot`` = (head, heads)
    tells ``ReplicatedGrads`` to sum the copies' gradients over those ranks (each saw its own query
    heads) and the export to write one copy. DeepSpeed counts a parameter in the global gradient norm on
    every rank when it is ``tensor_model_parallel``, else on TP rank 0 only: the flag is set on the
    first rank of each replica group, so every kv head counts once."""
    p = getattr(module, name)
    if p is None:
        return
    rep = tp // num_kv
    head = rank // rep
    shard_param(module, name, 0, rank, tp, index=torch.arange(head * head_dim, (head + 1) * head_dim))
    for new in [getattr(module, name)] + ([module.lora_B] if name == "weight" and has_lora(module) else []):
        new.tp_replica_slot = (head, num_kv)
        new.tensor_model_parallel = rank % rep == 0


def plus(x, bias):
    """``x + bias`` (a row-parallel bias, added once after the reduce-scatter), or ``x``."""
    return x if bias is None else x + bias


def dropped(x, drop, side, op: str):
    """``drop(x)`` when the layer has residual dropout, else ``x``."""
    return x if drop is None else drop(x, side, op)


def sequential_residual(norm: nn.Module, attn_bias, mlp_bias, drop=None):
    """``residual`` for ``h2 = h + drop(attn); h = h2 + drop(mlp)`` (pre-norm, the common case)."""
    return residual_ops(attn_bias, mlp_bias, before_mlp=norm, drop=drop)


def residual_ops(attn_bias, mlp_bias, after_attn=None, before_mlp=None, after_mlp=None, drop=None):
    """``residual`` of ``dense_layer_ops`` for any norm placement::

        h2 = h + drop(after_attn(attn + attn_bias))     x2 = before_mlp(h2)     h = h2 + drop(after_mlp(mlp + mlp_bias))

    A norm given as None is left out (pre-norm: ``before_mlp`` only). ``attn_bias`` / ``mlp_bias``:
    the row-parallel biases (or None), added after the reduce-scatter; ``drop``: the layer's
    residual dropout (a ``Dropout``) or None."""

    def branch(x, bias, norm, side, op):
        x = plus(x, bias)
        return dropped(x if norm is None else norm(x), drop, side, op)

    def mlp_norm(side, h, a):
        h2 = h + branch(a, attn_bias, after_attn, side, "attn.resid")
        return h2, (h2 if before_mlp is None else before_mlp(h2))

    def mlp_add(side, h2, m):
        return (h2 + branch(m, mlp_bias, after_mlp, side, "mlp.resid"),)

    def make(ar: str, mr: str):
        return (comp("mlp.norm", ("h", ar), ("h2", "x2"), mlp_norm), comp("mlp.add", ("h2", mr), ("h",), mlp_add))

    return make


def qkv_projections(attn_module):
    """``attn.qkv`` for separate q/k/v projections: xf [s, b, h] -> q, k, v [b, heads/t, s, d]
    (projections and views only, so the op stays linear on the way to its weights)."""
    hd = attn_module.head_dim
    projs = (attn_module.q_proj, attn_module.k_proj, attn_module.v_proj)

    def fn(side, xf):
        s, b, _ = xf.shape
        return tuple(project(proj, xf).view(s, b, -1, hd).permute(1, 2, 0, 3) for proj in projs)

    return fn


def rotary(apply_rotary_pos_emb, key: str | None = None, qk_norm=None):
    """``attn_core_op``'s ``rotary`` from an HF family's ``apply_rotary_pos_emb`` and the side
    inputs' cos/sin (``side["rope"][key]`` for a family whose layer kinds have their own RoPE,
    ``key`` the layer's kind); ``qk_norm``: ``(q_norm, k_norm)`` applied first (HF's order);
    ``apply_rotary_pos_emb`` None: no rotary (a NoPE layer). Rotary runs in ``attn.core``, not
    ``attn.qkv``: the projection op stays linear, so SI can defer its weight gradient (see
    ``Executor``). None when there is nothing to do."""
    if apply_rotary_pos_emb is None and qk_norm is None:
        return None

    def fn(q, k, side):
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        if apply_rotary_pos_emb is None:
            return q, k
        cos, sin = (side["cos"], side["sin"]) if key is None else side["rope"][key]
        return apply_rotary_pos_emb(q, k, cos, sin)

    return fn


def rope_kinds(rotary_emb: nn.Module, config) -> tuple[str, ...]:
    """The layer kinds with a RoPE of their own when the family's rotary embedding takes the kind
    (Gemma 3, OLMo 3: ``config.layer_types``); () for one RoPE for every layer."""
    import inspect

    if "layer_type" not in inspect.signature(rotary_emb.forward).parameters:
        return ()
    return tuple(sorted(set(config.layer_types)))


def rotary_key(rotary_emb: nn.Module, config, index: int) -> str | None:
    """The RoPE kind of layer ``index`` (see ``rope_kinds``), None when every layer has the same."""
    return config.layer_types[index] if rope_kinds(rotary_emb, config) else None


def layer_window(attn_module, config) -> int | None:
    """The sliding window of one attention layer: the module's own ``sliding_window`` (families
    with per-layer kinds: None for a full layer), else the config's (Mistral, Phi-3), else None."""
    if hasattr(attn_module, "sliding_window"):
        return attn_module.sliding_window
    return getattr(config, "sliding_window", None)


def layer_windows(model) -> tuple[int, ...]:
    """The distinct sliding windows of a model's attention layers (linear-attention layers have none)."""
    return tuple(
        sorted(
            {
                w
                for layer in model.model.layers
                if hasattr(layer, "self_attn") and (w := layer_window(layer.self_attn, model.config)) is not None
            }
        )
    )


def attn_core_op(attn_module, config, eager_fn, rotary=None, drop=None, window: int | None = None):
    """``attn.core``: HF's attention function on [b, heads/t, s, d] -> o [s, b, heads/t * d];
    ``rotary(q, k, side) -> (q, k)`` first when given; ``drop`` (a ``Dropout``): the attention
    probabilities' dropout, drawn by the attention kernel on the op's seeded stream; ``window``:
    the layer's sliding window (each query sees the ``window`` keys up to itself: the side's
    ``window_masks``, and flash attention's own ``sliding_window``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = config._attn_implementation or "sdpa"
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_fn)

    def fn(side, q, k, v):
        if rotary is not None:
            q, k = rotary(q, k, side)
        mask = side.get("causal_mask")  # eager's causal mask, or packed documents' block mask
        if window is not None:
            mask = side.get("window_masks", {}).get(window, mask)  # none: the sequence fits the window
        p = drop.p if drop is not None and attn_module.training else 0.0
        module = attn_module
        if k.shape[1] * getattr(attn_module, "num_key_value_groups", 1) != q.shape[1]:
            module = HeadGroupView(attn_module, q.shape[1] // k.shape[1])  # a CP group sharing one kv head
        with drop.rng(q.device, side, "attn.core") if p else contextlib.nullcontext():
            o, _ = attend(module, q, k, v, mask, dropout=p, scaling=attn_module.scaling, **extra)
        return (o.transpose(0, 1).flatten(2),)  # [b, s, n, d] -> [s, b, n*d]

    extra = {"sliding_window": window} if window is not None and impl == "flash_attention_2" else {}
    return comp("attn.core", ("q", "k", "v"), ("o",), AttentionCore(fn, attn_module, rotary, drop), selective=True)


def causal_mask_side(
    config, dtype, seq_len: int, device=None, position_ids=None, side=None, windows: tuple[int, ...] = ()
) -> dict:
    """The attention mask a micro-batch needs, as ``{"causal_mask": ...}`` (and ``"window_masks"``: for each of
    ``windows`` shorter than the sequence, the causal mask cut to that window, as boolean or additive as
    the causal one; flash attention takes the window itself): with ``position_ids``
    (packed documents: a document starts where its position is 0) a block-diagonal causal mask,
    boolean for sdpa and additive for eager, [b, 1, s, s]; else the additive causal mask eager
    attention needs [1, 1, s, s] (sdpa runs ``is_causal`` instead: nothing). ``side`` of a ring
    attention micro-batch: nothing (each ring step masks its own block)."""
    from ds_dhelix.data import attention_mask

    if side is not None and "ring_index" in side:
        return {}
    impl = config._attn_implementation or "sdpa"
    if position_ids is not None and impl == "flash_attention_2":
        raise ValueError("packed documents (position_ids) with flash_attention_2 are not supported; use sdpa or eager")
    additive = dtype if impl == "eager" else None
    out = {}
    if impl != "flash_attention_2":
        windows = [w for w in windows if w < seq_len]
        if windows:
            out["window_masks"] = {
                w: attention_mask(seq_len, position_ids, additive, device, window=w) for w in windows
            }
    if position_ids is not None or impl == "eager":  # sdpa without documents: is_causal, nothing to build
        out["causal_mask"] = attention_mask(seq_len, position_ids, additive, device)
    return out


def hf_mask_windows(config):
    """The sliding windows of the plain HF model of ``config``, as ``data.hf_model_inputs`` takes
    them: ``{layer kind: window or None}`` for families whose layers have kinds (they take a dict
    of masks: Qwen2/3, Gemma 3, SmolLM3, OLMo 3), one window for a window on every layer (Mistral,
    Phi-3), None for none."""
    window = config_window(config)
    if window is None:
        return None
    if getattr(config, "layer_types", None) is not None:
        return {"full_attention": None, "sliding_attention": window}
    return window


def config_window(config) -> int | None:
    """The sliding window some layer of ``config`` uses (every layer when the config has no layer
    kinds: Mistral, Phi-3), None when no layer slides."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    return window if kinds is None or "sliding_attention" in kinds else None


def side_positions(side: dict, device) -> torch.Tensor:
    """Positions over the full sequence, [b or 1, s]: the batch's ``position_ids`` when it has them."""
    pos = side.get("position_ids")
    return pos if pos is not None else torch.arange(side["seq_len"], device=device).unsqueeze(0)


def rotary_side_fn(rotary_emb: nn.Module, embed: nn.Module, config, windows: tuple[int, ...] = ()):
    """``extra`` for ``make_side_fn``: rotary cos/sin over the full sequence (``rope``: per layer
    kind, for a rotary embedding that takes one) (+ the eager mask, the sliding windows' masks), in
    the dtype and on the device of ``embed.weight`` as it is when the micro-batch is made (read
    then: a pipeline stage without the embedding holds an empty stand-in of it)."""
    kinds = rope_kinds(rotary_emb, config)
    shared: dict = {}  # masks without packed documents depend on the shape only: made once per shape

    def masks_of(side, dummy):
        documents = side.get("position_ids")
        key = (side["seq_len"], dummy.dtype, dummy.device, "ring_index" in side)
        if documents is None and key in shared:
            return shared[key]
        masks = causal_mask_side(config, dummy.dtype, side["seq_len"], dummy.device, documents, side, windows)
        if documents is None:
            shared[key] = masks
        return masks

    def extra(batch, side):
        dummy = embed.weight[:1].detach()
        pos = side_positions(side, dummy.device)
        masks = masks_of(side, dummy)
        if kinds:
            return {"rope": {kind: rotary_emb(dummy, pos, kind) for kind in kinds}, **masks}
        cos, sin = rotary_emb(dummy, pos)
        return {"cos": cos, "sin": sin, **masks}

    return extra


def check_dropout(config, keys, family: str) -> dict[str, float]:
    """The config's dropout rates ``keys`` (0 where unset); ``ValueError`` for a rate outside [0, 1)."""
    rates = {k: float(getattr(config, k, 0.0) or 0.0) for k in keys}
    bad = {k: v for k, v in rates.items() if not 0.0 <= v < 1.0}
    if bad:
        raise ValueError(f"{family} dropout {bad}: rates must lie in [0, 1)")
    return rates
