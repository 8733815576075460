"""Folded pipeline schedules as data: one list of instructions per rank (vocabulary: ``instructions``).

The fold (see :mod:`ds_dhelix.pipe.folding`): rank r runs chunk r in phase 0 (outbound) and chunk
2p-1-r in phase 1 (return). A micro-batch's forward goes rank 0 phase 0 -> ... -> rank p-1 phase 0
-> rank p-1 phase 1 -> ... -> rank 0 phase 1 (loss); its backward goes the reverse way. The
forward of phase 0 and the backward of phase 1 both move towards rank p-1, the forward of phase 1
and the backward of phase 0 both move towards rank 0, so a rank can co-execute (SI) F0(k)⊗B1(j)
and F1(k)⊗B0(j) (:class:`ForwardBackward`); F1(k) is the forward of phase 1 on micro-batch k.

Timeline labels: ``Fk``/``Bk`` forward/backward of micro-batch k in phase 0, ``Fk'``/``Bk'`` in
phase 1, ``FxBy`` one co-executed pair. The W schedule for p=2, m=4, unit costs (``dhelix simulate
--schedule w --pp 2 --micro-batches 4 --fwd-cost 1 --bwd-cost 1``)::

    time    0     1     2     3     4     5     6     7     8     9     10    11    12    13
    rank 0  F0    F1    .     F0'   F2B0' F1'   F3B1' F2'B0 B2'   F3'B1 B3'   B2    .     B3
    rank 1  .     F0    F0'   F1    F1'   F2B0' F2'B0 F3B1' F3'B1 B2'   B2    B3'   B3    .

Each rank alternates a phase-0 slot and a phase-1 slot. In a phase-0 slot it runs ``F0(k)`` with
``B1(k-p)``, in a phase-1 slot ``F1(k)`` with ``B0(k-p)`` (either part missing at the ends), so in
steady state every slot is an SI pair and the backward strand trails the forward strand by p
micro-batches. Rank r starts with p-r phase-0 slots before its first phase-1 slot. (The slot
model places phase-0 slot k of rank r at time r+2k and phase-1 slot k at 2p-1-r+2k; the order of
slots on a rank is the schedule, actual start times come from the replay.)

DualPipeV with SI (:func:`dualpipev_si_schedule`) keeps DeepSeek's per-rank order (nF0, nF0F1,
nB1W1F1, nF0B1F1B0, nB1F1B0, nB1B0, nWB0; weight gradients stay inside backward, so the W steps are
empty) and turns each F0/B1 and F1/B0 pair of its main steps into one :class:`ForwardBackward`.
:func:`sequential_fold_schedule` runs one micro-batch at a time (parity baseline).

Communication is asynchronous: ``Recv*`` only posts a receive (at the latest one compute
instruction ahead of use), ``WaitRecv`` blocks right before the compute that needs the data,
``Send*`` posts a send and never blocks; ``WaitSends`` at the end of the step blocks until every
posted send was received. Sends and receives match per directed channel (src, dst) in posting
order, as NCCL matches point-to-point ops (it has no tags), so a receiver posts a channel's
receives in its sender's order, earlier than it needs them where the two orders differ. An
executor keeps the channels independent by giving each direction of a rank pair its own
communicator (or by tagging under gloo). ``dhelix simulate`` / :mod:`ds_dhelix.schedule.simulate`
replays all ranks to check this before anything runs.

Plain data: no torch, no deepspeed.
"""

from __future__ import annotations

from collections.abc import Callable

from ..schedule.instructions import (
    ACTIVATION,
    GRAD,
    ONE,
    Backward,
    Forward,
    ForwardBackward,
    Instruction,
    LoadMicroBatch,
    Minimum,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    Schedule,
    SendActivation,
    SendGrad,
    WaitRecv,
    WaitSends,
    compute_parts,
)
from .folding import next_chunk_owner, prev_chunk_owner

# ---- minimum micro-batch counts ------------------------------------------------------------------

MIN_W = Minimum("p + 1", lambda p: p + 1)
"""The first SI pair on each rank is F0(p) with B1(0): m must exceed p."""

MIN_DUALPIPEV = Minimum("2 * p - 1", lambda p: 2 * p - 1)
"""DualPipeV's main step runs m - 2p + r + 1 >= 0 times on rank r; DeepSeek and DeepSpeed assert
m >= 2p, one more than the order needs (replay checks m = 2p - 1)."""


# ---- per-rank compute orders ---------------------------------------------------------------------


def _pair(f: Forward | None, b: Backward | None) -> Instruction | None:
    if f and b:
        return ForwardBackward(f.mb, f.phase, b.mb, b.phase)
    return f or b


def _w_compute(rank: int, p: int, m: int) -> list[Instruction]:
    """Slot model: phase-0 slot k at time r+2k runs F0(k)⊗B1(k-p); phase-1 slot k at 2p-1-r+2k
    runs F1(k)⊗B0(k-p). The order on the rank is the slot order."""
    slots = []
    for phase, first in ((0, rank), (1, 2 * p - 1 - rank)):
        for k in range(m + p):
            f = Forward(k, phase) if k < m else None
            b = Backward(k - p, 1 - phase) if k >= p else None
            slots.append((first + 2 * k, _pair(f, b)))
    return [ins for _, ins in sorted(slots, key=lambda s: s[0])]


def _dualpipev_compute(rank: int, p: int, m: int) -> list[Instruction]:
    """DualPipeV's eight steps with weight gradients inside backward and F/B pairs fused."""
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}

    def nxt(kind, phase):
        mb = count[kind, phase]
        count[kind, phase] += 1
        return Forward(mb, phase) if kind == "F" else Backward(mb, phase)

    out: list[Instruction] = []
    for _ in range(2 * (p - rank - 1)):  # Step 1: nF0
        out.append(nxt("F", 0))
    for _ in range(rank + 1):  # Step 2: nF0F1
        out += [nxt("F", 0), nxt("F", 1)]
    for _ in range(p - rank - 1):  # Step 3: nB1W1F1 (W is inside B)
        out += [nxt("B", 1), nxt("F", 1)]
    for _ in range(m - 2 * p + rank + 1):  # Step 4 (main step): nF0B1F1B0
        out += [_pair(nxt("F", 0), nxt("B", 1)), _pair(nxt("F", 1), nxt("B", 0))]
    for _ in range(p - rank - 1):  # Step 5: nB1F1B0
        out += [nxt("B", 1), _pair(nxt("F", 1), nxt("B", 0))]
    for _ in range(rank + 1):  # Step 6: nB1B0
        out += [nxt("B", 1), nxt("B", 0)]
    for _ in range(p - rank - 1):  # Step 7: nWB0 (W is inside B); Step 8 nW is empty
        out.append(nxt("B", 0))
    return out


def _sequential_compute(rank: int, p: int, m: int) -> list[Instruction]:
    """One micro-batch at a time through the whole fold and back: no pipelining, no SI."""
    return [ins for k in range(m) for ins in (Forward(k, 0), Forward(k, 1), Backward(k, 1), Backward(k, 0))]


# ---- communication around the compute order ------------------------------------------------------


def _needs(rank: int, part: Instruction, p: int) -> list[Instruction]:
    """Receives a compute part needs from another rank."""
    if isinstance(part, Forward):
        src = prev_chunk_owner(rank, part.phase, p)
        if src and src[0] != rank:
            return [RecvActivation(part.mb, part.phase, src[0])]
    else:
        src = next_chunk_owner(rank, part.phase, p)
        if src and src[0] != rank:
            return [RecvGrad(part.mb, part.phase, src[0])]
    return []


def _sends(rank: int, part: Instruction, p: int) -> list[Instruction]:
    """Sends that hand a compute part's result to another rank."""
    if isinstance(part, Forward):
        dst = next_chunk_owner(rank, part.phase, p)
        if dst and dst[0] != rank:
            return [SendActivation(part.mb, part.phase, dst[0])]
    else:
        dst = prev_chunk_owner(rank, part.phase, p)
        if dst and dst[0] != rank:
            return [SendGrad(part.mb, part.phase, dst[0])]
    return []


def _wait(recv: Instruction) -> WaitRecv:
    return WaitRecv(ACTIVATION if isinstance(recv, RecvActivation) else GRAD, recv.mb, recv.phase)


def _send_order(rank: int, compute: list[Instruction], p: int) -> dict[int, list]:
    """Per destination rank, the keys ``(kind, mb, phase)`` this rank sends, in sending order."""
    order: dict[int, list] = {}
    for ins in compute:
        for part in compute_parts(ins):
            for s in _sends(rank, part, p):
                kind = ACTIVATION if isinstance(s, SendActivation) else GRAD
                order.setdefault(s.peer, []).append((kind, s.mb, s.phase))
    return order


def _recv(kind: str, mb: int, phase: int, peer: int) -> Instruction:
    return (RecvActivation if kind == ACTIVATION else RecvGrad)(mb, phase, peer)


def add_communication(computes: list[list[Instruction]], p: int) -> Schedule:
    """Wrap every rank's compute order with async p2p. Results are sent as soon as they exist.
    A rank posts receives one compute instruction ahead of use and waits just before use; on each
    channel it posts them in the order the sender sends (NCCL matches by order), so a receive the
    sender sends earlier than this rank needs it is posted early."""
    send_orders = [_send_order(r, computes[r], p) for r in range(p)]
    return [_wrap_rank(r, computes[r], [send_orders[s].get(r, []) for s in range(p)], p) for r in range(p)]


def _wrap_rank(rank: int, compute: list[Instruction], incoming: list[list], p: int):
    needs = [[r for part in compute_parts(ins) for r in _needs(rank, part, p)] for ins in compute]
    posted = [0] * p  # per source rank: how much of its send order is posted here

    def post_through(recv) -> list[Instruction]:
        """Post, in the sender's order, every receive from its rank up to and including ``recv``."""
        src, key = recv.peer, (_wait(recv).kind, recv.mb, recv.phase)
        order = incoming[src]
        if key not in order[posted[src] :]:
            return [] if key in order[: posted[src]] else [recv]  # already posted / never sent
        end = order.index(key, posted[src]) + 1
        out = [_recv(*k, src) for k in order[posted[src] : end]]
        posted[src] = end
        return out

    out: list[Instruction] = [x for r in (needs[0] if compute else []) for x in post_through(r)]
    for i, ins in enumerate(compute):
        if i + 1 < len(compute):
            out += [x for r in needs[i + 1] for x in post_through(r)]
        out += [_wait(r) for r in needs[i]]
        out += [
            LoadMicroBatch(part.mb)
            for part in compute_parts(ins)
            if isinstance(part, Forward) and part.phase == 0 and rank == 0
        ]
        out.append(ins)
        out += [s for part in compute_parts(ins) for s in _sends(rank, part, p)]
    return out + [WaitSends(), ReduceGrads(), OptimizerStep()]


def _build(
    name: str, compute: Callable[[int, int, int], list[Instruction]], minimum: Minimum, p: int, m: int
) -> Schedule:
    minimum.check(name, p, m)
    return add_communication([compute(r, p, m) for r in range(p)], p)


def w_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """DHelix W schedule (see module docstring); needs ``num_microbatches >= num_stages + 1``."""
    return _build("w", _w_compute, MIN_W, num_stages, num_microbatches)


def dualpipev_si_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """DualPipeV's order with every F0/B1 and F1/B0 pair of its main steps as one SI
    :class:`ForwardBackward`; needs ``num_microbatches >= 2 * num_stages - 1``."""
    return _build("dualpipev", _dualpipev_compute, MIN_DUALPIPEV, num_stages, num_microbatches)


def sequential_fold_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Fold layout without pipelining or co-execution (parity baseline): each micro-batch runs its
    whole forward, then its whole backward, before the next starts."""
    return _build("sequential", _sequential_compute, ONE, num_stages, num_microbatches)
