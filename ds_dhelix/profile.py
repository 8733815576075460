"""Operator overlap profiling: time segments of one decoder layer alone and co-executed, in place.

A ``LayerProbe`` holds two micro-batches at one decoder layer: the forward strand at the layer's
input and the backward strand with the layer's forward done and a gradient waiting at its output.
To time a forward segment [a, b) with a backward segment [c, d) it runs ops before a and c
untimed, times ``Executor.run_step`` over the two segments (barrier included), then runs the rest
untimed, so every measurement is the real executor on real shapes, groups and devices.

All ranks run the same measurements in the same order (the collectives match); each entry is the
median over repeats, then the max over ranks, so every rank holds the same table and plans alike.
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

from .executor import Executor, MicroBatch
from .ops import backward_order
from .planner import OverlapTable, candidate_segments, plan_dp
from .plan import segment_has_comm


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu:{platform.machine()}:{os.cpu_count()}cores:{torch.get_num_threads()}threads"


OP_GRAPH_REVISION = 2
"""Bumped when the adapters move math from one op to another (2: rotary moved from ``attn.qkv`` to
``attn.core``, the MLP activation from ``mlp.up`` to ``mlp.down``): op names stay, their times
change, so tables cached before no longer apply."""


def run_meta(model_config, tp: int, world: int, batch_shape, dtype, link_gbps=None, ep: int = 1) -> dict:
    """What a table is keyed by: device, model shape, dtype, parallel layout, batch shape, link,
    op-graph revision."""
    c = model_config
    shape = {k: getattr(c, k, None) for k in ("model_type", "hidden_size", "intermediate_size",
                                               "num_attention_heads", "num_key_value_heads", "vocab_size",
                                               "num_local_experts", "num_experts_per_tok")}
    return {"device": device_name(), "model": json.dumps(shape, sort_keys=True),
            "dtype": str(dtype).removeprefix("torch."), "layout": f"world={world},tp={tp},ep={ep}",
            "batch_shape": list(batch_shape), "link_gbps": link_gbps, "op_graph": OP_GRAPH_REVISION}


def meta_key(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


class LayerProbe:
    """One decoder layer (block ``block``) of ``graph`` ready to be timed segment by segment."""

    def __init__(self, graph, batch: dict, block: int = 1):
        self.graph, self.block = graph, block
        self.executor = Executor(graph, stream=False)  # plan-mode semantics: what plans run by
        self.side = graph.make_side(batch)
        pre = MicroBatch(-1, self.side)
        for b in range(block):
            self.executor.run_step([], self.executor.tasks(pre, b, False))
        self.h0 = pre.env["h"]
        self.env0 = dict(pre.env)
        probe = MicroBatch(-1, self.side, env=dict(self.env0))
        self.executor.run_step([], self.executor.tasks(probe, block, False))
        self.g0 = torch.randn_like(probe.env["h"]) * 1e-3
        self.n = len(graph.blocks[block])

    def _strands(self):
        ex, blk = self.executor, self.block
        f = MicroBatch(1, self._own_side(), env=dict(self.env0))
        b = MicroBatch(0, self._own_side(), env=dict(self.env0))
        ex.run_step([], ex.tasks(b, blk, False))
        b.grads["h"] = self.g0.clone()
        return f, b

    def _own_side(self) -> dict:
        """Each strand owns its side dict (MoE ops keep per-micro-batch routing in side["moe"])."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self.side.items()}

    def time_step(self, fseg, bseg) -> float:
        """Seconds of one co-executed step (either segment may be empty)."""
        ex, blk = self.executor, self.block
        f, b = self._strands()
        ex.run_step(ex.tasks(b, blk, True, 0, bseg[0]), ex.tasks(f, blk, False, 0, fseg[0]))
        t0 = time.perf_counter()
        ex.run_step(ex.tasks(b, blk, True, *bseg), ex.tasks(f, blk, False, *fseg))
        t1 = time.perf_counter()
        ex.run_step(ex.tasks(b, blk, True, bseg[1], self.n), ex.tasks(f, blk, False, fseg[1], self.n))
        return t1 - t0

    def time_plan(self, plan) -> float:
        """Seconds of a whole layer pair run by ``plan`` (the makespan the planner predicts)."""
        ex, blk = self.executor, self.block
        f, b = self._strands()
        t0 = time.perf_counter()
        for st in plan.steps:
            ex.run_step(ex.tasks(b, blk, True, *st.bwd), ex.tasks(f, blk, False, *st.fwd))
        return time.perf_counter() - t0


def _world_max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def profile_layer(graph, batch: dict, meta: dict, params=(), warmup: int = 2, repeats: int = 5,
                  progress: bool = True) -> OverlapTable:
    """Measure every candidate segment alone and every allowed pair; returns the overlap table."""
    from tqdm import tqdm
    specs = graph.layer_specs()
    fwd, bwd = specs, backward_order(specs)
    fc, bc = candidate_segments(fwd), candidate_segments(bwd)
    empty_f, empty_b = (0, 0), (0, 0)
    jobs = [(s, empty_b) for s in fc] + [(empty_f, s) for s in bc]
    jobs += [(a, b) for a in fc for b in bc
             if not (segment_has_comm(fwd, a) and segment_has_comm(bwd, b))]
    probe = LayerProbe(graph, batch)
    show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
    medians = []
    for fseg, bseg in tqdm(jobs, desc="profile", disable=not show, dynamic_ncols=True):
        for _ in range(warmup):
            probe.time_step(fseg, bseg)
        medians.append(statistics.median(probe.time_step(fseg, bseg) for _ in range(repeats)) * 1e3)
    medians = _world_max(medians)
    for p in params:
        p.grad = None  # profiling must leave no gradients behind
    table = OverlapTable(meta, fwd, bwd)
    for (fseg, bseg), ms in zip(jobs, medians):
        if bseg == empty_b:
            table.fwd_alone_ms[fseg] = ms
        elif fseg == empty_f:
            table.bwd_alone_ms[bseg] = ms
        else:
            table.pair_ms[(fseg, bseg)] = ms
    return table


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
                raise ValueError('planner.profile="auto" needs a micro-batch to know the shapes: pass '
                                 "example_batch=... to ds_dhelix.initialize (train.py does)")
            log(f"ds_dhelix: profiling operator overlap ({len(candidate_segments(specs))} segments per strand)")
            table = profile_layer(graph, example_batch, meta, params, planner_cfg.warmup, planner_cfg.repeats)
            if not dist.is_initialized() or dist.get_rank() == 0:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                table.save(path)
                log(f"ds_dhelix: overlap table saved to {path}")
    else:
        table = OverlapTable.load(mode)
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
    from .plan import default_plan
    fallback = default_plan(plan.fwd_ops, plan.bwd_ops)
    if fallback.fingerprint() == plan.fingerprint():
        return plan
    probe = LayerProbe(graph, batch)
    samples = ([], [])
    probe.time_plan(plan), probe.time_plan(fallback)  # warm-up
    for _ in range(repeats):
        samples[0].append(probe.time_plan(plan))
        samples[1].append(probe.time_plan(fallback))
    dp_ms, default_ms = (m * 1e3 for m in _world_max([statistics.median(x) for x in samples]))
    for p in params:
        p.grad = None
    log(f"ds_dhelix: measured per layer pair: DP plan {dp_ms:.2f} ms, default plan {default_ms:.2f} ms")
    if default_ms < dp_ms:
        log("ds_dhelix: the default plan ran faster here; using it")
        return fallback
    return plan


# ---------------------------------------------------------------------------------- CLI worlds
def build_sharded(model_name: str, tp: int, seed: int = 1234, ep: int = 1):
    """On a running world of tp x ep ranks: the preset/checkpoint model, sharded for this rank
    (TP slices; experts over the EP group for MoE models), and its graph."""
    from hf_models.adapters import adapter_for
    from hf_models.registry import build_model
    from .config import DhelixConfig
    from .engine import _check_moe
    from .parallel import ParallelLayout
    model, _ = build_model(model_name, seed=seed)
    adapter = adapter_for(model.config)
    dh = DhelixConfig.from_dict({"enabled": True, "tensor_parallel": {"size": tp},
                                 "expert_parallel": {"size": ep}})
    moe = _check_moe(adapter, model.config, dh, dist.get_world_size() // tp)
    layout = ParallelLayout.create(tp, ep)
    if moe is not None:
        moe["ep_groups"] = layout.expert_groups()
    graph = adapter.build_graph(model, tp, layout.tp_rank, layout.tp_group, layout.tp_grad_group, **(moe or {}))
    return model, graph, layout


def example_batch(vocab: int, micro: int, seq_len: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (micro, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _profile_rank(rank, world, o: dict):
    model, graph, layout = build_sharded(o["model"], o["tp"], ep=o.get("ep", 1))
    batch = example_batch(model.config.vocab_size, o["micro_batch_size"], o["seq_len"], seed=rank // o["tp"])
    meta = run_meta(model.config, o["tp"], world, tuple(batch["input_ids"].shape),
                    next(model.parameters()).dtype, o.get("link_gbps"), ep=o.get("ep", 1))
    t0 = time.perf_counter()
    table = profile_layer(graph, batch, meta, list(model.parameters()), o["warmup"], o["repeats"])
    seconds = time.perf_counter() - t0
    return (table.to_dict(), seconds) if rank == 0 else None


def profile_world(o: dict, timeout: float = 900.0):
    """Spawn a CPU gloo world of ``o["tp"]`` ranks and profile; returns (table, seconds)."""
    from .spawn import run_ranks
    table, seconds = run_ranks(_profile_rank, o["tp"] * o.get("ep", 1), args=(o,), timeout=timeout)[0]
    return OverlapTable.from_dict(table), seconds


def _validate_rank(rank, world, o: dict):
    import random

    from .plan import default_plan, sequential_plan
    from .planner import predict_ms, random_plan
    table = OverlapTable.from_dict(o["table"])
    model, graph, layout = build_sharded(o["model"], o["tp"], ep=o.get("ep", 1))
    specs = graph.layer_specs()
    table.check_matches({}, specs, backward_order(specs))
    batch = example_batch(model.config.vocab_size, *table.meta["batch_shape"], seed=rank // o["tp"])
    rng = random.Random(o["seed"])
    plans = {"dp": plan_dp(table), "default": default_plan(table.fwd_ops, table.bwd_ops),
             "sequential": sequential_plan(table.fwd_ops, table.bwd_ops)}
    for k in range(o["alternatives"]):
        plans[f"random{k}"] = random_plan(table, rng)
    probe = LayerProbe(graph, batch)
    names = list(plans)
    samples = {n: [] for n in names}
    for _ in range(o["warmup"]):
        for n in names:
            probe.time_plan(plans[n])
    for _ in range(o["repeats"]):  # alternate plans within each repetition
        for n in names:
            samples[n].append(probe.time_plan(plans[n]) * 1e3)
    measured = _world_max([statistics.median(samples[n]) for n in names])
    if rank != 0:
        return None
    return [{"plan": n, "steps": len(plans[n].steps), "predicted_ms": predict_ms(table, plans[n]),
             "measured_ms": m} for n, m in zip(names, measured)]


def validate_world(o: dict, timeout: float = 900.0) -> dict:
    """Run the DP plan and alternatives for real; compare predicted and measured makespans."""
    from .spawn import run_ranks
    rows = run_ranks(_validate_rank, o["tp"] * o.get("ep", 1), args=(o,), timeout=timeout)[0]
    pred = [r["predicted_ms"] for r in rows]
    meas = [r["measured_ms"] for r in rows]
    for r in rows:
        r["error_pct"] = 100.0 * (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
    ranked = sorted(rows, key=lambda r: r["measured_ms"])
    dp = next(r for r in rows if r["plan"] == "dp")
    return {
        "rows": rows,
        "spearman": spearman(pred, meas),
        "mean_abs_error_pct": statistics.mean(abs(r["error_pct"]) for r in rows),
        "dp_predicted_ms": dp["predicted_ms"],
        "dp_measured_ms": dp["measured_ms"],
        "best_measured_ms": ranked[0]["measured_ms"],
        "best_measured_plan": ranked[0]["plan"],
        "dp_rank": 1 + ranked.index(dp),
        "dp_vs_best_pct": 100.0 * (dp["measured_ms"] / ranked[0]["measured_ms"] - 1.0),
        "num_plans": len(rows),
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0
