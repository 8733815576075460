"""Phi-MoE adapter: ``PhimoeForCausalLM`` -> ``ModelGraph`` with expert parallelism (EP) and
tensor/sequence parallel (TP) attention.

Layer ops (``s`` sequence, ``t`` TP size, ``N`` tokens of this rank, hidden sequence-first)::

    attn.norm     COMP  h[s/t] -> x               input_layernorm
    attn.ag       COMM  x -> xf[s]                all-gather (sequence)           t > 1
    attn.qkv      COMP  xf -> q,k,v               q/k/v_proj (column-parallel)
    attn.core     COMP  q,k,v -> o                rotary + HF attention function (sdpa/eager)
    attn.out      COMP  o -> ao                   o_proj (row-parallel, partial sums)
    attn.rs       COMM  ao -> ar[s/t]             reduce-scatter (sequence)       t > 1
    mlp.norm      COMP  h,ar -> h2,x2             residual add + post_attention_layernorm
    moe.router    COMP  x2 -> xs,w,aux.<i>        HF router (sparsemixer); copies sorted by expert
    moe.counts    COMM  xs -> xc                  rows per (rank, expert), async    ep > 1, dropless
    moe.dispatch  COMM  xs|xc -> xr               all-to-all to the experts' EP ranks  ep > 1
    moe.experts.up    COMP  xr -> xg              regroup rows by expert; gate/up projections
    moe.experts.act   COMP  xg -> xa              act(gate) x up
    moe.experts.down  COMP  xa -> yr              down projection; rows back in received order
    moe.combine   COMM  yr -> ys                  all-to-all back                      ep > 1
    moe.add       COMP  h2,ys,w -> h              weighted sum of each token's copies + residual

Each TP rank routes its own sequence shard; EP groups are DP peers with the same TP rank. The
router's per-layer load-balancing pieces (``aux.<i>``) flow to ``head.loss``, which adds HF's
``router_aux_loss_coef x load_balancing_loss`` over all layers, so its gradient reaches every router
through the ordinary backward of the op graph, under SI as well. HF state_dict keys never change:
expert shards keep their names and are gathered back to ``[E, ...]`` by global expert id.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers.models.phimoe import modeling_phimoe as hf

from ds_dhelix.comm import SeqAllGather, SeqReduceScatter
from ds_dhelix.graph import ModelGraph, comm, comp
from ds_dhelix.moe.dispatch import CountExchange, ExpertAllToAll, ExpertGroups
from ds_dhelix.moe.experts import check_ep as _check_ep
from ds_dhelix.moe.experts import expert_act, run_expert_down, run_expert_up, shard_experts
from ds_dhelix.moe.metrics import MoeMetrics
from ds_dhelix.draws import Draws, draw_seed, seeded_rng
from ds_dhelix.moe.router import aux_piece, combine_copies, load_balancing_loss, local_counts, route_tokens

from .common import (Dropout, attn_core_op, causal_mask_side, check_divisible, check_dropout, embed_op, head_ops,
                     make_side_fn, mark_replicated, qkv_projections, rotary, shard_param, side_positions)


DROPOUT_KEYS = ("attention_dropout",)


def check_tp(config, tp: int, world: int | None = None) -> None:
    check_divisible(tp, world, num_attention_heads=config.num_attention_heads,
                    num_key_value_heads=config.num_key_value_heads)
    check_moe(config)


def check_moe(config) -> None:
    """Routing settings HF's sparsemixer can run: ``ValueError`` otherwise."""
    num, top_k = config.num_local_experts, config.num_experts_per_tok
    if top_k > num:
        raise ValueError(f"num_experts_per_tok {top_k} is larger than num_local_experts {num}: a token cannot "
                         f"be routed to more experts than exist; use num_experts_per_tok <= {num}")
    if num < 2:
        raise ValueError(f"num_local_experts {num}: Phi-MoE's sparsemixer routes every token to 2 experts; "
                         f"use at least 2 experts")


def check_ep(config, ep: int, dp_size: int | None = None) -> None:
    """``ValueError`` unless ``ep`` divides the number of experts (and the DP size), listing valid sizes."""
    check_moe(config)
    _check_ep(config.num_local_experts, config.num_experts_per_tok, ep, dp_size)


def checkpoint_source(name: str, config):
    """Where ``name`` lives in Phi-MoE files as ``save_pretrained`` writes them: the router is
    ``block_sparse_moe.gate``; expert ``e``'s ``w1`` (gate) and ``w3`` (up) rows make
    ``gate_up_proj[e]``, its ``w2`` makes ``down_proj[e]`` (None: the name itself)."""
    from .loading import Joined, Key
    head, sep, leaf = name.partition(".mlp.")
    if not sep:
        return None
    moe = f"{head}.block_sparse_moe"
    n, inter = config.num_local_experts, config.intermediate_size
    if leaf == "router.weight":
        return Key(f"{moe}.gate.weight")
    if leaf == "experts.gate_up_proj":
        return Joined(0, tuple(Joined(0, (Key(f"{moe}.experts.{e}.w1.weight"), Key(f"{moe}.experts.{e}.w3.weight")),
                                      sizes=(inter, inter)) for e in range(n)), stack=True)
    if leaf == "experts.down_proj":
        return Joined(0, tuple(Key(f"{moe}.experts.{e}.w2.weight") for e in range(n)), stack=True)
    return Key(f"{moe}.{leaf}")


def shard(model, tp: int, tp_rank: int, ep_groups: ExpertGroups) -> None:
    """TP: q/k/v by output rows, o_proj by input columns. EP: keep this rank's experts."""
    for layer in model.model.layers:
        at = layer.self_attn
        for lin in (at.q_proj, at.k_proj, at.v_proj):
            shard_param(lin, "weight", 0, tp_rank, tp)
            shard_param(lin, "bias", 0, tp_rank, tp)
        shard_param(at.o_proj, "weight", 1, tp_rank, tp)
        shard_experts(layer.mlp.experts, ep_groups)


def attention_ops(index: int, layer, config, tp: int, tp_group, draws):
    at = layer.self_attn
    drop = Dropout.make(draws, config.attention_dropout, index, at)
    xin, ar = ("xf", "ar") if tp > 1 else ("x", "ao")
    ops = [comp("attn.norm", ("h",), ("x",), lambda side, h: (layer.input_layernorm(h),))]
    if tp > 1:
        ops.append(comm("attn.ag", SeqAllGather(tp_group, tp), "x", "xf"))
    ops += [comp("attn.qkv", (xin,), ("q", "k", "v"), qkv_projections(at), linear=True),
            attn_core_op(at, config, hf.eager_attention_forward, rotary=rotary(hf.apply_rotary_pos_emb), drop=drop),
            comp("attn.out", ("o",), ("ao",), lambda side, o: (F.linear(o, at.o_proj.weight),), linear=True)]
    if tp > 1:
        ops.append(comm("attn.rs", SeqReduceScatter(tp_group, tp), "ao", "ar"))

    def mlp_norm(side, h, a):
        h2 = h + (a if at.o_proj.bias is None else a + at.o_proj.bias)
        return h2, layer.post_attention_layernorm(h2)

    ops.append(comp("mlp.norm", ("h", ar), ("h2", "x2"), mlp_norm))
    return ops


def moe_ops(index: int, layer, ep_groups: ExpertGroups, settings: dict, metrics: MoeMetrics):
    """``moe.router`` .. ``moe.add`` of layer ``index``."""
    block = layer.mlp
    num_experts, top_k, ep = block.num_experts, block.top_k, ep_groups.size
    cf, grouped, base_seed, rank = (settings[k] for k in ("capacity_factor", "grouped_mm", "seed", "rank"))

    def router(side, x2):
        x = x2.reshape(-1, x2.shape[-1])
        noise = seeded_rng(x.device, draw_seed(base_seed, side["serial"], index, rank)) \
            if block.training else contextlib.nullcontext()
        with noise:
            eps = block.input_jitter_noise
            if block.training and eps > 0:  # PhimoeSparseMoeBlock's input jitter (HF: in place)
                x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
            if block.router.training and block.router.input_jitter_noise > 0:
                x = x.clone()  # the HF router jitters its input in place: the experts see it too
            logits, weights, selected = block.router(x)
        xs, route = route_tokens(x, selected, num_experts, cf)
        if ep == 1 or route.padded:
            local_counts(route, ep)
        side["moe"][index] = route
        if not side.get("recomputing"):  # a recomputed layer routes again: count its load once
            metrics.record_route(index, route.counts, route.dropped)
        return xs, weights, aux_piece(logits, top_k)

    def add(side, h2, ys, w):
        return (h2 + combine_copies(ys, w, side["moe"][index]).view(h2.shape),)

    xr, yr = ("xr", "yr") if ep > 1 else ("xs", "ys")
    ops = [comp("moe.router", ("x2",), ("xs", "w", f"aux.{index}"), router)]
    if ep > 1:
        if cf is None:  # dropless: the split sizes travel first, asynchronously
            ops.append(comm("moe.counts", CountExchange(index, ep_groups, metrics), "xs", "xc"))
        ops.append(comm("moe.dispatch", ExpertAllToAll(index, ep_groups, True, metrics),
                        "xs" if cf is not None else "xc", "xr"))
    experts = block.experts
    ops += [comp("moe.experts.up", (xr,), ("xg",),
                 lambda side, x: (run_expert_up(x, side["moe"][index], experts, ep, grouped),), linear=True),
            comp("moe.experts.act", ("xg",), ("xa",), lambda side, g: (expert_act(g, experts.act_fn),),
                 selective=True),
            comp("moe.experts.down", ("xa",), (yr,),
                 lambda side, a: (run_expert_down(a, side["moe"][index], experts, ep, grouped),), linear=True)]
    if ep > 1:
        ops.append(comm("moe.combine", ExpertAllToAll(index, ep_groups, False, metrics), "yr", "ys"))
    ops.append(comp("moe.add", ("h2", "ys", "w"), ("h",), add))
    return ops


def loss_op(config, num_layers: int, coef: float, tp: int, tp_grad_group, metrics: MoeMetrics):
    """``head.loss``: this rank's share of cross-entropy + ``coef`` x HF's load-balancing loss.

    With TP the pieces are summed over the TP group first (the loss is over all tokens of the
    micro-batch) and each TP rank adds 1/t of the aux term, so the shares still sum to the loss."""
    num_experts = config.num_local_experts
    keys = tuple(f"aux.{i}" for i in range(num_layers))

    def reduce(t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce
        return all_reduce(t, group=tp_grad_group)

    def fn(side, logits, *pieces):
        ce = F.cross_entropy(logits.float().flatten(0, 1), side["targets"].flatten(),
                             ignore_index=-100, reduction="sum") / max(side["num_valid"], 1)
        tokens = logits.shape[0] * logits.shape[1]
        aux = load_balancing_loss(pieces, tokens, num_experts, reduce if tp > 1 else None, tp)
        metrics.record_aux(aux)
        return (ce + coef * aux / tp,)

    return comp("head.loss", ("logits",) + keys, ("loss",), fn)


def build_graph(model, tp: int = 1, tp_rank: int = 0, tp_group=None, tp_grad_group=None, *,
                ep_groups: ExpertGroups | None = None, capacity_factor: float | None = None,
                aux_loss_coef: float | None = None, grouped_mm: bool | None = None,
                seed: int | None = None) -> ModelGraph:
    """Shard ``model`` in place for this TP rank and EP rank and return its op graph.

    ``capacity_factor`` None = dropless; ``aux_loss_coef`` None = the config's
    ``router_aux_loss_coef`` (0 when ``output_router_logits`` is off, as in HF); ``grouped_mm``
    None = auto (grouped GEMM on CUDA bf16, else a loop over experts)."""
    config = model.config
    ep_groups = ep_groups or ExpertGroups()
    check_tp(config, tp)
    check_dropout(config, DROPOUT_KEYS, "Phi-MoE")
    check_ep(config, ep_groups.size)
    shard(model, tp, tp_rank, ep_groups)
    inner = model.model
    replicated = None
    if tp > 1:
        replicated = [inner.embed_tokens.weight, inner.norm.weight, inner.norm.bias, model.lm_head.weight,
                      model.lm_head.bias]
        for layer in inner.layers:
            replicated += [layer.input_layernorm.weight, layer.input_layernorm.bias,
                           layer.post_attention_layernorm.weight, layer.post_attention_layernorm.bias,
                           layer.self_attn.o_proj.bias, layer.mlp.router.weight,
                           layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj]
        replicated = mark_replicated(replicated, tp_grad_group)
    if aux_loss_coef is None:
        aux_loss_coef = config.router_aux_loss_coef if config.output_router_logits else 0.0
    num_layers = len(inner.layers)
    metrics = MoeMetrics(num_layers, config.num_local_experts)
    draws = Draws(seed)  # router noise and attention dropout
    settings = {"capacity_factor": capacity_factor, "grouped_mm": grouped_mm, "seed": draws.base, "rank": draws.rank}

    blocks = [[embed_op(inner.embed_tokens)]]
    for i, layer in enumerate(inner.layers):
        blocks.append(attention_ops(i, layer, config, tp, tp_group, draws)
                      + moe_ops(i, layer, ep_groups, settings, metrics))
    blocks.append(head_ops(inner.norm, model.lm_head)[:2]
                  + [loss_op(config, num_layers, aux_loss_coef, tp, tp_grad_group, metrics)])
    meta = {"moe_metrics": metrics, "expert_groups": ep_groups, "capacity_factor": capacity_factor,
            "aux_loss_coef": aux_loss_coef}
    return ModelGraph(blocks, make_side_fn(tp, tp_rank, side_inputs(model)), family="phimoe", meta=meta,
                      replicated=replicated)


def side_inputs(model):
    """Rotary cos/sin (+ eager mask) and the MoE routing slots."""
    config, inner = model.config, model.model

    def extra(batch, side):
        s = side["seq_len"]
        window = getattr(config, "sliding_window", None)
        if window is not None and s > window:
            raise ValueError(f"sequence length {s} exceeds Phi-MoE's sliding_window {window}; the ds_dhelix "
                             f"adapter runs full causal attention: use --seq-len <= {window}")
        dummy = inner.embed_tokens.weight[:1]
        cos, sin = inner.rotary_emb(dummy, side_positions(side, dummy.device))
        return {"cos": cos, "sin": sin, "moe": {},
                **causal_mask_side(config, dummy.dtype, s, dummy.device, side.get("position_ids"))}

    return extra
