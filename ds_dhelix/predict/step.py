"""One optimizer step of m micro-batches per schedule, from predicted op times (``StepTimes``),
run the way the executor runs it (``runtime.executor``; keep the two in step)::

    sequential   F0 B0 F1 B1 ...                  every collective waited at once
    si           F0 | F1(x)B0 | ... | B(m-1)      reactive pairs over the whole model (``retime``),
                                                  weight gradients deferred when the graph communicates
    si-ends      F0(x)F1 | F2(x)B0 | ... | B(m-2)(x)B(m-1)   (``pair_ends``)
    si-plan      pairs by the default SI plan's rounds, a barrier after each (``si_execution: plan``)
    si-planned   pairs by the DP planner's plan over a table predicted from the same op times
    intra        F(a)(x)F(b) | B(a)(x)B(b) per micro-batch, its halves a and b (Domino's overlap)

then what a step adds once (``StepTimes.tail``). Each mode gives its step time, the time the
compute unit waited on collectives (exposed communication) and tokens/s. Plain data.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph.ops import OpKind, OpSpec, backward_order
from ..planning.plan import SIPlan, default_plan, segment_has_comm
from ..planning.planner import EMPTY, OverlapTable, candidate_segments, plan_dp, predict_ms
from .costs import OpTime, StepTimes
from .retime import ChainOp, PairRetime, RoundRules, retime_pair

MODES = ("sequential", "si", "si-ends", "si-plan", "si-planned", "intra")


@dataclass(frozen=True)
class Lap:
    """A stretch of the step: its time and how long compute waited on collectives in it."""

    ms: float
    wait_ms: float

    def __add__(self, other: "Lap") -> "Lap":
        return Lap(self.ms + other.ms, self.wait_ms + other.wait_ms)

    def __mul__(self, k: float) -> "Lap":
        return Lap(self.ms * k, self.wait_ms * k)


ZERO = Lap(0.0, 0.0)


def _lap(r: PairRetime) -> Lap:
    return Lap(r.makespan_ms, r.wait_ms)


def forward_chain(st: StepTimes, blocks: list[int], lo: int = 0, hi: int | None = None) -> list[ChainOp]:
    """A forward strand over ``blocks`` (ops ``lo:hi`` of each; depth = position in the list)."""
    return [ChainOp(o.name, o.comm, o.fwd_ms, 0.0, j, o.group, o.link)
            for j, b in enumerate(blocks) for o in st.blocks[b][lo:hi]]


def backward_chain(st: StepTimes, blocks: list[int], defer: bool, lo: int = 0, hi: int | None = None) -> list[ChainOp]:
    """A backward strand over ``blocks`` (given last block first; backward positions ``lo:hi`` of
    each); a linear op's weight gradient rides along as deferred work when ``defer``."""
    out = []
    for j, b in enumerate(blocks):
        for o in list(reversed(st.blocks[b]))[lo:hi]:
            later = o.wgrad_ms if defer and o.linear else 0.0
            out.append(ChainOp(o.name, o.comm, o.bwd_ms + o.wgrad_ms - later, later, j, o.group, o.link))
    return out


def _rules(st: StepTimes, **kw) -> RoundRules:
    return RoundRules(slowdown=st.slowdown, reacts=st.reacts, **kw)


def communicates(st: StepTimes) -> bool:
    return any(o.comm for b in st.blocks for o in b)


def sequential(st: StepTimes, m: int) -> Lap:
    """F then B per micro-batch, each collective waited at once."""
    comm = st.comm_ms()
    return Lap(st.compute_ms() + comm, comm) * m


def si(st: StepTimes, m: int) -> Lap:
    every = list(range(len(st.blocks)))
    back = every[::-1]
    defer = communicates(st)
    first = _lap(retime_pair([], forward_chain(st, every), rules=_rules(st)))
    pair = _lap(retime_pair(backward_chain(st, back, defer), forward_chain(st, every), rules=_rules(st)))
    last = _lap(retime_pair(backward_chain(st, back, defer), [], rules=_rules(st)))
    return first + pair * (m - 1) + last


def si_ends(st: StepTimes, m: int) -> Lap:
    if m < 2:
        raise ValueError(f"si-ends pairs the first two forwards: it needs at least 2 micro-batches, got {m}")
    every = list(range(len(st.blocks)))
    back, defer = every[::-1], communicates(st)
    ff = _lap(retime_pair(forward_chain(st, every), forward_chain(st, every), rules=_rules(st, gated=False)))
    pair = _lap(retime_pair(backward_chain(st, back, defer), forward_chain(st, every), rules=_rules(st)))
    bb = _lap(retime_pair(backward_chain(st, back, defer), backward_chain(st, back, defer),
                          rules=_rules(st, gated=False, trail=True)))
    return ff + pair * (m - 2) + bb


def intra(half_a: StepTimes, half_b: StepTimes, m: int) -> Lap:
    """Each micro-batch's halves: forwards side by side, then backwards (the second trailing)."""
    every = list(range(len(half_a.blocks)))
    back, defer = every[::-1], communicates(half_a)
    ff = _lap(retime_pair(forward_chain(half_a, every), forward_chain(half_b, every),
                          rules=_rules(half_a, gated=False)))
    bb = _lap(retime_pair(backward_chain(half_a, back, defer), backward_chain(half_b, back, defer),
                          rules=_rules(half_a, gated=False, trail=True)))
    return (ff + bb) * m


# ------------------------------------------------------------------------------ plan rounds
def plan_rules(st: StepTimes) -> RoundRules:
    """How a plan round runs: no reaction to completions, backward compute first, no deferral."""
    return RoundRules(gated=False, reacts=False, order="strand0", slowdown=st.slowdown)


def specs_of(st: StepTimes, b: int) -> tuple[OpSpec, ...]:
    return tuple(OpSpec(o.name, OpKind.COMM if o.comm else OpKind.COMP) for o in st.blocks[b])


def main_block(st: StepTimes) -> int:
    """The first layer of the most common layer kind (ties: the last layer's), as ``ModelGraph.main_block``."""
    kinds: dict = {}
    for b in range(1, len(st.blocks) - 1):
        kinds.setdefault(specs_of(st, b), []).append(b)
    last = specs_of(st, len(st.blocks) - 2)
    return kinds[max(kinds, key=lambda k: (len(kinds[k]), k == last))][0]


def predicted_table(st: StepTimes, block: int) -> OverlapTable:
    """An overlap table of layer ``block`` priced by re-timing each candidate round: what
    ``dhelix profile`` would measure if the op times were these."""
    fwd = specs_of(st, block)
    bwd = backward_order(fwd)
    rules = plan_rules(st)
    fc, bc = candidate_segments(fwd), candidate_segments(bwd)
    f_chain = {s: forward_chain(st, [block], *s) for s in fc}
    b_chain = {s: backward_chain(st, [block], False, *s) for s in bc}
    table = OverlapTable({"device": "predicted"}, fwd, bwd)
    for s in fc:
        table.set_entry((s, EMPTY), retime_pair([], f_chain[s], rules=rules).makespan_ms)
    for s in bc:
        table.set_entry((EMPTY, s), retime_pair(b_chain[s], [], rules=rules).makespan_ms)
    for a in fc:
        for s in bc:
            if not (segment_has_comm(fwd, a) and segment_has_comm(bwd, s)):
                table.set_entry((a, s), retime_pair(b_chain[s], f_chain[a], rules=rules).makespan_ms)
    return table


def plan_pair(st: StepTimes, f_blocks: list[int], b_blocks: list[int], plan: SIPlan) -> Lap:
    """A forward over ``f_blocks`` beside a backward over ``b_blocks`` (last block first) in plan
    mode (``Executor.co_execute``): the j-th forward block beside the j-th backward block, two
    layers by the plan's rounds (the plan of their kinds: ``plan``, or the default plan of the two
    op lists), anything else as one round; a barrier after each round."""
    nb, rules, lap = len(st.blocks), plan_rules(st), ZERO
    for j in range(max(len(f_blocks), len(b_blocks))):
        fb = f_blocks[j] if j < len(f_blocks) else None
        bb = b_blocks[j] if j < len(b_blocks) else None
        if fb is not None and bb is not None and 0 < fb < nb - 1 and 0 < bb < nb - 1:
            p = plan if specs_of(st, fb) == specs_of(st, bb) == plan.fwd_ops else \
                default_plan(specs_of(st, fb), backward_order(specs_of(st, bb)))
            for r in p.rounds:
                lap += _lap(retime_pair(backward_chain(st, [bb], False, *r.bwd), forward_chain(st, [fb], *r.fwd),
                                        rules=rules))
        else:
            lap += _lap(retime_pair(backward_chain(st, [bb], False) if bb is not None else [],
                                    forward_chain(st, [fb]) if fb is not None else [], rules=rules))
    return lap


def planned(st: StepTimes, m: int, plan: SIPlan) -> Lap:
    """SI by ``plan``: F0 alone, m-1 pairs of plan rounds, B(m-1) alone (no deferral)."""
    every = list(range(len(st.blocks)))
    alone = Lap(st.compute_ms() + st.comm_ms(), st.comm_ms())
    return alone + plan_pair(st, every, every[::-1], plan) * (m - 1)


def plans(st: StepTimes) -> dict:
    """The default plan and the DP plan of the main layer kind, and the planner's own prediction
    of each per layer pair (ms)."""
    table = predicted_table(st, main_block(st))
    default = default_plan(table.fwd_ops, table.bwd_ops)
    best = plan_dp(table, risk=0)
    return {"table": table, "default": default, "dp": best,
            "default_ms": predict_ms(table, default), "dp_ms": best.predicted_ms}
