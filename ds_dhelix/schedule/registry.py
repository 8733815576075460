"""Every schedule by name: one row each, read by the config, the engines, the bench, ``dhelix
predict``, ``dhelix simulate`` and the docs. Adding a schedule is a builder (``one_stage.py`` or
``ds_dhelix/pipe/schedule.py``) and one row here.

A row is keyed by (name, layout): ``sequential`` is a row of both layouts (the fold without SI in a
pipeline). Rows whose ``section`` is more than ``{"schedule": name}`` are variants of a configured
schedule (``si-ends`` is ``si`` with ``pair_ends``); the bench and ``dhelix predict`` measure them
as modes of their own. ``auto`` has no builder: the engine picks one of its candidates per step.

Plain data: no torch, no deepspeed.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field

from ..pipe import schedule as pipe_schedule
from . import one_stage
from .instructions import ONE, Minimum, Schedule

ONE_STAGE = "one-stage"
PIPELINE = "pipeline"


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: how to build its instruction lists and what it means to the rest."""

    name: str
    layout: str  # ONE_STAGE or PIPELINE
    summary: str
    build: Callable[[int, int], Schedule] | None  # (num_stages, num_microbatches) -> one list per rank
    minimum: Minimum = ONE  # the smallest m for p stages
    section: dict = field(default_factory=dict)  # the "dhelix" keys that select it
    co_executes: bool = False  # pairs two strands (what SI's gain is made of)
    defers_weight_grads: bool = False  # linear ops' weight gradients deferred inside pairs
    halves: bool = False  # its lists run two half micro-batches per micro-batch (intra)
    auto_candidate: bool = False  # "schedule": "auto" may choose it

    @property
    def reacts(self) -> bool:
        """Whether its pairs may react to completed collectives (where the machine lets them)."""
        return self.section.get("react_to_completions", True)

    @property
    def configured(self) -> bool:
        """A value of ``dhelix.schedule`` itself (not a variant of one)."""
        return self.section == {"schedule": self.name}

    def units(self, num_microbatches: int) -> int:
        """Micro-batches its instruction lists name for a step of ``num_microbatches``."""
        return 2 * num_microbatches if self.halves else num_microbatches

    def schedule(self, num_stages: int, num_microbatches: int) -> Schedule:
        """Every rank's instruction list; ValueError naming the smallest valid m when m is too small."""
        if self.build is None:
            raise ValueError(f"{self.name!r} picks a schedule per step; it has no instruction list of its own")
        self.minimum.check(self.name, num_stages, num_microbatches)
        return self.build(num_stages, num_microbatches)


def _row(name, layout, summary, build, section=None, **kw) -> ScheduleSpec:
    return ScheduleSpec(name, layout, summary, build, section=section or {"schedule": name}, **kw)


REGISTRY: tuple[ScheduleSpec, ...] = (
    _row(
        "sequential",
        ONE_STAGE,
        "micro-batches one after another, every collective waited at once",
        one_stage.sequential_schedule,
        auto_candidate=True,
    ),
    _row(
        "si",
        ONE_STAGE,
        "strand interleaving: the forward of k+1 beside the backward of k, reactive pairs",
        one_stage.si_schedule,
        co_executes=True,
        defers_weight_grads=True,
        auto_candidate=True,
    ),
    _row(
        "si-ends",
        ONE_STAGE,
        "si with the first two forwards and the last two backwards paired too",
        one_stage.si_ends_schedule,
        {"schedule": "si", "pair_ends": True},
        co_executes=True,
        defers_weight_grads=True,
    ),
    _row(
        "si-ordered",
        ONE_STAGE,
        "si in the timing-independent order a CUDA run takes (no reacting to completed collectives)",
        one_stage.si_schedule,
        {"schedule": "si", "react_to_completions": False},
        co_executes=True,
        defers_weight_grads=True,
    ),
    _row(
        "si-plan",
        ONE_STAGE,
        "si run by the fixed default plan, a barrier after each plan round",
        one_stage.si_schedule,
        {"schedule": "si", "si_execution": "plan"},
        co_executes=True,
    ),
    _row(
        "si-planned",
        ONE_STAGE,
        "si run by the plan the DP planner makes from a profile",
        one_stage.si_schedule,
        {"schedule": "si", "si_execution": "plan", "planner": {"profile": "auto"}},
        co_executes=True,
    ),
    _row(
        "intra",
        ONE_STAGE,
        "Domino's intra-batch overlap: each micro-batch's halves side by side",
        one_stage.intra_schedule,
        co_executes=True,
        defers_weight_grads=True,
        halves=True,
        auto_candidate=True,
    ),
    _row("auto", ONE_STAGE, "times its candidates on the first steps and keeps the fastest", None),
    _row(
        "sequential",
        PIPELINE,
        "the fold without SI: one micro-batch at a time through it",
        pipe_schedule.sequential_fold_schedule,
        auto_candidate=True,
    ),
    _row(
        "w",
        PIPELINE,
        "DHelix W schedule: the fold with every forward/backward slot pair co-executed",
        pipe_schedule.w_schedule,
        minimum=pipe_schedule.MIN_W,
        co_executes=True,
        auto_candidate=True,
    ),
    _row(
        "dualpipev",
        PIPELINE,
        "DualPipeV's order on the fold, its forward/backward pairs co-executed",
        pipe_schedule.dualpipev_si_schedule,
        minimum=pipe_schedule.MIN_DUALPIPEV,
        co_executes=True,
        auto_candidate=True,
    ),
    _row("auto", PIPELINE, "times its candidates on the first steps and keeps the fastest", None),
)

ALIASES = {"dualpipev-si": "dualpipev"}
"""Old names still read (results files, scripts), each with its current one."""


def names(layout: str | None = None, *, configured: bool = False, built: bool = False) -> tuple[str, ...]:
    """Schedule names in registry order, each once: of ``layout`` (None: both); ``configured``:
    only the values of ``dhelix.schedule``; ``built``: only those with instruction lists (no auto)."""
    out: list[str] = []
    for row in REGISTRY:
        if (
            (layout is None or row.layout == layout)
            and (row.configured or not configured)
            and (row.build is not None or not built)
            and row.name not in out
        ):
            out.append(row.name)
    return tuple(out)


def auto_candidates(layout: str) -> tuple[str, ...]:
    """What ``"schedule": "auto"`` chooses from on ``layout``."""
    return tuple(row.name for row in REGISTRY if row.layout == layout and row.auto_candidate)


def lookup(name: str, layout: str) -> ScheduleSpec:
    """The row of ``name`` on ``layout`` (an old name from ``ALIASES`` accepted); ValueError naming
    the choices and the closest one."""
    name = ALIASES.get(name, name)
    for row in REGISTRY:
        if row.name == name and row.layout == layout:
            return row
    choices = names(layout)
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    other = [r.layout for r in REGISTRY if r.name == name]
    where = f" ({name!r} is a {other[0]} schedule)" if other else ""
    hint = f"; did you mean {close[0]!r}?" if close and not other else ""
    raise ValueError(f"unknown {layout} schedule {name!r}{where}: choose one of {', '.join(choices)}{hint}")


def build(name: str, layout: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Every rank's instruction list of schedule ``name`` on ``layout``."""
    return lookup(name, layout).schedule(num_stages, num_microbatches)
