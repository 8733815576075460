"""The data-parallel gradient reduction, overlapped with the step's last backward.

Left to DeepSpeed, a step's gradients are reduced over the data-parallel group after its last
backward (ZeRO 1/2: the flush of ``coalesce_grad_reduction``; ZeRO 0: ``allreduce_gradients``),
where nothing hides it. Here the same DeepSpeed reduction is driven parameter by parameter while
the last backward runs:

- **Order.** The trained parameters in the order their gradients become final in a backward: by
  the first op (forward order) that adds to them, the last such op first; inside one op, the
  module's parameter order. TP-replicated weights (summed over the TP group first) are left to the
  end. The order is the op graph's as the steps before showed it (the first step has none: all
  its gradients are reduced at the end), not the schedule's, so every schedule makes the same
  calls in the same order: SI stays bitwise sequential.
- **Cue.** The executor calls ``grads_done(task)`` when a backward op's gradients for one
  micro-batch are in (after its deferred weight-gradient pass). When an op has done so for every
  micro-batch of the step, its parameters are final; the longest final prefix of the order is
  handed on (an op that shows new parameters during the step stops that: the rest waits for
  the end, in the same order).
- **Lane.** gloo's collectives block the thread that calls them, so on CPU one helper thread runs
  the handed reductions in order while the backward goes on. On CUDA they run at once on the main
  thread, on a side stream that waits for the compute stream (NCCL returns at once; one launching
  thread keeps every rank's order of DP and TP / EP collectives the same); the gradients DeepSpeed
  moves into its buckets are kept alive until the compute stream has waited for the side stream.
- **DeepSpeed does the reducing.** ZeRO 1/2: ``reduce_ready_partitions_and_remove_grads`` per
  parameter (its buckets of ``zero_optimization.reduce_bucket_size`` elements, reduced as they
  fill; the rest in its epilogue). ZeRO 0: its all-reduce of a bucket (``_reduce_non_expert_gradients``
  / ``_reduce_expert_gradients``), one per ``reduce_bucket_size`` elements of the order.
- **Finish** (the schedule's ``ReduceGrads``): the TP-replicated gradients over the TP group, a
  wait for the lane, what is left (in the same order), DeepSpeed's epilogue. ``StepStats.dp_reduce_s``
  is the reduction's time, ``dp_exposed_s`` the part the step waited for.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch


class Lane:
    """gloo (CPU): one daemon thread running submitted calls in order (``drain`` waits for them);
    its collectives block it, not the backward. ``busy_s``: seconds spent in them since the last
    ``reset``. An error is raised again by ``drain``; after one, later calls are dropped."""

    def __init__(self, name: str = "ds_dhelix-dp-reduce"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            t0 = time.perf_counter()
            try:
                if self._error is None:
                    fn()
            except BaseException as err:  # handed to the main thread by drain()
                self._error = err
            finally:
                self.busy_s += time.perf_counter() - t0
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def drain(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def reset(self) -> None:
        self.busy_s = 0.0

    def close(self) -> None:
        """End the thread once the work handed to it is done."""
        self._queue.put(None)


class StreamLane:
    """CUDA: the calls run at once on the calling (main) thread, on a side stream that first waits
    for the compute stream (NCCL returns at once, so nothing blocks; launching from one thread keeps
    every rank's order of DP and TP / EP collectives the same, which NCCL needs across
    communicators). ``drain`` makes the compute stream wait for the side stream."""

    def __init__(self, device: torch.device):
        self.device, self._stream = device, torch.cuda.Stream(device)
        self.busy_s = 0.0

    def submit(self, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            fn()
        self.busy_s += time.perf_counter() - t0

    def drain(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def reset(self) -> None:
        self.busy_s = 0.0

    def close(self) -> None:
        pass


class ZeroReducer:
    """ZeRO 1/2: DeepSpeed's partitioned reduction, parameter by parameter (``reduce_ready_
    partitions_and_remove_grads``); between ``open`` and ``close`` its hooks stay off, as inside
    ``coalesce_grad_reduction``."""

    def __init__(self, engine):
        self.engine, self.opt = engine, engine.optimizer
        self.group_of = {id(p): i for i, group in enumerate(self.opt.bit16_groups) for p in group}
        self.params = [p for group in self.opt.bit16_groups for p in group if p.requires_grad]
        self._saved_boundary = None
        self._kept: list = []

    def open(self) -> None:
        self._saved_boundary = self.engine._is_gradient_accumulation_boundary
        self.engine.inside_no_sync_ctxt = True
        self.opt._coalesce_grad_reduction = True

    def start(self) -> None:
        """Before the first reduction (main thread): the boundary set, the buckets ready."""
        self.opt.set_gradient_accumulation_boundary(True)
        if getattr(self.opt, "overlap_comm", False) and hasattr(self.opt, "reduction_stream"):
            from deepspeed.accelerator import get_accelerator

            if not get_accelerator().resolves_data_dependency():
                self.opt.reduction_stream.synchronize()
        self.opt.setup_buckets()

    def add(self, params) -> None:
        for p in params:
            g = self.opt.get_gradient_for_reduction(p)
            if g is None:
                continue
            if g.is_cuda:  # DeepSpeed re-points .grad into its bucket, freeing the memory the compute
                self._kept.append(g.detach())  # stream made; kept until that stream waited for ours
            self.opt.reduce_ready_partitions_and_remove_grads(p, self.group_of[id(p)])

    def close(self) -> None:
        self.opt._coalesce_grad_reduction = False
        self.engine.inside_no_sync_ctxt = False
        self.opt.overlapping_partition_gradients_reduce_epilogue()
        self.engine._is_gradient_accumulation_boundary = self._saved_boundary
        self._kept = []

    def abort(self) -> None:
        self.opt._coalesce_grad_reduction = False
        self.engine.inside_no_sync_ctxt = False
        self.engine._is_gradient_accumulation_boundary = self._saved_boundary


class PlainReducer:
    """ZeRO 0: DeepSpeed's bucketed all-reduce (expert gradients over their expert-data-parallel
    group), one call per ``bucket`` elements of the order; a missing gradient counts as zeros, as
    DeepSpeed's own reduction has it."""

    def __init__(self, engine, bucket: int):
        self.engine, self.bucket = engine, max(int(bucket), 1)
        self.params = [p for p in engine.module.parameters() if p.requires_grad and p.numel()]
        self._held: list = []
        self._held_numel = 0

    def open(self) -> None:
        self.engine.inside_no_sync_ctxt = True
        self._held, self._held_numel = [], 0

    def start(self) -> None:
        pass

    def add(self, params) -> None:
        for p in params:
            self._held.append(p)
            self._held_numel += p.numel()
            if self._held_numel >= self.bucket:
                self._reduce()

    def _reduce(self) -> None:
        from deepspeed.moe.utils import is_moe_param

        dense, experts = [], {}
        for p in self._held:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if is_moe_param(p):
                experts.setdefault(p.group_name, []).append(p.grad.data)
            else:
                dense.append(p.grad.data)
        self._held, self._held_numel = [], 0
        if dense:
            self.engine._reduce_non_expert_gradients(dense, self.bucket)
        if experts:
            self.engine._reduce_expert_gradients(experts, self.bucket)

    def close(self) -> None:
        if self._held:
            self._reduce()
        self.engine.inside_no_sync_ctxt = False

    def abort(self) -> None:
        self._held, self._held_numel = [], 0
        self.engine.inside_no_sync_ctxt = False


def reduction_order(executor, params) -> list:
    """``params`` (those some op adds to and not TP-replicated) in the order their gradients become
    final in a backward: by the first op that adds to them, last first; ties in ``params``' order."""
    rank = {id(p): k for k, p in enumerate(params)}
    first: dict[int, int] = {}
    position = 0
    for b, block in enumerate(executor.graph.blocks):
        for i, _ in enumerate(block):
            for p in executor.op_params((b, i)):
                if id(p) in rank and not getattr(p, "tp_replicated", False):
                    first.setdefault(id(p), position)
            position += 1
    chosen = [p for p in params if id(p) in first]
    return sorted(chosen, key=lambda p: (-first[id(p)], rank[id(p)]))


class OverlappedReduction:
    """The step's data-parallel reduction driven from the executor's ``grads_done`` cue (module
    docstring): ``begin(m)`` for a step of ``m`` micro-batches, ``finish()`` at its ``ReduceGrads``,
    ``abort()`` when it failed."""

    def __init__(self, engine, executor):
        self.engine, self.executor = engine, executor
        stage = engine.zero_optimization_stage()
        bucket = engine.zero_reduce_bucket_size()
        self.reducer = ZeroReducer(engine) if stage >= 1 else PlainReducer(engine, bucket)
        self.device = next((p.device for p in self.reducer.params), torch.device("cpu"))
        self.lane = StreamLane(self.device) if self.device.type == "cuda" else Lane()
        self.failed = False  # a step failed mid-reduction: DeepSpeed's reduction state is lost
        self._version = None
        self._order: list = []
        self._ops_of: dict = {}  # op key -> ids of its parameters in the order
        self._users: dict[int, int] = {}  # id(param) -> ops that add to it
        self.handed_early = 0  # parameters handed on during the last step's backward (of ``len(order)``)

    @property
    def order(self) -> list:
        return list(self._order)

    # ------------------------------------------------------------------ the order
    def _refresh(self) -> None:
        ex = self.executor
        if self._version == ex.weights_version:
            return
        self._version = ex.weights_version
        self._order = reduction_order(ex, self.reducer.params)
        ids = {id(p) for p in self._order}
        self._ops_of, self._users = {}, {}
        for b, block in enumerate(ex.graph.blocks):
            for i, _ in enumerate(block):
                mine = [id(p) for p in ex.op_params((b, i)) if id(p) in ids]
                if mine:
                    self._ops_of[(b, i)] = mine
                    for pid in mine:
                        self._users[pid] = self._users.get(pid, 0) + 1

    # ------------------------------------------------------------------ one step
    def begin(self, num_microbatches: int) -> None:
        if self.failed:
            raise RuntimeError(
                "ds_dhelix: an earlier step failed while its data-parallel gradient reduction was in "
                "flight, so this engine's reduction state is lost; build the engine again and resume "
                "from the last checkpoint"
            )
        self._m = num_microbatches
        self._done: dict = {}  # op key -> micro-batches whose backward gradients are in
        # the order from the steps before this one (the first step: none, all reduced at the end);
        # an op that shows new parameters during the step stops the handing on (``grads_done``)
        self._refresh()
        self._begin_version = self.executor.weights_version
        self._waiting = dict(self._users)  # id(param) -> ops whose gradients are not final yet
        self._cursor = 0
        self._started = False
        self.lane.reset()
        self.reducer.open()
        self.executor.grads_done = self.grads_done

    def grads_done(self, t) -> None:
        key = (t.block, t.op_index)
        n = self._done.get(key, 0) + 1
        self._done[key] = n
        if n < self._m or self.executor.weights_version != self._begin_version:
            return  # (new parameters: one may have a user the order does not count; the rest waits)
        for pid in self._ops_of.get(key, ()):
            self._waiting[pid] -= 1
        self._hand_on()

    def _hand_on(self) -> None:
        start, order, waiting = self._cursor, self._order, self._waiting
        while self._cursor < len(order) and waiting[id(order[self._cursor])] == 0:
            self._cursor += 1
        if self._cursor == start:
            return
        if not self._started:
            self.reducer.start()
            self._started = True
        ready = order[start : self._cursor]
        self.lane.submit(lambda: self.reducer.add(ready))

    def finish(self, reduce_replicated: Callable[[], None]) -> tuple[float, float]:
        """The rest of the reduction, after the last backward: TP-replicated gradients over the TP
        group, the lane's work waited for, the parameters left (in the same order), the epilogue.
        Returns the reduction's seconds and the part of them the step waited for."""
        self.executor.grads_done = None
        self.handed_early = self._cursor
        reduce_replicated()  # (its own collective on the TP group: timed as TP communication)
        t0 = time.perf_counter()
        self.lane.drain()
        if not self._started:
            self.reducer.start()
        ordered = {id(p) for p in self._order}
        left = self._order[self._cursor :] + [p for p in self.reducer.params if id(p) not in ordered]
        t1 = time.perf_counter()
        self.reducer.add(left)
        self.reducer.close()
        t2 = time.perf_counter()
        return self.lane.busy_s + (t2 - t1), t2 - t0

    def abort(self) -> None:
        """A step that failed: the cue off, DeepSpeed's flags back; the lane's work is abandoned (a
        collective it waits on may never complete) and the engine refuses further steps."""
        self.executor.grads_done = None
        self.reducer.abort()
        self.failed = True
