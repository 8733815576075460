"""Weight gradients left for later without a second autograd pass.

Inside an op the executor may defer (marked ``linear`` by its adapter, in a schedule that defers),
every linear whose weight or bias is trained runs on the detached weight and bias
(``_linear_deferring``: the same forward kernel; autograd then computes the input's gradient alone,
as for a frozen weight) with a ``PendingGrad`` hung on its output's autograd node as a prehook.
The adapters' projections reach it explicitly (``linear`` / ``addmm`` / ``matmul``, called by
``hf_models.lora.project``); any other linear of the op (an expert's ``x @ W[e]``) through the
``TorchFunctionMode`` of ``intercept_linears``, which the executor keeps only around the ops that
have one (``_Intercept.around``): a mode sends every torch call of the op through Python.

Handed the output's gradient inside the op's one engine call, the prehook adds the weight and bias
gradients at once or, while ``WeightGradStore.collecting``, leaves them waiting: two plain matmuls
the executor runs later (``PendingGrad.run``); no retained graph, no second engine pass, no
autograd Function (DualPipe's weight-gradient store works the same way). Against plain autograd a
routed linear costs a prehook and the store, a few µs of host time (``benchmarks/host_overhead.py``).

An expert's projection on its row of a fused expert weight (``F.linear(x, W[e])``, ``x @ W[e]``) is
routed too, its gradient added into that row (``Slot``). The weight gradients are the matmuls
autograd's own ``linear`` backward runs, on the same operands:
``dW = g.t().mm(x)``, ``db = g.sum(0)`` with ``g`` and ``x`` flattened to 2-D,
bitwise equal to plain autograd for 2-D to 4-D inputs, contiguous or not (``tests/test_wgrad.py``).
A gradient is added to ``param.grad`` as autograd's accumulator adds it (the first one taken as is,
later ones added in place). Added inside the op's engine call, the parameter's post-accumulate hooks
run after it, as the engine runs them; a deferred one is added outside any backward, where they do
not run (DeepSpeed's ZeRO-1/2 hooks refuse to, and do nothing inside the engines' coalesced
reduction, which reads ``param.grad`` after the last backward). A weight used twice inside one op would add its two gradients
one after the other where autograd sums them first (an ulp apart); no op of ours does, and the
SI-vs-sequential bitwise tests would see it. An input modified in place after a routed linear read
it is refused when the gradient comes (autograd's saved-tensor check, kept by hand).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode

_LINEAR = F.linear
_ENGINE = Variable._execution_engine


class PendingGrad:
    """One routed linear's weight (and bias) gradient: the prehook of the linear's output node
    (``__call__``, given the output's gradient), then, waiting or not, ``run()`` computes and
    accumulates it. ``x``: the linear's input (a 2-D matrix once the gradient came), ``g``: its
    output's gradient as a 2-D matrix; ``weight`` / ``bias``: where their gradients go (None: not
    trained); ``rows_out``: the weight is stored (out, in) as ``nn.Linear``'s (else (in, out), as
    GPT-2's ``Conv1D``)."""

    __slots__ = ("x", "g", "weight", "bias", "rows_out", "store", "version")

    def __init__(self, x: torch.Tensor, weight, bias, rows_out: bool, store: WeightGradStore):
        self.x, self.g, self.weight, self.bias, self.rows_out = x, None, weight, bias, rows_out
        self.store, self.version = store, x._version

    def __call__(self, grad_outputs):
        """The output node's prehook, inside the op's engine call: keep (or, when the store does
        not collect, run) the weight gradient; the input's is autograd's own."""
        x, g = self.x, grad_outputs[0]
        if x._version != self.version:
            raise RuntimeError(
                "dhelix: a deferred linear's input was modified in place after the linear used it "
                f"(version {self.version} -> {x._version}); its weight gradient would be wrong. "
                "Run this op without deferral (`dhelix.defer_weight_grads: false`)."
            )
        self.g = g.reshape(-1, g.shape[-1])
        self.x = x.reshape(-1, x.shape[-1]) if self.weight is not None else None
        store, self.store = self.store, None
        if not store.take(self):
            self.run(hooks=True)

    def run(self, hooks: bool = False) -> None:
        """Compute and add the gradients; ``hooks``: run the parameters' post-accumulate hooks
        (inside the op's engine call only: DeepSpeed's hooks refuse to run outside a backward)."""
        if self.weight is not None:
            accumulate_into(self.weight, self.g.t().mm(self.x) if self.rows_out else self.x.t().mm(self.g), hooks)
        if self.bias is not None:
            accumulate_into(self.bias, self.g.sum(0), hooks)
        self.x = self.g = None


class Slot:
    """Row ``index`` of parameter ``param``: an expert's slice of a fused expert weight, where the
    gradient of a linear on that slice goes."""

    __slots__ = ("param", "index")

    def __init__(self, param: torch.nn.Parameter, index: int):
        self.param, self.index = param, index

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad


def accumulate_into(param, grad: torch.Tensor, hooks: bool) -> None:
    """``grad`` added to ``param.grad`` as autograd's accumulator adds it, then (``hooks``) the
    parameter's post-accumulate-grad hooks. A ``Slot``'s gradient goes into its row of the
    parameter's gradient (zeros elsewhere the first time: what autograd's sum over the rows' views
    gives, bitwise); its hooks are not run (one slot is not the whole gradient)."""
    if isinstance(param, Slot):
        whole = param.param
        if whole.grad is None:
            whole.grad = torch.zeros_like(whole)
        whole.grad[param.index] += grad
        return
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
    registered = getattr(param, "_post_accumulate_grad_hooks", None) if hooks else None
    if registered:
        for hook in tuple(registered.values()):
            hook(param)


def _target(t: torch.Tensor | None):
    """Where the gradient of weight or bias ``t`` goes: ``t`` itself when it is a parameter, a
    ``Slot`` when it is ``param[e]`` (a row view of a parameter), else None (not routed)."""
    if isinstance(t, torch.nn.Parameter):
        return t
    base = getattr(t, "_base", None)
    if not isinstance(base, torch.nn.Parameter) or t.shape != base.shape[1:] or t.stride() != base.stride()[1:]:
        return None
    index, rest = divmod(t.storage_offset() - base.storage_offset(), base.stride(0))
    return Slot(base, index) if rest == 0 and 0 <= index < base.shape[0] else None


class WeightGradStore:
    """Where routed linears leave their weight gradients (``PendingGrad``) while ``collecting``."""

    def __init__(self):
        self._into: list | None = None

    @contextlib.contextmanager
    def collecting(self):
        """Inside, linear backwards leave their weight gradients in the yielded list."""
        self._into = pending = []
        try:
            yield pending
        finally:
            self._into = None

    def take(self, pending: PendingGrad) -> bool:
        if self._into is None:
            return False
        self._into.append(pending)
        return True


def _folds_anyway(x: torch.Tensor, flat_with_bias: bool) -> bool:
    """Whether ``F.linear`` / ``matmul`` multiply ``x`` (3+ dims) as one matrix whether or not the
    weight requires grad: ``F.linear`` with a bias on a contiguous input flattens it itself
    (``flat_with_bias``), else matmul does when the strides make ``x`` one matrix (each leading
    dim's stride its successor's stride times size, size-1 dims included)."""
    if flat_with_bias and x.is_contiguous():
        return True
    st, sz = x.stride(), x.shape
    if len(sz) == 3:
        return st[0] == st[1] * sz[1]
    return all(st[i] == st[i + 1] * sz[i + 1] for i in range(len(sz) - 2))


def _linear_deferring(x, weight, bias, targets, rows_out: bool, store: WeightGradStore) -> torch.Tensor:
    """The linear's forward on its detached weight and bias (the same kernel; autograd then
    computes the input's gradient alone, as it does for a frozen weight), with a ``PendingGrad``
    as its output node's prehook for the weight's. (Parameters left in the graph would have
    autograd visit their accumulators, and run their hooks, even when given no gradient.)"""
    w, b = weight.detach(), None if bias is None else bias.detach()
    if x.dim() > 2 and weight.requires_grad and not _folds_anyway(x, rows_out and b is not None):
        # autograd's matmul takes an input of 3+ dims as one matrix when the weight requires grad,
        # else only when its strides make it one (a batch otherwise: another rounding): one matrix
        # here too
        y2 = x.reshape(-1, x.shape[-1]).mm(w.t() if rows_out else w)
        node, y = y2.grad_fn, y2.view(*x.shape[:-1], y2.shape[-1])
        y = y if b is None else y + b
    else:
        y = _LINEAR(x, w, b) if rows_out else torch.matmul(x, w) if b is None else torch.addmm(b, x, w)
        node = (y if y._base is None else y._base).grad_fn
    # the node making the product (a view's base: an in-place op on the view rebases it, the base's
    # node still gets the gradient)
    w_to, b_to = targets
    pending = PendingGrad(
        x,
        w_to if w_to.requires_grad else None,
        b_to if b_to is not None and b_to.requires_grad else None,
        rows_out,
        store,
    )
    node.register_prehook(pending)
    return y


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("dhelix_linear_routing", default=None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, routed (``_linear_deferring``) inside a deferring op's linear routing: what
    the adapters' projections call, so that an op whose linears all come here needs no
    ``TorchFunctionMode`` (which would send every other torch call of the op through Python too)."""
    router = _ACTIVE.get()
    return _LINEAR(x, weight, bias) if router is None else router.route(_LINEAR, (x, weight, bias))


def addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.addmm(bias, x, weight)`` (GPT-2's ``Conv1D``), routed as ``linear`` is."""
    router = _ACTIVE.get()
    return torch.addmm(bias, x, weight) if router is None else router.route(torch.addmm, (bias, x, weight))


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(x, weight)`` (``Conv1D`` without its bias), routed as ``linear`` is."""
    router = _ACTIVE.get()
    return torch.matmul(x, weight) if router is None else router.route(torch.matmul, (x, weight))


class _Routing:
    """Entered: ``linear`` / ``addmm`` / ``matmul`` route through ``router``; ``mode``: the router
    is entered as a ``TorchFunctionMode`` too (every linear of the op is routed, however called)."""

    __slots__ = ("router", "mode", "token")

    def __init__(self, router: _Intercept, mode: bool):
        self.router, self.mode, self.token = router, mode, None

    def __enter__(self):
        self.token = _ACTIVE.set(self.router)
        if self.mode:
            self.router.__enter__()
        return self

    def __exit__(self, *exc):
        if self.mode:
            self.router.__exit__(*exc)
        _ACTIVE.reset(self.token)
        return False


class _Intercept(TorchFunctionMode):
    """Routes the linears of an op's forward through ``_linear_deferring``; ``params``: the parameters whose
    gradients it routed since it was last entered (whole parameters, for a slot its parameter).
    One instance serves every op: ``begin()`` starts a fresh ``params`` (a fused op enters it once
    per linear member, ``graph.fuse.around_linear_members``).

    ``around(op)`` routes the linears of one op's forward: the adapters' projections come through
    ``linear`` (explicit routing, no mode); the first time an op runs the mode watches too, and an
    op in which the mode then routes nothing (every linear came explicitly) runs without it after
    that. An op with a linear the mode routes keeps the mode: nothing is left unrouted that was
    routed before. (An op whose only linears are data-dependent and did not run that first time,
    e.g. experts that got no token, would compute those weight gradients inside its engine call:
    the same gradients, not deferred.)"""

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store, self._params = store, {}
        self._explicit: dict[int, bool] = {}  # id(op) -> every linear of it came explicitly
        self._by_mode = 0  # linears the mode routed

    def begin(self) -> _Intercept:
        self._params = {}
        return self

    @property
    def params(self) -> list:
        return list(self._params.values())

    def around(self, op):
        """The routing to enter around ``op``'s forward (see the class docstring)."""
        explicit = self._explicit.get(id(op))
        if explicit is None:
            return self._watching(op)
        return _Routing(self, not explicit)

    @contextlib.contextmanager
    def _watching(self, op):
        before = self._by_mode
        with _Routing(self, True):
            yield
        self._explicit[id(op)] = self._by_mode == before

    def route(self, func, args: tuple):
        """``func(*args)`` (positional), a linear routed when it is one to route."""
        routed = self._route(func, args)
        return func(*args) if routed is None else self._deferring(*routed)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _ROUTABLE:  # (every torch call inside comes here: the views, the norms)
            return func(*args, **(kwargs or {}))
        if kwargs:
            if func is not _LINEAR:
                return func(*args, **kwargs)
            args = _linear_args(*args, **kwargs)
        routed = self._route(func, args)
        if routed is None:
            return func(*args)
        self._by_mode += 1
        return self._deferring(*routed)

    def _deferring(self, x, weight, bias, targets, rows_out):
        for t in targets:
            if t is not None and t.requires_grad:
                p = t.param if isinstance(t, Slot) else t
                self._params[id(p)] = p
        return _linear_deferring(x, weight, bias, targets, rows_out, self.store)

    @staticmethod
    def _route(func, args: tuple):
        """(x, weight, bias, targets, rows_out) of a linear to route (positional ``args``), or None."""
        if func is _LINEAR:
            x, weight, bias = _linear_args(*args)
            rows_out = True
        elif func is torch.addmm and len(args) == 3:  # Conv1D: addmm(bias, x2d, weight)
            bias, x, weight = args
            rows_out = False
            if x.dim() != 2 or bias.dim() != 1:
                return None
        elif func in _MATMULS and len(args) == 2 and isinstance(args[1], torch.Tensor):
            (x, weight), bias, rows_out = args, None, False  # Conv1D without its bias; x @ W[e]
        else:
            return None
        if weight.dim() != 2 or x.dim() < 2 or not x.requires_grad:
            return None
        targets = (_target(weight), None if bias is None else _target(bias))
        if targets[0] is None or (bias is not None and targets[1] is None):
            return None  # a weight or bias that is not a parameter (or a row of one): autograd's
        if not any(t is not None and t.requires_grad for t in targets):
            return None
        return x, weight, bias, targets, rows_out


_MATMULS = (torch.matmul, torch.Tensor.matmul)  # ``x @ w`` comes to a mode as the method
_ROUTABLE = frozenset((_LINEAR, torch.addmm, *_MATMULS))


def _linear_args(input, weight, bias=None):
    return input, weight, bias


def run_backward(tensors: list, grads: list) -> None:
    """``torch.autograd.backward(tensors, grads)`` without its Python checks (the executor's
    gradients have their outputs' shapes and dtypes by construction): one engine call."""
    _ENGINE.run_backward(tuple(tensors), tuple(grads), False, False, (), True, True)


def intercept_linears(store: WeightGradStore):
    """A mode (re-enterable, one op at a time) inside which ``F.linear`` with a trained weight or
    bias runs on its detached parameters with a ``PendingGrad`` prehook (see the module docstring),
    which hands its weight gradient to ``store`` while it collects."""
    return _Intercept(store)
