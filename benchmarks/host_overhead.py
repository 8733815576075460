"""Host cost of the executor per op against plain HF, at near-zero compute, and what it would come
to beside a GPU's time per layer.

One process, no collectives (TP = 1), a model of tiny widths (``--hidden 8``: the matmuls take
almost nothing, so what is timed is Python, dispatch and autograd's bookkeeping). The same
micro-batches run:

    hf                   model(...).loss.backward() per micro-batch
    sequential           the executor, one micro-batch after another, on the fused graph
                         (``dhelix.fuse_ops``, the default: the COMP ops between two collectives
                         as one op; with TP = 1 a block is one op)
    si                   the executor's reactive SI on the fused graph, linear ops' weight gradients
                         deferred (forced on: with TP = 1 there is no collective to fill, so the
                         engine would not defer)
    sequential-unfused,  the same on the adapter's op graph, every op on its own
    si-unfused           (``"fuse_ops": false``)
    si-nodefer           SI on the fused graph without deferred weight gradients
                         (``"defer_weight_grads": false``): si minus this is what deferring costs

Reported per op of the adapter's op graph (its COMP ops; a micro-batch runs each once forward and
once backward, fused or not): host µs forward, backward and both (SI interleaves the two: both
only), autograd engine calls per op backward (``torch.autograd.backward`` / ``Tensor.backward``
reaching the engine) and deferred weight-gradient passes. Medians over ``--repeats`` steps, the
modes taking turns step by step (min and max beside them).

The projection prices one decoder layer's host time at what this run measured: each op at HF's
µs per op, plus each unit the executor runs (a fused run of COMP ops, or an op; each COMM op one
more: a launch and a wait) at the executor's overhead per unit above HF; and sets it beside ``dhelix
predict``'s roofline time of that layer's forward + backward on H100, for Llama-3-8B at TP = 8 and
Qwen3-30B-A3B at EP = 8 (seq 4096, bf16). HF's own row is there too: this CPU's host is slower
than a GPU server's, so every share is an upper bound.

    python benchmarks/host_overhead.py [--model tiny-llama] [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ds_dhelix.graph.fuse import fuse  # noqa: E402
from ds_dhelix.runtime import executor as executor_module  # noqa: E402
from ds_dhelix.runtime.executor import Executor  # noqa: E402
from ds_dhelix.verify import random_batches  # noqa: E402
from hf_models.adapters import adapter_for  # noqa: E402
from hf_models.registry import build_model  # noqa: E402

CONFIGS = os.path.join(ROOT, "benchmarks", "results", "predict", "configs")
LAYOUTS = {  # name: (config, predict flags)
    "llama3-8b-tp8-H100": ("llama-3-8b.json", {"tp": 8, "ep": 1}),
    "qwen3-30b-a3b-ep8-H100": ("qwen3-30b-a3b.json", {"tp": 1, "ep": 8}),
}
MODES = ("hf", "sequential", "si", "sequential-unfused", "si-unfused", "si-nodefer")
PROJECTED = MODES[1:5]  # si-nodefer: what deferring costs (``deferral_us_per_op``), not a layout


@contextmanager
def counting():
    """Counts autograd engine calls (``engine``), op backwards and deferred passes while inside."""
    counts = {"engine": 0, "op_backward": 0, "deferred": 0}
    engine, direct = torch.autograd._engine_run_backward, getattr(executor_module, "run_backward", None)
    comp_backward, run_deferred = Executor._comp_backward, Executor.run_deferred

    def engine_call(*a, **k):
        counts["engine"] += 1
        return engine(*a, **k)

    def direct_call(*a, **k):  # the executor's own engine call (``wgrad.run_backward``)
        counts["engine"] += 1
        return direct(*a, **k)

    def op_backward(self, t):
        counts["op_backward"] += 1
        return comp_backward(self, t)

    def deferred(self):
        ran = run_deferred(self)
        counts["deferred"] += ran
        return ran

    torch.autograd._engine_run_backward, executor_module.run_backward = engine_call, direct_call
    Executor._comp_backward, Executor.run_deferred = op_backward, deferred
    try:
        yield counts
    finally:
        torch.autograd._engine_run_backward, executor_module.run_backward = engine, direct
        Executor._comp_backward, Executor.run_deferred = comp_backward, run_deferred


def _zero(model) -> None:
    for p in model.parameters():
        p.grad = None


def _hf_step(model, batches, split: dict) -> None:
    for b in batches:
        t0 = time.perf_counter()
        loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss / len(batches)
        t1 = time.perf_counter()
        loss.backward()
        split["fwd"] += t1 - t0
        split["bwd"] += time.perf_counter() - t1


def _executor_step(executor, batches, schedule: str, split: dict) -> None:
    if schedule != "sequential":
        executor.run_microbatches(list(batches), schedule, 1 / len(batches))
        return
    fwd, bwd = executor.forward, executor.backward

    def timed(fn, key):
        def run(*a, **k):
            t0 = time.perf_counter()
            fn(*a, **k)
            split[key] += time.perf_counter() - t0

        return run

    executor.forward, executor.backward = timed(fwd, "fwd"), timed(bwd, "bwd")
    try:
        executor.run_microbatches(list(batches), schedule, 1 / len(batches))
    finally:
        del executor.forward, executor.backward


def _runner(ref, mode: str):
    """(model, step(split)) of ``mode`` on a copy of ``ref``."""
    model = copy.deepcopy(ref)
    schedule = mode.split("-")[0]
    if mode == "hf":
        return model, None, lambda batches, split: _hf_step(model, batches, split)
    graph = adapter_for(model.config).build_graph(model)
    graph = graph if mode.endswith("-unfused") else fuse(graph)
    executor = Executor(graph, None, defer_weight_grads=schedule == "si" and mode != "si-nodefer")
    return model, executor, lambda batches, split: _executor_step(executor, batches, schedule, split)


def _row(times: dict, counts: dict, executor, per_step: int, mode: str) -> dict:
    def us(xs):
        return {
            "median": round(statistics.median(xs) / per_step * 1e6, 1),
            "min": round(min(xs) / per_step * 1e6, 1),
            "max": round(max(xs) / per_step * 1e6, 1),
        }

    row = {"us_per_op": us(times["total"])}
    if executor is not None:
        row["units_per_microbatch"] = sum(1 for block in executor.graph.blocks for op in block if not op.is_comm)
    if not mode.startswith("si"):
        row |= {"us_per_op_forward": us(times["fwd"]), "us_per_op_backward": us(times["bwd"])}
    return row | {
        "engine_calls": counts["engine"],
        "engine_calls_per_op_backward": round(counts["engine"] / per_step, 3) if executor is not None else None,
        "op_backwards": counts["op_backward"] if executor is not None else None,
        "deferred_passes": counts["deferred"],
    }


def measure(model_name: str, hidden: int, layers: int, micro_batches: int, seq: int, repeats: int) -> dict:
    """Every mode's host time per op; the modes take turns step by step (this VM's speed drifts)."""
    torch.manual_seed(0)
    ref, _ = build_model(
        model_name,
        seed=0,
        num_layers=layers,
        overrides={"hidden_size": hidden, "intermediate_size": 2 * hidden, "head_dim": hidden // 4} if hidden else None,
    )
    batches = random_batches(ref.config.vocab_size, micro_batches, 1, seq)
    graph = adapter_for(ref.config).build_graph(ref)
    comp_ops = sum(1 for block in graph.blocks for op in block if not op.is_comm)
    per_step = comp_ops * micro_batches
    runners = {mode: _runner(ref, mode) for mode in MODES}
    times = {mode: {"total": [], "fwd": [], "bwd": []} for mode in MODES}
    for r in range(repeats + 2):  # two warm-ups
        for mode, (model, _, step) in runners.items():
            _zero(model)
            split = {"fwd": 0.0, "bwd": 0.0}
            t0 = time.perf_counter()
            step(batches, split)
            if r >= 2:
                times[mode]["total"].append(time.perf_counter() - t0)
                times[mode]["fwd"].append(split["fwd"])
                times[mode]["bwd"].append(split["bwd"])
    out = {"ops_per_microbatch": comp_ops, "micro_batches": micro_batches}
    for mode, (model, executor, step) in runners.items():
        _zero(model)
        with counting() as counts:
            step(batches, {"fwd": 0.0, "bwd": 0.0})
        out[mode] = _row(times[mode], counts, executor, per_step, mode)
    for mode in MODES[1:]:
        out[f"{mode}_vs_hf"] = round(out[mode]["us_per_op"]["median"] / out["hf"]["us_per_op"]["median"], 3)
    return out


def overheads_us(r: dict, schedule: str) -> tuple[float, float]:
    """The executor's host µs above HF's, per unit it runs (a fused op, or an op: autograd's engine
    call, the leaves, the round) and per op (what scales with the ops whatever their grouping: SI's
    deferred weight gradients): from its fused and unfused rows, which run the same ops in
    ``units_per_microbatch`` units and in one unit per op."""
    ops, hf = r["ops_per_microbatch"], r["hf"]["us_per_op"]["median"]
    fused, unfused = r[schedule], r[f"{schedule}-unfused"]
    extra_fused = (fused["us_per_op"]["median"] - hf) * ops
    extra_unfused = (unfused["us_per_op"]["median"] - hf) * ops
    per_unit = (extra_unfused - extra_fused) / (ops - fused["units_per_microbatch"])
    return per_unit, (extra_fused - fused["units_per_microbatch"] * per_unit) / ops


def layer_projection(hf_us_per_op: float, overheads: tuple[float, float] | None, fused: bool) -> dict:
    """Host time of one decoder layer (each op at ``hf_us_per_op``, plus the executor's
    ``overheads`` per unit and per op; None: HF alone) against predict's H100 time of that layer."""
    unit_us, op_us = overheads or (0.0, 0.0)
    from ds_dhelix.config.dims import ParallelDims
    from ds_dhelix.graph.ops import comm_runs
    from ds_dhelix.predict.costs import roofline_times
    from ds_dhelix.predict.hardware import load_hardware
    from ds_dhelix.predict.shapes import RunLayout, model_shape
    from ds_dhelix.predict.step import specs_of
    from hf_models.outline import config_of, model_outline

    hw = load_hardware("H100")
    out = {}
    for name, (config_file, par) in LAYOUTS.items():
        config = config_of(os.path.join(CONFIGS, config_file))
        dims = ParallelDims(8, tp=par["tp"], ep=par["ep"])
        layout = RunLayout(dims, 4096, 1, 8, "bf16", 1)
        outline = model_outline(config, dims)
        times = roofline_times(outline, model_shape(config), layout, hw)
        layer = times.blocks[1]
        gpu_ms = sum(o.fwd_ms + o.bwd_ms + o.wgrad_ms for o in layer if not o.comm)
        units = len(comm_runs(specs_of(times, 1))) if fused else len(layer)  # fused: runs between collectives
        # every op (a COMM op too: its launch and wait) at HF's cost, and the executor's per unit
        host_ms = (len(layer) * (hf_us_per_op + op_us) + units * unit_us) / 1e3  # forward + backward
        out[name] = {
            "ops_per_layer": len(layer),
            "comm_ops_per_layer": sum(o.comm for o in layer),
            "units_per_layer": units if overheads is not None else None,
            "gpu_compute_ms_per_layer": round(gpu_ms, 3),
            "host_ms_per_layer": round(host_ms, 3),
            "host_share_of_gpu": round(host_ms / gpu_ms, 3),
        }
    return out


def summary(r: dict) -> str:
    """The result as a table: one row per mode, then the projection."""
    lines = ["mode                us/op (min-max)        fwd    bwd   engine calls/op bwd  deferred  vs hf"]
    for mode in MODES:
        row, u = r[mode], r[mode]["us_per_op"]
        fwd = row.get("us_per_op_forward", {}).get("median", "-")
        bwd = row.get("us_per_op_backward", {}).get("median", "-")
        calls = row["engine_calls_per_op_backward"]
        ratio = r.get(f"{mode}_vs_hf", 1.0)
        lines.append(
            f"{mode:<19} {u['median']:>6} ({u['min']}-{u['max']})  {fwd:>6} {bwd:>6}  "
            f"{'-' if calls is None else calls:>18}  {row['deferred_passes']:>8}  {ratio:>5}"
        )
    for schedule, o in r["overheads_us"].items():
        lines.append(f"{schedule:<19} executor above HF: {o['per_unit']:.1f} us per unit, {o['per_op']:.1f} us per op")
    lines.append(f"{'si':<19} deferred weight gradients: {r['deferral_us_per_op']} us per op (si - si-nodefer)")
    for mode, layouts in r["projection"].items():
        for name, p in layouts.items():
            lines.append(
                f"{mode:<19} {name}: host {p['host_ms_per_layer']} ms/layer vs GPU {p['gpu_compute_ms_per_layer']} ms "
                f"({p['host_share_of_gpu']:.0%})"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--hidden", type=int, default=8, help="hidden size (0: the preset's)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable host timings)")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {
        "model": args.model,
        "hidden": args.hidden,
        "layers": args.layers,
        "seq_len": args.seq_len,
        "torch": torch.__version__,
        **measure(args.model, args.hidden, args.layers, args.micro_batches, args.seq_len, args.repeats),
    }
    hf_us = result["hf"]["us_per_op"]["median"]
    result["overheads_us"] = {
        s: dict(zip(("per_unit", "per_op"), overheads_us(result, s))) for s in ("sequential", "si")
    }
    result["projection"] = {"hf": layer_projection(hf_us, None, False)} | {
        mode: layer_projection(hf_us, overheads_us(result, mode.split("-")[0]), not mode.endswith("-unfused"))
        for mode in PROJECTED
    }
    result["deferral_us_per_op"] = round(
        result["si"]["us_per_op"]["median"] - result["si-nodefer"]["us_per_op"]["median"], 1
    )
    text = json.dumps(result, indent=1)
    print(summary(result))
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
