"""Per-step records -> result rows (pure; no torch.distributed).

Definitions (medians over the timed steps of one mode at one link rate):

    speedup_vs_sequential = step(sequential) / step(mode)
    ideal_speedup         = (comp + comm) / max(comp, comm)      comp, comm of the sequential run
    achieved_over_ideal   = speedup_vs_sequential / ideal_speedup          (SI modes)
    step_bound_speedup    = step(seq) / (step(seq) - min(comp, comm))      the same bound, but
                            with the step's non-overlappable time (optimizer, ...) kept in
    hidden_of_hideable    = (comm_seq - exposed) / min(comm_seq, comp_seq)   hidden / hideable
    hidden_of_comm        = (comm_seq - exposed) / comm_seq

    cpu_s                 CPU seconds of one rank's process per step (mean over ranks);
    other_threads_cpu_s   of which not on the main (compute) thread: gloo's threads and kernel
                          TCP work, which on a CPU machine competes with compute for the cores
    cpu_bound_speedup     step(seq) / max(cpu_s x world / cores, main_thread_cpu_s)   (CPU
                          devices): the speedup this mode would reach if the machine's cores did
                          nothing but this mode's own CPU work, all step long: no schedule of it
                          beats this on this machine
    cpu_bound_over_ideal  cpu_bound_speedup / ideal_speedup (SI modes): the highest
                          achieved_over_ideal this machine's cores allow the mode

comp is the time of the COMP ops, comm the time from launch to observed completion of each
collective, exposed the time spent blocked waiting for one (all as the executor measures them).
Hidden time is measured against the *sequential* run's comm: under SI a collective's completion
is only observed between compute ops, so the mode's own comm time overstates what it hid.
"""

from __future__ import annotations

import statistics

from .options import DHELIX_MODES, MIN_REPEATS, REFERENCE_GBPS, BenchOptions, split_mode

# Dense peak FLOP/s of devices by name (fp32 without tensor cores); MFU is null elsewhere (CPU).
PEAK_FLOPS_FP32 = {"A100": 19.5e12, "A40": 37.4e12, "A800": 19.5e12, "H100": 67e12, "H200": 67e12}


def ideal_speedup(comp_s: float, comm_s: float) -> float:
    """The overlap bound: perfect hiding of the shorter of compute and communication."""
    longer = max(comp_s, comm_s)
    return (comp_s + comm_s) / longer if longer > 0 else 1.0


def link_label(gbps: float | None) -> str:
    return "unshaped" if gbps is None else f"{gbps:g} Gbit/s"


def _median(steps: list[dict], key: str):
    values = [s[key] for s in steps if s.get(key) is not None]
    return statistics.median(values) if values else None


def mode_medians(steps: list[dict]) -> dict:
    return {
        key: _median(steps, key)
        for key in (
            "step_s",
            "compute_s",
            "comm_s",
            "exposed_s",
            "cpu_s",
            "main_thread_cpu_s",
            "dp_reduce_s",
            "dp_exposed_s",
        )
    }


def summarize_link(
    opts: BenchOptions,
    gbps: float | None,
    result: dict,
    peak_flops: float | None = None,
    flops_per_token: float | None = None,
) -> list[dict]:
    """One row per mode of ``opts`` for the link-rate ``result`` of ``world.measure_link``."""
    outcomes = result.get("modes", {})
    seq = outcomes.get("sequential", {})
    seq_med = mode_medians(seq["steps"]) if seq.get("steps") else None
    # pipelines: point-to-point transfers are not timed as comm, so there is no overlap bound
    ideal = ideal_speedup(seq_med["compute_s"], seq_med["comm_s"]) if seq_med and opts.pp == 1 else None
    cores = result.get("cpu_cores") if result.get("device") == "cpu" else None
    rows = []
    for mode in opts.modes:
        out = outcomes.get(mode) or {"status": "error", "reason": result.get("error", "no result")}
        row = {
            "mode": mode,
            "link_gbps": gbps,
            "link": link_label(gbps),
            "shaped": bool(result.get("shaped")),
            "status": out["status"],
            "reason": out.get("reason"),
            "build_s": out.get("build_s"),
            **(out.get("info") or {}),
        }
        if out.get("steps"):
            row.update(_timing(opts, out["steps"], seq_med, ideal, mode, peak_flops, flops_per_token, cores))
        row.update(first_step_loss=out.get("first_step_loss"), **_loss_vs_sequential(mode, out, seq))
        if mode == "si-planned" and row.get("plan_is_default"):
            row["reason"] = f"the planner kept the default plan (plan source {row.get('plan_source')!r})"
        rows.append(row)
    return rows


def _loss_vs_sequential(mode: str, out: dict, seq: dict) -> dict:
    """A peer's first-step loss against sequential's (the same model, batches and objective): the
    difference and whether it is within the peer's stated tolerance (tutel: ``LOSS_TOLERANCE``)."""
    from .tutel_peer import LOSS_TOLERANCE, TUTEL_MODES

    ours, theirs = seq.get("first_step_loss"), out.get("first_step_loss")
    if mode not in TUTEL_MODES or ours is None or theirs is None:
        return {}
    diff = abs(theirs - ours)
    return {
        "first_step_loss_diff_vs_sequential": diff,
        "loss_tolerance": LOSS_TOLERANCE,
        "loss_close": diff <= LOSS_TOLERANCE,
    }


def _timing(opts, steps, seq_med, ideal, mode, peak_flops, flops_per_token, cores=None) -> dict:
    med = mode_medians(steps)
    step_s = med["step_s"]
    times = [s["step_s"] for s in steps]
    row = {
        "steps": len(steps),
        "repeats_below_minimum": len(steps) < MIN_REPEATS,
        "step_times_s": times,
        "step_time_s": step_s,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "tokens_per_s": opts.tokens_per_step / step_s,
        "compute_s": med["compute_s"],
        "comm_s": med["comm_s"],
        "exposed_comm_s": med["exposed_s"],
        "dp_reduce_s": med["dp_reduce_s"],
        "dp_exposed_s": med["dp_exposed_s"],
        "cpu_s": med["cpu_s"],
        "other_threads_cpu_s": None,
        "peak_activation_bytes": max(
            (s["peak_activation_bytes"] for s in steps if s.get("peak_activation_bytes") is not None), default=None
        ),
        "peak_gathered_bytes": max(
            (s["peak_gathered_bytes"] for s in steps if s.get("peak_gathered_bytes") is not None), default=None
        ),
        "hidden_of_hideable": None,
        "hidden_of_comm": None,
        "ideal_speedup": ideal,
        "speedup_vs_sequential": None,
        "achieved_over_ideal": None,
        "step_bound_speedup": None,
        "cpu_bound_speedup": None,
        "cpu_bound_over_ideal": None,
        "mfu": None,
    }
    if med["cpu_s"] is not None and med["main_thread_cpu_s"] is not None:
        row["other_threads_cpu_s"] = max(0.0, med["cpu_s"] - med["main_thread_cpu_s"])
    ref = seq_med or med  # sequential comm / comp: what there was to hide
    comp, comm, exposed = ref["compute_s"], ref["comm_s"], med["exposed_s"]
    if comm and exposed is not None and comp and opts.pp == 1:
        hidden = min(comm, max(0.0, comm - exposed))
        row["hidden_of_comm"] = hidden / comm
        row["hidden_of_hideable"] = min(1.0, hidden / min(comm, comp))
    if seq_med:
        row["speedup_vs_sequential"] = seq_med["step_s"] / step_s
        if ideal:
            hideable = min(seq_med["compute_s"], seq_med["comm_s"])
            row["step_bound_speedup"] = seq_med["step_s"] / max(seq_med["step_s"] - hideable, 1e-9)
        if split_mode(mode)[0] in DHELIX_MODES and split_mode(mode)[0] != "sequential" and ideal:
            row["achieved_over_ideal"] = row["speedup_vs_sequential"] / ideal
        if cores and med["cpu_s"] and med["main_thread_cpu_s"]:
            floor = max(med["cpu_s"] * opts.world / cores, med["main_thread_cpu_s"])
            row["cpu_bound_speedup"] = seq_med["step_s"] / floor
            if row["achieved_over_ideal"] is not None:
                row["cpu_bound_over_ideal"] = row["cpu_bound_speedup"] / ideal
    if peak_flops and flops_per_token:
        row["mfu"] = flops_per_token * row["tokens_per_s"] / (peak_flops * opts.world)
    return row


def comm_comp_ratio(rows: list[dict]) -> dict:
    """comm / comp of the sequential run: at the reference link (2 Gbit/s, else the first
    measured) and per link."""
    by_link = {
        r["link"]: r["comm_s"] / r["compute_s"]
        for r in rows
        if r["mode"] == "sequential" and r.get("comm_s") and r.get("compute_s")
    }
    ref = link_label(REFERENCE_GBPS)
    ref = ref if ref in by_link else next(iter(by_link), None)
    return {"value": by_link.get(ref), "link": ref, "by_link": by_link}


def model_flops_per_token(num_params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (forward + backward GEMMs) + 12 L h s (attention scores)."""
    return 6.0 * num_params + 12.0 * num_layers * hidden * seq_len


def device_peak_flops(device: str | None) -> float | None:
    """Peak FLOP/s of the named device when known (``PEAK_FLOPS_FP32``); None for CPUs."""
    for name, peak in PEAK_FLOPS_FP32.items():
        if device and name in device.upper():
            return peak
    return None
