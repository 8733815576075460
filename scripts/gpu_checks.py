"""The prepared GPU checks for a session that is lent a device: one short run, JSON lines out.

    python3 scripts/gpu_checks.py --out "$OUT"                 # on the GPU machine (cuda)
    python3 scripts/gpu_checks.py --device cpu --steps 2       # dry run anywhere

Needs torch and transformers only (the GPU image has no DeepSpeed): it drives the op-graph executor
directly, on one device, so there are no collectives. Each check prints one JSON line; all of them
go to ``<out>/gpu_checks.json``.

1. ``env``: torch, device name.
2. ``parity``: tiny-llama (TP=1) through the executor on the fused graph the engine runs
   (``fuse_ops``), sequential vs reactive SI (deferred weight gradients) vs SI with ``pair_ends``:
   losses and every gradient bitwise equal or not, max abs difference (on CUDA, kernels must be
   deterministic for bitwise: cuBLAS is; this reports).
3. ``step_time``: median step of the executor's sequential and SI schedules against plain HF
   forward/backward on the same micro-batches: the executor's own cost where kernels run
   asynchronously (on CPU every op is synchronous); on the fused graph and on the adapter's ops
   each on its own (``*_unfused``).
4. ``profiler``: one SI step under ``torch.profiler`` with a trace recorder: every op span of the
   executor must be a profiler range of the same name; the profiler's own Chrome trace goes to
   ``<out>/profiler_trace.json.gz``. On CUDA the table is the kernel time under each range; the
   profiled step runs with autograd's multithreading off, so backward kernels are launched on the
   executor's thread, inside its ranges (by default autograd's device thread launches them, under
   its own ranges, and a table counts forward kernels only). On CPU it is each range's CPU time.
5. ``stream_overlap`` (CUDA only): a matmul chain on the compute stream while pinned host<->device
   copies run on a side stream: time of both together against each alone. SI on a GPU relies on
   communication (NCCL, copy engines) progressing beside compute like this.
6. ``device_events`` (CUDA only): the executor's CUDA-event timing of a collective (``comm.Pending``
   on a one-rank NCCL world): waited at once its exposed time is ~its busy time, launched before a
   longer matmul chain ~0; the host wait is ~0 in both (what host timers would report).
7. ``connections`` (CUDA only): ``CUDA_DEVICE_MAX_CONNECTIONS`` and the warning the engines give
   when it serializes kernels.
12. ``planner_clock``: the planner's ``StreamClock`` (``runtime/profiler.py``) on the device: a
   layer's co-executed round timed by CUDA events beside the host's time to launch it, and the
   world reduction on a one-rank NCCL world (a CUDA tensor).
13. ``layer_shapes``: a Llama-3-8B layer's TP=8 share and a Qwen3-30B-A3B layer's EP=8 share (bf16,
   seq 4096): HF against the executor's sequential and SI (step time, host launch time, the share
   of ops that found the GPU idle, ``starved_share``), and the same with side-stream fake
   collectives of ``dhelix predict``'s H100 lengths: how much sequential and SI hide
   (``scripts/gpu_layer_checks.py``).
14. ``two_ranks``: two processes on the one device over gloo (CUDA tensors, where the machine's
   gloo takes them): tiny-llama TP=2 and tiny-mixtral EP=2, sequential and SI through the executor,
   bitwise or not, and no hang (bounded by a timeout).
9. ``tutel_kernels`` (where tutel imports): ``dhelix.moe.kernels`` torch against tutel on the device,
   fp32 and bf16: the send buffer and combined rows equal or not, and the encode + decode forward +
   backward time of each (median).
10. ``tutel_overlap`` (CUDA, where tutel imports): tutel's MoE layer on a one-rank NCCL world,
   forward + backward time at ``a2a_ffn_overlap_degree`` 1, 2 and 4 (the bench's ``tutel``,
   ``tutel-overlap2``, ``tutel-overlap4``). One GPU means one EP rank: the all-to-all is a local
   copy, so these rows show what the chunking costs, not what it hides.
11. ``host_syncs`` (CUDA only): ``torch.cuda.set_sync_debug_mode("warn")`` around a steady-state
   SI step of tiny-llama and tiny-mixtral (EP=1 on one GPU: bf16's grouped GEMM, fp32's loop over
   experts) and the dropless counts -> dispatch -> combine path on a one-rank NCCL world: each
   synchronizing CUDA call by the op that made it (expected none), SI losses bitwise sequential.
8. ``roofline``: one Llama-shaped decoder layer with its embedding and head (bf16 on CUDA:
   h 4096, MLP 14336, 32 heads / 8 kv heads, 2 x 2048 tokens; fp32 and tiny on CPU), op by op
   through the op graph: measured forward and backward (input + weight gradient) times against
   ``dhelix predict``'s roofline for the device's preset (``ds_dhelix.predict``; H200 / H100 / A800
   / A40 by the device name, H100's numbers in a CPU dry run), and the GEMM efficiency each
   projection reached (the preset assumes ``gemm_efficiency``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ds_dhelix.graph.fuse import fuse  # noqa: E402
from ds_dhelix.moe.kernels import tutel_missing  # noqa: E402
from ds_dhelix.runtime.comm import cuda_connections_warning  # noqa: E402
from ds_dhelix.runtime.executor import Executor  # noqa: E402
from ds_dhelix.runtime.trace import TraceRecorder  # noqa: E402
from ds_dhelix.verify import random_batches  # noqa: E402
from hf_models.adapters import adapter_for  # noqa: E402
from hf_models.registry import build_model  # noqa: E402
from scripts.gpu_layer_checks import (  # noqa: E402
    against_sequential,
    check_layer_shapes,
    check_planner_clock,
    check_two_ranks,
)
from scripts.gpu_layer_checks import sync as _sync  # noqa: E402


def make_batches(vocab: int, num: int, size: int, seq: int, device) -> list[dict]:
    return random_batches(vocab, num, size, seq, device=device)


def _executor_step(model, batches, schedule: str) -> tuple[list, dict]:
    graph = fuse(adapter_for(model.config).build_graph(model))  # what the engine runs (fuse_ops)
    mbs = Executor(graph, None).run_microbatches(list(batches), schedule, 1 / len(batches))
    return [mb.loss.detach() for mb in mbs], {n: p.grad for n, p in model.named_parameters()}


def check_parity(ref, batches) -> dict:
    runs = {}
    for name in ("sequential", "si", "si-ends"):
        runs[name] = _executor_step(copy.deepcopy(ref), batches, name)
    return {name: against_sequential(runs["sequential"], runs[name]) for name in ("si", "si-ends")}


def check_step_time(ref, batches, steps: int, device) -> dict:
    def hf_step(model):
        for b in batches:
            (model(input_ids=b["input_ids"], labels=b["labels"]).loss / len(batches)).backward()

    timings = {}
    # the engine's graph (fused runs, "fuse_ops") and the adapter's ops each on its own ("_unfused");
    # a step runs with autograd's device threads off either way (the interpreter turns them off)
    names = ("hf", "sequential", "si", "sequential_unfused", "si_unfused")
    models = {k: copy.deepcopy(ref) for k in names}

    def graph_of(name, m):
        graph = adapter_for(m.config).build_graph(m)
        return graph if name.endswith("_unfused") else fuse(graph)

    executors = {k: Executor(graph_of(k, m), None) for k, m in models.items() if k != "hf"}
    for name in names:
        schedule = name.partition("_")[0]
        times = []
        for _ in range(steps + 1):  # the first is a warm-up
            for p in models[name].parameters():
                p.grad = None
            _sync(device)
            t0 = time.perf_counter()
            if name == "hf":
                hf_step(models[name])
            else:
                executors[name].run_microbatches(list(batches), schedule, 1 / len(batches))
            _sync(device)
            times.append(time.perf_counter() - t0)
        timings[name] = statistics.median(times[1:]) * 1e3
    return {f"{k}_ms": round(v, 2) for k, v in timings.items()} | {
        "executor_vs_hf": round(timings["sequential"] / timings["hf"], 3),
        "executor_unfused_vs_hf": round(timings["sequential_unfused"] / timings["hf"], 3),
        "si_vs_sequential": round(timings["sequential"] / timings["si"], 3),
    }


def check_profiler(ref, batches, device, out_dir: str | None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    model = copy.deepcopy(ref)
    graph = fuse(adapter_for(model.config).build_graph(model))
    Executor(graph, None, recorder=TraceRecorder(0, record_function=True)).run_microbatches(
        list(batches), "si", 1 / len(batches)
    )  # warm-up
    for p in model.parameters():
        p.grad = None
    rec = TraceRecorder(0, record_function=True)
    executor = Executor(graph, None, recorder=rec)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # backward on this thread, so backward kernels fall under the executor's ranges too
    with profile(activities=activities) as prof, torch.autograd.set_multithreading_enabled(False):
        executor.run_microbatches(list(batches), "si", 1 / len(batches))
        _sync(device)
    spans = {e["name"] for e in rec.events() if e["ph"] == "X" and e["cat"] == "compute"}
    ranges = {e.key: e for e in prof.key_averages()}

    def device_ms(e) -> float:  # kernel time on CUDA; CPU time of the range in a CPU dry run
        if device.type != "cuda":
            return e.cpu_time_total / 1e3
        return getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)) / 1e3

    table = sorted(
        ((name, round(device_ms(ranges[name]), 3), ranges[name].count) for name in spans if name in ranges),
        key=lambda r: -r[1],
    )
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "profiler_trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            g.write(f.read())
        os.remove(path)
    return {
        "spans": len(spans),
        "missing_ranges": sorted(spans - set(ranges)),
        "op_kernel_ms" if device.type == "cuda" else "op_cpu_ms": {name: ms for name, ms, _ in table[:16]},
        "named_ms": round(sum(ms for _, ms, _ in table), 3),
    }


def check_stream_overlap(device, reps: int = 20) -> dict:
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)  # 256 MiB
    dev = torch.empty_like(host, device=device)
    side = torch.cuda.Stream(device)

    def compute():
        x = a
        for _ in range(reps):
            x = x @ a
        return x

    def copies():
        with torch.cuda.stream(side):
            for _ in range(4):
                dev.copy_(host, non_blocking=True)
                host.copy_(dev, non_blocking=True)

    def timed(fn) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return (time.perf_counter() - t0) * 1e3

    for fn in (compute, copies):
        timed(fn)  # warm-up
    alone_c, alone_x = timed(compute), timed(copies)
    both = timed(lambda: (copies(), compute()))
    return {
        "compute_ms": round(alone_c, 2),
        "copy_ms": round(alone_x, 2),
        "both_ms": round(both, 2),
        "overlap": round((alone_c + alone_x - both) / min(alone_c, alone_x), 3),
    }


@contextlib.contextmanager
def one_rank_world(device):
    """A one-rank NCCL process group for the checks that launch collectives (kept if one exists)."""
    import torch.distributed as dist

    from ds_dhelix.runtime.spawn import free_port

    started = not dist.is_initialized()
    if started:
        index = device.index if device.index is not None else torch.cuda.current_device()
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", index),
        )  # torch 2.11 wants the index
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()


def check_device_events(device, size_mib: int = 512, reps: int = 40) -> dict:
    """``comm.Pending``'s CUDA events on a one-rank NCCL world: a collective waited at once is
    exposed for about its whole duration; one launched before a matmul chain longer than itself
    is hidden (exposed ~ 0). The host never blocks in either case."""
    import torch.distributed as dist

    from ds_dhelix.runtime.comm import Pending

    with one_rank_world(device):
        x = torch.ones(size_mib * 2**18, device=device)
        out = torch.empty_like(x)
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

        def one(hidden: bool) -> tuple[float, float, float]:
            _sync(device)
            p = Pending(dist.all_to_all_single(out, x, async_op=True), out)
            if hidden:
                y = a
                for _ in range(reps):
                    y = y @ a
            p.wait()
            host_wait = p.waited_s
            _sync(device)
            busy, exposed = p.device_events.times_s()
            return busy * 1e3, exposed * 1e3, host_wait * 1e3

        one(False)  # warm-up (NCCL's first call sets up the communicator)
        busy_a, exposed_a, host_a = one(False)
        busy_b, exposed_b, host_b = one(True)
        return {
            "waited_at_once": {
                "busy_ms": round(busy_a, 3),
                "exposed_ms": round(exposed_a, 3),
                "host_wait_ms": round(host_a, 3),
            },
            "behind_compute": {
                "busy_ms": round(busy_b, 3),
                "exposed_ms": round(exposed_b, 3),
                "host_wait_ms": round(host_b, 3),
            },
            "exposed_share_at_once": round(exposed_a / max(busy_a, 1e-9), 3),
            "exposed_share_hidden": round(exposed_b / max(busy_b, 1e-9), 3),
        }


def check_tutel_kernels(
    device, tokens: int = 8192, hidden: int = 2048, experts: int = 8, top_k: int = 2, reps: int = 10
) -> dict:
    """torch's and tutel's dispatch / combine kernels on the same routes (``ds_dhelix.moe.kernels``)."""
    from ds_dhelix.moe.kernels import make_kernels
    from ds_dhelix.moe.router import route_tokens

    kernels = {name: make_kernels(name) for name in ("torch", "tutel")}
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(tokens, experts, generator=gen).to(device)
    weights, selected = torch.topk(logits.softmax(-1), top_k)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype).requires_grad_()
        runs = {}
        for name, k in kernels.items():

            def step(k=k, x=x):
                xs, route = route_tokens(x, selected, experts, None, k)
                y = k.decode(xs, weights, route)
                y.backward(torch.ones_like(y))
                return xs.detach(), y.detach()

            runs[name] = step() + (round(_timed_ms(step, device, reps), 3),)
        (xs_a, y_a, ms_a), (xs_b, y_b, ms_b) = runs["torch"], runs["tutel"]
        out[str(dtype).removeprefix("torch.")] = {
            "buffer_equal": torch.equal(xs_a, xs_b),
            "combined_equal": torch.equal(y_a, y_b),
            "combined_max_diff": float((y_a.float() - y_b.float()).abs().max()),
            "torch_ms": ms_a,
            "tutel_ms": ms_b,
        }
    return {"tokens": tokens, "hidden": hidden, "experts": experts, "top_k": top_k, **out}


def check_tutel_overlap(
    device, tokens: int = 16384, hidden: int = 2048, ffn: int = 4096, experts: int = 8, reps: int = 10
) -> dict:
    """tutel's MoE layer (bf16) at a2a_ffn_overlap_degree 1, 2, 4 on a one-rank world."""
    from tutel import moe as tutel_moe

    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    out = {}
    with one_rank_world(device):
        layer = tutel_moe.moe_layer(
            gate_type={"type": "top", "k": 2, "capacity_factor": 1.0},
            experts={
                "type": "ffn",
                "count_per_node": experts,
                "hidden_size_per_expert": ffn,
                "activation_fn": torch.nn.functional.silu,
            },  # (its default names F unimported)
            model_dim=hidden,
        ).to(device, torch.bfloat16)
        for degree in (1, 2, 4):

            def step(degree=degree):
                layer(x, a2a_ffn_overlap_degree=degree).float().sum().backward()

            out[f"overlap{degree}_ms"] = round(_timed_ms(step, device, reps), 3)
    return {"tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts, "ranks": 1, **out}


ROOFLINE_SHAPES = {
    "cuda": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        batch=2,
        seq=2048,
    ),
    "cpu": dict(
        hidden_size=128,
        intermediate_size=352,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        batch=2,
        seq=64,
    ),
}


class _CurrentOp:
    """Stands in for the executor's watchdog: remembers the op it is running (``beat``)."""

    def __init__(self):
        self.op = "-"

    def beat(self, **where) -> None:
        self.op = where.get("op", self.op)


@contextlib.contextmanager
def recorded_syncs(current: _CurrentOp, found: dict):
    """``torch.cuda.set_sync_debug_mode("warn")`` inside; every synchronizing CUDA call (a device
    tensor's value read on the host, a blocking copy, ``nonzero``...) counted in ``found`` by the
    executor's op that made it (a backward's syncs arrive with its op: autograd replays the device
    thread's warnings on the calling thread)."""
    import warnings

    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            key = f"{current.op}: {filename.rsplit('/', 1)[-1]}:{lineno}"
            found[key] = found.get(key, 0) + 1

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _si_step_syncs(model, batches) -> dict:
    """Synchronizing CUDA calls in the second reactive SI step on ``model``'s op graph (the first
    warms up), and whether its losses are the sequential schedule's bit for bit."""
    batches = [{**b, "loss_denominator": float(b["input_ids"].numel())} for b in batches]  # as the training loop
    seq_model = copy.deepcopy(model)
    seq = Executor(adapter_for(seq_model.config).build_graph(seq_model)).run_microbatches(
        batches, "sequential", 1 / len(batches)
    )
    current, found = _CurrentOp(), {}
    ex = Executor(adapter_for(model.config).build_graph(model), watchdog=current)
    ex.run_microbatches(batches, "si", 1 / len(batches))  # warm-up
    model.zero_grad(set_to_none=True)
    with recorded_syncs(current, found):
        mbs = ex.run_microbatches(batches, "si", 1 / len(batches))
    torch.cuda.synchronize()
    return {
        "syncs": sum(found.values()),
        "where": found,
        "si_losses_bitwise": all(torch.equal(a.loss, b.loss) for a, b in zip(mbs, seq)),
    }


def _dropless_bodies_syncs(device) -> dict:
    """The dropless per-layer path on a one-rank NCCL world: moe.counts (its ``HostCopies`` copy
    ordered after the exchange), moe.dispatch (the one read: an event, not a device sync), the
    experts' regrouping, moe.combine, forward and backward."""
    import torch.distributed as dist

    from ds_dhelix.moe.dispatch import CountExchange, ExpertAllToAll
    from ds_dhelix.moe.router import route_tokens
    from ds_dhelix.runtime.groups import ExpertGroups

    with one_rank_world(device):
        groups = ExpertGroups(size=1, group=dist.group.WORLD, count_group=dist.group.WORLD)
        counts, dispatch, combine = (
            CountExchange(0, groups),
            ExpertAllToAll(0, groups, True),
            ExpertAllToAll(0, groups, False),
        )
        current, found, ok = _CurrentOp(), {}, []
        for step in range(2):  # the first warms up (NCCL's communicator, pinned host blocks)
            x = torch.randn(4096, 1024, device=device)
            selected = torch.randint(0, 8, (4096, 2), device=device)
            with recorded_syncs(current, found) if step else contextlib.nullcontext():
                xs, route = route_tokens(x, selected, 8)
                side = {"moe": {0: route}}
                back = combine.forward(dispatch.forward(counts.forward(xs, side).wait(), side).wait(), side).wait()
                grad = dispatch.backward(combine.backward(back, side).wait(), side).wait()
            ok.append(torch.equal(back, xs) and torch.equal(grad, xs))
        return {"syncs": sum(found.values()), "where": found, "round_trip_equal": all(ok)}


def check_host_syncs(device, micro_batches: int, size: int, seq: int) -> dict:
    """No host sync in a steady-state SI step: ``set_sync_debug_mode("warn")`` around the second SI
    step of tiny-llama and tiny-mixtral (one GPU: EP=1; bf16 runs the grouped GEMM, its offsets on
    the device; fp32 the loop over experts, its sizes read through ``HostCopy``), and the dropless
    counts -> dispatch -> combine path on a one-rank NCCL world (what each EP > 1 layer runs).
    Expected: 0 syncs everywhere. One GPU has no EP=2: the CPU test ``tests/test_host_syncs.py``
    counts the reads there."""
    out = {}
    for name, preset, dtype in (
        ("tiny-llama", "tiny-llama", torch.float32),
        ("tiny-mixtral-bf16", "tiny-mixtral", torch.bfloat16),
        ("tiny-mixtral-fp32", "tiny-mixtral", torch.float32),
    ):
        model = build_model(preset, seed=1234, dtype=dtype)[0].to(device)
        out[name] = _si_step_syncs(model, make_batches(model.config.vocab_size, micro_batches, size, seq, device))
    out["dropless_bodies"] = _dropless_bodies_syncs(device)
    out["total_syncs"] = sum(v["syncs"] for v in out.values())
    return out


def _timed_ms(fn, device, reps: int = 5) -> float:
    """Median ms of ``fn()`` (CUDA events on a GPU), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _op_times(graph, side: dict, device) -> dict:
    """(block, op) -> (forward ms, backward ms: input and weight gradient) of every op, alone."""
    env, out = {}, {}
    for b, block in enumerate(graph.blocks):
        for op in block:
            args = [env[k] for k in op.inputs]
            fwd = _timed_ms(lambda op=op, args=args: op.fn(side, *args), device)
            leaves = [a.detach().requires_grad_(a.is_floating_point()) for a in args]

            def backward(op=op, leaves=leaves):
                outs = [o for o in op.fn(side, *leaves) if o.requires_grad]
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

            both = _timed_ms(backward, device)
            with torch.no_grad():
                env.update(zip(op.outputs, op.fn(side, *args)))
            out[(b, op.name)] = (fwd, max(both - fwd, 0.0))
    return out


def check_roofline(device) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_dhelix.config.dims import ParallelDims
    from ds_dhelix.predict.costs import block_context, kernel_ms
    from ds_dhelix.predict.hardware import load_hardware
    from ds_dhelix.predict.roofline import op_work
    from ds_dhelix.predict.shapes import ModelOutline, OpLine, RunLayout, model_shape

    sizes = dict(ROOFLINE_SHAPES[device.type])
    batch, seq = sizes.pop("batch"), sizes.pop("seq")
    config = AutoConfig.for_model(
        "llama",
        num_hidden_layers=1,
        head_dim=sizes["hidden_size"] // sizes["num_attention_heads"],
        max_position_embeddings=seq,
        **sizes,
    )
    dtype = "bf16" if device.type == "cuda" else "fp32"
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32, attn_implementation="sdpa"
    ).to(device)
    graph = adapter_for(config).build_graph(model)
    ids = torch.randint(3, config.vocab_size, (batch, seq), device=device)
    measured = _op_times(graph, graph.make_side({"input_ids": ids, "labels": ids}), device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    preset = next((p for p in ("H200", "H100", "A800", "A40") if p in name), "H100")
    hw, shape = load_hardware(preset), model_shape(config)
    outline = ModelOutline(tuple(tuple(OpLine(o.name, o.is_comm, o.linear) for o in b) for b in graph.blocks), (None,))
    layout = RunLayout(ParallelDims(1), seq, batch, 1, dtype)
    ops, gemm_eff = {}, {}
    for (b, op_name), (fwd, bwd) in measured.items():
        work = op_work(op_name, block_context(shape, layout, outline, b))
        pf = sum(kernel_ms(hw, k, dtype) for k in work.fwd)
        pb = sum(kernel_ms(hw, k, dtype) for k in work.bwd + work.wgrad)
        ops[op_name] = {
            "fwd_ms": round(fwd, 4),
            "fwd_pred_ms": round(pf, 4),
            "bwd_ms": round(bwd, 4),
            "bwd_pred_ms": round(pb, 4),
        }
        flops = sum(k.flops for k in work.fwd if k.kind == "gemm")
        if flops and op_name != "mlp.down":
            gemm_eff[op_name] = round(flops / (fwd / 1e3) / hw.gpu.peak_flops(dtype), 3)
    total = sum(v["fwd_ms"] + v["bwd_ms"] for v in ops.values())
    pred = sum(v["fwd_pred_ms"] + v["bwd_pred_ms"] for v in ops.values())
    return {
        "preset": preset,
        "dtype": dtype,
        "tokens": batch * seq,
        "ops": ops,
        "measured_ms": round(total, 3),
        "predicted_ms": round(pred, 3),
        "measured_over_predicted": round(total / pred, 3),
        "gemm_efficiency_reached": gemm_eff,
        "gemm_efficiency_assumed": hw.assumptions.gemm_efficiency,
    }


TOTAL_BUDGET_S = 420
"""The whole script's time (under the 8 minutes a lent device allows for it): a check that would
start after it is ``skipped`` ("out of time")."""
BUDGET_S = {"two_ranks": 200, "layer_shapes": 150, "host_syncs": 90, "roofline": 90, "step_time": 90}
"""Each check's own bound (default ``DEFAULT_BUDGET_S``): past it the check fails as timed out."""
DEFAULT_BUDGET_S = 60


def _errors(value, path: str = "") -> list[str]:
    """Every ``error`` entry in a row, nested ones included (a case inside a check that failed)."""
    if isinstance(value, dict):
        found = [f"{path or 'check'}: {value['error']}"] if "error" in value else []
        return found + [e for k, v in value.items() if k != "error" for e in _errors(v, f"{path}.{k}".lstrip("."))]
    return []


def _bitwise_cases(row: dict) -> str | None:
    """The parity rows' verdict: every compared case bitwise (a skipped case aside)."""
    bad = [k for k, v in row.items() if isinstance(v, dict) and "bitwise" in v and not v["bitwise"]]
    return f"not bitwise: {', '.join(bad)}" if bad else None


HOLDS = {
    "parity": _bitwise_cases,
    "two_ranks": _bitwise_cases,
    "profiler": lambda r: None if r["spans"] > 0 and not r["missing_ranges"] else "op spans without profiler ranges",
    "host_syncs": lambda r: None if r["total_syncs"] == 0 else f"{r['total_syncs']} host syncs in a step",
    "planner_clock": lambda r: None if r["reduced"] == [1.0, 2.0] else f"reduced {r['reduced']}, not [1.0, 2.0]",
    "tutel_kernels": lambda r: (
        None
        if r["float32"]["buffer_equal"] and r["float32"]["combined_equal"]
        else "tutel's kernels differ from torch's in fp32"
    ),
}
"""What must hold for a check's row to be ``ok`` (None: it held; else why not). A check without an
entry holds when it ran to the end (it measures, it does not judge)."""


class _TimedOut(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """``_TimedOut`` in this (main) thread after ``seconds`` (SIGALRM; no bound where it is missing)."""
    import signal

    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(signum, frame):
        raise _TimedOut(f"timed out after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Report:
    """The rows of one run: each check ``ok`` only when it ran and held, ``skipped`` (ok null) with
    why when it cannot run here, ``ok: false`` with the error or what did not hold; every row goes
    to ``<out>/gpu_checks.json`` as soon as it exists, so a failure anywhere leaves what ran."""

    def __init__(self, out_dir: str | None, device: torch.device, total_s: float | None = None):
        self.out_dir, self.device, self.rows = out_dir, device, []
        self.total_s = TOTAL_BUDGET_S if total_s is None else total_s
        self.deadline = time.perf_counter() + self.total_s

    def skip(self, name: str, why: str) -> None:
        self.add({"check": name, "ok": None, "skipped": why, "wall_s": 0.0})

    def run(self, name: str, fn, needs_cuda: bool = False) -> None:
        if needs_cuda and self.device.type != "cuda":
            return self.skip(name, "needs CUDA")
        left = self.deadline - time.perf_counter()
        if left < 5:
            return self.skip(name, f"out of time: the script's {self.total_s:g} s were spent")
        t0 = time.perf_counter()
        try:
            with _time_limit(min(BUDGET_S.get(name, DEFAULT_BUDGET_S), left)):
                row = {"check": name, **fn()}
            problems = _errors(row)
            verdict = None if problems or "skipped" in row else HOLDS.get(name, lambda r: None)(row)
            row["ok"] = None if "skipped" in row and not problems else not problems and verdict is None
            if problems or verdict:
                row["failed"] = "; ".join(problems + ([verdict] if verdict else []))
        except Exception as err:  # report and go on: one run should say as much as it can
            row = {"check": name, "ok": False, "error": f"{type(err).__name__}: {err}"}
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        self.add(row)

    def add(self, row: dict) -> None:
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        if self.out_dir:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, "gpu_checks.json"), "w") as f:
                json.dump(self.rows, f, indent=1)

    @property
    def failed(self) -> bool:
        return any(r["ok"] is False for r in self.rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="timed steps per schedule (median)")
    p.add_argument("--out", default=None, help="directory for gpu_checks.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    report = Report(args.out, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report.run("env", lambda: {"torch": torch.__version__, "device": args.device, "name": name})
    try:
        ref = build_model(args.model, seed=1234)[0].to(device)
        batches = make_batches(ref.config.vocab_size, args.micro_batches, args.micro_batch_size, args.seq_len, device)
    except Exception as err:  # the checks below need them: say so, with what ran written
        report.add({"check": "setup", "ok": False, "error": f"{type(err).__name__}: {err}"})
        return 1
    run_checks(report, args, ref, batches, device)
    return 1 if report.failed else 0


def run_checks(report: Report, args, ref, batches, device) -> None:
    cuda = device.type == "cuda"
    report.run("parity", lambda: check_parity(ref, batches))
    report.run("step_time", lambda: check_step_time(ref, batches, args.steps, device))
    report.run("profiler", lambda: check_profiler(ref, batches, device, args.out))
    report.run("stream_overlap", lambda: check_stream_overlap(device), needs_cuda=True)
    report.run("device_events", lambda: check_device_events(device), needs_cuda=True)
    report.run(
        "connections",
        lambda: {
            "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "warning": cuda_connections_warning(device),
        },
        needs_cuda=True,
    )
    report.run("host_syncs", lambda: check_host_syncs(device, args.micro_batches, 2, 256), needs_cuda=True)
    report.run("roofline", lambda: check_roofline(device))
    report.run("planner_clock", lambda: check_planner_clock(ref, batches[0], device))
    report.run("two_ranks", lambda: check_two_ranks(device, timeout=90))
    report.run(
        "layer_shapes", lambda: check_layer_shapes(device, args.steps) if cuda else check_layer_shapes(device, 1, 2)
    )
    missing = tutel_missing()
    if missing:
        report.skip("tutel_kernels", missing)
        report.skip("tutel_overlap", missing)
        return
    small = {} if cuda else {"tokens": 256, "hidden": 64, "reps": 2}
    report.run("tutel_kernels", lambda: check_tutel_kernels(device, **small))
    report.run("tutel_overlap", lambda: check_tutel_overlap(device), needs_cuda=True)


if __name__ == "__main__":
    sys.exit(main())
