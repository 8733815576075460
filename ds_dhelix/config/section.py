"""The "dhelix" section of a DeepSpeed config, and the batch-size arithmetic around it.

A ds_config.json carries one extra top-level section::

    {
      "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 4,
      "dhelix": {
        "enabled": true,
        "schedule": "si",
        "tensor_parallel": {"size": 2, "sequence_parallel": true},
        "planner": {"profile": "auto"}
      }
    }

`DhelixConfig.from_ds_config` turns it into frozen dataclasses. Parsing is strict: an unknown key at any
level, a wrong type (``true`` where a number is expected, ``"2"`` for 2) or a bad value raises
`ValueError` naming the full key path, the value and what would be valid. Nothing is ignored silently.

`derive_batch` fills in the DeepSpeed batch triple (train_batch_size = micro x accumulation x
data-parallel size) and explains mismatches with the numbers; `load_ds_config` reads the JSON file.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..graph.recompute import MODES
from ..schedule.registry import ONE_STAGE, PIPELINE, auto_candidates, names
from .dims import ParallelDims

SCHEDULES = names(configured=True)
"""Valid values of ``dhelix.schedule`` (the schedule registry's, ``ds_dhelix.schedule.registry``)."""

ONE_STAGE_SCHEDULES = names(ONE_STAGE, configured=True)
"""Schedules without a pipeline (``pipeline.stages`` 1)."""

AUTO_CANDIDATES = auto_candidates(ONE_STAGE)
"""Schedules ``"schedule": "auto"`` may choose from on one stage (``dhelix.auto_candidates``)."""

AUTO_KEYS = ("auto_candidates", "auto_trials", "auto_recheck_steps")
"""Keys of ``"schedule": "auto"`` only: refused with any other schedule, even at their defaults."""

PIPELINE_SCHEDULES = names(PIPELINE, configured=True)
"""Schedules of a folded pipeline (``pipeline.stages`` > 1); "sequential" is the fold without SI.
Every one folds the layer list into 2 x stages chunks (rank r holds chunks r and 2p-1-r)."""

PIPELINE_AUTO_CANDIDATES = auto_candidates(PIPELINE)
"""Schedules ``"schedule": "auto"`` may choose from in a pipeline: all run on the same fold, so a
step may take any of them."""

RECOMPUTE_MODES = MODES
"""Valid values of ``dhelix.recompute`` (``recompute.py``)."""

SI_EXECUTIONS = ("reactive", "plan")
"""Valid values of ``dhelix.si_execution``."""

DEPRECATED_SI_EXECUTIONS = {"stream": "reactive"}
"""Old ``dhelix.si_execution`` values still accepted for one release, with a warning naming the new one."""

SECTION = "dhelix"


# --------------------------------------------------------------------------------------------------
# strict parsing machinery (shared by every section)
# --------------------------------------------------------------------------------------------------


def type_name(tp: Any) -> str:
    """A field type as the error messages and the configuration reference name it."""
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a JSON object (dict)"
    if isinstance(tp, type):
        return {"bool": "bool", "int": "int", "float": "number", "str": "string"}.get(tp.__name__, tp.__name__)
    if typing.get_origin(tp) is tuple:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    return str(tp)


def _matches(value: Any, tp: Any) -> bool:
    """True when ``value`` is a valid instance of the annotated field type ``tp`` (bool is not an int)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if typing.get_origin(tp) is tuple:
        (item,) = typing.get_args(tp)[:1]
        return isinstance(value, (tuple, list)) and all(_matches(v, item) for v in value)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, tp)
    raise AssertionError(f"unsupported field type {tp!r}")


def _normalize(value: Any, tp: Any) -> Any:
    """JSON -> field value: list -> tuple, int -> float for number fields."""
    if isinstance(value, list) and any(typing.get_origin(t) is tuple for t in _flat_types(tp)):
        return tuple(value)
    allowed = _flat_types(tp)
    if isinstance(value, int) and not isinstance(value, bool) and float in allowed and int not in allowed:
        return float(value)
    return value


def _flat_types(tp: Any) -> tuple:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def _unknown_key_error(path: str, key: str, valid: list[str]) -> ValueError:
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ValueError(f"unknown config key '{path}.{key}'; valid keys in '{path}': {', '.join(valid)}{hint}")


class _Section:
    """Mixin for the config dataclasses: strict ``from_dict``, ``to_dict`` and type checks."""

    _path: ClassVar[str] = SECTION
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}
    """The closed sets of values a field takes (checked in ``__post_init__``; listed in the
    configuration reference)."""

    @classmethod
    def from_dict(cls, d: Any):
        """Build from a plain (JSON) dict; unknown keys, wrong types and bad values raise ValueError."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError(f"'{cls._path}' must be a JSON object (dict), got {type(d).__name__} {d!r}")
        hints = typing.get_type_hints(cls)
        valid = [f.name for f in dataclasses.fields(cls)]
        kwargs = {}
        for key, value in d.items():
            if key not in valid:
                raise _unknown_key_error(cls._path, key, valid)
            tp = hints[key]
            if dataclasses.is_dataclass(tp) and (value is None or isinstance(value, dict)):
                value = tp.from_dict(value)
            kwargs[key] = value
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """Plain JSON-able dict; ``from_dict(to_dict())`` gives back an equal object."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, _Section):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            tp = hints[f.name]
            given = getattr(self, f.name)
            value = _normalize(given, tp)
            if not _matches(value, tp):
                raise ValueError(f"{self._path}.{f.name} must be {type_name(tp)}, got {type(given).__name__} {given!r}")
            object.__setattr__(self, f.name, value)

    def _fail(self, name: str, why: str) -> ValueError:
        return ValueError(f"{self._path}.{name} = {getattr(self, name)!r} is invalid: {why}")

    def _choose(self, name: str, choices) -> None:
        """``name``'s value is one of ``choices``, else a ValueError listing them and a close match."""
        value = getattr(self, name)
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise self._fail(name, f"choose one of {', '.join(choices)}{hint}")

    def _at_least(self, name: str, lo: int | float) -> None:
        if getattr(self, name) < lo:
            raise self._fail(name, f"must be >= {lo}")

    def _positive(self, name: str) -> None:
        v = getattr(self, name)
        if v is not None and not v > 0:
            raise self._fail(name, "must be > 0")


# --------------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorParallelConfig(_Section):
    """Megatron-style tensor parallelism with explicit (schedulable) collectives."""

    _path: ClassVar[str] = "dhelix.tensor_parallel"

    size: int = 1
    """Ranks per tensor-parallel group; heads, kv heads and the MLP width must divide by it."""
    sequence_parallel: bool = True
    """Shard activations along the sequence between TP regions (all-gather / reduce-scatter ops).
    Must be true: the op graphs are built with sequence parallelism only."""

    def __post_init__(self):
        self._check_types()
        self._at_least("size", 1)
        if not self.sequence_parallel:
            raise self._fail(
                "sequence_parallel",
                "ds_dhelix's tensor parallelism always shards activations "
                "along the sequence between TP regions; remove the key or set true",
            )


@dataclass(frozen=True)
class ExpertParallelConfig(_Section):
    """MoE expert parallelism (experts sharded over EP ranks, dispatch/combine all-to-all)."""

    _path: ClassVar[str] = "dhelix.expert_parallel"

    size: int = 1
    """Ranks per expert-parallel group; must divide the data-parallel size and the number of experts."""
    capacity_factor: float | None = None
    """Tokens per expert = capacity_factor x tokens x top_k / experts; null = dropless (no token dropped)."""
    aux_loss_coef: float | None = None
    """Weight of the load-balancing aux loss; null = the model config's own (e.g. router_aux_loss_coef)."""

    def __post_init__(self):
        self._check_types()
        self._at_least("size", 1)
        self._positive("capacity_factor")
        if self.aux_loss_coef is not None and self.aux_loss_coef < 0:
            raise self._fail("aux_loss_coef", "must be >= 0 (or null for the model's own coefficient)")


MOE_KERNELS = ("torch", "tutel")
"""Valid values of ``dhelix.moe.kernels`` (``ds_dhelix.moe.kernels``)."""


@dataclass(frozen=True)
class MoeConfig(_Section):
    """How the MoE layers move their tokens (the expert layout is ``expert_parallel``'s)."""

    _path: ClassVar[str] = "dhelix.moe"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"kernels": MOE_KERNELS}

    kernels: str = "torch"
    """Dispatch (token rows -> the expert-sorted send buffer) and combine (expert outputs -> each
    token's weighted sum) kernels of every MoE family: "torch" (index_select / index_copy and a
    weighted sum) or "tutel" (tutel's fast_encode / fast_decode JIT kernels, forward and backward;
    needs tutel installed, see the MoE guide). Dropless and capacity mode, under EP and SI; the
    router stays the family's own."""

    def __post_init__(self):
        self._check_types()
        if self.kernels not in MOE_KERNELS:
            raise self._fail("kernels", f"choose one of {', '.join(MOE_KERNELS)}")


PAIRED_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
OBJECTIVES = ("cross_entropy", *PAIRED_OBJECTIVES, "kto", "grpo")
"""Valid values of ``dhelix.objective.name`` (``ds_dhelix.graph.objectives``)."""
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""How GRPO's per-token losses are averaged (``dhelix.objective.loss_type``)."""
GRPO_KEYS = ("epsilon", "epsilon_high", "loss_type", "max_completion_length", "scale_rewards")
KTO_KEYS = ("desirable_weight", "undesirable_weight")


@dataclass(frozen=True)
class ObjectiveConfig(_Section):
    """What the head's loss is (``ds_dhelix.objectives``; guide: post-training)."""

    _path: ClassVar[str] = "dhelix.objective"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "name": OBJECTIVES,
        "loss_type": GRPO_LOSS_TYPES,
        "scale_rewards": ("group", "none"),
    }

    name: str = "cross_entropy"
    """"cross_entropy" (next-token prediction, the default) or a preference objective over rows
    paired in each micro-batch (its first half the chosen completions, its second half the rejected
    ones, as TRL's DPOTrainer concatenates them): "dpo" (TRL's sigmoid loss), "ipo" (length-
    normalised log-ratios), "simpo" (no reference; length-normalised log-probabilities and a
    margin), "orpo" (no reference; the chosen rows' NLL and an odds-ratio term); "kto" (unpaired
    completions labelled desirable or not, against the reference and a KL estimate); or "grpo", the
    policy-gradient update of GRPO on sampled completions with their advantages (the clipped
    surrogate, an optional KL term)."""
    beta: float | None = None
    """The objective's beta (DPO's temperature, IPO's tau, SimPO's and ORPO's weight, GRPO's KL
    coefficient); null = TRL's default: 0.1 (dpo, ipo, orpo, kto), 2.0 (simpo, as its paper), 0.0
    (grpo: no KL term)."""
    label_smoothing: float = 0.0
    """dpo / simpo: the probability that a pair's preference is flipped (conservative DPO); 0 = none."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin gamma (the loss is -logsigmoid(beta x delta - gamma))."""
    epsilon: float = 0.2
    """grpo: the ratio's clipping range below 1 (``1 - epsilon``), and above it unless
    ``epsilon_high`` is set."""
    epsilon_high: float | None = None
    """grpo: the clipping range above 1 (DAPO's clip-higher, e.g. 0.28); null = ``epsilon``."""
    loss_type: str = "dapo"
    """grpo: how the per-token losses are averaged: "grpo" (each completion's mean, then the mean
    over completions), "bnpo" (over the micro-batch's completion tokens), "dr_grpo" (the sum over
    completions x ``max_completion_length``), "dapo" (over the step's completion tokens on every
    replica: train.py's token average), as TRL defines them."""
    max_completion_length: int | None = None
    """grpo with loss_type "dr_grpo": the constant the summed loss is divided by, per completion;
    null = the sequence length."""
    desirable_weight: float = 1.0
    """kto: the weight of a desirable completion's loss."""
    undesirable_weight: float = 1.0
    """kto: the weight of an undesirable completion's loss."""
    scale_rewards: str = "group"
    """grpo, records with rewards (not advantages): each reward minus its group's mean, divided by the
    group's standard deviation + 1e-4 ("group", TRL's default) or not ("none", Dr. GRPO)."""

    def __post_init__(self):
        self._check_types()
        for key, choices in self.CHOICES.items():
            self._choose(key, choices)
        if self.name != "grpo":
            self._positive("beta")
        elif self.beta is not None and self.beta < 0:
            raise self._fail("beta", "must be >= 0 (0: no KL term)")
        for owner, keys in (("grpo", GRPO_KEYS), ("kto", KTO_KEYS)):
            for key in keys:
                if self.name != owner and getattr(self, key) != ObjectiveConfig.__dataclass_fields__[key].default:
                    raise self._fail(key, f"applies to {owner}; objective {self.name!r} has none")
        self._positive("desirable_weight")
        self._positive("undesirable_weight")
        for key in ("epsilon", "epsilon_high", "max_completion_length"):
            self._positive(key)
        if not 0 <= self.label_smoothing < 0.5:
            raise self._fail("label_smoothing", "must be in [0, 0.5)")
        if self.label_smoothing and self.name not in ("dpo", "simpo"):
            raise self._fail("label_smoothing", f"applies to dpo and simpo; objective {self.name!r} has none")
        if self.simpo_gamma != 0.5 and self.name != "simpo":
            raise self._fail("simpo_gamma", f"applies to simpo; objective {self.name!r} has none")
        if self.max_completion_length is not None and self.loss_type != "dr_grpo":
            raise self._fail("max_completion_length", f"applies to loss_type 'dr_grpo' (got {self.loss_type!r})")
        if self.name == "cross_entropy" and self.beta is not None:
            raise self._fail("beta", "applies to the preference objectives; cross_entropy has none")

    @property
    def paired(self) -> bool:
        """Rows paired chosen / rejected inside each micro-batch."""
        return self.name in PAIRED_OBJECTIVES

    @property
    def default_beta(self) -> float:
        return self.beta if self.beta is not None else {"simpo": 2.0, "grpo": 0.0}.get(self.name, 0.1)


CP_COMMS = ("ulysses", "ring")
"""Valid values of ``dhelix.context_parallel.comm``."""


@dataclass(frozen=True)
class ContextParallelConfig(_Section):
    """Context parallelism: the sequence sharded over ``size`` ranks (on top of TP's sequence
    shards); attention sees the whole sequence through explicit, schedulable COMM ops."""

    _path: ClassVar[str] = "dhelix.context_parallel"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"comm": CP_COMMS}

    size: int = 1
    """Ranks per context-parallel group; the sequence length must divide by tensor_parallel.size x size
    ("ulysses") or by 2 x tensor_parallel.size x size ("ring": the zig-zag split)."""
    comm: str = "ulysses"
    """"ulysses": all-to-alls from sequence shards to head shards before the attention core and back
    after it (DeepSpeed-Ulysses' exchange; query heads must divide by tensor_parallel.size x size).
    "ring": ring attention, the key/value blocks passed around the CP ranks point to point, one COMM
    op per ring step, zig-zag split for causal balance (any head count TP allows)."""

    def __post_init__(self):
        self._check_types()
        self._at_least("size", 1)
        if self.comm not in CP_COMMS:
            raise self._fail("comm", f"choose one of {', '.join(CP_COMMS)}")


@dataclass(frozen=True)
class PipelineConfig(_Section):
    """Pipeline parallelism. Every pipeline schedule (the sequential fold, "w", "dualpipev") cuts the
    layers into 2 x stages chunks, rank r holding chunks r and 2 x stages - 1 - r."""

    _path: ClassVar[str] = "dhelix.pipeline"

    stages: int = 1
    """Number of pipeline ranks p."""
    split: tuple[int, ...] | None = None
    """Layers per chunk, in layer order (2 x stages entries); null = even. Pipelines only."""

    def __post_init__(self):
        self._check_types()
        self._at_least("stages", 1)
        if self.split is not None:
            if not self.split or any(n < 1 for n in self.split):
                raise ValueError(
                    f"{self._path}.split = {list(self.split)} is invalid: every chunk needs at least 1 layer "
                    f"(layers are never dropped); give one positive layer count per chunk or null for an even split"
                )
            if self.stages == 1:
                raise ValueError(
                    f"{self._path}.split = {list(self.split)} with stages = 1: a split cuts the layers "
                    f"of a pipeline into its chunks; remove it, or set stages >= 2"
                )

    def num_chunks(self) -> int:
        """Layer chunks of the pipeline: 2 x stages (every pipeline schedule runs on the fold)."""
        return 2 * self.stages


@dataclass(frozen=True)
class PlannerConfig(_Section):
    """Where the SI planner's overlap table comes from."""

    _path: ClassVar[str] = "dhelix.planner"

    profile: str = "off"
    """"off" (the default plan), "auto" (profile one layer at start unless a cached table in
    cache_dir matches; needs an example batch) or a table JSON path (must exist; refused if it was
    measured for another device, shape, layout or link). Anything but "off" needs
    si_execution "plan" and one stage."""
    cache_dir: str = "~/.cache/ds_dhelix"
    """Directory for cached overlap tables."""
    warmup: int = 2
    """Untimed runs per table entry (segment alone or pair) before measuring."""
    repeats: int = 5
    """Timed runs per table entry (median and spread kept). Then noisy entries (median's standard
    error over 2% of it) get this many more runs within 0.3 x the first pass's time, and the DP
    plan's own entries are re-measured and the plan re-searched until it comes out the same twice
    (at most 4 times). The DP prices each entry at its median + 1 standard error."""

    def __post_init__(self):
        self._check_types()
        if self.profile not in ("off", "auto"):
            if not os.path.isfile(os.path.expanduser(self.profile)):
                close = difflib.get_close_matches(self.profile, ["off", "auto"], n=1, cutoff=0.5)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise self._fail("profile", f"must be 'off', 'auto' or an existing table JSON file{hint}")
        if not self.cache_dir:
            raise self._fail("cache_dir", "must be a non-empty directory path")
        self._at_least("warmup", 0)
        self._at_least("repeats", 1)

    @property
    def table_path(self) -> str | None:
        """The profile table file, or None for "off" / "auto"."""
        return None if self.profile in ("off", "auto") else os.path.expanduser(self.profile)


@dataclass(frozen=True)
class TraceConfig(_Section):
    """Chrome-trace of the executed ops (strand, stream, op name) for a few steps."""

    _path: ClassVar[str] = "dhelix.trace"

    enabled: bool = False
    """Write a Chrome/Perfetto trace of the first steps: per rank a compute lane and one
    communication lane per strand channel (comm:tp:F, comm:tp:B, plus comm:tp:grads), one span per op."""
    path: str = "runs/trace.json"
    """Output file (chrome://tracing / Perfetto JSON)."""
    steps: int = 3
    """Number of optimizer steps to record."""

    def __post_init__(self):
        self._check_types()
        if not self.path:
            raise self._fail("path", "must be a non-empty file path")
        self._at_least("steps", 1)


@dataclass(frozen=True)
class BenchmarkConfig(_Section):
    """Settings of the side-by-side benchmark."""

    _path: ClassVar[str] = "dhelix.benchmark"

    link_gbps: float | None = None
    """The emulated link the run is on, in Gbit/s (token-bucket shaped loopback; part of the
    overlap-table key); null = the real link."""

    def __post_init__(self):
        self._check_types()
        self._positive("link_gbps")


@dataclass(frozen=True)
class DhelixConfig(_Section):
    """The whole "dhelix" section. Absent section = ``DhelixConfig()`` (disabled)."""

    _path: ClassVar[str] = SECTION
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "schedule": SCHEDULES,
        "si_execution": SI_EXECUTIONS,
        "recompute": RECOMPUTE_MODES,
        "auto_candidates": AUTO_CANDIDATES + tuple(c for c in PIPELINE_AUTO_CANDIDATES if c not in AUTO_CANDIDATES),
    }

    enabled: bool = False
    """Turn DHelix on; off = plain DeepSpeed behaviour."""
    schedule: str = "si"
    """"sequential" (reference, no overlap), "si" (strand interleaving), "intra" (each micro-batch
    split in two halves along the batch, one half's collectives hidden behind the other half's
    compute in the same direction: Domino's intra-batch overlap), "auto" (the engine times the
    ``auto_candidates`` on real training steps and keeps the fastest; on one stage whose op graph has
    no collective to hide, sequential without a trial, saying so), "w" (folded W pipeline with
    SI), "dualpipev" (folded pipeline in DualPipeV's order, each forward/backward pair co-executed by
    SI; DeepSpeed's own DualPipeV runs the pairs one after the other)."""
    auto_candidates: tuple[str, ...] | None = None
    """"auto" only: the schedules it times. One stage: any of "sequential", "si", "intra" (default
    all three; "intra" is left out when a micro-batch has one sample). "sequential" and "si" are
    bitwise equal, so a run that settles on one of them is bitwise a run with it from the start;
    "intra" trains as half-size micro-batches do (other rounding; with dropout, router noise, an MoE
    balance loss or expert capacity also other draws / per-half terms), so its trial steps differ
    from theirs. A pipeline (``pipeline.stages`` > 1): any of "sequential", "w", "dualpipev"
    (default all three), bitwise equal to one another. None: the default of the layout."""
    auto_trials: int = 3
    """"auto" only: timed steps per candidate in a trial phase (alternated; the median is compared),
    after one untimed warm-up step each in the first phase."""
    auto_recheck_steps: int = 500
    """"auto" only: after this many steps on the chosen schedule, time the candidates again; 0 = never."""
    si_execution: str = "reactive"
    """How an SI pair runs: "reactive" (both strands walk the whole model barrier-free, nearest
    collective first, reacting to completed collectives, deferred weight gradients) or "plan"
    (layer pairs follow the SI plan's rounds with a barrier after each: the planner's searched plan
    when planner.profile is set, else the default plan). "stream" is the old name of "reactive", still
    accepted for one release with a FutureWarning."""
    defer_weight_grads: bool = True
    """"reactive" only: ops the adapter marks linear on the way to their weights (attn.qkv,
    attn.out, mlp.up, mlp.down, head.logits, moe.experts.up / .down) compute their input gradient
    first and their weight gradient later, filling the time both strands wait on collectives (in
    graphs that have collectives: TP, CP or EP > 1)."""
    react_to_completions: bool = True
    """"reactive" only: a strand whose collective has completed goes on at once, a rank with both
    strands' collectives in flight waits for whichever completes first, and the forward strand
    keeps within an activation byte budget, where that is safe: collectives the host sees complete
    (gloo on CPU) on separate strand groups. A CUDA run never does (the host would block on the
    device, and ranks could order their launches differently); false runs that timing-independent
    order here too, the order a GPU runs (the bench's "si-ordered")."""
    pair_ends: bool = False
    """"si" + "reactive" only: co-execute the step's first two forwards and its last two backwards
    too (F0xF1 | F2xB0 | ... | B(m-2)xB(m-1)), so no strand runs alone and their collectives are
    hidden as well. Costs one more micro-batch of activation memory (a whole micro-batch waits
    between its forward and its backward); results stay bitwise those of "sequential"."""
    overlap_grad_reduction: bool = True
    """Reduce the gradients over the data-parallel group while the step's last backward runs:
    DeepSpeed's own reduction (ZeRO 1/2: its partitioned buckets; ZeRO 0: its all-reduce), handed
    each parameter as its gradient becomes final, on a helper thread, so the step waits only for
    what is left after the backward. Buckets of ``zero_optimization.reduce_bucket_size`` elements;
    when the ds_config does not set it, ds_dhelix sets it to one layer's parameters (DeepSpeed's
    default, 5e8, holds most models whole: nothing would be reduced before the backward ends).
    false: the whole reduction after the last backward. One-stage engines; the folded pipeline
    reduces after its last backward either way (an explicit true is warned about). Results do not depend on it at 2 data-parallel
    ranks; with more, gloo may sum other buckets in another order (last-bit differences)."""
    zero3_prefetch: int = 1
    """ZeRO-3 (``zero_optimization.stage`` 3): how many blocks ahead of the one a strand runs have
    their parameters gathered (forward: the next layers, backward: the previous ones). Each
    strand then holds at most 1 + this many blocks gathered, both strands about twice that; 0
    gathers a block only when a strand reaches it (its gather is hidden only by the other
    strand). Results do not depend on it."""
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    """Tensor/sequence parallelism."""
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    """MoE expert parallelism."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """MoE dispatch / combine kernels."""
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    """Context parallelism (sequence shards; Ulysses all-to-alls around attention, or ring attention)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline parallelism and layer split."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """Overlap profiling and SI planning."""
    trace: TraceConfig = field(default_factory=TraceConfig)
    """Op trace output."""
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    """Benchmark settings."""
    watchdog_s: float = 600.0
    """Hang watchdog: a rank that makes no progress for this many seconds inside a step
    (micro-batches, optimizer step), a checkpoint save or the HF export prints its last op (step,
    micro-batch, strand, op) and exits with code 3; train.py --watchdog-s overrides it."""
    log_interval: int = 1
    """Log (stdout / TensorBoard scalars) every this many optimizer steps."""
    recompute: str = "none"
    """Activation recompute inside the op graph: "none", "selective" (the attention core, the MLP
    activation with its down projection and the MoE experts' activation keep their inputs and
    recompute right before their backward) or "full" (each decoder layer keeps only its inputs and
    recomputes its forward, collectives included, as its backward starts); losses and parameters do
    not change; works with every schedule and MoE."""
    fuse_ops: bool = True
    """Run each block's COMP ops between two collectives as one op (one autograd graph, one engine
    call in the backward, the executor's bookkeeping once): the host work per layer a GPU needs.
    SI still pairs the strands at the collectives, but the other strand can take over only between
    runs (reactive SI on CPU then reacts less finely), and plan-mode SI's planner pairs whole runs
    (on a dense TP layer it then finds little beyond the default plan: ``dhelix predict --unfused``
    shows what it gives up; docs, limitations). Op names in traces, plans and profiles are the
    runs' (``attn.qkv+attn.core+attn.out``); false runs every op of the adapter on its own (finer
    traces, reactions and plans; losses agree to rounding: ``graph/fuse.py``)."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The loss the head computes: next-token cross-entropy, or a preference objective."""
    head_chunk: int = 0
    """Tokens per chunk of the LM head and loss: > 0 makes and differentiates the logits that many
    tokens at a time (each chunk's logits recomputed in the backward, one more head GEMM; the
    head's weight gradient is then not deferred), so a micro-batch never holds more than
    ``head_chunk x vocabulary / TP`` logits; 0 (default) keeps the micro-batch's logits whole
    (``tokens x vocabulary / TP``; the vocabulary is split over TP either way). Worth it when the
    logits dominate the activation peak: long sequences with 128k+ vocabularies (docs: precision,
    recompute and memory)."""
    seed: int = 1234
    """Base seed of the op graph's random draws (dropout masks, MoE router noise): with the
    micro-batch's number in the run, the layer, the op and the rank it seeds each draw, so every
    schedule, and a resumed run, draw the same masks (``graph/draws.py``; a resume with another
    seed is refused). train.py sets it to --seed unless the section sets it."""
    allow_unknown_deepspeed_keys: bool = False
    """Warn instead of refusing a top-level ds_config key DeepSpeed does not read (keys of a newer
    DeepSpeed); DeepSpeed itself ignores such keys silently."""

    def __post_init__(self):
        self._check_types()
        self._choose("schedule", SCHEDULES)
        self._check_si_execution()
        if self.planner.profile != "off" and self.si_execution != "plan":
            raise ValueError(
                f"dhelix.planner.profile = {self.planner.profile!r} needs dhelix.si_execution = 'plan' "
                f"(got {self.si_execution!r}): the planner's plan is only run in plan mode; set "
                f'"si_execution": "plan" or "planner": {{"profile": "off"}}'
            )
        self._check_auto()
        if self.schedule == "intra" and self.si_execution != "reactive":
            raise ValueError(
                f"dhelix.si_execution = {self.si_execution!r} with schedule 'intra': si_execution says how an SI "
                f"pair runs, and intra pairs the two halves of one micro-batch, always reactively; remove "
                f'"si_execution" or use "schedule": "si"'
            )
        if self.schedule == "auto" and self.si_execution != "reactive" and "intra" in self.auto_schedules:
            raise ValueError(
                f"dhelix.auto_candidates includes 'intra' with si_execution {self.si_execution!r}: auto would time "
                f'intra on the plan executor (no deferred weight gradients), not as "schedule": "intra" runs it; '
                f"drop 'intra' from auto_candidates or use si_execution 'reactive'"
            )
        if self.pair_ends and (self.schedule not in ("si", "auto") or self.si_execution != "reactive"):
            raise ValueError(
                f"dhelix.pair_ends = true needs schedule 'si' (or 'auto') with si_execution 'reactive' (got schedule "
                f"{self.schedule!r}, si_execution {self.si_execution!r}): it pairs the first two forwards "
                f'and the last two backwards of a non-pipelined SI step; set "pair_ends": false or use '
                f'"schedule": "si", "si_execution": "reactive"'
            )
        self._check_objective()
        self._positive("watchdog_s")
        self._at_least("log_interval", 1)
        self._at_least("zero3_prefetch", 0)
        self._at_least("auto_trials", 1)
        self._at_least("auto_recheck_steps", 0)
        self._at_least("head_chunk", 0)
        self._choose("recompute", RECOMPUTE_MODES)
        split = self.pipeline.split
        chunks = self.pipeline.num_chunks()
        if split is not None and len(split) != chunks:
            raise ValueError(
                f"dhelix.pipeline.split = {list(split)} has {len(split)} entries but {self.pipeline.stages} "
                f"stages fold the layers into {chunks} chunks (2 x stages); give one layer count per chunk"
            )

    def _check_objective(self) -> None:
        """An objective other than cross-entropy takes each micro-batch whole (no halves: a pair's
        rows, a micro-batch's averages)."""
        name = self.objective.name
        if name == "cross_entropy":
            return
        if self.schedule == "intra" or (self.schedule == "auto" and "intra" in self.auto_schedules):
            raise ValueError(
                f"dhelix.objective {name!r} takes each micro-batch whole (its pairs, its averages), and schedule "
                f"'intra' cuts each micro-batch in two along its rows; use \"schedule\": \"si\" (or drop 'intra' "
                f"from auto_candidates)"
            )

    def _check_si_execution(self) -> None:
        """``si_execution``: a valid value (a deprecated one warned about and replaced)."""
        if self.si_execution in DEPRECATED_SI_EXECUTIONS:
            new = DEPRECATED_SI_EXECUTIONS[self.si_execution]
            warnings.warn(
                f"dhelix.si_execution = {self.si_execution!r} is deprecated and will be refused in the "
                f"next release; use {new!r} (same behaviour)",
                FutureWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "si_execution", new)
        if self.si_execution not in SI_EXECUTIONS:
            names = SI_EXECUTIONS + tuple(DEPRECATED_SI_EXECUTIONS)
            close = difflib.get_close_matches(self.si_execution, names, n=1, cutoff=0.5)
            new = DEPRECATED_SI_EXECUTIONS.get(close[0], close[0]) if close else None
            hint = (
                f"; did you mean '{new}'?" + (f" (formerly '{close[0]}')" if new != close[0] else "") if close else ""
            )
            raise self._fail("si_execution", f"choose one of {', '.join(SI_EXECUTIONS)}{hint}")

    @property
    def auto_schedules(self) -> tuple[str, ...]:
        """The schedules "auto" times: ``auto_candidates``, or the layout's default (one stage:
        sequential, si, intra; a pipeline: sequential, w, dualpipev)."""
        if self.auto_candidates is not None:
            return self.auto_candidates
        return PIPELINE_AUTO_CANDIDATES if self.pipeline.stages > 1 else AUTO_CANDIDATES

    def _check_auto(self) -> None:
        if self.auto_candidates is None:
            return
        allowed, where = (
            (PIPELINE_AUTO_CANDIDATES, f"with pipeline.stages = {self.pipeline.stages}")
            if self.pipeline.stages > 1
            else (AUTO_CANDIDATES, "on one stage")
        )
        bad = [c for c in self.auto_candidates if c not in allowed]
        if bad or len(set(self.auto_candidates)) != len(self.auto_candidates) or len(self.auto_candidates) < 2:
            other = AUTO_CANDIDATES if self.pipeline.stages > 1 else PIPELINE_AUTO_CANDIDATES
            kind = "one-stage" if self.pipeline.stages > 1 else "pipeline"
            hint = (
                f" ({', '.join(map(repr, bad))}: {kind} schedule{'s' if len(bad) > 1 else ''})"
                if bad and all(b in other for b in bad)
                else ""
            )
            raise self._fail(
                "auto_candidates", f"give two or more different schedules of {list(allowed)} {where}{hint}"
            )

    def to_dict(self) -> dict:
        out = super().to_dict()
        if self.schedule != "auto":  # they would be refused on the way back (``from_dict``)
            for key in AUTO_KEYS:
                out.pop(key)
        return out

    @classmethod
    def from_dict(cls, d: Any):
        config = super().from_dict(d)
        given = [k for k in AUTO_KEYS if k in (d or {})]
        if given and config.schedule != "auto":
            raise ValueError(
                f"dhelix.{given[0]} is set but schedule is {config.schedule!r}: the auto_* keys apply to "
                f'"schedule": "auto" only; remove them or set the schedule to \'auto\''
            )
        return config

    @classmethod
    def from_ds_config(cls, ds_config: dict) -> DhelixConfig:
        """Parse ``ds_config["dhelix"]``; a config without the section gives the disabled defaults."""
        if not isinstance(ds_config, dict):
            raise ValueError(f"ds_config must be a dict (parsed JSON object), got {type(ds_config).__name__}")
        return cls.from_dict(ds_config.get(SECTION))


# --------------------------------------------------------------------------------------------------
# batch arithmetic
# --------------------------------------------------------------------------------------------------

_TB, _MB, _GA = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """How a global batch is cut: train_batch_size = micro x accumulation x data-parallel size.

    Data-parallel size counts replicas of the dense parameters: world / (tp x pp). Expert parallelism
    shards experts *inside* the data-parallel group, so it does not change it; expert parameters are
    replicated over expert_data_parallel_size = world / (tp x pp x ep) ranks (DeepSpeed's definition).
    """

    dims: ParallelDims
    micro_batch_size: int
    gradient_accumulation_steps: int
    train_batch_size: int

    @property
    def data_parallel_size(self) -> int:
        return self.dims.dp

    def table(self) -> str:
        """Printable table of the derived sizes."""
        d = self.dims
        rows = [
            ("world size", d.world, ""),
            ("tensor parallel (tp)", d.tp, ""),
            ("pipeline stages (pp)", d.pp, ""),
            ("expert parallel (ep)", d.ep, "shards experts inside DP"),
            ("data parallel (dp)", d.dp, "world / (tp x pp)"),
            ("expert data parallel", d.edp, "dp / ep"),
            ("micro batch per GPU", self.micro_batch_size, _MB),
            ("accumulation steps", self.gradient_accumulation_steps, _GA),
            ("train batch size", self.train_batch_size, f"{_TB} = micro x accum x dp"),
        ]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {value:>6}  {note}".rstrip() for name, value, note in rows)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def derive_batch(
    ds_config: dict, world_size: int | ParallelDims, tp: int | None = None, pp: int | None = None, ep: int | None = None
) -> BatchSizes:
    """Fill in the missing batch values like DeepSpeed does and check that they add up.

    ``world_size`` is a ``ParallelDims`` or a rank count; with a count, tp / pp / ep default to the
    sizes in ``ds_config["dhelix"]``. Raises ValueError naming the numbers and which value to change.
    """
    if isinstance(world_size, ParallelDims):
        dims = world_size
    else:
        cfg = DhelixConfig.from_ds_config(ds_config)
        dims = ParallelDims(
            world_size,
            tp=cfg.tensor_parallel.size if tp is None else tp,
            pp=cfg.pipeline.stages if pp is None else pp,
            ep=cfg.expert_parallel.size if ep is None else ep,
            cp=cfg.context_parallel.size if cfg.enabled else 1,
        )
    ep_note = f"; ep {dims.ep} does not change it" if dims.ep > 1 else ""
    cp_note = f" / cp {dims.cp}" if dims.cp > 1 else ""
    tb, mb, ga = _batch_triple(
        ds_config, dims.dp, f"(world {dims.world} / tp {dims.tp} / pp {dims.pp}{cp_note}{ep_note})"
    )
    return BatchSizes(dims, mb, ga, tb)


def _batch_triple(ds_config: dict, dp: int, how: str) -> tuple[int, int, int]:
    """(train_batch_size, micro, accumulation) from any two (or one) of them, as DeepSpeed fills them."""
    given = {}
    for key in (_TB, _MB, _GA):
        if ds_config.get(key) is not None:
            given[key] = _positive_int(key, ds_config[key])
    tb, mb, ga = given.get(_TB), given.get(_MB), given.get(_GA)
    dp_text = f"data-parallel size {dp} {how}"
    if tb is None and mb is None:
        raise ValueError(f"set {_TB} or {_MB} in the ds_config (neither is given; {dp_text})")
    if tb is not None and mb is not None and ga is None:
        ga = tb // (mb * dp) if tb % (mb * dp) == 0 else None
        if ga is None or ga < 1:
            raise ValueError(
                f"{_TB} {tb} is not a multiple of micro {mb} x {dp_text}; set {_TB} to a multiple of {mb * dp}"
            )
    elif tb is not None and mb is None:
        ga = 1 if ga is None else ga
        mb = tb // (ga * dp) if tb % (ga * dp) == 0 else None
        if mb is None or mb < 1:
            raise ValueError(
                f"{_TB} {tb} is not a multiple of accumulation {ga} x {dp_text}; set {_TB} to a multiple of {ga * dp}"
            )
    elif tb is None:
        ga = 1 if ga is None else ga
        tb = mb * ga * dp
    if tb != mb * ga * dp:
        raise ValueError(f"{_TB} {tb} != micro {mb} x accumulation {ga} x {dp_text}; " + _fixes(tb, mb, ga, dp))
    return tb, mb, ga


def _fixes(tb: int, mb: int, ga: int, dp: int) -> str:
    options = [f"{_TB} to {mb * ga * dp}"]
    if tb % (mb * dp) == 0:
        options.append(f"{_GA} to {tb // (mb * dp)}")
    if tb % (ga * dp) == 0:
        options.append(f"{_MB} to {tb // (ga * dp)}")
    return "change " + ", or ".join(options) + " (or drop one of the three and it is derived)"


# --------------------------------------------------------------------------------------------------
# file loading
# --------------------------------------------------------------------------------------------------


def load_ds_config(path: str | os.PathLike) -> dict:
    """Read a ds_config JSON file into a dict; missing file / bad JSON -> one-line ValueError."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "not found"
        raise ValueError(f"ds_config file {path!r} {what}; pass the path of a JSON file to --deepspeed")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read ds_config file {path!r}: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise ValueError(f"ds_config file {path!r} is not valid JSON: {e.msg} at {where}") from None
    if not isinstance(data, dict):
        raise ValueError(f"ds_config file {path!r} must hold a JSON object, got {type(data).__name__}")
    return data
