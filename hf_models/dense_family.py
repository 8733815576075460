"""One dense decoder layer machinery for Llama and the families built like it (Qwen2/2.5, Qwen3,
Mistral, Gemma 3, Phi-3/Phi-4, SmolLM3, OLMo 3, Qwen3.5): a family is a ``DenseFamily`` (what
differs: fused projections, where the norms sit, q/k norm, residual dropout, logit softcapping,
output-gated attention, Gated DeltaNet layers); everything else is read off the HF modules
themselves (biases, ``scaling``, a layer's ``sliding_window``, its RoPE kind in
``config.layer_types``, NoPE layers' ``use_rope``, which layers are linear attention). An adapter
is then a spec of a few lines: Llama's (``llama.py``) with what differs (``DenseFamily.like``:
``qwen3.py``, ...; Qwen3.5 is Qwen3's). A Gated DeltaNet layer (``deltanet.py``) or an
output-gated attention layer (``gated_attention.py``) has its own op set between ``attn.ag`` and
``attn.rs``; the rest of the layer is the list below.

Layer ops (``s`` sequence, ``t`` TP size; hidden is sequence-first)::

    attn.norm  COMP  h[s/t] -> x          input_layernorm (an identity view for post-norm families)
    attn.ag    COMM  x -> xf[s]           all-gather (sequence)                                t > 1
    attn.qkv   COMP  xf -> q,k,v          q/k/v_proj or qkv_proj (column-parallel)
    attn.core  COMP  q,k,v -> o           q/k norm, rotary, HF attention function (sdpa/eager/flash)
    attn.out   COMP  o -> ao              o_proj (row-parallel, partial sums)
    attn.rs    COMM  ao -> ar[s/t]        reduce-scatter (sequence)                            t > 1
    mlp.norm   COMP  h,ar -> h2,x2        residual add and the norms around it (by placement)
    mlp.ag     COMM  x2 -> x2f[s]                                                              t > 1
    mlp.up     COMP  x2f -> gate,up       gate/up_proj or gate_up_proj (column-parallel)
    mlp.down   COMP  gate,up -> mo        act(gate) * up, down_proj (row-parallel)
    mlp.rs     COMM  mo -> mr[s/t]                                                             t > 1
    mlp.add    COMP  h2,mr -> h           residual add (after the post-MLP norm, by placement)

The q/k norm runs in ``attn.core`` before the rotary embedding (HF's order), so ``attn.qkv`` stays
linear on the way to its weights and reactive SI can defer its weight gradient. Norm placements::

    pre       x = in_ln(h)   h2 = h + attn               x2 = post_attention_ln(h2)   h = h2 + mlp
    post      x = h          h2 = h + post_attn_ln(attn)  x2 = h2                     h = h2 + post_ff_ln(mlp)
    sandwich  x = in_ln(h)   h2 = h + post_attn_ln(attn)  x2 = pre_ff_ln(h2)          h = h2 + post_ff_ln(mlp)

(pre: Llama and most families; post: OLMo; sandwich: Gemma 3.)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ds_dhelix.graph.draws import Draws
from ds_dhelix.graph.model_graph import ModelGraph, comm, comp
from ds_dhelix.runtime.comm import TensorAllReduce
from ds_dhelix.runtime.groups import ContextShards

from . import deltanet, gated_attention
from .common import (
    Dropout,
    attn_core_op,
    check_divisible,
    check_dropout,
    config_window,
    cp_heads,
    dense_layer_ops,
    embed_op,
    head_ops,
    layer_window,
    layer_windows,
    lean_glu,
    make_side_fn,
    mark_replicated,
    qkv_projections,
    residual_ops,
    rotary,
    rotary_key,
    rotary_side_fn,
    shard_kv_replica,
    shard_param,
)
from .lora import project
from .vocab import shard_vocab

NORM_PLACEMENTS = ("pre", "post", "sandwich")


@dataclass(frozen=True)
class DenseFamily:
    """What differs between the dense families this machinery runs."""

    name: str  # "Qwen3", for messages
    family: str  # the graph's family tag
    hf: object  # the transformers modeling module (eager attention, apply_rotary_pos_emb)
    fused_qkv: bool = False  # one qkv_proj with rows [q | k | v] (Phi-3), else q_proj / k_proj / v_proj
    fused_gate_up: bool = False  # one gate_up_proj with rows [gate | up] (Phi-3), else gate_proj / up_proj
    qk_norm: str | None = None  # RMSNorm of q and of k: "head" (over head_dim: Qwen3, Gemma 3) or "full"
    # (over all heads, OLMo: its sum of squares all-reduced over TP)
    norms: str = "pre"  # one of NORM_PLACEMENTS
    resid_dropout: str | None = None  # config key of the dropout on the attention / MLP outputs (Phi-3)
    softcap: str | None = None  # config key of the final logits' tanh softcapping (Gemma 3)
    attention: str = "mha"  # "mha", or "gated": q_proj rows [q | gate] per head, the output x sigmoid(gate)
    # before o_proj (Qwen3.5; ``gated_attention.py``)
    linear_attention: bool = False  # layer_types' "linear_attention" layers are Gated DeltaNets (Qwen3.5;
    # ``deltanet.py``): a layer kind of their own

    def __post_init__(self):
        assert self.norms in NORM_PLACEMENTS and self.qk_norm in (None, "head", "full"), (self.norms, self.qk_norm)
        assert self.attention in ("mha", "gated") and not (self.attention == "gated" and self.fused_qkv)

    def like(self, **changes) -> DenseFamily:
        """A family of this kind: this spec with what differs (its ``name``, ``family``, ``hf`` and
        the fields it changes); everything else is kept."""
        return dataclasses.replace(self, **changes)

    @property
    def dropout_keys(self) -> tuple[str, ...]:
        return ("attention_dropout",) + ((self.resid_dropout,) if self.resid_dropout else ())


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def warn_unused(config, key: str, family: str) -> None:
    """A config setting the installed transformers stores but does not apply (so neither do we):
    warned once, never silently dropped."""
    import warnings

    value = getattr(config, key, None)
    if value:
        warnings.warn(
            f"{family}: {key}={value!r} is not applied (transformers' own {family} model ignores it "
            f"too); training runs without it",
            UserWarning,
            stacklevel=2,
        )


class DenseAdapter:
    """The adapter interface (``hf_models/adapters.py``) of one dense family; ``check(config)``:
    the family's own refusals (``ValueError``), run with the TP checks."""

    CONTEXT_PARALLEL = True

    def __init__(self, family: DenseFamily, check=None):
        self.FAMILY, self.check = family, check
        self.DROPOUT_KEYS = family.dropout_keys
        attn = (
            ("self_attn.qkv_proj",)
            if family.fused_qkv
            else ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        )
        mlp = ("mlp.gate_up_proj",) if family.fused_gate_up else ("mlp.gate_proj", "mlp.up_proj")
        self.LORA_TARGETS = attn + ("self_attn.o_proj",) + mlp + ("mlp.down_proj",)  # modules the ops call

    def check_tp(self, config, tp: int, world: int | None = None) -> None:
        """TP divides the query heads and the MLP width, and divides the kv heads or is a multiple of
        them (each kv head then replicated on TP / kv ranks: not with a fused qkv_proj yet)."""
        check_divisible(
            tp, world, num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size
        )
        kv = kv_heads(config)
        if kv % tp and tp % kv:
            valid = [
                t
                for t in range(1, config.num_attention_heads + 1)
                if config.num_attention_heads % t == 0
                and config.intermediate_size % t == 0
                and (kv % t == 0 or t % kv == 0)
            ]
            raise ValueError(
                f"tensor_parallel.size {tp} with num_key_value_heads={kv}: TP must divide the kv heads or "
                f"be a multiple of them (each kv head replicated on TP / kv ranks); valid TP sizes: {valid}"
            )
        if tp > kv and self.FAMILY.qk_norm == "full":
            raise ValueError(
                f"tensor_parallel.size {tp} > num_key_value_heads={kv} with {self.FAMILY.name}'s k norm "
                f"over all kv heads: replicated kv heads are not supported with it; use a TP size that "
                f"divides {kv}"
            )
        if tp > kv and self.FAMILY.fused_qkv:
            raise ValueError(
                f"tensor_parallel.size {tp} > num_key_value_heads={kv} with {self.FAMILY.name}'s fused "
                f"qkv_proj: replicating kv heads inside a fused projection is not supported yet; use a TP "
                f"size that divides {kv}"
            )
        if self.FAMILY.linear_attention:
            deltanet.check_tp(config, tp, self.FAMILY.name)
        if self.check is not None:
            self.check(config)

    def check_packing(self, config, packing: str) -> None:
        """``ValueError`` for a data packing the family's layers cannot honour (``deltanet.check_packing``)."""
        if self.FAMILY.linear_attention and deltanet.linear_layers(config):
            deltanet.check_packing(packing, self.FAMILY.name)

    def check_cp(self, config, cp: int, comm: str) -> None:
        """Ring attention splits attention into blocks by position; a sliding window would cut
        through them: refused (Ulysses gives each rank whole heads over the whole sequence).
        Gated DeltaNet layers and output-gated attention: refused (not built)."""
        if self.FAMILY.linear_attention and deltanet.linear_layers(config):
            deltanet.check_cp(cp, self.FAMILY.name)
        if cp > 1 and self.FAMILY.attention == "gated":
            raise ValueError(
                f"context_parallel.size {cp} with {self.FAMILY.name}'s output-gated attention is not "
                f"supported yet; use context_parallel.size 1"
            )
        if cp > 1 and self.FAMILY.qk_norm == "full":
            raise ValueError(
                f"context_parallel.size {cp} with {self.FAMILY.name}'s q/k norm over all heads (a "
                f"statistic over every head of a token, which context parallelism splits) is not "
                f"supported yet; use context_parallel.size 1"
            )
        window = config_window(config)
        if cp > 1 and comm == "ring" and window is not None:
            raise ValueError(
                f"context_parallel.comm 'ring' with {self.FAMILY.name}'s sliding-window layers "
                f"(sliding_window={window}) is not supported; use context_parallel.comm 'ulysses'"
            )

    def shard(self, model, tp: int, tp_rank: int) -> None:
        """Cut ``model``'s parameters to this TP rank's shards, in place (see :func:`shard`)."""
        shard(self.FAMILY, model, tp, tp_rank)

    def build_graph(
        self,
        model,
        tp: int = 1,
        tp_rank: int = 0,
        tp_group=None,
        tp_grad_group=None,
        seed: int | None = None,
        cp: ContextShards | None = None,
    ) -> ModelGraph:
        """Shard ``model`` in place for this TP rank and return its op graph; ``seed``: the base
        seed of its dropout masks (None: ``torch.initial_seed()``)."""
        config = model.config
        self.check_tp(config, tp)
        check_dropout(config, self.DROPOUT_KEYS, self.FAMILY.name)
        return build_graph(self.FAMILY, model, tp, tp_rank, tp_group, tp_grad_group, Draws(seed), cp)


# ------------------------------------------------------------------------------------- sharding
def head_rows(config, head_dim: int, tp: int, tp_rank: int) -> torch.Tensor:
    """Rows of a fused ``[q | k | v]`` projection that hold this TP rank's query and kv heads."""
    nq, nk = config.num_attention_heads, kv_heads(config)
    q, k = nq * head_dim // tp, nk * head_dim // tp
    return torch.cat(
        [
            torch.arange(tp_rank * q, (tp_rank + 1) * q),
            nq * head_dim + torch.arange(tp_rank * k, (tp_rank + 1) * k),
            (nq + nk) * head_dim + torch.arange(tp_rank * k, (tp_rank + 1) * k),
        ]
    )


def half_rows(inter: int, tp: int, tp_rank: int) -> torch.Tensor:
    """Rows of a fused ``[gate | up]`` projection that hold this TP rank's part of each half."""
    n = inter // tp
    return torch.cat(
        [torch.arange(tp_rank * n, (tp_rank + 1) * n), inter + torch.arange(tp_rank * n, (tp_rank + 1) * n)]
    )


def shard(family: DenseFamily, model, tp: int, tp_rank: int) -> None:
    """Column-parallel projections by output rows (fused ones by head group / by half), o_proj and
    down_proj by input columns, in place; with fewer kv heads than TP ranks each rank keeps the kv
    head its query heads use (``shard_kv_replica``); a Gated DeltaNet by its heads (``deltanet.shard``)."""
    if tp == 1:
        return
    for layer in model.model.layers:
        if deltanet.is_linear(layer):
            deltanet.shard(layer.linear_attn, tp, tp_rank)
        else:
            shard_attention(family, layer.self_attn, model.config, tp, tp_rank)
        mlp = layer.mlp
        if family.fused_gate_up:
            for name in ("weight", "bias"):
                shard_param(
                    mlp.gate_up_proj, name, 0, tp_rank, tp, index=half_rows(model.config.intermediate_size, tp, tp_rank)
                )
        for lin in [] if family.fused_gate_up else [mlp.gate_proj, mlp.up_proj]:
            shard_param(lin, "weight", 0, tp_rank, tp)
            shard_param(lin, "bias", 0, tp_rank, tp)
        shard_param(mlp.down_proj, "weight", 1, tp_rank, tp)


def shard_attention(family: DenseFamily, at, config, tp: int, tp_rank: int) -> None:
    """An attention module's projections (see ``shard``): q (an output-gated one's rows ``[q | gate]``
    per head go together), k, v by heads, o_proj by input columns."""
    nk = kv_heads(config)
    column = [] if family.fused_qkv else [at.q_proj] + ([at.k_proj, at.v_proj] if nk >= tp else [])
    if not family.fused_qkv and nk < tp:
        for lin in (at.k_proj, at.v_proj):
            for name in ("weight", "bias"):
                shard_kv_replica(lin, name, at.head_dim, nk, tp_rank, tp)
    if family.fused_qkv:
        for name in ("weight", "bias"):
            shard_param(at.qkv_proj, name, 0, tp_rank, tp, index=head_rows(config, at.head_dim, tp, tp_rank))
    for lin in column:
        shard_param(lin, "weight", 0, tp_rank, tp)
        shard_param(lin, "bias", 0, tp_rank, tp)
    if family.qk_norm == "full":  # the norms' weights span every head: cut with the projections
        shard_param(at.q_norm, "weight", 0, tp_rank, tp)
        shard_param(at.k_norm, "weight", 0, tp_rank, tp)
    shard_param(at.o_proj, "weight", 1, tp_rank, tp)


# ---------------------------------------------------------------------------------- layer ops
def qkv_fn(family: DenseFamily, at, config, tp: int):
    """``attn.qkv``: xf [s, b, h] -> q, k, v [b, heads/t, s, d] (projections and views only)."""
    if not family.fused_qkv:
        return qkv_projections(at)
    hd = at.head_dim
    sizes = (config.num_attention_heads * hd // tp, kv_heads(config) * hd // tp, kv_heads(config) * hd // tp)

    def fn(side, xf):
        s, b, _ = xf.shape
        return tuple(p.view(s, b, -1, hd).permute(1, 2, 0, 3) for p in project(at.qkv_proj, xf).split(sizes, dim=-1))

    return fn


def mlp_fns(family: DenseFamily, mlp):
    """``mlp.up`` (the projections) and ``mlp.down`` (activation, gate x up, down_proj; row-parallel)."""
    if family.fused_gate_up:

        def up(side, x):
            return tuple(project(mlp.gate_up_proj, x).chunk(2, dim=-1))
    else:

        def up(side, x):
            return project(mlp.gate_proj, x), project(mlp.up_proj, x)

    act = getattr(mlp, "act_fn", None) or mlp.activation_fn

    def down(side, g, u):
        return (project(mlp.down_proj, lean_glu(act, g, u), bias=False),)

    return up, down


def residual_fn(family: DenseFamily, layer, drop=None):
    """``residual(ar, mr)`` of ``dense_layer_ops`` for the family's norm placement (see
    ``common.residual_ops``); ``drop`` (a ``Dropout``) is the residual dropout on both branches."""
    attn_bias = layer.self_attn.o_proj.bias if hasattr(layer, "self_attn") else None  # (DeltaNet: out_proj has none)
    biases = (attn_bias, layer.mlp.down_proj.bias)
    if family.norms == "pre":
        return residual_ops(*biases, before_mlp=layer.post_attention_layernorm, drop=drop)
    before_mlp = layer.pre_feedforward_layernorm if family.norms == "sandwich" else None
    return residual_ops(
        *biases,
        after_attn=layer.post_attention_layernorm,
        before_mlp=before_mlp,
        after_mlp=layer.post_feedforward_layernorm,
        drop=drop,
    )


def token_mixer(family: DenseFamily, index: int, layer, config, tp: int, draws: Draws, rotary_emb) -> dict:
    """The token mixer of layer ``index`` as ``dense_layer_ops`` keywords: ``mixer`` (a Gated DeltaNet,
    ``deltanet.mixer_ops``; output-gated attention, ``gated_attention.mixer_ops``) or attention's
    ``qkv`` / ``attn_core`` / ``attn_out``."""
    if deltanet.is_linear(layer):
        return {"mixer": lambda xin: deltanet.mixer_ops(layer.linear_attn, family.hf, tp, xin)}
    at = layer.self_attn
    qk_norm = (at.q_norm, at.k_norm) if family.qk_norm == "head" else None
    apply = family.hf.apply_rotary_pos_emb if getattr(at, "use_rope", True) else None
    core = attn_core_op(
        at,
        config,
        family.hf.eager_attention_forward,
        drop=Dropout.make(draws, config.attention_dropout, index, at),
        window=layer_window(at, config),
        rotary=rotary(apply, rotary_key(rotary_emb, config, index), qk_norm),
    )
    if family.attention == "gated":
        return {"mixer": lambda xin: gated_attention.mixer_ops(at, xin, core)}
    return {
        "qkv": qkv_fn(family, at, config, tp),
        "attn_core": core,
        "attn_out": lambda side, o: (project(at.o_proj, o, bias=False),),
    }


def layer_ops(family: DenseFamily, index: int, layer, config, tp: int, tp_group, draws: Draws, rotary_emb, cp=None):
    norm = (
        (lambda side, h: (h.view_as(h),)) if family.norms == "post" else (lambda side, h: (layer.input_layernorm(h),))
    )
    up, down = mlp_fns(family, layer.mlp)
    resid = family.resid_dropout and getattr(config, family.resid_dropout, 0.0)
    ops = dense_layer_ops(
        tp,
        tp_group,
        cp=cp,
        heads=cp_heads(config, tp),
        attn_norm=norm,
        **token_mixer(family, index, layer, config, tp, draws, rotary_emb),
        residual=residual_fn(family, layer, Dropout.make(draws, resid, index, layer) if resid else None),
        mlp_up=up,
        mlp_down=down,
        mlp_hidden=("gate", "up"),
    )
    return full_qk_norm(ops, layer.self_attn, config, tp, tp_group) if family.qk_norm == "full" else ops


def full_qk_norm(ops: list, at, config, tp: int, tp_group) -> list:
    """The attention of ``ops`` with an RMSNorm of q and of k over all heads of a token (OLMo's
    ``q_norm`` / ``k_norm`` on the whole projection, before RoPE). Each TP rank holds some heads, so
    the per-token sums of squares are summed over the TP group first::

        attn.qk_ss   COMP  q,k -> ss        this rank's heads' sums of squares per token   t > 1
        attn.qk_ar   COMM  ss -> ssf        all-reduce (sum) over TP                       t > 1
        attn.core    COMP  q,k,v,ssf -> o   x * rsqrt(ss / (heads x head_dim) + eps) * w, then as before
    """
    sizes = (config.num_attention_heads * at.head_dim, kv_heads(config) * at.head_dim)
    norms = (at.q_norm, at.k_norm)

    def sums(q, k):
        return torch.stack([t.float().pow(2).sum(dim=(1, 3)) for t in (q, k)])  # [2, b, s]

    def normed(x, ss, i):
        var = (ss / sizes[i])[:, None, :, None]
        h = x.float() * torch.rsqrt(var + norms[i].variance_epsilon)
        return (norms[i].weight.view(1, -1, 1, x.shape[-1]) * h).to(x.dtype)

    i = next(n for n, op in enumerate(ops) if op.name == "attn.core")
    core = ops[i]
    if tp == 1:

        def attend(side, q, k, v):
            ss = sums(q, k)
            return core.fn(side, normed(q, ss[0], 0), normed(k, ss[1], 1), v)

        return ops[:i] + [comp("attn.core", ("q", "k", "v"), core.outputs, attend, selective=True)] + ops[i + 1 :]

    def attend_sharded(side, q, k, v, ss):
        return core.fn(side, normed(q, ss[0], 0), normed(k, ss[1], 1), v)

    return (
        ops[:i]
        + [
            comp("attn.qk_ss", ("q", "k"), ("ss",), lambda side, q, k: (sums(q, k),)),
            comm("attn.qk_ar", TensorAllReduce(tp_group, tp), "ss", "ssf"),
            comp("attn.core", ("q", "k", "v", "ssf"), core.outputs, attend_sharded, selective=True),
        ]
        + ops[i + 1 :]
    )


def build_graph(
    family: DenseFamily,
    model,
    tp: int,
    tp_rank: int,
    tp_group,
    tp_grad_group,
    draws: Draws,
    cp: ContextShards | None = None,
) -> ModelGraph:
    config = model.config
    shard(family, model, tp, tp_rank)
    inner = model.model
    vocab = shard_vocab(inner.embed_tokens, model.lm_head, tp, tp_rank, tp_group)
    replicated = None
    if tp > 1:  # every parameter TP does not cut (norms, row-parallel biases) sees a sequence
        # shard; a replicated kv head's copies see their own query heads
        replicated = mark_replicated(
            [
                p
                for p in model.parameters()
                if not getattr(p, "tensor_model_parallel", False) or hasattr(p, "tp_replica_slot")
            ],
            tp_grad_group,
        )
    blocks = [embed_op(inner.embed_tokens, vocab=vocab)]
    blocks += [
        layer_ops(family, i, layer, config, tp, tp_group, draws, inner.rotary_emb, cp)
        for i, layer in enumerate(inner.layers)
    ]
    cap = getattr(config, family.softcap, None) if family.softcap else None
    head = functools.partial(head_ops, inner.norm, model.lm_head, softcap=cap, vocab=vocab)
    blocks.append(head())
    side = rotary_side_fn(inner.rotary_emb, inner.embed_tokens, config, layer_windows(model))
    if family.linear_attention and deltanet.linear_layers(config):
        side = deltanet.no_documents(side, family.name)
    side = make_side_fn(tp, tp_rank, side, cp)
    return ModelGraph(blocks, side, family=family.family, meta={"head": head}, replicated=replicated)
