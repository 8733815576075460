"""Operator overlap profiling: time segments of one decoder layer alone and co-executed, in place.

A ``LayerProbe`` holds two micro-batches at one decoder layer: the forward strand at the layer's
input and the backward strand with the layer's forward done and a gradient waiting at its output.
To time a forward segment [a, b) with a backward segment [c, d) it runs ops before a and c
untimed, times ``Executor.run_round`` over the two segments (barrier included), then runs the rest
untimed, so every measurement is the real executor on real shapes, groups and devices.
(``profile_runs.py`` runs the profiler and the plan validation on a CPU gloo world.)

All ranks run the same measurements in the same order (the collectives match); each entry is the
median over repeats, then the max over ranks, so every rank holds the same table and plans alike.

A profile runs in three passes (``profile_layer``), all choices made from world-reduced numbers so
every rank re-measures the same entries in the same order:

    1. every entry: ``warmup`` untimed runs, ``repeats`` timed (median, robust spread)
    2. noisy entries: whose median's standard error exceeds ``NOISE_TARGET`` of the median get
       ``repeats`` more runs, pass after pass, within ``NOISE_BUDGET`` x the first pass's time
    3. the plan's own entries: the DP plan (noise-aware, ``planner.plan_dp``) has every entry it is
       priced from re-measured with ``repeats`` more runs, interleaved, and the plan re-searched,
       until it comes out the same twice, or once with none of its entries noisy (at most
       ``REFINE_ROUNDS`` times):
       a pair that won by lucky samples is measured again before the plan is kept
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from ..graph.ops import backward_order
from ..planning.plan import segment_has_comm
from ..planning.planner import EMPTY, OverlapTable, candidate_segments, plan_dp
from .executor import Executor, MicroBatch


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu:{platform.machine()}:{os.cpu_count()}cores:{torch.get_num_threads()}threads"


OP_GRAPH_REVISION = 2
"""Bumped when the adapters move math from one op to another (2: rotary moved from ``attn.qkv`` to
``attn.core``, the MLP activation from ``mlp.up`` to ``mlp.down``): op names stay, their times
change, so tables cached before no longer apply."""


def op_graph_key(fused: bool):
    """A table's ``op_graph``: the revision, with ``+fused`` when its ops ran as fused runs
    (``dhelix.fuse_ops``: other op names, other times; ``OverlapTable.fused``); tables of either
    kind stay valid."""
    return f"{OP_GRAPH_REVISION}+fused" if fused else OP_GRAPH_REVISION


def run_meta(
    model_config,
    tp: int,
    world: int,
    batch_shape,
    dtype,
    link_gbps=None,
    ep: int = 1,
    cp: int = 1,
    cp_comm: str = "ulysses",
    fused: bool = True,
) -> dict:
    """What a table is keyed by: device, model shape, dtype, parallel layout, batch shape, link,
    op-graph revision (and whether its ops ran fused)."""
    c = model_config
    shape = {
        k: getattr(c, k, None)
        for k in (
            "model_type",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "num_local_experts",
            "num_experts",
            "num_experts_per_tok",
        )
    }
    return {
        "device": device_name(),
        "model": json.dumps(shape, sort_keys=True),
        "dtype": str(dtype).removeprefix("torch."),
        "layout": f"world={world},tp={tp},ep={ep}"
        + (f",cp={cp}" if cp > 1 else "")
        + (",ring" if cp > 1 and cp_comm == "ring" else ""),
        "batch_shape": list(batch_shape),
        "link_gbps": link_gbps,
        "op_graph": op_graph_key(fused),
    }


def meta_key(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


class StreamClock:
    """Seconds of work on ``device``: on CUDA between two events recorded on the current stream
    (work the stream waits for, a collective's included), read after synchronising on the second,
    since the host only enqueues and ``perf_counter`` would time the enqueueing; on CPU, where
    every op runs on the calling thread, ``perf_counter``. ``reduce_max`` takes the maximum over
    the ranks on a tensor of the device (an NCCL group takes no CPU tensor)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started) -> float:
        if not self.cuda:
            return time.perf_counter() - started
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return started.elapsed_time(end) / 1e3

    def reduce_max(self, values: list[float]) -> list[float]:
        return world_max(values, self.device)


class LayerProbe:
    """One decoder layer (block ``block``) of ``graph`` ready to be timed segment by segment, on
    the device of ``batch`` (``clock``: a ``StreamClock`` of it)."""

    def __init__(self, graph, batch: dict, block: int | None = None):
        block = graph.main_block() if block is None else block  # (a layer of the kind the plan is for)
        self.graph, self.block = graph, block
        self.clock = StreamClock(batch["input_ids"].device)
        self.executor = Executor(graph, reactive=False)  # plan-mode semantics: what plans run by
        self.side = graph.make_side(batch)
        pre = MicroBatch(-1, self.side)
        for b in range(block):
            self.executor.run_round([], self.executor.tasks(pre, b, False))
        self.h0 = pre.env["h"]
        self.env0 = dict(pre.env)
        probe = MicroBatch(-1, self.side, env=dict(self.env0))
        self.executor.run_round([], self.executor.tasks(probe, block, False))
        self.g0 = torch.randn_like(probe.env["h"]) * 1e-3
        self.n = len(graph.blocks[block])

    def _strands(self):
        ex, blk = self.executor, self.block
        f = MicroBatch(1, self._own_side(), env=dict(self.env0))
        b = MicroBatch(0, self._own_side(), env=dict(self.env0))
        ex.run_round([], ex.tasks(b, blk, False))
        b.grads["h"] = self.g0.clone()
        return f, b

    def _own_side(self) -> dict:
        """Each strand owns its side dict (MoE ops keep per-micro-batch routing in side["moe"])."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self.side.items()}

    def time_round(self, fseg, bseg) -> float:
        """Seconds of one co-executed round (either segment may be empty)."""
        ex, blk = self.executor, self.block
        f, b = self._strands()
        ex.run_round(ex.tasks(b, blk, True, 0, bseg[0]), ex.tasks(f, blk, False, 0, fseg[0]))
        t0 = self.clock.start()
        ex.run_round(ex.tasks(b, blk, True, *bseg), ex.tasks(f, blk, False, *fseg))
        seconds = self.clock.stop(t0)
        ex.run_round(ex.tasks(b, blk, True, bseg[1], self.n), ex.tasks(f, blk, False, fseg[1], self.n))
        return seconds

    def comm_cpu(self, fseg, bseg) -> float:
        """Seconds of CPU the process spent beside this thread while one round ran (a COMM op
        alone: what gloo's threads and the kernel's TCP work took from the cores)."""
        ex, blk = self.executor, self.block
        f, b = self._strands()
        ex.run_round(ex.tasks(b, blk, True, 0, bseg[0]), ex.tasks(f, blk, False, 0, fseg[0]))
        cpu0, main0 = time.process_time(), time.thread_time()
        ex.run_round(ex.tasks(b, blk, True, *bseg), ex.tasks(f, blk, False, *fseg))
        other = (time.process_time() - cpu0) - (time.thread_time() - main0)
        ex.run_round(ex.tasks(b, blk, True, bseg[1], self.n), ex.tasks(f, blk, False, fseg[1], self.n))
        return max(other, 0.0)

    def time_end_blocks(self) -> dict:
        """Seconds of each op of the first and last blocks (embedding; norm, head, loss), forward
        and backward, each alone, within one whole micro-batch's forward and backward (the layers
        between run untimed): ``{"pre" | "post": (forward times, backward times in op order)}``."""
        ex, nb = self.executor, len(self.graph.blocks)
        mb = MicroBatch(2, self._own_side())
        ends = {0: ([], []), nb - 1: ([], [])}
        for b in range(nb):
            self._run_block(mb, b, False, ends[b][0] if b in ends else None)
        ex.start_backward(mb, 1.0)
        for b in reversed(range(nb)):
            self._run_block(mb, b, True, ends[b][1] if b in ends else None)
        return {"pre": ends[0], "post": ends[nb - 1]}

    def _run_block(self, mb: MicroBatch, b: int, backward: bool, times: list | None) -> None:
        """Block ``b`` of ``mb`` in one direction; with ``times``, op by op, each op's seconds appended."""
        ex = self.executor
        if times is None:
            ex.run_round(*((ex.tasks(mb, b, True), []) if backward else ([], ex.tasks(mb, b, False))))
            return
        for i in range(len(self.graph.blocks[b])):
            tasks = ex.tasks(mb, b, backward, i, i + 1)
            t0 = self.clock.start()
            ex.run_round(*((tasks, []) if backward else ([], tasks)))
            times.append(self.clock.stop(t0))
        if backward:
            times.reverse()  # backward positions -> forward op order

    def time_plan(self, plan) -> float:
        """Seconds of a whole layer pair run by ``plan`` (the makespan the planner predicts)."""
        ex, blk = self.executor, self.block
        f, b = self._strands()
        t0 = self.clock.start()
        for r in plan.rounds:
            ex.run_round(ex.tasks(b, blk, True, *r.bwd), ex.tasks(f, blk, False, *r.fwd))
        return self.clock.stop(t0)


def world_max(values: list[float], device: torch.device | str = "cpu") -> list[float]:
    """Each value's maximum over the ranks (every rank then holds the same numbers), reduced on a
    tensor of ``device`` (the run's: an NCCL group takes no CPU tensor)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


NOISE_TARGET = 0.02
"""Pass 2 re-measures an entry while its median's standard error exceeds this share of the median."""
NOISE_BUDGET = 0.3
"""Pass 2 may take at most this many times the first pass's seconds."""
REFINE_ROUNDS = 4
"""Pass 3 re-measures the plan's entries and re-searches at most this many times."""
BUDGET_CHECK_EVERY = 16
"""Pass 2 compares the time spent with its budget after every this many entries (one all-reduce)."""


def robust_spread(values: list[float]) -> float:
    """Run-to-run sigma, robust to one outlier: 1.4826 x the median absolute deviation."""
    med = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - med) for v in values)


class _Samples:
    """Every entry's timed runs (ms), and the table they make, reduced over the ranks."""

    def __init__(self, probe: LayerProbe, meta: dict, fwd, bwd):
        self.probe, self.meta, self.fwd, self.bwd = probe, meta, fwd, bwd
        self.runs: dict = {}
        self.timed = 0  # timed runs in all

    def measure(self, key, times: int, warmup: int = 0) -> None:
        for _ in range(warmup):
            self.probe.time_round(*key)
        self.runs.setdefault(key, []).extend(self.probe.time_round(*key) * 1e3 for _ in range(times))
        self.timed += times

    def table(self) -> OverlapTable:
        keys = list(self.runs)
        reduced = self.probe.clock.reduce_max(
            [statistics.median(self.runs[k]) for k in keys] + [robust_spread(self.runs[k]) for k in keys]
        )
        medians, spreads = reduced[: len(keys)], reduced[len(keys) :]  # one all-reduce for both
        table = OverlapTable(self.meta, self.fwd, self.bwd)
        for key, ms, spread in zip(keys, medians, spreads):
            table.set_entry(key, ms, spread, len(self.runs[key]))
        return table


def profile_layer(
    graph, batch: dict, meta: dict, params=(), warmup: int = 2, repeats: int = 5, progress: bool = True
) -> OverlapTable:
    """Measure every candidate segment alone and every allowed pair, then re-measure the noisy
    entries and the plan's own (see the module docstring); returns the overlap table, with
    ``info`` saying what each pass did."""
    from .progress import progress as tqdm

    specs = graph.layer_specs()
    fwd, bwd = specs, backward_order(specs)
    fc, bc = candidate_segments(fwd), candidate_segments(bwd)
    jobs = [(s, EMPTY) for s in fc] + [(EMPTY, s) for s in bc]
    jobs += [(a, b) for a in fc for b in bc if not (segment_has_comm(fwd, a) and segment_has_comm(bwd, b))]
    samples = _Samples(LayerProbe(graph, batch), meta, fwd, bwd)
    show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
    t0 = time.perf_counter()
    for key in tqdm(jobs, desc="profile", disable=not show, dynamic_ncols=True):
        samples.measure(key, repeats, warmup)
    first_s = samples.probe.clock.reduce_max([time.perf_counter() - t0])[
        0
    ]  # the slowest rank's: every rank's budget alike
    table = samples.table()
    noisy_runs = _remeasure_noisy(samples, table, repeats, first_s * NOISE_BUDGET, show)
    table = samples.table() if noisy_runs else table
    table, refined = _refine_plan(samples, table, repeats, show)
    table.block_ops = time_block_ops(samples.probe, warmup, repeats)
    table.comm_cpu_ms = time_comm_cpu(samples.probe, fwd, bwd, warmup, repeats)
    for p in params:
        p.grad = None  # profiling must leave no gradients behind
    table.info = {
        "warmup": warmup,
        "repeats": repeats,
        "entries": len(jobs),
        "timed_runs": samples.timed,
        "noisy_remeasured_runs": noisy_runs,
        "plan_refinements": refined,
        "noise_target": NOISE_TARGET,
        "first_pass_s": round(first_s, 2),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    return table


def time_block_ops(probe: LayerProbe, warmup: int, repeats: int) -> dict:
    """The embedding and head blocks' ops timed alone (``LayerProbe.time_end_blocks``): medians of
    ``repeats`` runs after ``warmup``, max over ranks, as ``OverlapTable.block_ops``."""
    for _ in range(warmup):
        probe.time_end_blocks()
    runs = [probe.time_end_blocks() for _ in range(repeats)]
    graph, nb = probe.graph, len(probe.graph.blocks)
    layout = [(key, d, len(graph.blocks[b])) for key, b in (("pre", 0), ("post", nb - 1)) for d in (0, 1)]
    medians = [statistics.median(run[key][d][i] for run in runs) * 1e3 for key, d, n in layout for i in range(n)]
    reduced, out = probe.clock.reduce_max(medians), {}
    for key, d, n in layout:
        block = graph.blocks[0 if key == "pre" else nb - 1]
        entry = out.setdefault(key, {"ops": [op.name for op in block]})
        entry["bwd_ms" if d else "fwd_ms"], reduced = reduced[:n], reduced[n:]
    return out


def time_comm_cpu(probe: LayerProbe, fwd, bwd, warmup: int, repeats: int) -> dict:
    """Each COMM op's CPU time beside the main thread, alone (``LayerProbe.comm_cpu``): medians of
    ``repeats`` runs after ``warmup``, max over ranks, as ``OverlapTable.comm_cpu_ms``."""
    keys = [((i, i + 1), EMPTY) for i, op in enumerate(fwd) if op.is_comm]
    keys += [(EMPTY, (j, j + 1)) for j, op in enumerate(bwd) if op.is_comm]
    for key in keys:
        for _ in range(warmup):
            probe.comm_cpu(*key)
    medians = probe.clock.reduce_max(
        [statistics.median(probe.comm_cpu(*key) for _ in range(repeats)) * 1e3 for key in keys]
    )
    out = {"fwd": [None] * len(fwd), "bwd": [None] * len(bwd)}
    for (fseg, bseg), ms in zip(keys, medians):
        direction, seg = ("fwd", fseg) if bseg == EMPTY else ("bwd", bseg)
        out[direction][seg[0]] = ms
    return out


def _noisy(table: OverlapTable, keys) -> list:
    return [k for k in keys if table.standard_error(k) > NOISE_TARGET * table.entry_ms(k)]


def _remeasure_noisy(samples: _Samples, table: OverlapTable, repeats: int, budget_s: float, show: bool) -> int:
    """Pass 2: ``repeats`` more runs of every noisy entry, pass after pass, within ``budget_s``;
    returns the runs added. Which entries are noisy is read from the world-reduced table, so all
    ranks agree."""
    added, t0 = 0, time.perf_counter()
    keys = _noisy(table, samples.runs)
    while keys:
        for i, key in enumerate(keys):
            samples.measure(key, repeats)
            added += repeats
            if (
                i % BUDGET_CHECK_EVERY == BUDGET_CHECK_EVERY - 1
                and samples.probe.clock.reduce_max([time.perf_counter() - t0])[0] >= budget_s
            ):
                keys = []  # out of time (every rank sees the slowest rank's clock: all stop together)
                break
        else:
            spent = samples.probe.clock.reduce_max([time.perf_counter() - t0])[0]
            keys = _noisy(samples.table(), keys) if spent < budget_s else []
    if show and added:
        print(
            f"ds_dhelix: profile re-measured noisy entries: {added} runs in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    return added


def _refine_plan(samples: _Samples, table: OverlapTable, repeats: int, show: bool) -> tuple[OverlapTable, int]:
    """Pass 3: re-measure the DP plan's entries (interleaved) and re-search until the plan stays."""
    from ..planning.planner import plan_keys

    plan, kept = plan_dp(table), 0
    for k in range(REFINE_ROUNDS):
        keys = list(dict.fromkeys(plan_keys(table, plan)))
        for _ in range(repeats):  # interleaved: a drift in machine load hits every entry alike
            for key in keys:
                samples.measure(key, 1)
        table = samples.table()
        again = plan_dp(table)
        if show:
            print(
                f"ds_dhelix: profile refinement {k + 1}: re-measured the plan's {len(keys)} entries; plan "
                f"predicted {again.predicted_ms:.3f} ms "
                f"(+-{again.meta.get('predicted_spread_ms', 0.0):.3f}){', kept' if again.fingerprint() == plan.fingerprint() else ', changed'}",
                flush=True,
            )
        kept = kept + 1 if again.fingerprint() == plan.fingerprint() else 0
        if kept and (kept == 2 or not _noisy(table, keys)):  # the same plan twice, or once with quiet entries
            return table, k + 1
        plan = again
    return table, REFINE_ROUNDS


def cached_table_path(cache_dir: str, meta: dict) -> str:
    return os.path.join(os.path.expanduser(cache_dir), f"overlap-{meta_key(meta)}.json")


def check_same_plan(plan) -> None:
    """All ranks must hold the same plan (the collectives' order depends on it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = plan.fingerprint()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if len(set(everyone)) != 1:
        raise RuntimeError(f"ranks hold different SI plans: {everyone}")


def resolve_plan(planner_cfg, graph, meta: dict, example_batch: dict | None, params=(), log=print):
    """The SI plan for ``planner.profile``: "off" -> None (the default plan); a path -> that table,
    refused when it does not match this run; "auto" -> a cached table for this run, or profile now."""
    mode = planner_cfg.profile
    if mode == "off":
        return None, None
    specs = graph.layer_specs()
    if mode == "auto":
        path = cached_table_path(planner_cfg.cache_dir, meta)
        if os.path.exists(path):
            table = OverlapTable.load(path)
            log(f"ds_dhelix: using cached overlap table {path}")
        else:
            if example_batch is None:
                raise ValueError(
                    'planner.profile="auto" needs a micro-batch to know the shapes: pass '
                    "example_batch=... to ds_dhelix.initialize (train.py does)"
                )
            log(f"ds_dhelix: profiling operator overlap ({len(candidate_segments(specs))} segments per strand)")
            table = profile_layer(graph, example_batch, meta, params, planner_cfg.warmup, planner_cfg.repeats)
            if not dist.is_initialized() or dist.get_rank() == 0:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                table.save(path)
                log(f"ds_dhelix: overlap table saved to {path}")
    else:
        table = OverlapTable.load(planner_cfg.table_path)
    table.check_matches(meta, specs, backward_order(specs))
    plan = plan_dp(table)
    if example_batch is not None:
        plan = confirm_by_measurement(graph, example_batch, plan, params, log)
    check_same_plan(plan)
    return plan, table


def confirm_by_measurement(graph, batch: dict, plan, params=(), log=print, repeats: int = 7):
    """Run the DP plan and the default plan side by side on the real layer and keep the faster.

    The table's pair times are medians of a few runs; picking the minimum over hundreds of noisy
    entries favours entries measured low by chance, so a plan can be predicted faster than it
    runs. Medians over rounds that alternate the two plans, max over ranks (every rank decides
    alike)."""
    from ..planning.plan import default_plan

    fallback = default_plan(plan.fwd_ops, plan.bwd_ops)
    if fallback.fingerprint() == plan.fingerprint():
        return plan
    probe = LayerProbe(graph, batch)
    samples = ([], [])
    probe.time_plan(plan), probe.time_plan(fallback)  # warm-up
    for _ in range(repeats):
        samples[0].append(probe.time_plan(plan))
        samples[1].append(probe.time_plan(fallback))
    dp_ms, default_ms = (m * 1e3 for m in probe.clock.reduce_max([statistics.median(x) for x in samples]))
    for p in params:
        p.grad = None
    log(f"ds_dhelix: measured per layer pair: DP plan {dp_ms:.2f} ms, default plan {default_ms:.2f} ms")
    if default_ms < dp_ms:
        log("ds_dhelix: the default plan ran faster here; using it")
        return fallback
    return plan
