"""What a benchmark run measures: ``BenchOptions`` (model, layout, shapes, modes, link rates) and
the ds_config each mode trains with.

Modes, all on the same model, the same world and the same tokens per optimizer step::

    deepspeed   plain DeepSpeed engine, data parallel over the whole world (no TP, no overlap)
    autotp      DeepSpeed AutoTP ("tensor_parallel": {"autotp_size": tp}), collectives inside modules
    autoep      DeepSpeed AutoEP ("expert_parallel": {"enabled": true, "autoep_size": ep, "preset_model": p})
                on the HF MoE model types DeepSpeed has a preset for (mixtral, qwen3_moe / qwen2_moe,
                deepseek_v2, deepseek_v3, ...): data parallel over the world, experts sharded over ep
                ranks, its own dispatch/combine all-to-alls inside the MoE blocks it replaced
    sequential  ds_dhelix TP/SP, micro-batches one after another, every comm waited at once
    si          ds_dhelix TP/SP with strand interleaving, reactive pairs (the default "si_execution")
    si-ordered  reactive SI without reacting to completed collectives: the timing-independent order a
                CUDA run takes ("react_to_completions": false)
    si-plan     SI run by the fixed default plan, a barrier after each plan round ("si_execution": "plan")
    si-planned  SI run by the plan the planner makes from a profile ("planner.profile": "auto")
    si-ends     reactive SI with "pair_ends": the first two forwards and the last two backwards paired
                too (no strand alone; one more micro-batch of activations)
    intra       Domino's intra-batch overlap ("schedule": "intra"): each micro-batch in two halves along
                the batch, one half's collectives behind the other's compute, same direction
    tutel       tutel's MoE layer (``tutel.moe.moe_layer``) in place of each MoE block, on plain DeepSpeed,
                data parallel over the world like autoep, experts sharded over it, the same expert weights
                and router logits; ``tutel-overlap2`` / ``tutel-overlap4``: with its all-to-all / expert-FFN
                overlap (a2a_ffn_overlap_degree 2 / 4; CUDA only). Asked for by name (tutel is optional)
    auto        "schedule": "auto": the engine times sequential, si and intra on its first steps and
                keeps the fastest; its row is timed after that decision (the trial steps run in its
                warm-up and are reported in the row: auto_trial_steps, auto_chosen, auto_figures,
                auto_reason); with no collective in the op graph (TP, EP, CP 1) it takes sequential
                without a trial, and auto_reason says there is nothing to hide

A ds_dhelix mode may name its activation recompute after a ``+``: ``si+full``, ``sequential+selective``
(``dhelix.recompute``; plain ``si`` is ``si+none``), so the modes' step times sit side by side; and
``+dp-end`` reduces the data-parallel gradients after the last backward instead of during it
(``"overlap_grad_reduction": false``): ``si+dp-end``, ``sequential+full+dp-end``; ``+unfused`` runs
every op of the adapter on its own (``"fuse_ops": false``): ``si+unfused``.

With ``pp > 1`` (folded pipeline over ``pp`` stages of ``tp`` ranks each) the modes are ``PP_MODES``::

    ds-1f1b       DeepSpeed PipelineEngine, its 1F1B schedule, on the HF decoder layers (tp 1) or on
                  our op graph's TP layers run op after op (tp > 1; ds_dhelix/bench/ds_pipelines.py)
    ds-dualpipev  DeepSpeed DualPipeVEngine (V-folded, forward/backward pairs one after the other)
    sequential    ds_dhelix folded pipeline, pairs run one after the other (the reference)
    w             ds_dhelix W schedule: folded pipeline, pairs co-executed by SI
    dualpipev     ds_dhelix DualPipeV order with SI pairs (``dualpipev-si``, its old name, is read too)
    auto          "schedule": "auto" over sequential, w, dualpipev (on request; timed after its trials)
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

from ..graph.recompute import MODES as RECOMPUTE_MODES
from ..runtime.linkemu import DEFAULT_BURST_KB
from ..schedule.registry import ALIASES, ONE_STAGE, PIPELINE, lookup, names

TUTEL_MODES = ("tutel", "tutel-overlap2", "tutel-overlap4")
"""The tutel peer's modes (``bench/tutel_peer.py``)."""

MODES = ("deepspeed", "autotp", "autoep", *TUTEL_MODES, *names(ONE_STAGE))
"""Modes a run can measure, in table order: the peers, then every one-stage schedule of the registry."""

DEFAULT_MODES = tuple(m for m in MODES if m not in ("si-ends", "auto", *TUTEL_MODES))
"""Modes measured unless ``--modes`` says otherwise (``si-ends``, ``auto`` and the tutel modes are asked for
by name; ``si-ordered``, the order a GPU runs, is measured beside ``si`` by default)."""

DEEPSPEED_MODES = ("deepspeed", "autotp", "autoep", *TUTEL_MODES)
"""Modes that run DeepSpeed's own engine on the HF model (no ds_dhelix adapter involved)."""

DATA_PARALLEL_MODES = ("deepspeed", "autoep", *TUTEL_MODES)
"""DeepSpeed modes data parallel over the world (each rank 1/world of a step's micro-batches)."""

DHELIX_MODES = names()
"""Modes that run the ds_dhelix executor (they report compute / comm / exposed time): the registry's."""

PP_MODES = ("ds-1f1b", "ds-dualpipev", *names(PIPELINE))
"""Modes of a pipeline run (pp > 1), in table order: DeepSpeed's, then the registry's pipeline schedules."""

PP_DEFAULT_MODES = tuple(m for m in PP_MODES if m != "auto")
"""Modes of a pipeline run unless ``--modes`` says otherwise (``auto`` is asked for by name)."""


MODE_FLAGS = {"dp-end": {"overlap_grad_reduction": False}, "unfused": {"fuse_ops": False}}
"""A ds_dhelix mode's ``+`` flags other than a recompute mode: the "dhelix" keys each sets."""


def split_mode(mode: str) -> tuple[str, str | None]:
    """``"si+full"`` -> ``("si", "full")``; ``"si"`` -> ``("si", None)`` (an old name read as its new
    one); ``+`` flags (``MODE_FLAGS``) are left out."""
    base, *rest = mode.split("+")
    recompute = next((r for r in rest if r not in MODE_FLAGS), None)
    return ALIASES.get(base, base), recompute


def mode_flags(mode: str) -> list[str]:
    """The ``MODE_FLAGS`` a mode names after ``+``, in order."""
    return [r for r in mode.split("+")[1:] if r in MODE_FLAGS]


def canonical_mode(mode: str) -> str:
    """A mode as the tables name it: its base's old name read as the new one."""
    base, *rest = mode.split("+")
    return "+".join([ALIASES.get(base, base), *rest])


MIN_REPEATS = 5
"""Timed steps a row needs to be reported: fewer are measured (quick looks, tests) but marked
``repeats_below_minimum`` and flagged in the tables."""

REFERENCE_GBPS = 2.0
"""The link whose sequential comm/comp ratio the run reports (the paper's A40-like regime)."""


@dataclass(frozen=True)
class BenchOptions:
    """One benchmark run: every mode at every link rate.

    Defaults are the representative regime: tiny-llama, TP=2, 16 micro-batches of 4 x 256 tokens,
    where at 2 Gbit/s the sequential run spends about as long communicating as computing (on the
    CPU machine this was chosen on; the bench reports the ratio it measured). SI leaves the first
    forward and the last backward of a step unpaired; 16 rather than 8 micro-batches halve that
    share at the same activation peak (benchmarks/results/README.md has the measurements).
    """

    model: str = "tiny-llama"
    """Preset name or local HF checkpoint directory."""
    tp: int = 2
    """Tensor-parallel size; the world is ``tp x ep`` ranks (deepspeed mode: data parallel over them)."""
    pp: int = 1
    """Pipeline stages (folded, two chunks per rank); with ``pp > 1`` the world is ``pp x tp`` ranks
    and the modes are ``PP_MODES``."""
    cp: int = 1
    """Context-parallel size of the ds_dhelix modes: the world is ``tp x cp x ep``
    ranks, each sequence sharded over tp x cp of them."""
    cp_comm: str = "ulysses"
    """Context parallelism's exchange: "ulysses" (all-to-alls around the attention core) or "ring"
    (ring attention, one point-to-point COMM op per ring step)."""
    ep: int = 1
    """Expert-parallel size for MoE models (e.g. tiny-phimoe with ``tp=1, ep=2``): the ds_dhelix
    modes shard the experts over ``ep`` data-parallel ranks, each rank with its own micro-batches."""
    data_parallel: int | None = None
    """Data-parallel size of the ds_dhelix modes (None: ``ep``, the MoE runs' data-parallel ranks);
    the world is ``tp x cp x pp x data_parallel`` ranks, and a multiple of ``ep``. E.g.
    ``--tp 1 --dp 2``: our executor against plain DeepSpeed on the same two data-parallel ranks."""
    modes: tuple[str, ...] = DEFAULT_MODES
    """Modes to measure (subset of ``MODES``)."""
    link_gbps: tuple[float | None, ...] = (1.0, 2.0, 5.0, 10.0, None)
    """Emulated link rates in Gbit/s; None = unshaped loopback."""
    link_burst_kb: int = DEFAULT_BURST_KB
    """Token-bucket burst of the emulated link in KB. Kept just above the loopback MTU (64 KiB):
    a larger bucket banks credit while the link idles, so a schedule that leaves the link idle
    during compute (sequential) gets its next messages faster than the nominal rate; a real link
    never exceeds its rate (linkemu's default, 512 KB, lets sequential communication beat the
    nominal rate)."""
    micro_batches: int = 16
    """Micro-batches per optimizer step (gradient accumulation) of each data-parallel group: with
    ``ep > 1`` a step has ``micro_batches x ep`` micro-batches in all."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    seq_len: int = 256
    """Tokens per sequence."""
    num_layers: int | None = None
    """Shrink the preset to this many layers (None: as the preset says)."""
    warmup: int = 2
    """Untimed steps per mode before measuring."""
    repeats: int = 5
    """Timed steps per mode; modes alternate step by step, the median is reported."""
    zero_stage: int = 0
    """ZeRO stage of every mode (3: plain DeepSpeed gathers in its module hooks with its own prefetch,
    the ds_dhelix modes as op-graph collectives)."""
    lora_r: int = 0
    """> 0: every mode trains a PEFT LoRA adapter of this rank (alpha 2 x rank) on the attention and
    MLP projections of a frozen model, as ``train.py --lora-r`` does; 0: a full fine-tune."""
    seed: int = 1234
    timeout: float = 900.0
    """Seconds one link rate may take before its world is killed."""
    extra_dhelix: dict = field(default_factory=dict)
    """Extra keys for the "dhelix" section of the ds_dhelix modes."""
    moe_kernels: str = "torch"
    """MoE dispatch / combine kernels of the ds_dhelix modes (``dhelix.moe.kernels``: torch or tutel)."""

    def __post_init__(self):
        if self.pp > 1 and self.modes == DEFAULT_MODES:  # the default list: the pipeline's
            object.__setattr__(self, "modes", PP_DEFAULT_MODES)
        renamed = tuple(canonical_mode(m) for m in self.modes)  # old names read as new
        object.__setattr__(self, "modes", renamed)
        self._check_modes()
        self._check_layout()
        if not self.link_gbps:
            raise ValueError("no link rates; pass e.g. --link-gbps 2 or --link-gbps unshaped")
        for g in self.link_gbps:
            if g == "matched":
                continue
            if g is not None and (isinstance(g, str) or not g > 0):
                raise ValueError(f"link rate {g} Gbit/s must be > 0 (or 'unshaped')")
        if self.link_burst_kb < 65:
            raise ValueError(
                f"link-burst-kb {self.link_burst_kb} is below the loopback MTU (64 KiB): "
                f"the token bucket would drop full-size packets; use >= 65"
            )
        for name in ("tp", "pp", "cp", "ep", "micro_batches", "micro_batch_size", "seq_len", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num-layers must be >= 1, got {self.num_layers}")
        if self.cp_comm not in ("ulysses", "ring"):
            raise ValueError(f"cp-comm {self.cp_comm!r}: choose ulysses or ring")
        from ds_dhelix.config.dims import ParallelDims

        ParallelDims(self.tp * self.cp, tp=self.tp, cp=self.cp, cp_comm=self.cp_comm).check_seq_len(
            self.seq_len, "seq-len"
        )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero stage {self.zero_stage} not supported here; use 0, 1, 2 or 3")
        if self.zero_stage == 3 and self.pp > 1:
            raise ValueError("--zero 3 with --pp: the folded pipeline does not take ZeRO-3 yet; use one stage")
        if self.lora_r < 0:
            raise ValueError(f"lora-r must be >= 1 (or 0: full fine-tune), got {self.lora_r}")
        if self.moe_kernels not in ("torch", "tutel"):
            raise ValueError(f"moe-kernels {self.moe_kernels!r}: choose torch or tutel")
        if self.lora_r and self.pp > 1:
            raise ValueError(
                f"--lora-r with --pp {self.pp}: DeepSpeed's pipeline peers train no PEFT model; "
                f"benchmark LoRA with one stage"
            )

    def _check_modes(self) -> None:
        allowed = PP_MODES if self.pp > 1 else MODES
        unknown = [m for m in self.modes if split_mode(m)[0] not in allowed]
        if unknown:
            other = PP_MODES if self.pp == 1 else MODES
            hint = ""
            if any(m in other for m in unknown):
                hint = " (pipeline modes need --pp > 1)" if self.pp == 1 else " (not a pipeline mode; drop --pp)"
            raise ValueError(f"unknown bench mode(s) {unknown}{hint}; choose from {', '.join(allowed)}")
        for m in self.modes:
            base, recompute = split_mode(m)
            extras = [r for r in m.split("+")[1:] if r not in MODE_FLAGS]
            flags = mode_flags(m)
            if (recompute is not None or flags) and (
                base not in DHELIX_MODES or recompute not in (None, *RECOMPUTE_MODES) or len(extras) > 1
            ):
                raise ValueError(
                    f"bench mode {m!r}: only a ds_dhelix mode ({', '.join(d for d in DHELIX_MODES if d in allowed)}) "
                    f"takes '+' with a recompute mode ({', '.join(RECOMPUTE_MODES)}) and / or "
                    f"{', '.join(MODE_FLAGS)}, e.g. si+full or si+dp-end"
                )
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"bench modes {list(self.modes)} name a mode twice")
        if not self.modes:
            raise ValueError("no modes to measure; pass e.g. --modes sequential si")

    def _check_layout(self) -> None:
        if self.pp > 1 and self.ep != 1:
            raise ValueError(
                f"--pp {self.pp} with --ep {self.ep}: the pipeline benchmark has no expert "
                f"parallelism inside stages (ds_dhelix pipelines refuse it too); drop --ep"
            )
        if self.data_parallel is not None:
            if self.data_parallel < 1 or self.data_parallel % self.ep:
                raise ValueError(
                    f"--dp {self.data_parallel} must be >= 1 and a multiple of --ep {self.ep} (expert "
                    f"parallelism shards experts inside the data-parallel ranks)"
                )
            if self.pp > 1 and self.data_parallel > 1:
                raise ValueError(
                    f"--dp {self.data_parallel} with --pp {self.pp}: the pipeline bench runs one rank "
                    f"per stage; drop --dp"
                )
        if self.cp > 1 and self.pp > 1:
            raise ValueError(
                f"--cp {self.cp} with --pp {self.pp}: the pipeline bench measures DeepSpeed's 1F1B and "
                f"DualPipeV, which have no context parallelism; bench CP with one stage (training and "
                f"dhelix parity run CP inside pipeline stages)"
            )
        if self.pp == 1 and "autoep" in self.modes and self.modes != DEFAULT_MODES and self.ep < 2:
            raise ValueError(_autoep_needs_ep(self.ep))  # named explicitly (the default list: a skipped row)
        cp_peers = [m for m in self.modes if m in ("autotp", "autoep")]
        if self.cp > 1 and cp_peers:
            raise ValueError(
                f"--cp {self.cp}: modes {cp_peers} have no context parallelism to compare; measure "
                f"deepspeed (plain data parallel), sequential and si"
            )

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * (self.ep if self.data_parallel is None else self.data_parallel)

    @property
    def dp(self) -> int:
        """Data-parallel size of the ds_dhelix modes (a sequence spans ``tp x cp`` ranks)."""
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def step_micro_batches(self) -> int:
        """Micro-batches of one optimizer step over the whole world, the same in every mode."""
        return self.micro_batches * self.dp

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step, the same in every mode."""
        return self.step_micro_batches * self.micro_batch_size * self.seq_len

    def to_dict(self) -> dict:
        return asdict(self)

    # ---------------------------------------------------------------- ds_configs per mode
    def base_ds_config(self, micro_batches: int) -> dict:
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": micro_batches,
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": self.zero_stage},
        }

    def dhelix_ds_config(self, mode: str, link_gbps: float | None = None) -> dict:
        """ds_config of a ds_dhelix mode: TP over the whole world, all micro-batches on it.
        ``link_gbps`` keys the planner's cached overlap table to the emulated link."""
        flags = mode_flags(mode)
        mode, recompute = split_mode(mode)
        assert mode in DHELIX_MODES, mode
        section = copy.deepcopy(self.extra_dhelix)
        if recompute is not None:
            section["recompute"] = recompute
        for flag in flags:
            section.update(MODE_FLAGS[flag])
        section.setdefault("seed", self.seed)
        section.update(enabled=True, tensor_parallel={"size": self.tp})
        for key, value in lookup(mode, PIPELINE if self.pp > 1 else ONE_STAGE).section.items():
            section[key] = {**section.get(key, {}), **value} if isinstance(value, dict) else value
        if self.pp > 1:
            section["pipeline"] = {"stages": self.pp}
        if self.ep > 1:
            section["expert_parallel"] = {**section.get("expert_parallel", {}), "size": self.ep}
        if self.cp > 1:
            section["context_parallel"] = {**section.get("context_parallel", {}), "size": self.cp, "comm": self.cp_comm}
        section["benchmark"] = {**section.get("benchmark", {}), "link_gbps": link_gbps}
        if self.moe_kernels != "torch":
            section["moe"] = {**section.get("moe", {}), "kernels": self.moe_kernels}
        return {**self.base_ds_config(self.micro_batches), "dhelix": section}

    def deepspeed_ds_config(self) -> dict:
        """Plain DeepSpeed, data parallel over the world: each rank takes 1/world of the step."""
        return self.base_ds_config(self.step_micro_batches // self.world)

    def autoep_ds_config(self, preset: str) -> dict:
        """DeepSpeed AutoEP: data parallel over the world like ``deepspeed`` (same micro-batches per rank),
        experts over ``ep`` ranks; ``preset`` is AutoEP's name for the model type (``autoep_preset``)."""
        return {
            **self.deepspeed_ds_config(),
            "expert_parallel": {"enabled": True, "autoep_size": self.ep, "preset_model": preset},
        }

    def autotp_ds_config(self) -> dict:
        """DeepSpeed AutoTP over the whole world: every rank sees all micro-batches."""
        return {**self.base_ds_config(self.micro_batches), "tensor_parallel": {"autotp_size": self.tp}}


def autoep_preset(model_config) -> str | None:
    """DeepSpeed AutoEP's preset for the HF ``model_type`` of ``model_config`` (None: it has none)."""
    from deepspeed.module_inject.auto_ep_presets.registry import preset_name_for_hf_model_type

    return preset_name_for_hf_model_type(model_config.model_type)


def _autoep_needs_ep(ep: int) -> str:
    return (
        f"autoep shards the experts over --ep ranks, got --ep {ep}: pass --ep 2 (or more) with an MoE "
        f"model, e.g. --model tiny-qwen3-moe --tp 1 --ep 2, or drop autoep"
    )


def autoep_unfit(opts: BenchOptions, model_config) -> str | None:
    """Why the ``autoep`` mode cannot run on this model and layout, naming the fix (None: it can).
    AutoEP is only run on a model type it has a preset for: on another MoE family its generic
    patterns could replace the blocks with routing math that is not the model's."""
    if opts.ep < 2:
        return _autoep_needs_ep(opts.ep)
    model_type = model_config.model_type
    if autoep_preset(model_config) is not None:
        return None
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    covered = ", ".join(t for preset in PRESET_MODELS.values() for t in preset.hf_model_types)
    from hf_models.adapters import is_moe

    if not is_moe(model_config):
        return (
            f"autoep needs an MoE model: model_type {model_type!r} has no experts; use an MoE model "
            f"DeepSpeed AutoEP has a preset for ({covered}), e.g. --model tiny-qwen3-moe, or drop autoep"
        )
    return (
        f"DeepSpeed AutoEP has no preset for model_type {model_type!r} (its presets cover {covered}); "
        f"drop autoep for this model"
    )


def check_modes_fit(opts: BenchOptions, model_config) -> None:
    """A mode named in ``--modes`` that cannot run on this model: ``ValueError`` naming the fix, before
    any model is built. (In the default mode list such a mode becomes a skipped row instead; so does
    a tutel overlap mode on a machine without CUDA.)"""
    if opts.pp == 1 and "autoep" in opts.modes and opts.modes != DEFAULT_MODES:
        reason = autoep_unfit(opts, model_config)
        if reason is not None:
            raise ValueError(reason)
    tutel = [m for m in opts.modes if m in TUTEL_MODES]
    if tutel:
        from .tutel_peer import tutel_unfit

        reason = (
            opts.pp > 1
            and f"--pp {opts.pp}: the tutel modes have no pipeline; drop --pp"
            or tutel_unfit("tutel", opts.ep, opts.world, model_config, "cuda")
        )
        if reason:
            raise ValueError(f"--modes {' '.join(tutel)}: {reason}")


def quick(opts: BenchOptions, **overrides) -> BenchOptions:
    """The ``--quick`` variant: two layers, 4 micro-batches of shorter sequences, one link rate,
    few steps."""
    values = {
        **asdict(opts),
        "num_layers": 2,
        "seq_len": 128,
        "micro_batches": 4,
        "warmup": 1,
        "repeats": 3,
        "link_gbps": (REFERENCE_GBPS,),
        "timeout": 170.0,
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    values["modes"] = tuple(values["modes"])
    values["link_gbps"] = tuple(values["link_gbps"])
    return BenchOptions(**values)
