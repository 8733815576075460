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

import functools

from transformers.models.gpt_neox import modeling_gpt_neox as hf

from ds_dhelix.graph.draws import Draws
from ds_dhelix.graph.model_graph import ModelGraph, comp

from .common import (
    ContextShards,
    Dropout,
    attn_core_op,
    check_divisible,
    check_dropout,
    cp_heads,
    dense_layer_ops,
    dropped,
    embed_op,
    head_ops,
    lean_act,
    make_side_fn,
    mark_replicated,
    plus,
    rotary,
    rotary_side_fn,
    sequential_residual,
    shard_param,
)
from .lora import project
from .vocab import shard_vocab

CONTEXT_PARALLEL = True
"""Attention runs with context parallelism (Ulysses or ring, ``common.context_attention``)."""

DROPOUT_KEYS = ("hidden_dropout", "attention_dropout")
LORA_TARGETS = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def check_tp(config, tp: int, world: int | None = None) -> None:
    check_divisible(
        tp, world, num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size
    )


def shard(model, tp: int, tp_rank: int) -> None:
    """Slice query_key_value/dense_h_to_4h by output rows and dense/dense_4h_to_h by input columns."""
    for layer in model.gpt_neox.layers:
        at, mlp = layer.attention, layer.mlp
        for lin in (at.query_key_value, mlp.dense_h_to_4h):
            shard_param(lin, "weight", 0, tp_rank, tp)
            shard_param(lin, "bias", 0, tp_rank, tp)
        for lin in (at.dense, mlp.dense_4h_to_h):
            shard_param(lin, "weight", 1, tp_rank, tp)


def residual(layer, drop=None):
    """``mlp.norm`` / ``mlp.add`` for the parallel residual (h + drop(attn(ln1(h))) + drop(mlp(ln2(h))))
    or the sequential one; ``drop``: ``hidden_dropout`` on the attention and MLP outputs."""
    at, mlp = layer.attention, layer.mlp
    if not layer.use_parallel_residual:
        return sequential_residual(layer.post_attention_layernorm, at.dense.bias, mlp.dense_4h_to_h.bias, drop)

    def add(side, h, a, m):
        return (
            dropped(plus(m, mlp.dense_4h_to_h.bias), drop, side, "mlp.resid")
            + dropped(plus(a, at.dense.bias), drop, side, "attn.resid")
            + h,
        )

    def make(ar: str, mr: str):
        norm = comp("mlp.norm", ("h",), ("x2",), lambda side, h: (layer.post_attention_layernorm(h),))
        return norm, comp("mlp.add", ("h", ar, mr), ("h",), add)

    return make


def layer_ops(index: int, layer, config, tp: int, tp_group, draws, cp=None):
    at, mlp = layer.attention, layer.mlp
    hd = at.head_size

    def qkv(side, xf):
        s, b, _ = xf.shape
        fused = project(at.query_key_value, xf).view(s, b, -1, 3 * hd).permute(1, 2, 0, 3)  # [b, n/t, s, 3d]
        return fused.chunk(3, dim=-1)

    return dense_layer_ops(
        tp,
        tp_group,
        cp=cp,
        heads=cp_heads(config, tp),
        attn_norm=lambda side, h: (layer.input_layernorm(h),),
        qkv=qkv,
        attn_core=attn_core_op(
            at,
            config,
            hf.eager_attention_forward,
            rotary=rotary(hf.apply_rotary_pos_emb),
            drop=Dropout.make(draws, config.attention_dropout, index, at),
        ),
        attn_out=lambda side, o: (project(at.dense, o, bias=False),),
        residual=residual(layer, Dropout.make(draws, config.hidden_dropout, index, layer)),
        mlp_up=lambda side, x: (project(mlp.dense_h_to_4h, x),),
        mlp_down=lambda side, a: (project(mlp.dense_4h_to_h, lean_act(mlp.act, a), bias=False),),
    )


def build_graph(
    model,
    tp: int = 1,
    tp_rank: int = 0,
    tp_group=None,
    tp_grad_group=None,
    seed: int | None = None,
    cp: ContextShards | None = None,
) -> ModelGraph:
    """Shard ``model`` in place for this TP rank and return its op graph. Dropout
    (``attention_dropout``, ``hidden_dropout``) draws its masks from ``ds_dhelix.graph.draws`` (``seed``:
    their base seed, None: ``torch.initial_seed()``)."""
    config = model.config
    check_tp(config, tp)
    check_dropout(config, DROPOUT_KEYS, "GPT-NeoX")
    draws = Draws(seed)
    shard(model, tp, tp_rank)
    inner = model.gpt_neox
    vocab = shard_vocab(inner.embed_in, model.lm_head, tp, tp_rank, tp_group)
    replicated = None
    if tp > 1:
        replicated = [inner.final_layer_norm.weight, inner.final_layer_norm.bias]
        for layer in inner.layers:
            replicated += [
                layer.input_layernorm.weight,
                layer.input_layernorm.bias,
                layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.bias,
                layer.attention.dense.bias,
                layer.mlp.dense_4h_to_h.bias,
            ]
        replicated = mark_replicated(replicated, tp_grad_group)

    blocks = [embed_op(inner.embed_in, vocab=vocab)]
    blocks += [layer_ops(i, layer, config, tp, tp_group, draws, cp) for i, layer in enumerate(inner.layers)]
    head = functools.partial(head_ops, inner.final_layer_norm, model.lm_head, vocab=vocab)
    blocks.append(head())
    side = rotary_side_fn(inner.rotary_emb, inner.embed_in, config)  # cos/sin: [1, s, rotary_ndims]
    side = make_side_fn(tp, tp_rank, side, cp)
    return ModelGraph(blocks, side, family="gpt_neox", meta={"head": head}, replicated=replicated)
