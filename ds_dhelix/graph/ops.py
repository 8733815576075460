"""Op vocabulary shared by op graphs, overlap tables, plans, traces and the profiler.

A decoder layer is an ordered list of named ops. Each op is either compute (``COMP``) or
communication (``COMM``). The backward op list of a layer is the forward list reversed; an op keeps
its name in both directions (``"attn.ag"`` forward is an all-gather, backward a reduce-scatter).

This module is plain data: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OpKind(str, enum.Enum):
    COMP = "comp"
    COMM = "comm"


@dataclass(frozen=True)
class OpSpec:
    """One op of a layer: a stable name (``"attn.qkv"``) and its kind."""

    name: str
    kind: OpKind

    @property
    def is_comm(self) -> bool:
        return self.kind is OpKind.COMM


def op_specs(pairs) -> tuple[OpSpec, ...]:
    """``[("attn.norm", "comp"), ...]`` -> a tuple of ``OpSpec``."""
    return tuple(OpSpec(name, OpKind(kind)) for name, kind in pairs)


def backward_order(ops: tuple[OpSpec, ...]) -> tuple[OpSpec, ...]:
    """The order in which a layer's ops run in backward: the forward order reversed."""
    return tuple(reversed(ops))


def comm_runs(ops: tuple[OpSpec, ...]) -> list[tuple[int, int]]:
    """Split an op list into runs delimited by communication ops (the paper's operator groups).

    Every COMM op is a run of its own; each maximal stretch of COMP ops between them is one run.
    Returns half-open index ranges ``(start, stop)`` in order, covering the whole list.
    """
    runs: list[tuple[int, int]] = []
    start = 0
    for i, op in enumerate(ops):
        if op.is_comm:
            if start < i:
                runs.append((start, i))
            runs.append((i, i + 1))
            start = i + 1
    if start < len(ops):
        runs.append((start, len(ops)))
    return runs
