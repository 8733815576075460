"""Output-gated attention (Qwen3.5 / Qwen3.5-MoE full-attention layers) as an attention op set of
the shared machinery (``DenseFamily(attention="gated")``, ``MoeFamily(attention="gated")``).

HF's ``q_proj`` returns, per head, the query and a gate of the same width (rows ``[q | gate]``
head by head); the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``. As ops
(``n`` query heads of this TP rank, ``d`` head_dim)::

    attn.qkv   COMP  xf -> q,k,v,gate   q_proj (column-parallel by heads: a head's q and gate rows
                                        together), k_proj, v_proj; views only    q [b, n, s, d], gate [s, b, n*d]
    attn.core  COMP  q,k,v -> o         q/k RMSNorm per head, (partial) rotary, HF's attention function
    attn.out   COMP  o,gate -> ao       o x sigmoid(gate), o_proj (row-parallel, partial sums)

The gate travels from ``attn.qkv`` to ``attn.out`` on this rank's heads; ``attn.qkv`` stays a
projection (the norms run in ``attn.core``, HF's order) and ``attn.out`` is linear on the way to
``o_proj``'s weight, so SI can defer both weight gradients.
"""

from __future__ import annotations

import torch

from ds_dhelix.graph.model_graph import comp

from .lora import project


def qkv_fn(at):
    """``attn.qkv``: xf [s, b, h] -> q, k, v [b, heads/t, s, d], gate [s, b, heads/t * d]."""
    hd = at.head_dim

    def fn(side, xf):
        s, b, _ = xf.shape
        q, gate = project(at.q_proj, xf).view(s, b, -1, 2 * hd).chunk(2, dim=-1)
        k, v = (project(proj, xf).view(s, b, -1, hd) for proj in (at.k_proj, at.v_proj))
        return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), gate.reshape(s, b, -1)

    return fn


def mixer_ops(at, xin: str, core) -> list:
    """``attn.qkv``, ``core`` (the family's ``attn.core`` op on q, k, v), ``attn.out`` of a gated
    attention module ``at``, reading ``xin`` and writing ``ao``."""

    def out(side, o, gate):
        return (project(at.o_proj, o * torch.sigmoid(gate), bias=False),)

    return [
        comp("attn.qkv", (xin,), ("q", "k", "v", "gate"), qkv_fn(at), linear=True),
        core,
        comp("attn.out", ("o", "gate"), ("ao",), out, linear=True),
    ]
