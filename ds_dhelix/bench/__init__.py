"""Side-by-side benchmark: plain DeepSpeed, DeepSpeed AutoTP and the ds_dhelix schedules on the same
model, world and tokens per step, at several emulated link rates, in one run.

    options.py  BenchOptions, modes and their ds_configs
    modes.py    one runner per mode (build on every rank, ``step(batches)``)
    world.py    per-rank measurement (alternating modes) and one world per link rate
    metrics.py  records -> rows: medians, speedups, the ideal and CPU bounds, hidden shares
    report.py   JSON / CSV / markdown / PNG
    tracing.py  ``dhelix trace``: a traced run on a CPU gloo world, the trace summarized
    profile_runs.py  ``dhelix profile`` / ``validate-plan``: the profiler and the plans on a CPU gloo world
    ds_pipelines.py  DeepSpeed's own pipelines (the ``ds-*`` modes of ``--pp``) on our layers

Measurement worlds above the engine: may import ``ds_dhelix.engine``, ``hf_models`` and every layer
below; only the commands and ``benchmarks/`` import this package.

    report = run_bench(BenchOptions(link_gbps=(2.0,)))
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable

from .options import MODES, BenchOptions, quick


def run_bench(opts: BenchOptions, progress: Callable[[str], None] | None = None) -> dict:
    """Measure every mode at every link rate; return the report (``results`` rows and more)."""
    from ds_dhelix.runtime.linkemu import link_emulation_available

    from .metrics import device_peak_flops, link_label, summarize_link

    say = progress or (lambda text: None)
    emulation, how = link_emulation_available()
    rows, links, t0 = [], [], time.perf_counter()
    for gbps in opts.link_gbps:
        matched = None
        if gbps == "matched":
            gbps, history = match_link(lambda g: _sequential_ratio(opts, g, say))
            matched = {
                "target": list(MATCH_RANGE),
                "chosen_gbps": gbps,
                "calibration": [{"link_gbps": g, "comm_comp": r} for g, r in history],
            }
            say(
                f"[bench] matched link: {gbps:.3g} Gbit/s (sequential comm/comp "
                f"{', '.join(f'{r:.2f} at {g:.3g}' for g, r in history)})"
            )
        say(
            f"[bench] {link_label(gbps)}: {', '.join(opts.modes)} "
            f"({opts.warmup} warm-up + {opts.repeats} timed steps each) ..."
        )
        result = _measure(opts, gbps)
        link_rows = summarize_link(
            opts, gbps, result, device_peak_flops(result.get("device")), _flops_per_token(opts, result.get("device"))
        )
        rows += link_rows
        links.append(
            {
                "link_gbps": gbps,
                "shaped": result["shaped"],
                "wall_s": result["wall_s"],
                "error": result.get("error"),
                "device": result.get("device"),
                "loadavg_1min": result.get("loadavg_1min"),
                **({"matched": matched} if matched else {}),
            }
        )
        for r in link_rows:
            say(f"[bench]   {_progress_line(r)}")
        busy = max((x for x in result.get("loadavg_1min") or [] if x is not None), default=0.0)
        if busy > _cpus() + 0.5:
            say(
                f"[bench]   note: load average {busy:.1f} on {_cpus()} CPUs during this link: other jobs "
                f"shared the cores, timings are noisy"
            )
    return _report(opts, rows, links, time.perf_counter() - t0, how if emulation else f"unavailable: {how}")


def _title(opts: BenchOptions) -> str:
    layout = f"TP={opts.tp}"
    if opts.cp > 1:
        layout += f" CP={opts.cp}" + (" (ring)" if opts.cp_comm == "ring" else "")
    if opts.ep > 1:
        layout += f" EP={opts.ep}"
    if opts.dp > 1 and opts.dp != opts.ep:
        layout += f" DP={opts.dp}"
    if opts.pp > 1:
        layout += f" PP={opts.pp}"
    return (
        f"{opts.model} {layout}, {opts.step_micro_batches}x{opts.micro_batch_size}x{opts.seq_len} tokens/step, "
        f"{opts.world} CPU ranks x 1 thread, link burst {opts.link_burst_kb} KB"
    )


def _report(opts: BenchOptions, rows: list, links: list, wall_s: float, emulation: str) -> dict:
    """The run's report: rows, links, environment, the command that made it."""
    import deepspeed
    import torch

    from .metrics import comm_comp_ratio

    return {
        "title": _title(opts),
        "options": opts.to_dict(),
        "results": rows,
        "comm_comp_ratio": comm_comp_ratio(rows),
        "links": links,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "machine": platform.machine(),
            "cpus": _cpus(),
            "link_emulation": emulation,
        },
        "wall_s": wall_s,
        "command": " ".join(["dhelix", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else None,
    }


MATCH_RANGE = (0.9, 1.1)
"""comm/comp of the sequential run that ``--link-gbps matched`` aims for."""


def match_link(
    ratio_at: Callable[[float], float | None],
    start: float = 2.0,
    tries: int = 4,
    target: tuple[float, float] = MATCH_RANGE,
) -> tuple[float, list[tuple[float, float]]]:
    """The link rate at which ``ratio_at(rate)`` (the sequential run's comm/comp) falls in
    ``target``, and every (rate, ratio) tried. The exchange is bandwidth-bound, comm ~ 1/rate, so
    the next rate is rate x ratio; after ``tries`` the closest rate tried. The comm/comp regime then
    depends on the model and the layout, not on how fast this machine computes."""
    rate, history = start, []
    for _ in range(tries):
        ratio = ratio_at(rate)
        if not ratio:
            raise ValueError(
                f"--link-gbps matched: the sequential run communicated nothing at {rate:g} Gbit/s "
                f"(no TP, EP or CP collectives to match); pass a rate"
            )
        history.append((rate, ratio))
        if target[0] <= ratio <= target[1]:
            return rate, history
        rate = float(f"{min(max(rate * ratio, 0.01), 1000.0):.3g}")  # 3 significant digits: a readable label
    return min(history, key=lambda h: abs(h[1] - 1.0))[0], history


def _sequential_ratio(opts: BenchOptions, gbps: float, say) -> float | None:
    """comm/comp of a short sequential run (1 warm-up + 2 timed steps) at ``gbps``."""
    from dataclasses import replace

    from .metrics import summarize_link

    probe = replace(opts, modes=("sequential",), warmup=1, repeats=2, link_gbps=(gbps,))
    rows = summarize_link(probe, gbps, _measure(probe, gbps), None, None)
    row = next((r for r in rows if r["mode"] == "sequential"), None)
    if row is None or not row.get("compute_s"):
        raise ValueError(
            f"--link-gbps matched: the calibration run at {gbps:g} Gbit/s failed: "
            f"{(row or {}).get('error') or 'no sequential row'}"
        )
    return (row.get("comm_s") or 0.0) / row["compute_s"]


def _measure(opts, gbps):
    from .world import measure_link

    return measure_link(opts, gbps)


def _flops_per_token(opts: BenchOptions, device: str | None) -> float | None:
    from .metrics import device_peak_flops, model_flops_per_token

    if device_peak_flops(device) is None:
        return None  # MFU only where the device's peak is known
    from hf_models.registry import load_config

    cfg = load_config(opts.model)
    layers = opts.num_layers or cfg.num_hidden_layers
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    params = layers * (4 * h * h + 3 * h * inter) + vocab * h  # GEMM weights incl. the LM head
    return model_flops_per_token(params, layers, h, opts.seq_len)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _progress_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['mode']:<11} {r['status']}: {r['reason']}"
    parts = [f"{r['mode']:<11} step {r['step_time_s'] * 1e3:7.0f} ms", f"{r['tokens_per_s']:7.0f} tok/s"]
    if r.get("speedup_vs_sequential") is not None:
        parts.append(f"{r['speedup_vs_sequential']:.2f}x vs seq")
    if r.get("comm_s") is not None:
        parts.append(
            f"comp {r['compute_s'] * 1e3:.0f} comm {r['comm_s'] * 1e3:.0f} exposed {r['exposed_comm_s'] * 1e3:.0f} ms"
        )
    if r.get("auto_chosen") and r.get("auto_trial_steps"):
        parts.append(f"chose {r['auto_chosen']} after {r['auto_trial_steps']} trial steps")
    elif r.get("auto_chosen"):
        parts.append(f"chose {r['auto_chosen']} without a trial ({r['auto_reason']})")
    return ", ".join(parts)


__all__ = ["BenchOptions", "MODES", "quick", "run_bench"]
