"""SIPlan: how one forward op list and one backward op list are co-executed.

A plan is a list of steps. Each step pairs a contiguous forward segment ``[f0, f1)`` with a
contiguous backward segment ``[b0, b1)`` (either may be empty). Steps run one after another with a
barrier between them; inside a step, communication ops are launched asynchronously and the other
strand's compute runs meanwhile. The segments of all steps cover both op lists in order.

Plain data: no torch.distributed, no deepspeed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .ops import OpSpec


@dataclass(frozen=True)
class PlanStep:
    fwd: tuple[int, int]  # half-open index range into the forward op list
    bwd: tuple[int, int]  # half-open index range into the backward op list


@dataclass(frozen=True)
class SIPlan:
    """Steps over ``fwd_ops`` (forward order) and ``bwd_ops`` (backward order)."""

    fwd_ops: tuple[OpSpec, ...]
    bwd_ops: tuple[OpSpec, ...]
    steps: tuple[PlanStep, ...]
    predicted_ms: float | None = None
    source: str = "default"  # "default", "dp", "sequential", "random", "exhaustive"
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError unless the steps cover both op lists contiguously and in order."""
        f = b = 0
        for k, st in enumerate(self.steps):
            if st.fwd[0] != f or st.bwd[0] != b or st.fwd[1] < st.fwd[0] or st.bwd[1] < st.bwd[0]:
                raise ValueError(f"plan step {k} {st} does not continue at fwd={f}, bwd={b}")
            if st.fwd[0] == st.fwd[1] and st.bwd[0] == st.bwd[1]:
                raise ValueError(f"plan step {k} is empty")
            f, b = st.fwd[1], st.bwd[1]
        if f != len(self.fwd_ops) or b != len(self.bwd_ops):
            raise ValueError(
                f"plan covers {f}/{len(self.fwd_ops)} forward and {b}/{len(self.bwd_ops)} backward ops")
