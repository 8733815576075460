"""Two strands' op chains run on one compute unit and the links of their collectives, decision by
decision by the executor's own round policy (``ds_dhelix.schedule.policy``): the makespan of one
round (an SI pair, two backwards, two forwards).

A strand is a chain of ``ChainOp``: compute of ``ms`` (plus ``deferred_ms`` of weight-gradient work
it leaves for later) or a collective of ``ms`` wire time on ``group`` over ``link``. This module is
the policy's host on a virtual clock: a collective has completed when its wire time has passed,
every collective may be polled, no activation budget binds. Collectives in flight on the same
``link`` share it evenly; on different links they run side by side. While any collective flies,
compute runs ``slowdown`` slower (compute and communication kernels share the device; on a CPU,
gloo's threads share the cores). A round ends with its deferred weight gradients run, as the
executor drains them after a pair.

    retime_pair   the executor's order (``Round.decide``)
    search_pair   the best order a beam search over the same choices (``Round.choices``) finds
    bound         max(sum of compute, sum of wire time): perfect overlap

Plain data: no torch, no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule import policy as P
from ..schedule.policy import RoundRules

__all__ = ["ChainOp", "PairRetime", "RoundRules", "retime_pair", "search_pair", "reactive_rules"]


@dataclass(frozen=True)
class ChainOp:
    """One entry of a strand's chain: ``comm`` (a collective of ``ms`` wire time) or compute of
    ``ms``, plus ``deferred_ms`` of weight-gradient work it leaves for later; ``depth``: the block
    depth of the pair it belongs to (forward block j and backward block L+1-j share depth j);
    ``group``: the process group of a collective, ``link``: the link it travels on."""

    name: str
    comm: bool
    ms: float
    deferred_ms: float = 0.0
    depth: int = 0
    group: str = ""
    link: str = ""


@dataclass(frozen=True)
class PairRetime:
    makespan_ms: float
    compute_ms: float  # sum of compute (incl. deferred weight gradients), without the slowdown
    wire_ms: float  # sum of the collectives' wire time
    wait_ms: float = 0.0  # time the compute unit waited on collectives (exposed communication)
    order: tuple[str, ...] = ()  # what ran and launched, in order: op names, "wgrad:<op>" for deferred work

    @property
    def bound_ms(self) -> float:
        return max(self.compute_ms, self.wire_ms)


def reactive_rules(max_deferred: int = 2, **kw) -> RoundRules:
    """An SI pair's rules as the executor runs it on separate strand groups: gated, reacting to
    completions, nearest collective first."""
    return RoundRules(**{"gated": True, "reacts": True, "nearest": True, "max_deferred": max_deferred, **kw})


class _Flight:
    """A collective in flight: wire ms left and its link."""

    __slots__ = ("left", "link")

    def __init__(self, op: ChainOp):
        self.left, self.link = op.ms, op.link


def _copy_flight(f: _Flight) -> _Flight:
    c = object.__new__(_Flight)
    c.left, c.link = f.left, f.link
    return c


class _Pair:
    """One round on the virtual clock: the policy's ``Round`` and what the host knows (time, wire
    left per collective, the deferred weight gradients)."""

    def __init__(self, strand0, strand1, rules: RoundRules, slowdown: float):
        self.round = P.Round(list(strand0), list(strand1), rules, comm=lambda o: o.comm, depth=lambda o: o.depth)
        self.slowdown = slowdown
        self.t, self.waited = 0.0, 0.0
        self.queue: list[tuple[float, int, str]] = []  # deferred (ms, depth, op name), oldest first
        self.order: list[str] = []

    def copy(self) -> _Pair:
        c = object.__new__(_Pair)
        c.round, c.slowdown, c.t, c.waited = self.round.copy(_copy_flight), self.slowdown, self.t, self.waited
        c.queue, c.order = list(self.queue), list(self.order)
        return c

    def key(self) -> tuple:
        """What the search tells states apart by: positions, deferred count, collectives in flight."""
        r = self.round
        return (*r.pos, len(self.queue), *((s, round(r.flight[s][1].left, 3)) for s in r.order))

    # ---- the policy's host
    def completed(self, flight: _Flight) -> bool:
        return flight.left <= 1e-12

    def pollable(self, item) -> bool:
        return True

    def deferred(self) -> tuple[int, float]:
        return len(self.queue), (self.queue[0][1] if self.queue else float("inf"))

    def may_save(self, item) -> bool:
        return True

    # ---- carrying out a decision
    @property
    def done(self) -> bool:
        return self.round.done and not self.queue

    def options(self) -> list[P.Decision]:
        """Forced moves applied; then every legal choice (the deferred work once the lists are
        run; none when the round is done)."""
        while not self.round.done:
            forced = self.round.forced(self)
            if forced is None:
                return self.round.choices(self)
            self.apply(forced)
        return [P.Decision(P.FILL)] if self.queue else []

    def decide(self) -> P.Decision:
        return self.round.decide(self) if not self.round.done else P.Decision(P.FILL)

    def apply(self, d: P.Decision) -> None:
        r = self.round
        if d.kind == P.COMPUTE:
            op = r.take(d.strand)
            self.order.append(op.name)
            if op.deferred_ms > 0:
                self.queue.append((op.deferred_ms, op.depth, op.name))
            self._run(op.ms)
        elif d.kind == P.LAUNCH:
            op = r.take(d.strand)
            self.order.append(op.name)
            r.launched(d.strand, op, _Flight(op))
        elif d.kind == P.FINISH:
            r.finished(d.strand)
        elif d.kind in (P.DRAIN, P.FILL):
            ms, _, name = self.queue.pop(0)
            self.order.append(f"wgrad:{name}")
            self._run(ms)
        elif d.kind == P.WAIT:
            self._wait((d.strand,))
        elif d.kind == P.WAIT_FIRST:
            self._wait(d.strands)

    def _flights(self) -> list[_Flight]:
        return [f[1] for f in self.round.flight if f is not None and f[1].left > 1e-12]

    def _run(self, work: float) -> None:
        """Advance through ``work`` ms of compute, slowed while collectives fly."""
        while work > 1e-12:
            rate = 1.0 / (1.0 + self.slowdown) if self._flights() else 1.0
            dt = work / rate
            nxt = self._next_completion()
            if nxt is not None and nxt < dt:
                dt = nxt
            self._advance(dt)
            work -= dt * rate

    def _wait(self, strands: tuple[int, ...]) -> None:
        """Until one of ``strands``' collectives is done; it is finished (its strand goes on)."""
        t0, r = self.t, self.round
        while not any(self.completed(r.flight[s][1]) for s in strands):
            self._advance(self._next_completion())
        r.finished(next(s for s in strands if self.completed(r.flight[s][1])))
        self.waited += self.t - t0

    def _next_completion(self) -> float | None:
        active = self._flights()
        if not active:
            return None
        return min(f.left * sum(g.link == f.link for g in active) for f in active)

    def _advance(self, dt: float) -> None:
        active = self._flights()
        for f in active:
            f.left -= dt / sum(g.link == f.link for g in active)
        self.t += dt

    def result(self) -> PairRetime:
        chains = list(self.round.items[0]) + list(self.round.items[1])
        return PairRetime(
            self.t,
            sum(st.ms + st.deferred_ms for st in chains if not st.comm),
            sum(st.ms for st in chains if st.comm),
            self.waited,
            tuple(self.order),
        )


def _pair(backward, forward, max_deferred: int, rules: RoundRules | None, slowdown: float) -> _Pair:
    if slowdown < 0:
        raise ValueError(f"slowdown {slowdown} must be >= 0 (compute's extra time while a collective flies)")
    return _Pair(backward, forward, rules if rules is not None else reactive_rules(max_deferred), slowdown)


def retime_pair(
    backward: list[ChainOp],
    forward: list[ChainOp],
    max_deferred: int = 2,
    rules: RoundRules | None = None,
    slowdown: float = 0.0,
) -> PairRetime:
    """Run two strands' chains (strand 0: ``backward``, wins ties) by the round policy (``rules``,
    default: reactive SI with at most ``max_deferred`` weight gradients waiting), compute
    ``slowdown`` slower while a collective flies. Pure function of its inputs."""
    pair = _pair(backward, forward, max_deferred, rules, slowdown)
    while not pair.done:
        pair.apply(pair.decide())
    return pair.result()


def search_pair(
    backward: list[ChainOp],
    forward: list[ChainOp],
    max_deferred: int = 2,
    width: int = 1000,
    rules: RoundRules | None = None,
    slowdown: float = 0.0,
) -> PairRetime:
    """The shortest makespan a beam search over the compute unit's choices finds for the same
    chains, machine and constraints as ``retime_pair`` (any work-conserving order, not just the
    policy's pick): how much a better order could gain. Keeps the ``width`` earliest states per
    number of decisions; the rule's own order stays a candidate, so the result is never worse
    than ``retime_pair``'s."""
    frontier, best = [_pair(backward, forward, max_deferred, rules, slowdown)], None
    while frontier:
        states: dict = {}
        for pair in frontier:
            choices = pair.options()
            if not choices:
                best = pair if best is None or pair.t < best.t else best
                continue
            for choice in choices:
                nxt = pair.copy()
                nxt.apply(choice)
                k = nxt.key()
                if k not in states or states[k].t > nxt.t:
                    states[k] = nxt
        frontier = sorted(states.values(), key=lambda p: p.t)[:width]
    rule = retime_pair(backward, forward, max_deferred, rules, slowdown)
    return rule if rule.makespan_ms <= best.t else best.result()
