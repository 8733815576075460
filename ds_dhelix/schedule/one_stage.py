"""One-stage schedules as data: the single rank's instruction list for a step of m micro-batches.

Every instruction's chunk is the whole model (phase ``WHOLE``); F = forward, B = backward,
(x) = co-executed (one ``ForwardBackward``, ``ForwardForward`` or ``BackwardBackward``)::

    sequential   F0 B0 F1 B1 ... F(m-1) B(m-1)                   each collective waited at once
    si           F0 | F1(x)B0 | F2(x)B1 | ... | B(m-1)           SI: forward of k+1 beside backward of k
    si-ends      F0(x)F1 | F2(x)B0 | ... | F(m-1)(x)B(m-3) | B(m-2)(x)B(m-1)    no strand alone
    intra        F0a(x)F0b | B0a(x)B0b | F1a(x)F1b | ...        a, b: the halves of a micro-batch

``si`` fixes the activation budget after its lone first forward (``FixActivationBudget``): the
forward strand of every later pair keeps the live activations within that micro-batch's.
``intra`` lists 2m micro-batches, the halves (2k, 2k+1) of micro-batch k. How a pair runs
(reactive, or by the SI plan's rounds) is the executor's (``dhelix.si_execution``), not the list's.

Plain data: no torch, no deepspeed.
"""

from __future__ import annotations

from .instructions import (
    Backward,
    BackwardBackward,
    FixActivationBudget,
    Forward,
    ForwardBackward,
    ForwardForward,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    ReduceGrads,
    Schedule,
)


def _check(name: str, num_stages: int, m: int, need: int = 1) -> None:
    if num_stages != 1:
        raise ValueError(
            f"{name} is a one-stage schedule; got num_stages={num_stages} (use w, dualpipev or the "
            f"sequential fold with a pipeline)"
        )
    if not isinstance(m, int) or m < need:
        raise ValueError(f"{name} needs num_microbatches >= {need}, got {m!r}")


def _step(body: list[Instruction]) -> Schedule:
    return [body + [ReduceGrads(), OptimizerStep()]]


def sequential_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """One micro-batch after another: F0 B0 F1 B1 ..."""
    _check("sequential", num_stages, num_microbatches)
    return _step([ins for k in range(num_microbatches) for ins in (LoadMicroBatch(k), Forward(k), Backward(k))])


def si_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """SI: F0 alone, then F(k+1) beside B(k), then B(m-1) alone."""
    _check("si", num_stages, num_microbatches)
    m = num_microbatches
    if m == 1:
        return sequential_schedule(1, 1)
    body: list[Instruction] = [LoadMicroBatch(0), Forward(0), FixActivationBudget()]
    for k in range(m - 1):
        body += [LoadMicroBatch(k + 1), ForwardBackward(k + 1, 0, k, 0)]
    return _step(body + [Backward(m - 1)])


def si_ends_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """SI with no strand alone: F0 beside F1, F(k+2) beside B(k), B(m-2) beside B(m-1)."""
    _check("si-ends", num_stages, num_microbatches)
    m = num_microbatches
    if m == 1:
        return sequential_schedule(1, 1)
    body: list[Instruction] = [LoadMicroBatch(0), LoadMicroBatch(1), ForwardForward(0, 1)]
    for k in range(m - 2):
        body += [LoadMicroBatch(k + 2), ForwardBackward(k + 2, 0, k, 0)]
    return _step(body + [BackwardBackward(m - 2, m - 1)])


def intra_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Domino's intra-batch overlap over 2m halves: each micro-batch's halves forward side by side,
    then backward side by side (the second trailing)."""
    _check("intra", num_stages, num_microbatches)
    body: list[Instruction] = []
    for k in range(num_microbatches):
        a, b = 2 * k, 2 * k + 1
        body += [LoadMicroBatch(a), LoadMicroBatch(b), ForwardForward(a, b), BackwardBackward(a, b)]
    return _step(body)
