"""One round policy (ds_dhelix.schedule.policy) for the executor and the predictor: the same op
chains with the same op times and collective completion times give the same order of compute ops,
launches and deferred weight gradients, whether the executor runs them (real autograd, collectives
whose completion follows a virtual clock) or ``dhelix predict`` re-times them on its own clock."""

import random
from collections import deque

import pytest
import torch
import torch.nn.functional as F

from ds_dhelix.graph.model_graph import ModelGraph, comm, comp
from ds_dhelix.predict.retime import ChainOp, reactive_rules, retime_pair
from ds_dhelix.runtime.comm import Pending
from ds_dhelix.runtime.executor import Executor
from ds_dhelix.runtime.interpreter import Interpreter
from ds_dhelix.runtime.tasks import MicroBatch
from ds_dhelix.runtime.wgrad import PendingGrad
from ds_dhelix.schedule import policy as P


class Clock:
    """Virtual time: compute advances it by each op's milliseconds; a collective completes at its
    launch time plus its wire time; waiting (or polling) moves it to the next completion."""

    def __init__(self):
        self.t, self.log, self.works = 0.0, [], []

    def run(self, name: str, ms: float) -> None:
        self.log.append(name)
        self.t += ms

    def next_completion(self) -> None:
        pending = [w.done_at for w in self.works if w.done_at > self.t]
        if pending:
            self.t = min(pending)


class Work:
    def __init__(self, clock: Clock, ms: float):
        self.clock, self.done_at = clock, clock.t + ms
        clock.works.append(self)

    def is_completed(self) -> bool:
        return self.clock.t >= self.done_at

    def wait(self) -> bool:
        self.clock.t = max(self.clock.t, self.done_at)
        return True


class Collective:
    """A COMM op's body on the virtual clock (forward and backward on separate strand groups)."""

    strand_safe = True

    def __init__(self, clock: Clock, name: str, ms: float):
        self.clock, self.name, self.ms = clock, name, ms

    def forward(self, x, side, channel=0):
        self.clock.log.append(f"F{side['mb']}.{self.name}")
        return Pending(Work(self.clock, self.ms), x.clone())

    def backward(self, g, side, channel=0):
        self.clock.log.append(f"B{side['mb']}.{self.name}")
        return Pending(Work(self.clock, self.ms), g.clone())


WGRAD_CLOCKS: dict = {}  # weight -> its weight gradient's tick on the clock, for deferred ones (one graph's)


def _timed_pending_run(run):
    def timed(self, hooks=False):
        weight = self.weight
        run(self, hooks)
        if not hooks and weight in WGRAD_CLOCKS:
            WGRAD_CLOCKS[weight]()

    return timed


def _layer_op(clock: Clock, name: str, fwd: float, bwd: float, wgrad: float, src: str, dst: str):
    """A linear COMP op: its input gradient costs ``bwd`` ms, its weight gradient ``wgrad`` (an
    ``F.linear`` of a parameter, which the executor can defer; timed when the gradient is added to
    the weight, by its post-accumulate hook), its forward ``fwd``."""
    weight = torch.nn.Parameter(torch.ones(2, 2))
    owed: deque = deque()  # micro-batches whose weight gradient is owed, oldest first (gradients
    # of one weight are added in micro-batch order)

    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mb):
            ctx.mb = mb
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            clock.run(f"B{ctx.mb}.{name}", bwd)
            return g * 1.0, None

    weight.register_post_accumulate_grad_hook(lambda p: clock.run(f"wgrad:B{owed.popleft()}.{name}", wgrad))
    WGRAD_CLOCKS[weight] = lambda: clock.run(f"wgrad:B{owed.popleft()}.{name}", wgrad)  # deferred: no hook runs

    def fn(side, x):
        clock.run(f"F{side['mb']}.{name}", fwd)
        owed.append(side["mb"])
        return (Timed.apply(x, side["mb"]) + F.linear(x, weight) * 0.0,)

    return comp(name, (src,), (dst,), fn, linear=True), weight


LAYER = [("a", 1.0, 2.0, 1.0), ("ag", 2.0, 0, 0), ("b", 1.0, 1.0, 0.5), ("rs", 1.5, 0, 0)]
"""(op, forward ms or wire ms, input-gradient ms, weight-gradient ms) of one layer; collectives: ag, rs."""


def _graph(clock: Clock, layer=LAYER, num_layers: int = 2) -> ModelGraph:
    blocks, params = [], []
    for i in range(num_layers):
        ops, x = [], "h"
        for name, ms, bwd, wgrad in layer:
            out = f"{name}{i}"
            if bwd == 0:
                ops.append(comm(f"{name}{i}", Collective(clock, f"{name}{i}", ms), x, out))
            else:
                op, w = _layer_op(clock, f"{name}{i}", ms, bwd, wgrad, x, out)
                ops.append(op)
                params.append(w)
            x = out
        ops.append(comp(f"out{i}", (x,), ("h",), lambda side, y: (y * 1.0,)))
        blocks.append(ops)
    blocks.append([comp("loss", ("h",), ("loss",), lambda side, h: (h.sum(),))])
    return ModelGraph(blocks, make_side=lambda batch, serial=0: {"mb": batch["mb"]})


def _chains(layer=LAYER, num_layers: int = 2, f_mb: int = 1, b_mb: int = 0):
    """The predictor's view of the same pair: forward strand F(f_mb), backward strand B(b_mb)
    (last layer first), one link per strand as the executor's strand groups have."""
    fwd, bwd = [], []
    for i in range(num_layers):
        for name, ms, _, _ in layer:
            comm_ = layer[[n for n, *_ in layer].index(name)][2] == 0
            fwd.append(ChainOp(f"F{f_mb}.{name}{i}", comm_, ms, 0.0, i, "g", "F"))
        fwd.append(ChainOp(f"F{f_mb}.out{i}", False, 0.0, 0.0, i, "g", "F"))
    fwd.append(ChainOp(f"F{f_mb}.loss", False, 0.0, 0.0, num_layers))
    bwd.append(ChainOp(f"B{b_mb}.loss", False, 0.0, 0.0, 0))
    for j, i in enumerate(reversed(range(num_layers))):
        bwd.append(ChainOp(f"B{b_mb}.out{i}", False, 0.0, 0.0, j + 1))
        for name, ms, bw, wgrad in reversed(layer):
            if bw == 0:
                bwd.append(ChainOp(f"B{b_mb}.{name}{i}", True, ms, 0.0, j + 1, "g", "B"))
            else:
                bwd.append(ChainOp(f"B{b_mb}.{name}{i}", False, bw, wgrad, j + 1))
    return bwd, fwd


def _executor_order(monkeypatch, layer=LAYER, num_layers: int = 2) -> list[str]:
    """Run F(1) beside B(0) through the executor (reactive, weight gradients deferred) on the
    virtual clock; the names of what ran, in order (unnamed zero-cost ops left out)."""
    clock = Clock()
    WGRAD_CLOCKS.clear()  # the previous graph's weights
    graph = _graph(clock, layer, num_layers)
    import time

    monkeypatch.setattr(time, "sleep", lambda s: clock.next_completion())  # polling: time passes
    monkeypatch.setattr(PendingGrad, "run", _timed_pending_run(PendingGrad.run))
    ex = Executor(graph, defer_weight_grads=True)
    assert ex.reactive and ex.defer_weight_grads and ex.reacts_to_completions
    mbs = [MicroBatch(k, graph.make_side({"mb": k}), env={"h": torch.ones(2, 2)}) for k in range(2)]
    with ex.deferring(True):  # the first forward too, as in a step (its linears then defer)
        ex.forward(mbs[0])
        clock.log.clear()
        ex.start_backward(mbs[0], 1.0)
        Interpreter(ex).co_execute(mbs[1], ex.all_blocks(), mbs[0], ex.all_blocks()[::-1])
    return clock.log


def _predicted_order(layer=LAYER, num_layers: int = 2) -> list[str]:
    bwd, fwd = _chains(layer, num_layers)
    order = retime_pair(bwd, fwd, rules=reactive_rules()).order
    costly = {n for n, ms, _, _ in layer}
    return [o for o in order if o.split(".")[-1].rstrip("0123456789") in costly]


@pytest.mark.parametrize("seed", [None, 1, 2, 3, 4])
def test_executor_and_predictor_take_the_same_order(monkeypatch, seed):
    layer = LAYER
    if seed is not None:  # other op and wire times: the order changes, the agreement must not
        rng = random.Random(seed)
        layer = [
            (
                n,
                rng.choice((0.5, 1.0, 2.0, 3.0)),
                bwd and rng.choice((0.5, 1.0, 2.0)),
                wgrad and rng.choice((0.5, 1.0, 2.0)),
            )
            for n, _, bwd, wgrad in LAYER
        ]
    executed = _executor_order(monkeypatch, layer)
    predicted = _predicted_order(layer)
    assert executed == predicted
    assert any(name.startswith("wgrad:") for name in executed)  # deferral took part
    launches = [n for n in executed if n.split(".")[-1].startswith(("ag", "rs"))]
    assert launches and launches != sorted(launches, key=lambda n: n[0])  # the strands interleave


def test_policy_waits_for_the_first_to_complete_only_when_reacting():
    """Both strands' collectives in flight: reacting, wait for whichever completes first (polled);
    otherwise the oldest."""

    class Host:
        def completed(self, h):
            return False

        def pollable(self, item):
            return True

        def deferred(self):
            return 0, float("inf")

        def may_save(self, item):
            return True

    items = [ChainOp("c", True, 1.0)]
    for reacts, want in ((True, P.WAIT_FIRST), (False, P.WAIT)):
        rnd = P.Round(items, items, P.RoundRules(reacts=reacts), comm=lambda o: o.comm, depth=lambda o: o.depth)
        for s in (0, 1):
            assert rnd.decide(Host()).kind == P.LAUNCH
            rnd.launched(s, rnd.take(s), object())
        d = rnd.decide(Host())
        assert d.kind == want and (d.strands == (0, 1) if reacts else d.strand == 0)
