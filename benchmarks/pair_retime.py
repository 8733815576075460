"""Re-timing of traced SI pairs on an idealised machine: how much of a pair's time the two strands'
structure costs, and how much the run itself (rank skew, launch overheads) adds.

Each pair F(k+1)(x)B(k) of a traced SI step becomes two chains of ops, in the order the trace ran
them: compute ops with their measured duration (a backward op's deferred weight gradient, its
``<op>.wgrad`` span, rides along as free-floating work) and collectives with their *wire time*: for
each collective op and direction, the median over the trace of completion minus the later of the
two ranks' launches, over instances no other collective overlapped (or the shortest instance, when
none ran alone). The re-timing then runs both chains the way the reactive executor does
(``ds_dhelix.predict.retime``, which ``dhelix predict`` uses too): a collective starts the moment
its strand reaches it; the one compute unit takes the strand with the fewest compute ops before its
next collective (ties: backward), deferred weight gradients when more than ``max_deferred`` wait or
when neither strand can compute; the forward strand stays within the backward strand's block depth;
the link is shared evenly by the collectives in flight.

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

from ds_dhelix.bench.tracing import lane_names, split_steps
from ds_dhelix.predict.retime import ChainOp, PairRetime, retime_pair, search_pair

__all__ = ["ChainOp", "PairRetime", "pair_chains", "retime_pair", "retime_trace", "search_pair", "wire_times"]


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


def pair_chains(
    trace: dict, pid: int = 0, wire: dict | None = None
) -> list[tuple[float, list[ChainOp], list[ChainOp]]]:
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
            out[pid] = dict(
                zip(("measured_ms", "retime_ms", "search_ms", "bound_ms", "compute_ms", "wire_ms"), med),
                pairs=len(rows),
            )
    return out
