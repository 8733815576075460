"""Re-timing of traced SI pairs on an idealised machine: how much of a pair's time the two strands'
structure costs, and how much the run itself (rank skew, launch overheads) adds.

Each pair F(k+1)(x)B(k) of a traced SI step becomes two chains of ops, in the order the trace ran
them: compute ops with their measured duration (a backward op's deferred weight gradient, its
``<op>.wgrad`` span, rides along as free-floating work) and collectives with their *wire time*: for
each collective op and direction, the median over the trace of completion minus the later of the
two ranks' launches, over instances no other collective overlapped (or the shortest instance, when
none ran alone). The re-timing then runs both
chains the way the reactive executor does (``executor._Round``; keep the two in step): a
collective starts the moment its strand reaches it; the one compute unit takes the strand with the
fewest compute ops before its next collective (ties: backward), deferred weight gradients when more
than ``max_deferred`` wait or when neither strand can compute; the forward strand stays within the
backward strand's block depth; the link is shared evenly by the collectives in flight.

    measured   the pair as traced (first span to last)
    retime     the same ops and order rule with no rank skew and no launch cost
    search     the best order a beam search finds for the same chains and constraints
    bound      max(sum of compute, sum of wire time): what perfect overlap would take

measured / retime is the cost of the run (ranks reaching a collective at different times, gloo's
launch and completion overheads); retime / bound is the cost of the schedule itself: two chains,
each alternating compute and communication, cannot keep both the compute unit and the link busy
all the time; search / retime is what a better order of the same ops could gain.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from ds_dhelix.bench.tracing import lane_names, split_steps


@dataclass(frozen=True)
class ChainOp:
    """One entry of a strand's chain: ``comm`` (a collective of ``ms`` wire time) or compute of
    ``ms``, plus ``deferred_ms`` of weight-gradient work it leaves for later; ``depth``: the block
    depth of the pair it belongs to (forward block j and backward block L+1-j share depth j)."""

    name: str
    comm: bool
    ms: float
    deferred_ms: float = 0.0
    depth: int = 0


@dataclass(frozen=True)
class PairRetime:
    makespan_ms: float
    compute_ms: float  # sum of compute (incl. deferred weight gradients)
    wire_ms: float  # sum of the collectives' wire time

    @property
    def bound_ms(self) -> float:
        return max(self.compute_ms, self.wire_ms)


class _Pair:
    """Two strands' chains on one compute unit and one evenly shared link, advanced decision by
    decision. A decision is what the compute unit does next: ``("op", s)`` the next compute op of
    strand s (0: backward), ``("wgrad",)`` the oldest deferred weight gradient, ``("wait",)``
    nothing until a collective completes. Collectives start when their strand reaches them, at the
    next decision."""

    def __init__(self, backward, forward, max_deferred: int):
        self.chains, self.max_deferred = (list(backward), list(forward)), max_deferred
        self.t, self.pos = 0.0, [0, 0]
        self.wire: dict[int, list] = {}  # strand -> [wire ms left, depth] of its collective in flight
        self.deferred: list[tuple[float, int]] = []  # (ms, depth), oldest first

    def copy(self) -> "_Pair":
        c = object.__new__(_Pair)
        c.chains, c.max_deferred, c.t, c.pos = self.chains, self.max_deferred, self.t, list(self.pos)
        c.wire, c.deferred = {s: list(v) for s, v in self.wire.items()}, list(self.deferred)
        return c

    def key(self) -> tuple:
        """What the search tells states apart by. The deferred queue needs only its length: only the
        backward strand defers, in chain order, so positions and count fix its contents."""
        return (*self.pos, len(self.deferred), *sorted((s, round(v[0], 3)) for s, v in self.wire.items()))

    @property
    def done(self) -> bool:
        return not (self._left(0) or self._left(1) or self.wire or self.deferred)

    def _left(self, s: int) -> bool:
        return self.pos[s] < len(self.chains[s])

    def _head(self, s: int) -> ChainOp:
        return self.chains[s][self.pos[s]]

    def may_go(self, s: int) -> bool:
        """The executor's rule: a strand goes on when its collective has completed; the forward
        strand not past the backward strand's block depth, nor while a weight gradient of an earlier
        depth waits (``executor._Round``, gated)."""
        if s in self.wire or not self._left(s):
            return False
        if s == 0:
            return True
        f_depth = self._head(1).depth
        if self.deferred and self.deferred[0][1] < f_depth:
            return False
        if not (self._left(0) or 0 in self.wire):
            return True
        return f_depth <= (self.wire[0][1] if 0 in self.wire else self._head(0).depth)

    def launch(self) -> None:
        for s in (0, 1):
            if self.may_go(s) and self._head(s).comm:
                self.wire[s] = [self._head(s).ms, self._head(s).depth]
                self.pos[s] += 1

    def options(self) -> list[tuple]:
        self.launch()
        if len(self.deferred) > self.max_deferred:
            return [("wgrad",)]
        out = [("op", s) for s in (0, 1) if self.may_go(s)]
        if self.deferred:
            out.append(("wgrad",))
        if not (out or self.wire):
            raise ValueError(f"pair re-timing stuck at {self.pos}: no strand may go and nothing in flight")
        return out or [("wait",)]

    def until_comm(self, s: int) -> int:
        chain = self.chains[s]
        return next((i - self.pos[s] for i in range(self.pos[s], len(chain)) if chain[i].comm),
                    len(chain) - self.pos[s])

    def apply(self, choice: tuple) -> None:
        work = None
        if choice[0] == "op":
            op = self._head(choice[1])
            self.pos[choice[1]] += 1
            if op.deferred_ms > 0:
                self.deferred.append((op.deferred_ms, op.depth))
            work = op.ms
        elif choice[0] == "wgrad":
            work = self.deferred.pop(0)[0]
        end = None if work is None else self.t + work
        while True:  # advance to the end of the work, or (none) to the next completed collective
            share = len(self.wire)
            to_next = min(v[0] for v in self.wire.values()) * share if share else None
            dt = to_next if end is None else (end - self.t if to_next is None else min(to_next, end - self.t))
            if dt is None:
                break
            for v in self.wire.values():
                v[0] -= dt / share
            self.t += dt
            finished = [s for s, v in self.wire.items() if v[0] <= 1e-9]
            for s in finished:
                del self.wire[s]
            if (end is not None and self.t >= end - 1e-9) or (end is None and finished):
                break

    def result(self) -> PairRetime:
        chains = self.chains[0] + self.chains[1]
        return PairRetime(self.t, sum(st.ms + st.deferred_ms for st in chains if not st.comm),
                          sum(st.ms for st in chains if st.comm))


def retime_pair(backward: list[ChainOp], forward: list[ChainOp], max_deferred: int = 2) -> PairRetime:
    """Run two strands' chains (strand 0: ``backward``, wins ties) under the executor's order rule:
    deferred weight gradients first when more than ``max_deferred`` wait, else the compute op of
    the strand with the fewest compute ops before its next collective, else a deferred weight
    gradient, else wait. Pure function of its inputs."""
    pair = _Pair(backward, forward, max_deferred)
    while not pair.done:
        opts = pair.options()
        ops = [o for o in opts if o[0] == "op"]
        pair.apply(min(ops, key=lambda o: (pair.until_comm(o[1]), o[1])) if ops else opts[0])
    return pair.result()


def search_pair(backward: list[ChainOp], forward: list[ChainOp], max_deferred: int = 2,
                width: int = 1000) -> PairRetime:
    """The shortest makespan a beam search over the compute unit's decisions finds for the same
    chains, machine and constraints as ``retime_pair`` (any work-conserving order, not just the
    executor's rule): how much a better order could gain. Keeps the ``width`` earliest states per
    number of decisions (one per queue position, deferred count and collectives in flight); the
    rule's own order stays a candidate, so the result is never worse than ``retime_pair``'s."""
    frontier, best = [_Pair(backward, forward, max_deferred)], None
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
    rule = retime_pair(backward, forward, max_deferred)
    return rule if rule.makespan_ms <= best.t else best.result()


def _spans(trace: dict):
    lanes = lane_names(trace)
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and "microbatch" in e.get("args", {}):
            lane = lanes.get((e["pid"], e.get("tid")), "")
            if lane == "compute" or (lane.startswith("comm") and not lane.endswith("grads")):
                yield e, lane != "compute"


def wire_times(trace: dict) -> dict[tuple[str, str], float]:
    """(collective op, direction) -> median ms from the later rank's launch to the last rank's
    completion, over instances that no other collective overlapped on any rank (none such: the
    shortest instance)."""
    inst: dict = defaultdict(dict)  # (key, occurrence) -> {pid: (start, end)}
    seen: dict = defaultdict(int)
    per_rank: dict = defaultdict(list)
    for e, is_comm in sorted(_spans(trace), key=lambda x: x[0]["ts"]):
        if not is_comm:
            continue
        a = e["args"]
        key = (e["name"], a["direction"], a["microbatch"], a.get("block"), e["pid"])
        n = seen[key]
        seen[key] += 1
        inst[(e["name"], a["direction"], a["microbatch"], a.get("block"), n)][e["pid"]] = (e["ts"], e["ts"] + e["dur"])
        per_rank[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    ranks = set(per_rank)

    def alone(lo: float, hi: float) -> bool:
        return all(sum(1 for a, b in per_rank[p] if a < hi and b > lo) <= 1 for p in ranks)

    clean, shared = defaultdict(list), defaultdict(list)
    for (name, direction, *_), by_pid in inst.items():
        if set(by_pid) != ranks:
            continue
        lo, hi = max(a for a, _ in by_pid.values()), max(b for _, b in by_pid.values())
        (clean if alone(min(a for a, _ in by_pid.values()), hi) else shared)[(name, direction)].append((hi - lo) / 1e3)
    # a collective never seen alone (short traces): its fastest shared instance, the closest to its wire time
    return {k: statistics.median(clean[k]) if clean[k] else min(shared[k]) for k in set(clean) | set(shared)}


def pair_chains(trace: dict, pid: int = 0,
                wire: dict | None = None) -> list[tuple[float, list[ChainOp], list[ChainOp]]]:
    """Every traced pair of rank ``pid``: (measured ms, backward chain, forward chain). A pair is the
    forward of micro-batch k+1 with the backward of micro-batch k of one step. ``wire``: the
    trace's ``wire_times`` (computed when not given)."""
    wire = wire_times(trace) if wire is None else wire
    spans = sorted((x for x in _spans(trace) if x[0]["pid"] == pid), key=lambda x: x[0]["ts"])
    comm_ids = {id(e) for e, is_comm in spans if is_comm}
    last_block = max((e["args"].get("block") or 0 for e, _ in spans), default=0)
    out = []
    for step_events in split_steps([e for e, _ in spans]):
        step = [(e, id(e) in comm_ids) for e in step_events]
        last = max(x[0]["args"]["microbatch"] for x in step)
        for k in range(last):
            f = [x for x in step if x[0]["args"]["microbatch"] == k + 1 and x[0]["args"]["direction"] == "forward"]
            b = [x for x in step if x[0]["args"]["microbatch"] == k and x[0]["args"]["direction"] == "backward"]
            if not f or not b:
                continue
            # the pair runs once the forward of micro-batch k+1 starts (k = 0: F0's forward ran alone)
            t0 = f[0][0]["ts"]
            b = [x for x in b if x[0]["ts"] >= t0]
            chains = [_chain(b, wire, lambda blk: last_block - blk), _chain(f, wire, lambda blk: blk)]
            if None in chains:
                continue
            t1 = max(x[0]["ts"] + x[0]["dur"] for x in f + b)
            out.append(((t1 - t0) / 1e3, chains[0], chains[1]))
    return out


def _chain(spans, wire, depth_of) -> list[ChainOp] | None:
    """A strand's spans as a chain; ``depth_of(block)``: the block depth of the pair (the forward
    strand's block j and the backward strand's block L+1-j run in depth j)."""
    chain: list[ChainOp] = []
    last_op: dict = {}  # op name + block -> index in chain, for its .wgrad span
    for e, is_comm in spans:
        a, name = e["args"], e["name"]
        if is_comm:
            ms = wire.get((name, a["direction"]))
            if ms is None:
                return None  # not seen on every rank: no wire time to give it
            chain.append(ChainOp(name, True, ms, depth=depth_of(a.get("block") or 0)))
        elif name.endswith(".wgrad"):
            i = last_op.get((name[: -len(".wgrad")], a.get("block")))
            if i is not None:
                st = chain[i]
                chain[i] = ChainOp(st.name, False, st.ms, st.deferred_ms + e["dur"] / 1e3, st.depth)
        else:
            last_op[(name, a.get("block"))] = len(chain)
            chain.append(ChainOp(name, False, e["dur"] / 1e3, depth=depth_of(a.get("block") or 0)))
    return chain


def retime_trace(trace: dict, max_deferred: int = 2, search_width: int = 100) -> dict:
    """Per rank, totals over its traced pairs (ms per pair, medians): ``{pid: {"pairs", "measured_ms",
    "retime_ms", "search_ms", "bound_ms", "compute_ms", "wire_ms"}}`` (``search_ms``: the best
    order ``search_pair`` finds, beam ``search_width``); ranks without an SI pair are left out."""
    wire = wire_times(trace)
    out = {}
    for pid in sorted({e["pid"] for e, _ in _spans(trace)}):
        rows = []
        for measured, b, f in pair_chains(trace, pid, wire):
            r = retime_pair(b, f, max_deferred)
            searched = search_pair(b, f, max_deferred, search_width)
            rows.append((measured, r.makespan_ms, searched.makespan_ms, r.bound_ms, r.compute_ms, r.wire_ms))
        if rows:
            med = [statistics.median(col) for col in zip(*rows)]
            out[pid] = dict(zip(("measured_ms", "retime_ms", "search_ms", "bound_ms", "compute_ms", "wire_ms"), med),
                            pairs=len(rows))
    return out
