"""Replay of traced SI pairs on an idealised machine: how much of a pair's time the two strands'
structure costs, and how much the run itself (rank skew, launch overheads) adds.

Each pair F(k+1)(x)B(k) of a traced SI step becomes two chains of ops, in the order the trace ran
them: compute ops with their measured duration (a backward op's deferred weight gradient, its
``<op>.wgrad`` span, rides along as free-floating work) and collectives with their *wire time*: for
each collective op and direction, the median over the trace of completion minus the later of the
two ranks' launches, over instances no other collective overlapped (or the shortest instance, when
none ran alone). The replay then runs both
chains the way the streamed executor does (``Executor.run_step``; keep the two in step): a
collective starts the moment its strand reaches it; the one compute unit takes the strand with the
fewest compute ops before its next collective (ties: backward), deferred weight gradients when more
than ``max_deferred`` wait or when neither strand can compute; the link is shared evenly by the
collectives in flight.

    measured   the pair as traced (first span to last)
    replay     the same ops and order rule with no rank skew and no launch cost
    bound      max(sum of compute, sum of wire time): what perfect overlap would take

measured / replay is the cost of the run (ranks reaching a collective at different times, gloo's
launch and completion overheads); replay / bound is the cost of the schedule itself: two chains,
each alternating compute and communication, cannot keep both the compute unit and the link busy
all the time.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from .tracing import _lane_names, _split_steps


@dataclass(frozen=True)
class ChainOp:
    """One entry of a strand's chain: ``comm`` (a collective of ``ms`` wire time) or compute of
    ``ms``, plus ``deferred_ms`` of weight-gradient work it leaves for later."""

    name: str
    comm: bool
    ms: float
    deferred_ms: float = 0.0


@dataclass(frozen=True)
class PairReplay:
    makespan_ms: float
    compute_ms: float  # sum of compute (incl. deferred weight gradients)
    wire_ms: float  # sum of the collectives' wire time

    @property
    def bound_ms(self) -> float:
        return max(self.compute_ms, self.wire_ms)


def replay_pair(backward: list[ChainOp], forward: list[ChainOp], max_deferred: int = 2) -> PairReplay:
    """Run two strands' chains (strand 0: ``backward``, wins ties) on one compute unit and one
    evenly shared link; return the makespan. Pure function of its inputs."""
    queues = [list(backward), list(forward)]
    wire: dict[int, float] = {}  # strand -> wire ms left of its collective in flight
    deferred: list[float] = []
    t = 0.0

    def until_comm(s: int) -> int:
        return next((i for i, st in enumerate(queues[s]) if st.comm), len(queues[s]))

    while queues[0] or queues[1] or wire or deferred:  # deferred passes all run before the pair ends
        for s in (0, 1):
            if s not in wire and queues[s] and queues[s][0].comm:
                wire[s] = queues[s].pop(0).ms
        runnable = sorted((s for s in (0, 1) if s not in wire and queues[s]), key=lambda s: (until_comm(s), s))
        work = None
        if len(deferred) > max_deferred or (not runnable and deferred):
            work = deferred.pop(0)
        elif runnable:
            op = queues[runnable[0]].pop(0)
            if op.deferred_ms > 0:
                deferred.append(op.deferred_ms)
            work = op.ms
        end = None if work is None else t + work
        while True:  # advance to the end of the work, or (none) to the next completed collective
            share = len(wire)
            to_next = min(wire.values()) * share if share else None
            dt = to_next if end is None else (end - t if to_next is None else min(to_next, end - t))
            if dt is None:
                break
            for s in wire:
                wire[s] -= dt / share
            t += dt
            done = [s for s, left in wire.items() if left <= 1e-9]
            for s in done:
                del wire[s]
            if (end is not None and t >= end - 1e-9) or (end is None and done):
                break
    compute = sum(st.ms + st.deferred_ms for st in backward + forward if not st.comm)
    return PairReplay(t, compute, sum(st.ms for st in backward + forward if st.comm))


def _spans(trace: dict):
    lanes = _lane_names(trace)
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
    out = []
    for step_events in _split_steps([e for e, _ in spans]):
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
            chains = [_chain(b, wire), _chain(f, wire)]
            if None in chains:
                continue
            t1 = max(x[0]["ts"] + x[0]["dur"] for x in f + b)
            out.append(((t1 - t0) / 1e3, chains[0], chains[1]))
    return out


def _chain(spans, wire) -> list[ChainOp] | None:
    chain: list[ChainOp] = []
    last_op: dict = {}  # op name + block -> index in chain, for its .wgrad span
    for e, is_comm in spans:
        a, name = e["args"], e["name"]
        if is_comm:
            ms = wire.get((name, a["direction"]))
            if ms is None:
                return None  # not seen on every rank: no wire time to give it
            chain.append(ChainOp(name, True, ms))
        elif name.endswith(".wgrad"):
            i = last_op.get((name[: -len(".wgrad")], a.get("block")))
            if i is not None:
                st = chain[i]
                chain[i] = ChainOp(st.name, False, st.ms, st.deferred_ms + e["dur"] / 1e3)
        else:
            last_op[(name, a.get("block"))] = len(chain)
            chain.append(ChainOp(name, False, e["dur"] / 1e3))
    return chain


def replay_trace(trace: dict, max_deferred: int = 2) -> dict:
    """Per rank, totals over its traced pairs (ms per pair, medians): ``{pid: {"pairs", "measured_ms",
    "replay_ms", "bound_ms", "compute_ms", "wire_ms"}}``; ranks without an SI pair are left out."""
    wire = wire_times(trace)
    out = {}
    for pid in sorted({e["pid"] for e, _ in _spans(trace)}):
        rows = []
        for measured, b, f in pair_chains(trace, pid, wire):
            r = replay_pair(b, f, max_deferred)
            rows.append((measured, r.makespan_ms, r.bound_ms, r.compute_ms, r.wire_ms))
        if rows:
            med = [statistics.median(col) for col in zip(*rows)]
            out[pid] = {"pairs": len(rows), "measured_ms": med[0], "replay_ms": med[1], "bound_ms": med[2],
                        "compute_ms": med[3], "wire_ms": med[4]}
    return out
