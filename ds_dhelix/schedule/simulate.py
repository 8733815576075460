"""Pure replay of every rank's instruction stream of a schedule: the fold's (see
:mod:`ds_dhelix.pipe.schedule`) or one stage's (:mod:`ds_dhelix.schedule.one_stage`, ``one_stage=True``:
one rank, one chunk, the whole model).

:func:`replay` runs all ranks' lists against each other:

* communication: ``Recv*``/``Send*`` post without blocking; ops on a directed channel (src, dst)
  match in posting order and must agree on kind, micro-batch and phase, and the peer must be the
  neighbour the fold says; ``WaitRecv`` blocks until the matching send is posted, ``WaitSends``
  until every send of the rank has a posted receive. When no rank can move and some are not done,
  that is a deadlock and every stuck rank's instruction is reported.
* buffers: a forward needs its input (loaded, received and waited on, or made locally at the
  turn on rank p-1); a backward needs its saved activations and its output gradient (loss, local,
  or received). Receiving twice, waiting twice, sending a result twice or before it exists, and
  freeing activations twice are errors.
* work: every (micro-batch, chunk) is forwarded exactly once and backwarded exactly once after its
  forward, chunks in reverse data-flow order (a backward needs the gradient its successor sends);
  grads are reduced and the optimizer steps once per rank, after all backward work.

Timing: ``Forward`` costs F, ``Backward`` B, ``ForwardBackward`` ``pair_cost`` (``"max"``:
max(F, B), perfect overlap, the default; ``"sum"``: F+B, no overlap; or a number); communication
costs ``latency`` (default 0). Each rank starts an instruction as soon as its previous one ends and
its waits are satisfied. bubble fraction = idle / (p * makespan).

W schedule bubble, closed form (:func:`w_bubble_closed_form`), for m >= p+1, latency 0 and a
pair cost c >= max(F, B) (co-executing two strands is never faster than the slower one alone).

Slot model (:mod:`ds_dhelix.pipe.schedule`): rank r's phase-0 slot k sits at slot time r+2k
and holds F0(k)⊗B1(k-p), its phase-1 slot k sits at 2p-1-r+2k and holds F1(k)⊗B0(k-p),
k = 0..m+p-1. A slot with k < p is forward-only (weight F), p <= k < m a pair (c), k >= m
backward-only (B). Every rank thus does the same work  W = 2pF + 2(m-p)c + 2pB.

Write (r, s) for rank r's slot at slot time s. Every data dependency runs from slot time s to
s+1: F0/B1 of slot k on rank r-1 feed rank r's phase-0 slot k; F1/B0 on rank r+1 feed rank r's
phase-1 slot k; the turns (F0 -> F1 on rank p-1, F1 -> B1 on rank 0, B1 -> B0 on rank p-1) are the
next slot on the same rank. With a fixed order per rank and instructions started as soon as
possible, the makespan T is the heaviest path through this DAG, and a path takes at most one slot
per slot time s = 0 .. 2m+4p-3:

* s < 2p: only forward-only slots exist (a phase-0 pair needs s >= r+2p, a phase-1 pair
  s >= 4p-1-r >= 3p), so these 2p slot times add at most 2pF. The forward chain of micro-batch 0,
  (0,0) -> (1,1) -> .. -> (p-1,p-1) -> (p-1,p) -> .. -> (0,2p-1), attains it.
* s >= 2m+2p-2: only backward-only slots (mirror image), at most 2pB; the backward chain of
  micro-batch m-1 attains it.
* 2p <= s <= 2m+2p-3 (2m-2 slot times): at most c each, since c >= max(F, B). For m >= p+1 an
  all-pair path exists: up the phase-0 pairs (r, 2p+r) of k = p to rank p-1, along rank p-1
  (all pairs from 3p-1 to 2m+p-2), and down the phase-1 pairs (r, 2m+2p-3-r) to rank 0.

So  T = 2pF + 2(m-1)c + 2pB  and, all ranks doing W,

    bubble = (T - W) / T = (p-1)c / (p(F+B) + (m-1)c).

Examples: F = B = c = 1 gives (p-1)/(m+2p-1); c = F+B (no overlap) gives (p-1)/(m+p-1), the 1F1B
bubble; p = 4, m = 8, F = 1, B = 2, c = 2 gives 6/26 = 0.231. The p/(m-1) attributed to the paper
(0.571 for p = 4, m = 8) ignores the costs and overstates the bubble for every c: ours grows with c
but stays below its limit (p-1)/(m-1).

Plain data: no torch, no deepspeed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from ..pipe.folding import chunk_index, next_chunk_owner, prev_chunk_owner
from .instructions import (
    ACTIVATION,
    GRAD,
    WHOLE,
    Backward,
    BackwardBackward,
    FixActivationBudget,
    Forward,
    ForwardBackward,
    ForwardForward,
    Instruction,
    LoadMicroBatch,
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


@dataclass(frozen=True)
class Topology:
    """Where a schedule's chunks live: the fold over ``num_ranks`` ranks (2p chunks, two phases per
    rank), or one stage (one rank, one chunk: the whole model, phase ``WHOLE``)."""

    num_ranks: int
    folded: bool = True

    @property
    def num_chunks(self) -> int:
        return 2 * self.num_ranks if self.folded else 1

    @property
    def phases(self) -> tuple[int, ...]:
        return (0, 1) if self.folded else (WHOLE,)

    def chunk(self, rank: int, phase: int) -> int:
        return chunk_index(rank, phase, self.num_ranks) if self.folded else 0

    def next_owner(self, rank: int, phase: int) -> tuple[int, int] | None:
        """Where the forward output of (rank, phase) goes; None after the last chunk (the loss)."""
        return next_chunk_owner(rank, phase, self.num_ranks) if self.folded else None

    def prev_owner(self, rank: int, phase: int) -> tuple[int, int] | None:
        """Where the forward input of (rank, phase) comes from; None for the first chunk (loaded)."""
        return prev_chunk_owner(rank, phase, self.num_ranks) if self.folded else None


@dataclass(frozen=True)
class ReplayError:
    """One problem found by :func:`replay`. ``kind``: deadlock, unmatched, order, peer, buffer,
    work."""

    kind: str
    message: str
    rank: int | None = None
    index: int | None = None  # position in the rank's instruction list

    def __str__(self) -> str:
        where = f"rank {self.rank} #{self.index}: " if self.rank is not None else ""
        return f"[{self.kind}] {where}{self.message}"


@dataclass(frozen=True)
class Event:
    """A compute instruction on the timeline."""

    start: float
    end: float
    instruction: Instruction


@dataclass
class Replay:
    """Result of :func:`replay`: per-rank compute timelines and the problems found."""

    num_stages: int
    num_microbatches: int
    events: list[list[Event]]
    errors: list[ReplayError]
    peak_activations: list[int]  # most (mb, phase) activations held at once, per rank

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def makespan(self) -> float:
        return max((ev.end for evs in self.events for ev in evs), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(ev.end - ev.start for ev in self.events[rank])

    @property
    def bubble_fraction(self) -> float:
        """Idle time of all ranks over ``p * makespan``."""
        total = self.num_stages * self.makespan
        return 1.0 - sum(self.busy(r) for r in range(self.num_stages)) / total if total else 0.0

    def render_timeline(self) -> str:
        return render_timeline(self.events)


def resolve_pair_cost(fwd_cost: float, bwd_cost: float, pair_cost="max") -> float:
    """``"max"``/None -> max(F, B) (perfect overlap), ``"sum"`` -> F + B, or a number >= 0."""
    if pair_cost is None or pair_cost == "max":
        return max(fwd_cost, bwd_cost)
    if pair_cost == "sum":
        return fwd_cost + bwd_cost
    if isinstance(pair_cost, (int, float)) and not isinstance(pair_cost, bool) and pair_cost >= 0:
        return pair_cost
    raise ValueError(f"pair_cost={pair_cost!r}: use 'max', 'sum' or a number >= 0")


class _Fail(Exception):
    def __init__(self, error: ReplayError):
        super().__init__(str(error))
        self.error = error


@dataclass
class _Channel:
    """Posted sends and receives on one directed channel, matched by position."""

    sends: list = field(default_factory=list)  # (key, post time)
    recvs: list = field(default_factory=list)  # (key, post time)


@dataclass
class _Rank:
    pc: int = 0
    clock: float = 0.0
    posted: dict = field(default_factory=dict)  # key -> (src, position on channel)
    waited: set = field(default_factory=set)
    ready: set = field(default_factory=set)  # (kind, mb, phase) inputs usable now
    saved: set = field(default_factory=set)  # (mb, phase) activations kept for backward
    unsent: set = field(default_factory=set)  # (kind, mb, phase) results to send
    sent: set = field(default_factory=set)
    peak: int = 0
    reduced: int = 0
    stepped: int = 0


class _Replayer:
    def __init__(self, schedule: Schedule, num_microbatches: int, costs: dict, latency: float, topo: Topology):
        self.schedule, self.p, self.m, self.topo = schedule, len(schedule), num_microbatches, topo
        self.costs, self.latency = costs, latency
        self.ranks = [_Rank() for _ in range(self.p)]
        self.events: list[list[Event]] = [[] for _ in range(self.p)]
        self.channels: dict[tuple[int, int], _Channel] = {}
        self.forwarded: dict[tuple[int, int], int] = {}
        self.backwarded: dict[tuple[int, int], int] = {}

    # -- helpers -----------------------------------------------------------------------------
    def fail(self, kind: str, rank: int, msg: str):
        raise _Fail(ReplayError(kind, msg, rank, self.ranks[rank].pc))

    def channel(self, src: int, dst: int) -> _Channel:
        return self.channels.setdefault((src, dst), _Channel())

    def check_match(self, src: int, dst: int, pos: int) -> None:
        ch = self.channel(src, dst)
        if pos < len(ch.sends) and pos < len(ch.recvs) and ch.sends[pos][0] != ch.recvs[pos][0]:
            raise _Fail(
                ReplayError(
                    "order",
                    f"channel {src}->{dst} op #{pos}: rank {src} sends "
                    f"{_key(ch.sends[pos][0])} but rank {dst} receives {_key(ch.recvs[pos][0])} "
                    f"(p2p ops match in posting order)",
                )
            )

    def arrival(self, src: int, dst: int, pos: int) -> float | None:
        """When op ``pos`` of channel src->dst completes, or None while its send is not posted."""
        ch = self.channel(src, dst)
        if pos >= len(ch.sends) or pos >= len(ch.recvs):
            return None
        return max(ch.sends[pos][1], ch.recvs[pos][1]) + self.latency

    # -- one instruction; returns False when it must block ------------------------------------
    def step(self, r: int) -> bool:
        st, ins = self.ranks[r], self.schedule[r][self.ranks[r].pc]
        if isinstance(ins, (RecvActivation, RecvGrad)):
            self.post_recv(r, ins)
        elif isinstance(ins, (SendActivation, SendGrad)):
            self.post_send(r, ins)
        elif isinstance(ins, WaitRecv):
            return self.wait_recv(r, ins)
        elif isinstance(ins, WaitSends):
            return self.wait_sends(r)
        elif isinstance(ins, LoadMicroBatch):
            key = (ACTIVATION, ins.mb, 0)
            if r != 0 or key in st.ready or (ins.mb, self.topo.chunk(0, self.topo.phases[0])) in self.forwarded:
                self.fail("buffer", r, f"LoadMicroBatch({ins.mb}) on rank {r}: only rank 0 loads, once per micro-batch")
            st.ready.add(key)
        elif compute_parts(ins):
            self.compute(r, ins)
        elif isinstance(ins, FixActivationBudget):
            pass  # a memory rule for the executor: nothing to replay
        elif isinstance(ins, ReduceGrads):
            self.check_done(r, "ReduceGrads")
            st.reduced += 1
        elif isinstance(ins, OptimizerStep):
            if st.reduced != 1 or st.stepped:
                self.fail("work", r, "OptimizerStep must run once, after ReduceGrads")
            st.stepped += 1
        else:
            self.fail("buffer", r, f"unknown instruction {ins!r}")
        st.pc += 1
        return True

    def post_recv(self, r: int, ins) -> None:
        st = self.ranks[r]
        kind = ACTIVATION if isinstance(ins, RecvActivation) else GRAD
        key = (kind, ins.mb, ins.phase)
        src = (self.topo.prev_owner if kind == ACTIVATION else self.topo.next_owner)(r, ins.phase)
        if not src or src[0] == r or ins.peer != src[0]:
            want = f"rank {src[0]}" if src and src[0] != r else "no rank (made locally or loaded)"
            self.fail("peer", r, f"{ins} receives from rank {ins.peer}; the fold sends it from {want}")
        if key in st.posted or key in st.ready:
            self.fail("buffer", r, f"{ins}: {_key(key)} received twice")
        ch = self.channel(ins.peer, r)
        st.posted[key] = (ins.peer, len(ch.recvs))
        ch.recvs.append((key, st.clock))
        self.check_match(ins.peer, r, len(ch.recvs) - 1)

    def post_send(self, r: int, ins) -> None:
        st = self.ranks[r]
        kind = ACTIVATION if isinstance(ins, SendActivation) else GRAD
        key = (kind, ins.mb, ins.phase)
        dst = (self.topo.next_owner if kind == ACTIVATION else self.topo.prev_owner)(r, ins.phase)
        if not dst or dst[0] == r or ins.peer != dst[0]:
            want = f"rank {dst[0]}" if dst and dst[0] != r else "no rank (used locally)"
            self.fail("peer", r, f"{ins} sends to rank {ins.peer}; the fold sends it to {want}")
        if key not in st.unsent:
            why = "sent twice" if key in st.sent else "sent before it was computed"
            self.fail("buffer", r, f"{ins}: {_key(key)} {why}")
        st.unsent.discard(key)
        st.sent.add(key)
        ch = self.channel(r, ins.peer)
        ch.sends.append((key, st.clock))
        self.check_match(r, ins.peer, len(ch.sends) - 1)

    def wait_recv(self, r: int, ins: WaitRecv) -> bool:
        st = self.ranks[r]
        key = (ins.kind, ins.mb, ins.phase)
        if key not in st.posted:
            self.fail("buffer", r, f"{ins}: waits on a receive that was never posted")
        if key in st.waited:
            self.fail("buffer", r, f"{ins}: waited twice")
        src, pos = st.posted[key]
        done = self.arrival(src, r, pos)
        if done is None:
            return False
        st.clock = max(st.clock, done)
        st.waited.add(key)
        st.ready.add(key)
        st.pc += 1
        return True

    def wait_sends(self, r: int) -> bool:
        st, done = self.ranks[r], self.ranks[r].clock
        for (src, dst), ch in self.channels.items():
            if src != r:
                continue
            for pos in range(len(ch.sends)):
                t = self.arrival(src, dst, pos)
                if t is None:
                    return False
                done = max(done, t)
        st.clock = done
        st.pc += 1
        return True

    def compute(self, r: int, ins: Instruction) -> None:
        st = self.ranks[r]
        parts = compute_parts(ins)
        if len(parts) == 2 and (parts[0].mb, parts[0].phase) == (parts[1].mb, parts[1].phase):
            what = (
                "a chunk's forward with its own backward"
                if isinstance(ins, ForwardBackward)
                else f"micro-batch {parts[0].mb} with itself"
            )
            self.fail("work", r, f"{ins} pairs {what}")
        for part in parts:
            (self.check_forward if isinstance(part, Forward) else self.check_backward)(r, part)
        for part in parts:
            (self.do_forward if isinstance(part, Forward) else self.do_backward)(r, part)
        cost = self.costs[type(ins)]
        self.events[r].append(Event(st.clock, st.clock + cost, ins))
        st.clock += cost
        st.peak = max(st.peak, len(st.saved))

    def check_forward(self, r: int, f: Forward) -> None:
        chunk = (f.mb, self.topo.chunk(r, f.phase))
        if not 0 <= f.mb < self.m:
            self.fail("work", r, f"{f}: micro-batch outside 0..{self.m - 1}")
        if self.forwarded.get(chunk):
            self.fail("work", r, f"{f}: chunk {chunk[1]} of micro-batch {f.mb} forwarded twice")
        if (ACTIVATION, f.mb, f.phase) not in self.ranks[r].ready:
            self.fail("buffer", r, f"{f}: input activation used before it was received/loaded")

    def check_backward(self, r: int, b: Backward) -> None:
        st, chunk = self.ranks[r], (b.mb, self.topo.chunk(r, b.phase))
        if (b.mb, b.phase) not in st.saved:
            why = (
                "frees its activations twice (backward twice)"
                if self.backwarded.get(chunk)
                else "runs before the chunk's forward"
            )
            self.fail("work", r, f"{b}: {why}")
        if (GRAD, b.mb, b.phase) not in st.ready:
            self.fail("buffer", r, f"{b}: output gradient used before it was received/computed")

    def do_forward(self, r: int, f: Forward) -> None:
        st = self.ranks[r]
        self.forwarded[(f.mb, self.topo.chunk(r, f.phase))] = 1
        st.ready.discard((ACTIVATION, f.mb, f.phase))
        st.saved.add((f.mb, f.phase))
        dst = self.topo.next_owner(r, f.phase)
        if dst is None:
            st.ready.add((GRAD, f.mb, f.phase))  # the loss: its gradient starts backward here
        elif dst[0] == r:
            st.ready.add((ACTIVATION, f.mb, dst[1]))  # the turn on rank p-1
        else:
            st.unsent.add((ACTIVATION, f.mb, f.phase))

    def do_backward(self, r: int, b: Backward) -> None:
        st = self.ranks[r]
        self.backwarded[(b.mb, self.topo.chunk(r, b.phase))] = 1
        st.saved.discard((b.mb, b.phase))
        st.ready.discard((GRAD, b.mb, b.phase))
        dst = self.topo.prev_owner(r, b.phase)
        if dst is not None and dst[0] == r:
            st.ready.add((GRAD, b.mb, dst[1]))
        elif dst is not None:
            st.unsent.add((GRAD, b.mb, b.phase))

    def check_done(self, r: int, what: str) -> None:
        st = self.ranks[r]
        missing = [
            Backward(mb, ph).label()
            for ph in self.topo.phases
            for mb in range(self.m)
            if not self.backwarded.get((mb, self.topo.chunk(r, ph)))
        ]
        if missing:
            self.fail("work", r, f"{what} before backward {', '.join(missing[:4])} ran")
        if st.unsent:
            self.fail(
                "unmatched", r, f"{what} with results never sent: {', '.join(_key(k) for k in sorted(st.unsent))}"
            )
        if st.reduced:
            self.fail("work", r, f"{what} runs twice")

    # -- driver ---------------------------------------------------------------------------------
    def run(self) -> list[ReplayError]:
        try:
            self.advance()
        except _Fail as fail:
            return [fail.error]
        stuck = [r for r in range(self.p) if self.ranks[r].pc < len(self.schedule[r])]
        if stuck:
            return [ReplayError("deadlock", "; ".join(self.describe_stuck(r) for r in stuck))]
        return self.final_checks()

    def advance(self) -> None:
        moved = True
        while moved:
            moved = False
            for r in range(self.p):
                while self.ranks[r].pc < len(self.schedule[r]) and self.step(r):
                    moved = True

    def describe_stuck(self, r: int) -> str:
        pc = self.ranks[r].pc
        ins = self.schedule[r][pc]
        if isinstance(ins, WaitRecv):
            src = self.ranks[r].posted[(ins.kind, ins.mb, ins.phase)][0]
            why = f"waits for rank {src} to send {_key((ins.kind, ins.mb, ins.phase))}"
        else:
            why = "waits for its sends to be received"
        return f"rank {r} stuck at #{pc} {ins} ({why})"

    def final_checks(self) -> list[ReplayError]:
        errors = []
        for (src, dst), ch in sorted(self.channels.items()):
            for extra, side in ((ch.sends[len(ch.recvs) :], "send"), (ch.recvs[len(ch.sends) :], "recv")):
                for key, _ in extra:
                    errors.append(
                        ReplayError(
                            "unmatched",
                            f"channel {src}->{dst}: {side} of "
                            f"{_key(key)} has no matching "
                            f"{'recv' if side == 'send' else 'send'}",
                        )
                    )
        for r, st in enumerate(self.ranks):
            for key in sorted(set(st.posted) - st.waited):
                errors.append(ReplayError("buffer", f"receive of {_key(key)} never waited on", r))
            if st.unsent:
                errors.append(ReplayError("buffer", f"results never sent: {sorted(st.unsent)}", r))
            if st.reduced != 1 or st.stepped != 1:
                errors.append(
                    ReplayError(
                        "work", f"ReduceGrads ran {st.reduced}x, OptimizerStep {st.stepped}x (need once each)", r
                    )
                )
        for chunk in range(self.topo.num_chunks):
            for mb in range(self.m):
                for done, what in ((self.forwarded, "forward"), (self.backwarded, "backward")):
                    if not done.get((mb, chunk)):
                        errors.append(ReplayError("work", f"{what} of micro-batch {mb}, chunk {chunk} never ran"))
        return errors


def _key(key) -> str:
    kind, mb, phase = key
    return f"{kind} (mb {mb}, phase {phase})"


def replay(
    schedule: Schedule,
    num_microbatches: int,
    fwd_cost: float = 1.0,
    bwd_cost: float = 2.0,
    pair_cost="max",
    latency: float = 0.0,
    one_stage: bool = False,
) -> Replay:
    """Replay all ranks of ``schedule`` (a list per rank) for ``num_microbatches`` micro-batches
    (``one_stage``: a one-stage schedule's single list, whose micro-batches are the ones its list
    names: 2m halves under intra).

    Returns a :class:`Replay` with the timeline, bubble fraction and errors (empty when the
    schedule is correct). Stops at the first structural error; a deadlock lists every stuck rank.
    Two strands of one direction (``ForwardForward``, ``BackwardBackward``) cost max(F, F) and
    max(B, B) (``pair_cost`` "sum": twice; a number prices the forward/backward pair only).
    """
    if fwd_cost <= 0 or bwd_cost <= 0 or latency < 0:
        raise ValueError(f"fwd_cost={fwd_cost}, bwd_cost={bwd_cost} must be > 0 and latency={latency} >= 0")
    same = pair_cost if pair_cost in ("max", "sum", None) else "max"
    costs = {
        Forward: fwd_cost,
        Backward: bwd_cost,
        ForwardBackward: resolve_pair_cost(fwd_cost, bwd_cost, pair_cost),
        ForwardForward: resolve_pair_cost(fwd_cost, fwd_cost, same),
        BackwardBackward: resolve_pair_cost(bwd_cost, bwd_cost, same),
    }
    if one_stage and len(schedule) != 1:
        raise ValueError(f"a one-stage schedule has one rank's list, got {len(schedule)}")
    sim = _Replayer(schedule, num_microbatches, costs, latency, Topology(len(schedule), folded=not one_stage))
    errors = sim.run()
    return Replay(len(schedule), num_microbatches, sim.events, errors, [st.peak for st in sim.ranks])


# ---- closed forms ------------------------------------------------------------------------------


def w_bubble_closed_form(p: int, m: int, F: float = 1.0, B: float = 2.0, pair_cost="max") -> float:
    """Bubble fraction of :func:`~ds_dhelix.pipe.schedule.w_schedule` (derivation: module
    docstring): (p-1)c / (p(F+B) + (m-1)c) with c the pair cost; needs m >= p+1, c >= max(F, B)."""
    c = resolve_pair_cost(F, B, pair_cost)
    if m < p + 1 or c < max(F, B):
        raise ValueError(
            f"w_bubble_closed_form(p={p}, m={m}, F={F}, B={B}, c={c}) holds for "
            f"m >= p+1 = {p + 1} and pair cost c >= max(F, B) = {max(F, B)}"
        )
    return (p - 1) * c / (p * (F + B) + (m - 1) * c)


def sequential_bubble_closed_form(p: int, m: int, F: float = 1.0, B: float = 2.0) -> float:
    """Sequential fold: one micro-batch at a time, so each rank works 2(F+B) of every 2p(F+B)."""
    return 1.0 - 1.0 / p


# ---- text timeline -----------------------------------------------------------------------------


def _unit(events: list[list[Event]]) -> float:
    """Largest time step putting every start and end on a cell boundary (times to 1/1000)."""
    times = {Fraction(t).limit_denominator(1000) for evs in events for ev in evs for t in (ev.start, ev.end)} - {0}
    if not times:
        return 1.0
    den = math.lcm(*(t.denominator for t in times))
    return math.gcd(*(int(t * den) for t in times)) / den


def render_timeline(events: list[list[Event]], unit: float | None = None) -> str:
    """One row per rank, one cell per ``unit`` of time (default: see :func:`_unit`); an
    instruction spanning several cells is ``label---``; ``.`` is idle."""
    unit = unit or _unit(events)
    width = max([len(ev.instruction.label()) for evs in events for ev in evs] + [2]) + 1
    end = max((ev.end for evs in events for ev in evs), default=0.0)
    num_cells = int(math.ceil(end / unit - 1e-9))
    header = "time    " + "".join(f"{k * unit:<{width}g}" for k in range(num_cells))
    rows = [header.rstrip()]
    for r, evs in enumerate(events):
        cells = [".".ljust(width)] * num_cells
        for ev in evs:
            first = int(round(ev.start / unit))
            n = max(1, int(round((ev.end - ev.start) / unit)))
            text = (
                ev.instruction.label().ljust(n * width - 1, "-") + " " if n > 1 else ev.instruction.label().ljust(width)
            )
            for k in range(n):
                cells[first + k] = text[k * width : (k + 1) * width]
        rows.append((f"rank {r:<3}" + "".join(cells)).rstrip())
    legend = (
        "Fk/Bk: forward/backward of micro-batch k, phase 0 (outbound); Fk'/Bk': phase 1 "
        "(return); FxBy: one co-executed SI pair; '.': idle"
    )
    return "\n".join(rows + [legend])
