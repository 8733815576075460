"""Gated DeltaNet linear attention (Qwen3.5, Qwen3.5-MoE: ``config.layer_types`` "linear_attention")
as an op set of the shared machinery: the dense family spec (``DenseFamily(linear_attention=True)``)
and ``MoeFamily`` put these ops where a full-attention layer has its attention ops, so a linear
layer and a full one are two layer kinds of the same op graph (``ModelGraph.layer_kinds``).

HF's ``*GatedDeltaNet`` module, as ops (``t`` TP size; ``nk`` / ``nv`` this rank's key / value
heads, ``dk`` / ``dv`` their widths; hidden is sequence-first)::

    attn.norm  COMP  h[s/t] -> x             input_layernorm
    attn.ag    COMM  x -> xf[s]              all-gather (sequence)                                t > 1
    attn.qkv   COMP  xf -> mixed,z,b,a       in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (column-parallel)
    attn.conv  COMP  mixed -> q,k,v          causal depthwise conv1d + its activation over the whole
                                             sequence (HF's causal_conv1d_fn), cut into heads
    attn.core  COMP  q,k,v,a,b,z -> o        beta = sigmoid(b), decay g = -exp(A_log) softplus(a + dt_bias);
                                             HF's chunked gated delta rule (its fast kernel where installed,
                                             the torch fallback otherwise); the gated RMSNorm with z
    attn.out   COMP  o -> ao                 out_proj (row-parallel, partial sums)
    attn.rs    COMM  ao -> ar[s/t]           reduce-scatter (sequence)                            t > 1

The conv and the delta rule run along the sequence, so they sit between ``attn.ag`` and
``attn.rs``, on the whole sequence of this rank's heads, as attention's core does. TP cuts the key
heads (``linear_num_key_heads``) and, with them, the value heads each key head serves (the
``linear_num_value_heads / linear_num_key_heads`` consecutive ones): the q / k / v rows of
``in_proj_qkv`` and the conv channels by those heads, ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a``, ``A_log`` and ``dt_bias`` by value head, ``out_proj`` by input columns. The gated
RMSNorm's weight (one per value-head channel, shared by every head) stays whole; each rank's
gradient of it is its heads' share, summed over TP like every replicated weight.

Not built: packed documents (the recurrence would have to restart at each document: transformers'
torch fallback refuses ``cu_seqlens``, so there is no reference to train against on CPU) and
context parallelism (a state-passing scheme between CP ranks): both refused before any model is
built (``check_packing``, ``check_cp``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds_dhelix.graph.model_graph import comp

from .common import check_divisible, lean, shard_param
from .lora import project

KIND = "linear_attention"  # the layer kind's name in config.layer_types


def is_linear(layer) -> bool:
    """A decoder layer whose token mixer is a Gated DeltaNet (``layer.linear_attn``)."""
    return hasattr(layer, "linear_attn")


def linear_layers(config) -> list[int]:
    """The layers of ``config`` that are linear attention (``config.layer_types``)."""
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind == KIND]


def check_tp(config, tp: int, name: str) -> None:
    """``ValueError`` unless ``tp`` divides the linear layers' key heads (each value head goes with
    its key head) and the value heads are a multiple of the key heads (HF's grouping)."""
    if not linear_layers(config):
        return
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    if nv % nk:
        raise ValueError(
            f"{name}: linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk} "
            f"(each key head serves nv / nk value heads); use a multiple"
        )
    check_divisible(tp, None, linear_num_key_heads=nk)


def check_cp(cp: int, name: str) -> None:
    if cp > 1:
        raise ValueError(
            f"context_parallel.size {cp} with {name}'s Gated DeltaNet layers (layer_types "
            f"'linear_attention': a recurrence along the whole sequence, which context parallelism "
            f"would cut; passing its state between CP ranks is not built): use context_parallel.size 1"
        )


def check_packing(packing: str, name: str) -> None:
    if packing == "docs":
        raise ValueError(
            f"--packing docs with {name}'s Gated DeltaNet layers: their recurrence would have to "
            f"restart at every document, which transformers' own model does only with the "
            f"flash-linear-attention kernels (its torch fallback refuses cu_seqlens), so it is not "
            f"built; use --packing concat (or none: right padding)"
        )


def qkv_rows(la, tp: int, tp_rank: int) -> torch.Tensor:
    """Rows of ``in_proj_qkv`` (and conv channels) of this TP rank: its key heads' q and k rows,
    its value heads' v rows."""
    kd, vd = la.key_dim, la.value_dim
    k, v = kd // tp, vd // tp
    return torch.cat(
        [
            torch.arange(tp_rank * k, (tp_rank + 1) * k),
            kd + torch.arange(tp_rank * k, (tp_rank + 1) * k),
            2 * kd + torch.arange(tp_rank * v, (tp_rank + 1) * v),
        ]
    )


def shard(la, tp: int, tp_rank: int) -> None:
    """Cut a GatedDeltaNet module ``la`` to this TP rank's heads, in place (see the module docstring)."""
    if tp == 1:
        return
    rows = qkv_rows(la, tp, tp_rank)
    shard_param(la.in_proj_qkv, "weight", 0, tp_rank, tp, index=rows)
    shard_param(la.conv1d, "weight", 0, tp_rank, tp, index=rows)
    shard_param(la.conv1d, "bias", 0, tp_rank, tp, index=rows)
    for lin in (la.in_proj_z, la.in_proj_b, la.in_proj_a):
        shard_param(lin, "weight", 0, tp_rank, tp)
    shard_param(la, "A_log", 0, tp_rank, tp)
    shard_param(la, "dt_bias", 0, tp_rank, tp)
    shard_param(la.out_proj, "weight", 1, tp_rank, tp)


def mixer_ops(la, hf, tp: int, xin: str) -> list:
    """``attn.qkv`` .. ``attn.out`` of a GatedDeltaNet ``la`` (sharded for ``tp``), reading ``xin``
    ([s, b, h], the whole sequence) and writing ``ao`` (row-parallel partial sums); ``hf``: the
    family's transformers modeling module (its conv and delta-rule functions)."""
    dk, dv = la.head_k_dim, la.head_v_dim
    kd, vd = la.key_dim // tp, la.value_dim // tp
    fla = fla_installed()

    def project_in(side, xf):
        return la.in_proj_qkv(xf), la.in_proj_z(xf), la.in_proj_b(xf), la.in_proj_a(xf)

    def conv(side, mixed):  # [s, b, 2kd + vd] -> q, k [b, s, nk, dk], v [b, s, nv, dv]
        out = hf.causal_conv1d_fn(
            mixed.permute(1, 2, 0), la.conv1d.weight.squeeze(1), la.conv1d.bias, activation=la.activation
        ).transpose(1, 2)
        b, s = out.shape[:2]
        q, k, v = out.split([kd, kd, vd], dim=-1)
        return q.reshape(b, s, -1, dk), k.reshape(b, s, -1, dk), v.reshape(b, s, -1, dv)

    def delta_rule(q, k, v, g, beta):
        return hf.torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True
        )[0]

    def core(side, q, k, v, a, beta_in, z):
        beta = beta_in.transpose(0, 1).sigmoid()  # [b, s, nv]
        g = -la.A_log.float().exp() * F.softplus(a.transpose(0, 1).float() + la.dt_bias)
        o = delta_rule(q, k, v, g, beta) if fla and q.is_cuda else lean(delta_rule, q, k, v, g, beta)
        b, s = o.shape[:2]
        gate = z.transpose(0, 1).reshape(-1, dv)
        o = la.norm(o.reshape(-1, dv), gate).view(b, s, -1)
        return (o.transpose(0, 1),)  # [s, b, nv * dv]

    return [
        comp("attn.qkv", (xin,), ("mixed", "z", "b", "a"), project_in, linear=True),
        comp("attn.conv", ("mixed",), ("q", "k", "v"), conv, selective=True),
        comp("attn.core", ("q", "k", "v", "a", "b", "z"), ("o",), core, selective=True),
        comp("attn.out", ("o",), ("ao",), lambda side, o: (project(la.out_proj, o, bias=False),), linear=True),
    ]


def fla_installed() -> bool:
    """Whether flash-linear-attention is installed: transformers' chunked delta rule then runs its
    kernel on CUDA inputs, which keeps only its inputs for backward by itself. The torch fallback
    (CPU, or without the package) keeps every intermediate of its chunk loop (~6x a full-attention
    core's bytes at the presets' sizes), so ``attn.core`` then runs it through ``common.lean``: only
    q, k, v, g, beta are kept and backward runs the same fallback again (the same kernels on the
    same inputs: the gradients are bitwise plain autograd's)."""
    import importlib.util

    return importlib.util.find_spec("fla") is not None


def no_documents(extra, name: str):
    """``extra`` of ``make_side_fn`` that first refuses packed documents (``position_ids``): the
    last guard of ``check_packing``, for batches built elsewhere (a Trainer's collator)."""

    def fn(batch: dict, side: dict) -> dict:
        if side.get("position_ids") is not None:
            check_packing("docs", name)
        return extra(batch, side)

    return fn
