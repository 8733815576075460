"""One optimizer step of m micro-batches per schedule, from predicted op times (``StepTimes``):
the schedule's instruction list (``ds_dhelix.schedule``) priced instruction by instruction, each
compute instruction's rounds run by the executor's own round policy on a virtual clock
(``retime``)::

    Forward / Backward   one strand alone (a lone backward's weight gradients deferred where the
                         schedule defers them and the graph communicates)
    ForwardBackward      an SI pair: reactive (one gated round) or, under si-plan / si-planned,
                         by the plan's rounds with a barrier after each (``plan_pair``)
    ForwardForward       two forwards side by side; BackwardBackward: two backwards, the second
                         trailing (intra: the two halves of a micro-batch, each at its own size)

then what a step adds once (``StepTimes.tail``). Each mode gives its step time, the time the
compute unit waited on collectives (exposed communication) and tokens/s. A new one-stage schedule
needs no code here: its instruction list is priced as it is. Plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph.ops import OpKind, OpSpec, backward_order
from ..planning.plan import SIPlan, default_plan, segment_has_comm
from ..planning.planner import EMPTY, OverlapTable, candidate_segments, plan_dp, predict_ms
from ..schedule import instructions as S
from ..schedule.registry import ONE_STAGE, ScheduleSpec, names
from .costs import StepTimes
from .retime import ChainOp, PairRetime, RoundRules, reactive_rules, retime_pair

MODES = names(ONE_STAGE, built=True)


@dataclass(frozen=True)
class Lap:
    """A stretch of the step: its time and how long compute waited on collectives in it."""

    ms: float
    wait_ms: float

    def __add__(self, other: Lap) -> Lap:
        return Lap(self.ms + other.ms, self.wait_ms + other.wait_ms)

    def __mul__(self, k: float) -> Lap:
        return Lap(self.ms * k, self.wait_ms * k)


ZERO = Lap(0.0, 0.0)


def _lap(r: PairRetime) -> Lap:
    return Lap(r.makespan_ms, r.wait_ms)


def forward_chain(st: StepTimes, blocks: list[int], lo: int = 0, hi: int | None = None) -> list[ChainOp]:
    """A forward strand over ``blocks`` (ops ``lo:hi`` of each; depth = position in the list)."""
    return [
        ChainOp(o.name, o.comm, o.fwd_ms, 0.0, j, o.group, o.link)
        for j, b in enumerate(blocks)
        for o in st.blocks[b][lo:hi]
    ]


def backward_chain(st: StepTimes, blocks: list[int], defer: bool, lo: int = 0, hi: int | None = None) -> list[ChainOp]:
    """A backward strand over ``blocks`` (given last block first; backward positions ``lo:hi`` of
    each); a linear op's weight gradient rides along as deferred work when ``defer``."""
    out = []
    for j, b in enumerate(blocks):
        for o in list(reversed(st.blocks[b]))[lo:hi]:
            later = o.wgrad_ms if defer and o.linear else 0.0
            out.append(ChainOp(o.name, o.comm, o.bwd_ms + o.wgrad_ms - later, later, j, o.group, o.link))
    return out


def _rules(st: StepTimes, reacts: bool = True, **kw) -> RoundRules:
    return reactive_rules(reacts=st.reacts and reacts, **kw)


def _run(st: StepTimes, backward: list[ChainOp], forward: list[ChainOp], rules: RoundRules) -> PairRetime:
    """A round of the two chains by the round policy on ``st``'s machine (its slowdown)."""
    return retime_pair(backward, forward, rules=rules, slowdown=st.slowdown)


def communicates(st: StepTimes) -> bool:
    return any(o.comm for b in st.blocks for o in b)


def _strand_rules(st: StepTimes, plan_mode: bool, **kw) -> RoundRules:
    return plan_rules(st) if plan_mode else _rules(st, **kw)


def price(
    ins: S.Instruction, spec: ScheduleSpec, st: StepTimes, half: tuple[StepTimes, StepTimes], plan: SIPlan | None
) -> Lap:
    """One compute instruction of ``spec``'s list (``plan``: a plan schedule's); ``half``: the op
    times of a micro-batch's two halves (intra)."""
    every = list(range(len(st.blocks)))
    back, defer = every[::-1], spec.defers_weight_grads and communicates(st)
    rules = _strand_rules(st, plan is not None, reacts=spec.reacts)
    if isinstance(ins, S.Forward):
        return _lap(_run(st, [], forward_chain(st, every), rules))
    if isinstance(ins, S.Backward):
        return _lap(_run(st, backward_chain(st, back, defer), [], rules))
    if isinstance(ins, S.ForwardBackward):
        if plan is not None:
            return plan_pair(st, every, back, plan)
        return _lap(_run(st, backward_chain(st, back, defer), forward_chain(st, every), _rules(st, spec.reacts)))
    a, b = half if spec.halves else (st, st)
    if isinstance(ins, S.ForwardForward):
        return _lap(_run(a, forward_chain(a, every), forward_chain(b, every), _rules(a, spec.reacts, gated=False)))
    if isinstance(ins, S.BackwardBackward):
        chains = backward_chain(a, back, defer), backward_chain(b, back, defer)
        return _lap(_run(a, *chains, _rules(a, spec.reacts, gated=False, trail=True)))
    return ZERO  # loads, the activation budget, the step's end (``StepTimes.tail``)


def schedule_step(
    spec: ScheduleSpec,
    m: int,
    st: StepTimes,
    half: tuple[StepTimes, StepTimes] | None = None,
    plan: SIPlan | None = None,
) -> Lap:
    """A step of ``m`` micro-batches under one-stage schedule ``spec``: its instruction list priced
    (instructions of one kind cost the same: priced once each)."""
    lap, prices = ZERO, {}
    for ins in spec.schedule(1, m)[0]:
        if type(ins) not in prices:
            prices[type(ins)] = price(ins, spec, st, half or (st, st), plan)
        lap += prices[type(ins)]
    return lap


# ------------------------------------------------------------------------------ plan rounds
def plan_rules(st: StepTimes) -> RoundRules:
    """How a plan round runs: no reaction to completions, backward compute first, no deferral."""
    return RoundRules(gated=False, reacts=False, nearest=False)


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
        table.set_entry((s, EMPTY), _run(st, [], f_chain[s], rules).makespan_ms)
    for s in bc:
        table.set_entry((EMPTY, s), _run(st, b_chain[s], [], rules).makespan_ms)
    for a in fc:
        for s in bc:
            if not (segment_has_comm(fwd, a) and segment_has_comm(bwd, s)):
                table.set_entry((a, s), _run(st, b_chain[s], f_chain[a], rules).makespan_ms)
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
            p = (
                plan
                if specs_of(st, fb) == specs_of(st, bb) == plan.fwd_ops
                else default_plan(specs_of(st, fb), backward_order(specs_of(st, bb)))
            )
            for r in p.rounds:
                lap += _lap(_run(st, backward_chain(st, [bb], False, *r.bwd), forward_chain(st, [fb], *r.fwd), rules))
        else:
            lap += _lap(
                _run(
                    st,
                    backward_chain(st, [bb], False) if bb is not None else [],
                    forward_chain(st, [fb]) if fb is not None else [],
                    rules,
                )
            )
    return lap


def plans(st: StepTimes) -> dict:
    """The default plan and the DP plan of the main layer kind, and the planner's own prediction
    of each per layer pair (ms)."""
    table = predicted_table(st, main_block(st))
    default = default_plan(table.fwd_ops, table.bwd_ops)
    best = plan_dp(table, risk=0)
    return {
        "table": table,
        "default": default,
        "dp": best,
        "default_ms": predict_ms(table, default),
        "dp_ms": best.predicted_ms,
    }
