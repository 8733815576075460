"""ZeRO-3 under the op graph: each block's parameter gathers and gradient reduce-scatters as COMM ops.

DeepSpeed's ZeRO-3 gathers a module's parameters in forward / backward module hooks and reduces
their gradients in hooks on the parameters. The op graph calls weights directly, from its own
ops, and runs two micro-batches' strands interleaved, so those hooks would fire in an order its
prefetcher never saw (or never fire). Here DeepSpeed stays the owner of the partitioned
parameters (``ds_tensor``, ``ds_status``, ``partition()``), of the gradient partitions
(``partition_grads``), of the optimizer state and the checkpoint format; its module and gradient
hooks are removed, and every block of the op graph gains two COMM ops that carry no tensor::

    block b:  [z3.in] op op ... op [z3.out]

    op       forward                              backward (the block's ops reversed)
    z3.in    gather b's parameters                reduce-scatter b's gradients of this
             (prefetch b+1's)                     micro-batch; release b
    z3.out   release b (kept while recomputing)   gather b's parameters (prefetch b-1's)

The executor launches them like TP's collectives, so SI pairs one strand's gathers and
reduce-scatters with the other strand's compute. A parameter is gathered while any (block,
micro-batch) holds it and released when the last lets go: the two strands share one gathered
copy. Live gathered blocks: the held one and ``prefetch`` ahead per strand, i.e. about four
blocks' parameters beside the partitions at the default prefetch 1 (``Zero3Blocks.peak_gathered``);
a prefetch is skipped where it would take the gathered elements past ``max_live`` (DeepSpeed's
``stage3_max_live_parameters``; the blocks a strand runs are always gathered).

Expert shards (expert parallelism) are partitioned over their expert-data-parallel group, the
rest over the data-parallel group (DeepSpeed's placement: ``ds_zero_placement_family``); gathers
and reduce-scatters go per partition group.

Gradients: each micro-batch's block gradients are averaged (experts' by the whole data-parallel
size, DeepSpeed's convention) and reduce-scattered, in one collective per block, into DeepSpeed's partitions (copied the first time a
parameter is reduced in a step, added after), the way its own hooks do per bucket. Bitwise SI =
sequential follows: the gathers copy, the reduction of one parameter's micro-batches keeps their
order, and every rank launches the same collectives in the same order (the bodies are not
strand-safe, so the executor never reorders the strands by timing).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

import torch
import torch.distributed as dist

from ..config.ds_settings import ZEROPP_KEYS, ZeroSettings
from ..graph.model_graph import Op
from ..graph.ops import OpKind
from ..runtime.comm import Pending, Works, all_gather_seq, reduce_scatter_seq

IN, OUT = "z3.in", "z3.out"


@contextlib.contextmanager
def gathered(p):
    """Inside: ZeRO-3 parameter ``p`` whole (DeepSpeed's ``GatheredParameters``, read-only); yields
    whether it was partitioned. Any other parameter as it is."""
    if getattr(p, "ds_id", None) is None or _available(p):
        yield False
        return
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters([p]):
        yield True


def _available(p) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return p.ds_status == ZeroParamStatus.AVAILABLE


class _InFlight:
    """A ZeRO-3 collective of one partition group in flight (a group of one rank launches none).
    ``is_completed`` notes when it was first seen done (``Zero3Blocks.poll``); ``wait()`` joins it
    once, adds its span (launch to first seen done) to ``spans``, and ``_land`` hands the result on."""

    def __init__(self, params: list, spans: list):
        self.params, self.spans, self.done = params, spans, False
        self.world = dist.get_world_size(params[0].ds_process_group)
        self.launched_at, self.seen_done_at = time.perf_counter(), None

    def _launch(self, collective, flat: torch.Tensor) -> None:
        group = self.params[0].ds_process_group
        self.pending = collective(flat, group, self.world) if self.world > 1 else Pending(None, flat)

    def is_completed(self) -> bool:
        done = self.done or self.pending.work is None or self.pending.work.is_completed()
        if done and self.seen_done_at is None:
            self.seen_done_at = time.perf_counter()
        return done

    def wait(self) -> None:
        if self.done:
            return
        out = self.pending.wait()
        self.spans.append((self.launched_at, self.seen_done_at or time.perf_counter()))
        self._land(out)
        self.done = True

    def _land(self, out: torch.Tensor) -> None:
        raise NotImplementedError


class _Gather(_InFlight):
    """A gather of parameters of one partition group; ``wait()`` sets their data."""

    def __init__(self, params: list, spans: list, storages: dict, device):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        super().__init__(params, spans)
        self.storages = storages
        # (an offloaded partition is on the host: copied to the device the model runs on first)
        self._launch(all_gather_seq, torch.cat([p.ds_tensor.reshape(-1) for p in params]).to(device, non_blocking=True))
        for p in params:
            p.ds_status = ZeroParamStatus.INFLIGHT

    def _land(self, out: torch.Tensor) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        rows, offset = out.view(self.world, -1), 0
        for p in self.params:
            part = p.ds_tensor.numel()
            full = rows[:, offset : offset + part].reshape(-1)[: p.ds_numel]
            if self.world == 1:
                # one rank's slice is a view of ``out``: a storage of its own for each parameter (the
                # activation meter finds a saved view's parameter by its storage); over more ranks
                # the reshape copies anyway
                full = full.clone()
            p.data = full.view(p.ds_shape)
            p.ds_status = ZeroParamStatus.AVAILABLE
            if not p.ds_persist:  # (a persistent one stays whole; DeepSpeed gathers it anew after each step)
                self.storages[p.data.untyped_storage().data_ptr()] = p
            offset += part


class Zero3Blocks:
    """Which parameters each op-graph block uses, who holds them gathered, and the launches.

    ``gathered[b]``: the parameters block ``b``'s ops read (every one, frozen too); ``reduced[b]``:
    the trained ones whose gradients are final after block ``b``'s backward (a parameter two blocks
    use, a tied embedding, is reduced after the lower block, the last its backward reaches)."""

    IN_FLIGHT_REDUCES = 2  # block reductions a strand leaves behind it (each holds a block's gradients)

    def __init__(self, optimizer, gathered: list[list], prefetch: int = 1, max_live: float = float("inf")):
        self.optimizer, self.gathered, self.prefetch, self.max_live = optimizer, gathered, prefetch, max_live
        from deepspeed.accelerator import get_accelerator

        self.device = torch.device(get_accelerator().current_device_name())  # where the model runs
        owner: dict = {}  # id(param) -> the lowest block using it
        for b in range(len(gathered) - 1, -1, -1):
            for p in gathered[b]:
                owner[id(p)] = b
        self.reduced = [
            [p for p in params if p.requires_grad and owner[id(p)] == b] for b, params in enumerate(gathered)
        ]
        self._holds: set = set()  # (block, holder)
        self._count: dict = {}  # id(param) -> holds
        self._inflight: dict = {}  # id(param) -> _Gather
        self._reduced_this_step: set = set()
        # storage of each gathered copy -> its parameter: the activation meter keeps saved views of
        # them as layouts, so a released block's copy is freed (``memory._Regathered``)
        self.storages: dict = {}
        self._reducing: deque = deque()  # reductions in flight, in launch order
        # each gather's and reduction's (launch, first seen complete); the z3 ops' own Pendings count
        # only their waits (``times_itself``): ``comm_s`` is the time any of them was in flight
        self._spans: list = []
        self.waited_s = 0.0  # the step's waits on reductions joined outside a z3 op
        self._live = 0  # parameter elements gathered or in flight now (persistent ones not counted)
        self.peak_gathered = 0  # the most at once

    # ------------------------------------------------------------------ gathers
    def acquire(self, block: int, holder, direction: int) -> Pending:
        """Hold ``block``'s parameters for ``holder``; the Pending completes when they are in.
        ``direction`` +1 forward, -1 backward: the block prefetched next."""
        gathers = []
        if (block, holder) not in self._holds:
            self._holds.add((block, holder))
            for p in self.gathered[block]:
                self._count[id(p)] = self._count.get(id(p), 0) + 1
            gathers = self._launch(self.gathered[block])
        for k in range(1, self.prefetch + 1):  # ahead, while the gathered elements stay within max_live
            ahead = block + direction * k
            if not 0 <= ahead < len(self.gathered) or self._live + self._missing(ahead) > self.max_live:
                break
            self._launch(self.gathered[ahead])
        if not gathers:
            return Pending(None, self._marker())
        return Pending(Works(gathers), self._marker())  # (every gather the block's parameters are in)

    def _missing(self, block: int) -> int:
        """Elements a gather of ``block`` would add (its partitioned parameters not whole or in flight)."""
        params = self.gathered[block]
        return sum(p.ds_numel for p in params if not p.ds_persist and not _available(p) and id(p) not in self._inflight)

    def _launch(self, params) -> list:
        """Gathers for ``params``: in flight already, or launched now (per partition group)."""
        gathers, todo = [], {}
        for p in params:
            g = self._inflight.get(id(p))
            if g is not None and not g.done:
                gathers.append(g)
            elif not _available(p) and id(p) not in self._inflight:
                todo.setdefault(id(p.ds_process_group), []).append(p)
        for params_of_group in todo.values():
            params_of_group.sort(key=lambda p: p.ds_id)
            g = _Gather(params_of_group, self._spans, self.storages, self.device)
            for p in params_of_group:
                self._inflight[id(p)] = g
            gathers.append(g)
            self._live += sum(p.ds_numel for p in params_of_group if not p.ds_persist)
        self.peak_gathered = max(self.peak_gathered, self._live)
        return list({id(g): g for g in gathers}.values())

    def release(self, block: int, holder) -> None:
        """``holder`` lets go of ``block``; parameters nobody holds are partitioned again."""
        if (block, holder) not in self._holds:
            return
        self._holds.discard((block, holder))
        free = []
        for p in self.gathered[block]:
            self._count[id(p)] -= 1
            if self._count[id(p)] == 0:
                free.append(p)
        self._free(free)

    def _free(self, params) -> None:
        for p in params:
            g = self._inflight.pop(id(p), None)
            if g is not None:
                g.wait()  # (a prefetch nobody claimed yet)
            if not p.ds_persist and _available(p):
                self.storages.pop(p.data.untyped_storage().data_ptr(), None)
                p.partition()
                self._live -= p.ds_numel

    def release_all(self) -> None:
        """Partition every parameter still gathered (prefetches nobody claimed, an aborted step);
        reductions still in flight are joined first."""
        self.drain()
        self._holds.clear()
        self._count.clear()
        self._free([p for params in self.gathered for p in params])

    def _marker(self) -> torch.Tensor:
        return torch.empty(0, device=self.device)

    # ------------------------------------------------------------------ gradients
    def reduce(self, block: int) -> Pending:
        """Launch the reduce-scatter of ``block``'s gradients of the micro-batch whose backward just
        ran it (per partition group). The strand goes on at once: the reduction is joined later, in
        launch order (so each parameter's micro-batches reach DeepSpeed's partitions in order), when
        more than ``IN_FLIGHT_REDUCES`` are in flight or at the step's end (``drain``)."""
        by_group: dict = {}
        for p in self.reduced[block]:
            by_group.setdefault(id(p.ds_process_group), []).append(p)
        self._reducing.extend(_Reduce(self, sorted(ps, key=lambda p: p.ds_id)) for ps in by_group.values())
        while len(self._reducing) > self.IN_FLIGHT_REDUCES:
            self._join(self._reducing.popleft())
        return Pending(None, self._marker())

    def drain(self) -> None:
        """Join every reduction still in flight (the step's end)."""
        while self._reducing:
            self._join(self._reducing.popleft())

    def _join(self, work: _Reduce) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.waited_s += time.perf_counter() - t0

    def poll(self) -> None:
        """Note which collectives in flight have completed (their time ends there); each z3 op
        calls it, so a reduction joined later is not timed up to its join."""
        for work in self._reducing:
            work.is_completed()
        for g in self._inflight.values():
            g.is_completed()

    def grad_partition(self, p):
        """This rank's partition of ``p``'s step gradient in DeepSpeed's buffers (None: not trained)."""
        if not p.requires_grad:
            return None
        return self.optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition[p.ds_id]

    def begin_step(self) -> None:
        self._reduced_this_step.clear()
        self._spans.clear()  # (in place: the collectives in flight hold the list)
        self.waited_s = 0.0

    def comm_s(self) -> float:
        """The step's ZeRO-3 communication time: how long any of its collectives was in flight (one
        link carries them in order, so their own intervals overlap)."""
        total, end = 0.0, float("-inf")
        for start, stop in sorted(self._spans):
            if stop > end:
                total += stop - max(start, end)
                end = stop
        return total

    def unreduced(self) -> list:
        """Trained parameters no micro-batch of this step reduced (an expert no token reached)."""
        return [p for params in self.reduced for p in params if id(p) not in self._reduced_this_step]


class _Reduce(_InFlight):
    """One block's gradients of one partition group, averaged and reduce-scattered; ``wait()``
    hands each rank's partitions to DeepSpeed (``partition_grads``)."""

    def __init__(self, owner: Zero3Blocks, params: list):
        super().__init__(params, owner._spans)
        self.owner = owner
        rows = []
        for p in params:
            part = p.ds_tensor.numel()
            g = p.grad if p.grad is not None else torch.zeros(p.ds_shape, dtype=p.dtype, device=owner.device)
            flat = torch.zeros(self.world * part, dtype=g.dtype, device=g.device)
            flat[: p.ds_numel] = g.reshape(-1)
            rows.append(flat.view(self.world, part))
            p.grad = None
        buf = torch.cat(rows, dim=1)
        buf.div_(owner.optimizer._gradient_averaging_world_size(params, self.world))
        self._launch(reduce_scatter_seq, buf.reshape(-1))

    def _land(self, mine: torch.Tensor) -> None:
        opt, seen = self.owner.optimizer, self.owner._reduced_this_step
        parts, offset = [], 0
        for p in self.params:
            n = p.ds_tensor.numel()
            parts.append(mine[offset : offset + n].to(opt.gradient_accumulation_dtype))
            offset += n
        first = [i for i, p in enumerate(self.params) if id(p) not in seen]
        again = [i for i, p in enumerate(self.params) if id(p) in seen]
        for ids, step in ((first, 0), (again, 1)):  # copy into the partition, or add to it
            if ids:
                opt.micro_step_id = step
                opt.partition_grads([self.params[i] for i in ids], [parts[i] for i in ids])
        seen.update(id(p) for p in self.params)


class _Body:
    """COMM body of ``z3.in`` (``first``) or ``z3.out`` of one block: see the module docstring."""

    strand_safe = False  # one partition group for both strands: the launch order is the plan's
    lane = "comm:zero3"
    times_itself = True  # a gather may serve several ops (prefetched, shared): ``Zero3Blocks.comm_s`` times it

    def __init__(self, blocks: Zero3Blocks, block: int, first: bool):
        self.blocks, self.block, self.first = blocks, block, first

    def forward(self, x, side, channel: int = 0) -> Pending:
        self.blocks.poll()
        holder = id(side)
        if self.first:
            return self.blocks.acquire(self.block, holder, +1)
        if not side.get("recomputing"):  # a recomputed block stays gathered for its backward
            self.blocks.release(self.block, holder)
        return Pending(None, self.blocks._marker())

    def backward(self, grad, side, channel: int = 1) -> Pending:
        self.blocks.poll()
        holder = id(side)
        if not self.first:
            return self.blocks.acquire(self.block, holder, -1)
        pending = self.blocks.reduce(self.block)
        self.blocks.release(self.block, holder)
        return pending


def add_zero3_ops(graph, blocks: Zero3Blocks) -> None:
    """Put ``z3.in`` / ``z3.out`` around every block of ``graph`` (in place)."""
    for b, ops in enumerate(graph.blocks):
        if ops and ops[0].name == IN:
            continue
        graph.blocks[b] = [
            Op(IN, OpKind.COMM, (), (), comm=_Body(blocks, b, True)),
            *ops,
            Op(OUT, OpKind.COMM, (), (), comm=_Body(blocks, b, False)),
        ]


def block_parameters(model, graph) -> list[list]:
    """The parameters each block of ``graph`` reads: block 0 the input embeddings (and any other
    embedding outside the decoder layers), block i+1 decoder layer i, the last block everything
    else (final norm, head; a tied head's weight is the embedding's)."""
    layers = _decoder_layers(model, graph.num_layers)
    in_layer = {id(p): i + 1 for i, layer in enumerate(layers) for p in layer.parameters()}
    embeds = {id(p) for p in model.get_input_embeddings().parameters()}
    blocks: list[list] = [[] for _ in graph.blocks]
    for name, p in model.named_parameters():
        if id(p) in in_layer:
            blocks[in_layer[id(p)]].append(p)
        elif id(p) in embeds or "emb" in name.rsplit(".", 2)[-2] or ".wpe." in f".{name}":
            blocks[0].append(p)
        else:
            blocks[-1].append(p)
    head = model.get_output_embeddings()
    for p in head.parameters() if head is not None else ():
        if id(p) not in {id(q) for q in blocks[-1]}:
            blocks[-1].append(p)
    return blocks


def _decoder_layers(model, num_layers: int):
    best = None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            size = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, module)
    if best is None:
        raise ValueError(f"ZeRO-3: no list of {num_layers} decoder layers in {type(model).__name__}")
    return best[1]


NOT_YET = ZEROPP_KEYS
"""Stage-3 keys the op graph's gathers and reduce-scatters do not carry out yet: refused when on."""

OWN_SCHEDULE_KEYS = (
    "stage3_prefetch_bucket_size",
    "stage3_max_reuse_distance",
    "reduce_bucket_size",
    "overlap_comm",
)
"""DeepSpeed's stage-3 prefetch and bucket keys: under dhelix every block's gathers and reduce-scatters
are op-graph collectives (``dhelix.zero3_prefetch``), so these do nothing; said once."""


def check_zero3(zero: ZeroSettings, dh) -> list[str]:
    """What ``zero_optimization`` at stage 3 with dhelix cannot have (``ValueError`` naming the key
    and the fix), and the warnings for keys that do nothing here."""
    if dh.pipeline.stages > 1:
        raise ValueError(
            f"zero_optimization.stage = 3 with dhelix.pipeline.stages = {dh.pipeline.stages}: the folded "
            f"pipeline does not gather ZeRO-3 partitions yet; use stage 0 or 1 (each stage holds only its "
            f"layers already), or one stage"
        )
    if zero.zeropp_on:
        key = zero.zeropp_on[0]
        raise ValueError(
            f"zero_optimization.{key} = {zero.written[key]!r} ({NOT_YET[key]}) with dhelix at stage 3 is not "
            f"supported yet; remove it (or use stage 2)"
        )
    for key, device in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        if device not in ("none", "cpu"):
            raise ValueError(
                f"zero_optimization.{key}.device = {device!r} with dhelix at stage 3 is not supported yet; "
                f'use "cpu" (or no offload)'
            )
    warnings = []
    given = [k for k in OWN_SCHEDULE_KEYS if k in zero.written]
    if given:
        warnings.append(
            f"ds_dhelix: zero_optimization.{', '.join(given)} do nothing with dhelix at stage 3: each block's "
            f"gathers and reduce-scatters are op-graph collectives, prefetched dhelix.zero3_prefetch blocks "
            f"ahead ({dh.zero3_prefetch}), one reduce-scatter per block and micro-batch"
        )
    if zero.written.get("stage3_gather_16bit_weights_on_model_save") is False:
        warnings.append(
            "ds_dhelix: zero_optimization.stage3_gather_16bit_weights_on_model_save = false: the HF export "
            "(train.py's output, DhelixTrainer.save_model) still writes the weights, gathered one tensor at a "
            "time (never more than one whole tensor in memory); DeepSpeed's checkpoints hold the partitions"
        )
    return warnings
