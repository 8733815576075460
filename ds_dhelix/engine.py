"""DhelixEngine: a DeepSpeed engine whose ``train_batch`` runs a whole step with strand
interleaving, and ``ds_dhelix.initialize`` that builds it like ``deepspeed.initialize``.

A step of m micro-batches: the executor runs every forward and backward op by op (sequential or
SI), leaving gradients on the parameters; then DeepSpeed does the rest with its own code paths:
its data-parallel gradient reduction (ZeRO 1/2: ``coalesce_grad_reduction``; ZeRO 0: the buffered
all-reduce), gradient clipping over the model-parallel group, the optimizer and the LR schedule.
"""
from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import logger

from .config import DhelixConfig
from .executor import Executor, StepStats
from .memory import ActivationMeter
from .ops import backward_order
from .parallel import ParallelLayout
from .plan import SIPlan, default_plan
from .trace import TraceRecorder, merge_traces
from .watchdog import Watchdog


FEW_MICROBATCHES = 3
"""At or below this many micro-batches per step, SI's unpaired ends are a large share of the step."""


def few_microbatches_hint(num_microbatches: int, pair_ends: bool) -> str | None:
    """The warning for an SI step with too few micro-batches to overlap much, or None.

    With m micro-batches SI pairs F(k+1) with B(k); the first forward and the last backward run
    alone, one micro-batch's compute in all: 1/m of the step runs with nothing to hide its
    communication behind (``pair_ends`` pairs them too)."""
    m = num_microbatches
    if m == 1:
        return ("ds_dhelix: one micro-batch per step: SI has nothing to pair (set "
                "gradient_accumulation_steps >= 2 to overlap communication)")
    if m <= FEW_MICROBATCHES and not pair_ends:
        return (f"ds_dhelix: {m} micro-batches per step: SI runs the first forward and the last "
                f"backward without a partner, 1/{m} of the step's compute with its communication "
                f"exposed; more gradient_accumulation_steps (e.g. 16) or \"dhelix\": "
                f"{{\"pair_ends\": true}} hide more")
    return None


class DhelixEngine(DeepSpeedEngine):
    """DeepSpeed engine + SI executor. Build it with :func:`ds_dhelix.initialize`."""

    def __init__(self, *, dhelix: DhelixConfig, layout: ParallelLayout, graph, plan: SIPlan, **kwargs):
        super().__init__(**kwargs)
        self.dhelix, self.layout, self.graph, self.plan = dhelix, layout, graph, plan
        self.meter = ActivationMeter(self.module.parameters())
        self.executor = Executor(graph, plan if dhelix.schedule == "si" else None, meter=self.meter,
                                 defer_weight_grads=dhelix.defer_weight_grads, pair_ends=dhelix.pair_ends)
        self.watchdog = Watchdog(dhelix.watchdog_s, self.global_rank).start()
        self.watchdog.pause()  # armed only inside train_batch / eval_batch
        self.executor.watchdog = self.watchdog
        self.recorder = TraceRecorder(self.global_rank) if dhelix.trace.enabled else None
        self.executor.recorder = self.recorder
        self.last_stats = StepStats()
        self.last_loss = None
        self._warned_few = False

    def destroy(self):
        self.watchdog.stop()
        super().destroy()

    def export_hf(self, out_dir: str, tokenizer=None) -> str | None:
        """Write an HF checkpoint (shards gathered) from global rank 0; collective on all ranks."""
        from .checkpoint import export_hf
        return export_hf(self.module, out_dir, tokenizer, self.layout.tp_group, self.layout.tp_size)

    # ------------------------------------------------------------------ training
    def _reduction_context(self):
        if self.zero_optimization_stage() >= 1:
            return self.coalesce_grad_reduction()
        return self.no_sync()

    def _pull_batches(self, data_iter) -> list[dict]:
        gas = self.gradient_accumulation_steps()
        batches = [next(data_iter) for _ in range(gas)]
        shape = tuple(batches[0]["input_ids"].shape)
        for k, b in enumerate(batches):
            got = tuple(b["input_ids"].shape)
            if got != shape:
                raise ValueError(f"micro-batch {k} has shape {got}, expected {shape}: every micro-batch "
                                 f"of a step must have the same [batch, sequence] shape")
        return batches

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from ``data_iter``.

        Returns the mean loss of the step (over micro-batches and data-parallel ranks)."""
        batches = self._pull_batches(data_iter)
        schedule = self.dhelix.schedule
        if schedule == "si" and not self._warned_few:
            hint = few_microbatches_hint(len(batches), self.dhelix.pair_ends)
            if hint:
                logger.warning(hint)
            self._warned_few = True
        self.module.train()
        self.executor.stats = StepStats()
        self.meter.reset_peak()
        t0 = time.perf_counter()
        self.watchdog.resume(step=self.global_steps)
        try:
            with self._reduction_context():
                mbs = self.executor.run_microbatches(batches, schedule, 1.0 / len(batches))
        finally:
            self.watchdog.pause()
        gas = len(batches)
        self._is_gradient_accumulation_boundary = True
        if self.zero_optimization_stage() == 0:
            self.allreduce_gradients()
        self.micro_steps += gas - 1
        self.step()
        self._is_gradient_accumulation_boundary = None
        stats = self.executor.stats
        stats.peak_activation_bytes = self.meter.peak
        stats.step_s = time.perf_counter() - t0
        self.last_stats = stats
        self.last_loss = self._mean_loss(mbs)
        self._log_step(batches)
        self._maybe_dump_trace()
        return self.last_loss

    def _maybe_dump_trace(self) -> None:
        """After ``trace.steps`` steps: every rank writes its spans, rank 0 merges them."""
        if self.recorder is None or self.global_steps < self.dhelix.trace.steps:
            return
        path = self.dhelix.trace.path
        part = self.recorder.dump(f"{path}.rank{self.global_rank}")
        self.recorder = self.executor.recorder = None
        dist.barrier()
        if self.global_rank == 0:
            parts = [f"{path}.rank{r}" for r in range(dist.get_world_size())]
            merge_traces(parts, path)
            for p in parts:
                os.remove(p)
            logger.info(f"ds_dhelix: trace of {self.global_steps} steps written to {path}")
        dist.barrier()
        del part

    @torch.no_grad()
    def eval_batch(self, data_iter) -> torch.Tensor:
        """Mean loss over one step's worth of micro-batches, forward only."""
        from .executor import MicroBatch
        batches = self._pull_batches(data_iter)
        self.module.eval()
        self.executor.grad_enabled = False
        self.watchdog.resume(step=self.global_steps)
        try:
            mbs = []
            for k, b in enumerate(batches):
                mb = MicroBatch(k, self.graph.make_side(b))
                self.executor.forward(mb)
                mbs.append(mb)
        finally:
            self.watchdog.pause()
            self.executor.grad_enabled = True
            self.module.train()
        return self._mean_loss(mbs)

    def _mean_loss(self, mbs) -> torch.Tensor:
        loss = torch.stack([mb.loss.detach().float() for mb in mbs]).mean()
        if self.layout.tp_size > 1:
            dist.all_reduce(loss, group=self.layout.tp_grad_group)  # shares -> full loss
        if self.layout.dp_size > 1:
            dist.all_reduce(loss, group=self.layout.dp_group)
            loss /= self.layout.dp_size
        return loss

    def _log_step(self, batches) -> None:
        s = self.last_stats
        tokens = sum(b["input_ids"].numel() for b in batches) * self.layout.dp_size
        s.tokens_per_s = tokens / max(s.step_s, 1e-9)
        if not (self.monitor.enabled and self.global_rank == 0):
            return
        if self.global_steps % self.dhelix.log_interval:
            return
        step = self.global_steps
        norm = self.get_global_grad_norm()
        events = [("Train/loss", float(self.last_loss), step),
                  ("Train/lr", self.get_lr()[0], step),
                  ("Train/tokens_per_s", s.tokens_per_s, step),
                  ("Train/step_time_s", s.step_s, step),
                  ("Train/comm_ms", s.comm_s * 1e3, step),
                  ("Train/exposed_comm_ms", s.exposed_s * 1e3, step),
                  ("Train/hidden_comm_fraction", s.hidden_fraction, step),
                  ("Train/peak_activation_bytes", float(s.peak_activation_bytes), step)]
        if norm is not None:
            events.append(("Train/grad_norm", float(norm), step))
        self.monitor.write_events(events)


def _plan_from_config(dh, graph, model, layout, ds_config, example_batch) -> SIPlan:
    """The searched plan when ``planner.profile`` asks for one, else the default plan."""
    from .profile import resolve_plan, run_meta
    specs = graph.layer_specs()
    fallback = default_plan(specs, backward_order(specs))
    if dh.planner.profile == "off":
        return fallback
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    shape = tuple(example_batch["input_ids"].shape) if example_batch is not None else (micro, None)
    dtype = next(model.parameters()).dtype
    meta = run_meta(model.config, layout.tp_size, layout.world_size, shape, dtype, dh.benchmark.link_gbps)
    log = (lambda msg: logger.info(msg)) if layout.rank == 0 else (lambda msg: None)
    plan, table = resolve_plan(dh.planner, graph, meta, example_batch, list(model.parameters()), log)
    from .planner import predict_ms
    log(f"ds_dhelix: SI plan '{plan.source}' (predicted {predict_ms(table, plan):.2f} ms per layer pair; "
        f"default plan {predict_ms(table, fallback):.2f} ms)\n{plan.render_text()}")
    return plan


def _strip_section(ds_config: dict) -> dict:
    cfg = copy.deepcopy(ds_config)
    cfg.pop("dhelix", None)
    return cfg


def initialize(args=None, model=None, config=None, model_parameters=None, optimizer=None,
               lr_scheduler=None, plan: SIPlan | None = None, example_batch: dict | None = None):
    """Like ``deepspeed.initialize`` for an HF causal LM: returns ``(engine, optimizer, None,
    lr_scheduler)``. ``config`` is the ds_config dict (or path) with an enabled "dhelix" section.
    The model is sharded in place for this rank's TP slice. ``plan`` (an ``SIPlan``) runs SI pairs
    by that plan, as ``si_execution="plan"`` would; ``example_batch`` (one micro-batch) gives the
    shapes to profile for ``planner.profile="auto"``."""
    import deepspeed
    from hf_models.adapters import adapter_for

    from .config import load_ds_config
    if not isinstance(config, dict):
        config = load_ds_config(config)
    dh = DhelixConfig.from_ds_config(config)
    if not dh.enabled:
        raise ValueError('ds_dhelix.initialize needs "dhelix": {"enabled": true}; use deepspeed.initialize otherwise')
    if dh.pipeline.stages > 1:  # folded pipeline: W, DualPipeV with SI, or the sequential fold
        from .pipe.engine import initialize_pipeline
        return initialize_pipeline(args, model, config, dh, model_parameters, optimizer, lr_scheduler, plan)
    if dh.schedule not in ("sequential", "si"):
        raise ValueError(f"schedule {dh.schedule!r} needs the pipeline engine (dhelix.pipeline.stages > 1); "
                         f"with one stage use 'si' or 'sequential'")
    # wraps an existing torch.distributed world, or starts one from the launcher's environment
    deepspeed.init_distributed(dist_init_required=not dist.is_initialized())
    tp, ep = dh.tensor_parallel.size, dh.expert_parallel.size
    adapter = adapter_for(model.config)
    adapter.check_tp(model.config, tp, dist.get_world_size())
    moe = _check_moe(adapter, model.config, dh, dist.get_world_size() // tp)
    layout = ParallelLayout.create(tp, ep)
    if moe is not None:
        moe["ep_groups"] = layout.expert_groups()
    graph = adapter.build_graph(model, tp, layout.tp_rank, layout.tp_group, layout.tp_grad_group, **(moe or {}))
    if plan is None and dh.schedule == "si" and dh.si_execution == "plan":
        plan = _plan_from_config(dh, graph, model, layout, config, example_batch)
    ds_config = _strip_section(config)
    config_class = DeepSpeedConfig(ds_config, layout)
    engine_class = DhelixEngine
    if moe is not None:  # knows expert parameters, logs aux loss and expert load
        from .moe.engine import DhelixMoeEngine as engine_class
    engine = engine_class(dhelix=dh, layout=layout, graph=graph, plan=plan, args=args, model=model,
                          optimizer=optimizer, model_parameters=model_parameters or model.parameters(),
                          lr_scheduler=lr_scheduler, mpu=layout, config=ds_config, config_class=config_class)
    return engine, engine.optimizer, None, engine.lr_scheduler


def _check_moe(adapter, model_config, dh: DhelixConfig, dp_size: int) -> dict | None:
    """MoE adapters: check expert parallelism, return their extra build_graph arguments."""
    ep = dh.expert_parallel
    if not hasattr(adapter, "check_ep"):
        if ep.size > 1 or ep.capacity_factor is not None or ep.aux_loss_coef is not None:
            raise ValueError(f"dhelix.expert_parallel is set but model_type {model_config.model_type!r} has no "
                             f"experts; remove the section or use an MoE model (e.g. tiny-phimoe)")
        return None
    adapter.check_ep(model_config, ep.size, dp_size)
    return {"capacity_factor": ep.capacity_factor, "aux_loss_coef": ep.aux_loss_coef}
