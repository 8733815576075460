"""GPT-NeoX adapter: ``GPTNeoXForCausalLM`` (Pythia) -> sharded ``ModelGraph`` (TP + sequence parallel).

The fused ``query_key_value`` weight ``[3h, h]`` stores its rows per head as ``[heads, 3, head_size]``,
so a contiguous block of ``3h/t`` rows is whole heads with their q, k and v: a plain row slice.
Rotary embeddings cover the first ``rotary_ndims`` of each head (HF's ``apply_rotary_pos_emb``).

Layer ops (``s`` sequence, ``t`` TP size; hidden is sequence-first)::

    attn.norm  COMP  h[s/t] -> x                 input_layernorm
    attn.ag    COMM  x -> xf[s]                  all-gather (sequence)
    attn.qkv   COMP  xf -> q,k,v                 query_key_value (column-parallel) + partial rotary
    attn.core  COMP  q,k,v -> o                  HF attention function (sdpa/eager)
    attn.out   COMP  o -> ao                     dense weight (row-parallel, partial sums)
    attn.rs    COMM  ao -> ar[s/t]               reduce-scatter (sequence)
    mlp.norm   COMP  see below                   post_attention_layernorm
    mlp.ag     COMM  x2 -> x2f[s]
    mlp.up     COMP  x2f -> act                  act(dense_h_to_4h) (column-parallel)
    mlp.down   COMP  act -> mo                   dense_4h_to_h weight (row-parallel)
    mlp.rs     COMM  mo -> mr[s/t]
    mlp.add    COMP  see below                   residual add

    use_parallel_residual   mlp.norm  h -> x2                 mlp.add  h,ar,mr -> h   (h + attn + mlp)
    sequential residual     mlp.norm  h,ar -> h2,x2           mlp.add  h2,mr -> h

With t = 1 the COMM ops are left out. Row-parallel biases are added once, after the
reduce-scatter. Dropout is not applied (see ``build_graph``).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from transformers.models.gpt_neox import modeling_gpt_neox as hf

from ds_dhelix.comm import SeqAllGather, SeqReduceScatter
from ds_dhelix.graph import ModelGraph, comm, comp

from .common import check_divisible, embed_op, head_ops, make_side_fn, mark_replicated, shard_param

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


def with_bias(x, lin):
    return x if lin.bias is None else x + lin.bias


def attn_core_op(attn_module, config):
    """``attn.core``: HF's attention function on [b, heads/t, s, d] -> o [s, b, heads/t * d]."""
    impl = config._attn_implementation or "sdpa"
    attend = hf.ALL_ATTENTION_FUNCTIONS.get_interface(impl, hf.eager_attention_forward)

    def fn(side, q, k, v):
        mask = side.get("causal_mask") if impl == "eager" else None
        o, _ = attend(attn_module, q, k, v, mask, dropout=0.0, scaling=attn_module.scaling)
        return (o.transpose(0, 1).flatten(2),)  # [b, s, n, d] -> [s, b, n*d]

    return comp("attn.core", ("q", "k", "v"), ("o",), fn)


def residual_ops(layer, ar: str, mr: str):
    """``mlp.norm`` and ``mlp.add`` for the parallel or the sequential residual."""
    at, mlp = layer.attention, layer.mlp
    if layer.use_parallel_residual:  # h + attn(ln1(h)) + mlp(ln2(h))
        norm = comp("mlp.norm", ("h",), ("x2",), lambda side, h: (layer.post_attention_layernorm(h),))
        add = comp("mlp.add", ("h", ar, mr), ("h",),
                   lambda side, h, a, m: (with_bias(m, mlp.dense_4h_to_h) + with_bias(a, at.dense) + h,))
        return norm, add

    def mlp_norm(side, h, a):
        h2 = with_bias(a, at.dense) + h
        return h2, layer.post_attention_layernorm(h2)

    norm = comp("mlp.norm", ("h", ar), ("h2", "x2"), mlp_norm)
    add = comp("mlp.add", ("h2", mr), ("h",), lambda side, h2, m: (with_bias(m, mlp.dense_4h_to_h) + h2,))
    return norm, add


def layer_ops(layer, config, tp: int, tp_group):
    at, mlp = layer.attention, layer.mlp
    hd = at.head_size
    sharded = tp > 1
    xin, x2in = ("xf", "x2f") if sharded else ("x", "x2")
    ar, mr = ("ar", "mr") if sharded else ("ao", "mo")
    gather, scatter = SeqAllGather(tp_group, tp), SeqReduceScatter(tp_group, tp)

    def qkv(side, xf):
        s, b, _ = xf.shape
        fused = at.query_key_value(xf).view(s, b, -1, 3 * hd).permute(1, 2, 0, 3)  # [b, n/t, s, 3d]
        q, k, v = fused.chunk(3, dim=-1)
        q, k = hf.apply_rotary_pos_emb(q, k, side["cos"], side["sin"])
        return q, k, v

    norm, add = residual_ops(layer, ar, mr)
    ops = [comp("attn.norm", ("h",), ("x",), lambda side, h: (layer.input_layernorm(h),))]
    if sharded:
        ops.append(comm("attn.ag", gather, "x", "xf"))
    ops += [
        comp("attn.qkv", (xin,), ("q", "k", "v"), qkv),
        attn_core_op(at, config),
        comp("attn.out", ("o",), ("ao",), lambda side, o: (F.linear(o, at.dense.weight),)),
    ]
    if sharded:
        ops.append(comm("attn.rs", scatter, "ao", "ar"))
    ops.append(norm)
    if sharded:
        ops.append(comm("mlp.ag", gather, "x2", "x2f"))
    ops += [
        comp("mlp.up", (x2in,), ("act",), lambda side, x: (mlp.act(mlp.dense_h_to_4h(x)),)),
        comp("mlp.down", ("act",), ("mo",), lambda side, a: (F.linear(a, mlp.dense_4h_to_h.weight),)),
    ]
    if sharded:
        ops.append(comm("mlp.rs", scatter, "mo", "mr"))
    ops.append(add)
    return ops


def build_graph(model, tp: int = 1, tp_rank: int = 0, tp_group=None, tp_grad_group=None) -> ModelGraph:
    """Shard ``model`` in place for this TP rank and return its op graph.

    Dropout is not applied: the op graph must give the same result under every schedule, and
    SI reorders micro-batches' ops (and so their random draws). A warning names nonzero keys.
    """
    config = model.config
    check_tp(config, tp)
    active = {k: getattr(config, k) for k in _DROPOUT_KEYS if getattr(config, k, 0.0)}
    if active:
        warnings.warn(f"ds_dhelix runs GPT-NeoX without dropout; ignoring {active}", stacklevel=2)
    shard(model, tp, tp_rank)
    inner = model.gpt_neox
    if tp > 1:
        replicated = [inner.embed_in.weight, inner.final_layer_norm.weight, inner.final_layer_norm.bias,
                      model.lm_head.weight]
        for layer in inner.layers:
            replicated += [layer.input_layernorm.weight, layer.input_layernorm.bias,
                           layer.post_attention_layernorm.weight, layer.post_attention_layernorm.bias,
                           layer.attention.dense.bias, layer.mlp.dense_4h_to_h.bias]
        mark_replicated(replicated, tp_grad_group)

    def rotary(batch, side):
        s, dummy = side["seq_len"], inner.embed_in.weight[:1].detach()
        cos, sin = inner.rotary_emb(dummy, torch.arange(s).unsqueeze(0))  # [1, s, rotary_ndims]
        extra = {"cos": cos, "sin": sin}
        if (config._attn_implementation or "sdpa") == "eager":
            mask = torch.full((s, s), torch.finfo(dummy.dtype).min, dtype=dummy.dtype).triu(1)
            extra["causal_mask"] = mask[None, None]
        return extra

    blocks = [[embed_op(inner.embed_in)]]
    blocks += [layer_ops(layer, config, tp, tp_group) for layer in inner.layers]
    blocks.append(head_ops(inner.final_layer_norm, model.lm_head))
    return ModelGraph(blocks, make_side_fn(tp, tp_rank, rotary), family="gpt_neox")
