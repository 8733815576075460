"""The instruction vocabulary every schedule is written in, one-stage and pipeline alike.

A schedule is one list of instructions per rank (``Schedule``); one interpreter
(``ds_dhelix.runtime.interpreter``) runs a rank's list through the executor, and the replay
(``simulate``) checks every rank's list before anything runs. ``phase`` names the chunk of layers
an instruction runs: on one stage there is one chunk, the whole model (``WHOLE``); in the fold,
phase 0 is a rank's outbound chunk and phase 1 its return chunk (``folding``).

    compute   Forward, Backward, ForwardBackward (an SI pair), ForwardForward (two forwards side
              by side), BackwardBackward (two backwards, the second trailing the first)
    p2p       SendActivation / RecvActivation / SendGrad / RecvGrad (posted, never blocking),
              WaitRecv, WaitSends
    step      LoadMicroBatch, FixActivationBudget, ReduceGrads, OptimizerStep

Plain data: no torch, no deepspeed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ACTIVATION = "activation"
GRAD = "grad"
WHOLE = 0
"""The phase of a one-stage instruction: its chunk is the whole model."""


@dataclass(frozen=True)
class Instruction:
    """Base class; every instruction is a frozen record an interpreter dispatches on by type."""

    def label(self) -> str:
        return type(self).__name__


def _tag(mb: int, phase: int) -> str:
    return f"{mb}'" if phase else str(mb)


@dataclass(frozen=True)
class LoadMicroBatch(Instruction):
    """Rank 0: load inputs and labels of micro-batch ``mb`` (input of its phase-0 forward)."""

    mb: int


@dataclass(frozen=True)
class Forward(Instruction):
    """Run this rank's ``phase`` chunk forward on micro-batch ``mb``; keep its activations."""

    mb: int
    phase: int = WHOLE

    def label(self) -> str:
        return "F" + _tag(self.mb, self.phase)


@dataclass(frozen=True)
class Backward(Instruction):
    """Backward of this rank's ``phase`` chunk for ``mb`` (input and weight grads); frees them."""

    mb: int
    phase: int = WHOLE

    def label(self) -> str:
        return "B" + _tag(self.mb, self.phase)


@dataclass(frozen=True)
class ForwardBackward(Instruction):
    """Co-execute (SI) ``Forward(f_mb, f_phase)`` with ``Backward(b_mb, b_phase)``; both finish."""

    f_mb: int
    f_phase: int
    b_mb: int
    b_phase: int

    @property
    def forward(self) -> Forward:
        return Forward(self.f_mb, self.f_phase)

    @property
    def backward(self) -> Backward:
        return Backward(self.b_mb, self.b_phase)

    def label(self) -> str:
        return self.forward.label() + self.backward.label()


@dataclass(frozen=True)
class ForwardForward(Instruction):
    """Two micro-batches' forwards of the ``phase`` chunk side by side; the second launches its
    collectives on the other channel of the strand groups."""

    first: int
    second: int
    phase: int = WHOLE

    def label(self) -> str:
        return Forward(self.first, self.phase).label() + Forward(self.second, self.phase).label()


@dataclass(frozen=True)
class BackwardBackward(Instruction):
    """Two micro-batches' backwards of the ``phase`` chunk side by side, ``second`` trailing
    ``first`` op by op (gradients accumulate in micro-batch order)."""

    first: int
    second: int
    phase: int = WHOLE

    def label(self) -> str:
        return Backward(self.first, self.phase).label() + Backward(self.second, self.phase).label()


@dataclass(frozen=True)
class FixActivationBudget(Instruction):
    """From here on, the forward strand of a pair keeps the live activation bytes within what is
    live now (one micro-batch's whole forward) plus the executor's slack; the step's end lifts it."""


@dataclass(frozen=True)
class SendActivation(Instruction):
    """Post a send of the forward output of ``(mb, phase)`` to rank ``peer`` (non-blocking)."""

    mb: int
    phase: int
    peer: int


@dataclass(frozen=True)
class RecvActivation(Instruction):
    """Post a receive of the forward input of ``(mb, phase)`` from rank ``peer`` (non-blocking)."""

    mb: int
    phase: int
    peer: int


@dataclass(frozen=True)
class SendGrad(Instruction):
    """Post a send of the input gradient of ``(mb, phase)`` (made by its backward) to ``peer``."""

    mb: int
    phase: int
    peer: int


@dataclass(frozen=True)
class RecvGrad(Instruction):
    """Post a receive of the output gradient for ``(mb, phase)`` from rank ``peer``."""

    mb: int
    phase: int
    peer: int


@dataclass(frozen=True)
class WaitRecv(Instruction):
    """Block until the posted receive of ``kind`` (activation/grad) for (mb, phase) has landed."""

    kind: str
    mb: int
    phase: int


@dataclass(frozen=True)
class WaitSends(Instruction):
    """Block until every send this rank posted has been received."""


@dataclass(frozen=True)
class ReduceGrads(Instruction):
    """Reduce the step's gradients: the TP-replicated weights' over the TP group, then the
    data-parallel reduction."""


@dataclass(frozen=True)
class OptimizerStep(Instruction):
    """Apply the optimizer to this rank's parameters."""


Schedule = list[list[Instruction]]
"""One instruction list per rank."""


@dataclass(frozen=True)
class Minimum:
    """The smallest micro-batch count a schedule takes for p stages, with its formula's text."""

    formula: str
    of: Callable[[int], int]

    def check(self, name: str, num_stages: int, num_microbatches: int) -> None:
        """ValueError naming the formula and the smallest valid m when (p, m) does not fit."""
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages={num_stages!r}: need a positive number of pipeline ranks")
        need = self.of(num_stages)
        if not isinstance(num_microbatches, int) or num_microbatches < need:
            raise ValueError(
                f"{name} schedule with num_stages={num_stages} needs num_microbatches >= "
                f"{self.formula} = {need}, got {num_microbatches}; use at least {need} micro-batches"
            )


ONE = Minimum("1", lambda p: 1)


COMPUTE = (Forward, Backward, ForwardBackward, ForwardForward, BackwardBackward)


def compute_parts(ins: Instruction) -> tuple[Forward | Backward, ...]:
    """The Forward/Backward parts of a compute instruction (a pair gives both), else ``()``."""
    if isinstance(ins, (Forward, Backward)):
        return (ins,)
    if isinstance(ins, ForwardBackward):
        return ins.forward, ins.backward
    if isinstance(ins, ForwardForward):
        return Forward(ins.first, ins.phase), Forward(ins.second, ins.phase)
    if isinstance(ins, BackwardBackward):
        return Backward(ins.first, ins.phase), Backward(ins.second, ins.phase)
    return ()


def forward_only(instructions: list[Instruction]) -> list[Instruction]:
    """A rank's list reduced to what an evaluation runs: the forwards (a pair's forward parts, in
    order) and the activations' loads, sends, receives and waits; no backward, no step."""
    out: list[Instruction] = []
    for ins in instructions:
        parts = compute_parts(ins)
        if parts:
            out += [p for p in parts if isinstance(p, Forward)]
        elif isinstance(ins, (LoadMicroBatch, SendActivation, RecvActivation, WaitSends)) or (
            isinstance(ins, WaitRecv) and ins.kind == ACTIVATION
        ):
            out.append(ins)
    return out
