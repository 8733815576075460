"""Communication ops: asynchronous collectives launched by the executor.

Sequence-parallel tensors are sequence-first, ``[s, b, h]``, so a sequence shard is a contiguous
slice along dim 0 and all-gather / reduce-scatter need no copies.

    op      forward                         backward
    ag      all-gather  [s/t,b,h]->[s,b,h]  reduce-scatter of the gradient
    rs      reduce-scatter [s,b,h]->[s/t,b,h]  all-gather of the gradient
    a2a     all-to-all of [cp, ...] chunks  all-to-all of the gradient (context parallelism)
    ring    send to CP rank r+1, receive    send the gradient to r-1, receive from r+1
            from r-1 (point to point)       (ring attention's key/value blocks)

A COMM op's body is an object with ``forward(x, side, channel) -> Pending`` and ``backward(grad,
side, channel) -> Pending`` (``side``: the micro-batch's side dict, where e.g. MoE split sizes are
kept between the two directions; ``channel``: which of the body's ``StrandGroups`` the launch
uses, chosen by the executor). Every launch returns a ``Pending`` whose ``wait()`` gives the
result; on CUDA (NCCL) the collective runs on NCCL's own stream and ``wait()`` makes the compute
stream wait on it; on CPU (gloo) it runs on gloo's worker threads. Same code path. A body whose
``strand_safe`` is true has separate groups per channel, which lets the reactive executor
interleave the two strands by timing.

On gloo both sequence collectives are all-to-alls: a reduce-scatter is an all-to-all of the shards
plus a local sum (gloo's own reduce-scatter is a full all-reduce: twice the bytes), an all-gather
sends the rank's shard to every rank (cheaper per call than gloo's all-gather). Weights replicated
over the TP group sum their gradients once per step (``ReplicatedGrads``).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch >= 2.13 renames the single-tensor collectives; older releases only have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator",
    "ncclRemoteError",
    "Timed out waiting",
    "gloo::EnforceNotMet",
    "connectFullMesh",
)


def is_comm_failure(err: BaseException) -> bool:
    """A backend error of a collective (a peer gone, a broken connection), not an error of ours."""
    if isinstance(err, CollectiveError) or isinstance(err, getattr(dist, "DistError", ())):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in _PEER_LOST)


class CollectiveError(RuntimeError):
    """A collective failed (typically: a peer process died). ``where`` names the op, micro-batch and
    strand; ``peer`` the remote address the backend reported, when it did."""

    def __init__(self, where: str, cause: BaseException, group=None):
        self.where, self.cause = where, cause
        text = str(cause).strip()
        found = re.search(r"\[([0-9a-fA-F.:]+)\]:(\d+)", text)
        self.peer = _peer_ranks(group) or (f"{found.group(1)}:{found.group(2)}" if found else None)
        reason = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[-1] if text else type(cause).__name__)
        reason = reason.split(". This is typically")[0]  # gloo's boilerplate advice
        super().__init__(f"collective {where} failed" + (f" (peer {self.peer})" if self.peer else "") + f": {reason}")


@contextlib.contextmanager
def collective_failures(where: str | Callable[[], str], group=None):
    """Report a backend failure inside the block (a peer gone during DeepSpeed's own collectives:
    the gradient reduction, the optimizer step, the step's loss) as a ``CollectiveError`` naming
    ``where`` (or what ``where()`` says when it fails) and the other ranks of ``group``, as the
    executor's own collectives do. Give the world group where the block's collectives span
    several groups (the optimizer step's gradient-norm all-reduce runs over the model-parallel
    ranks, its reduction over the data-parallel ones)."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, CollectiveError) or not is_comm_failure(err):
            raise
        raise CollectiveError(where() if callable(where) else where, err, group=group) from err


def _peer_ranks(group) -> str | None:
    """The other global ranks of ``group``, as text ("rank 1", "ranks [1, 2, 3]")."""
    try:
        others = [r for r in dist.get_process_group_ranks(group) if r != dist.get_rank()]
    except Exception:  # noqa: BLE001 -- no group, or no process group at all: say nothing
        return None
    return f"rank {others[0]}" if len(others) == 1 else (f"ranks {others}" if others else None)


def cuda_connections_warning(device: torch.device, env=None) -> str | None:
    """The warning for a CUDA setting that serializes kernels, or None. ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    (Megatron sets it so its TP collectives launch in order) gives all streams one hardware queue:
    a collective's kernel then holds back the compute kernels launched after it."""
    env = os.environ if env is None else env
    if device.type != "cuda" or env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        return None
    return (
        "ds_dhelix: CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream on one hardware queue: a collective's "
        "kernel holds back the compute kernels launched after it, which limits what SI can overlap to the "
        "launch order; unset it (or set 8 or more) for ds_dhelix runs"
    )


@dataclass
class DeviceEvents:
    """CUDA events of one collective, for device-true timing (with NCCL the host never blocks, so
    host wait times say nothing): ``launched`` on the compute stream at launch; at the point the
    result is first needed ``reached``, then the compute stream is made to wait for the collective
    (``work.wait()``, NCCL's own stream ordering, which also keeps its inputs alive until then),
    then ``resumed``. After a synchronize: exposed = reached -> resumed (the time the compute stream
    stalled on it), busy = launched -> resumed (launch to observed completion, as the host measures
    it on CPU: a collective that finished long before it was needed counts until it was needed)."""

    launched: object
    reached: object = None
    resumed: object = None

    @classmethod
    def start(cls) -> DeviceEvents:
        launched = torch.cuda.Event(enable_timing=True)
        launched.record()
        return cls(launched)

    def join(self, work) -> None:
        """The compute stream needs the result now: mark the point, make it wait, mark again."""
        self.reached = torch.cuda.Event(enable_timing=True)
        self.resumed = torch.cuda.Event(enable_timing=True)
        self.reached.record()
        work.wait()
        self.resumed.record()

    def waited_in_full(self) -> DeviceEvents:
        """A collective the compute stream waited on from its launch (a blocking call, such as the
        replicated gradients' all-reduce): reached at launch, resumed now; busy = exposed."""
        self.reached = self.launched
        self.resumed = torch.cuda.Event(enable_timing=True)
        self.resumed.record()
        return self

    def times_s(self) -> tuple[float, float]:
        """(busy, exposed) seconds; call after the device has finished the step."""
        if self.resumed is None:
            return 0.0, 0.0
        return self.launched.elapsed_time(self.resumed) / 1e3, self.reached.elapsed_time(self.resumed) / 1e3


@dataclass
class HostCopy:
    """A small tensor's values on their way to the host (``HostCopies.start``); ``read()`` returns
    them as (nested) Python lists. On CUDA it waits on the copy's event alone, never on the compute
    stream; on CPU the tensor is host memory already."""

    host: torch.Tensor
    event: object = None  # CUDA: recorded on the side stream after the copy

    def read(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class HostCopies:
    """Starts copies of small device tensors (MoE split sizes) to pinned host memory on one side
    stream, so that the host can read them later without draining the compute stream::

        compute stream:  [router] [other strand's ops ..........................]
        NCCL stream:              [counts a2a]
        side stream:                          [D2H]·event
        host:            launch .. launch .. launch ..  event.synchronize, read -> dispatch a2a

    ``start(src, after=work)`` orders the copy after the collective ``work`` that wrote ``src``
    only (``work.wait()`` under the side stream); without ``after``, after the compute stream's
    work queued so far (``src`` was made there). CPU: no stream, no copy; the same calls."""

    def __init__(self):
        self._stream = None  # created on first CUDA use

    def start(self, src: torch.Tensor, after=None) -> HostCopy:
        if not src.is_cuda:
            return HostCopy(src)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=src.device)
        stream, compute = self._stream, torch.cuda.current_stream(src.device)
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            if after is None:
                stream.wait_stream(compute)
            else:
                after.wait()  # NCCL: makes the current (side) stream wait on the collective
            host.copy_(src, non_blocking=True)
            event.record(stream)
        src.record_stream(stream)  # the allocator may not reuse src before the copy has run
        return HostCopy(host, event)


@dataclass
class Pending:
    """An in-flight collective: ``wait()`` blocks until done and returns the output tensor. On CUDA
    ``wait()`` does not block the host: the compute stream waits (``device_events`` time it)."""

    work: object
    out: torch.Tensor
    launched_at: float = field(default_factory=time.perf_counter)
    waited_s: float = 0.0  # time the caller spent blocked in wait()
    done_at: float | None = None  # first time the executor saw it complete
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None  # local epilogue after the wait
    device_events: DeviceEvents | None = None  # CUDA: set at launch

    def __post_init__(self):
        if self.work is not None and self.out.is_cuda and self.device_events is None:
            self.device_events = DeviceEvents.start()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            t0 = time.perf_counter()
            if self.device_events is not None:
                self.device_events.join(self.work)
            else:
                self.work.wait()
            self.waited_s += time.perf_counter() - t0
            self.work = None
            if self.finish is not None:
                self.out, self.finish = self.finish(self.out), None
        return self.out


@dataclass(frozen=True)
class StrandGroups:
    """Two process groups over the same ranks, one per strand of a pair: ``forward`` carries the
    collectives of the forward strand (channel 0), ``backward`` those of the backward strand
    (channel 1). Each group then sees one strand's collectives, in that strand's program order,
    whatever the interleaving, so the reactive executor may follow completions as they happen
    and still issue every group's collectives in the same order on every rank. A pair of two
    strands of one direction (``pair_ends``) sends its second strand to the other channel.

    ``StrandGroups.of(group)`` wraps a single group (both channels on it: not ``separate``)."""

    forward: object
    backward: object

    @classmethod
    def of(cls, group) -> StrandGroups:
        return group if isinstance(group, StrandGroups) else cls(group, group)

    @property
    def separate(self) -> bool:
        """True when the two channels are distinct groups (timing may then reorder the strands)."""
        return self.backward is not self.forward

    def channel(self, index: int):
        """The process group of channel ``index`` (0: forward strand, 1: backward strand)."""
        return self.backward if index else self.forward


class SeqAllGather:
    """COMM op body: all-gather along the sequence forward, reduce-scatter backward. ``channel``
    (given by the executor at each launch) picks the strand group."""

    def __init__(self, groups, world: int):
        self.groups, self.world = StrandGroups.of(groups), world

    @property
    def strand_safe(self) -> bool:
        """Forward and backward collectives on separate groups (see ``StrandGroups``)."""
        return self.groups.separate

    def forward(self, x, side, channel: int = 0) -> Pending:
        return all_gather_seq(x, self.groups.channel(channel), self.world)

    def backward(self, grad, side, channel: int = 1) -> Pending:
        return reduce_scatter_seq(grad, self.groups.channel(channel), self.world)


class SeqReduceScatter(SeqAllGather):
    """COMM op body: reduce-scatter along the sequence forward, all-gather backward."""

    def forward(self, x, side, channel: int = 0) -> Pending:
        return reduce_scatter_seq(x, self.groups.channel(channel), self.world)

    def backward(self, grad, side, channel: int = 1) -> Pending:
        return all_gather_seq(grad, self.groups.channel(channel), self.world)


class TensorAllReduce(SeqAllGather):
    """COMM op body: a sum over the group, forward and backward (each rank's gradient of a summed
    value is the sum of every rank's): for small per-token statistics such as the sum of squares of
    a q/k norm that spans heads held by several TP ranks."""

    def forward(self, x, side, channel: int = 0) -> Pending:
        return all_reduce_sum(x, self.groups.channel(channel))

    def backward(self, grad, side, channel: int = 1) -> Pending:
        return all_reduce_sum(grad, self.groups.channel(channel))


def all_reduce_sum(x: torch.Tensor, group) -> Pending:
    out = x.detach().clone().contiguous()
    return Pending(dist.all_reduce(out, group=group, async_op=True), out)


class ContextAllToAll(SeqAllGather):
    """COMM op body of context parallelism (Ulysses): an all-to-all along dim 0 of a tensor laid
    out ``[cp, ...]``, chunk ``j`` going to CP rank ``j``; the result's chunk ``i`` came from CP rank
    ``i``. The same exchange is its own adjoint, so the backward is the all-to-all of the gradient.
    The COMP ops on either side lay the chunks out (heads by destination before the attention core,
    sequence by destination after it)."""

    lane = "comm:cp"  # trace lane

    def forward(self, x, side, channel: int = 0) -> Pending:
        return all_to_all_chunks(x, self.groups.channel(channel), self.world)

    def backward(self, grad, side, channel: int = 1) -> Pending:
        return all_to_all_chunks(grad, self.groups.channel(channel), self.world)


class RingPass(SeqAllGather):
    """COMM op body of ring attention: one step of the ring. Forward: send this rank's tensor to
    the next CP rank and receive the previous one's (point-to-point, both at once); backward: the
    gradient goes the other way, back to the rank the tensor came from."""

    lane = "comm:cp"  # trace lane
    # gloo's send / receive works say they are complete only once waited for: never polled
    reports_completion = False

    def forward(self, x, side, channel: int = 0) -> Pending:
        return ring_exchange(x, self.groups.channel(channel), self.world, +1)

    def backward(self, grad, side, channel: int = 1) -> Pending:
        return ring_exchange(grad, self.groups.channel(channel), self.world, -1)


class Works:
    """Several in-flight works as one (a send and a receive; the gathers a ZeRO-3 block waits for)."""

    def __init__(self, works):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def ring_exchange(x: torch.Tensor, group, world: int, direction: int) -> Pending:
    """Send ``x`` to the group rank ``direction`` steps on and receive from as many steps back."""
    me = dist.get_rank(group)
    to, frm = (dist.get_global_rank(group, (me + direction * k) % world) for k in (1, -1))
    x = x.contiguous()
    out = torch.empty_like(x)
    # one batch: NCCL needs a send and a receive with the same peer (CP = 2) issued together
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, to, group), dist.P2POp(dist.irecv, out, frm, group)])
    return Pending(Works(works), out)


def all_to_all_chunks(x: torch.Tensor, group, world: int) -> Pending:
    if x.shape[0] != world:
        raise ValueError(f"context-parallel all-to-all of a tensor with {x.shape[0]} chunks on {world} ranks")
    x = x.contiguous()
    out = torch.empty_like(x)
    return Pending(dist.all_to_all_single(out, x, group=group, async_op=True), out)


def _on_gloo(group) -> bool:
    """gloo (CPU): the sequence collectives run as all-to-alls (see the module docstring)."""
    return dist.get_backend(group) == "gloo"


def all_gather_seq(x: torch.Tensor, group, world: int) -> Pending:
    out = torch.empty((x.shape[0] * world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if _on_gloo(group):
        # each rank sends its shard to every rank: rank r's chunk of the result is rank r's shard
        # (gloo's own all-gather costs more per call on CPU; benchmarks/results/README.md)
        work = dist.all_to_all_single(out, torch.cat([x] * world), group=group, async_op=True)
        return Pending(work, out)
    work = _ALL_GATHER(out, x.contiguous(), group=group, async_op=True)
    return Pending(work, out)


def reduce_scatter_seq(x: torch.Tensor, group, world: int) -> Pending:
    if x.shape[0] % world:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor_parallel.size {world}")
    if _on_gloo(group):
        return _reduce_scatter_by_all_to_all(x.contiguous(), group, world)
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _REDUCE_SCATTER(out, x.contiguous(), group=group, async_op=True)
    return Pending(work, out)


def _reduce_scatter_by_all_to_all(x: torch.Tensor, group, world: int) -> Pending:
    """Reduce-scatter as an all-to-all of the shards plus a local sum, in rank order.

    gloo implements reduce-scatter with a full all-reduce, so it moves twice the bytes of an
    all-gather of the result. The all-to-all moves only the (t-1)/t of the tensor that other ranks
    own, like a ring reduce-scatter, and costs what the all-gather costs. The sum runs when the
    result is waited for.
    """
    recv = torch.empty_like(x)
    work = dist.all_to_all_single(recv, x, group=group, async_op=True)

    def finish(buf: torch.Tensor) -> torch.Tensor:
        parts = buf.view(world, x.shape[0] // world, *x.shape[1:])
        acc = parts[0] + parts[1] if world > 1 else parts[0].clone()
        for r in range(2, world):
            acc += parts[r]
        return acc

    return Pending(work, recv, finish=finish)


class ReplicatedGrads:
    """Weights replicated across the TP group but applied to a sequence shard (norms, embeddings,
    LM head, row-parallel biases): each rank's gradient holds only its shard's contribution.

    Their gradients accumulate locally over the micro-batches of a step and are summed over the TP
    group once, by ``all_reduce()`` after the last backward: one coalesced all-reduce per step on its
    own group (``tp_grad_group``), instead of a blocking one per parameter per micro-batch. Sum
    order is fixed, so SI and sequential stay bitwise equal.

    A replicated kv head (``tp_replica_slot`` = (head, heads): its copies live on the ranks of one
    replica group) is summed over its group only: each rank puts its gradient in its head's slot of
    a zero buffer of ``heads`` slots, the buffer is summed over the TP group with the rest, and the
    rank takes its slot back.
    """

    def __init__(self, params, group):
        seen, self.params = set(), []
        for p in params:
            sharded = getattr(p, "tensor_model_parallel", False) and getattr(p, "tp_replica_slot", None) is None
            if p is None or id(p) in seen or sharded:
                continue
            seen.add(id(p))
            p.tp_replicated = True
            self.params.append(p)
        self.group = group

    def equalize(self, among=None) -> None:
        """Make every rank's copy its group's first holder's (TP rank 0; for a replicated kv head, the
        first rank of its replica group): DeepSpeed broadcasts the model over data-parallel ranks only,
        and weights drawn per process (a PEFT adapter made without a seed, a model built from its
        config) would otherwise train a different copy on each TP rank. ``among``: ids of the
        parameters this rank holds (a pipeline stage's), default all."""
        first = dist.get_rank(self.group) == 0
        by_dtype: dict = {}
        for p in self.params:
            if among is None or id(p) in among:
                by_dtype.setdefault(p.dtype, []).append(p)
        for params in by_dtype.values():
            parts = []
            for p in params:
                slot = getattr(p, "tp_replica_slot", None)
                mine = p.tensor_model_parallel if slot else first  # the holder whose copy every rank takes
                data = p.data.reshape(-1) if mine else torch.zeros_like(p.data).reshape(-1)
                if slot:
                    data = _in_slot(data, slot).reshape(-1)
                parts.append(data)
            flat = torch.cat(parts)
            dist.all_reduce(flat, group=self.group)  # one holder's copy plus zeros: that copy, exactly
            offset = 0
            for p in params:
                slot = getattr(p, "tp_replica_slot", None)
                size = p.numel() * (slot[1] if slot else 1)
                part = flat[offset : offset + size]
                with torch.no_grad():
                    p.copy_((part.view(slot[1], -1)[slot[0]] if slot else part).view_as(p))
                offset += size

    def all_reduce(self, grad_of=None) -> int:
        """Sum the accumulated gradients over the group in place; returns the bytes reduced.
        ``grad_of(p)``: where ``p``'s gradient is (default ``p.grad``; ZeRO-3: its partition)."""
        grad_of = grad_of or (lambda p: p.grad)
        by_dtype: dict = {}
        for p in self.params:
            if (g := grad_of(p)) is not None:
                by_dtype.setdefault(g.dtype, []).append((p, g))
        total = 0
        for pairs in by_dtype.values():
            flat = torch.cat([_slotted(p, g).reshape(-1) for p, g in pairs])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for p, g in pairs:
                slot = getattr(p, "tp_replica_slot", None)
                size = g.numel() * (slot[1] if slot else 1)
                part = flat[offset : offset + size]
                g.copy_((part.view(slot[1], -1)[slot[0]] if slot else part).view_as(g))
                offset += size
            total += flat.numel() * flat.element_size()
        return total


def _slotted(p, grad: torch.Tensor) -> torch.Tensor:
    """``grad``, or for a replicated kv head ``p`` its gradient in its slot of a zero buffer."""
    slot = getattr(p, "tp_replica_slot", None)
    if slot is None:
        return grad
    return _in_slot(grad.reshape(-1), slot)


def _in_slot(flat: torch.Tensor, slot: tuple) -> torch.Tensor:
    """``flat`` in row ``slot[0]`` of a zero buffer of ``slot[1]`` rows."""
    buf = flat.new_zeros(slot[1], flat.numel())
    buf[slot[0]] = flat
    return buf


SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"
"""DeepSpeed's CPU all-reduce buffers in /dev/shm: ``<prefix>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``."""


def release_deepspeed_shm() -> None:
    """Unlink this rank's DeepSpeed shared-memory all-reduce buffer name; collective (a barrier).

    On CPU with every rank on one machine, ``deepspeed.init_distributed`` maps a ~69 MB file per
    rank in /dev/shm (RAM), named by MASTER_ADDR and MASTER_PORT, and DeepSpeed never unlinks it:
    each run on another port leaves world x 69 MB of memory behind until reboot. Once every rank
    has mapped its peers' files (they have when init returned on all of them: the barrier), each
    rank unlinks its own name; the mappings stay valid until the process ends."""
    if not dist.is_initialized():
        return
    dist.barrier()
    name = (
        f"{SHM_BUFFER_PREFIX}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}"
    )
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass  # no shm op (GPU, ranks on several machines) or already released
