"""The SI executor: runs micro-batches through a ``ModelGraph``, one op at a time, either
sequentially or as two interleaved strands. It launches and waits for the COMM ops' collectives
(``comm.py`` builds them).

Schedules for a step of m micro-batches (F = forward, B = backward, k = micro-batch)::

    sequential:  F0 B0 F1 B1 ... F(m-1) B(m-1)           (each comm waited at once)
    si:          F0 | F1(x)B0 | F2(x)B1 | ... | B(m-1)   (x = co-executed pair)
    si, pair_ends:  F0(x)F1 | F2(x)B0 | ... | F(m-1)(x)B(m-3) | B(m-2)(x)B(m-1)
    intra:       F0a(x)F0b | B0a(x)B0b | F1a(x)F1b | ...   (a, b = the halves of a micro-batch)

``intra`` is Domino's intra-batch overlap on the same op graph and collectives: each micro-batch
is cut in two halves along the batch (``half_batches``) and the halves run as a same-direction
pair, forward beside forward, then backward beside backward (the second half trailing the first
op by op, as ``pair_ends``' backwards do). Each half's loss is its sum over the whole micro-batch's
target count, so the two add up to the micro-batch's loss; the weight gradients are the halves'
sums added, so a dense model without dropout matches ``sequential`` up to float rounding. Intra
is bitwise ``sequential`` over half-size micro-batches, twice as many per step, wherever the
halves count as many targets each (even rows, no ignored labels spread unevenly): the halves draw
that run's dropout masks and router noise (``half_serial``; so not the whole micro-batch's), an
MoE router's load-balancing loss is each half's own, weighted by its share of the rows, and an
expert capacity applies per half, all as there. (Under ``auto`` an intra step's draw numbers
are those a whole-micro-batch step twice as far into the run would use: two steps of different
data may then share masks.)

``pair_ends`` leaves no strand alone (reactive execution): the first two forwards and the last two
backwards are pairs too (the second of two backwards trails the first op by op, so weight
gradients still accumulate in micro-batch order; the second strand of a same-direction pair
launches its collectives on the other channel of the strand groups). It holds one more
micro-batch of activations: from the first pair on, a whole micro-batch waits between its
forward and its backward.

A pair F(k+1)(x)B(k) runs in one of two ways:

- **reactive** (no plan, the default): both strands walk the whole model as one round, no
  barrier. COMM ops are launched asynchronously the moment their strand reaches them; the next
  COMP op comes from the strand with the fewest compute ops left before its next collective
  (ties: backward), so the link is fed as early as possible; a strand whose collective has
  completed may go on at once (forward and backward collectives go to separate channels of
  ``comm.StrandGroups``, so this timing-dependent interleaving still issues every group's
  collectives in the same order on every rank); the executor waits only when neither strand can
  compute, and then for whichever strand's collective completes first (ranks may let the forward
  strand go at different times; waiting on one would tie the other strand to its peers). The
  backward strand's ops that the adapter marks ``linear`` (linear on the way to their weights: ``attn.qkv``, ``attn.out``, ``mlp.up``, ``mlp.down``, ``head.logits``,
  ``moe.experts.up`` / ``.down``) compute their input gradient first and leave their weight
  gradient for later, so the strand reaches its next collective sooner; the deferred weight
  gradients (at most ``MAX_DEFERRED`` waiting) fill the time when both strands wait, and all are
  done before the pair ends. The forward strand enters block depth j only after the backward
  strand has finished depth j-1 (and its deferred weight gradients), so it never saves
  activations ahead of those the backward strand frees, and it saves an op's tensors only while
  the live activation bytes stay within one micro-batch's whole forward plus
  ``ACTIVATION_SLACK`` (reacting to completions only; layers of different sizes, e.g. a dense
  layer among MoE ones)::

      comm lane:     [F: attn.ag ........]   [B: mlp.ag(grad) ...]     [F: attn.rs ..]
      compute lane:  [B: mlp.down dX][B: mlp.up]  [F: qkv][F: core][F: out] [B: mlp.down dW]

- **plan**: a layer pair (forward layer i with backward layer L-1-i) runs the SI plan's rounds
  of (forward segment, backward segment) with a barrier after each, backward compute first; the
  other blocks run as one round each. This is what the planner's overlap tables measure and
  predict.

In plan mode (and in reactive mode without separate strand groups) launch order is a pure
function of the op lists and plan: a decision depends only on which ops are queued and which
collectives were already waited for, never on timing, so every rank issues its collectives in the
same order. Per-strand data dependencies and the per-op math are untouched: results are bitwise
those of ``sequential`` (a weight gradient is the same matmul whether or not it is deferred; a
deferred one always runs before any later op adds to the same weight).
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .comm import CollectiveError, Pending, is_comm_failure
from ..graph.model_graph import ModelGraph, Op
from ..planning.plan import SIPlan
from ..graph.recompute import Kept, RecomputePolicy, keep


@dataclass
class MicroBatch:
    """One micro-batch in flight: forward values, saved op contexts, backward gradients."""

    index: int
    side: dict
    env: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    loss: torch.Tensor | None = None


@dataclass(frozen=True)
class Task:
    """One op of one micro-batch in one direction, as a strand's queue holds it."""

    mb: MicroBatch
    block: int
    op_index: int
    op: Op
    backward: bool
    depth: int = 0  # position of the block in its strand's block list (the forward strand's gate)
    swapped: bool = False  # second strand of a same-direction pair: collectives on the other channel
    recompute: bool = False  # a forward op the backward strand runs again (``recompute.py``)

    @property
    def strand(self) -> str:
        return "B" if self.backward or self.recompute else "F"

    @property
    def channel(self) -> int:
        """The strand-group channel its collectives use: 0 forward, 1 backward (flipped if swapped);
        a recomputed forward op belongs to the backward strand."""
        return int(self.backward or self.recompute) ^ int(self.swapped)


@dataclass
class StepStats:
    """Per training step: compute seconds, comm seconds (launch to observed completion),
    exposed comm seconds (time blocked waiting), number of collectives."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    num_comms: int = 0
    num_deferred: int = 0  # weight-gradient passes run after their op's input gradient
    peak_activation_bytes: int = 0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    # CUDA: the same from CUDA events (``comm.DeviceEvents``): collective launch to completion, and
    # the time the compute stream stalled waiting on one (None on CPU, where the host waits)
    device_comm_s: float | None = None
    device_exposed_s: float | None = None

    @property
    def hidden_fraction(self) -> float:
        """Share of this step's own communication time that did not block compute (device-true on CUDA)."""
        comm, exposed = self.comm_and_exposed
        return 0.0 if comm <= 0 else max(0.0, 1.0 - exposed / comm)

    @property
    def comm_and_exposed(self) -> tuple[float, float]:
        """(comm, exposed) seconds: from CUDA events where measured, else the host's."""
        if self.device_comm_s is not None:
            return self.device_comm_s, self.device_exposed_s
        return self.comm_s, self.exposed_s


@dataclass(frozen=True)
class _OpWeights:
    params: tuple  # parameters the op's backward accumulates into
    deferrable: bool  # marked linear by its adapter and has a matrix weight
    ids: frozenset = frozenset()  # id() of each of ``params``


_NO_WEIGHTS = _OpWeights((), False)  # COMM ops


def _op_weights(op: Op, tensors, leaves) -> _OpWeights:
    """The parameters an op's backward adds to: the leaf variables its autograd graph reaches from
    its outputs, other than its own inputs. Deferrable when its adapter marks it ``linear`` (a
    later ``backward(inputs=params)`` then runs only the weight matmuls)."""
    leaf_ids = {id(x) for x in leaves}
    params, seen, stack = [], set(), [x.grad_fn for x in tensors if x.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # a leaf's gradient accumulator
        if var is not None:
            if id(var) not in leaf_ids:
                params.append(var)
            continue
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return _OpWeights(tuple(params), op.linear and any(p.dim() >= 2 for p in params),
                      frozenset(id(p) for p in params))


def _until_comm(queue) -> int:
    """Compute ops ahead of the first COMM op in a strand's queue."""
    for i, t in enumerate(queue):
        if t.op.is_comm:
            return i
    return len(queue)


def _accumulate(grads: dict, key: str, g: torch.Tensor) -> None:
    grads[key] = g if key not in grads else grads[key] + g


def half_serial(serial: int, half: int) -> int:
    """The random-draw number of half ``half`` (0 or 1) of micro-batch ``serial`` under ``intra``:
    the number that half has in a run of half-size micro-batches (twice as many per step)."""
    return 2 * serial + half


def half_batches(batch: dict) -> tuple[dict, dict]:
    """A micro-batch cut in two along the batch (the first half takes the extra row of an odd
    batch). Each half carries ``loss_denominator`` (the whole micro-batch's: its own, or its
    ``valid_targets``, as ``make_side_fn`` counts them) and ``loss_share`` (its rows / all rows),
    so the halves' losses add up to the whole one's."""
    ids = batch["input_ids"]
    rows = ids.shape[0]
    if rows < 2:
        raise ValueError(f"schedule 'intra' splits a micro-batch along the batch; this one has {rows} row")
    denominator = batch.get("loss_denominator")
    if denominator is None:
        from ..data.inputs import valid_targets
        denominator = max(valid_targets(batch.get("labels", ids)), 1)
    cut = (rows + 1) // 2
    halves = []
    for lo, hi in ((0, cut), (cut, rows)):
        half = {k: v[lo:hi] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v
                for k, v in batch.items()}
        half.update(loss_denominator=denominator, loss_share=(hi - lo) / rows)
        halves.append(half)
    return halves[0], halves[1]


POLL_S = 50e-6
"""How long a rank waiting on two strands' collectives sleeps between looking at them."""


class _Round:
    """Two strands' task lists run together up to a barrier (either may be empty). Strand 0 is
    the backward strand of a mixed pair and wins ties; each strand has at most one collective in
    flight. Each turn of ``run``:

        react      (reactive, separate strand groups) finish every collective already completed
        launch     every COMM op at the head of a strand that may go is launched
        compute    one COMP op from a strand that may go (reactive: nearest collective first)
        fill       else one deferred weight-gradient pass
        wait       else wait for a collective in flight (``wait_first``)

    Who may go: a strand with nothing in flight and tasks left, subject to ``gated`` (the forward
    strand stays within the backward strand's block depth, see ``_gate_open``) and ``trail`` (two
    backward strands: the second follows the first op by op, see ``_trail_open``)."""

    def __init__(self, ex: "Executor", b_tasks: list[Task], f_tasks: list[Task], gated: bool, trail: bool):
        self.ex, self.gated, self.trail = ex, gated, trail
        self.queues = [deque(b_tasks), deque(f_tasks)]
        self.lengths = (len(b_tasks), len(f_tasks))
        self.pending: list[tuple[Task, Pending] | None] = [None, None]
        self.order: list[int] = []  # strands with a collective in flight, in launch order
        self.last_use: dict = {}  # trail: param id -> last position of strand 0 that adds to it
        if trail:
            for pos, t in enumerate(b_tasks):
                for pid in ex.weights_of(t).ids:
                    self.last_use[pid] = pos

    def run(self) -> None:
        ex = self.ex
        while self.queues[0] or self.queues[1] or self.order:
            if ex.reacts_to_completions:
                self.finish_completed()
            self.launch_ready()
            if ex.deferred_over_limit():
                ex.run_deferred()
                continue
            s = self.next_compute()
            if s is not None:
                ex.run_comp(self.queues[s].popleft())
                self.note_completions()
            elif ex.run_deferred():  # both strands wait: fill with a weight gradient
                self.note_completions()
            elif self.order:  # nothing to compute: wait for a collective
                self.wait_first()

    # ---- who may go
    def may_go(self, s: int) -> bool:
        if self.pending[s] is not None or not self.queues[s]:
            return False
        if self.trail and s == 1 and self.queues[0]:
            return self._trail_open()
        if s == 0 or not self.gated:
            return True
        return self._gate_open()

    def _trail_open(self) -> bool:
        """The trailing strand runs position i only after the leading one has run its own, and an
        op of a weight several ops share (tied embeddings) only after the leader's last use of it."""
        done0 = self.lengths[0] - len(self.queues[0])  # tasks strand 0 has run or launched
        if self.lengths[1] - len(self.queues[1]) >= done0:
            return False
        head = self.queues[1][0]
        return all(self.last_use.get(pid, -1) < done0 for pid in self.ex.weights_of(head).ids)

    def _gate_open(self) -> bool:
        """The forward strand may not start a block deeper than the backward strand's current one,
        nor while a weight gradient of a shallower block is deferred (it still holds its
        activations), so it does not save activations ahead of those the backward strand frees;
        nor an op whose saved tensors would lift the live activations above the step's budget
        (``Executor.within_budget``: layers of different sizes, e.g. a dense layer among MoE ones)."""
        head = self.queues[1][0]
        if self.ex.oldest_deferred_depth() < head.depth:
            return False
        if not (self.queues[0] or self.pending[0]):
            return True
        b_head = self.pending[0][0] if self.pending[0] is not None else self.queues[0][0]
        return head.depth <= b_head.depth and self.ex.within_budget(head)

    # ---- turns
    def finish_completed(self) -> None:
        for s in list(self.order):
            work = self.pending[s][1].work
            if work is not None and work.is_completed():
                self.finish(s)

    def launch_ready(self) -> None:
        for s in (0, 1):
            while self.may_go(s) and self.queues[s][0].op.is_comm:
                task = self.queues[s].popleft()
                launched = self.ex.launch_comm(task)
                if launched.work is None:  # nothing to wait for (e.g. a pass-through backward)
                    self.ex.finish_comm(task, launched)
                    continue
                self.pending[s] = (task, launched)
                self.order.append(s)

    def next_compute(self) -> int | None:
        runnable = [s for s in (0, 1) if self.may_go(s)]
        if self.ex.reactive and len(runnable) == 2:  # nearest collective first
            runnable.sort(key=lambda s: (_until_comm(self.queues[s]), s))
        return runnable[0] if runnable else None

    def finish(self, s: int) -> None:
        task, p = self.pending[s]
        self.pending[s] = None
        self.order.remove(s)
        self.ex.finish_comm(task, p)

    def wait_first(self) -> None:
        """Wait for a collective in flight: the oldest when only one strand has one (or pairs do not
        react to completions); when both strands have one in flight while reacting to completions,
        whichever completes first, polled. Blocking on one strand's collective would tie the other
        strand's progress to the first one's peers: ranks decide when the forward strand may go by
        their own progress and live bytes (``_gate_open``), so one rank can have launched a forward
        collective its peer holds back until its backward strand frees activations, while that
        backward strand waits for the first rank's next backward collective: a cycle (two ranks
        over the same group; four ranks over TP and CP, TP and EP groups). Works that say they are
        complete only once waited for (ring attention's send / receive on gloo: ``Executor.polls``)
        are not polled; with only those in flight the oldest is waited for, and such graphs keep
        the block-depth gate alone (``within_budget``)."""
        polled = [] if not self.ex.reacts_to_completions or len(self.order) == 1 else \
            [s for s in self.order if self.ex.polls(self.pending[s][0].op)]
        if not polled:
            self.finish(self.order[0])
            return
        t0 = time.perf_counter()
        while True:
            for s in polled:
                pending = self.pending[s][1]
                if pending.work is None or pending.work.is_completed():
                    pending.waited_s += time.perf_counter() - t0  # polled: exposed like a blocking wait
                    self.finish(s)
                    return
            time.sleep(POLL_S)

    def note_completions(self) -> None:
        """Stamp the time a collective is first seen complete (its comm time ends there)."""
        now = time.perf_counter()
        for item in self.pending:
            if item is not None and item[1].done_at is None and item[1].work is not None \
                    and item[1].work.is_completed():
                item[1].done_at = now


class Executor:
    """Runs forward/backward of ``graph`` ops for micro-batches.

    ``plan`` None (default): SI pairs run reactively (see the module docstring), with weight
    gradients of linear ops deferred when ``defer_weight_grads`` (None: when the graph has
    collectives); with a plan (or
    ``reactive=False``) pairs run the plan's rounds with barriers (no plan: one round per block),
    backward compute first. Collaborators, all optional: ``meter`` (``ActivationMeter``),
    ``recorder`` (``TraceRecorder``: spans and profiler labels), ``watchdog`` (``beat(**where)``).
    ``start_step()`` begins a step's ``StepStats``."""

    MAX_DEFERRED = 2  # weight-gradient passes waiting at once (each keeps its op's saved tensors)
    # SI's second strand may hold at most this share more activation bytes than one micro-batch's
    # whole forward (the step's first, lone forward; measured by the meter): the block-depth gate
    # alone keeps that true for layers of one size, not for a large layer beside small ones
    ACTIVATION_SLACK = 0.02

    def __init__(self, graph: ModelGraph, plan: SIPlan | None = None, *, meter=None, recorder=None,
                 watchdog=None, defer_weight_grads: bool | None = None, reactive: bool | None = None,
                 pair_ends: bool = False, recompute: str = "none"):
        self.graph, self.plan, self.meter = graph, plan, meter
        self._pair_plans: dict = {}  # (forward kind, backward kind) -> default plan (mixed layer kinds)
        self.recompute = RecomputePolicy(recompute, graph)
        self.reactive = plan is None if reactive is None else reactive
        if self.reactive and plan is not None:
            raise ValueError("Executor: a plan runs with barriers; pass reactive=False (or no plan)")
        if pair_ends and not self.reactive:
            raise ValueError("Executor: pair_ends needs reactive execution (a plan pairs a forward with a backward)")
        self.recorder, self.watchdog = recorder, watchdog
        self.stats = StepStats()
        # deferring a weight gradient costs a second autograd pass; it pays only where it fills the
        # time the strands wait on collectives, so by default (None) a graph without COMM ops
        # (TP = CP = EP = 1) runs each backward op whole; True defers anyway (the same matmuls
        # either way: results do not change)
        if defer_weight_grads is None:
            defer_weight_grads = any(op.is_comm for block in graph.blocks for op in block)
        self.defer_weight_grads = defer_weight_grads and self.reactive
        self.pair_ends = pair_ends
        self._grad = True  # False inside ``inference()``
        self._deferring = False  # on inside SI pairs and the last lone backward (reactive)
        self._deferred: deque = deque()  # (task, outputs, grads, op weights), oldest first
        self._deferred_params: dict[int, int] = {}  # id(param) -> deferred passes touching it
        self._op_weights: dict = {}  # (block, op index) -> _OpWeights, from the op's first forward
        # react to completed collectives at once when every COMM op keeps forward and backward
        # collectives on separate groups (timing may then reorder the two strands' launches);
        # never on CUDA, where the host's view of completion lags the device (``_cuda``)
        self._reacts = self.reactive and all(
            getattr(op.comm, "strand_safe", False) for block in graph.blocks for op in block if op.is_comm)
        # every COMM op's in-flight work says when it is complete (``within_budget``, ``polls``)
        self._all_poll = all(self.polls(op) for block in graph.blocks for op in block if op.is_comm)
        self._cuda = False  # set by the first collective launched on a CUDA tensor
        self._device_events: list = []  # this step's ``comm.DeviceEvents`` (CUDA)
        self._op_bytes: dict = {}  # (block, op index) -> bytes its forward saves (the meter's, largest seen)
        self._budget: float | None = None  # live activation bytes SI pairs stay within (``within_budget``)

    @property
    def reacts_to_completions(self) -> bool:
        return self._reacts and not self._cuda

    def start_step(self) -> StepStats:
        """Begin a step: fresh ``StepStats`` (returned; ``self.stats`` until the next step)."""
        self.stats = StepStats()
        self._device_events = []
        return self.stats

    def finish_device_times(self) -> None:
        """CUDA: fill the step's ``device_comm_s`` / ``device_exposed_s`` from its collectives'
        events (synchronizes the device; call once the step's work is launched)."""
        if not self._device_events:
            return
        torch.cuda.synchronize()
        busy = exposed = 0.0
        for events in self._device_events:
            b, e = events.times_s()
            busy, exposed = busy + b, exposed + e
        self.stats.device_comm_s, self.stats.device_exposed_s = busy, exposed
        self._device_events = []

    @contextlib.contextmanager
    def inference(self):
        """Forwards inside run without autograd (evaluation); no gradients are reduced."""
        self._grad = False
        try:
            yield
        finally:
            self._grad = True

    def record_wait(self, seconds: float) -> None:
        """Time the step spent blocked outside the executor's own collectives (pipeline receives)."""
        self.stats.exposed_s += seconds

    @staticmethod
    def polls(op: Op) -> bool:
        """Whether COMM op ``op``'s in-flight work may be polled for completion (not gloo's send /
        receive)."""
        return getattr(op.comm, "reports_completion", True)

    def within_budget(self, t: Task) -> bool:
        """Whether forward task ``t`` may save its tensors now: the live activation bytes plus what
        its op saved before stay within this step's budget (no meter or no budget: always). Only
        while pairs react to completions: a rank's live bytes are its own (EP ranks hold different
        expert rows), so the gate may open on one rank before its peer, which only a pair that waits
        for whichever collective completes first (``_Round.wait_first``) tolerates; in-order waits
        (CUDA, shared groups) keep the block-depth gate alone."""
        if self._budget is None or self.meter is None or not (self.reacts_to_completions and self._all_poll):
            return True
        return self.meter.current + self._op_bytes.get((t.block, t.op_index), 0) <= self._budget

    def weights_of(self, t: Task) -> _OpWeights:
        """The parameters ``t``'s op adds to (known after its first forward)."""
        return self._op_weights.get((t.block, t.op_index), _NO_WEIGHTS)

    # ------------------------------------------------------------------ single ops
    def run_comp(self, t: Task) -> None:
        self._beat(t)
        if t.backward and self._deferred_params:
            self._drain_for(t)
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
        return not self._grad or (not t.recompute and (self.recompute.full(t.block)
                                                       or self.recompute.selective(t.block, t.op)))

    def _comp_forward(self, t: Task) -> None:
        op, mb = t.op, t.mb
        if self._forward_only(t):
            if self._grad and self.recompute.selective(t.block, op):
                mb.saved[(t.block, t.op_index)] = keep(mb.env, op.inputs, self.meter)
            with torch.no_grad():
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
        with torch.enable_grad(), hooks:
            outs = op.fn(mb.side, *leaves)
        key = (t.block, t.op_index)
        if key not in self._op_weights:  # once per op: the weights its backward will add to
            self._op_weights[key] = _op_weights(op, [o for o in outs if o.requires_grad], leaves)
        mb.saved[key] = (leaves, outs)
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
        leaves, outs = mb.saved.pop((t.block, t.op_index))
        tensors, grads = [], []
        for key, out in zip(op.outputs, outs):
            g = mb.grads.pop(key, None)
            if g is not None and out.requires_grad:
                tensors.append(out)
                grads.append(g)
        if tensors:
            # (run_comp has already run any deferred pass that adds to this op's weights)
            weights = self.weights_of(t)
            need = [leaf for leaf in leaves if leaf.requires_grad]
            if self._deferring and weights.deferrable and need:
                torch.autograd.backward(tensors, grads, inputs=need, retain_graph=True)
                self._defer(t, tensors, grads, weights)
            else:
                torch.autograd.backward(tensors, grads)
        for key, leaf in zip(op.inputs, leaves):
            if leaf.grad is not None:
                _accumulate(mb.grads, key, leaf.grad)
        del leaves, outs, tensors, grads

    def _drain_for(self, t: Task) -> None:
        """Before a backward op adds to a weight that a deferred pass will also add to (a tied
        weight, or the same op of an earlier micro-batch in a backward-backward pair), run the
        deferred passes first: each weight keeps its accumulation order."""
        if any(pid in self._deferred_params for pid in self.weights_of(t).ids):
            self.drain_deferred()

    def _defer(self, t: Task, tensors, grads, weights: _OpWeights) -> None:
        self._deferred.append((t, tensors, grads, weights))
        for p in weights.params:
            self._deferred_params[id(p)] = self._deferred_params.get(id(p), 0) + 1

    def deferred_over_limit(self) -> bool:
        return len(self._deferred) > self.MAX_DEFERRED

    def oldest_deferred_depth(self) -> float:
        """Block depth of the oldest deferred weight gradient (infinity when none waits)."""
        return self._deferred[0][0].depth if self._deferred else float("inf")

    def run_deferred(self) -> bool:
        """Run the oldest deferred weight-gradient pass; False when none is waiting."""
        if not self._deferred:
            return False
        t, tensors, grads, weights = self._deferred.popleft()
        with self._label(f"{t.op.name}.wgrad"):
            t0 = time.perf_counter()
            torch.autograd.backward(tensors, grads, inputs=list(weights.params))
            t1 = time.perf_counter()
        for p in weights.params:
            left = self._deferred_params.pop(id(p)) - 1
            if left:
                self._deferred_params[id(p)] = left
        self.stats.compute_s += t1 - t0
        self.stats.num_deferred += 1
        if self.recorder is not None:
            self.recorder.add_span("compute", f"{t.op.name}.wgrad", t0, t1, self._args(t))
        return True

    def drain_deferred(self) -> None:
        while self.run_deferred():
            pass

    def launch_comm(self, t: Task) -> Pending:
        self._beat(t)
        self._before_forward(t)
        op, mb = t.op, t.mb
        with self._label(op.name), self._collective(t):
            if t.backward:
                pending = op.comm.backward(mb.grads.pop(op.outputs[0]), mb.side, t.channel)
            else:
                pending = op.comm.forward(mb.env[op.inputs[0]], mb.side, t.channel)
        self.stats.num_comms += 1
        if pending.device_events is not None:
            self._cuda = True
        return pending

    @contextlib.contextmanager
    def _collective(self, t: Task):
        """A failing collective (a dead peer) as a ``CollectiveError`` naming the op and its strand."""
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as err:
            if not is_comm_failure(err):
                raise
            groups = getattr(t.op.comm, "groups", None)
            group = groups.channel(t.channel) if hasattr(groups, "channel") else None
            raise CollectiveError(f"{t.op.name} ({t.strand} strand, micro-batch {t.mb.index}, block {t.block})",
                                  err, group) from err

    def finish_comm(self, t: Task, pending: Pending) -> None:
        with self._collective(t):
            out = pending.wait()
        done = time.perf_counter()
        if pending.device_events is not None:
            self._device_events.append(pending.device_events)
        self.stats.exposed_s += pending.waited_s
        self.stats.comm_s += done - pending.launched_at if pending.done_at is None \
            else pending.done_at - pending.launched_at
        if self.recorder is not None:
            end = pending.done_at or done
            group = "B" if t.channel else "F"  # lane of the strand group: one comm in flight each
            lane = f"{getattr(t.op.comm, 'lane', 'comm:tp')}:{group}"
            self.recorder.add_span(lane, t.op.name, pending.launched_at, end, self._args(t))
        if t.backward:
            _accumulate(t.mb.grads, t.op.inputs[0], out)
        else:
            t.mb.env[t.op.outputs[0]] = out

    # ------------------------------------------------------------------ one round
    def run_round(self, b_tasks: list[Task], f_tasks: list[Task], gated: bool = False,
                  trail: bool = False) -> None:
        """Run two strands' task lists together (either may be empty); barrier at the end.
        ``gated``: the forward strand stays within the backward strand's block depth; ``trail``:
        two backward strands, the second trailing the first (see ``_Round``)."""
        _Round(self, b_tasks, f_tasks, gated, trail).run()

    # ------------------------------------------------------------------ blocks and schedules
    def tasks(self, mb: MicroBatch, block: int, backward: bool, lo: int = 0, hi: int | None = None,
              depth: int = 0, swapped: bool = False):
        ops = self.graph.blocks[block]
        hi = len(ops) if hi is None else hi
        if not backward:
            return [Task(mb, block, i, ops[i], False, depth, swapped) for i in range(lo, hi)]
        # backward positions index the reversed op list; a recomputing layer's backward starts with
        # its forward again (in the round that runs its first backward op; a plan's earlier rounds
        # may give the backward an empty range)
        n = len(ops)
        again = [Task(mb, block, i, ops[i], False, depth, swapped, recompute=True) for i in range(n)] \
            if lo == 0 < hi and self._grad and self.recompute.full(block) else []
        return again + [Task(mb, block, n - 1 - j, ops[n - 1 - j], True, depth, swapped) for j in range(lo, hi)]

    def _strand(self, mb: MicroBatch, backward: bool, swapped: bool = False) -> list[Task]:
        """Every task of one micro-batch's forward (or backward, last block first)."""
        blocks = range(len(self.graph.blocks))
        order = reversed(blocks) if backward else blocks
        return [t for b in order for t in self.tasks(mb, b, backward, swapped=swapped)]

    def forward(self, mb: MicroBatch, blocks=None) -> None:
        """Forward of ``blocks`` (default: all) for one micro-batch, alone."""
        for block in (range(len(self.graph.blocks)) if blocks is None else blocks):
            self.run_round([], self.tasks(mb, block, False))
        mb.loss = mb.env.get("loss")

    def backward(self, mb: MicroBatch, seed: float | None, blocks=None) -> None:
        """Backward of ``blocks`` (default: all, last first) for one micro-batch, alone.
        ``seed``: the loss gradient (1/accumulation steps) when the loss block is included."""
        if seed is not None:
            self.start_backward(mb, seed)
        for block in (reversed(range(len(self.graph.blocks))) if blocks is None else blocks):
            self.run_round(self.tasks(mb, block, True), [])
        self.drain_deferred()

    def start_backward(self, mb: MicroBatch, seed: float) -> None:
        mb.loss = mb.env["loss"]
        mb.grads["loss"] = torch.full_like(mb.loss, seed)

    def pair(self, f_mb: MicroBatch, b_mb: MicroBatch, seed: float) -> None:
        """Co-execute the forward of ``f_mb`` with the backward of ``b_mb`` over the whole model (SI)."""
        self.start_backward(b_mb, seed)
        nb = len(self.graph.blocks)
        self.co_execute(f_mb, list(range(nb)), b_mb, list(reversed(range(nb))))
        f_mb.loss = f_mb.env.get("loss")

    def pair_forwards(self, first: MicroBatch, second: MicroBatch) -> None:
        """The forwards of two micro-batches co-executed (``pair_ends``: the step's first two)."""
        self.run_round(self._strand(first, False), self._strand(second, False, swapped=True))
        first.loss, second.loss = first.env.get("loss"), second.env.get("loss")

    def pair_backwards(self, first: MicroBatch, second: MicroBatch, seed: float) -> None:
        """The backwards of two micro-batches co-executed (``pair_ends``: the step's last two);
        ``second`` trails ``first`` op by op, so gradients accumulate in micro-batch order."""
        self.start_backward(first, seed)
        self.start_backward(second, seed)
        self.run_round(self._strand(first, True), self._strand(second, True, swapped=True), trail=True)
        self.drain_deferred()

    def pair_plan(self, fb: int, bb: int) -> SIPlan:
        """The plan of forward block ``fb`` beside backward block ``bb``: the SI plan when both are
        layers of the kind it is for, else (a dense layer beside an MoE one) the default plan of
        the two op lists, made once per pair of kinds."""
        from ..graph.ops import backward_order
        from ..planning.plan import default_plan
        fs, bs = self.graph.block_specs(fb), self.graph.block_specs(bb)
        if fs == bs == tuple(self.plan.fwd_ops):
            return self.plan
        key = (fs, bs)
        if key not in self._pair_plans:
            self._pair_plans[key] = default_plan(fs, backward_order(bs))
        return self._pair_plans[key]

    def co_execute(self, f_mb: MicroBatch, f_blocks: list[int], b_mb: MicroBatch, b_blocks: list[int]) -> None:
        """Forward ``f_blocks`` (in order) of ``f_mb`` together with backward ``b_blocks`` (in the
        order given, i.e. last layer first) of ``b_mb``. Reactive (no plan): both as one round. With
        a plan: the j-th forward block runs beside the j-th backward block; two decoder layers run
        by the SI plan's rounds, anything else as one round (backward ops first); the longer list's
        surplus runs alone."""
        nb = len(self.graph.blocks)
        if self.reactive:
            self.run_round([t for j, bb in enumerate(b_blocks) for t in self.tasks(b_mb, bb, True, depth=j)],
                           [t for j, fb in enumerate(f_blocks) for t in self.tasks(f_mb, fb, False, depth=j)],
                           gated=True)
            self.drain_deferred()
            return
        for j in range(max(len(f_blocks), len(b_blocks))):
            fb = f_blocks[j] if j < len(f_blocks) else None
            bb = b_blocks[j] if j < len(b_blocks) else None
            both_layers = fb is not None and bb is not None and 0 < fb < nb - 1 and 0 < bb < nb - 1
            if both_layers and self.plan is not None:
                for r in self.pair_plan(fb, bb).rounds:
                    self.run_round(self.tasks(b_mb, bb, True, *r.bwd), self.tasks(f_mb, fb, False, *r.fwd))
            else:
                self.run_round(self.tasks(b_mb, bb, True) if bb is not None else [],
                               self.tasks(f_mb, fb, False) if fb is not None else [])

    def run_microbatches(self, batches: list[dict], schedule: str, seed: float,
                         first_serial: int = 0) -> list[MicroBatch]:
        """Forward and backward of every micro-batch under ``schedule`` ("sequential", "si" or
        "intra"); micro-batch k is number ``first_serial + k`` of the run (what seeds its random draws)."""
        if schedule == "intra":
            return self._run_intra(batches, seed, first_serial)
        mbs = [MicroBatch(k, self.graph.make_side(b, first_serial + k)) for k, b in enumerate(batches)]
        if schedule == "sequential" or len(mbs) == 1:
            for mb in mbs:
                self.forward(mb)
                self.backward(mb, seed)
        elif schedule == "si" and self.pair_ends:  # F0xF1 | F2xB0 | ... | B(m-2)xB(m-1)
            self._deferring = self.defer_weight_grads
            try:
                self.pair_forwards(mbs[0], mbs[1])
                for k in range(len(mbs) - 2):
                    self.pair(mbs[k + 2], mbs[k], seed)
                self.pair_backwards(mbs[-2], mbs[-1], seed)
            finally:
                self._deferring = False
        elif schedule == "si":
            self.forward(mbs[0])
            if self.meter is not None and self.reactive:  # one micro-batch's activations, and the slack
                self._budget = self.meter.current * (1 + self.ACTIVATION_SLACK)
            self._deferring = self.defer_weight_grads
            try:
                for k in range(len(mbs) - 1):
                    self.pair(mbs[k + 1], mbs[k], seed)
                self.backward(mbs[-1], seed)
            finally:
                self._deferring = False
        else:
            raise ValueError(f"unknown schedule {schedule!r}; expected 'sequential', 'si' or 'intra'")
        self._budget = None
        self._end_microbatches(mbs)
        return mbs

    def _run_intra(self, batches: list[dict], seed: float, first_serial: int) -> list[MicroBatch]:
        """``intra``: each micro-batch's halves forward as a pair, then backward as a pair; returns
        one ``MicroBatch`` per micro-batch whose loss is its halves' sum."""
        wholes, halves = [], []
        self._deferring = self.defer_weight_grads
        try:
            for k, batch in enumerate(batches):
                a, b = (MicroBatch(k, self.graph.make_side(h, half_serial(first_serial + k, i)))
                        for i, h in enumerate(half_batches(batch)))
                self.pair_forwards(a, b)
                self.pair_backwards(a, b, seed)
                halves += [a, b]
                wholes.append(MicroBatch(k, a.side, loss=a.loss + b.loss))
        finally:
            self._deferring = False
        self._end_microbatches(halves)
        return wholes

    def _end_microbatches(self, mbs: list[MicroBatch]) -> None:
        for mb in mbs:
            assert not mb.saved, "op contexts left after backward"
            mb.env.clear()
            mb.grads.clear()
        self.reduce_replicated_grads(mbs[-1].index)

    def reduce_replicated_grads(self, after_microbatch: int = -1) -> None:
        """Sum the step's gradients of TP-replicated weights over the TP group (one blocking
        all-reduce, counted as exposed communication; traced as part of the backward strand of the
        step's last micro-batch)."""
        if self.graph.replicated is None or not self._grad:
            return
        t0 = time.perf_counter()
        nbytes = self.graph.replicated.all_reduce()
        t1 = time.perf_counter()
        if nbytes:
            self.stats.comm_s += t1 - t0
            self.stats.exposed_s += t1 - t0
            self.stats.num_comms += 1
            if self.recorder is not None:
                self.recorder.add_span("comm:tp:grads", "replicated.allreduce", t0, t1,
                                       {"strand": "B", "microbatch": after_microbatch, "bytes": nbytes,
                                        "op": "replicated.allreduce", "direction": "backward"})

    def _label(self, name: str):
        """The recorder's ``torch.profiler`` range for an op (no-op without a recorder)."""
        return self.recorder.label(name) if self.recorder is not None else contextlib.nullcontext()

    def _beat(self, t: Task) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(microbatch=t.mb.index, strand=t.strand, op=f"{t.op.name} (block {t.block})")

    @staticmethod
    def _args(t: Task) -> dict:
        args = {"strand": t.strand, "microbatch": t.mb.index, "block": t.block, "op": t.op.name,
                "direction": "backward" if t.backward or t.recompute else "forward"}
        if t.recompute:
            args["recompute"] = True
        return args
