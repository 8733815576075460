"""Weight gradients left for later without a second autograd pass.

Inside an op the executor may defer (marked ``linear`` by its adapter, in a schedule that defers),
``intercept_linears`` routes every ``F.linear`` whose weight or bias is trained through
``_Linear``: the same forward kernel, and a backward that computes the input gradient and adds the
weight and bias gradients itself, or, while ``WeightGradStore.collecting``, leaves them to a
``PendingGrad``. The op's backward is then one autograd engine call, and the deferred
part is two plain matmuls run later by the executor (``PendingGrad.run``): no retained graph and
no second engine pass (DualPipe's weight-gradient store works the same way).

The gradients are the matmuls autograd's own ``linear`` backward runs, on the same operands:
``dX = g.mm(W)``, ``dW = g.t().mm(x)``, ``db = g.sum(0)`` with ``g`` and ``x`` flattened to 2-D,
bitwise equal to plain autograd for 2-D to 4-D inputs, contiguous or not (``tests/test_wgrad.py``).
A gradient is added to ``param.grad`` as autograd's accumulator adds it (the first one taken as is,
later ones added in place). Added inside the op's engine call, the parameter's post-accumulate hooks
run after it, as the engine runs them; a deferred one is added outside any backward, where they do
not run (DeepSpeed's ZeRO-1/2 hooks refuse to, and do nothing inside the engines' coalesced
reduction, which reads ``param.grad`` after the last backward). A weight used twice inside one op would add its two gradients
one after the other where autograd sums them first (an ulp apart); no op of ours does, and the
SI-vs-sequential bitwise tests would see it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode

_LINEAR = F.linear
_ENGINE = Variable._execution_engine


class PendingGrad:
    """One linear's weight (and bias) gradient waiting: ``run()`` computes and accumulates it.
    ``x`` and ``g`` are the linear's input and output gradient as 2-D matrices; ``rows_out``: the
    weight is stored (out, in) as ``nn.Linear``'s (else (in, out), as GPT-2's ``Conv1D``)."""

    __slots__ = ("x", "g", "weight", "bias", "rows_out")

    def __init__(self, x, g: torch.Tensor, weight, bias, rows_out: bool):
        self.x, self.g, self.weight, self.bias, self.rows_out = x, g, weight, bias, rows_out

    def run(self, hooks: bool = False) -> None:
        """Compute and add the gradients; ``hooks``: run the parameters' post-accumulate hooks
        (inside the op's engine call only: DeepSpeed's hooks refuse to run outside a backward)."""
        if self.weight is not None:
            accumulate_into(self.weight, self.g.t().mm(self.x) if self.rows_out else self.x.t().mm(self.g), hooks)
        if self.bias is not None:
            accumulate_into(self.bias, self.g.sum(0), hooks)
        self.x = self.g = None


def accumulate_into(param: torch.Tensor, grad: torch.Tensor, hooks: bool) -> None:
    """``grad`` added to ``param.grad`` as autograd's accumulator adds it, then (``hooks``) the
    parameter's post-accumulate-grad hooks."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
    registered = getattr(param, "_post_accumulate_grad_hooks", None) if hooks else None
    if registered:
        for hook in tuple(registered.values()):
            hook(param)


class WeightGradStore:
    """Where ``_Linear``'s backward leaves its weight gradients while ``collecting``."""

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


class _Linear(torch.autograd.Function):
    """A linear whose parameters are not inputs of the autograd graph: its backward adds their
    gradients itself (``PendingGrad.run``), now or, while the store collects, later. (Were they
    inputs, autograd would visit their accumulators, and run their hooks, even when given none.)
    ``rows_out``: ``F.linear(x, weight, bias)``; else ``Conv1D``'s ``addmm(bias, x, weight)`` /
    ``matmul(x, weight)``."""

    @staticmethod
    def forward(ctx, x, store, params, rows_out):
        ctx.save_for_backward(x)
        ctx.store, ctx.params, ctx.rows_out = store, params, rows_out
        weight, bias = params
        if rows_out:
            return _LINEAR(x, weight, bias)
        return torch.matmul(x, weight) if bias is None else torch.addmm(bias, x, weight)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.params
        g2 = g.reshape(-1, g.shape[-1])
        dx = (g2.mm(weight) if ctx.rows_out else g2.mm(weight.t())).view(x.shape)
        need_w, need_b = weight.requires_grad, bias is not None and bias.requires_grad
        x2 = x.reshape(-1, x.shape[-1]) if need_w else None
        pending = PendingGrad(x2, g2, weight if need_w else None, bias if need_b else None, ctx.rows_out)
        if not ctx.store.take(pending):
            pending.run(hooks=True)
        return dx, None, None, None


def _trained(*params) -> bool:
    return any(p is not None and p.requires_grad for p in params)


class _Intercept(TorchFunctionMode):
    """Routes the linears of an op's forward through ``_Linear``; ``params``: those it routed."""

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store, self.params = store, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        routed = self._route(func, args, kwargs)
        if routed is None:
            return func(*args, **kwargs)
        x, weight, bias, rows_out = routed
        self.params.extend(p for p in (weight, bias) if p is not None and p.requires_grad)
        return _Linear.apply(x, self.store, (weight, bias), rows_out)

    @staticmethod
    def _route(func, args, kwargs):
        """(x, weight, bias, rows_out) of a linear to route, or None."""
        if kwargs and func is not _LINEAR:
            return None
        if func is _LINEAR:
            x, weight, bias = _linear_args(*args, **kwargs)
            rows_out = True
        elif func is torch.addmm and len(args) == 3:  # Conv1D: addmm(bias, x2d, weight)
            bias, x, weight = args
            rows_out = False
            if x.dim() != 2 or bias.dim() != 1:
                return None
        elif func is torch.matmul and len(args) == 2 and isinstance(args[1], torch.nn.Parameter):
            (x, weight), bias, rows_out = args, None, False  # Conv1D without its bias
        else:
            return None
        ok = isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and x.dim() >= 2 and x.requires_grad
        return (x, weight, bias, rows_out) if ok and _trained(weight, bias) else None


def _linear_args(input, weight, bias=None):
    return input, weight, bias


def run_backward(tensors: list, grads: list) -> None:
    """``torch.autograd.backward(tensors, grads)`` without its Python checks (the executor's
    gradients have their outputs' shapes and dtypes by construction): one engine call."""
    _ENGINE.run_backward(tuple(tensors), tuple(grads), False, False, (), True, True)


def intercept_linears(store: WeightGradStore):
    """Inside: ``F.linear`` with a trained weight or bias runs as ``_Linear`` (see the module
    docstring), whose backward hands its weight gradient to ``store`` while it collects."""
    return _Intercept(store)
