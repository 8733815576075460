"""``layer_shapes``, one check of ``scripts/gpu_checks.py``: the executor at the per-rank shapes of a
large run, on one GPU.

Two layers as one rank of a big job holds them (bf16, seq 4096; on CPU a tiny stand-in of each):

    llama-tp8    a Llama-3-8B layer's TP=8 share: hidden 4096, 4 query heads and 1 KV head of 128,
                 FFN 1792
    moe-ep8      a Qwen3-30B-A3B layer's EP=8 share: hidden 2048, 32 / 4 heads of 128, 16 local
                 experts of FFN 768, top-8 (a rank's expert rows as EP=8 gives them on average)

For each: plain HF forward + backward against the executor's sequential and SI steps (weight
gradients deferred), the step's median time, the host's time to launch it (the step before its
final synchronisation), the share of compute ops that found the GPU idle at launch
(``StepStats.starved_share``) and autograd engine calls per op backward. Then the same layer with
fake collectives where the TP / EP run has its own (``attn.ag`` / ``attn.rs`` / ``mlp.ag`` /
``mlp.rs``; the MoE dispatch and combine): ``torch.cuda._sleep`` on a side stream for the length
``dhelix predict`` gives that collective on H100 NVLink, the compute stream waiting on it where the
result is needed: how much of that time sequential and SI expose (``hidden`` = 1 − added step time
/ fake collective time). On CPU a fake collective completes its length after launch (a dry run).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ds_dhelix.graph.fuse import fuse
from ds_dhelix.graph.model_graph import ModelGraph, comm
from ds_dhelix.runtime.comm import Pending
from ds_dhelix.runtime.executor import Executor
from ds_dhelix.verify import random_batches
from hf_models.adapters import adapter_for

LAYERS = {
    "llama-tp8": dict(
        model_type="llama",
        cuda=dict(hidden_size=4096, intermediate_size=1792, num_attention_heads=4, num_key_value_heads=1),
        cpu=dict(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1),
        # (op it follows, key it reads and writes, the collective of the TP run it stands for)
        fakes=(
            ("attn.norm", "x", "attn.ag"),
            ("attn.out", "ao", "attn.rs"),
            ("mlp.norm", "x2", "mlp.ag"),
            ("mlp.down", "mo", "mlp.rs"),
        ),  # fmt: skip
        predict=("llama-3-8b.json", 8, 1),
    ),
    "moe-ep8": dict(
        model_type="qwen3_moe",
        cuda=dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            intermediate_size=6144,
            num_attention_heads=32,
            num_key_value_heads=4,
            num_experts=16,
            num_experts_per_tok=8,
        ),
        cpu=dict(
            hidden_size=64,
            moe_intermediate_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        fakes=(("moe.router", "xs", "moe.dispatch"), ("moe.experts.down", "ys", "moe.combine")),
        predict=("qwen3-30b-a3b.json", 1, 8),
    ),
}
SEQ = {"cuda": 4096, "cpu": 32}


class _EventWork:
    """A fake collective's completion: an event on its side stream (CUDA)."""

    def __init__(self, event):
        self.event = event

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return self.event.query()


class _TimedWork:
    """A fake collective's completion on CPU: its length after launch."""

    def __init__(self, ms: float):
        self.done_at = time.perf_counter() + ms / 1e3

    def wait(self) -> bool:
        time.sleep(max(self.done_at - time.perf_counter(), 0.0))
        return True

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.done_at


class FakeCollective:
    """A COMM op body that takes ``ms`` on a side stream (``torch.cuda._sleep``) and returns its
    input unchanged, forward and backward."""

    strand_safe = True
    lane = "comm:fake"

    def __init__(self, ms: float, device: torch.device, cycles_per_ms: float):
        self.ms, self.cycles = ms, int(ms * cycles_per_ms)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _launch(self, x: torch.Tensor) -> Pending:
        if self.stream is None:
            return Pending(_TimedWork(self.ms), x)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(self.cycles)
            event = torch.cuda.Event()
            event.record()
        return Pending(_EventWork(event), x)

    def forward(self, x, side, channel: int = 0) -> Pending:
        return self._launch(x)

    def backward(self, g, side, channel: int = 0) -> Pending:
        return self._launch(g)


def cycles_per_ms(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10**6)  # warm-up
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    return 10**8 / start.elapsed_time(end)


def with_fakes(graph: ModelGraph, fakes: tuple, lengths: dict, device, per_ms: float) -> ModelGraph:
    """``graph`` with a fake collective after each ``(op name, key, collective)`` of ``fakes`` in
    every layer (reading and writing ``key``), ``lengths[collective]`` ms long."""
    blocks = []
    for b, ops in enumerate(graph.blocks):
        out = []
        for op in ops:
            out.append(op)
            for name, key, collective in fakes:
                if 0 < b < len(graph.blocks) - 1 and op.name == name:
                    body = FakeCollective(lengths[collective], device, per_ms)
                    out.append(comm(f"fake.{collective}", body, key, key))
        blocks.append(out)
    return dataclasses.replace(graph, blocks=blocks)


def predicted_comm_ms(config_file: str, tp: int, ep: int) -> dict:
    """``dhelix predict``'s H100 time of each collective of one layer by name (the longer of its
    forward and backward)."""
    import os

    from ds_dhelix.config.dims import ParallelDims
    from ds_dhelix.predict.costs import roofline_times
    from ds_dhelix.predict.hardware import load_hardware
    from ds_dhelix.predict.shapes import RunLayout, model_shape
    from hf_models.outline import config_of, model_outline

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = config_of(os.path.join(root, "benchmarks", "results", "predict", "configs", config_file))
    dims = ParallelDims(8, tp=tp, ep=ep)
    times = roofline_times(
        model_outline(config, dims), model_shape(config), RunLayout(dims, 4096, 1, 8, "bf16", 1), load_hardware("H100")
    )
    return {o.name: max(o.fwd_ms, o.bwd_ms) for o in times.blocks[1] if o.comm}


def _model(spec: dict, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = spec[device.type]
    config = AutoConfig.for_model(
        spec["model_type"], num_hidden_layers=1, head_dim=128 if device.type == "cuda" else 32, vocab_size=1024,
        max_position_embeddings=SEQ[device.type], **sizes
    )  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def against_sequential(seq: tuple, other: tuple) -> dict:
    """``(losses, {name: grad})`` of a run against sequential's: bitwise or not, largest gradient
    difference."""
    (seq_l, seq_g), (losses, grads) = seq[:2], other[:2]
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(losses, seq_l))
        and seq_g.keys() == grads.keys()
        and all(torch.equal(grads[k], seq_g[k]) for k in seq_g),
        "max_abs_grad_diff": max(float((grads[k] - seq_g[k]).abs().max()) for k in seq_g),
    }


def _time_steps(run, device, steps: int) -> dict:
    """Median step ms, median host ms (until ``run`` returns, before the final synchronisation)."""
    run()  # warm-up
    walls, hosts = [], []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        run()
        hosts.append(time.perf_counter() - t0)
        sync(device)
        walls.append(time.perf_counter() - t0)
    return {"step_ms": round(statistics.median(walls) * 1e3, 3), "host_ms": round(statistics.median(hosts) * 1e3, 3)}


def _layer_row(spec: dict, device, steps: int, micro_batches: int) -> dict:
    model = _model(spec, device)
    seq = SEQ[device.type]
    batches = random_batches(model.config.vocab_size, micro_batches, 1, seq, device=device)
    row = {}

    def hf():
        for p in model.parameters():
            p.grad = None
        for b in batches:
            (model(input_ids=b["input_ids"], labels=b["labels"]).loss / len(batches)).backward()

    row["hf"] = _time_steps(hf, device, steps)
    graph = adapter_for(model.config).build_graph(model)
    per_ms = cycles_per_ms(device)
    lengths = predicted_comm_ms(*spec["predict"])
    # fused runs, as the engine runs them (``fuse_ops``); the fakes are collectives, so they cut runs
    fake_graph = fuse(with_fakes(graph, spec["fakes"], lengths, device, per_ms))
    graph = fuse(graph)
    for mode in ("sequential", "si"):
        for name, g in ((mode, graph), (f"{mode}+fakes", fake_graph)):
            ex = Executor(g, None, defer_weight_grads=mode == "si")

            def step(ex=ex, mode=mode):
                for p in model.parameters():
                    p.grad = None
                ex.start_step()
                ex.run_microbatches(list(batches), mode, 1 / len(batches))

            row[name] = _time_steps(step, device, steps)
            stats = ex.stats
            row[name]["starved_share"] = None if stats.starved_share is None else round(stats.starved_share, 3)
    fake_ms = sum(lengths[c] for _, _, c in spec["fakes"]) * 2 * micro_batches  # both directions
    row["fake_collectives"] = {
        "per_step": len(spec["fakes"]) * 2 * micro_batches,
        "lengths_ms": {c: round(lengths[c], 4) for _, _, c in spec["fakes"]},
        "step_ms": round(fake_ms, 3),
    }
    for mode in ("sequential", "si"):
        added = row[f"{mode}+fakes"]["step_ms"] - row[mode]["step_ms"]
        row[f"{mode}_hidden"] = round(1 - added / fake_ms, 3)
    row["sequential_vs_hf"] = round(row["sequential"]["step_ms"] / row["hf"]["step_ms"], 3)
    row["si_vs_hf"] = round(row["si"]["step_ms"] / row["hf"]["step_ms"], 3)
    return row


def check_layer_shapes(device: torch.device, steps: int = 5, micro_batches: int = 4) -> dict:
    return {name: _layer_row(spec, device, steps, micro_batches) for name, spec in LAYERS.items()}


def check_planner_clock(model, batch: dict, device: torch.device) -> dict:
    """The planner's ``StreamClock`` on this device: one layer's co-executed round timed by it
    (events on CUDA) beside the host's time to launch the same round, and its world reduction on
    a one-rank world of the device's backend (NCCL takes CUDA tensors only)."""
    import torch.distributed as dist

    from ds_dhelix.runtime.profiler import LayerProbe

    probe = LayerProbe(adapter_for(model.config).build_graph(model), batch)
    full = (0, probe.n)
    probe.time_round(full, full)  # warm-up
    clocked, launched = [], []
    for _ in range(5):
        ex, blk = probe.executor, probe.block
        f, b = probe._strands()
        sync(device)
        t0, c0 = time.perf_counter(), probe.clock.start()
        ex.run_round(ex.tasks(b, blk, True), ex.tasks(f, blk, False))
        launched.append(time.perf_counter() - t0)
        clocked.append(probe.clock.stop(c0))
    own = not dist.is_initialized()
    if own:
        from ds_dhelix.runtime.spawn import free_port

        backend = "nccl" if device.type == "cuda" else "gloo"
        index = (
            device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
        )
        kw = {"device_id": torch.device("cuda", index)} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kw)
    try:
        reduced = probe.clock.reduce_max([1.0, 2.0])
    finally:
        if own:
            dist.destroy_process_group()
    return {
        "clock": "cuda events" if probe.clock.cuda else "perf_counter",
        "round_ms": round(statistics.median(clocked) * 1e3, 3),
        "host_launch_ms": round(statistics.median(launched) * 1e3, 3),
        "reduced": reduced,
    }


TWO_RANK_CASES = {"tiny-llama-tp2": ("tiny-llama", 2, 1), "tiny-mixtral-ep2": ("tiny-mixtral", 1, 2)}


def _two_rank_case(rank, world, preset: str, tp: int, ep: int, device_type: str) -> dict:
    """One rank of a TP / EP pair on one device: sequential and SI steps through the executor,
    losses and every gradient bitwise or not (gloo carries the collectives, CUDA tensors on a GPU)."""
    import copy

    from ds_dhelix.config.dims import ParallelDims
    from ds_dhelix.runtime.groups import ProcessGroups
    from hf_models.registry import build_model

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    lay = ProcessGroups.create(ParallelDims(world, tp=tp, ep=ep))
    ref, _ = build_model(preset, seed=0, num_layers=2)
    runs = {}
    for schedule in ("sequential", "si"):
        model = copy.deepcopy(ref).to(device)
        extra = {"ep_groups": lay.expert_groups()} if ep > 1 else {}
        graph = fuse(adapter_for(model.config).build_graph(model, tp, lay.tp_rank, lay.tp, lay.tp_grad_group, **extra))
        batches = random_batches(model.config.vocab_size, 4, 1, 32, seed=1 + rank // tp, device=device)
        t0 = time.perf_counter()
        mbs = Executor(graph).run_microbatches(batches, schedule, 1 / len(batches))
        sync(device)
        runs[schedule] = (
            [mb.loss.detach() for mb in mbs],
            {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            time.perf_counter() - t0,
        )
    return against_sequential(runs["sequential"], runs["si"]) | {
        "sequential_s": round(runs["sequential"][2], 3),
        "si_s": round(runs["si"][2], 3),
    }


def check_two_ranks(device: torch.device, timeout: int = 240) -> dict:
    """Two processes on the one device, TP=2 and EP=2 over gloo (CUDA tensors on a GPU, where this
    machine's gloo takes them): the CUDA branch of the executor's collectives (device events, the
    side-stream host copies of MoE split sizes) for parity and no hang (a hang fails by the timeout)."""
    import importlib.util

    from ds_dhelix.runtime.spawn import run_ranks

    out = {}
    for name, (preset, tp, ep) in TWO_RANK_CASES.items():
        if ep > 1 and importlib.util.find_spec("deepspeed") is None:  # (its expert groups: runtime/groups.py)
            out[name] = {"skipped": "EP's groups are DeepSpeed's (ds_dhelix/runtime/groups.py), not installed here"}
            continue
        try:
            ranks = run_ranks(_two_rank_case, 2, args=(preset, tp, ep, device.type), timeout=timeout)
            out[name] = {"bitwise": all(r["bitwise"] for r in ranks), "ranks": ranks}
        except Exception as err:  # gloo without CUDA support, a hang: say which
            out[name] = {"error": f"{type(err).__name__}: {str(err)[-400:]}"}
    return out
