"""The interpreter: one rank's instruction list (``ds_dhelix.schedule``) run through the executor.
Both engines use it, the one-stage ``DhelixEngine`` and the folded ``FoldedPipelineEngine``; what
only an engine can do (p2p sends and receives, DeepSpeed's reduction and optimizer step) it passes
in as handlers for those instructions::

    Forward / Backward     executor.forward / backward over the phase's chunk of blocks
    ForwardBackward        co_execute: an SI pair, reactive (one round) or by the SI plan's rounds
    ForwardForward         pair_forwards: two forwards side by side, the second on the other channel
    BackwardBackward       pair_backwards: two backwards, the second trailing the first op by op
    FixActivationBudget    executor.fix_activation_budget (the live bytes of one whole forward)
    LoadMicroBatch         nothing: a step's micro-batches are built before it runs (``prepare``)
    ReduceGrads            the micro-batches are done (checked, freed), then the engine's handler
    anything else          the engine's handler; an instruction nobody handles is an error

``chunks`` maps a phase to its blocks (one stage: ``WHOLE`` -> every block); the backward of
``loss_phase`` starts from the loss, seeded with the step's seed. ``run_microbatches`` runs a
one-stage schedule by name, the optimizer left to the caller. Imports no executor module: the
executor is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..schedule import instructions as S
from ..schedule.registry import ONE_STAGE, ScheduleSpec, lookup
from .tasks import MicroBatch


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
        half = {
            k: v[lo:hi] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v
            for k, v in batch.items()
        }
        half.update(loss_denominator=denominator, loss_share=(hi - lo) / rows)
        halves.append(half)
    return halves[0], halves[1]


def prepare(graph, batches: list[dict], spec: ScheduleSpec, first_serial: int = 0) -> list[MicroBatch]:
    """The micro-batches ``spec``'s instruction lists name: one per batch, micro-batch k numbered
    ``first_serial + k`` for its random draws; under ``intra`` the two halves of each
    (``half_batches``, ``half_serial``)."""
    if not spec.halves:
        return [MicroBatch(k, graph.make_side(b, first_serial + k)) for k, b in enumerate(batches)]
    return [
        MicroBatch(2 * k + i, graph.make_side(h, half_serial(first_serial + k, i)))
        for k, batch in enumerate(batches)
        for i, h in enumerate(half_batches(batch))
    ]


def wholes(spec: ScheduleSpec, mbs: list[MicroBatch]) -> list[MicroBatch]:
    """One ``MicroBatch`` per micro-batch of the step: ``mbs`` itself, or under ``intra`` one per
    pair of halves whose loss is their sum."""
    if not spec.halves:
        return mbs
    return [MicroBatch(k, a.side, loss=a.loss + b.loss) for k, (a, b) in enumerate(zip(mbs[::2], mbs[1::2]))]


class Interpreter:
    """Runs instruction lists through ``executor`` (see the module docstring)."""

    def __init__(self, executor, chunks: Mapping[int, list[int]] | None = None, loss_phase: int | None = S.WHOLE):
        self.ex = executor
        self.chunks = dict(chunks) if chunks is not None else {S.WHOLE: list(range(len(executor.graph.blocks)))}
        self.loss_phase = loss_phase
        self._pair_plans: dict = {}  # (forward kind, backward kind) -> default plan (mixed layer kinds)
        self._mbs: list[MicroBatch] = []
        self._seed = 0.0
        self._ended = True
        self._own = {
            S.LoadMicroBatch: lambda ins: None,
            S.Forward: self._forward,
            S.Backward: self._backward,
            S.ForwardBackward: self._forward_backward,
            S.ForwardForward: self._forward_forward,
            S.BackwardBackward: self._backward_backward,
            S.FixActivationBudget: lambda ins: executor.fix_activation_budget(),
        }

    def run(
        self,
        instructions: list[S.Instruction],
        mbs: list[MicroBatch],
        seed: float,
        *,
        defer: bool = False,
        handlers: Mapping[type, Callable] | None = None,
    ) -> list[MicroBatch]:
        """Run ``instructions`` over ``mbs`` (indexed by the instructions' micro-batch numbers);
        ``seed``: the loss gradient; ``defer``: weight gradients deferred inside pairs; ``handlers``:
        the engine's, by instruction type. Returns ``mbs``, their values freed."""
        handlers = handlers or {}
        self._mbs, self._seed, self._ended = mbs, seed, False
        try:
            # autograd's device threads off: on CUDA each engine call would otherwise be handed to
            # the device's worker thread and waited for (~0.3 ms per call on an H200, one per op)
            with self.ex.deferring(defer), torch.autograd.set_multithreading_enabled(False):
                for ins in instructions:
                    if isinstance(ins, S.ReduceGrads):
                        self._end_microbatches()
                    handler = handlers.get(type(ins)) or self._own.get(type(ins))
                    if handler is None:
                        raise ValueError(
                            f"instruction {ins!r} has no handler here: this engine runs "
                            f"{sorted(t.__name__ for t in {**self._own, **handlers})}"
                        )
                    handler(ins)
            self._end_microbatches()
        finally:
            self._mbs = []
        return mbs

    def _end_microbatches(self) -> None:
        if self._ended:
            return
        for mb in self._mbs:
            assert not mb.saved, f"micro-batch {mb.index}: op contexts left after its backward"
            mb.env.clear()
            mb.grads.clear()
        self._ended = True

    def _seed_of(self, phase: int) -> float | None:
        return self._seed if phase == self.loss_phase else None

    # ------------------------------------------------------------------ compute instructions
    def _forward(self, ins: S.Forward) -> None:
        self.ex.forward(self._mbs[ins.mb], self.chunks[ins.phase])

    def _backward(self, ins: S.Backward) -> None:
        self.ex.backward(self._mbs[ins.mb], self._seed_of(ins.phase), list(reversed(self.chunks[ins.phase])))

    def _forward_backward(self, ins: S.ForwardBackward) -> None:
        f, b = self._mbs[ins.f_mb], self._mbs[ins.b_mb]
        assert f is not b, f"SI pair of micro-batch {f.index} with itself"
        if ins.b_phase == self.loss_phase:
            self.ex.start_backward(b, self._seed)
        self.co_execute(f, self.chunks[ins.f_phase], b, list(reversed(self.chunks[ins.b_phase])))
        if ins.f_phase == self.loss_phase:
            f.loss = f.env.get("loss")

    def _forward_forward(self, ins: S.ForwardForward) -> None:
        """Two forwards side by side; the second strand's collectives on the other channel."""
        first, second, blocks = self._mbs[ins.first], self._mbs[ins.second], self.chunks[ins.phase]
        self._need_reactive(ins)
        self.ex.run_round(self._strand(first, blocks, False), self._strand(second, blocks, False, swapped=True))
        first.loss, second.loss = first.env.get("loss"), second.env.get("loss")

    def _backward_backward(self, ins: S.BackwardBackward) -> None:
        """Two backwards, last block first; the second trails the first op by op, so gradients
        accumulate in micro-batch order."""
        first, second = self._mbs[ins.first], self._mbs[ins.second]
        blocks = list(reversed(self.chunks[ins.phase]))
        self._need_reactive(ins)
        if ins.phase == self.loss_phase:
            self.ex.start_backward(first, self._seed)
            self.ex.start_backward(second, self._seed)
        self.ex.run_round(
            self._strand(first, blocks, True), self._strand(second, blocks, True, swapped=True), trail=True
        )
        self.ex.drain_deferred()

    def _need_reactive(self, ins: S.Instruction) -> None:
        if not self.ex.reactive:
            raise ValueError(
                f"{ins.label()}: pairing two strands of one direction (pair_ends, intra) needs "
                f"reactive execution; a plan pairs a forward with a backward"
            )

    def _strand(self, mb: MicroBatch, blocks: list[int], backward: bool, swapped: bool = False) -> list:
        """Every task of one micro-batch over ``blocks`` in one direction (backward: last block first)."""
        return [t for b in blocks for t in self.ex.tasks(mb, b, backward, swapped=swapped)]

    # ------------------------------------------------------------------ SI pairs
    def co_execute(self, f_mb: MicroBatch, f_blocks: list[int], b_mb: MicroBatch, b_blocks: list[int]) -> None:
        """Forward ``f_blocks`` (in order) of ``f_mb`` together with backward ``b_blocks`` (in the
        order given, i.e. last layer first) of ``b_mb``. Reactive (no plan): both as one round, the
        forward strand gated by the backward strand's block depth. With a plan: the j-th forward
        block runs beside the j-th backward block; two decoder layers run by the SI plan's rounds,
        anything else as one round (backward ops first); the longer list's surplus runs alone."""
        ex = self.ex
        if ex.reactive:
            ex.run_round(
                [t for j, bb in enumerate(b_blocks) for t in ex.tasks(b_mb, bb, True, depth=j)],
                [t for j, fb in enumerate(f_blocks) for t in ex.tasks(f_mb, fb, False, depth=j)],
                gated=True,
            )
            ex.drain_deferred()
            return
        nb = len(ex.graph.blocks)
        for j in range(max(len(f_blocks), len(b_blocks))):
            fb = f_blocks[j] if j < len(f_blocks) else None
            bb = b_blocks[j] if j < len(b_blocks) else None
            both_layers = fb is not None and bb is not None and 0 < fb < nb - 1 and 0 < bb < nb - 1
            if both_layers and ex.plan is not None:
                for r in self.pair_plan(fb, bb).rounds:
                    ex.run_round(ex.tasks(b_mb, bb, True, *r.bwd), ex.tasks(f_mb, fb, False, *r.fwd))
            else:
                ex.run_round(
                    ex.tasks(b_mb, bb, True) if bb is not None else [],
                    ex.tasks(f_mb, fb, False) if fb is not None else [],
                )

    def pair_plan(self, fb: int, bb: int):
        """The plan of forward block ``fb`` beside backward block ``bb``: the SI plan when both are
        layers of the kind it is for, else (a dense layer beside an MoE one) the default plan of
        the two op lists, made once per pair of kinds."""
        from ..graph.ops import backward_order
        from ..planning.plan import default_plan

        graph, plan = self.ex.graph, self.ex.plan
        fs, bs = graph.block_specs(fb), graph.block_specs(bb)
        if fs == bs == tuple(plan.fwd_ops):
            return plan
        key = (fs, bs)
        if key not in self._pair_plans:
            self._pair_plans[key] = default_plan(fs, backward_order(bs))
        return self._pair_plans[key]


def run_microbatches(
    executor, batches: list[dict], schedule: str, seed: float, first_serial: int = 0
) -> list[MicroBatch]:
    """Forward and backward of every micro-batch under the one-stage ``schedule`` (a registry name:
    sequential, si, si-ends, intra, ...), the TP-replicated gradients reduced; the optimizer is the
    caller's. Micro-batch k is number ``first_serial + k`` of the run (what seeds its random draws).
    Returns one ``MicroBatch`` per batch, with its loss."""
    spec = lookup(schedule, ONE_STAGE)
    mbs = prepare(executor.graph, batches, spec, first_serial)
    instructions = spec.schedule(1, len(batches))[0]
    handlers = {
        S.ReduceGrads: lambda ins: executor.reduce_replicated_grads(mbs[-1].index),
        S.OptimizerStep: lambda ins: None,
    }  # the caller steps its optimizer
    Interpreter(executor).run(instructions, mbs, seed, defer=spec.defers_weight_grads, handlers=handlers)
    return wholes(spec, mbs)
