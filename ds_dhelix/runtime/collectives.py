"""The executor's collectives: a COMM op launched (its strand's channel, a failing peer named),
finished (its result in the micro-batch, its time on the step, its span on the trace), polled for
the round policy (``completed``, ``pollable``, the first of two to complete), and the step's own
reductions and device timings. ``Executor`` (``executor.py``) is the one class built from it: the
methods read its ``stats``, ``recorder``, ``graph`` and per-step state."""

from __future__ import annotations

import contextlib
import time

import torch

from ..graph.model_graph import Op
from ..schedule import policy as P
from .comm import CollectiveError, DeviceEvents, Pending, is_comm_failure
from .tasks import Task, accumulate

POLL_S = 50e-6
"""How long a rank waiting on two strands' collectives sleeps between looking at them."""


class Collectives:
    """Launching, finishing and timing collectives (mixed into ``Executor``)."""

    def launch_comm(self, t: Task) -> Pending:
        self._beat(t)
        self._before_forward(t)
        op, mb = t.op, t.mb
        with self._label(op.name), self._collective(t):
            if t.backward:  # (a COMM op without tensors, ZeRO-3's gathers, gets None)
                pending = op.comm.backward(mb.grads.pop(op.outputs[0]) if op.outputs else None, mb.side, t.channel)
            else:
                pending = op.comm.forward(mb.env[op.inputs[0]] if op.inputs else None, mb.side, t.channel)
        self.stats.num_comms += 1
        if pending.device_events is not None:
            self._cuda = True
        return pending

    @contextlib.contextmanager
    def _collective(self, t: Task):
        """A failing collective (a dead peer) as a ``CollectiveError`` naming the op and its strand."""
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as err:
            if not is_comm_failure(err):
                raise
            groups = getattr(t.op.comm, "groups", None)
            group = groups.channel(t.channel) if hasattr(groups, "channel") else None
            raise CollectiveError(
                f"{t.op.name} ({t.strand} strand, micro-batch {t.mb.index}, block {t.block})", err, group
            ) from err

    def finish_comm(self, t: Task, pending: Pending) -> None:
        with self._collective(t):
            out = pending.wait()
        done = time.perf_counter()
        if pending.device_events is not None:
            self._device_events.append(pending.device_events)
        self.stats.exposed_s += pending.waited_s
        if not getattr(t.op.comm, "times_itself", False):  # (ZeRO-3's gathers report their own time)
            self.stats.comm_s += (
                done - pending.launched_at if pending.done_at is None else pending.done_at - pending.launched_at
            )
        if self.recorder is not None:
            end = pending.done_at or done
            group = "B" if t.channel else "F"  # lane of the strand group: one comm in flight each
            lane = f"{getattr(t.op.comm, 'lane', 'comm:tp')}:{group}"
            self.recorder.add_span(lane, t.op.name, pending.launched_at, end, self._args(t))
        if t.backward and t.op.inputs:
            accumulate(t.mb.grads, t.op.inputs[0], out)
        elif not t.backward and t.op.outputs:
            t.mb.env[t.op.outputs[0]] = out

    def _wait_first(self, rnd: P.Round, strands: tuple[int, ...]) -> int:
        """Poll the collectives of ``strands`` until one completes; the time polled counts as exposed."""
        t0 = time.perf_counter()
        while True:
            for s in strands:
                pending = rnd.flight[s][1]
                if pending.work is None or pending.work.is_completed():
                    pending.waited_s += time.perf_counter() - t0
                    return s
            time.sleep(POLL_S)

    def _note_completions(self, rnd: P.Round) -> None:
        """Stamp the time a collective is first seen complete (its comm time ends there)."""
        now = time.perf_counter()
        for item in rnd.flight:
            if item is not None and item[1].done_at is None and self.completed(item[1]):
                item[1].done_at = now

    def finish_device_times(self) -> None:
        """CUDA: fill the step's ``device_comm_s`` / ``device_exposed_s`` from its collectives'
        events (synchronizes the device; call once the step's work is launched)."""
        if not self._device_events:
            return
        torch.cuda.synchronize()
        busy = exposed = 0.0
        for events in self._device_events:
            b, e = events.times_s()
            busy, exposed = busy + b, exposed + e
        self.stats.device_comm_s, self.stats.device_exposed_s = busy, exposed
        self._device_events = []

    def record_wait(self, seconds: float) -> None:
        """Time the step spent blocked outside the executor's own collectives (pipeline receives)."""
        self.stats.exposed_s += seconds

    def reduce_replicated_grads(self, after_microbatch: int = -1) -> None:
        """Sum the step's gradients of TP-replicated weights over the TP group (one blocking
        all-reduce, counted as exposed communication; traced as part of the backward strand of the
        step's last micro-batch)."""
        if self.graph.replicated is None or not self._grad:
            return
        events = DeviceEvents.start() if self._cuda else None  # (TP collectives ran on CUDA tensors)
        t0 = time.perf_counter()
        nbytes = self.graph.replicated.all_reduce()
        t1 = time.perf_counter()
        if events is not None and nbytes:  # NCCL returns at once: its time is the stream's, by events
            self._device_events.append(events.waited_in_full())
        if nbytes:
            self.stats.comm_s += t1 - t0
            self.stats.exposed_s += t1 - t0
            self.stats.num_comms += 1
            if self.recorder is not None:
                self.recorder.add_span(
                    "comm:tp:grads",
                    "replicated.allreduce",
                    t0,
                    t1,
                    {
                        "strand": "B",
                        "microbatch": after_microbatch,
                        "bytes": nbytes,
                        "op": "replicated.allreduce",
                        "direction": "backward",
                    },
                )

    @staticmethod
    def polls(op: Op) -> bool:
        """Whether COMM op ``op``'s in-flight work may be polled for completion (not gloo's send /
        receive)."""
        return getattr(op.comm, "reports_completion", True)

    def completed(self, pending: Pending) -> bool:
        return pending.work is not None and pending.work.is_completed()

    def pollable(self, t: Task) -> bool:
        return self.polls(t.op)
