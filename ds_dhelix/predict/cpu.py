"""Op times of a CPU gloo world from this machine's overlap table (``dhelix profile``) and an
emulated link, for checking the predictor against ``dhelix bench`` here.

    compute    each layer op's forward and backward: the table's single-op entries; the embedding
               and head ops: the table's ``block_ops``; a linear op's backward is cut into input
               and weight gradient by their FLOPs (``roofline``), as reactive SI defers the latter
    links      all ranks' traffic shares one loopback shaped to G Gbit/s (``runtime.linkemu``): a
               collective moves the bytes every rank sends at once, through G; gloo's own cost of
               it (copies, TCP on the same cores) is its unshaped time from the table, which the
               wire time hides when longer: ``max(table, bytes / G)``. Collectives the table does
               not hold (the step's gradient all-reduces) move at the rate the table's collectives
               reached unshaped, or G when slower
    slowdown   a collective takes CPU from the cores (gloo's threads, the kernel's TCP work): the
               table's ``comm_cpu_ms``, measured while each COMM op ran alone. Compute beside
               collectives runs slower by that CPU time over the collectives' time: behind a
               shaped link the same CPU work spreads over a longer collective, and slows less

Plain data.
"""

from __future__ import annotations

import statistics

from ..planning.planner import OverlapTable
from .costs import OpTime, StepTimes, block_context, overlap_dp_grads, rank_params
from .hardware import presets
from .roofline import OpWork, line_work
from .shapes import ModelOutline, ModelShape, RunLayout

CPU_STREAM_GBS = 5.0
"""Bytes/s one core streams through the optimizer's update (an assumption: order of magnitude of
one core's memory bandwidth; the update is under 1% of a tiny model's step here)."""
SENT = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "all_reduce": 2.0}
"""Each rank sends this many times (n-1)/n of the buffer (gloo: all-gather and reduce-scatter as
all-to-alls, all-reduce as reduce-scatter then all-gather)."""


def world_bytes(kind: str, n: int, nbytes: float, world: int) -> float:
    """Bytes all ranks put on the shared link for one collective of ``kind`` over groups of ``n``."""
    return world * SENT[kind] * (n - 1) / n * nbytes if n > 1 else 0.0


def check_table(table: OverlapTable, outline: ModelOutline, layout: RunLayout, link_gbps) -> None:
    """ValueError naming what differs between the table and this prediction, with the fix."""
    d = layout.dims
    want = f"world={d.world},tp={d.tp},ep={d.ep}" + (f",cp={d.cp}" if d.cp > 1 else "")
    have = {
        "layout": table.meta.get("layout"),
        "batch_shape": table.meta.get("batch_shape"),
        "dtype": table.meta.get("dtype"),
    }
    expect = {"layout": want, "batch_shape": [layout.micro_batch_size, layout.seq_len], "dtype": "float32"}
    diffs = [f"{k}: table {have[k]!r}, prediction {expect[k]!r}" for k in expect if have[k] != expect[k]]
    if layout.dtype != "fp32":
        diffs.append(f"dtype: the CPU check runs fp32, got --dtype {layout.dtype}")
    fused = outline.fused
    if table.fused != fused:
        diffs.append(
            "ops: the table timed "
            + (
                "fused runs (dhelix.fuse_ops), predict was asked for the ops one by one (--unfused)"
                if table.fused
                else "the ops one by one (--unfused), predict prices fused runs (add --unfused)"
            )
        )
    layers = {tuple(op.name for op in ops) for ops in outline.blocks[1:-1]}
    if layers != {tuple(op.name for op in table.fwd_ops)}:
        diffs.append(f"layer ops: table {[o.name for o in table.fwd_ops]}, model {sorted(layers)}")
    if not table.block_ops:
        diffs.append("the table has no embedding/head op times (profiled before they were kept): profile again")
    if table.meta.get("link_gbps") not in (None, link_gbps):
        diffs.append(
            f"link: table profiled at {table.meta.get('link_gbps')} Gbit/s, predicting {link_gbps}; "
            f"profile unshaped (no --link-gbps) to predict any rate"
        )
    if diffs:
        raise ValueError(
            "overlap table does not fit this prediction: "
            + "; ".join(diffs)
            + f". Profile it with dhelix profile --model ... --tp {d.tp} --ep {d.ep} --micro-batch-size "
            f"{layout.micro_batch_size} --seq-len {layout.seq_len}" + (" --unfused" if not fused else "")
        )


def _wgrad_share(work: OpWork) -> float:
    """Share of a linear op's backward FLOPs that is its weight gradient."""
    dx, dw = sum(k.flops for k in work.bwd), sum(k.flops for k in work.wgrad)
    return dw / (dx + dw) if dx + dw else 0.0


def _layer_ms(table: OverlapTable) -> tuple[list[float], list[float]]:
    """(forward ms, backward ms) of each layer op alone, in forward op order."""
    n = len(table.fwd_ops)
    fwd = [table.fwd_alone_ms[(i, i + 1)] for i in range(n)]
    bwd = [table.bwd_alone_ms[(n - 1 - i, n - i)] for i in range(n)]
    return fwd, bwd


class _Link:
    """The emulated link: ``gbps`` (None: unshaped) and the rate gloo reached unshaped."""

    def __init__(self, gbps, unshaped_bps: float, world: int):
        self.bps = None if gbps is None else gbps * 1e9 / 8
        self.unshaped_bps, self.world = unshaped_bps, world

    def op_ms(self, table_ms: float, kind: str, n: int, nbytes: float) -> float:
        wire = world_bytes(kind, n, nbytes, self.world) / self.bps * 1e3 if self.bps else 0.0
        return max(table_ms, wire)

    def other_ms(self, kind: str, n: int, nbytes: float) -> float:
        size = world_bytes(kind, n, nbytes, self.world)
        rate = min(self.unshaped_bps, self.bps) if self.bps else self.unshaped_bps
        return size / rate * 1e3 if size else 0.0


def _group_size(layout: RunLayout, group: str) -> int:
    return {"tp": layout.dims.tp, "cp": layout.dims.cp, "ep": layout.dims.ep}[group]


def _unshaped_bps(table: OverlapTable, works: list[OpWork], layout: RunLayout) -> float:
    """The rate (bytes/s on the shared link) the table's collectives reached: the median entry's."""
    fwd, bwd = _layer_ms(table)
    rates = []
    for i, work in enumerate(works):
        if work.comm is not None:
            c = work.comm
            size = world_bytes(c.fwd, _group_size(layout, c.group), c.nbytes, layout.dims.world)
            rates += [size / (ms / 1e3) for ms in (fwd[i], bwd[i]) if ms > 0 and size > 0]
    if not rates:
        raise ValueError("the table's layer has no collective: nothing to predict a link for (use TP, EP or CP > 1)")
    return statistics.median(rates)


def comm_cpu_per_collective(table: OverlapTable) -> float:
    """ms of CPU one collective takes from the cores (gloo's threads, the kernel's TCP work): the
    median over the layer's collectives of the table's ``comm_cpu_ms`` (robust to one rank's
    outlier run)."""
    values = [ms for d in ("fwd", "bwd") for ms in table.comm_cpu_ms.get(d, ()) if ms is not None]
    if not values:
        raise ValueError(
            "the overlap table has no CPU time of its collectives (profiled before it was kept): profile again"
        )
    return statistics.median(values)


def _block_ms(table: OverlapTable, outline: ModelOutline, b: int) -> tuple[list[float], list[float]]:
    """(forward, backward) ms of block ``b``'s ops from the table."""
    if 0 < b < len(outline.blocks) - 1:
        return _layer_ms(table)
    entry = table.block_ops["pre" if b == 0 else "post"]
    names = [op.name for op in outline.blocks[b]]
    if entry["ops"] != names:
        raise ValueError(f"table block_ops {entry['ops']} differ from the model's block {names}: profile again")
    return entry["fwd_ms"], entry["bwd_ms"]


def table_times(
    table: OverlapTable, outline: ModelOutline, shape: ModelShape, layout: RunLayout, link_gbps: float | None
) -> StepTimes:
    """``StepTimes`` of a CPU gloo world behind a ``link_gbps`` link (None: unshaped), from
    ``table`` (see the module docstring)."""
    check_table(table, outline, layout, link_gbps)
    main = 1
    works = [line_work(op, block_context(shape, layout, outline, main)) for op in outline.blocks[main]]
    link = _Link(link_gbps, _unshaped_bps(table, works, layout), layout.dims.world)
    blocks, shaped, count = [], 0.0, 0
    for b, ops in enumerate(outline.blocks):
        ctx = block_context(shape, layout, outline, b)
        fwd, bwd = _block_ms(table, outline, b)
        row = []
        for op, f_ms, b_ms in zip(ops, fwd, bwd):
            work = line_work(op, ctx)
            if work.comm is not None:
                c, n = work.comm, _group_size(layout, work.comm.group)
                f2, b2 = link.op_ms(f_ms, c.fwd, n, c.nbytes), link.op_ms(b_ms, c.bwd, n, c.nbytes)
                shaped, count = shaped + f2 + b2, count + 2
                row.append(OpTime(op.name, True, f2, b2, group=c.group, link="lo"))
            else:
                share = _wgrad_share(work) if op.linear else 0.0
                row.append(OpTime(op.name, False, f_ms, b_ms * (1 - share), b_ms * share, linear=op.linear))
        blocks.append(tuple(row))
    per = comm_cpu_per_collective(table)
    q = min(per * count / shaped, 0.9) if shaped else 0.0
    notes = {
        "comm_cpu_ms_per_collective": per,
        "slowdown": q / (1 - q),
        "unshaped_link_gbps": link.unshaped_bps * 8 / 1e9,
        "cpu_stream_gbs": CPU_STREAM_GBS,
    }
    tail, dp_notes = overlap_dp_grads(cpu_tail(shape, outline, layout, link), blocks, shape, outline, layout)
    return StepTimes(tuple(blocks), tail, 0.0, q / (1 - q), reacts=True, notes={**notes, **dp_notes})


def cpu_tail(shape: ModelShape, outline: ModelOutline, layout: RunLayout, link: _Link) -> dict:
    """What a CPU step adds once: the TP-replicated and data-parallel gradient all-reduces over
    the shared link, and the optimizer's update (``CPU_STREAM_GBS``)."""
    p, d = rank_params(shape, outline, layout), layout.dims
    dense, e = p.sharded + p.replicated, layout.bytes
    edp = d.dp // d.ep * d.cp
    shards = (d.dp * d.cp, edp) if layout.zero_stage else (1, 1)
    return {
        "tp_grads": link.other_ms("all_reduce", d.tp, p.replicated * e),
        "dp_grads": link.other_ms("all_reduce", d.dp * d.cp, dense * e)
        + link.other_ms("all_reduce", edp, p.experts * e),
        "optimizer": (dense / shards[0] + p.experts / shards[1])
        * presets()["assumptions"]["optimizer_bytes_per_param"]
        / (CPU_STREAM_GBS * 1e9)
        * 1e3,
    }
