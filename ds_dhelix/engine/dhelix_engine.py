"""DhelixEngine: a DeepSpeed engine whose ``train_batch`` runs a whole step with strand
interleaving. ``ds_dhelix.initialize`` (``build.py``) builds it like ``deepspeed.initialize``.

A step of m micro-batches is its schedule's instruction list (``ds_dhelix.schedule``: sequential,
si, si-ends, intra; under "auto" the one ``autoschedule.AutoSchedule`` names for the step) run by
the interpreter (``runtime.interpreter``): the executor runs every forward and backward op by op
(each loss seeded with 1/m, times the fp16 loss scale), leaving gradients on the parameters. The
list ends in ``ReduceGrads`` and ``OptimizerStep``, which DeepSpeed's own code paths carry out
(overflow checks and the loss scale's update under fp16 included): its data-parallel gradient
reduction (ZeRO 1/2: its partitioned buckets; ZeRO 0: the buffered all-reduce; by default driven
during the last backward, ``grad_reduction.py``, else after it: ``coalesce_grad_reduction`` /
``no_sync``), gradient clipping over the model-parallel group, the optimizer and the LR schedule.
"""

from __future__ import annotations

import contextlib
import time

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import logger

from hf_models.lora import adapters_off, has_adapter

from ..config.section import DhelixConfig
from ..graph.objectives import REFERENCE_KEY
from ..planning.plan import SIPlan
from ..runtime.groups import ProcessGroups
from ..runtime.interpreter import Interpreter, prepare, wholes
from ..runtime.tasks import MicroBatch
from ..schedule import instructions as S
from ..schedule.registry import ONE_STAGE, ScheduleSpec, lookup
from .precision import loss_seed
from .stepping import DhelixStepMixin

FEW_MICROBATCHES = 3
"""At or below this many micro-batches per step, SI's unpaired ends are a large share of the step."""


def few_microbatches_hint(num_microbatches: int, pair_ends: bool) -> str | None:
    """The warning for an SI step with too few micro-batches to overlap much, or None.

    With m micro-batches SI pairs F(k+1) with B(k); the first forward and the last backward run
    alone, one micro-batch's compute in all: 1/m of the step runs with nothing to hide its
    communication behind (``pair_ends`` pairs them too)."""
    m = num_microbatches
    if m == 1:
        return (
            "ds_dhelix: one micro-batch per step: SI has nothing to pair (set "
            "gradient_accumulation_steps >= 2 to overlap communication)"
        )
    if m <= FEW_MICROBATCHES and not pair_ends:
        return (
            f"ds_dhelix: {m} micro-batches per step: SI runs the first forward and the last "
            f"backward without a partner, 1/{m} of the step's compute with its communication "
            f'exposed; more gradient_accumulation_steps (e.g. 16) or "dhelix": '
            f'{{"pair_ends": true}} hide more'
        )
    return None


class DhelixEngine(DhelixStepMixin, DeepSpeedEngine):
    """DeepSpeed engine + SI executor. Build it with :func:`ds_dhelix.initialize`."""

    def __init__(
        self, *, dhelix: DhelixConfig, groups: ProcessGroups, graph, plan: SIPlan | None, load_report=None, **kwargs
    ):
        super().__init__(**kwargs)
        self.load_report = load_report
        self.zero3 = self._take_over_zero3(graph, dhelix) if self.zero_optimization_stage() == 3 else None
        self.setup_strands(
            dhelix,
            groups,
            graph,
            plan if dhelix.schedule in ("si", "auto") else None,
            # None: where useful; ZeRO-3 reduces a block's gradients right after its backward
            defer_weight_grads=None if dhelix.defer_weight_grads and self.zero3 is None else False,
            react=dhelix.react_to_completions,
            recompute=dhelix.recompute,
        )
        if self.zero3 is not None:
            self.meter.gathered = self.zero3.storages
        self.interpreter = Interpreter(self.executor)
        self._warned_few = False
        self._overlap = self._make_overlap()

    def _take_over_zero3(self, graph, dhelix):
        """ZeRO-3: DeepSpeed's module and gradient hooks off, the op graph's blocks given their
        gathers and reduce-scatters (``zero3.py``)."""
        from .zero3 import Zero3Blocks, add_zero3_ops, block_parameters

        opt = self.optimizer
        opt.parameter_offload._remove_module_hooks()
        for hook in opt._grad_acc_hooks + opt._leaf_module_hooks:
            hook.remove()
        opt._grad_acc_hooks, opt._leaf_module_hooks = [], []
        max_live = self._config.zero_config.max_live_parameters  # (stage3_max_live_parameters)
        blocks = Zero3Blocks(opt, block_parameters(self.module, graph), dhelix.zero3_prefetch, max_live)
        add_zero3_ops(graph, blocks)
        return blocks

    def export_hf(self, out_dir: str, tokenizer=None, max_shard_size="5GB") -> str | None:
        """Write an HF checkpoint (shards gathered) from global rank 0; collective on all ranks."""
        from .checkpoint import export_hf

        return export_hf(
            self.module,
            out_dir,
            tokenizer,
            self.groups.tp_grad_group,
            self.groups.tp_size,
            max_shard_size=max_shard_size,
        )

    def export_adapter(self, out_dir: str, base: str | None = None, tokenizer=None) -> str | None:
        """Write the LoRA adapter as a PEFT directory from global rank 0 (collective on all ranks)."""
        from hf_models.lora import is_factor_name

        from .checkpoint import export_adapter, hf_tensors

        return export_adapter(
            self.module,
            out_dir,
            hf_tensors(self.module, self.groups.tp_grad_group, self.groups.tp_size, only=is_factor_name),
            base,
            tokenizer,
        )

    # ------------------------------------------------------------------ training
    @property
    def overlaps_grad_reduction(self) -> bool:
        """Whether the data-parallel reduction runs during the last backward (``grad_reduction.py``)."""
        return self._overlap is not None

    def _make_overlap(self):
        if not self.dhelix.overlap_grad_reduction or self.dp_world_size < 2 or self.zero3 is not None:
            return None
        from .grad_reduction import OverlappedReduction

        return OverlappedReduction(self, self.executor)

    @contextlib.contextmanager
    def _dp_reduction(self, mbs):
        """The step's data-parallel reduction; yields what ``ReduceGrads`` calls to finish it (it
        returns the reduction's seconds and the part the step waited for)."""
        replicated = lambda: self.executor.reduce_replicated_grads(mbs[-1].index)  # noqa: E731
        if self.zero3 is not None:  # every block's reduce-scatter ran in the backward
            self.zero3.begin_step()
            try:
                yield self._finish_zero3
            finally:
                self.zero3.release_all()
            return
        if self._overlap is not None:
            self._overlap.begin(len(mbs))
            try:
                yield lambda: self._overlap.finish(replicated)
            except BaseException:
                self._overlap.abort()
                raise
            return
        with contextlib.ExitStack() as reduction:  # ZeRO 1/2 reduce as it closes
            reduction.enter_context(
                self.coalesce_grad_reduction() if self.zero_optimization_stage() else self.no_sync()
            )

            def finish() -> tuple[float, float]:
                replicated()
                t0 = time.perf_counter()
                reduction.close()
                if self.zero_optimization_stage() == 0:
                    self._is_gradient_accumulation_boundary = True
                    self.allreduce_gradients()
                waited = time.perf_counter() - t0
                return waited, waited

            yield finish

    def _finish_zero3(self) -> tuple[float, float]:
        """ZeRO-3's end of the reduction: partitions of trained parameters no micro-batch reached
        zeroed, DeepSpeed's epilogue (its averaged gradients)."""
        t0 = time.perf_counter()
        self.zero3.release_all()
        unreached = self.zero3.unreduced()
        if unreached:
            self.optimizer.micro_step_id = 0
            self.optimizer.partition_grads(unreached, [torch.zeros_like(p.ds_tensor) for p in unreached])
        if self.graph.replicated is not None:  # TP-replicated weights: their partitions summed over TP
            self.graph.replicated.all_reduce(self.zero3.grad_partition)
        self.optimizer.independent_gradient_partition_epilogue()
        waited = time.perf_counter() - t0
        stats = self.executor.stats  # the gathers' and reductions' time, once each
        stats.comm_s, stats.exposed_s = stats.comm_s + self.zero3.comm_s(), stats.exposed_s + self.zero3.waited_s
        return waited, waited

    def destroy(self):
        if self._overlap is not None:
            self._overlap.lane.close()
        super().destroy()

    def _warn_few_once(self, num_microbatches: int) -> None:
        if self.dhelix.schedule in ("si", "auto") and not self._warned_few:
            hint = few_microbatches_hint(num_microbatches, self.dhelix.pair_ends)
            if hint:
                logger.warning(hint)
            self._warned_few = True

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from ``data_iter``.

        Returns the mean loss of the step (over micro-batches and data-parallel ranks)."""
        batches = self.pull_batches(data_iter)
        self._warn_few_once(len(batches))
        self.add_reference(batches)
        self.module.train()
        return self.guarded_step(batches, lambda: self._micro_batches_and_step(batches), self.mean_loss)

    def schedule_spec(self) -> ScheduleSpec:
        """The registry row of the next step's schedule (``si`` with ``pair_ends`` is ``si-ends``)."""
        name = self.step_schedule()
        return lookup("si-ends" if name == "si" and self.dhelix.pair_ends else name, ONE_STAGE)

    def _micro_batches_and_step(self, batches: list[dict]):
        spec = self.schedule_spec()
        mbs = prepare(self.graph, batches, spec, first_serial=self.global_steps * len(batches))
        with self._dp_reduction(mbs) as finish:
            handlers = {
                S.ReduceGrads: lambda ins: self._reduce_grads(finish),
                S.OptimizerStep: lambda ins: self._optimizer_step(len(batches)),
            }
            self.interpreter.run(
                spec.schedule(1, len(batches))[0],
                mbs,
                loss_seed(self, len(batches)),
                defer=spec.defers_weight_grads,
                handlers=handlers,
            )
        return wholes(spec, mbs)

    def _reduce_grads(self, finish) -> None:
        """TP-replicated weights over the TP group, then (the rest of) DeepSpeed's data-parallel
        reduction."""
        self.watchdog.beat(microbatch="-", strand="-", op="gradient reduction and optimizer step")
        reduce_s, exposed_s = finish()
        self._is_gradient_accumulation_boundary = True
        if self.dp_world_size > 1:
            self.executor.stats.dp_reduce_s, self.executor.stats.dp_exposed_s = reduce_s, exposed_s

    def _optimizer_step(self, num_microbatches: int) -> None:
        self.micro_steps += num_microbatches - 1
        self.step()
        self._is_gradient_accumulation_boundary = None

    @torch.no_grad()
    def eval_batch(self, data_iter, num_microbatches: int | None = None, per_microbatch: bool = False) -> torch.Tensor:
        """Mean loss over one step's worth of micro-batches (or ``num_microbatches``), forward only;
        ``per_microbatch``: each micro-batch's loss on this replica instead (``sequence_losses``)."""
        batches = self.pull_batches(data_iter, num_microbatches)
        self.add_reference(batches)
        mbs = self._forward_only(batches)
        return self.sequence_losses(mbs) if per_microbatch else self.mean_loss(mbs)

    def _forward_only(self, batches: list[dict]) -> list[MicroBatch]:
        """The micro-batches run forward in eval mode, no gradients (the watchdog armed)."""
        self.module.eval()
        self.watchdog.resume(step=self.global_steps)
        try:
            mbs = [MicroBatch(k, self.graph.make_side(b)) for k, b in enumerate(batches)]
            with torch.no_grad(), self.executor.inference():
                self.interpreter.run(S.forward_only(lookup("sequential", ONE_STAGE).schedule(1, len(mbs))[0]), mbs, 1.0)
        finally:
            self.watchdog.pause()
            self.module.train()
        return mbs

    def add_reference(self, batches: list[dict]) -> None:
        """A preference objective with a reference model and batches without its log-probabilities
        (``ref_logps``): each row's sum under the frozen base, the LoRA adapter switched off, one
        forward of the step's micro-batches (``objectives``)."""
        objective = self.graph.meta.get("objective")
        if objective is None or not objective.needs_reference or REFERENCE_KEY in batches[0]:
            return
        if not has_adapter(self.module):
            raise ValueError(
                f"dhelix.objective {objective.name!r} compares with the reference model, and a full fine-tune "
                f"changes the only copy of its weights: give each row's reference log-probability sum as the "
                f"batches' {REFERENCE_KEY!r} (TRL's precomputed ref_chosen_logps / ref_rejected_logps), or train LoRA"
            )
        objective.capture = []
        try:
            with adapters_off(self.module):
                self._forward_only(batches)
            rows = objective.capture
        finally:
            objective.capture = None
        for batch, logps in zip(batches, rows):
            batch[REFERENCE_KEY] = logps
