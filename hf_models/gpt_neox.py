"""GPT-NeoX adapter: ``GPTNeoXForCausalLM`` (Pythia) -> sharded ``ModelGraph`` (TP + sequence parallel).

The fused ``query_key_value`` weight ``[3h, h]`` stores its rows per head as ``[heads, 3, head_size]``,
so a contiguous block of ``3h/t`` rows is whole heads with their q, k and v: a plain row slice.
Rotary embeddings cover the first ``rotary_ndims`` of each head (HF's ``apply_rotary_pos_emb``).

Layer ops (``s`` sequence, ``t`` TP size; hidden is sequence-first)::

    attn.norm  COMP  h[s/t] -> x                 input_layernorm
    attn.ag    COMM  x -> xf[s]                  all-gather (sequence)
    attn.qkv   COMP  xf -> q,k,v                 query_key_value (column-parallel)
    attn.core  COMP  q,k,v -> o                  partial rotary + HF attention function (sdpa/eager)
    attn.out   COMP  o -> ao                     dense weight (row-parallel, partial sums)
    attn.rs    COMM  ao -> ar[s/t]               reduce-scatter (sequence)
    mlp.norm   COMP  see below                   post_attention_layernorm
    mlp.ag     COMM  x2 -> x2f[s]
    mlp.up     COMP  x2f -> act                  dense_h_to_4h (column-parallel)
    mlp.down   COMP  act -> mo                   activation, dense_4h_to_h weight (row-parallel)
    mlp.rs     COMM  mo -> mr[s/t]
    mlp.add    COMP  see below                   residual add

    use_parallel_residual   mlp.norm  h -> x2                 mlp.add  h,ar,mr -> h   (h + attn + mlp)
    sequential residual     mlp.norm  h,ar -> h2,x2           mlp.add  h2,mr -> h

With t = 1 the COMM ops are left out. Row-parallel biases are added once, after the
reduce-scatter. Dropout is not applied (see ``build_graph``).
"""
from __future__ import annotations

import torch.nn.functional as F
from transformers.models.gpt_neox import modeling_gpt_neox as hf

from ds_dhelix.graph import ModelGraph, comp

from .common import (attn_core_op, check_divisible, dense_layer_ops, embed_op, head_ops, make_side_fn,
                     mark_replicated, rotary, rotary_side_fn, sequential_residual, shard_param, warn_dropout)

_DROPOUT_KEYS = ("hidden_dropout", "attention_dropout")


def check_tp(config, tp: int, world: int | None = None) -> None:
    check_divisible(tp, world, num_attention_heads=config.num_attention_heads,
                    intermediate_size=config.intermediate_size)


def shard(model, tp: int, tp_rank: int) -> None:
    """Slice query_key_value/dense_h_to_4h by output rows and dense/dense_4h_to_h by input columns."""
    for layer in model.gpt_neox.layers:
        at, mlp = layer.attention, layer.mlp
        for lin in (at.query_key_value, mlp.dense_h_to_4h):
            shard_param(lin, "weight", 0, tp_rank, tp)
            shard_param(lin, "bias", 0, tp_rank, tp)
        for lin in (at.dense, mlp.dense_4h_to_h):
            shard_param(lin, "weight", 1, tp_rank, tp)


def residual(layer):
    """``mlp.norm`` / ``mlp.add`` for the parallel residual (h + attn(ln1(h)) + mlp(ln2(h))) or the
    sequential one."""
    at, mlp = layer.attention, layer.mlp
    if not layer.use_parallel_residual:
        return sequential_residual(layer.post_attention_layernorm, at.dense.bias, mlp.dense_4h_to_h.bias)

    def plus(x, lin):
        return x if lin.bias is None else x + lin.bias

    def make(ar: str, mr: str):
        norm = comp("mlp.norm", ("h",), ("x2",), lambda side, h: (layer.post_attention_layernorm(h),))
        add = comp("mlp.add", ("h", ar, mr), ("h",),
                   lambda side, h, a, m: (plus(m, mlp.dense_4h_to_h) + plus(a, at.dense) + h,))
        return norm, add

    return make


def layer_ops(layer, config, tp: int, tp_group):
    at, mlp = layer.attention, layer.mlp
    hd = at.head_size

    def qkv(side, xf):
        s, b, _ = xf.shape
        fused = at.query_key_value(xf).view(s, b, -1, 3 * hd).permute(1, 2, 0, 3)  # [b, n/t, s, 3d]
        return fused.chunk(3, dim=-1)

    return dense_layer_ops(
        tp, tp_group,
        attn_norm=lambda side, h: (layer.input_layernorm(h),),
        qkv=qkv,
        attn_core=attn_core_op(at, config, hf.eager_attention_forward, rotary=rotary(hf.apply_rotary_pos_emb)),
        attn_out=lambda side, o: (F.linear(o, at.dense.weight),),
        residual=residual(layer),
        mlp_up=lambda side, x: (mlp.dense_h_to_4h(x),),
        mlp_down=lambda side, a: (F.linear(mlp.act(a), mlp.dense_4h_to_h.weight),),
    )


def build_graph(model, tp: int = 1, tp_rank: int = 0, tp_group=None, tp_grad_group=None) -> ModelGraph:
    """Shard ``model`` in place for this TP rank and return its op graph.

    Dropout is not applied: the op graph must give the same result under every schedule, and
    SI reorders micro-batches' ops (and so their random draws). A warning names nonzero keys.
    """
    config = model.config
    check_tp(config, tp)
    warn_dropout(config, _DROPOUT_KEYS, "GPT-NeoX")
    shard(model, tp, tp_rank)
    inner = model.gpt_neox
    replicated = None
    if tp > 1:
        replicated = [inner.embed_in.weight, inner.final_layer_norm.weight, inner.final_layer_norm.bias,
                      model.lm_head.weight]
        for layer in inner.layers:
            replicated += [layer.input_layernorm.weight, layer.input_layernorm.bias,
                           layer.post_attention_layernorm.weight, layer.post_attention_layernorm.bias,
                           layer.attention.dense.bias, layer.mlp.dense_4h_to_h.bias]
        replicated = mark_replicated(replicated, tp_grad_group)

    blocks = [[embed_op(inner.embed_in)]]
    blocks += [layer_ops(layer, config, tp, tp_group) for layer in inner.layers]
    blocks.append(head_ops(inner.final_layer_norm, model.lm_head))
    side = rotary_side_fn(inner.rotary_emb, inner.embed_in.weight, config)  # cos/sin: [1, s, rotary_ndims]
    return ModelGraph(blocks, make_side_fn(tp, tp_rank, side), family="gpt_neox", replicated=replicated)
