"""What the executor runs: ``MicroBatch`` (one micro-batch in flight) and ``Task`` (one op of it
in one direction, as a strand's list holds it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..graph.model_graph import Op


@dataclass
class MicroBatch:
    """One micro-batch in flight: forward values, saved op contexts, backward gradients."""

    index: int
    side: dict
    env: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    loss: torch.Tensor | None = None


@dataclass(frozen=True)
class Task:
    """One op of one micro-batch in one direction, as a strand's list holds it."""

    mb: MicroBatch
    block: int
    op_index: int
    op: Op
    backward: bool
    depth: int = 0  # position of the block in its strand's block list (the forward strand's gate)
    swapped: bool = False  # second strand of a same-direction pair: collectives on the other channel
    recompute: bool = False  # a forward op the backward strand runs again (``recompute.py``)

    @property
    def strand(self) -> str:
        return "B" if self.backward or self.recompute else "F"

    @property
    def channel(self) -> int:
        """The strand-group channel its collectives use: 0 forward, 1 backward (flipped if swapped);
        a recomputed forward op belongs to the backward strand."""
        return int(self.backward or self.recompute) ^ int(self.swapped)


def accumulate(grads: dict, key: str, g: torch.Tensor) -> None:
    """Add gradient ``g`` of env key ``key`` to a micro-batch's ``grads``."""
    grads[key] = g if key not in grads else grads[key] + g
