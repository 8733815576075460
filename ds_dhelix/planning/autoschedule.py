"""``"schedule": "auto"``: time the candidate schedules on real training steps, keep the fastest.

A trial phase runs the candidates in rotating order (``auto_trials`` rounds; the first phase of a
process starts with one untimed warm-up step per candidate, which pays one-time costs such as
allocations), like the benchmark alternates its modes so that drifting machine load hits every
candidate alike. Each candidate's median step time is taken over the slowest rank (``reduce_max``:
every rank then makes the same choice), the fastest is kept and the decision logged with the
figures. After ``auto_recheck_steps`` steps on it a new phase (no warm-up) times them again.

Every step, trial or not, is a real training step with the math of the schedule it ran:
``sequential`` and ``si`` are bitwise equal; ``intra`` trains as half-size micro-batches do (float
rounding of the split sums; with dropout or router noise other draws; an MoE balance loss and
expert capacity per half), see ``executor``.

    auto = AutoSchedule(("sequential", "si", "intra"), trials=3, recheck_steps=500, reduce_max=fn)
    schedule = auto.schedule()        # this step's schedule
    ... train the step ...
    decision = auto.record(step, seconds)   # a dict when this step ended a trial phase

A decision is ``{"step", "chosen", "previous", "trials", "figures", "reason"}``: ``figures`` the
candidates' median / min / max step seconds (empty for a choice made without a trial), ``reason``
why ``chosen`` was taken, in words.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence

UNTIMED_CHOICE = "sequential"
"""What auto takes without a trial where there is nothing to hide (``nothing_to_hide``)."""


def nothing_to_hide(graph) -> str | None:
    """Why no schedule but ``sequential`` can gain on ``graph`` (a one-stage ``ModelGraph``), or
    None when it has a collective to hide. SI and intra only overlap one strand's compute with the
    other strand's collectives inside the op graph (TP all-gathers / reduce-scatters, EP
    all-to-alls, CP exchanges); DP's gradient reduction is DeepSpeed's, after the pairs."""
    if any(op.is_comm for block in graph.blocks for op in block):
        return None
    return (
        "nothing to hide: the op graph has no collective (no TP, EP or CP communication) for an SI pair or "
        "an intra half to overlap, so si and intra could only add overhead; DP's gradient reduction runs "
        "outside the pairs"
    )


class AutoSchedule:
    """The schedule of each step under ``"schedule": "auto"`` (see the module docstring).
    ``reduce_max(list of float) -> list of float``: element-wise max over the ranks (None: one rank).
    ``untimed_reason``: why there is nothing to time (``nothing_to_hide``'s reason, None: time the
    candidates): with ``sequential`` among them it is chosen before step 1, without a trial or a
    re-check; without it the candidates are timed as usual."""

    def __init__(
        self,
        candidates: Sequence[str],
        trials: int,
        recheck_steps: int,
        reduce_max: Callable[[list], list] | None = None,
        untimed_reason: str | None = None,
    ):
        if len(candidates) < 2:
            raise ValueError(f"schedule 'auto' needs two or more candidates, got {list(candidates)}")
        self.candidates, self.trials, self.recheck_steps = tuple(candidates), trials, recheck_steps
        self.reduce_max = reduce_max or (lambda values: values)
        self.chosen: str | None = None
        self.decisions: list[dict] = []  # every phase's outcome, in order
        self._queue: deque = deque()  # (schedule, timed) of the trial phase's steps left
        self._times: dict[str, list[float]] = {}
        self._since = 0  # steps on the chosen schedule since the last decision
        if untimed_reason is not None and UNTIMED_CHOICE in self.candidates:
            self.chosen, self.recheck_steps = UNTIMED_CHOICE, 0
            self.decisions.append(
                {
                    "step": 0,
                    "chosen": UNTIMED_CHOICE,
                    "previous": None,
                    "trials": 0,
                    "figures": {},
                    "reason": untimed_reason,
                }
            )
        else:
            self._start_phase(warm_up=True)
        self._timed_note = (
            ""
            if untimed_reason is None or self.chosen is not None
            else (f"; {untimed_reason}, but {UNTIMED_CHOICE!r} is not among the candidates")
        )

    @property
    def trial_steps_left(self) -> int:
        return len(self._queue)

    def _start_phase(self, warm_up: bool) -> None:
        order = list(self.candidates)
        steps = [(c, False) for c in order] if warm_up else []
        for r in range(self.trials):
            k = r % len(order)
            steps += [(c, True) for c in order[k:] + order[:k]]
        self._queue = deque(steps)
        self._times = {c: [] for c in order}

    def schedule(self) -> str:
        """The schedule of the next step."""
        return self._queue[0][0] if self._queue else self.chosen

    def record(self, step: int, seconds: float) -> dict | None:
        """The step that ``schedule()`` named took ``seconds`` (this rank's wall time); returns the
        decision when it ended a trial phase, else None."""
        if not self._queue:
            self._since += 1
            if self.recheck_steps and self._since >= self.recheck_steps:
                self._start_phase(warm_up=False)
            return None
        name, timed = self._queue.popleft()
        if timed:
            self._times[name].append(seconds)
        return self._decide(step) if not self._queue else None

    def _decide(self, step: int) -> dict:
        stats = []
        for c in self.candidates:
            t = self._times[c]
            stats += [statistics.median(t), min(t), max(t)]
        stats = [float(v) for v in self.reduce_max(stats)]  # the slowest rank's, so all ranks agree
        figures = {
            c: {"median_s": stats[3 * i], "min_s": stats[3 * i + 1], "max_s": stats[3 * i + 2]}
            for i, c in enumerate(self.candidates)
        }
        best = min(self.candidates, key=lambda c: (figures[c]["median_s"], self.candidates.index(c)))
        decision = {
            "step": step,
            "chosen": best,
            "previous": self.chosen,
            "trials": self.trials,
            "figures": figures,
            "reason": f"the fastest median step time ({self.trials} timed step{'s' * (self.trials != 1)} "
            f"each, slowest rank)" + self._timed_note,
        }
        self.chosen, self._since = best, 0
        self.decisions.append(decision)
        return decision


def describe(decision: dict) -> str:
    """The log line of a decision."""
    if not decision["trials"]:  # chosen without a trial (``nothing_to_hide``)
        return f"ds_dhelix: schedule auto chose {decision['chosen']!r} without a trial: {decision['reason']}"
    figures = decision["figures"]
    best = figures[decision["chosen"]]["median_s"]
    parts = [
        f"{c} {f['median_s'] * 1e3:.1f} ms [{f['min_s'] * 1e3:.1f}-{f['max_s'] * 1e3:.1f}]"
        + ("" if c == decision["chosen"] else f" ({f['median_s'] / best:.2f}x)")
        for c, f in sorted(figures.items(), key=lambda kv: kv[1]["median_s"])
    ]
    again = "" if decision["previous"] is None else f" (re-check; was {decision['previous']!r})"
    return (
        f"ds_dhelix: schedule auto chose {decision['chosen']!r} after step {decision['step']}{again}: "
        f"median step time of {decision['trials']} steps each, slowest rank [min-max]: " + ", ".join(parts)
    )
