"""The step loop: optimizer steps up to the run's total, evaluation every K steps and after the
last, periodic checkpoints, agreed stops (a signal, a vanished launcher, a job slot's end).

    start ─► step ─► [eval every K] ─► stop agreed? ─► left early? ─► [save every K] ─► step ...
                                         │ (save)        │ (save)
                                         ▼               ▼
                                 log.end "stopped"   log.end "left"       after the last: eval, log.end "done"

``train_loop`` returns a ``TrainLog``; what comes after (final checkpoint, HF export, summary,
leaving the process) is the caller's (train.py: ``finish``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from ..runtime.progress import progress
from .evaluation import evaluate
from .plain import plain_step

LOSS_AVERAGES = ("tokens", "microbatches")


@dataclass
class LoopOptions:
    """How the loop runs (train.py's flags of the same names)."""

    steps: int
    """The run's total optimizer steps: an engine resumed at step s trains steps s+1 .. ``steps``."""
    eval_interval: int = 0
    """Evaluate every K steps and after the last (0: after the last only, when the data has eval blocks)."""
    loss_average: str | None = None
    """A step's loss: "tokens" (summed over its targets on every replica / their count) or
    "microbatches" (the mean of micro-batch means); None: tokens when the loss is on the answers."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (``ds_dhelix.engine.resume``): every ``save_interval`` steps, on a stop."""
    save_interval: int = 0
    """Save a checkpoint every K steps (0: off)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept (the newest)."""
    stop_after: int = 0
    """Leave with a checkpoint after N steps of this call (0: off); the run stays ``steps`` long."""
    save_on_signal: bool = False
    """On an agreed stop (SIGTERM / SIGINT / a vanished launcher) save a checkpoint first."""
    prog: str = "ds_dhelix"
    """The prefix of the loop's messages (train.py: "train.py")."""

    def __post_init__(self):
        for name in ("steps", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoopOptions.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_interval", "save_interval", "stop_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"LoopOptions.{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.loss_average not in (None, *LOSS_AVERAGES):
            raise ValueError(f"LoopOptions.loss_average {self.loss_average!r}: use one of {', '.join(LOSS_AVERAGES)}")
        for name, on in (
            ("save_interval", self.save_interval > 0),
            ("stop_after", self.stop_after > 0),
            ("save_on_signal", self.save_on_signal),
        ):
            if on and not self.checkpoint_dir:
                raise ValueError(f"LoopOptions.{name} saves checkpoints: set checkpoint_dir")


@dataclass
class TrainLog:
    """What the loop did: one entry per step it ran (``losses``, ``lrs``: the LR each step ran at, ``times`` in seconds;
    ``stats``: the ds_dhelix engine's ``StepStats``), ``eval_losses`` as ``{"step", "loss"}``."""

    start_step: int
    tokens_per_step: int  # micro x accumulation x sequence x data-parallel replicas
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    stats: list = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    eval_losses: list[dict] = field(default_factory=list)
    objective: list[dict] = field(default_factory=list)  # a preference objective's metrics per step
    end: str = "done"  # "done": at the total; "left": stop_after; "stopped": an agreed stop
    checkpoint: str | None = None  # the checkpoint saved on leaving or stopping
    exit_code: int = 0  # "stopped": 128 + the signal (143 for a vanished launcher)


def loss_average(choice: str | None, data) -> str:
    """``choice``, or its default for the data (tokens when the loss is on the answers; a
    preference objective's pairs: micro-batches, each holding the same number of pairs)."""
    return choice or ("tokens" if data.loss_on == "answers" else "microbatches")


def train_loop(engine, data, options: LoopOptions, run_state: dict | None = None) -> TrainLog:
    """Train ``engine`` (``ds_dhelix.initialize``'s, or plain DeepSpeed's) on ``data``
    (``ds_dhelix.data.TrainingData``) from its current step to ``options.steps``: the blocks in
    ``data.options.seed``'s order, each replica its share, continuing a resumed engine's position.
    ``run_state``: what checkpoints record (``ds_dhelix.training.run_state``). Collective."""
    import torch.distributed as dist

    from ds_dhelix.engine.evaluation import data_parallel
    from ds_dhelix.engine.stopping import StopRequest

    if options.eval_interval and data.eval is None:
        raise ValueError(
            "LoopOptions.eval_interval evaluates on the data's eval blocks: load the data with "
            "eval_path or eval_fraction"
        )
    dp_rank, dp_size, dp_group = data_parallel(engine)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    start = engine.global_steps
    batches = data.batches(micro, seed=data.options.seed, rank=dp_rank, replicas=dp_size, start=start * gas)
    if loss_average(options.loss_average, data) == "tokens":
        batches = weighed_by_targets(batches, gas, dp_size, dp_group, engine.device)
    stop = StopRequest.install()
    rows = micro * (2 if data.format in ("preference", "unpaired") else 1)  # (a pair is two rows; KTO: a KL row)
    log = TrainLog(start, rows * gas * data.options.seq_len * dp_size)
    log_data_fields(engine, data, start)
    bar = progress(total=options.steps, initial=start, desc="train", disable=dist.get_rank() != 0, dynamic_ncols=True)
    for _ in range(start, options.steps):
        _one_step(engine, batches, log, bar)
        if _between_steps(engine, data, options, run_state, log, stop, bar):
            stop.close()
            return log
    bar.close()
    stop.close()
    if data.eval is not None and start < options.steps:
        log.eval_losses.append(evaluate(engine, data.eval, micro, options.prog))
    return log


def _between_steps(engine, data, options: LoopOptions, run_state, log: TrainLog, stop, bar) -> bool:
    """Evaluation, an agreed stop, leaving early and the periodic checkpoint after a step (not
    after the last: the run's end does those); True: the loop leaves now."""
    import torch.distributed as dist

    step, total = engine.global_steps, options.steps
    if options.eval_interval and step % options.eval_interval == 0 and step < total:
        log.eval_losses.append(evaluate(engine, data.eval, engine.train_micro_batch_size_per_gpu(), options.prog))
    reason = stop.agreed()
    if reason and step < total:  # after the last step: finish (export) instead
        bar.close()
        _stopped(engine, options, run_state, log, stop, reason)
        return True
    if step < total and options.stop_after and step - log.start_step >= options.stop_after:
        bar.close()
        log.end, log.checkpoint = "left", save_checkpoint(engine, options, run_state)
        if dist.get_rank() == 0:
            print(
                f"{options.prog}: leaving after step {step} of {total} (--stop-after {options.stop_after}); "
                f"checkpoint {log.checkpoint}; continue with --resume auto"
            )
        return True
    if options.save_interval and step % options.save_interval == 0 and step < total:
        save_checkpoint(engine, options, run_state)
    return False


def _stopped(engine, options: LoopOptions, run_state, log: TrainLog, stop, reason: str) -> None:
    import torch.distributed as dist

    saved = save_checkpoint(engine, options, run_state) if options.save_on_signal else None
    if dist.get_rank() == 0:
        what = f"; checkpoint saved to {saved}" if saved else " (no checkpoint: --save-on-signal was not given)"
        print(
            f"{options.prog}: stopped by {reason} after step {engine.global_steps}{what}", file=sys.stderr, flush=True
        )
    log.end, log.checkpoint, log.exit_code = "stopped", saved, stop.exit_code()


def _one_step(engine, batches, log: TrainLog, bar) -> None:
    from ds_dhelix.engine.evaluation import is_dhelix

    lr = float(engine.get_lr()[0])  # the LR this step runs at (DeepSpeed's scheduler moves after the step)
    t0 = time.perf_counter()
    if is_dhelix(engine):
        loss = engine.train_batch(batches)
        log.stats.append(engine.last_stats)
        if getattr(engine, "objective_metrics", None) is not None:
            log.objective.append(engine.objective_metrics)
    else:
        loss = plain_step(engine, batches)
    log.times.append(time.perf_counter() - t0)
    log.losses.append(float(loss))
    log.lrs.append(lr)
    bar.set_postfix(loss=f"{log.losses[-1]:.3f}", tok_s=f"{log.tokens_per_step / log.times[-1]:.0f}")
    bar.update(1)


def save_checkpoint(engine, options: LoopOptions, run_state: dict | None = None) -> str:
    """A checkpoint of the current step under ``options.checkpoint_dir`` (the newest
    ``keep_checkpoints`` kept), recording ``run_state`` at this step. Collective."""
    from ds_dhelix.engine import resume
    from ds_dhelix.engine.evaluation import watched

    state = dict(
        {"step": 0, "total_steps": options.steps} if run_state is None else run_state, step=engine.global_steps
    )
    with watched(engine, "checkpoint save"):
        return resume.save(engine, os.path.abspath(options.checkpoint_dir), state, options.keep_checkpoints)


def weighed_by_targets(batches, gas: int, dp_size: int, dp_group, device="cpu"):
    """The micro-batches, each step's ``gas`` carrying the step's ``loss_denominator``: its target
    count over every data-parallel replica / (gas x replicas), so the engine's mean over micro-
    batches and replicas is the step's summed loss over its targets (one all-reduce per step, on
    ``device``: the engine's, so an NCCL data-parallel group takes it)."""
    import torch
    import torch.distributed as dist

    from ds_dhelix.data import valid_targets

    while True:
        step = [next(batches) for _ in range(gas)]
        count = torch.tensor([float(sum(valid_targets(b["labels"]) for b in step))], dtype=torch.float64, device=device)
        if dp_size > 1:
            dist.all_reduce(count, group=dp_group)
        denominator = max(float(count) / (gas * dp_size), 1e-12)
        yield from ({**b, "loss_denominator": denominator} for b in step)


def log_data_fields(engine, data, step: int) -> None:
    """What the loss is computed on, in TensorBoard (``Data/...``, at the run's first step)."""
    import torch.distributed as dist

    if not engine.monitor.enabled or dist.get_rank() != 0:
        return
    s = data.stats
    engine.monitor.write_events(
        [
            (f"Data/{k}", float(v), step)
            for k, v in (
                ("records", s.records),
                ("tokens", s.tokens),
                ("loss_tokens", s.loss_tokens),
                ("truncated", s.truncated),
                ("dropped", s.dropped),
                ("padding_fraction", s.padding_fraction),
            )
        ]
    )


def teardown(engine) -> None:
    """A clean end: every rank past its last collective, the engine's threads stopped and the
    process groups destroyed before the interpreter exits (a communication thread still running
    at exit aborts the process: "terminate called without an active exception", exit -6)."""
    import torch.distributed as dist

    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()
