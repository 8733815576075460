"""Expert-parallel all-to-alls as COMM op bodies: ``moe.dispatch`` and ``moe.combine``.

    op            forward                                  backward
    moe.dispatch  copies -> expert owners (send->recv)      gradients back (recv->send)
    moe.combine   expert outputs -> token owners (recv->send)  gradients to experts (send->recv)

    moe.counts    per-expert copy counts exchanged          nothing (no gradient)

Dropless mode needs the split sizes before the token all-to-all can be posted: ``moe.counts``
exchanges the per-expert copy counts (a tiny asynchronous ``all_to_all_single`` on its own group,
``count_group``, so it never queues behind the large all-to-alls) as an op of its own between the
router and the dispatch, so the other strand computes while it is in flight instead of both ranks
meeting in a blocking exchange. Every rank runs the same ops in the same order, so every rank
issues the same collectives in the same order whatever the routing. Capacity mode has fixed, even
splits: no exchange.

Host reads: one per dropless layer per micro-batch, ``split_sizes`` at the dispatch launch
(``all_to_all_single`` takes its split sizes as Python lists); the rows per local expert come with
it. When the executor finishes ``moe.counts``, the sent and received counts start their way to
pinned host memory (``runtime.comm.HostCopies``: a copy on a side stream that waits on the
exchange alone, and an event); the dispatch launch waits on that event, not on the compute
stream, so the other strand's queued kernels stay queued. Capacity mode reads nothing::

    host:     router, counts launch | other strand's ops | counts finish | dispatch: event wait, read
    compute:  [router][other strand's kernels ..........................................]
    NCCL:             [counts a2a]
    side:                          [D2H copy]·event
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime.comm import HostCopies, Pending
from ..runtime.groups import ExpertGroups
from .router import Route


@dataclass
class TimedPending(Pending):
    """A ``Pending`` that reports (busy, waited) seconds to ``sink`` once its result is taken."""

    sink: object = None

    def wait(self) -> torch.Tensor:
        first = self.work is not None
        out = super().wait()
        if self.done_at is None:
            self.done_at = time.perf_counter()
        if first and self.sink is not None:
            self.sink(self.done_at - self.launched_at, self.waited_s)
        return out


class CountExchange:
    """COMM op body of ``moe.counts``: forward passes ``x`` through once this rank knows how many
    copies it sends to / receives from each EP rank; backward passes the gradient through.
    ``copies``: the ``HostCopies`` the counts go to the host by (one per graph; None: its own)."""

    lane = "comm:ep"  # trace lane

    def __init__(self, layer: int, groups: ExpertGroups, metrics=None, copies: HostCopies | None = None):
        self.layer, self.groups, self.metrics = layer, groups, metrics
        self.copies = HostCopies() if copies is None else copies

    def process_group(self, channel: int):
        """The group a launch on ``channel`` runs on."""
        return self.groups.count_group.channel(channel)

    @property
    def strand_safe(self) -> bool:
        """Its backward launches nothing; two forward strands (``pair_ends``) need both channels."""
        return self.groups.count_group.separate

    def forward(self, x, side, channel: int = 0) -> Pending:
        route = side["moe"][self.layer]
        if route.padded:  # capacity mode: fixed splits
            return Pending(None, x)
        ep = self.groups.size
        both = route.counts.new_empty((2, ep, route.counts.numel() // ep))  # [sent, received]: one copy to the host
        both[0].copy_(route.counts.view(ep, -1))
        work = dist.all_to_all_single(both[1], both[0], group=self.groups.count_group.channel(channel), async_op=True)

        def finish(_):  # [ep, E/ep] copies sent to / received from each EP rank, per expert
            route.recv_counts = both[1]
            route.host_counts = self.copies.start(both, after=work)  # read by ``split_sizes``, not here
            return x

        pending = TimedPending(work, x, finish=finish)
        if self.metrics is not None:
            pending.sink = self.metrics.record_comm
        return pending

    def backward(self, grad, side, channel: int = 1) -> Pending:
        return Pending(None, grad)


def split_sizes(route: Route) -> None:
    """The host read of a dropless layer: the sent and received counts ``moe.counts`` started to
    the host -> the all-to-all's split sizes per EP rank and the received rows per local expert."""
    sent, received = route.host_counts.read()
    route.send_splits = [sum(row) for row in sent]
    route.recv_splits = [sum(row) for row in received]
    route.expert_sizes = [sum(col) for col in zip(*received)]


def _all_to_all(x: torch.Tensor, out_splits, in_splits, group) -> Pending:
    x = x.contiguous()
    rows = x.shape[0] if out_splits is None else sum(out_splits)
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = dist.all_to_all_single(
        out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group, async_op=True
    )
    return TimedPending(work, out)


class ExpertAllToAll:
    """COMM op body for layer ``layer``: ``to_experts=True`` is ``moe.dispatch``, False ``moe.combine``."""

    lane = "comm:ep"  # trace lane

    def __init__(self, layer: int, groups: ExpertGroups, to_experts: bool, metrics=None):
        self.layer, self.groups, self.to_experts, self.metrics = layer, groups, to_experts, metrics

    def process_group(self, channel: int):
        """The group a launch on ``channel`` runs on."""
        return self.groups.group.channel(channel)

    @property
    def strand_safe(self) -> bool:
        return self.groups.group.separate

    def _send(self, x, route: Route, toward_experts: bool, group) -> Pending:
        if route.padded:
            return _all_to_all(x, None, None, group)
        if toward_experts:
            return _all_to_all(x, route.recv_splits, route.send_splits, group)
        return _all_to_all(x, route.send_splits, route.recv_splits, group)

    def forward(self, x, side, channel: int = 0) -> Pending:
        route = side["moe"][self.layer]
        if not route.padded and route.recv_splits is None:
            if route.host_counts is None:
                raise RuntimeError(
                    f"moe.dispatch of layer {self.layer}: no split sizes; a dropless graph "
                    f"needs its moe.counts op before the dispatch"
                )
            split_sizes(route)  # as late as possible: the launch that needs them
        return self._record(self._send(x, route, self.to_experts, self.groups.group.channel(channel)))

    def backward(self, grad, side, channel: int = 1) -> Pending:
        return self._record(
            self._send(grad, side["moe"][self.layer], not self.to_experts, self.groups.group.channel(channel))
        )

    def _record(self, pending: TimedPending) -> TimedPending:
        if self.metrics is not None:
            pending.sink = self.metrics.record_comm
        return pending
