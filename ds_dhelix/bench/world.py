"""The measurement itself: on every rank, build each mode's runner, warm them up, then run the
modes step by step in rotating order and collect per-step records on rank 0.

    rep 0:  deepspeed autotp sequential si si-planned
    rep 1:  autotp sequential si si-planned deepspeed
    ...                                 (rotation: drifting machine load hits every mode alike)

``measure_link(opts, gbps)`` runs the whole world in a child process behind an emulated link
(``ds_dhelix.runtime.linkemu``): real TCP through gloo at ``gbps`` Gbit/s, or unshaped for None.
"""

from __future__ import annotations

import time
import traceback

import torch
import torch.distributed as dist

from ..verify import random_batches
from .modes import SkipMode, build_runner
from .options import BenchOptions


def make_batches(opts: BenchOptions, vocab: int) -> list[dict]:
    """The step's micro-batches (all data-parallel groups'): deterministic random tokens
    (``verify.random_batches``), reused every step and mode; each mode takes its rank's share."""
    return random_batches(vocab, opts.step_micro_batches, opts.micro_batch_size, opts.seq_len, seed=opts.seed + 1)


def _all_ranks(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _failure(err: BaseException) -> tuple[str, str]:
    if isinstance(err, SkipMode):
        return "skipped", str(err)
    last = traceback.format_exception_only(type(err), err)[-1].strip()
    return "error", last[:500]


def _guarded(fn):
    """Run ``fn`` on every rank; ``(value, None)`` or ``(None, (status, reason))`` agreed by all."""
    try:
        value, failure = fn(), None
    except Exception as err:  # noqa: BLE001 -- the reason goes into the result row
        value, failure = None, _failure(err)
    if not _all_ranks(failure is None):
        return None, failure or ("error", "failed on another rank")
    return value, None


def _timed_step(runner, batches) -> dict:
    """One step: wall time, and CPU time of this rank's process and of its main (compute) thread;
    the difference is what gloo's threads and the kernel's TCP work cost this rank."""
    dist.barrier()
    t0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
    record = runner.step(batches)
    record["step_s"] = time.perf_counter() - t0
    record["cpu_s"] = time.process_time() - cpu0
    record["main_thread_cpu_s"] = time.thread_time() - main0
    return record


def _warm_up(runner, batches, steps: int) -> float | None:
    """``steps`` untimed steps, then any the runner needs to settle (``auto``'s trial phase); the
    first step's loss (every mode starts from the same model on the same batches; None: no step)."""
    first = None
    for _ in range(steps):
        record = _timed_step(runner, batches)
        first = record.get("loss") if first is None else first
    while getattr(runner, "settling_steps", 0):
        _timed_step(runner, batches)
    return first


def build_runners(opts: BenchOptions, batches: list[dict], gbps: float | None) -> tuple[dict, dict]:
    """``(runners, outcome)``: runners that built and warmed up on every rank; per mode its status."""
    runners, outcome = {}, {}
    for mode in opts.modes:
        t0 = time.perf_counter()
        runner, failure = _guarded(lambda m=mode: build_runner(opts, m, batches[0], gbps))
        build_s = time.perf_counter() - t0
        outcome[mode] = {"status": "ok", "reason": None, "build_s": build_s}
        if failure is not None:
            outcome[mode].update(status=failure[0], reason=failure[1])
            continue
        outcome[mode]["info"] = runner.info
        runners[mode] = runner
    return runners, outcome


def rank_main(rank: int, world: int, opts: BenchOptions, gbps: float | None):
    """Per rank: build, warm up, measure. Rank 0 returns ``{"modes": {mode: {...}}}``."""
    from hf_models.registry import load_config

    batches = make_batches(opts, load_config(opts.model).vocab_size)
    runners, outcome = build_runners(opts, batches, gbps)
    for mode, runner in list(runners.items()):  # warm-up (and auto's trials); a mode failing here is dropped
        first, failure = _guarded(lambda r=runner: _warm_up(r, batches, opts.warmup))
        outcome[mode]["first_step_loss"] = first
        if failure is not None:
            outcome[mode].update(status=failure[0], reason=f"warm-up step failed: {failure[1]}")
            runners.pop(mode)
        elif hasattr(runner, "settled_info"):
            outcome[mode]["info"] = {**outcome[mode].get("info", {}), **runner.settled_info()}
    records = {mode: [] for mode in runners}
    order = list(runners)
    for rep in range(opts.repeats if order else 0):
        k = rep % len(order)
        for mode in order[k:] + order[:k]:
            records[mode].append(_timed_step(runners[mode], batches))
            if outcome[mode]["first_step_loss"] is None:  # no warm-up: the first timed step is the first
                outcome[mode]["first_step_loss"] = records[mode][-1].get("loss")
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    for runner in runners.values():
        runner.close()
    if rank != 0:
        return None
    for mode in runners:
        outcome[mode]["steps"] = combine_ranks([g[mode] for g in gathered])
    return {"modes": outcome, "world": world, "device": _device_name(), "cpu_cores": _cpu_cores()}


def _cpu_cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _device_name() -> str:
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return name


def combine_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """One record per step from every rank's: the slowest rank's step time, the mean of compute /
    comm / exposed / CPU time, the largest activation peak."""
    steps = []
    for recs in zip(*per_rank):
        peaks = [r["peak_activation_bytes"] for r in recs if r.get("peak_activation_bytes") is not None]
        step = {
            "step_s": max(r["step_s"] for r in recs),
            "peak_activation_bytes": max(peaks, default=None),
            "loss": recs[0].get("loss"),
        }
        gathered = [r["peak_gathered_bytes"] for r in recs if r.get("peak_gathered_bytes") is not None]
        if gathered:  # (ZeRO-3 under the op graph)
            step["peak_gathered_bytes"] = max(gathered)
        for key in ("compute_s", "comm_s", "exposed_s", "cpu_s", "main_thread_cpu_s", "dp_reduce_s", "dp_exposed_s"):
            values = [r.get(key) for r in recs]
            if key in recs[0]:
                step[key] = None if None in values else sum(values) / len(values)
        steps.append(step)
    return steps


def _link_main(opts: BenchOptions, gbps: float | None) -> dict:
    """Inside the link's namespace: start the world, return rank 0's result."""
    from ds_dhelix.runtime.spawn import run_ranks

    return run_ranks(rank_main, opts.world, args=(opts, gbps), timeout=opts.timeout)[0]


def measure_link(opts: BenchOptions, gbps: float | None) -> dict:
    """All modes at one link rate: ``{"modes": ..., "shaped": bool, "wall_s": ...}``; a world that
    fails or hangs gives ``{"error": "..."}`` instead of raising."""
    from ds_dhelix.runtime.linkemu import link_emulation_available, run_in_link

    shaped = gbps is not None and link_emulation_available()[0]
    t0, load0 = time.perf_counter(), _loadavg()
    try:
        result = run_in_link(
            _link_main, gbps, args=(opts, gbps), timeout=opts.timeout + 30, burst_kb=opts.link_burst_kb
        )
    except Exception as err:  # noqa: BLE001 -- reported in the rows of this link
        result = {"error": f"{type(err).__name__}: {error_line(str(err))}"[:800], "modes": {}}
    result.update(shaped=shaped, wall_s=time.perf_counter() - t0, loadavg_1min=[load0, _loadavg()])
    return result


def error_line(text: str) -> str:
    """The line of a failed world's output that says what failed: the last exception line
    (``ValueError: ...``), else the last line that is not a warning (a rank's stderr often ends in
    the interpreter's shutdown warnings)."""
    import re

    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt|Timeout)\b", ln)]
    if errors:
        return errors[-1]
    quiet = [ln for ln in lines if "warn" not in ln.lower()]
    return (quiet or lines or [""])[-1]


def _loadavg() -> float | None:
    """The machine's 1-minute load average (other jobs on the cores skew every timing)."""
    import os

    try:
        return os.getloadavg()[0]
    except OSError:
        return None
