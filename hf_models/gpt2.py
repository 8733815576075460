"""GPT-2 adapter: ``GPT2LMHeadModel`` -> sharded ``ModelGraph`` (TP + sequence parallel).

GPT-2's projections are ``Conv1D``: ``y = x @ W + b`` with ``W`` stored ``[in, out]`` (transposed
against ``nn.Linear``), so column-parallel shards split dim 1 and row-parallel shards dim 0. The
fused ``c_attn`` holds ``[q | k | v]`` column blocks of ``h`` each; every rank keeps its heads'
columns of all three blocks (picked by index, so ``gather_param`` puts them back in place).

Layer ops (``s`` sequence, ``t`` TP size; hidden is sequence-first)::

    attn.norm  COMP  h[s/t] -> x                 ln_1
    attn.ag    COMM  x -> xf[s]                  all-gather (sequence)
    attn.qkv   COMP  xf -> q,k,v                 c_attn (column-parallel, q/k/v by heads)
    attn.core  COMP  q,k,v -> o                  HF attention function (sdpa/eager)
    attn.out   COMP  o -> ao                     attn.c_proj weight (row-parallel, partial sums)
    attn.rs    COMM  ao -> ar[s/t]               reduce-scatter (sequence)
    mlp.norm   COMP  h,ar -> h2,x2               + c_proj bias, residual add, ln_2
    mlp.ag     COMM  x2 -> x2f[s]
    mlp.up     COMP  x2f -> act                  c_fc (column-parallel)
    mlp.down   COMP  act -> mo                   activation, mlp.c_proj weight (row-parallel)
    mlp.rs     COMM  mo -> mr[s/t]
    mlp.add    COMP  h2,mr -> h                  + c_proj bias, residual add

With t = 1 the COMM ops are left out. Row-parallel biases are added once, after the
reduce-scatter. Learned position embeddings (``wpe``) are added in ``embed`` for the rank's
positions; a tied ``lm_head`` is the same Parameter as ``wte`` and is used by both end blocks.
Dropout: ``embd_pdrop`` in ``embed``, ``attn_pdrop`` in ``attn.core``, ``resid_pdrop`` on the attention
and MLP outputs in ``mlp.norm`` / ``mlp.add`` (after the reduce-scatter, so on the full sums), with
masks seeded per micro-batch, layer, op and rank (``ds_dhelix.graph.draws``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.models.gpt2 import modeling_gpt2 as hf

from ds_dhelix.graph.draws import Draws
from ds_dhelix.graph.model_graph import ModelGraph, comp

from .common import (
    ContextShards,
    Dropout,
    causal_mask_side,
    check_divisible,
    check_dropout,
    cp_heads,
    dense_layer_ops,
    embed_op,
    head_ops,
    lean_act,
    make_side_fn,
    mark_replicated,
    sequential_residual,
    shard_param,
)
from .lora import project
from .ring import AttentionCore
from .vocab import shard_vocab

CONTEXT_PARALLEL = True
"""Attention runs with context parallelism (Ulysses or ring, ``common.context_attention``)."""

DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def inner_size(config) -> int:
    return config.n_inner if config.n_inner is not None else 4 * config.hidden_size


def check_tp(config, tp: int, world: int | None = None) -> None:
    if getattr(config, "add_cross_attention", False):
        raise ValueError(
            "GPT-2 with add_cross_attention=True is not supported by the ds_dhelix adapter; "
            "use a decoder-only GPT-2 config"
        )
    check_divisible(tp, world, n_head=config.num_attention_heads, n_inner=inner_size(config))


def qkv_columns(hidden: int, tp: int, tp_rank: int) -> torch.Tensor:
    """Columns of the fused ``c_attn`` ``[q | k | v]`` that hold this rank's heads."""
    n = hidden // tp
    return torch.cat([torch.arange(j * hidden + tp_rank * n, j * hidden + (tp_rank + 1) * n) for j in range(3)])


def shard(model, tp: int, tp_rank: int) -> None:
    """Slice c_attn/c_fc by output columns and both c_proj by input rows, in place."""
    if tp == 1:
        return
    cols = qkv_columns(model.config.hidden_size, tp, tp_rank)
    for block in model.transformer.h:
        at, mlp = block.attn, block.mlp
        shard_param(at.c_attn, "weight", 1, tp_rank, tp, index=cols)
        shard_param(at.c_attn, "bias", 0, tp_rank, tp, index=cols)
        shard_param(mlp.c_fc, "weight", 1, tp_rank, tp)
        shard_param(mlp.c_fc, "bias", 0, tp_rank, tp)
        for conv in (at.c_attn, mlp.c_fc):
            conv.nf = conv.weight.shape[1]  # Conv1D shapes its output from nf
        for conv in (at.c_proj, mlp.c_proj):
            shard_param(conv, "weight", 0, tp_rank, tp)


def attn_core_op(attn_module, config, drop=None):
    """``attn.core``: HF's attention function on [b, heads/t, s, d] -> o [s, b, heads/t * d];
    ``drop``: ``attn_pdrop`` on the attention probabilities, drawn on the op's seeded stream (the
    upcast path's own ``attn_dropout`` module draws there too)."""
    impl = config._attn_implementation or "sdpa"
    attend = hf.ALL_ATTENTION_FUNCTIONS.get_interface(impl, hf.eager_attention_forward)
    upcast = impl == "eager" and attn_module.reorder_and_upcast_attn

    def fn(side, q, k, v):
        mask = side.get("causal_mask")  # eager's causal mask, or packed documents' block mask
        p = drop.p if drop is not None and attn_module.training else 0.0
        with drop.rng(q.device, side, "attn.core") if drop is not None else contextlib.nullcontext():
            if upcast:
                o, _ = attn_module._upcast_and_reordered_attn(q, k, v, mask)
            else:
                o, _ = attend(attn_module, q, k, v, mask, dropout=p, scaling=attn_module.scaling)
        return (o.transpose(0, 1).flatten(2),)  # [b, s, n, d] -> [s, b, n*d]

    return comp("attn.core", ("q", "k", "v"), ("o",), AttentionCore(fn, attn_module, drop=drop), selective=True)


def layer_ops(index: int, block, config, tp: int, tp_group, draws, cp=None):
    at, mlp = block.attn, block.mlp
    hd = at.head_dim

    def qkv(side, xf):
        s, b, _ = xf.shape
        parts = project(at.c_attn, xf).split(at.c_attn.nf // 3, dim=2)
        return tuple(p.view(s, b, -1, hd).permute(1, 2, 0, 3) for p in parts)  # [b, n/t, s, d]

    return dense_layer_ops(
        tp,
        tp_group,
        cp=cp,
        heads=cp_heads(config, tp),
        attn_norm=lambda side, h: (block.ln_1(h),),
        qkv=qkv,
        attn_core=attn_core_op(at, config, Dropout.make(draws, config.attn_pdrop, index, at)),
        attn_out=lambda side, o: (project(at.c_proj, o, bias=False),),
        residual=sequential_residual(
            block.ln_2, at.c_proj.bias, mlp.c_proj.bias, Dropout.make(draws, config.resid_pdrop, index, block)
        ),
        mlp_up=lambda side, x: (project(mlp.c_fc, x),),
        mlp_down=lambda side, a: (project(mlp.c_proj, lean_act(mlp.act, a), bias=False),),
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
    """Shard ``model`` in place for this TP rank and return its op graph. Dropout (``embd_pdrop``,
    ``attn_pdrop``, ``resid_pdrop``) draws its masks from ``ds_dhelix.graph.draws`` (``seed``: their base
    seed, None: ``torch.initial_seed()``), so every schedule draws the same ones."""
    config = model.config
    check_tp(config, tp)
    check_dropout(config, DROPOUT_KEYS, "GPT-2")
    draws = Draws(seed)
    shard(model, tp, tp_rank)
    tr = model.transformer
    vocab = shard_vocab(tr.wte, model.lm_head, tp, tp_rank, tp_group)
    replicated = None
    if tp > 1:
        replicated = [tr.wpe.weight, tr.ln_f.weight, tr.ln_f.bias]
        for block in tr.h:
            replicated += [
                block.ln_1.weight,
                block.ln_1.bias,
                block.ln_2.weight,
                block.ln_2.bias,
                block.attn.c_proj.bias,
                block.mlp.c_proj.bias,
            ]
        replicated = mark_replicated(replicated, tp_grad_group)

    def eager_mask(batch, side):
        return causal_mask_side(
            config, tr.wte.weight.dtype, side["seq_len"], tr.wte.weight.device, side.get("position_ids"), side
        )

    blocks = [embed_op(tr.wte, pos_embed=tr.wpe, drop=Dropout.make(draws, config.embd_pdrop, -1, tr), vocab=vocab)]
    blocks += [layer_ops(i, block, config, tp, tp_group, draws, cp) for i, block in enumerate(tr.h)]
    head = functools.partial(head_ops, tr.ln_f, model.lm_head, vocab=vocab)
    blocks.append(head())
    side = make_side_fn(tp, tp_rank, eager_mask, cp)
    return ModelGraph(blocks, side, family="gpt2", meta={"head": head}, replicated=replicated)
