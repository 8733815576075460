"""Llama adapter: ``LlamaForCausalLM`` -> sharded ``ModelGraph`` (TP + sequence parallel).

Layer ops (``s`` sequence, ``t`` TP size; hidden is sequence-first)::

    attn.norm  COMP  h[s/t] -> x                 input_layernorm
    attn.ag    COMM  x -> xf[s]                  all-gather (sequence)
    attn.qkv   COMP  xf -> q,k,v                 q/k/v_proj (column-parallel)
    attn.core  COMP  q,k,v -> o                  rotary + HF attention function (sdpa/eager)
    attn.out   COMP  o -> ao                     o_proj (row-parallel, partial sums)
    attn.rs    COMM  ao -> ar[s/t]               reduce-scatter (sequence)
    mlp.norm   COMP  h,ar -> h2,x2               residual add + post_attention_layernorm
    mlp.ag     COMM  x2 -> x2f[s]
    mlp.up     COMP  x2f -> gate,up              gate_proj, up_proj (column-parallel)
    mlp.down   COMP  gate,up -> mo               act(gate) * up, down_proj (row-parallel)
    mlp.rs     COMM  mo -> mr[s/t]
    mlp.add    COMP  h2,mr -> h                  residual add

With t = 1 the COMM ops are left out. The HF modules keep their parameters (sliced for TP) and
their state_dict keys; the math is theirs, called op by op.
"""
from __future__ import annotations

import torch.nn.functional as F
from transformers.models.llama import modeling_llama as hf

from ds_dhelix.graph.model_graph import ModelGraph

from ds_dhelix.graph.draws import Draws

from .common import (ContextShards, Dropout, attn_core_op, check_divisible, check_dropout, cp_heads, dense_layer_ops,
                     embed_op, head_ops, make_side_fn, mark_replicated, qkv_projections, rotary, rotary_side_fn,
                     sequential_residual, shard_param)


CONTEXT_PARALLEL = True
"""Attention runs with context parallelism (Ulysses or ring, ``common.context_attention``)."""

DROPOUT_KEYS = ("attention_dropout",)


def check_tp(config, tp: int, world: int | None = None) -> None:
    check_divisible(tp, world, num_attention_heads=config.num_attention_heads,
                    num_key_value_heads=config.num_key_value_heads,
                    intermediate_size=config.intermediate_size)


def shard(model, tp: int, tp_rank: int) -> None:
    """Slice q/k/v/gate/up by output rows and o/down by input columns, in place."""
    for layer in model.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        for lin in (at.q_proj, at.k_proj, at.v_proj, mlp.gate_proj, mlp.up_proj):
            shard_param(lin, "weight", 0, tp_rank, tp)
            shard_param(lin, "bias", 0, tp_rank, tp)
        for lin in (at.o_proj, mlp.down_proj):
            shard_param(lin, "weight", 1, tp_rank, tp)


def layer_ops(index: int, layer, config, tp: int, tp_group, draws: Draws, cp=None):
    at, mlp = layer.self_attn, layer.mlp
    drop = Dropout.make(draws, config.attention_dropout, index, at)
    return dense_layer_ops(
        tp, tp_group, cp=cp, heads=cp_heads(config, tp),
        attn_norm=lambda side, h: (layer.input_layernorm(h),),
        qkv=qkv_projections(at),
        attn_core=attn_core_op(at, config, hf.eager_attention_forward, rotary=rotary(hf.apply_rotary_pos_emb),
                               drop=drop),
        attn_out=lambda side, o: (F.linear(o, at.o_proj.weight),),
        residual=sequential_residual(layer.post_attention_layernorm, at.o_proj.bias, mlp.down_proj.bias),
        mlp_up=lambda side, x: (mlp.gate_proj(x), mlp.up_proj(x)),
        mlp_down=lambda side, g, u: (F.linear(mlp.act_fn(g) * u, mlp.down_proj.weight),),
        mlp_hidden=("gate", "up"),
    )


def build_graph(model, tp: int = 1, tp_rank: int = 0, tp_group=None, tp_grad_group=None,
                seed: int | None = None, cp: ContextShards | None = None) -> ModelGraph:
    """Shard ``model`` in place for this TP rank and return its op graph; ``seed``: the base seed
    of its dropout masks (None: ``torch.initial_seed()``)."""
    config = model.config
    check_tp(config, tp)
    check_dropout(config, DROPOUT_KEYS, "Llama")
    draws = Draws(seed)
    shard(model, tp, tp_rank)
    inner = model.model
    replicated = None
    if tp > 1:
        replicated = [inner.embed_tokens.weight, inner.norm.weight, model.lm_head.weight]
        for layer in inner.layers:
            replicated += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                           layer.self_attn.o_proj.bias, layer.mlp.down_proj.bias]
        replicated = mark_replicated(replicated, tp_grad_group)

    blocks = [[embed_op(inner.embed_tokens)]]
    blocks += [layer_ops(i, layer, config, tp, tp_group, draws, cp) for i, layer in enumerate(inner.layers)]
    blocks.append(head_ops(inner.norm, model.lm_head))
    side = rotary_side_fn(inner.rotary_emb, inner.embed_tokens, config)
    return ModelGraph(blocks, make_side_fn(tp, tp_rank, side, cp), family="llama", replicated=replicated)
