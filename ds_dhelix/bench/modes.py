"""One runner per benchmark mode, built on every rank of the world: ``runner.step(batches)`` runs one
optimizer step over the step's micro-batches and returns what the mode can measure.

A runner picks its own share of the step: the TP modes (autotp, ds_dhelix) take every micro-batch
on every rank; the data-parallel ``deepspeed`` and ``autoep`` modes take ``1/world`` of them per rank. Every mode
trains on the same tokens per step.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from ..runtime.comm import release_deepspeed_shm
from .options import (
    DATA_PARALLEL_MODES,
    DHELIX_MODES,
    TUTEL_MODES,
    BenchOptions,
    autoep_preset,
    autoep_unfit,
    split_mode,
)


class SkipMode(Exception):
    """The mode does not apply to this model/layout; the message says why (it becomes the row)."""


def build_model(opts: BenchOptions):
    """A fresh copy of the benchmark model (same seed in every mode); with ``lora_r`` its PEFT LoRA
    model (the same adapter in every mode)."""
    from hf_models.registry import build_model as build

    model = build(opts.model, seed=opts.seed, num_layers=opts.num_layers)[0]
    if not opts.lora_r:
        return model
    from hf_models.adapters import lora_target_names

    from ..verify import with_lora

    targets = lora_target_names(model.config)
    return with_lora(
        model,
        {"r": opts.lora_r, "lora_alpha": 2 * opts.lora_r, "target_modules": targets, "init_lora_weights": True},
        opts.seed,
    )


class _Settling:
    """What a runner whose ``engine`` may run ``"schedule": "auto"`` tells the measurement loop."""

    engine: object

    @property
    def settling_steps(self) -> int:
        """Steps the engine needs before its measured steps are its steady state: ``auto``'s trial
        phase (run as warm-up), else none."""
        auto = getattr(self.engine, "auto", None)
        return auto.trial_steps_left if auto is not None and auto.chosen is None else 0

    def settled_info(self) -> dict:
        """What the row reports once settled: ``auto``'s choice, why (``auto_reason``), and the
        figures it chose by (none when it chose without a trial: nothing to hide)."""
        auto = getattr(self.engine, "auto", None)
        if auto is None or not auto.decisions:
            return {}
        last = auto.decisions[-1]
        return {
            "auto_chosen": last["chosen"],
            "auto_trial_steps": last["step"],
            "auto_figures": last["figures"],
            "auto_reason": last["reason"],
        }


class DhelixRunner(_Settling):
    """``sequential``, ``si``, ``si-planned``: the ds_dhelix engine with its executor stats."""

    def __init__(self, opts: BenchOptions, mode: str, example_batch: dict, link_gbps: float | None):
        from ds_dhelix.engine.build import build_engine
        from ds_dhelix.graph.ops import backward_order
        from ds_dhelix.planning.plan import default_plan

        self.mode = mode
        self.engine = build_engine(
            build_model(opts), opts.dhelix_ds_config(mode, link_gbps), example_batch=example_batch
        )
        plan = self.engine.plan
        self.info = {}
        if plan is not None:
            specs = self.engine.graph.layer_specs()
            default = default_plan(specs, backward_order(specs))
            self.info = {
                "plan_source": plan.source,
                "plan_fingerprint": plan.fingerprint()[:12],
                "plan_is_default": plan.fingerprint() == default.fingerprint(),
                "plan_rounds": len(plan.rounds),
            }

    def step(self, batches: list[dict]) -> dict:
        share = len(batches) // self.engine.groups.dp_size  # this data-parallel group's micro-batches
        dp_rank = self.engine.groups.dp_rank
        loss = self.engine.train_batch(iter(batches[dp_rank * share : (dp_rank + 1) * share]))
        s = self.engine.last_stats
        comm, exposed = s.comm_and_exposed  # CUDA: from CUDA events (the host never waits on NCCL)
        return {
            "compute_s": s.compute_s,
            "comm_s": comm,
            "exposed_s": exposed,
            "loss": float(loss),
            "num_comms": s.num_comms,
            "peak_activation_bytes": s.peak_activation_bytes,
            "peak_gathered_bytes": _gathered_bytes(self.engine),
            "dp_reduce_s": s.dp_reduce_s,  # (None with one data-parallel rank)
            "dp_exposed_s": s.dp_exposed_s,
        }

    def close(self) -> None:
        self.engine.destroy()


class DeepSpeedRunner:
    """Plain DeepSpeed (``deepspeed``: data parallel), AutoTP (``autotp``), AutoEP (``autoep``) or
    tutel's MoE layer on DeepSpeed (``tutel*``): forward, backward, step per micro-batch; activation
    bytes counted with the same saved-tensor meter."""

    def __init__(self, opts: BenchOptions, mode: str):
        import deepspeed

        from ds_dhelix.runtime.memory import ActivationMeter

        self.mode, self.world = mode, opts.world
        model = build_model(opts)
        config, self.info = _deepspeed_config(opts, mode, model), {}
        if mode in TUTEL_MODES:
            from .tutel_peer import TUTEL_MODES as DEGREES
            from .tutel_peer import tutel_engine, with_tutel_blocks

            self.engine = tutel_engine(with_tutel_blocks(model, opts.ep, DEGREES[mode]), opts.ep, config)
            self.info = {"tutel_overlap_degree": DEGREES[mode]}
        else:
            with _autoep_registry_compat() if mode == "autoep" else contextlib.nullcontext():
                self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        release_deepspeed_shm()
        if mode == "autoep":
            replaced = sum(type(m).__name__ == "AutoEPMoELayer" for m in self.engine.module.modules())
            if not replaced:  # never report plain data parallel as AutoEP
                raise RuntimeError("DeepSpeed AutoEP replaced no MoE block of this model")
            self.info = {"autoep_preset": config["expert_parallel"]["preset_model"], "autoep_layers": replaced}
        self.meter = ActivationMeter(self.engine.module.parameters())

    def my_batches(self, batches: list[dict]) -> list[dict]:
        if self.mode not in DATA_PARALLEL_MODES:
            return batches
        share = len(batches) // self.world
        rank = dist.get_rank()
        return batches[rank * share : (rank + 1) * share]

    def step(self, batches: list[dict]) -> dict:
        self.meter.reset_peak()
        mine, total = self.my_batches(batches), 0.0
        for b in mine:
            with self.meter.hooks():
                out = self.engine(input_ids=b["input_ids"], labels=b["labels"])
            self.engine.backward(out.loss)
            self.engine.step()
            total += float(out.loss.detach())
        return {"peak_activation_bytes": self.meter.peak, "loss": self._mean_loss(total / len(mine))}

    def _mean_loss(self, mine: float) -> float:
        """The step's loss: the mean over its micro-batches (on every rank: the world's mean where
        the mode is data parallel)."""
        if self.mode == "autotp":
            return mine
        import torch

        t = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / self.world

    def close(self) -> None:
        self.engine.destroy()


class PipeRunner(_Settling):
    """``pp > 1``: DeepSpeed's pipelines (``ds-1f1b``, ``ds-dualpipev``) and ours (``sequential``,
    ``w``, ``dualpipev``, ``auto``) on the same HF model and micro-batches; ours report executor
    stats."""

    def __init__(self, opts: BenchOptions, mode: str, link_gbps: float | None):
        self.mode, self.info = mode, {}
        if mode.startswith("ds-"):
            from ds_dhelix.bench.ds_pipelines import build_deepspeed_pipe

            self.engine = build_deepspeed_pipe(
                build_model(opts),
                opts.pp,
                mode.removeprefix("ds-"),
                opts.base_ds_config(opts.micro_batches),
                tp=opts.tp,
                seed=opts.seed,
            )
            release_deepspeed_shm()
        else:
            from ds_dhelix.engine.build import build_engine

            self.engine = build_engine(build_model(opts), opts.dhelix_ds_config(mode, link_gbps))

    def step(self, batches: list[dict]) -> dict:
        if self.mode.startswith("ds-"):
            self.engine.train_batch(iter([(b["input_ids"], b["labels"]) for b in batches]))
            return {"peak_activation_bytes": None}
        self.engine.train_batch(iter(batches))
        s = self.engine.last_stats
        # exposed: time blocked on collectives and on receives from the other stages; stage-to-stage
        # transfers are not timed as comm, so comm is only reported when collectives ran
        return {
            "compute_s": s.compute_s,
            "comm_s": s.comm_s if s.num_comms else None,
            "exposed_s": s.exposed_s,
            "num_comms": s.num_comms,
            "peak_activation_bytes": s.peak_activation_bytes,
        }

    def close(self) -> None:
        self.engine.destroy()


def _gathered_bytes(engine) -> int | None:
    """ZeRO-3: the most parameter bytes gathered at once so far (None below stage 3)."""
    zero3 = getattr(engine, "zero3", None)
    if zero3 is None:
        return None
    return zero3.peak_gathered * next(engine.module.parameters()).element_size()


def _deepspeed_config(opts: BenchOptions, mode: str, model) -> dict:
    """The ds_config of a DeepSpeed mode (``SkipMode`` where the mode does not apply)."""
    if mode in DATA_PARALLEL_MODES and opts.step_micro_batches % opts.world:
        raise SkipMode(
            f"{opts.step_micro_batches} micro-batches do not split over {opts.world} "
            f"data-parallel ranks; pass --micro-batches as a multiple of {opts.world}"
        )
    if mode == "deepspeed":
        return opts.deepspeed_ds_config()
    if mode in TUTEL_MODES:
        from deepspeed.accelerator import get_accelerator

        from .tutel_peer import tutel_unfit

        reason = tutel_unfit(mode, opts.ep, opts.world, model.config, get_accelerator().device_name())
        if reason is not None:
            raise SkipMode(reason)
        return opts.deepspeed_ds_config()
    if mode == "autotp":
        if opts.tp < 2 or opts.ep > 1:
            raise SkipMode(
                f"AutoTP needs tensor parallelism over the whole world (tp {opts.tp}, "
                f"ep {opts.ep}); it applies to the dense --tp runs"
            )
        return opts.autotp_ds_config()
    reason = autoep_unfit(opts, model.config)  # the default mode list (named in --modes: refused already)
    if reason is not None:
        raise SkipMode(reason)
    return opts.autoep_ds_config(autoep_preset(model.config))


@contextlib.contextmanager
def _autoep_registry_compat():
    """DeepSpeed 0.19.8's AutoEP calls ``registry.get(key, default)`` on transformers' output-capture
    registry, whose ``get`` takes one argument since transformers 5 (``TypeError: _CanRecordRegistry.get()
    takes 2 positional arguments but 3 were given``). While AutoEP replaces the MoE blocks, ``get``
    also accepts a key and a default (plain dict lookup); the model's own one-argument calls are
    unchanged. Nothing is patched when the installed transformers already accepts a default."""
    import inspect

    from transformers.utils import output_capturing

    registry = getattr(output_capturing, "_CanRecordRegistry", None)
    if registry is None or len(inspect.signature(registry.get).parameters) > 2:
        yield
        return
    one_arg = registry.get

    def get(self, key, *default):
        return dict.get(self, key, *default) if default else one_arg(self, key)

    registry.get = get
    try:
        yield
    finally:
        registry.get = one_arg


def build_runner(opts: BenchOptions, mode: str, example_batch: dict, link_gbps: float | None = None):
    """The runner of ``mode`` (``SkipMode`` when it does not apply here). ``example_batch`` is one
    micro-batch (the planner profiles its shapes), ``link_gbps`` the emulated link rate."""
    if opts.pp > 1:
        return PipeRunner(opts, mode, link_gbps)
    if split_mode(mode)[0] in DHELIX_MODES:
        return DhelixRunner(opts, mode, example_batch, link_gbps)
    if mode in ("deepspeed", "autotp", "autoep", *TUTEL_MODES):
        return DeepSpeedRunner(opts, mode)
    raise SkipMode(f"mode {mode!r} has no runner yet")  # pipeline modes: add a runner here
