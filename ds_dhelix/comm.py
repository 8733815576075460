"""Communication ops: asynchronous collectives launched by the executor.

Sequence-parallel tensors are sequence-first, ``[s, b, h]``, so a sequence shard is a contiguous
slice along dim 0 and all-gather / reduce-scatter need no copies.

    op      forward                         backward
    ag      all-gather  [s/t,b,h]->[s,b,h]  reduce-scatter of the gradient
    rs      reduce-scatter [s,b,h]->[s/t,b,h]  all-gather of the gradient

A COMM op's body is an object with ``forward(x, side) -> Pending`` and ``backward(grad, side) ->
Pending`` (``side``: the micro-batch's side dict, where e.g. MoE split sizes are kept between the
two directions). Every launch returns a ``Pending`` whose ``wait()`` gives the result; on CUDA (NCCL) the
collective runs on the communication stream and ``wait()`` makes the compute stream wait on it;
on CPU (gloo) it runs on gloo's worker threads. Same code path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# torch >= 2.13 renames the single-tensor collectives; older releases only have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Pending:
    """An in-flight collective: ``wait()`` blocks until done and returns the output tensor."""

    work: object
    out: torch.Tensor
    launched_at: float = field(default_factory=time.perf_counter)
    waited_s: float = 0.0  # time the caller spent blocked in wait()
    done_at: float | None = None  # first time the executor saw it complete

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            t0 = time.perf_counter()
            self.work.wait()
            self.waited_s = time.perf_counter() - t0
            self.work = None
        return self.out


class SeqAllGather:
    """COMM op body: all-gather along the sequence forward, reduce-scatter backward."""

    def __init__(self, group, world: int):
        self.group, self.world = group, world

    def forward(self, x, side) -> Pending:
        return all_gather_seq(x, self.group, self.world)

    def backward(self, grad, side) -> Pending:
        return reduce_scatter_seq(grad, self.group, self.world)


class SeqReduceScatter(SeqAllGather):
    """COMM op body: reduce-scatter along the sequence forward, all-gather backward."""

    def forward(self, x, side) -> Pending:
        return reduce_scatter_seq(x, self.group, self.world)

    def backward(self, grad, side) -> Pending:
        return all_gather_seq(grad, self.group, self.world)


def all_gather_seq(x: torch.Tensor, group, world: int) -> Pending:
    out = torch.empty((x.shape[0] * world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _ALL_GATHER(out, x.contiguous(), group=group, async_op=True)
    return Pending(work, out)


def reduce_scatter_seq(x: torch.Tensor, group, world: int) -> Pending:
    if x.shape[0] % world:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor_parallel.size {world}")
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _REDUCE_SCATTER(out, x.contiguous(), group=group, async_op=True)
    return Pending(work, out)


def allreduce_grad_hook(group):
    """A parameter hook that sums the gradient over ``group`` before it is accumulated.

    For weights replicated across the TP group but applied to a sequence shard (norms, embeddings,
    LM head, row-parallel biases): each rank computes only its shard's contribution. A small
    blocking all-reduce on its own group (``tp_grad_group``), so it never queues behind the large
    asynchronous all-gathers of the op graph.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook
