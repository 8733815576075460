"""The vocabulary split over the TP group (Megatron's vocab-parallel layout): each TP rank holds
``ceil(V / t)`` rows of the embedding and of the LM head (one tensor when tied), the last rank's
tail padded with zero rows that no token id reaches and whose logits are masked out, so the padding
never reaches a probability, a gradient or a checkpoint (sharded loading reads the real rows, the
export gathers and trims).

Ops at TP ``t`` > 1 (``n`` = this rank's sequence shard, ``t n`` = the TP group's tokens)::

    embed         COMP  ()      -> he[t n]   rows of this rank's vocabulary; other ids give zeros
    embed.rs      COMM  he      -> h[n]      reduce-scatter (sequence): every id's row from its owner
    embed.add     COMP  h0      -> h         learned positions, embedding dropout (when the model has them)
    head.norm     COMP  h[n]    -> y
    head.ag       COMM  y       -> yf[t n]   all-gather (sequence)
    head.logits   COMP  yf      -> logits    [t n, b, V/t]: this rank's vocabulary columns
    head.lse      COMP  logits  -> st        per token: log-sum-exp over the rank's columns and the
                                             target's logit where the rank holds it (0 elsewhere)
    head.lse_a2a  COMM  st      -> stf       all-to-all: each rank gets every rank's statistics of
                                             its own n tokens
    head.loss     COMP  stf     -> loss      log-sum-exp of the parts - the target's logit, summed
                                             over this rank's valid targets

No rank ever holds more than ``t n x V/t`` logits; the all-to-all carries 2 floats per token and
rank. The backward of the all-to-all is the all-to-all of the gradient, so each rank's logits get
``softmax - onehot`` over its own columns for every token of the group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ds_dhelix.graph.model_graph import comm, comp
from ds_dhelix.graph.shards import select
from ds_dhelix.runtime.comm import ContextAllToAll, SeqAllGather, SeqReduceScatter

from .lora import project


@dataclass(frozen=True)
class VocabShard:
    """This TP rank's rows ``[start, start + rows)`` of a ``vocab``-row vocabulary; ``group``: the TP
    group (or a strand pair) the embedding and head collectives run on."""

    vocab: int
    tp: int
    rank: int
    group: object = field(default=None, compare=False, repr=False)

    @property
    def rows(self) -> int:
        return -(-self.vocab // self.tp)

    @property
    def start(self) -> int:
        return self.rank * self.rows

    @property
    def real(self) -> int:
        """Rows that are tokens (the rest of ``rows`` is padding)."""
        return max(0, min(self.rows, self.vocab - self.start))

    def local(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``ids`` as row numbers of this shard, 0 where another rank holds them; which it holds)."""
        rel = ids - self.start
        inside = (rel >= 0) & (rel < self.real)
        return rel.masked_fill(~inside, 0), inside


def check_vocab(vocab: int, tp: int) -> None:
    """``ValueError`` when ``tp`` ranks cannot each hold a real row of a ``vocab``-row vocabulary."""
    if VocabShard(vocab, tp, tp - 1).real == 0:
        fits = max(t for t in range(1, tp) if VocabShard(vocab, t, t - 1).real > 0)
        raise ValueError(
            f"vocab_size {vocab} split over tensor_parallel.size {tp}: rank {tp - 1} would hold padding only; "
            f"the largest TP size below it that gives every rank a token is {fits} (or use a larger vocabulary)"
        )


def shard_vocab(embed: nn.Module, lm_head: nn.Module | None, tp: int, tp_rank: int, group) -> VocabShard | None:
    """Cut ``embed.weight`` and ``lm_head.weight`` (one parameter when tied) to this TP rank's rows,
    in place; None at TP 1 (the whole vocabulary on the rank)."""
    if tp == 1:
        return None
    vocab = embed.weight.shape[0]
    check_vocab(vocab, tp)
    shard = VocabShard(vocab, tp, tp_rank, group)
    tied = lm_head is not None and lm_head.weight is embed.weight
    _cut_rows(embed, "weight", shard)
    pad = getattr(embed, "padding_idx", None)
    if pad is not None:  # the padding row's gradient stays zero on the rank that holds it
        rel = pad - shard.start
        embed.padding_idx = rel if 0 <= rel < shard.real else None
    if lm_head is None:
        return shard
    if tied:
        lm_head.weight = embed.weight
        return shard
    if lm_head.weight.shape[0] != vocab:
        raise ValueError(f"lm_head has {lm_head.weight.shape[0]} rows, the embedding {vocab}: cannot split both")
    _cut_rows(lm_head, "weight", shard)
    if getattr(lm_head, "bias", None) is not None:
        _cut_rows(lm_head, "bias", shard)
    return shard


def _cut_rows(module: nn.Module, name: str, shard: VocabShard) -> None:
    p = getattr(module, name)
    rows = (shard.rows, *p.shape[1:])
    stop = shard.start + shard.real
    if p.is_meta:
        data = torch.empty(rows, dtype=p.dtype, device="meta")
    else:
        data = p.data.new_zeros(rows)
        data[: shard.real] = p.data[shard.start : stop]
    new = nn.Parameter(data, requires_grad=p.requires_grad)
    new.hf_selection = select(p, 0, slice(shard.start, stop))
    new.tensor_model_parallel = True
    new.tp_partition_dim = 0
    new.vocab_shard = shard  # the export trims the padding, sharded loading pads the read rows
    setattr(module, name, new)


def trim_padding(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (the TP shards of ``p`` gathered) without the vocabulary padding."""
    shard = getattr(p, "vocab_shard", None)
    return full if shard is None else full.narrow(0, 0, shard.vocab)


def real_shape(p: torch.Tensor) -> list[int]:
    """``p``'s shape without the vocabulary padding rows."""
    shard, shape = getattr(p, "vocab_shard", None), getattr(p, "ds_shape", p.shape)  # (ZeRO-3: partitioned)
    return list(shape) if shard is None else [shard.real, *shape[1:]]


def pad_rows(p: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` (the real rows of ``p`` read from a checkpoint) with ``p``'s padding rows appended."""
    rows = getattr(p, "ds_shape", p.shape)[0]  # (ZeRO-3: a partitioned parameter's own shape)
    extra = rows - data.shape[0] if getattr(p, "vocab_shard", None) is not None else 0
    if extra <= 0:
        return data
    return torch.cat([data, data.new_zeros((extra, *data.shape[1:]))])


def refuse_outside(ids: torch.Tensor, vocab: int, ignore: int | None = None) -> None:
    """Fail when a token id is outside ``[0, vocab)`` (``ignore``: a label that means "no target"),
    as the unsplit embedding would: split over TP every rank would give it a zero row and train on
    silently. Asserted on the device, without a host sync (on CUDA a device-side assert)."""
    ok = (ids >= 0) & (ids < vocab)
    if ignore is not None:
        ok |= ids == ignore
    torch._assert_async(
        ok.all(),
        f"a token id of this micro-batch is outside the model's vocabulary of {vocab} ids (0..{vocab - 1}): "
        f"the data was tokenised for another model or tokenizer",
    )


def embed_ops(embed: nn.Module, shard: VocabShard, pos_embed: nn.Module | None = None, drop=None) -> list:
    """The embedding's ops at TP > 1 (see the module docstring)."""
    grp, tp = shard.group, shard.tp

    def lookup(side):
        refuse_outside(side["tp_ids"], shard.vocab)
        rows, inside = shard.local(side["tp_ids"])  # [b, t n]
        he = embed(rows).masked_fill(~inside.unsqueeze(-1), 0)
        return (he.transpose(0, 1).contiguous(),)

    ops = [comp("embed", (), ("he",), lookup)]
    if pos_embed is None and drop is None:
        return ops + [comm("embed.rs", SeqReduceScatter(grp, tp), "he", "h")]

    def add(side, h0):
        h = h0.transpose(0, 1)
        if pos_embed is not None:
            h = h + pos_embed(side["positions"])
        if drop is not None:
            h = drop(h, side, "embed")
        return (h.transpose(0, 1).contiguous(),)

    return ops + [comm("embed.rs", SeqReduceScatter(grp, tp), "he", "h0"), comp("embed.add", ("h0",), ("h",), add)]


def head_ops(
    norm: nn.Module, lm_head: nn.Module, shard: VocabShard, softcap: float | None, loss, chunk: int = 0, objective=None
) -> list:
    """The head's ops at TP > 1 (see the module docstring), or at TP 1 with ``chunk``;
    ``loss(side, ce_sum, *pieces)`` turns the summed cross-entropy of this rank's tokens into its
    ``loss`` (``loss.keys``: the extra inputs, e.g. MoE load-balancing pieces). ``chunk`` > 0:
    ``head.logits`` computes the statistics itself, ``chunk`` tokens at a time, and recomputes
    each chunk's logits in its backward (``ChunkedStats``): no more than ``chunk x V/t`` logits
    ever exist, for one more head GEMM and a weight gradient that is not deferred. ``objective``:
    another loss than cross-entropy, given each token's ``target - lse`` (``common.head_ops``)."""
    grp, tp = shard.group, shard.tp

    def targets(side):
        t = side["tp_targets"] if tp > 1 else side["targets"]
        refuse_outside(t, shard.vocab, ignore=-100)
        return t

    def stats(side, logits):
        z = logits.float()
        if softcap:
            z = torch.tanh(z / softcap) * softcap
        if shard.real < shard.rows:  # padding columns: no probability
            z = z.narrow(-1, 0, shard.real)
        rows, inside = shard.local(targets(side))  # [t n, b]
        target = z.gather(-1, rows.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0)
        return (by_rank(torch.stack([torch.logsumexp(z, dim=-1), target], dim=-1)),)

    def chunked(side, y):
        rows, inside = shard.local(targets(side))
        st = ChunkedStats.apply(y, lm_head.weight, lm_head.bias, rows, inside, shard.real, softcap, chunk)
        return (by_rank(st),)

    def by_rank(st):  # [t n, b, 2] -> [t, n, b, 2]: chunk j, TP rank j's tokens (the all-to-all's layout)
        return st.view(tp, -1, *st.shape[1:])

    def finish(side, st, *pieces):  # st [t, n, b, 2]: every rank's statistics of this rank's tokens
        lse = torch.logsumexp(st[..., 0], dim=0)  # [n, b]: over every rank's columns
        target = st[..., 1].sum(dim=0)  # one rank holds each target's column, the others gave 0
        valid = side["targets"] != -100
        if objective is not None:
            return (loss.combine(side, objective(side, (target - lse).masked_fill(~valid, 0)), *pieces),)
        return (loss(side, (lse - target).masked_fill(~valid, 0).sum(), *pieces),)

    x = "yf" if tp > 1 else "y"
    ops = [comp("head.norm", ("h",), ("y",), lambda side, h: (norm(h),))]
    if tp > 1:
        ops.append(comm("head.ag", SeqAllGather(grp, tp), "y", "yf"))
    if chunk:
        ops.append(comp("head.logits", (x,), ("st",), chunked))
    else:
        ops += [
            comp("head.logits", (x,), ("logits",), lambda side, y: (project(lm_head, y),), linear=True),
            comp("head.lse", ("logits",), ("st",), stats),
        ]
    if tp > 1:
        ops.append(comm("head.lse_a2a", VocabAllToAll(grp, tp), "st", "stf"))
    return ops + [comp("head.loss", ("stf" if tp > 1 else "st", *getattr(loss, "keys", ())), ("loss",), finish)]


class ChunkedStats(torch.autograd.Function):
    """Per token of ``y`` [T, b, h]: the log-sum-exp of its logits over this rank's ``real``
    vocabulary columns and its target's logit (0 where ``inside`` is False), ``chunk`` tokens at a
    time; the backward recomputes each chunk's logits and forms ``y``'s, the weight's and the bias's
    gradients chunk by chunk (the softcap ``c tanh(z / c)`` differentiated as 1 - (capped / c)^2)."""

    @staticmethod
    def forward(ctx, y, weight, bias, rows, inside, real, softcap, chunk):
        x, t = y.reshape(-1, y.shape[-1]), rows.reshape(-1)
        out = torch.empty(x.shape[0], 2, dtype=torch.float32, device=y.device)
        for i in range(0, x.shape[0], chunk):
            z = _capped(x[i : i + chunk], weight, bias, softcap).narrow(-1, 0, real)
            out[i : i + chunk, 0] = torch.logsumexp(z, dim=-1)
            out[i : i + chunk, 1] = z.gather(-1, t[i : i + chunk, None]).squeeze(-1)
        out[:, 1].masked_fill_(~inside.reshape(-1), 0)
        ctx.save_for_backward(x, weight, bias, t, inside.reshape(-1), out[:, 0].clone())
        ctx.shape, ctx.real, ctx.softcap, ctx.chunk = y.shape, real, softcap, chunk
        return out.view(*y.shape[:-1], 2)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, t, inside, lse = ctx.saved_tensors
        real, softcap, chunk = ctx.real, ctx.softcap, ctx.chunk
        g = grad.reshape(-1, 2).float()
        dx = torch.empty_like(x)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        db = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        for i in range(0, x.shape[0], chunk):
            xc, sl = x[i : i + chunk], slice(i, i + chunk)
            z = _capped(xc, weight, bias, softcap)
            gz = torch.zeros_like(z)
            gz[:, :real] = torch.exp(z[:, :real] - lse[sl, None]) * g[sl, :1]
            gz.scatter_add_(1, t[sl, None], (g[sl, 1] * inside[sl])[:, None])
            if softcap:
                gz = gz * (1 - (z / softcap) ** 2)
            gz = gz.to(weight.dtype)
            dx[sl] = gz @ weight
            dw += (gz.t() @ xc).float()
            if db is not None:
                db += gz.float().sum(0)
        return (
            dx.view(ctx.shape),
            dw.to(weight.dtype) if ctx.needs_input_grad[1] else None,
            None if db is None or not ctx.needs_input_grad[2] else db.to(bias.dtype),
            None, None, None, None, None,
        )  # fmt: skip


def _capped(x, weight, bias, softcap):
    z = torch.nn.functional.linear(x, weight, bias).float()
    return torch.tanh(z / softcap) * softcap if softcap else z


class VocabAllToAll(ContextAllToAll):
    """COMM op body of the vocab-parallel loss: the per-token statistics [t, n, b, 2], chunk ``j``
    (TP rank ``j``'s tokens) to TP rank ``j``."""

    lane = "comm:tp"
