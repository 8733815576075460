"""One MoE decoder layer machinery for every HF MoE family whose experts are fused tensors
(``ExpertLayout``: ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, or gpt-oss's transposed,
biased, interleaved ones) behind a router returning ``(logits, top-k weights, top-k experts)``:
Phi-MoE (sparsemixer), Mixtral (softmax top-k, renormalised), Qwen3-MoE and OLMoE (softmax top-k,
renormalised when ``norm_topk_prob``; RMSNorm of q and k per head or over the whole projection),
Qwen2-MoE (a sigmoid-gated shared expert), DeepSeek-V3 and GLM-4.5 (group-limited sigmoid routing,
ungated shared experts; DeepSeek's multi-head latent attention, ``mla.py``), gpt-oss (softmax
after top-k of a biased router, attention sinks, sliding layers), Qwen3.5-MoE (Gated DeltaNet
layers, ``deltanet.py``, among output-gated attention layers, ``gated_attention.py``; a gated
shared expert). A family is a ``MoeFamily``:
its attention op set, router function, shared expert, expert layout, where its router and jitter
live, its expert keys, how its files store the experts. The adapters (``phimoe.py``,
``deepseek_v3.py``, ...) are that description plus their checks; a family of a known kind is its
base's spec with what differs (``MoeFamily.like``: Phi-MoE of Mixtral; Qwen2-MoE, OLMoE, Qwen3.5-MoE
and DeepSeek-V3 of Qwen3-MoE; GLM-4.5 of DeepSeek-V3).

Layer ops (``s`` sequence, ``t`` TP size, ``N`` tokens of this rank, hidden sequence-first)::

    attn.norm     COMP  h[s/t] -> x               input_layernorm
    attn.ag       COMM  x -> xf[s]                all-gather (sequence)           t > 1
    attn.qkv      COMP  xf -> q,k,v               q/k/v_proj (column-parallel); MLA: ``mla.qkv_fn``
    attn.core     COMP  q,k,v -> o                rotary + HF attention function (sdpa/eager; sinks, windows)
    attn.out      COMP  o -> ao                   o_proj (row-parallel, partial sums)
    attn.rs       COMM  ao -> ar[s/t]             reduce-scatter (sequence)       t > 1
    mlp.norm      COMP  h,ar -> h2,x2             residual add + post_attention_layernorm
    moe.router    COMP  x2 -> xs,w[,aux.<i>]      the family's router; copies sorted by expert
    moe.counts    COMM  xs -> xc                  rows per (rank, expert), async    ep > 1, dropless
    moe.dispatch  COMM  xs|xc -> xr               all-to-all to the experts' EP ranks  ep > 1
    moe.shared    COMP  x2 -> ysh                 the shared expert(s)      Qwen2-MoE, DeepSeek-V3, GLM-4.5
    moe.experts.up    COMP  xr -> xg              regroup rows by expert; gate/up projections
    moe.experts.act   COMP  xg -> xa              act(gate) x up (gpt-oss: the clamped SwiGLU)
    moe.experts.down  COMP  xa -> yr              down projection; rows back in received order
    moe.combine   COMM  yr -> ys                  all-to-all back                      ep > 1
    moe.add       COMP  h2,ys,w[,ysh] -> h        weighted sum of each token's copies (+ shared) + residual

A dense layer among them (``dense_layers``: ``first_k_dense_replace``, ``mlp_only_layers``,
``decoder_sparse_step``) has ``mlp.up``, ``mlp.down``, ``mlp.add`` after ``mlp.norm`` instead
(``dense_mlp_ops``): a layer kind of its own.

Each TP rank routes its own sequence shard; EP groups are DP peers with the same TP rank. The
router's per-layer load-balancing pieces (``aux.<i>``, MoE layers only) flow to ``head.loss``,
which adds HF's ``router_aux_loss_coef x load_balancing_loss``, so its gradient reaches every
router through the ordinary backward of the op graph, under SI as well (families whose HF model has
no such loss emit none). HF state_dict keys never change: expert shards keep their names and are
gathered back to ``[E, ...]`` by global expert id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_dhelix.graph.draws import Draws, draw_seed, seeded_rng
from ds_dhelix.graph.model_graph import ModelGraph, comm, comp
from ds_dhelix.graph.objectives import sum_over_ranks
from ds_dhelix.moe.dispatch import CountExchange, ExpertAllToAll
from ds_dhelix.moe.experts import (
    DEFAULT_LAYOUT,
    ExpertLayout,
    layout_act,
    run_expert_down,
    run_expert_up,
    shard_experts,
    use_grouped_mm,
)
from ds_dhelix.moe.kernels import make_kernels
from ds_dhelix.moe.metrics import MoeMetrics
from ds_dhelix.moe.router import (
    aux_piece,
    grouped_sigmoid_topk,
    load_balancing_loss,
    local_counts,
    route_tokens,
    softmax_after_topk,
)
from ds_dhelix.runtime.comm import HostCopies, SeqAllGather, SeqReduceScatter
from ds_dhelix.runtime.groups import ExpertGroups

from . import deltanet, gated_attention, mla
from .common import (
    ContextShards,
    CrossEntropy,
    Dropout,
    attn_core_op,
    causal_mask_side,
    check_divisible,
    check_dropout,
    context_attention,
    cp_heads,
    embed_op,
    head_ops,
    layer_window,
    layer_windows,
    lean_glu,
    make_side_fn,
    mark_replicated,
    qkv_projections,
    rotary,
    rotary_side_fn,
    shard_param,
    side_positions,
)
from .lora import project
from .vocab import shard_vocab


@dataclass(frozen=True)
class MoeFamily:
    """What differs between the MoE families this machinery runs."""

    name: str  # "Phi-MoE", for messages
    family: str  # the graph's family tag
    hf: object  # the transformers modeling module (eager attention, rotary)
    router: str  # the router's attribute on the sparse block ("router", "gate")
    block_jitter: str | None  # the block's input-jitter attribute ("input_jitter_noise", "jitter_noise")
    experts_key: str  # the config key of the expert count
    files_block: str  # the block's name in the files save_pretrained writes
    files_router: str  # the router's name there
    files_experts: tuple | None  # (gate, up, down) names of one expert there; None: the fused tensors' own names
    inter_key: str = "intermediate_size"  # the config key of one expert's hidden size
    shared_expert: str | None = None  # "gated": shared_expert x sigmoid(shared_expert_gate(x)) (Qwen2-MoE);
    # "plain": shared_experts(x), an MLP of n_shared_experts x the expert width
    qk_norm: str | None = (
        None  # RMSNorm of q and k: "head" (over head_dim, Qwen3) or "full" (the whole projection, OLMoE)
    )
    noise_keys: tuple = ()  # config keys of the router's random draws while training (jitter; 0 = off)
    attention: str = "mha"  # "mha" (q/k/v projections), "mla" (multi-head latent attention, ``mla.py``) or "gated"
    # (q_proj rows [q | gate] per head, output x sigmoid(gate): ``gated_attention.py``)
    linear_attention: bool = False  # layer_types' "linear_attention" layers are Gated DeltaNets (``deltanet.py``)
    route: object = None  # (gate, x) -> (logits, top-k weights, top-k experts); None: the HF router module's own
    aux_loss: bool = True  # HF trains the load-balancing loss (router_aux_loss_coef) for this family
    layout: ExpertLayout = DEFAULT_LAYOUT  # how the fused expert tensors hold an expert (``ExpertLayout``)
    sinks: bool = False  # attention sinks: a learned logit per head (gpt-oss; eager attention)
    sliding: bool = False  # per-layer sliding windows (``config.layer_types``; the module's ``sliding_window``)

    def like(self, **changes) -> MoeFamily:
        """A family of this kind: this spec with what differs (its ``name``, ``family``, ``hf`` and
        the fields it changes); everything else, functions such as ``route`` included, is kept."""
        return dataclasses.replace(self, **changes)

    def num_experts(self, config) -> int:
        return getattr(config, self.experts_key)


def check_tp(config, tp: int, world: int | None = None) -> None:
    check_divisible(
        tp, world, num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads
    )


class MoeAdapter:
    """The adapter interface (``hf_models/adapters.py``) of one MoE family: its ``MoeFamily`` and
    ``check_moe(config)`` (the routing settings it cannot run, as ``ValueError``); ``max_tp``: the
    largest TP size its attention allows (None: any that divides the heads), with the reason."""

    DROPOUT_KEYS = ("attention_dropout",)
    CONTEXT_PARALLEL = True

    def __init__(self, family: MoeFamily, check_moe, max_tp: tuple[int, str] | None = None):
        self.FAMILY, self.check_moe, self.max_tp = family, check_moe, max_tp
        # the attention projections the op graph calls (not the experts: fused tensors, no modules)
        self.LORA_TARGETS = (
            MLA_LORA_TARGETS
            if family.attention == "mla"
            else ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        )

    def check_cp(self, config, cp: int, comm: str) -> None:
        """Context parallelism the family's attention cannot take, refused in one line."""
        f = self.FAMILY
        if f.linear_attention and deltanet.linear_layers(config):
            deltanet.check_cp(cp, f.name)
        if cp > 1 and f.attention == "gated":
            raise ValueError(
                f"context_parallel.size {cp} with {f.name}'s output-gated attention is not supported "
                f"yet; use context_parallel.size 1"
            )
        if cp > 1 and f.sinks:
            raise ValueError(
                f"context_parallel.size {cp} with {f.name}'s attention sinks (eager attention with a "
                f"sink logit per head) is not supported yet; use context_parallel.size 1"
            )
        if cp > 1 and comm == "ring" and f.attention == "mla":
            raise ValueError(
                f"context_parallel.comm 'ring' with {f.name}'s multi-head latent attention (q/k and v "
                f"of other widths) is not supported; use context_parallel.comm 'ulysses'"
            )

    def check_aux(self, coef: float | None) -> None:
        """``ValueError`` for a load-balancing loss weight on a family whose HF model trains none."""
        if coef and not self.FAMILY.aux_loss:
            raise ValueError(
                f"dhelix.expert_parallel.aux_loss_coef {coef} with {self.FAMILY.name}: its HF model has no "
                f"load-balancing loss (the router balances through e_score_correction_bias); remove "
                f"the key or set it to 0"
            )

    @property
    def NOISE_KEYS(self) -> tuple[str, ...]:
        """Config keys of the family's router noise (``MoeFamily.noise_keys``)."""
        return self.FAMILY.noise_keys

    def check_tp(self, config, tp: int, world: int | None = None) -> None:
        if self.max_tp is not None and tp > self.max_tp[0]:
            raise ValueError(f"tensor_parallel.size {tp} with {self.FAMILY.name}: {self.max_tp[1]}")
        check_tp(config, tp, world)
        if self.FAMILY.linear_attention:
            deltanet.check_tp(config, tp, self.FAMILY.name)
        self.check_moe(config)

    def check_packing(self, config, packing: str) -> None:
        """``ValueError`` for a data packing the family's layers cannot honour (``deltanet.check_packing``)."""
        if self.FAMILY.linear_attention and deltanet.linear_layers(config):
            deltanet.check_packing(packing, self.FAMILY.name)

    def check_ep(self, config, ep: int, dp_size: int | None = None) -> None:
        """``ValueError`` unless ``ep`` divides the experts (and the DP size), listing valid sizes."""
        from ds_dhelix.moe.experts import check_ep as check_sizes

        self.check_moe(config)
        f = self.FAMILY
        check_sizes(f.num_experts(config), config.num_experts_per_tok, ep, dp_size, key=f.experts_key)

    def checkpoint_source(self, name: str, config):
        return checkpoint_source(self.FAMILY, name, config)

    def shard(self, model, tp: int, tp_rank: int, ep_groups) -> None:
        shard(model, tp, tp_rank, ep_groups)

    def build_graph(self, model, tp: int = 1, tp_rank: int = 0, tp_group=None, tp_grad_group=None, **options):
        """Shard ``model`` in place for this TP and EP rank and return its op graph (options: see
        :func:`build_graph`)."""
        return build_graph(self.FAMILY, model, tp, tp_rank, tp_group, tp_grad_group, check_ep=self.check_ep, **options)


def grouped_sigmoid_route(gate, x):
    """``MoeFamily.route`` of DeepSeek-V3 and GLM-4.5 (``moe.router.grouped_sigmoid_topk``): fp32
    logits of the router weight, ``e_score_correction_bias`` for the choice only."""
    logits = F.linear(x.float(), gate.weight.float())
    weights, experts = grouped_sigmoid_topk(
        logits,
        gate.top_k,
        gate.e_score_correction_bias,
        gate.num_group,
        gate.topk_group,
        gate.norm_topk_prob,
        gate.routed_scaling_factor,
    )
    return logits, weights, experts


def biased_softmax_route(gate, x):
    """``MoeFamily.route`` of gpt-oss (``moe.router.softmax_after_topk``): a linear router with a bias."""
    logits = F.linear(x, gate.weight, gate.bias)
    weights, experts = softmax_after_topk(logits, gate.top_k)
    return logits, weights, experts


def check_groups(config, name: str) -> None:
    """``ValueError`` for group-limited routing settings HF's router cannot run."""
    num, k = config.n_routed_experts, config.num_experts_per_tok
    groups, keep = config.n_group, config.topk_group
    if groups < 1 or num % groups:
        raise ValueError(f"{name}: n_group {groups} must divide n_routed_experts {num}")
    if groups > 1 and num // groups < 2:
        raise ValueError(
            f"{name}: n_group {groups} leaves {num // groups} expert per group; a group scores its two "
            f"best experts: use n_group <= {num // 2}"
        )
    if not 1 <= keep <= groups:
        raise ValueError(f"{name}: topk_group {keep} must lie in 1..n_group {groups}")
    if not 1 <= k <= keep * (num // groups):
        raise ValueError(
            f"{name}: num_experts_per_tok {k} with topk_group {keep} of n_group {groups}: a token picks "
            f"among {keep * (num // groups)} experts; use 1..{keep * (num // groups)}"
        )


MLA_LORA_TARGETS = (
    "self_attn.q_proj",
    "self_attn.q_a_proj",
    "self_attn.q_b_proj",
    "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_b_proj",
    "self_attn.o_proj",
)


def check_top_k(config, key: str) -> None:
    """``ValueError`` unless a token goes to between 1 and all of the ``key`` experts."""
    num, top_k = getattr(config, key), config.num_experts_per_tok
    if not 1 <= top_k <= num:
        raise ValueError(f"num_experts_per_tok {top_k} with {key} {num}: a token goes to between 1 and {num} experts")


def dense_layers(config) -> list[int]:
    """The decoder layers of ``config`` that are dense MLPs, by the rule of its HF model: the first
    ``first_k_dense_replace`` (DeepSeek, GLM-4.5); Qwen-MoE's ``mlp_only_layers`` and every layer
    ``i`` with ``(i + 1) % decoder_sparse_step != 0``."""
    n = config.num_hidden_layers
    first = getattr(config, "first_k_dense_replace", None)
    if first is not None:
        return list(range(min(first, n)))
    only = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [i for i in range(n) if i in only or (i + 1) % step != 0]


def check_layers(config, name: str) -> None:
    """``ValueError`` for layer settings that leave no MoE layer or name layers that do not exist."""
    n = config.num_hidden_layers
    bad = sorted(i for i in (getattr(config, "mlp_only_layers", None) or []) if not 0 <= i < n)
    if bad:
        raise ValueError(f"{name}: mlp_only_layers {bad} are not layers of this model (0..{n - 1})")
    step = getattr(config, "decoder_sparse_step", 1)
    if step is not None and step < 1:
        raise ValueError(f"{name}: decoder_sparse_step {step} must be >= 1")
    if len(dense_layers(config)) == n:
        raise ValueError(
            f"{name}: every one of its {n} layers is dense (first_k_dense_replace / mlp_only_layers / "
            f"decoder_sparse_step), so the model has no experts; train it as a dense model or keep "
            f"some MoE layers"
        )


def is_sparse(layer) -> bool:
    """A decoder layer whose ``mlp`` is an MoE block (its experts), not a dense MLP."""
    return hasattr(layer.mlp, "experts")


def checkpoint_source(family: MoeFamily, name: str, config):
    """Where ``name`` lives in the files ``save_pretrained`` writes for ``family``: the router under
    its file name; expert ``e``'s gate and up rows make ``gate_up_proj[e]``, its down projection
    ``down_proj[e]`` (None: the name itself)."""
    from .loading import Joined, Key

    head, sep, leaf = name.partition(".mlp.")
    if not sep or family.files_experts is None:
        return None
    block = f"{head}.{family.files_block}"
    n, inter = family.num_experts(config), getattr(config, family.inter_key)
    gate, up, down = family.files_experts
    if leaf == f"{family.router}.weight":
        return Key(f"{block}.{family.files_router}.weight")
    if leaf == "experts.gate_up_proj":
        return Joined(
            0,
            tuple(
                Joined(
                    0,
                    (Key(f"{block}.experts.{e}.{gate}.weight"), Key(f"{block}.experts.{e}.{up}.weight")),
                    sizes=(inter, inter),
                )
                for e in range(n)
            ),
            stack=True,
        )
    if leaf == "experts.down_proj":
        return Joined(0, tuple(Key(f"{block}.experts.{e}.{down}.weight") for e in range(n)), stack=True)
    return Key(f"{block}.{leaf}")


def shard(model, tp: int, tp_rank: int, ep_groups: ExpertGroups) -> None:
    """TP: q/k/v by output rows (MLA: its head-wise projections, ``mla.shard``), attention sinks by
    head, o_proj by input columns; a Gated DeltaNet by its heads (``deltanet.shard``). EP: keep this
    rank's experts (MoE layers only: a dense layer's MLP stays whole on every rank)."""
    for layer in model.model.layers:
        if deltanet.is_linear(layer):
            deltanet.shard(layer.linear_attn, tp, tp_rank)
        else:
            shard_attention(layer.self_attn, tp, tp_rank)
        if is_sparse(layer):
            shard_experts(layer.mlp.experts, ep_groups)


def shard_attention(at, tp: int, tp_rank: int) -> None:
    """One attention module's TP shards (see ``shard``)."""
    if mla.is_mla(at):
        mla.shard(at, tp, tp_rank)
    else:
        for lin in (at.q_proj, at.k_proj, at.v_proj):
            shard_param(lin, "weight", 0, tp_rank, tp)
            shard_param(lin, "bias", 0, tp_rank, tp)
        shard_param(at.o_proj, "weight", 1, tp_rank, tp)
    if hasattr(at, "sinks"):
        shard_param(at, "sinks", 0, tp_rank, tp)


def qkv_op(at, qk_norm: str | None):
    """``attn.qkv``: the projections, then the family's RMSNorm of q and k (HF's order)."""
    if qk_norm is None:
        return qkv_projections(at)
    if qk_norm == "head":  # per head: the projections' views normalised over head_dim
        project = qkv_projections(at)

        def fn(side, xf):
            q, k, v = project(side, xf)
            return at.q_norm(q), at.k_norm(k), v

        return fn
    hd = at.head_dim

    def full(side, xf):  # over the whole projection (every head at once; TP = 1)
        s, b, _ = xf.shape
        q, k, v = at.q_norm(at.q_proj(xf)), at.k_norm(at.k_proj(xf)), at.v_proj(xf)
        return tuple(t.view(s, b, -1, hd).permute(1, 2, 0, 3) for t in (q, k, v))

    return full


def mixer_ops(index: int, layer, config, tp: int, draws, family: MoeFamily, xin: str, cp=None) -> list:
    """The token mixer of layer ``index``, reading ``xin`` and writing ``ao``: a Gated DeltaNet
    (``deltanet.mixer_ops``), output-gated attention (``gated_attention.mixer_ops``, q/k norm and
    rotary in ``attn.core``), or MHA / MLA through ``context_attention``."""
    if deltanet.is_linear(layer):
        return deltanet.mixer_ops(layer.linear_attn, family.hf, tp, xin)
    at, hf = layer.self_attn, family.hf
    drop = Dropout.make(draws, config.attention_dropout, index, at)
    window = layer_window(at, config) if family.sliding else None
    if family.attention == "gated":
        norms = (at.q_norm, at.k_norm) if hasattr(at, "q_norm") else None
        core = attn_core_op(
            at,
            config,
            hf.eager_attention_forward,
            rotary=rotary(hf.apply_rotary_pos_emb, None, norms),
            drop=drop,
            window=window,
        )
        return gated_attention.mixer_ops(at, xin, core)
    if family.attention == "mla":  # the latent projections and their norms: not linear on the way to q_b/kv_b
        qkv, rope, widths = (
            comp("attn.qkv", (xin,), ("q", "k", "v"), mla.qkv_fn(at)),
            mla.rotary_fn(at, config, hf),
            mla.head_dims(at),
        )
    else:
        qk_norm = family.qk_norm if hasattr(at, "q_norm") else None  # (GLM-4.5: only with use_qk_norm)
        qkv = comp("attn.qkv", (xin,), ("q", "k", "v"), qkv_op(at, qk_norm), linear=qk_norm is None)
        rope, widths = rotary(hf.apply_rotary_pos_emb), None
    return context_attention(
        cp,
        cp_heads(config, tp),
        qkv,
        attn_core_op(at, config, hf.eager_attention_forward, rotary=rope, drop=drop, window=window),
        comp("attn.out", ("o",), ("ao",), lambda side, o: (project(at.o_proj, o, bias=False),), linear=True),
        widths=widths,
    )


def attention_ops(index: int, layer, config, tp: int, tp_group, draws, family: MoeFamily, cp=None):
    """``attn.norm`` .. ``mlp.norm`` of layer ``index`` (the token mixer: ``mixer_ops``)."""
    xin, ar = ("xf", "ar") if tp > 1 else ("x", "ao")
    ops = [comp("attn.norm", ("h",), ("x",), lambda side, h: (layer.input_layernorm(h),))]
    if tp > 1:
        ops.append(comm("attn.ag", SeqAllGather(tp_group, tp), "x", "xf"))
    ops += mixer_ops(index, layer, config, tp, draws, family, xin, cp)
    if tp > 1:
        ops.append(comm("attn.rs", SeqReduceScatter(tp_group, tp), "ao", "ar"))
    bias = layer.self_attn.o_proj.bias if hasattr(layer, "self_attn") else None  # (DeltaNet's out_proj has none)

    def mlp_norm(side, h, a):
        h2 = h + (a if bias is None else a + bias)
        return h2, layer.post_attention_layernorm(h2)

    ops.append(comp("mlp.norm", ("h", ar), ("h2", "x2"), mlp_norm))
    return ops


def moe_ops(index: int, layer, ep_groups: ExpertGroups, settings: dict, metrics: MoeMetrics, family: MoeFamily):
    """``moe.router`` .. ``moe.add`` of layer ``index``."""
    block, ep, cf = layer.mlp, ep_groups.size, settings["capacity_factor"]
    kernels = settings["kernels"]

    def add(side, h2, ys, w, *shared):
        routed = kernels.decode(ys, w, side["moe"][index]).view(h2.shape)
        return (h2 + (routed + shared[0] if shared else routed),)  # HF's order: (routed + shared) + residual

    aux = (f"aux.{index}",) if family.aux_loss else ()
    ops = [comp("moe.router", ("x2",), ("xs", "w") + aux, _router_fn(index, block, family, ep, settings, metrics))]
    if ep > 1:
        if cf is None:  # dropless: the split sizes travel first, asynchronously
            ops.append(
                comm("moe.counts", CountExchange(index, ep_groups, metrics, settings["host_copies"]), "xs", "xc")
            )
        dispatch = ExpertAllToAll(index, ep_groups, True, metrics)
        ops.append(comm("moe.dispatch", dispatch, "xs" if cf is not None else "xc", "xr"))
    ops += _shared_ops(block, family) + _expert_ops(index, block, family, ep, settings["grouped_mm"])
    if ep > 1:
        ops.append(comm("moe.combine", ExpertAllToAll(index, ep_groups, False, metrics), "yr", "ys"))
    ops.append(comp("moe.add", ("h2", "ys", "w") + (("ysh",) if family.shared_expert else ()), ("h",), add))
    return ops


def _router_fn(index: int, block, family: MoeFamily, ep: int, settings: dict, metrics: MoeMetrics):
    """The ``moe.router`` op's body: router noise drawn from the run's seed, logits, top-k, the
    tokens' copies sorted by expert (``route_tokens``), the aux-loss piece."""
    gate = getattr(block, family.router)
    num_experts, top_k = family.num_experts(settings["config"]), gate.top_k
    cf, base_seed, rank, kernels = (settings[k] for k in ("capacity_factor", "seed", "rank", "kernels"))
    grouped, copies = settings["grouped_mm"], settings["host_copies"]

    def router(side, x2):
        x = x2.reshape(-1, x2.shape[-1])
        noise = (
            seeded_rng(x.device, draw_seed(base_seed, side["serial"], index, rank))
            if block.training
            else contextlib.nullcontext()
        )
        with noise:
            eps = getattr(block, family.block_jitter) if family.block_jitter else 0.0
            if block.training and eps > 0:  # the sparse block's input jitter (HF: in place, the experts see it)
                x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
            if gate.training and getattr(gate, "input_jitter_noise", 0) > 0:
                x = x.clone()  # Phi-MoE's router jitters its input in place: the experts see it too
            logits, weights, selected = gate(x) if family.route is None else family.route(gate, x)
        xs, route = route_tokens(x, selected, num_experts, cf, kernels)
        if ep == 1 or route.padded:  # (ep == 1: a loop over experts reads the sizes on the host, later)
            local_counts(route, ep, None if use_grouped_mm(xs, grouped) else copies)
        side["moe"][index] = route
        if not side.get("recomputing"):  # a recomputed layer routes again: count its load once
            metrics.record_route(index, route.counts, route.dropped if route.padded else None)
        return (xs, weights) + ((aux_piece(logits, top_k),) if family.aux_loss else ())

    return router


def _shared_ops(block, family: MoeFamily) -> list:
    """The shared expert, right after the dispatch: it computes while the routed tokens are in flight."""
    if family.shared_expert == "gated":
        return [
            comp(
                "moe.shared",
                ("x2",),
                ("ysh",),
                lambda side, x: (torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x),),
            )
        ]
    if family.shared_expert == "plain":
        return [comp("moe.shared", ("x2",), ("ysh",), lambda side, x: (block.shared_experts(x),))]
    return []


def _expert_ops(index: int, block, family: MoeFamily, ep: int, grouped) -> list:
    """``moe.experts.up`` / ``.act`` / ``.down`` on this EP rank's experts."""
    experts, layout = block.experts, family.layout
    act = layout_act(layout, experts)
    xr, yr = ("xr", "yr") if ep > 1 else ("xs", "ys")

    def up(side, x):
        return (run_expert_up(x, side["moe"][index], experts, ep, grouped, layout),)

    def down(side, a):
        return (run_expert_down(a, side["moe"][index], experts, ep, grouped, layout),)

    return [
        comp("moe.experts.up", (xr,), ("xg",), up, linear=True),
        comp("moe.experts.act", ("xg",), ("xa",), lambda side, g: (act(g),), selective=True),
        comp("moe.experts.down", ("xa",), (yr,), down, linear=True),
    ]


def dense_mlp_ops(layer) -> list:
    """A dense layer's MLP among MoE layers (``first_k_dense_replace``, ``mlp_only_layers``), on this
    rank's sequence shard with the whole MLP, as the experts run (its weights replicated over TP,
    their gradients summed there)::

        mlp.up    COMP  x2 -> gate,up   gate_proj / up_proj
        mlp.down  COMP  gate,up -> mo   act(gate) x up, down_proj
        mlp.add   COMP  h2,mo -> h      residual add
    """
    mlp = layer.mlp

    return [
        comp(
            "mlp.up",
            ("x2",),
            ("gate", "up"),
            lambda side, x: (project(mlp.gate_proj, x), project(mlp.up_proj, x)),
            linear=True,
        ),
        comp(
            "mlp.down",
            ("gate", "up"),
            ("mo",),
            lambda side, g, u: (project(mlp.down_proj, lean_glu(mlp.act_fn, g, u)),),
            linear=True,
            selective=True,
        ),
        comp("mlp.add", ("h2", "mo"), ("h",), lambda side, h2, m: (h2 + m,)),
    ]


def moe_loss(config, sparse: list[int], coef: float, tp: int, tp_grad_group, metrics: MoeMetrics, num_experts: int):
    """``head.loss``'s last step: this rank's share of cross-entropy + ``coef`` x HF's load-balancing loss.

    With TP the pieces are summed over the TP group first (the loss is over all tokens of the
    micro-batch) and each TP rank adds 1/t of the aux term, so the shares still sum to the loss.
    With context parallelism ``tp`` / ``tp_grad_group`` are the tp x cp ranks of a sequence. A half
    micro-batch of the intra schedule weighs its aux term by its share of the rows."""
    keys = tuple(f"aux.{i}" for i in sparse)  # (HF: the router logits of the MoE layers only)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return sum_over_ranks(t, tp_grad_group)

    def add(side, ce, *pieces):
        if not pieces:  # a family without HF's load-balancing loss (DeepSeek-V3, GLM-4.5)
            return ce
        tokens = side["targets"].numel()  # this rank's sequence shard
        aux = load_balancing_loss(pieces, tokens, num_experts, reduce if tp > 1 else None, tp)
        metrics.record_aux(aux)
        return ce + coef * side["loss_share"] * aux / tp

    return CrossEntropy(keys, add)


def build_graph(
    family: MoeFamily,
    model,
    tp: int = 1,
    tp_rank: int = 0,
    tp_group=None,
    tp_grad_group=None,
    *,
    ep_groups: ExpertGroups | None = None,
    capacity_factor: float | None = None,
    aux_loss_coef: float | None = None,
    grouped_mm: bool | None = None,
    kernels: str = "torch",
    seed: int | None = None,
    check_ep=None,
    cp: ContextShards | None = None,
) -> ModelGraph:
    """Shard ``model`` in place for this TP rank and EP rank and return its op graph.

    ``capacity_factor`` None = dropless; ``aux_loss_coef`` None = the config's
    ``router_aux_loss_coef`` (0 when ``output_router_logits`` is off, as in HF); ``grouped_mm``
    None = auto (grouped GEMM on CUDA bf16, else a loop over experts); ``kernels``: the dispatch and
    combine kernels (``ds_dhelix.moe.kernels``: "torch" or "tutel")."""
    config, ep_groups = model.config, ep_groups or ExpertGroups()
    _check_and_shard(family, model, tp, tp_rank, ep_groups, check_ep)
    inner = model.model
    aux_loss_coef = _aux_loss_coef(family, config, aux_loss_coef)
    sparse = [i for i, layer in enumerate(inner.layers) if is_sparse(layer)]
    metrics = MoeMetrics(len(inner.layers), family.num_experts(config))
    draws = Draws(seed)  # router noise and attention dropout
    settings = {"capacity_factor": capacity_factor, "grouped_mm": grouped_mm, "seed": draws.base, "rank": draws.rank,
                "config": config, "kernels": make_kernels(kernels)}  # fmt: skip
    settings["host_copies"] = HostCopies()  # split sizes to the host: one side stream for the graph
    vocab = shard_vocab(inner.embed_tokens, model.lm_head, tp, tp_rank, tp_group)
    replicated = _replicated(model, tp, tp_grad_group)
    blocks = [embed_op(inner.embed_tokens, vocab=vocab)]
    for i, layer in enumerate(inner.layers):
        mlp = moe_ops(i, layer, ep_groups, settings, metrics, family) if i in sparse else dense_mlp_ops(layer)
        blocks.append(attention_ops(i, layer, config, tp, tp_group, draws, family, cp) + mlp)
    loss = moe_loss(config, sparse if family.aux_loss else [], aux_loss_coef, *sequence_ranks(tp, tp_grad_group, cp),
                    metrics, family.num_experts(config))  # fmt: skip
    head = functools.partial(head_ops, inner.norm, model.lm_head, vocab=vocab, loss=loss)
    blocks.append(head())
    meta = {"moe_metrics": metrics, "expert_groups": ep_groups, "capacity_factor": capacity_factor,
            "moe_kernels": kernels, "aux_loss_coef": aux_loss_coef, "sparse_layers": sparse, "head": head}  # fmt: skip
    side = make_side_fn(tp, tp_rank, side_inputs(model, family), cp)
    return ModelGraph(blocks, side, family=family.family, meta=meta, replicated=replicated)


def _check_and_shard(family: MoeFamily, model, tp: int, tp_rank: int, ep_groups, check_ep) -> None:
    """The family's checks, then ``model`` cut in place for this TP and EP rank."""
    check_tp(model.config, tp)
    check_dropout(model.config, ("attention_dropout",), family.name)
    if check_ep is not None:
        check_ep(model.config, ep_groups.size)
    shard(model, tp, tp_rank, ep_groups)


def _replicated(model, tp: int, tp_grad_group):
    """The TP-replicated parameters' gradient reduction (None at TP 1)."""
    if tp == 1:
        return None
    # every parameter TP does not cut (norms, router, experts) sees a sequence shard
    return mark_replicated([p for p in model.parameters() if not getattr(p, "tensor_model_parallel", False)],
                           tp_grad_group)  # fmt: skip


def _aux_loss_coef(family: MoeFamily, config, coef: float | None) -> float:
    """The coefficient a graph trains the load-balancing loss with (None: HF's default for the family)."""
    if coef and not family.aux_loss:
        raise ValueError(f"aux_loss_coef {coef} with {family.name}: its HF model has no load-balancing loss")
    if coef is None:
        return default_aux_loss_coef(config) if family.aux_loss else 0.0
    return coef


def default_aux_loss_coef(config) -> float:
    """The load-balancing loss coefficient HF trains with: ``router_aux_loss_coef`` when the config
    has ``output_router_logits`` on, else 0 (always 0 for a family whose HF model has no such loss:
    DeepSeek-V3, GLM-4.5)."""
    from .adapters import adapter_for

    family = getattr(adapter_for(config), "FAMILY", None)
    if family is not None and not getattr(family, "aux_loss", True):
        return 0.0
    return getattr(config, "router_aux_loss_coef", 0.0) if getattr(config, "output_router_logits", False) else 0.0


def sequence_ranks(tp: int, tp_grad_group, cp: ContextShards | None):
    """(count, group) of the ranks holding shards of one sequence: TP, or TP x CP."""
    return (tp, tp_grad_group) if cp is None else (tp * cp.size, cp.sequence_group)


def side_inputs(model, family: MoeFamily):
    """Rotary cos/sin (+ eager mask, the sliding windows' masks) and the MoE routing slots."""
    config, inner = model.config, model.model
    if family.sliding:  # per-layer windows (gpt-oss): the dense machinery's side inputs, and the routing slots
        dense = rotary_side_fn(inner.rotary_emb, inner.embed_tokens, config, layer_windows(model))
        return lambda batch, side: {**dense(batch, side), "moe": {}}
    if family.linear_attention and deltanet.linear_layers(config):
        return deltanet.no_documents(attention_side(model, family), family.name)
    return attention_side(model, family)


def attention_side(model, family: MoeFamily):
    """Rotary cos/sin over the full sequence (+ eager's mask) and the MoE routing slots."""
    config, inner = model.config, model.model

    def extra(batch, side):
        s = side["seq_len"]
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        if window and s > window:
            raise ValueError(
                f"sequence length {s} exceeds {family.name}'s sliding_window {window}; the ds_dhelix "
                f"adapter runs full causal attention: use --seq-len <= {window}"
            )
        dummy = inner.embed_tokens.weight[:1]
        cos, sin = inner.rotary_emb(dummy, side_positions(side, dummy.device))
        return {
            "cos": cos,
            "sin": sin,
            "moe": {},
            **causal_mask_side(config, dummy.dtype, s, dummy.device, side.get("position_ids"), side),
        }

    return extra
