"""The folded pipeline engine: DeepSpeed's ``PipelineEngine`` running our schedules (W, DualPipeV
with SI, sequential fold) through the SI executor.

It subclasses :class:`deepspeed.runtime.pipe.engine.PipelineEngine` (constructed directly:
``deepspeed.initialize`` hard-codes its engine class) with a :class:`FoldedPipelineModule`, and keeps
DeepSpeed's grid (pipe x data x model groups, the ``mpu``), its data-parallel gradient reduction
(``_exec_reduce_grads``: ZeRO-1's ``reduce_gradients(pipeline_parallel=True)`` or the buffered
all-reduce for ZeRO-0), its clipping over the pipe x model group and its optimizer step
(``_exec_optimizer_step``). It replaces the per-instruction execution: a step is one rank's instruction list
(:mod:`ds_dhelix.schedule`), run by the interpreter the one-stage engine uses too
(:mod:`ds_dhelix.runtime.interpreter`: compute instructions on the rank's two chunks, phase 0 and
phase 1, the loss at the end of phase 1 on stage 0), with this engine's handlers for the rest::

    Send* / Recv*           torch.distributed isend / irecv on a p2p group, one tag per
                            (micro-batch, chunk boundary, kind, tensor); never blocking
    WaitRecv / WaitSends    wait for the posted receives / all sends
    ReduceGrads / OptimizerStep   DeepSpeed's

One W steady-state instruction on stage 0 (p = 2, 4 layers; blocks: embed, layer 0 | layer 3,
head) and the blocks the executor pairs, each pair one round (layer pairs by the SI plan's rounds)::

    F2B0'  = F(mb 2, phase 0) x B(mb 0, phase 1)
             depth 0:  F embed      x  B head + loss   (seeded 1/m)
             depth 1:  F layer 0    x  B layer 3
             then      SendActivation(2, phase 0) and SendGrad(0, phase 1) to stage 1

What crosses a stage boundary is every env tensor the later blocks read that the earlier blocks
wrote (liveness over the op graph): ``h`` for dense models, ``h`` plus the routers' ``aux.<i>``
pieces for MoE, so the aux loss computed on stage 0 sends its gradient back into each stage's
routers. Every rank reads the same micro-batches (side inputs are built locally); the loss exists
on stage 0 only, is seeded with 1/m, and is broadcast over the pipeline for reporting.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from hf_models.adapters import num_experts

from ..engine.precision import loss_seed
from ..engine.stepping import DhelixStepMixin
from ..graph.objectives import REFERENCE_KEY
from ..runtime.interpreter import Interpreter
from ..runtime.tasks import MicroBatch
from ..schedule import instructions as S
from ..schedule.registry import PIPELINE, lookup
from .folding import LayerFold, chunk_index
from .module import cast_stand_ins

ACT, GRAD = 0, 1
_KIND = {S.ACTIVATION: ACT, S.GRAD: GRAD}
MAX_CARRIED = 256  # tensors per boundary message (tag space)


# ----------------------------------------------------------------------- what crosses a boundary
def live_keys(graph, after_block: int) -> tuple[str, ...]:
    """Env tensors written by blocks ``<= after_block`` and read by later blocks before they
    rewrite them: what a stage boundary after ``after_block`` must carry."""
    written = {k for blk in graph.blocks[: after_block + 1] for op in blk for k in op.outputs}
    live, defined = [], set()
    for blk in graph.blocks[after_block + 1 :]:
        for op in blk:
            live += [k for k in op.inputs if k in written and k not in defined and k not in live]
            defined.update(op.outputs)
    return tuple(live)


def boundary_keys(graph, fold: LayerFold) -> list[tuple[str, ...]]:
    """Per chunk boundary b (between chunk b and b+1): the carried env keys; ValueError for a key
    whose shape the receiver cannot know (only ``h`` and MoE ``aux.<i>`` are supported)."""
    out = []
    for b in range(2 * fold.num_stages - 1):
        keys = live_keys(graph, fold.chunk_layers(b)[-1] + 1)
        bad = [k for k in keys if k != "h" and not re.fullmatch(r"aux\.\d+", k)]
        if bad or len(keys) > MAX_CARRIED:
            raise ValueError(
                f"a stage boundary of the {graph.family} graph carries {list(keys)}; the pipeline "
                f"can send 'h' and MoE 'aux.<i>' pieces only (at most {MAX_CARRIED})"
            )
        out.append(keys)
    return out


@dataclass
class _StepState:
    mbs: list[MicroBatch]
    recvs: dict = field(default_factory=dict)  # (kind, mb, phase) -> [(key, buffer, work)]
    sends: list = field(default_factory=list)  # [(work, tensor)]


# ---------------------------------------------------------------------------------------- engine
class FoldedPipelineEngine(DhelixStepMixin, PipelineEngine):
    """DeepSpeed pipeline engine for a :class:`FoldedPipelineModule`. Build it with
    ``ds_dhelix.initialize`` (``pipeline.stages > 1``)."""

    def __init__(self, *, dhelix, groups, plan, load_report=None, **kwargs):
        super().__init__(**kwargs)
        if self.bfloat16_enabled() or self.fp16_enabled():
            cast_stand_ins(self.module.hf_model, torch.bfloat16 if self.bfloat16_enabled() else torch.half)
        self.load_report = load_report
        self.setup_strands(
            dhelix, groups, self.module.graph, plan, recompute=dhelix.recompute, react=dhelix.react_to_completions
        )
        self.fold = self.module.fold
        self.blocks = [self.module.chunk_blocks(0), self.module.chunk_blocks(1)]
        loss_phase = 1 if chunk_index(self.stage_id, 1, self.num_stages) == 2 * self.num_stages - 1 else None
        self.interpreter = Interpreter(self.executor, {0: self.blocks[0], 1: self.blocks[1]}, loss_phase)
        self.carried = boundary_keys(self.graph, self.fold)
        cfg = self.module.hf_model.config
        self._hidden, self._experts = cfg.hidden_size, num_experts(cfg)
        self._dtype = next(self.module.parameters()).dtype
        self._schedules: dict[tuple[str, int], list] = {}
        self._state: _StepState | None = None

    def set_dataiterator(self, iterator):
        """Every stage reads the micro-batches (side inputs are built on each rank)."""
        self.training_dataloader, self.data_iterator = None, iterator

    def export_hf(self, out_dir: str, tokenizer=None, max_shard_size="5GB") -> str | None:
        """The whole model as an HF checkpoint written by global rank 0 (collective)."""
        from .module import export_hf_pipeline

        return export_hf_pipeline(
            self.module,
            out_dir,
            tokenizer,
            self.groups.tp_grad_group,
            self.groups.tp_size,
            max_shard_size=max_shard_size,
        )

    def export_adapter(self, out_dir: str, base: str | None = None, tokenizer=None) -> str | None:
        """The LoRA adapter of the whole model as a PEFT directory, from global rank 0 (collective)."""
        from hf_models.lora import is_factor_name

        from ..engine.checkpoint import export_adapter
        from .module import pipeline_tensors

        return export_adapter(
            self.module.hf_model,
            out_dir,
            pipeline_tensors(self.module, self.groups.tp_grad_group, self.groups.tp_size, only=is_factor_name),
            base,
            tokenizer,
        )

    # ------------------------------------------------------------------ steps
    def _rank_schedule(self, name: str, m: int) -> list:
        if (name, m) not in self._schedules:
            self._schedules[name, m] = lookup(name, PIPELINE).schedule(self.num_stages, m)[self.stage_id]
        return self._schedules[name, m]

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the mean
        loss (over micro-batches and data-parallel replicas) on every rank."""
        batches = self.pull_batches(data_iter or self.data_iterator)
        self._check_reference(batches)
        self.module.train()
        return self.guarded_step(
            batches,
            lambda: self._run(batches, self._rank_schedule(self.step_schedule(), len(batches))),
            self._pipeline_loss,
        )

    @torch.no_grad()
    def eval_batch(self, data_iter, num_microbatches: int | None = None, per_microbatch: bool = False) -> torch.Tensor:
        """Mean loss of one step's micro-batches (or ``num_microbatches``), forward only (the
        sequential fold's forwards); ``per_microbatch``: each one's loss on this replica."""
        batches = self.pull_batches(data_iter, num_microbatches)
        self._check_reference(batches)
        order = S.forward_only(self._rank_schedule("sequential", len(batches)))
        self.module.eval()
        self.watchdog.resume(step=self.global_steps)
        try:
            with self.executor.inference():
                mbs = self._run(batches, order)
        finally:
            self.watchdog.pause()
            self.module.train()
        return self._pipeline_loss(mbs, per_microbatch)

    def _check_reference(self, batches: list[dict]) -> None:
        """An objective with a reference model needs its log-probabilities in the batches here: the
        pass with the adapter switched off runs on one-stage engines only."""
        objective = self.graph.meta.get("objective")
        if objective is not None and objective.needs_reference and REFERENCE_KEY not in batches[0]:
            raise ValueError(
                f"dhelix.objective {objective.name!r} with a pipeline: give the reference log-probabilities as "
                f"the batches' {REFERENCE_KEY!r} (the data's reference columns); the pass with the LoRA adapter "
                f"switched off runs on one-stage layouts only"
            )

    def _run(self, batches: list[dict], instructions: list) -> list[MicroBatch]:
        first = self.global_steps * len(batches)  # serials of this step's micro-batches
        mbs = [MicroBatch(k, self.graph.make_side(b, first + k)) for k, b in enumerate(batches)]
        self._state = _StepState(mbs)
        try:
            return self.interpreter.run(instructions, mbs, loss_seed(self, len(mbs)), handlers=self._handlers())
        finally:
            self._state = None

    def _pipeline_loss(self, mbs, per_microbatch: bool = False) -> torch.Tensor:
        """Stage 0's mean loss (TP shares summed, DP averaged), broadcast over the pipeline;
        ``per_microbatch``: its micro-batches' losses on this replica."""
        if self.stage_id == 0:
            loss = self.sequence_losses(mbs) if per_microbatch else self.mean_loss(mbs)
        else:
            loss = torch.zeros((len(mbs),) if per_microbatch else (), dtype=torch.float32, device=self.device)
        dist.broadcast(loss, src=self.grid.stage_to_global(0), group=self.grid.get_pipe_parallel_group())
        return loss

    def _chunk(self, phase: int) -> int:
        return chunk_index(self.stage_id, phase, self.num_stages)

    def _mb(self, index: int) -> MicroBatch:
        return self._state.mbs[index]

    # ------------------------------------------------------------------ p2p instructions
    def _spec(self, key: str, side: dict):
        if key == "h":
            return (side["seq_len"] // self.groups.dims.shards, side["batch"], self._hidden), self._dtype
        return (2, self._experts), torch.float32  # MoE aux piece (see hf_models/phimoe.py)

    def _tag(self, mb: int, boundary: int, kind: int, j: int) -> int:
        return ((mb * 2 * self.num_stages + boundary) * 2 + kind) * MAX_CARRIED + j

    def _post_recv(self, ins, kind: int, boundary: int) -> None:
        mb = self._mb(ins.mb)
        src = self.grid.stage_to_global(ins.peer)
        posted = []
        for j, key in enumerate(self.carried[boundary]):
            shape, dtype = self._spec(key, mb.side)
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buf, src=src, group=self.groups.p2p_group, tag=self._tag(ins.mb, boundary, kind, j))
            posted.append((key, buf, work))
        self._state.recvs[kind, ins.mb, ins.phase] = posted

    def _post_send(self, ins, kind: int, boundary: int, tensors: list[torch.Tensor]) -> None:
        dst = self.grid.stage_to_global(ins.peer)
        side = self._mb(ins.mb).side
        for j, (key, t) in enumerate(zip(self.carried[boundary], tensors)):
            shape, dtype = self._spec(key, side)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise RuntimeError(
                    f"pipeline send of {key!r}: got {tuple(t.shape)} {t.dtype}, the receiver expects {shape} {dtype}"
                )
            t = t.detach().contiguous()
            work = dist.isend(t, dst=dst, group=self.groups.p2p_group, tag=self._tag(ins.mb, boundary, kind, j))
            self._state.sends.append((work, t))

    def _exec_recv_activation(self, ins: S.RecvActivation) -> None:
        self._post_recv(ins, ACT, self._chunk(ins.phase) - 1)

    def _exec_recv_grad(self, ins: S.RecvGrad) -> None:
        self._post_recv(ins, GRAD, self._chunk(ins.phase))

    def _exec_send_activation(self, ins: S.SendActivation) -> None:
        boundary = self._chunk(ins.phase)
        env = self._mb(ins.mb).env
        self._post_send(ins, ACT, boundary, [env[k] for k in self.carried[boundary]])

    def _exec_send_grad(self, ins: S.SendGrad) -> None:
        boundary = self._chunk(ins.phase) - 1
        mb = self._mb(ins.mb)
        grads = []
        for key in self.carried[boundary]:
            g = mb.grads.pop(key, None)
            if g is None:  # no gradient reached it: the receiver still expects a tensor
                shape, dtype = self._spec(key, mb.side)
                g = torch.zeros(shape, dtype=dtype, device=self.device)
            grads.append(g)
        self._post_send(ins, GRAD, boundary, grads)

    def _exec_wait_recv(self, ins: S.WaitRecv) -> None:
        kind = _KIND[ins.kind]
        self.watchdog.beat(microbatch=ins.mb, strand=ins.kind, op=f"wait recv {ins.kind} phase {ins.phase}")
        mb = self._mb(ins.mb)
        target = mb.env if kind == ACT else mb.grads
        t0 = time.perf_counter()
        for key, buf, work in self._state.recvs.pop((kind, ins.mb, ins.phase)):
            work.wait()
            target[key] = buf
        self.executor.record_wait(time.perf_counter() - t0)

    def _exec_wait_sends(self, ins: S.WaitSends) -> None:
        self.watchdog.beat(op="wait sends")
        for work, _ in self._state.sends:
            work.wait()
        self._state.sends.clear()
        assert not self._state.recvs, f"receives posted but never waited: {sorted(self._state.recvs)}"

    def _exec_reduce(self, ins: S.ReduceGrads) -> None:
        self.watchdog.beat(microbatch="-", strand="-", op="gradient reduction")
        self.executor.reduce_replicated_grads()  # TP first, then DeepSpeed's data-parallel reduction
        PipelineEngine._exec_reduce_grads(self)

    def _exec_step(self, ins: S.OptimizerStep) -> None:
        self.watchdog.beat(microbatch="-", strand="-", op="optimizer step")
        PipelineEngine._exec_optimizer_step(self)

    def _handlers(self) -> dict:
        """This engine's part of a step: p2p, DeepSpeed's reduction and optimizer step."""
        return {
            S.SendActivation: self._exec_send_activation,
            S.RecvActivation: self._exec_recv_activation,
            S.SendGrad: self._exec_send_grad,
            S.RecvGrad: self._exec_recv_grad,
            S.WaitRecv: self._exec_wait_recv,
            S.WaitSends: self._exec_wait_sends,
            S.ReduceGrads: self._exec_reduce,
            S.OptimizerStep: self._exec_step,
        }
