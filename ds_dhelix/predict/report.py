"""The projection: every asked-for schedule's step time, exposed communication and tokens/s, and
SI's predicted gain, as one JSON-ready dict (``dhelix predict --json`` prints it).

    modes.<mode>.step_time_s      predicted optimizer step
    modes.<mode>.exposed_comm_s   time the compute unit waited on collectives (the step's gradient
                                  all-reduces included: they run after the last backward)
    modes.<mode>.tokens_per_s     tokens of a step over the whole world / step time
    si_gain                       the best SI schedule's tokens/s over the best schedule without SI

Plain data.
"""

from __future__ import annotations

from collections.abc import Callable

from ..schedule.registry import ALIASES, ONE_STAGE, PIPELINE, REGISTRY, lookup
from .costs import StepTimes
from .pipeline import PIPE_MODES, chunk_blocks, pipeline_step, schedule_of
from .shapes import ModelShape, RunLayout
from .step import MODES, Lap, plans, schedule_step

SI_MODES = tuple(dict.fromkeys(row.name for row in REGISTRY if row.co_executes and row.name != "intra"))
"""Modes that co-execute a forward with a backward (SI; the rest, intra included, are the baselines
SI is measured against)."""


def available_modes(layout: RunLayout) -> tuple[str, ...]:
    return PIPE_MODES if layout.dims.pp > 1 else MODES


def why_not(mode: str, layout: RunLayout, half_times: bool = True) -> str | None:
    """Why ``mode`` cannot run this layout (None: it can)."""
    m, p = layout.micro_batches, layout.dims.pp
    mode = ALIASES.get(mode, mode)
    if mode not in available_modes(layout):
        other = "a pipeline mode (needs --pp > 1)" if mode in PIPE_MODES else "not a pipeline mode (drop --pp)"
        return f"{mode} is {other}" if mode in PIPE_MODES + MODES else f"unknown schedule {mode!r}"
    if mode == "intra" and layout.micro_batch_size < 2:
        return "intra cuts each micro-batch in two along the batch: it needs --micro-batch-size >= 2"
    if mode == "intra" and not half_times:
        return (
            f"intra runs half micro-batches ({layout.micro_batch_size // 2} sequences) and the overlap table "
            f"holds op times at {layout.micro_batch_size} only: not projected with --hardware cpu"
        )
    if mode == "si-ends" and m < 2:
        return "si-ends pairs the first two forwards: it needs --micro-batches >= 2"
    if p > 1 and schedule_of(mode) is not None:
        try:
            lookup(schedule_of(mode), PIPELINE).minimum.check(schedule_of(mode), p, m)
        except ValueError as err:
            return str(err)
    return None


def choose_modes(asked: list[str] | None, layout: RunLayout, half_times: bool = True) -> tuple[list[str], dict]:
    """(modes to predict, {skipped mode: reason}). A mode asked for that cannot run is a ValueError."""
    if asked:
        asked = [ALIASES.get(mode, mode) for mode in asked]
        for mode in asked:
            reason = why_not(mode, layout, half_times)
            if reason:
                raise ValueError(
                    f"--schedule {mode}: {reason}; schedules for this layout: {', '.join(available_modes(layout))}"
                )
        return list(dict.fromkeys(asked)), {}
    reasons = {mode: why_not(mode, layout, half_times) for mode in available_modes(layout)}
    return [m for m, why in reasons.items() if why is None], {m: why for m, why in reasons.items() if why}


def mode_lap(
    mode: str,
    st: StepTimes,
    layout: RunLayout,
    shape: ModelShape,
    times_of: Callable[[int], StepTimes],
    planned_plans: dict,
) -> tuple[Lap, float | None]:
    """(the micro-batches' part of a step of ``mode``, the pipeline bubble or None)."""
    m = layout.micro_batches
    if layout.dims.pp > 1:
        return pipeline_step(st, mode, shape.num_layers, layout.dims.pp, m)
    spec = lookup(mode, ONE_STAGE)
    plan = planned_plans["default" if mode == "si-plan" else "dp"] if mode in ("si-plan", "si-planned") else None
    b = layout.micro_batch_size
    half = (times_of((b + 1) // 2), times_of(b // 2)) if spec.halves else None
    return schedule_step(spec, m, st, half, plan), None


def project(
    shape: ModelShape, layout: RunLayout, times_of: Callable[[int], StepTimes], modes: list[str], plan_source=None
) -> dict:
    """Predict ``modes``; ``times_of(micro_batch_size)`` gives the op times; ``plan_source``:
    ``{"default", "dp", ...}`` plans to run si-plan / si-planned by (None: planned from the op times)."""
    st = times_of(layout.micro_batch_size)
    chosen = plan_source or (plans(st) if {"si-plan", "si-planned"} & set(modes) else {})
    tail = st.tail
    tail_comm = tail.get("tp_grads", 0.0) + tail.get("dp_grads", 0.0)
    out = {}
    for mode in modes:
        lap, bubble = mode_lap(mode, st, layout, shape, times_of, chosen)
        step_s = (lap.ms + sum(tail.values())) / 1e3
        out[mode] = {
            "step_time_s": step_s,
            "exposed_comm_s": (lap.wait_ms + tail_comm) / 1e3,
            "tokens_per_s": layout.tokens_per_step / step_s,
        }
        if bubble is not None:
            out[mode]["bubble_fraction"] = bubble
    base = out.get("sequential")
    for row in out.values():
        if base:
            row["speedup_vs_sequential"] = base["step_time_s"] / row["step_time_s"]
    return {
        "modes": out,
        "si_gain": si_gain(out),
        "per_step": per_step(st, layout, shape),
        "plans": _plan_summary(chosen),
    }


def per_step(st: StepTimes, layout: RunLayout, shape: ModelShape) -> dict:
    """One rank's compute and collectives per step (pipeline: rank 0's two chunks), what a step
    adds once, and the overlap bound (comp + comm) / max(comp, comm) the bench reports too."""
    blocks = None
    if layout.dims.pp > 1:
        chunks = chunk_blocks(shape.num_layers, layout.dims.pp)
        blocks = chunks[(0, 0)] + chunks[(0, 1)]
    comp, comm = st.compute_ms(blocks) * layout.micro_batches, st.comm_ms(blocks) * layout.micro_batches
    dp = st.notes.get("dp_grads_ms")  # the data-parallel reduction during the last backward
    return {
        "compute_s": comp / 1e3,
        "comm_s": comm / 1e3,
        "tail_s": {k: v / 1e3 for k, v in st.tail.items()},
        "dp_grads_whole_s": (dp["whole"] if dp else st.tail.get("dp_grads", 0.0)) / 1e3,
        "ideal_speedup": (comp + comm) / max(comp, comm) if max(comp, comm) else 1.0,
    }


def si_gain(modes: dict) -> dict | None:
    """The best SI schedule against the best schedule without SI (tokens/s ratio)."""
    with_si = {m: r for m, r in modes.items() if m in SI_MODES}
    without = {m: r for m, r in modes.items() if m not in SI_MODES}
    if not with_si or not without:
        return None
    best = min(with_si, key=lambda m: with_si[m]["step_time_s"])
    base = min(without, key=lambda m: without[m]["step_time_s"])
    return {"mode": best, "baseline": base, "speedup": modes[base]["step_time_s"] / modes[best]["step_time_s"]}


def _plan_summary(chosen: dict) -> dict:
    if not chosen:
        return {}
    out = {
        "default_rounds": len(chosen["default"].rounds),
        "dp_rounds": len(chosen["dp"].rounds),
        "dp_is_default": chosen["dp"].fingerprint() == chosen["default"].fingerprint(),
    }
    for key in ("default_ms", "dp_ms"):
        if chosen.get(key) is not None:
            out[f"planner_{key}_per_layer_pair"] = chosen[key]
    return out
