"""Deferred weight gradients: which parameters an op's backward adds to (``op_weights``), and the
weight-gradient passes left for later (``DeferredGrads``), oldest first.

A backward op marked ``linear`` by its adapter may compute its input gradient first and leave its
linears' weight gradients for later (``wgrad.py``: one autograd engine call now, two matmuls per
linear later; matrices that are not plain linears, such as an expert's slice of a fused weight,
keep a second autograd pass over them): the same matmuls, so results do not change, and the
strand reaches its next collective sooner. A deferred pass must run before any later op adds to the same
weight (a tied weight, the same op of an earlier micro-batch), so each weight keeps its
accumulation order: ``touches`` says when.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..graph.model_graph import Op


@dataclass(frozen=True)
class OpWeights:
    params: tuple  # parameters the op's backward accumulates into
    deferrable: bool  # marked linear by its adapter and has a matrix weight
    ids: frozenset = frozenset()  # id() of each of ``params``


NO_WEIGHTS = OpWeights((), False)  # COMM ops


def op_weights(op: Op, tensors, leaves) -> OpWeights:
    """The parameters an op's backward adds to through autograd: the leaf variables its autograd
    graph reaches from its outputs, other than its own inputs. Deferrable when its adapter marks
    it ``linear``."""
    leaf_ids = {id(x) for x in leaves}
    params, seen, stack = [], set(), [x.grad_fn for x in tensors if x.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # a leaf's gradient accumulator
        if var is not None:
            if id(var) not in leaf_ids:
                params.append(var)
            continue
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return with_params(op, NO_WEIGHTS, params)


def with_params(op: Op, weights: OpWeights, params) -> OpWeights:
    """``weights`` with ``params`` added (those not in it yet): what an op adds to, gathered over
    the ways its forward ran (through autograd, or with its linears routed by ``wgrad.py``)."""
    found = list(weights.params)
    ids = set(weights.ids)
    for p in params:
        if id(p) not in ids:
            found.append(p)
            ids.add(id(p))
    return OpWeights(tuple(found), op.linear and any(p.dim() >= 2 for p in found), frozenset(ids))


class DeferredGrads:
    """Weight-gradient passes waiting, oldest first: ``(task, ([PendingGrad], second pass or None),
    OpWeights)`` each; a second pass ``(outputs, grads, params)`` covers the matrices autograd
    reaches itself (not routed through ``wgrad``)."""

    def __init__(self):
        self._queue: deque = deque()
        self._params: dict[int, int] = {}  # id(param) -> passes waiting that add to it

    def __len__(self) -> int:
        return len(self._queue)

    def oldest_depth(self) -> float:
        """Block depth of the oldest waiting pass (infinity when none waits)."""
        return self._queue[0][0].depth if self._queue else float("inf")

    def add(self, task, pending: tuple, weights: OpWeights) -> None:
        self._queue.append((task, pending, weights))
        for p in weights.params:
            self._params[id(p)] = self._params.get(id(p), 0) + 1

    def touches(self, ids: frozenset) -> bool:
        """Whether a waiting pass adds to any of the parameters ``ids``."""
        return bool(self._params) and any(pid in self._params for pid in ids)

    def pop(self):
        """The oldest waiting pass, no longer waiting."""
        item = self._queue.popleft()
        for p in item[2].params:
            left = self._params.pop(id(p)) - 1
            if left:
                self._params[id(p)] = left
        return item
