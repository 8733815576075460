"""Two strands' op chains run the way the executor orders them, on one compute unit and the
links of their collectives: the makespan of one round (an SI pair, two backwards, two forwards).

A strand is a chain of ``ChainOp``: compute of ``ms`` (plus ``deferred_ms`` of weight-gradient work
it leaves for later) or a collective of ``ms`` wire time on ``group`` over ``link``. The chains run
under the rules of ``runtime.executor._Round`` (keep the two in step):

    launch     a collective starts the moment its strand reaches it (strand 0 first)
    compute    one compute op: of the strand with the fewest compute ops before its next
               collective (``order="reactive"``, ties: strand 0) or strand 0 first
               (``order="strand0"``: plan rounds, and the executor without reactive pairs)
    fill       else a deferred weight gradient (first, when more than ``max_deferred`` wait)
    wait       else wait for a collective in flight: the oldest, or whichever completes first
               when the two in flight are on different groups and the executor reacts
    who may go a strand with no collective in flight (``reacts``: one that completed lets its
               strand go at once; not reacting, only once it is waited for, as on CUDA, where the
               host does not see completions), ``gated``: the forward strand (1) not past the
               backward strand's block depth, nor while a weight gradient of a shallower depth
               waits; ``trail``: strand 1 runs position i only after strand 0 ran its own

Collectives in flight on the same ``link`` share it evenly; on different links they run side by
side. While any collective flies, compute runs ``slowdown`` slower (compute and communication
kernels share the device; on a CPU, gloo's threads share the cores).

    retime_pair   the executor's order rule
    search_pair   the best order a beam search finds for the same chains and constraints
    bound         max(sum of compute, sum of wire time): perfect overlap

Plain data: no torch, no torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass

ORDERS = ("reactive", "strand0")


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

    @property
    def bound_ms(self) -> float:
        return max(self.compute_ms, self.wire_ms)


@dataclass(frozen=True)
class RoundRules:
    """How a round runs: see the module docstring."""

    max_deferred: int = 2
    gated: bool = True
    trail: bool = False
    reacts: bool = True
    order: str = "reactive"
    slowdown: float = 0.0

    def __post_init__(self):
        if self.order not in ORDERS or self.slowdown < 0 or self.max_deferred < 0:
            raise ValueError(f"round rules: order {self.order!r} (one of {ORDERS}), slowdown {self.slowdown} "
                             f"(>= 0), max_deferred {self.max_deferred} (>= 0)")


class _Flight:
    """A collective in flight: its strand, wire ms left, depth, group and link."""

    __slots__ = ("strand", "left", "depth", "group", "link")

    def __init__(self, strand: int, op: ChainOp):
        self.strand, self.left, self.depth, self.group, self.link = strand, op.ms, op.depth, op.group, op.link

    def copy(self) -> "_Flight":
        c = object.__new__(_Flight)
        c.strand, c.left, c.depth, c.group, c.link = self.strand, self.left, self.depth, self.group, self.link
        return c


class _Pair:
    """Two strands' chains advanced decision by decision. A decision is what the compute unit does
    next: ``("op", s)`` the next compute op of strand s (0: backward), ``("wgrad",)`` the oldest
    deferred weight gradient, ``("wait",)`` nothing until a collective is done."""

    def __init__(self, strand0, strand1, rules: RoundRules):
        self.chains, self.rules = (list(strand0), list(strand1)), rules
        self.t, self.waited, self.pos = 0.0, 0.0, [0, 0]
        self.flights: list[_Flight] = []  # in launch order; ``left`` 0: done, not yet waited for
        self.deferred: list[tuple[float, int]] = []  # (ms, depth), oldest first

    def copy(self) -> "_Pair":
        c = object.__new__(_Pair)
        c.chains, c.rules, c.t, c.waited, c.pos = self.chains, self.rules, self.t, self.waited, list(self.pos)
        c.flights, c.deferred = [f.copy() for f in self.flights], list(self.deferred)
        return c

    def key(self) -> tuple:
        """What the search tells states apart by: queue positions, how many weight gradients wait
        (their contents follow from the positions) and the collectives in flight."""
        return (*self.pos, len(self.deferred), *((f.strand, round(f.left, 3)) for f in self.flights))

    @property
    def done(self) -> bool:
        return not (self._left(0) or self._left(1) or self.flights or self.deferred)

    def _left(self, s: int) -> bool:
        return self.pos[s] < len(self.chains[s])

    def _head(self, s: int) -> ChainOp:
        return self.chains[s][self.pos[s]]

    def _flying(self, s: int) -> _Flight | None:
        return next((f for f in self.flights if f.strand == s), None)

    def may_go(self, s: int) -> bool:
        if self._flying(s) is not None or not self._left(s):
            return False
        if self.rules.trail and s == 1 and self._left(0):
            return self.pos[1] < self.pos[0]
        if s == 0 or not self.rules.gated:
            return True
        f_depth = self._head(1).depth
        if self.deferred and self.deferred[0][1] < f_depth:
            return False
        b = self._flying(0)
        if not (self._left(0) or b is not None):
            return True
        return f_depth <= (b.depth if b is not None else self._head(0).depth)

    def launch(self) -> None:
        for s in (0, 1):
            while self.may_go(s) and self._head(s).comm:
                self.flights.append(_Flight(s, self._head(s)))
                self.pos[s] += 1

    def options(self) -> list[tuple]:
        self.launch()
        if len(self.deferred) > self.rules.max_deferred:
            return [("wgrad",)]
        out = [("op", s) for s in (0, 1) if self.may_go(s) and not self._head(s).comm]
        if self.deferred:
            out.append(("wgrad",))
        if not (out or self.flights):
            raise ValueError(f"pair re-timing stuck at {self.pos}: no strand may go and nothing in flight")
        return out or [("wait",)]

    def until_comm(self, s: int) -> int:
        chain = self.chains[s]
        return next((i - self.pos[s] for i in range(self.pos[s], len(chain)) if chain[i].comm),
                    len(chain) - self.pos[s])

    def apply(self, choice: tuple) -> None:
        if choice[0] == "op":
            op = self._head(choice[1])
            self.pos[choice[1]] += 1
            if op.deferred_ms > 0:
                self.deferred.append((op.deferred_ms, op.depth))
            self._run(op.ms)
        elif choice[0] == "wgrad":
            self._run(self.deferred.pop(0)[0])
        else:
            self._wait()

    def _run(self, work: float) -> None:
        """Advance through ``work`` ms of compute, slowed while collectives fly."""
        while work > 1e-12:
            rate = 1.0 / (1.0 + self.rules.slowdown) if self._active() else 1.0
            dt = work / rate
            nxt = self._next_completion()
            if nxt is not None and nxt < dt:
                dt = nxt
            self._advance(dt)
            work -= dt * rate

    def _wait(self) -> None:
        """Wait for the oldest collective, or for the first to complete (reacting, different groups)."""
        t0 = self.t
        active = self._active()
        if self.rules.reacts and len(active) > 1 and len({f.group for f in active}) > 1:
            while len(self._active()) == len(active):  # (reacting: completed ones leave the list)
                self._advance(self._next_completion())
        else:
            target = self.flights[0]
            while target.left > 1e-12:
                self._advance(self._next_completion())
            if target in self.flights:
                self.flights.remove(target)
        self.waited += self.t - t0

    def _active(self) -> list[_Flight]:
        return [f for f in self.flights if f.left > 1e-12]

    def _next_completion(self) -> float | None:
        active = self._active()
        if not active:
            return None
        return min(f.left * sum(g.link == f.link for g in active) for f in active)

    def _advance(self, dt: float) -> None:
        active = self._active()
        for f in active:
            f.left -= dt / sum(g.link == f.link for g in active)
        self.t += dt
        if self.rules.reacts:  # a completed collective lets its strand go at once
            self.flights = [f for f in self.flights if f.left > 1e-12]

    def result(self) -> PairRetime:
        chains = self.chains[0] + self.chains[1]
        return PairRetime(self.t, sum(st.ms + st.deferred_ms for st in chains if not st.comm),
                          sum(st.ms for st in chains if st.comm), self.waited)


def _rules(max_deferred, rules: RoundRules | None) -> RoundRules:
    return rules if rules is not None else RoundRules(max_deferred=max_deferred)


def retime_pair(backward: list[ChainOp], forward: list[ChainOp], max_deferred: int = 2,
                rules: RoundRules | None = None) -> PairRetime:
    """Run two strands' chains (strand 0: ``backward``, wins ties) under the executor's order rule
    (``rules``, default: reactive SI with at most ``max_deferred`` weight gradients waiting).
    Pure function of its inputs."""
    pair = _Pair(backward, forward, _rules(max_deferred, rules))
    reactive = pair.rules.order == "reactive"
    while not pair.done:
        opts = pair.options()
        ops = [o for o in opts if o[0] == "op"]
        if ops:
            pair.apply(min(ops, key=lambda o: (pair.until_comm(o[1]) if reactive else 0, o[1])))
        else:
            pair.apply(opts[0])
    return pair.result()


def search_pair(backward: list[ChainOp], forward: list[ChainOp], max_deferred: int = 2,
                width: int = 1000, rules: RoundRules | None = None) -> PairRetime:
    """The shortest makespan a beam search over the compute unit's decisions finds for the same
    chains, machine and constraints as ``retime_pair`` (any work-conserving order, not just the
    executor's rule): how much a better order could gain. Keeps the ``width`` earliest states per
    number of decisions; the rule's own order stays a candidate, so the result is never worse
    than ``retime_pair``'s."""
    rules = _rules(max_deferred, rules)
    frontier, best = [_Pair(backward, forward, rules)], None
    while frontier:
        states: dict = {}
        for pair in frontier:
            if pair.done:
                best = pair if best is None or pair.t < best.t else best
                continue
            for choice in pair.options():
                nxt = pair.copy()
                nxt.apply(choice)
                k = nxt.key()
                if k not in states or states[k].t > nxt.t:
                    states[k] = nxt
        frontier = sorted(states.values(), key=lambda p: p.t)[:width]
    rule = retime_pair(backward, forward, rules=rules)
    return rule if rule.makespan_ms <= best.t else best.result()
