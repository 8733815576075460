"""What both ds_dhelix engines do around an optimizer step, whatever runs inside it: the single-stage
``DhelixEngine`` (``engine.py``) and the folded ``FoldedPipelineEngine`` (``pipe/engine.py``) mix
this in before their DeepSpeed base class.

    setup_strands   executor, activation meter, watchdog, trace recorder; "schedule": "auto"'s chooser
    step_schedule   the schedule of the next step (auto's pick, else the configured one)
    watched         the watchdog armed around work between steps (checkpoint saves, the HF export)
    pull_batches    a step's micro-batches from the data iterator, shapes checked
    guarded_step    begin_step, the step, end_step; a failed collective named by where the rank was
    begin_step      fresh StepStats, meter peak reset, watchdog armed
    end_step        stats filled, TensorBoard scalars, the step's time to auto (its decisions
                    logged), trace written
    failure_position  where the rank was, for a failed collective (the watchdog's last op)
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
from deepspeed.utils import logger

from ..planning.autoschedule import AutoSchedule, nothing_to_hide
from ..planning.autoschedule import describe as describe_decision
from ..runtime.comm import collective_failures, cuda_connections_warning
from ..runtime.executor import Executor
from ..runtime.memory import ActivationMeter
from ..runtime.stats import StepStats
from ..runtime.trace import TraceRecorder, merge_traces
from ..runtime.watchdog import Watchdog

STEP_END = "the step's end (its loss, logs and trace)"  # the watchdog's op after the optimizer step


def check_attention_mask(batch: dict, k: int, moe: bool = False) -> None:
    """A micro-batch's ``attention_mask`` is honoured when it is right padding whose targets are
    ignored: causal attention never lets a real token see the padding after it, so every counted
    loss term is what HF computes with the mask. Any other mask is refused, naming the fix."""
    mask = batch.get("attention_mask")
    if mask is None or bool((mask != 0).all()):
        return
    fix = (
        "pad on the right with labels = -100 on the padding (DataCollatorForLanguageModeling does), or pack "
        "documents with position_ids (train.py --packing docs)"
    )
    if mask.dim() != 2:
        raise ValueError(
            f"micro-batch {k} has an attention_mask of shape {tuple(mask.shape)}: ds_dhelix reads a "
            f"[batch, sequence] padding mask only; {fix}"
        )
    keep = mask != 0
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError(
            f"micro-batch {k} has an attention_mask with left padding or holes, which the op graph's "
            f"causal attention cannot honour; {fix}"
        )
    labels = batch.get("labels", batch["input_ids"])
    if bool((labels[~keep] != -100).any()):
        raise ValueError(
            f"micro-batch {k}: labels on padded positions (attention_mask 0) must be -100, or the "
            f"loss would count the padding; {fix}"
        )
    if moe:
        raise ValueError(
            f"micro-batch {k} has padding: the MoE router's load-balancing loss would count the padded "
            f"tokens (HF leaves them out); pack the data without padding (--packing concat or docs)"
        )


class DhelixStepMixin:
    """Step logic shared by the ds_dhelix engines (mixed in before a ``DeepSpeedEngine`` class)."""

    objective_metrics: dict | None = None
    """An objective's metrics of the last step (``objectives``; None for cross-entropy)."""

    dhelix_engine = True
    """Marks ds_dhelix's engines for ``guard`` (they remove the dhelix section before DeepSpeed reads it)."""

    load_report = None
    """``build.LoadReport`` when the build read this rank's shards from a checkpoint, else None."""

    def _broadcast_model(self) -> None:
        """DeepSpeed's broadcast over data-parallel ranks, then the TP-replicated weights made the
        first TP rank's (``ReplicatedGrads.equalize``). DeepSpeed's ``__init__`` calls it once the
        model is on its device, before the optimizer copies the parameters."""
        super()._broadcast_model()
        graph = getattr(self.module, "graph", None) or getattr(self.module, "dhelix_graph", None)
        if graph is not None and graph.replicated is not None:
            graph.replicated.equalize(among={id(p) for p in self.module.parameters()})

    def setup_strands(self, dhelix, groups, graph, plan, **executor_options) -> None:
        """Everything a step needs; call after the DeepSpeed engine's own ``__init__``."""
        self.dhelix, self.groups, self.graph, self.plan = dhelix, groups, graph, plan
        self.meter = ActivationMeter(self.module.parameters())
        self.watchdog = Watchdog(dhelix.watchdog_s, self.global_rank).start()
        self.watchdog.pause()  # armed only inside a step
        self.recorder = TraceRecorder(self.global_rank) if dhelix.trace.enabled else None
        self.executor = Executor(
            graph, plan, meter=self.meter, recorder=self.recorder, watchdog=self.watchdog, **executor_options
        )
        self.last_stats, self.last_loss = StepStats(), None
        warning = cuda_connections_warning(torch.device(self.device))
        if warning and self.global_rank == 0:
            logger.warning(warning)
        self._step_t0 = 0.0
        self.steps_run = 0  # steps of this process (a resumed engine's global_steps starts higher)
        self.auto = self._make_auto() if dhelix.schedule == "auto" else None
        self.step_schedule()

    def _make_auto(self) -> AutoSchedule:
        """``"schedule": "auto"``'s chooser over the layout's candidates (``auto_schedules``; "intra" left
        out, with a warning, when a micro-batch has one sample: check_setup refused it if fewer than 2
        remain). On one stage whose op graph has no collective (``nothing_to_hide``) it takes
        sequential without a trial, logged with the reason. Every rank decides on the slowest
        rank's figures (an all-reduce of them), so all ranks take the same schedule."""
        candidates = [
            c for c in self.dhelix.auto_schedules if c != "intra" or self.train_micro_batch_size_per_gpu() >= 2
        ]
        if len(candidates) < len(self.dhelix.auto_schedules) and self.global_rank == 0:
            logger.warning(
                "ds_dhelix: schedule auto leaves out 'intra': it splits a micro-batch in two along the "
                "batch, and train_micro_batch_size_per_gpu is 1"
            )

        def reduce_max(values: list) -> list:
            t = torch.tensor(values, dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.tolist()

        # one stage only: a pipeline's candidates also differ in their bubbles and stage-to-stage sends
        untimed = nothing_to_hide(self.graph) if self.dhelix.pipeline.stages == 1 else None
        auto = AutoSchedule(
            candidates, self.dhelix.auto_trials, self.dhelix.auto_recheck_steps, reduce_max, untimed_reason=untimed
        )
        if auto.decisions and self.global_rank == 0:  # chosen without a trial: said now, before step 1
            logger.info(describe_decision(auto.decisions[-1]))
        return auto

    def step_schedule(self) -> str:
        """The schedule the next step runs (and ``current_schedule`` from then on)."""
        auto = getattr(self, "auto", None)
        self.current_schedule = self.dhelix.schedule if auto is None else auto.schedule()
        return self.current_schedule

    def destroy(self):
        self.watchdog.stop()
        super().destroy()

    def optimizer_state_bytes(self) -> int:
        """Bytes this rank's optimizer holds beside the model: its state (Adam's moments, ...) and
        fp32 master copies (ZeRO's partitions, a mixed-precision optimizer's copies)."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # ZeRO / fp16 wrappers hold the torch one
        model = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        seen, total = set(), 0
        tensors = [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t)]
        tensors += [p for g in inner.param_groups for p in g["params"]]
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr in model or ptr in seen:
                continue
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return total

    # ------------------------------------------------------------------ checkpoints
    def frozen_names(self) -> list[str]:
        """Parameters that train nothing (a LoRA model's base, any ``requires_grad=False``)."""
        return [n for n, p in self.module.named_parameters() if not p.requires_grad]

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint without the frozen parameters: the model a run is built from
        holds them (a LoRA checkpoint is the adapters and their optimizer state), and DP rank 0's
        frozen expert shards would otherwise be loaded by every rank."""
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        out = super().save_checkpoint(
            save_dir,
            tag,
            {} if client_state is None else client_state,
            save_latest,
            exclude_frozen_parameters or bool(self.frozen_names()),
        )
        from .reshard import write_record

        write_record(self, os.path.join(save_dir, tag))
        return out

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        """DeepSpeed's load, or, for a checkpoint of another TP / DP / EP / CP layout, ZeRO stage or
        precision (its shard records differ from this engine's) or one converted offline, the
        resharded load (``ds_dhelix.engine.reshard``): every caller of ``load_checkpoint`` (the HF
        Trainer's resume too) continues on any layout. Returns DeepSpeed's ``(path, client_state)``."""
        from .reshard import load_if_resharded

        if tag is None and os.path.isfile(os.path.join(load_dir, "latest")):
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        saved = load_if_resharded(self, load_dir, str(tag)) if tag is not None else None
        self.loaded_resharded = saved is not None
        if self.loaded_resharded:
            return os.path.join(load_dir, str(tag)), {"dhelix_run_state": saved}
        out = super().load_checkpoint(load_dir, tag=tag, **kwargs)
        detach_optimizer_state(self.optimizer)
        return out

    def load_module_state_dict(self, checkpoint, strict=True, **kwargs):
        """Frozen parameters are not in the checkpoint (``save_checkpoint``): every trained one must be."""
        frozen = set(self.frozen_names())
        saved = checkpoint.get("module") if isinstance(checkpoint, dict) else None
        if frozen and saved is not None:
            missing = [n for n, _ in self.module.named_parameters() if n not in frozen and n not in saved]
            if missing:
                raise ValueError(
                    f"checkpoint lacks {len(missing)} trained parameters ({', '.join(missing[:3])}, ...): "
                    f"it was saved from another model or another set of trained parameters"
                )
        return super().load_module_state_dict(checkpoint, strict=strict and not frozen, **kwargs)

    @contextlib.contextmanager
    def watched(self, what: str):
        """Arm the watchdog around work outside a step (a checkpoint save, the HF export): a hang
        there is reported as ``what`` and ends the rank too."""
        self.watchdog.resume(step=self.global_steps, microbatch="-", strand="-", op=what)
        try:
            yield
        finally:
            self.watchdog.pause()

    def failure_position(self) -> str:
        """Where this rank was when a collective outside the executor's own failed (DeepSpeed's
        gradient reduction, the optimizer step, a checkpoint save): the watchdog's last op."""
        op = self.watchdog.op
        return f"during {op}" if op else "before the first step"

    def pull_batches(self, data_iter, count: int | None = None) -> list[dict]:
        """The step's ``gradient_accumulation_steps`` micro-batches (or ``count``), on this engine's
        device; every one must have the same shape."""
        count = self.gradient_accumulation_steps() if count is None else count
        batches = [
            {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in next(data_iter).items()}
            for _ in range(count)
        ]
        shape = tuple(batches[0]["input_ids"].shape)
        for k, b in enumerate(batches):
            got = tuple(b["input_ids"].shape)
            if got != shape:
                raise ValueError(
                    f"micro-batch {k} has shape {got}, expected {shape}: every micro-batch "
                    f"of a step must have the same [batch, sequence] shape"
                )
            check_attention_mask(b, k, moe=self.graph.is_moe)
        return batches

    def begin_step(self) -> StepStats:
        stats = self.executor.start_step()
        if self.graph.meta.get("objective") is not None:  # (an evaluation's pairs are not the step's)
            self.graph.meta["objective"].metrics.reset()
        self.meter.reset_peak()
        self.step_lr = self.get_lr()[0]  # what this step's update runs at (the scheduler moves after it)
        self._step_t0 = time.perf_counter()
        self.watchdog.resume(step=self.global_steps)
        return stats

    def guarded_step(self, batches: list[dict], run, loss_of):
        """One training step: ``run()`` (the micro-batches and the optimizer step, the watchdog
        armed) then ``end_step`` with ``loss_of(run's result)``; a collective that fails anywhere in
        it, DeepSpeed's own included, is named by the watchdog's last position. Returns the loss."""
        stats = self.begin_step()
        with collective_failures(self.failure_position, dist.group.WORLD):
            try:
                out = run()
            finally:
                self.watchdog.pause()
            self.watchdog.beat(op=STEP_END)
            self.end_step(stats, loss_of(out), batches)
        return self.last_loss

    def end_step(self, stats: StepStats, loss, batches: list[dict]) -> None:
        """After the optimizer step (watchdog paused): record the step's numbers, log them, give
        auto's chooser the step's time (logging a decision when it makes one), write the trace when
        due."""
        self.executor.finish_device_times()
        if self.auto is not None and torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()  # auto times steps: none may leave device work to the next
        stats.peak_activation_bytes = self.meter.peak
        stats.step_s = time.perf_counter() - self._step_t0
        self.last_stats, self.last_loss = stats, loss
        self.steps_run += 1
        self.log_step(batches)
        if self.auto is not None:
            decision = self.auto.record(self.global_steps, stats.step_s)
            if decision is not None and self.global_rank == 0:
                logger.info(describe_decision(decision))
        self.maybe_dump_trace()

    def mean_loss(self, mbs) -> torch.Tensor:
        """The step's loss: the micro-batches' mean, TP and CP shares summed, averaged over DP replicas."""
        loss = torch.stack([mb.loss.detach().float() for mb in mbs]).mean()
        g = self.groups
        if g.cp_size > 1:  # shares -> full loss, in one sum over the TP x CP ranks of a sequence
            dist.all_reduce(loss, group=g.sequence_group)
        elif g.tp_size > 1:
            dist.all_reduce(loss, group=g.tp_grad_group)
        if self.groups.dp_size > 1:
            dist.all_reduce(loss, group=self.groups.dp_group)
            loss /= self.groups.dp_size
        return loss

    def sequence_losses(self, mbs) -> torch.Tensor:
        """Each micro-batch's loss [len(mbs)] on this data-parallel replica (TP and CP shares
        summed, no DP average): what a token-weighted evaluation weighs by the targets. (``mean_loss``
        reduces the mean instead of the vector: the same value, but its float order is what the
        golden losses hold.)"""
        losses = torch.stack([mb.loss.detach().float() for mb in mbs])
        g = self.groups
        if g.cp_size > 1:
            dist.all_reduce(losses, group=g.sequence_group)
        elif g.tp_size > 1:
            dist.all_reduce(losses, group=g.tp_grad_group)
        return losses

    def logs_this_step(self) -> bool:
        """Rank 0 writes TensorBoard scalars this step (monitor on, every ``log_interval`` steps)."""
        return self.monitor.enabled and self.global_rank == 0 and self.global_steps % self.dhelix.log_interval == 0

    def _reduce_objective_metrics(self) -> None:
        """An objective's step metrics (``objectives.METRICS`` / ``KTO_METRICS`` / ``GRPO_METRICS``): summed over the
        ranks of a sequence and the replicas (every rank), then means: ``self.objective_metrics``."""
        objective = self.graph.meta.get("objective")
        self.objective_metrics = None
        if objective is None or objective.metrics.sums is None:
            return
        sums = objective.metrics.sums  # (summed in place: ``begin_step`` starts the next step's afresh)
        if objective.ranks > 1:
            dist.all_reduce(sums, group=objective.group)
        if self.groups.dp_size > 1:
            dist.all_reduce(sums, group=self.groups.dp_group)
        self.objective_metrics = objective.metrics.means(sums)

    def log_step(self, batches) -> None:
        self._reduce_objective_metrics()
        s = self.last_stats
        tokens = sum(b["input_ids"].numel() for b in batches) * self.groups.dp_size
        s.tokens_per_s = tokens / max(s.step_s, 1e-9)
        if not self.logs_this_step():
            return
        step = self.global_steps
        norm = self.get_global_grad_norm()
        events = [
            ("Train/loss", float(self.last_loss), step),
            ("Train/lr", self.step_lr, step),
            ("Train/tokens_per_s", s.tokens_per_s, step),
            ("Train/step_time_s", s.step_s, step),
            ("Train/comm_ms", s.comm_and_exposed[0] * 1e3, step),
            ("Train/exposed_comm_ms", s.comm_and_exposed[1] * 1e3, step),
            ("Train/hidden_comm_fraction", s.hidden_fraction, step),
            ("Train/peak_activation_bytes", float(s.peak_activation_bytes), step),
        ]
        if norm is not None:
            events.append(("Train/grad_norm", float(norm), step))
        if s.starved_share is not None:  # CUDA: compute ops that found the GPU idle at launch
            events.append(("Train/starved_launch_fraction", s.starved_share, step))
        if s.dp_reduce_s is not None:  # the data-parallel reduction; the part the step waited for
            events.append(("Train/dp_reduce_ms", s.dp_reduce_s * 1e3, step))
            events.append(("Train/dp_exposed_ms", s.dp_exposed_s * 1e3, step))
        auto = getattr(self, "auto", None)
        if auto is not None:  # which candidate ran the step (its index in auto.candidates: intra left out
            # for one-sample micro-batches)
            events.append(("Train/auto_schedule", float(auto.candidates.index(self.current_schedule)), step))
        if self.fp16_enabled():
            events.append(("Train/loss_scale", float(self._get_optimizer_loss_scale()), step))
        for name, value in (self.objective_metrics or {}).items():  # (TRL's names, under Train/)
            events.append((f"Train/{name}", value, step))
        self.monitor.write_events(events)

    def maybe_dump_trace(self) -> None:
        """After ``trace.steps`` steps: every rank writes its spans, rank 0 merges them; the
        recorder stops recording."""
        if self.recorder is None or not self.recorder.enabled or self.steps_run < self.dhelix.trace.steps:
            return
        path = self.dhelix.trace.path
        self.recorder.dump(f"{path}.rank{self.global_rank}")
        self.recorder.stop()
        dist.barrier()
        if self.global_rank == 0:
            parts = [f"{path}.rank{r}" for r in range(dist.get_world_size())]
            merge_traces(parts, path)
            for p in parts:
                os.remove(p)
            logger.info(f"ds_dhelix: trace of {self.steps_run} steps written to {path}")
        dist.barrier()


def detach_optimizer_state(optimizer) -> None:
    """Every tensor of the optimizer's state as a plain tensor. DeepSpeed's ZeRO-1/2 load hands the
    Muon momentum of an expert-parallel group back as a tensor that requires grad, and the next
    step's in-place commit of the momentum then fails ("a leaf Variable that requires grad is being
    used in an in-place operation"; found by the feature matrix: Qwen3-MoE, EP=2, ZeRO-2, Muon,
    resumed). Optimizer state is never differentiated, so detaching changes nothing else."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in getattr(inner, "state", {}).values():
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                state[key] = value.detach()
