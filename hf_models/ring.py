"""Ring attention for context parallelism (``"context_parallel": {"comm": "ring"}``).

Each of the ``c`` CP ranks keeps its own query, key and value heads (all of them: no head
condition beyond TP's) for its share of the sequence, and the key/value blocks travel around the
ring, one point-to-point exchange per step. Causal attention is balanced by the zig-zag split: the
sequence is cut into ``2c`` chunks and CP rank ``r`` holds chunks ``r`` and ``2c-1-r``, so every
rank has as many early tokens (few keys before them) as late ones. The op list::

    attn.qkv    COMP  xf -> q, k, v                 projections of this rank's tokens (unchanged)
    attn.ring0  COMP  q, k, v -> qr, kv0, o0, lse0  rotary at the tokens' own positions; causal
                                                     attention over the rank's own keys
    attn.kv1    COMM  kv0 -> kv1                     keys/values of CP rank r-1 (send ours to r+1)
    attn.ring1  COMP  qr, kv1, o0, lse0 -> o1, lse1  attention over them, merged by log-sum-exp
    ...                                              (c - 1 exchanges in all)
    attn.out    COMP  o -> ao                        projection (unchanged)

The block that arrives at step ``i`` comes from CP rank ``src = (r - i) mod c``. With the zig-zag
split a block from an earlier rank (``src < r``) holds one chunk every local query sees in full
(chunk ``src``) and one no local query sees; a block from a later rank is seen in full by the
local late chunk only. Each step therefore computes one unmasked (2c)-th x c-th block of scores,
the same amount on every rank. Packed documents (``position_ids``) add their block-diagonal mask
to every step; a query row that sees nothing of a block gets a finite, vanishing weight.

The merge keeps each step's output normalised: ``lse = logaddexp(lse_a, lse_b)``, ``o = o_a *
exp(lse_a - lse) + o_b * exp(lse_b - lse)``; autograd carries it backward (the matching
backward merge). Scores, softmax and the running output are float32 whatever the model dtype;
the last step casts back. The exchange's backward sends the key/value gradients back the other
way, to the rank that owns them (``comm.RingPass``).
"""

from __future__ import annotations

import torch

from ds_dhelix.graph.model_graph import comm, comp
from ds_dhelix.runtime.comm import RingPass

_HIDDEN = -1e30
"""Score of a masked pair: finite, so a query row that sees nothing of a block has a finite
log-sum-exp (its weight in the merge then underflows to exactly 0, and no NaN reaches a gradient)."""


def zigzag_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions of CP rank ``rank``'s tokens: chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    n = seq_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat(
        [torch.arange(rank * n, (rank + 1) * n, device=device), torch.arange(late * n, (late + 1) * n, device=device)]
    )


def local_positions(side: dict, index: torch.Tensor) -> dict:
    """``side`` with its rotary cos/sin (or each layer kind's, ``rope``) at the positions ``index``."""
    out = dict(side)
    if "cos" in side:
        out["cos"], out["sin"] = side["cos"][:, index], side["sin"][:, index]
    if "rope" in side:
        out["rope"] = {kind: (cos[:, index], sin[:, index]) for kind, (cos, sin) in side["rope"].items()}
    return out


class AttentionCore:
    """An ``attn.core`` body that ring attention can take apart: ``module`` (the HF attention
    module: its ``scaling``, ``training``), ``rotary(q, k, side) -> q, k`` (None: no rotary),
    ``drop`` (a ``common.Dropout`` on the attention probabilities, or None) and the HF-function
    body ``fn`` the op runs without ring attention."""

    def __init__(self, fn, module, rotary=None, drop=None):
        self.fn, self.module, self.rotary, self.drop = fn, module, rotary, drop

    def __call__(self, side, *inputs):
        return self.fn(side, *inputs)


def block_attention(q, k, v, scaling: float, allowed=None, drop=None, side=None, op: str = "", causal=False):
    """softmax(q k^T * scaling) v of one block, float32, with its log-sum-exp per query row.
    ``q`` [b, nq, sq, d], ``k`` / ``v`` [b, nk, sk, d] (nq a multiple of nk: grouped queries);
    ``allowed`` (bool, broadcast to [b, 1, sq, sk]) or None; ``causal``: the block is the rank's
    own tokens in increasing position order, query i seeing keys 0..i (``allowed`` then carries
    only the documents' mask, if any). On CPU without dropout a fused kernel (``_FusedBlock``) saves
    only q, k, v, the output and its log-sum-exp; elsewhere the scores go through autograd."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q, k, v = q.float(), k.float(), v.float()
    if drop is None and q.device.type == "cpu" and _FUSED is not None:
        bias = None
        if allowed is not None:
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill(~allowed, _HIDDEN)
            if causal:  # the documents' mask and causality in one bias
                sq, sk = q.shape[2], k.shape[2]
                bias = bias.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(), _HIDDEN)
        return _FusedBlock.apply(q, k, v, scaling, causal and bias is None, bias)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        allowed = keep if allowed is None else allowed & keep
    if allowed is not None:
        scores = scores.masked_fill(~allowed, _HIDDEN)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if drop is not None:
        probs = drop(probs, side, op)
    return torch.matmul(probs, v), lse


_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _FusedBlock(torch.autograd.Function):
    """One block's attention and log-sum-exp by torch's CPU flash-attention kernel, differentiable
    in both outputs. The kernel's backward computes dS = P * (dO V^T - rowsum(dO * O)); the
    log-sum-exp's gradient g adds P * g, which is the same formula with one more value column:
    V gets a zero column, O a column of -1 and dO the column g (and q, k a zero column so all
    head dims agree), so rowsum(dO * O) becomes rowsum(dO * O) - g. The extra columns of the
    gradients are dropped."""

    @staticmethod
    def forward(ctx, q, k, v, scaling, causal, bias):
        o, lse = _FUSED(q, k, v, 0.0, causal, attn_mask=bias, scale=scaling)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scaling, ctx.causal, ctx.bias = scaling, causal, bias
        return o, lse

    @staticmethod
    def backward(ctx, g_o, g_lse):
        q, k, v, o, lse = ctx.saved_tensors
        g_o = torch.zeros_like(o) if g_o is None else g_o
        g_lse = torch.zeros_like(lse) if g_lse is None else g_lse

        def widen(t, fill=0.0):
            return torch.cat([t, torch.full_like(t[..., :1], fill)], dim=-1)

        dq, dk, dv = _FUSED_BACKWARD(
            torch.cat([g_o, g_lse.unsqueeze(-1)], dim=-1).contiguous(),
            widen(q),
            widen(k),
            widen(v),
            widen(o, -1.0),
            lse,
            0.0,
            ctx.causal,
            attn_mask=ctx.bias,
            scale=ctx.scaling,
        )
        d = q.shape[-1]
        return dq[..., :d], dk[..., :d], dv[..., :d], None, None, None


def merge(o_a, lse_a, o_b, lse_b):
    """Two normalised partial attentions over disjoint key sets as one."""
    lse = torch.logaddexp(lse_a, lse_b)
    return o_a * torch.exp(lse_a - lse).unsqueeze(-1) + o_b * torch.exp(lse_b - lse).unsqueeze(-1), lse


def _segments(side: dict, index: torch.Tensor):
    """Document number of the tokens at ``index`` [b, n] (packed documents), else None."""
    seg = side.get("segments")
    return None if seg is None else seg[:, index]


def _documents(side: dict, q_index, k_index):
    """Packed documents: which (query, key) pairs share a document, [b, 1, sq, sk]; else None."""
    qs, ks = _segments(side, q_index), _segments(side, k_index)
    return None if qs is None else (qs[:, :, None] == ks[:, None, :]).unsqueeze(1)


def ring_attention(cp, qkv, core, out) -> list:
    """The attention ops of one layer with ring context parallelism (see the module docstring).
    ``core``: the family's ``attn.core`` op, whose body must be an ``AttentionCore``."""
    body = core.fn
    if not isinstance(body, AttentionCore):
        raise ValueError("context_parallel.comm 'ring' needs an attention core it can split into ring steps; "
                         "this model's adapter has none: use comm 'ulysses'")  # fmt: skip
    c, r, module = cp.size, cp.rank, body.module
    p_drop = body.drop.p if body.drop is not None else 0.0

    def drop():  # the probabilities' dropout while training (each step draws its own, seeded by its name)
        return body.drop if p_drop and module.training else None

    def first(side, q, k, v):
        index = side["ring_index"]
        if body.rotary is not None:
            q, k = body.rotary(q, k, local_positions(side, index))
        o, lse = block_attention(
            q, k, v, module.scaling, _documents(side, index, index), drop(), side, "attn.ring0", causal=True
        )
        return q, torch.stack([k, v]), o, lse

    def finished(o, lse, last: bool, dtype):
        if not last:
            return o, lse
        return (o.to(dtype).transpose(1, 2).flatten(2).transpose(0, 1),)  # [b, h, s, d] -> [s, b, h*d]

    def step(i):
        src, name = (r - i) % c, f"attn.ring{i}"
        last = i == c - 1

        def fn(side, qr, kv, o, lse):
            index, n = side["ring_index"], qr.shape[2] // 2
            k_index = zigzag_index(side["seq_len"], c, src, index.device)
            if src < r:  # their early chunk, seen in full by every local query
                docs = _documents(side, index, k_index[:n])
                ob, lb = block_attention(qr, kv[0][:, :, :n], kv[1][:, :, :n], module.scaling, docs, drop(), side, name)
                o, lse = merge(o, lse, ob, lb)
            else:  # all of theirs, seen in full by the local late chunk only
                docs = _documents(side, index[n:], k_index)
                ob, lb = block_attention(qr[:, :, n:], kv[0], kv[1], module.scaling, docs, drop(), side, name)
                late, late_lse = merge(o[:, :, n:], lse[:, :, n:], ob, lb)
                o, lse = torch.cat([o[:, :, :n], late], dim=2), torch.cat([lse[:, :, :n], late_lse], dim=2)
            return finished(o, lse, last, qr.dtype)

        outs = ("o",) if last else (f"oa{i}", f"lse{i}")
        return comp(name, ("qr", f"kv{i}", f"oa{i - 1}", f"lse{i - 1}"), outs, fn, selective=True)

    ring = RingPass(cp.groups, c)
    ops = [qkv, comp("attn.ring0", qkv.outputs, ("qr", "kv0", "oa0", "lse0"), first, selective=True)]
    for i in range(1, c):
        ops += [comm(f"attn.kv{i}", ring, f"kv{i - 1}", f"kv{i}"), step(i)]
    return ops + [out]
