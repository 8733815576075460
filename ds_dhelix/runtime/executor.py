"""The executor: runs a ``ModelGraph``'s ops for micro-batches, one op at a time, alone or as two
strands side by side, launching and waiting for the COMM ops' collectives (``comm.py`` builds them).

A step's schedule is an instruction list (``ds_dhelix.schedule``) that the interpreter
(``interpreter.py``) turns into calls here: ``forward`` / ``backward`` of a chunk of blocks alone,
and ``run_round``: two strands' task lists up to a barrier (an SI pair, two forwards, two
backwards), whose next step the round policy (``ds_dhelix.schedule.policy``) decides; ``dhelix
predict`` runs the same policy on a virtual clock. The executor keeps what only it can do: op
execution through autograd, deferred weight gradients (``deferral.py``), the activation budget,
recompute, CUDA events, and it answers the policy's questions (``completed``, ``pollable``,
``deferred``, ``may_save``).

In a reactive SI pair the backward strand's ops the adapter marks ``linear`` compute their input
gradient first and leave their weight gradient for later (at most ``MAX_DEFERRED`` waiting), which
fills the time both strands wait on collectives; the forward strand saves an op's tensors only
while the live activation bytes stay within one micro-batch's whole forward plus
``ACTIVATION_SLACK``::

    comm lane:     [F: attn.ag ........]   [B: mlp.ag(grad) ...]     [F: attn.rs ..]
    compute lane:  [B: mlp.down dX][B: mlp.up]  [F: qkv][F: core][F: out] [B: mlp.down dW]

Per-strand data dependencies and the per-op math are untouched: results are bitwise those of
``sequential`` (a weight gradient is the same matmul whether or not it is deferred; a deferred one
always runs before any later op adds to the same weight).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from ..graph.draws import op_side
from ..graph.fuse import around_linear_members
from ..graph.model_graph import ModelGraph
from ..graph.recompute import Kept, RecomputePolicy, keep
from ..planning.plan import SIPlan
from ..schedule import policy as P
from .collectives import Collectives
from .deferral import NO_WEIGHTS, DeferredGrads, OpWeights, op_weights, with_params
from .interpreter import run_microbatches
from .stats import StepStats
from .tasks import MicroBatch, Task, accumulate
from .wgrad import WeightGradStore, intercept_linears, run_backward

_UNKNOWN = object()


def _is_comm(t: Task) -> bool:
    return t.op.is_comm


def _depth(t: Task) -> int:
    return t.depth


class Executor(Collectives):
    """Runs forward/backward of ``graph`` ops for micro-batches.

    ``plan`` None (default): SI pairs run reactively (see the module docstring), with weight
    gradients of linear ops deferred when ``defer_weight_grads`` (None: when the graph has
    collectives); with a plan (or ``reactive=False``) pairs run the plan's rounds with barriers (no
    plan: one round per block), backward compute first. Collaborators, all optional: ``meter``
    (``ActivationMeter``), ``recorder`` (``TraceRecorder``: spans and profiler labels),
    ``watchdog`` (``beat(**where)``). ``start_step()`` begins a step's ``StepStats``. It is the
    round policy's host (``completed``, ``pollable``, ``deferred``, ``may_save``). ``react``
    False: never react to completed collectives (the timing-independent order CUDA runs)."""

    MAX_DEFERRED = 2  # weight-gradient passes waiting at once (each keeps its op's saved tensors)
    # SI's second strand may hold at most this share more activation bytes than one micro-batch's
    # whole forward (the step's first, lone forward; measured by the meter): the block-depth gate
    # alone keeps that true for layers of one size, not for a large layer beside small ones
    ACTIVATION_SLACK = 0.02

    def __init__(
        self,
        graph: ModelGraph,
        plan: SIPlan | None = None,
        *,
        meter=None,
        recorder=None,
        watchdog=None,
        defer_weight_grads: bool | None = None,
        reactive: bool | None = None,
        recompute: str = "none",
        react: bool = True,
    ):
        self.graph, self.plan, self.meter = graph, plan, meter
        self._pair_plans: dict = {}  # (forward kind, backward kind) -> default plan (mixed layer kinds)
        self.recompute = RecomputePolicy(recompute, graph)
        self.reactive = plan is None if reactive is None else reactive
        if self.reactive and plan is not None:
            raise ValueError("Executor: a plan runs with barriers; pass reactive=False (or no plan)")
        self.recorder, self.watchdog = recorder, watchdog
        self.stats = StepStats()
        comms = [op for block in graph.blocks for op in block if op.is_comm]
        # deferring a weight gradient costs host work (its linears run as autograd Functions); it
        # pays only where it fills the time the strands wait on collectives, so by default (None) a
        # graph without COMM ops (TP = CP = EP = 1) runs each backward op whole; True defers anyway
        # (the same matmuls either way: results do not change)
        self.defer_weight_grads = (bool(comms) if defer_weight_grads is None else defer_weight_grads) and self.reactive
        self._grad = True  # False inside ``inference()``
        self._deferring = False  # on while a schedule that defers runs (``deferring``)
        self._deferred = DeferredGrads()
        self._wgrad = WeightGradStore()  # where deferred linears leave their weight gradients
        self._linears = intercept_linears(self._wgrad)  # entered around a deferring op's forward
        self._op_weights: dict = {}  # (block, op index) -> OpWeights, from the op's first forwards
        # (block, op index, linears routed) -> parameters autograd reaches when matrices are among them
        self._weighed: dict = {}
        # react to completed collectives at once when every COMM op keeps forward and backward
        # collectives on separate groups (timing may then reorder the two strands' launches) and
        # every one can be polled: a rank blocked on one strand's collective while the other's
        # (ring attention's send / receive) has completed unseen can hold back the launch its
        # TP peer waits for (ring CP x TP deadlocked so); never on CUDA, where the host's view of
        # completion lags the device (``_cuda``)
        self._reacts = (
            react and self.reactive and all(self.polls(op) and getattr(op.comm, "strand_safe", False) for op in comms)
        )
        self._cuda = False  # set by the first collective launched on a CUDA tensor
        self._stream = _UNKNOWN  # the compute stream (CUDA), None on CPU: from the first op's input
        self._device_events: list = []  # this step's ``comm.DeviceEvents`` (CUDA)
        self._op_bytes: dict = {}  # (block, op index) -> bytes its forward saves (the meter's, largest seen)
        # called with each backward task once its op's gradients for that micro-batch are all in
        # (after its deferred weight-gradient pass, if any): the data-parallel reduction's cue
        self.grads_done: Callable[[Task], None] | None = None
        self.weights_version = 0  # bumped whenever an op's known parameters grow (``weights_of``)
        self._budget: float | None = None  # live activation bytes SI pairs stay within (``within_budget``)
        # modules an op calls that draw per micro-batch without being given the side (LoRA dropout)
        # read it from ``draws.current_side``: set around each op only where the graph has them
        self._op_side = op_side if graph.meta.get("needs_side") else contextlib.nullcontext

    @property
    def reacts_to_completions(self) -> bool:
        return self._reacts and not self._cuda

    def start_step(self) -> StepStats:
        """Begin a step: fresh ``StepStats`` (returned; ``self.stats`` until the next step)."""
        self.stats = StepStats()
        self._device_events = []
        return self.stats

    @contextlib.contextmanager
    def inference(self):
        """Forwards inside run without autograd (evaluation); no gradients are reduced."""
        self._grad = False
        try:
            yield
        finally:
            self._grad = True

    @contextlib.contextmanager
    def deferring(self, on: bool):
        """Inside: linear ops' weight gradients are deferred (where ``defer_weight_grads``) when ``on``;
        the activation budget (``fix_activation_budget``) is lifted at the end."""
        self._deferring = on and self.defer_weight_grads
        try:
            yield
        finally:
            self._deferring, self._budget = False, None

    def fix_activation_budget(self) -> None:
        """The live activation bytes from here on stay within what is live now (one micro-batch's
        whole forward) plus ``ACTIVATION_SLACK`` (reactive pairs with a meter only)."""
        if self.meter is not None and self.reactive:
            self._budget = self.meter.current * (1 + self.ACTIVATION_SLACK)

    def within_budget(self, t: Task) -> bool:
        """Whether forward task ``t`` may save its tensors now: the live activation bytes plus what
        its op saved before stay within this step's budget (no meter or no budget: always). Only
        while pairs react to completions: a rank's live bytes are its own (EP ranks hold different
        expert rows), so the gate may open on one rank before its peer, which only a round that
        waits for whichever collective completes first tolerates; in-order waits (CUDA, shared
        groups, ring attention's send / receive) keep the block-depth gate alone."""
        if self._budget is None or self.meter is None or not self.reacts_to_completions:
            return True
        return self.meter.current + self._op_bytes.get((t.block, t.op_index), 0) <= self._budget

    def weights_of(self, t: Task) -> OpWeights:
        """The parameters ``t``'s op adds to (known after its first forward)."""
        return self._op_weights.get((t.block, t.op_index), NO_WEIGHTS)

    def op_params(self, key: tuple[int, int]) -> tuple:
        """The parameters op ``key`` = (block, op index) adds to, as far as its forwards showed."""
        return self._op_weights.get(key, NO_WEIGHTS).params

    # ------------------------------------------------------------------ the round policy's host
    def deferred(self) -> tuple[int, float]:
        return len(self._deferred), self._deferred.oldest_depth()

    def may_save(self, t: Task) -> bool:
        return self.within_budget(t)

    # ------------------------------------------------------------------ single ops
    def run_comp(self, t: Task) -> None:
        self._beat(t)
        self._note_launch(t)
        if t.backward and self._deferred.touches(self.weights_of(t).ids):
            self.drain_deferred()  # a deferred pass adds to this op's weights: it runs first
        live = self.meter.current if self.meter is not None else 0
        self._before_forward(t)
        with self._label(t.op.name):
            t0 = time.perf_counter()
            if t.backward:
                self._comp_backward(t)
            else:
                self._comp_forward(t)
            t1 = time.perf_counter()
        if self.meter is not None and not t.backward and not t.recompute:  # what this op saves (``within_budget``)
            key = (t.block, t.op_index)
            self._op_bytes[key] = max(self._op_bytes.get(key, 0), self.meter.current - live)
        self.stats.compute_s += t1 - t0
        if self.recorder is not None:
            self.recorder.add_span("compute", t.op.name, t0, t1, self._args(t))

    def _note_launch(self, t: Task) -> None:
        """CUDA: count the op's launch, and whether the compute stream had run dry (``StepStats.
        starved_share``): one non-blocking query per op."""
        if self._stream is _UNKNOWN:
            x = next((v for k in t.op.inputs if isinstance(v := t.mb.env.get(k), torch.Tensor)), None)
            if x is None:
                return
            self._stream = torch.cuda.current_stream(x.device) if x.is_cuda else None
        if self._stream is not None:
            self.stats.launches += 1
            self.stats.idle_launches += bool(self._stream.query())

    def _before_forward(self, t: Task) -> None:
        """A layer that recomputes keeps its inputs as its forward starts, and gets them back as
        its recomputation starts; a recomputing op's side says so (e.g. MoE load is counted once)."""
        if t.backward:
            return
        mb = t.mb
        if t.op_index == 0 and self._grad and self.recompute.full(t.block):
            if t.recompute:
                mb.env.update(mb.saved.pop((t.block, "in")).values)
            else:
                mb.saved[(t.block, "in")] = keep(mb.env, self.recompute.live_in(t.block), self.meter)
        mb.side["recomputing"] = t.recompute

    def _forward_only(self, t: Task) -> bool:
        """Run ``t`` without autograd: evaluation, or a recomputing layer's / op's first forward."""
        return not self._grad or (
            not t.recompute and (self.recompute.full(t.block) or self.recompute.selective(t.block, t.op))
        )

    def _comp_forward(self, t: Task) -> None:
        op, mb = t.op, t.mb
        if self._forward_only(t):
            if self._grad and self.recompute.selective(t.block, op):
                mb.saved[(t.block, t.op_index)] = keep(mb.env, op.inputs, self.meter)
            with torch.no_grad(), self._op_side(mb.side):
                outs = op.fn(mb.side, *(mb.env[k] for k in op.inputs))
            mb.env.update(zip(op.outputs, outs))
            return
        self._record_forward(t, {k: mb.env[k] for k in op.inputs})

    def _record_forward(self, t: Task, inputs: dict) -> list:
        """The op's forward through autograd from detached ``inputs``: its saved context, its outputs
        in the env; returns the outputs."""
        op, mb = t.op, t.mb
        leaves = [inputs[k].detach().requires_grad_(inputs[k].is_floating_point()) for k in op.inputs]
        hooks = self.meter.hooks() if self.meter is not None else contextlib.nullcontext()
        linears = self._linears.begin() if self._deferring and op.linear else None
        routing = (
            contextlib.nullcontext()
            if linears is None
            else around_linear_members(linears.around)
            if op.members
            else linears.around(op)
        )
        with torch.enable_grad(), hooks, routing, self._op_side(mb.side):
            outs = op.fn(mb.side, *leaves)
        key = (t.block, t.op_index)
        way = (*key, linears is not None)
        if way not in self._weighed:  # once per op and way: what its backward adds to
            in_graph = op_weights(op, [o for o in outs if o.requires_grad], leaves)
            # matrices a deferring op reaches through autograd (not routed: a gpt-oss expert bias,
            # a grouped GEMM) keep a second pass for their part (``_comp_backward``); a fused op's
            # get theirs in its one engine call (a second pass over a run would redo most of it)
            self._weighed[way] = in_graph.params if in_graph.deferrable and not op.members else ()
            routed = linears.params if linears is not None else ()
            before = self._op_weights.get(key, NO_WEIGHTS)
            self._op_weights[key] = with_params(op, with_params(op, before, in_graph.params), routed)
            self.weights_version += len(self._op_weights[key].params) != len(before.params)
        mb.saved[key] = (leaves, outs, self._weighed[way])
        for name, out in zip(op.outputs, outs):
            mb.env[name] = out.detach()
        return outs

    def _comp_backward(self, t: Task) -> None:
        op, mb = t.op, t.mb
        saved = mb.saved.get((t.block, t.op_index))
        if isinstance(saved, Kept):  # selective: the op's forward again, from its kept inputs
            mb.side["recomputing"] = True
            self._record_forward(t, saved.values)
            mb.side["recomputing"] = False
            del saved
        leaves, outs, in_graph = mb.saved.pop((t.block, t.op_index))
        tensors, grads, deferred = [], [], False
        for key, out in zip(op.outputs, outs):
            g = mb.grads.pop(key, None)
            if g is not None and out.requires_grad:
                tensors.append(out)
                grads.append(g)
        if tensors:
            # (run_comp has run any deferred pass that adds to this op's weights: each keeps its order)
            # one engine call: a deferring op's routed linears leave their weight gradients pending;
            # matrices autograd reaches itself (``in_graph``) are left to a second pass over them
            weights = self.weights_of(t)
            if self._deferring and weights.deferrable:
                need = [leaf for leaf in leaves if leaf.requires_grad] if in_graph else []
                with self._wgrad.collecting() as pending:
                    if need:
                        torch.autograd.backward(tensors, grads, inputs=need, retain_graph=True)
                    else:
                        run_backward(tensors, grads)
                if pending or need:
                    self._deferred.add(t, (pending, (tensors, grads, in_graph) if need else None), weights)
                    deferred = True  # its gradients are in once the pass has run (``run_deferred``)
            else:
                run_backward(tensors, grads)
        if not deferred and self.grads_done is not None:
            self.grads_done(t)
        for key, leaf in zip(op.inputs, leaves):
            if leaf.grad is not None:
                accumulate(mb.grads, key, leaf.grad)
        del leaves, outs, tensors, grads

    # ------------------------------------------------------------------ deferred weight gradients
    def run_deferred(self) -> bool:
        """Run the oldest deferred weight-gradient pass; False when none is waiting."""
        if not self._deferred:
            return False
        t, (pending, second), _ = self._deferred.pop()
        with self._label(f"{t.op.name}.wgrad"):
            t0 = time.perf_counter()
            for grad in pending:
                grad.run()
            if second is not None:  # linears it passes through again added theirs already
                tensors, grads, params = second
                with self._wgrad.collecting():
                    torch.autograd.backward(tensors, grads, inputs=list(params))
            t1 = time.perf_counter()
        self.stats.compute_s += t1 - t0
        self.stats.num_deferred += 1
        if self.grads_done is not None:
            self.grads_done(t)
        if self.recorder is not None:
            self.recorder.add_span("compute", f"{t.op.name}.wgrad", t0, t1, self._args(t))
        return True

    def drain_deferred(self) -> None:
        while self.run_deferred():
            pass

    # ------------------------------------------------------------------ one round
    def run_round(self, b_tasks: list[Task], f_tasks: list[Task], gated: bool = False, trail: bool = False) -> None:
        """Run two strands' task lists together (either may be empty) by the round policy; barrier
        at the end. ``gated``: the forward strand stays within the backward strand's block depth;
        ``trail``: two backward strands, the second trailing the first."""
        rules = P.RoundRules(gated, trail, self.reacts_to_completions, self.reactive, self.MAX_DEFERRED)
        rnd = P.Round(
            b_tasks,
            f_tasks,
            rules,
            comm=_is_comm,
            depth=_depth,
            weights=(lambda t: self.weights_of(t).ids) if trail else None,
        )
        while True:
            d = rnd.decide(self)
            kind = d.kind
            if kind == P.COMPUTE:
                self.run_comp(rnd.take(d.strand))
                self._note_completions(rnd)
            elif kind == P.LAUNCH:
                task = rnd.take(d.strand)
                pending = self.launch_comm(task)
                if pending.work is None:  # nothing to wait for (e.g. a pass-through backward)
                    self.finish_comm(task, pending)
                else:
                    rnd.launched(d.strand, task, pending)
            elif kind in (P.FINISH, P.WAIT):
                self.finish_comm(*rnd.finished(d.strand))
            elif kind == P.WAIT_FIRST:
                self.finish_comm(*rnd.finished(self._wait_first(rnd, d.strands)))
            elif kind in (P.DRAIN, P.FILL):
                self.run_deferred()
                if kind == P.FILL:
                    self._note_completions(rnd)
            else:
                return

    # ------------------------------------------------------------------ blocks
    def tasks(
        self,
        mb: MicroBatch,
        block: int,
        backward: bool,
        lo: int = 0,
        hi: int | None = None,
        depth: int = 0,
        swapped: bool = False,
    ):
        ops = self.graph.blocks[block]
        hi = len(ops) if hi is None else hi
        if not backward:
            return [Task(mb, block, i, ops[i], False, depth, swapped) for i in range(lo, hi)]
        # backward positions index the reversed op list; a recomputing layer's backward starts with
        # its forward again (in the round that runs its first backward op; a plan's earlier rounds
        # may give the backward an empty range)
        n = len(ops)
        again = (
            [Task(mb, block, i, ops[i], False, depth, swapped, recompute=True) for i in range(n)]
            if lo == 0 < hi and self._grad and self.recompute.full(block)
            else []
        )
        return again + [Task(mb, block, n - 1 - j, ops[n - 1 - j], True, depth, swapped) for j in range(lo, hi)]

    def all_blocks(self) -> list[int]:
        return list(range(len(self.graph.blocks)))

    def forward(self, mb: MicroBatch, blocks=None) -> None:
        """Forward of ``blocks`` (default: all) for one micro-batch, alone."""
        for block in self.all_blocks() if blocks is None else blocks:
            self.run_round([], self.tasks(mb, block, False))
        mb.loss = mb.env.get("loss")

    def backward(self, mb: MicroBatch, seed: float | None, blocks=None) -> None:
        """Backward of ``blocks`` (default: all, last first) for one micro-batch, alone.
        ``seed``: the loss gradient (1/accumulation steps) when the loss block is included."""
        if seed is not None:
            self.start_backward(mb, seed)
        for block in reversed(self.all_blocks()) if blocks is None else blocks:
            self.run_round(self.tasks(mb, block, True), [])
        self.drain_deferred()

    def start_backward(self, mb: MicroBatch, seed: float) -> None:
        mb.loss = mb.env["loss"]
        mb.grads["loss"] = torch.full_like(mb.loss, seed)

    def run_microbatches(
        self, batches: list[dict], schedule: str, seed: float, first_serial: int = 0
    ) -> list[MicroBatch]:
        """Forward and backward of every micro-batch under the one-stage ``schedule`` (sequential,
        si, si-ends, intra, ...; ``interpreter.run_microbatches``); the optimizer is the caller's."""
        return run_microbatches(self, batches, schedule, seed, first_serial)

    def _label(self, name: str):
        """The recorder's ``torch.profiler`` range for an op (no-op without a recorder)."""
        return self.recorder.label(name) if self.recorder is not None else contextlib.nullcontext()

    def _beat(self, t: Task) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(microbatch=t.mb.index, strand=t.strand, op=f"{t.op.name} (block {t.block})")

    @staticmethod
    def _args(t: Task) -> dict:
        args = {
            "strand": t.strand,
            "microbatch": t.mb.index,
            "block": t.block,
            "op": t.op.name,
            "direction": "backward" if t.backward or t.recompute else "forward",
        }
        if t.recompute:
            args["recompute"] = True
        return args
