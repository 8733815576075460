"""Activation recompute inside the op graph (``dhelix.recompute``): what a decoder layer keeps between
its forward and its backward, and what it recomputes; the recomputation runs as compute of the
backward strand, so the other strand's collectives overlap it.

    "none"       every op saves what its backward needs
    "selective"  ops the adapter marks ``selective`` (the attention core, the MLP activation with
                 its projection, the experts' activation) run forward without autograd and keep
                 only their inputs; each recomputes its forward right before its backward
    "full"       a decoder layer runs forward without autograd and keeps only its inputs (the env
                 tensors it reads, e.g. ``h``); its backward starts by recomputing the whole layer
                 forward (collectives included, launched on the backward strand's channel)

The embedding and head blocks are never recomputed. Recomputed values are bitwise the originals
(the same ops on the same inputs; random draws are seeded by micro-batch, layer and op), so
losses and gradients do not change. Kept inputs are counted by the activation meter.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("none", "selective", "full")


@dataclass
class Kept:
    """Inputs an op or a layer keeps instead of its saved tensors: ``values`` by env key, and the
    meter's handles that count them (released with this object)."""

    values: dict
    handles: tuple = ()


class RecomputePolicy:
    """Which blocks and ops of ``graph`` recompute under ``mode``."""

    def __init__(self, mode: str, graph):
        if mode not in MODES:
            raise ValueError(f"recompute mode {mode!r}: choose one of {', '.join(MODES)}")
        self.mode, self.graph = mode, graph
        self._live_in: dict[int, tuple[str, ...]] = {}

    def is_layer(self, block: int) -> bool:
        return 0 < block < len(self.graph.blocks) - 1

    def full(self, block: int) -> bool:
        """The whole block runs forward without autograd and recomputes before its backward."""
        return self.mode == "full" and self.is_layer(block)

    def selective(self, block: int, op) -> bool:
        """This op alone runs forward without autograd and recomputes before its backward."""
        return self.mode == "selective" and self.is_layer(block) and getattr(op, "selective", False)

    def live_in(self, block: int) -> tuple[str, ...]:
        """Env keys the block reads before writing them: what a recomputed layer keeps."""
        if block not in self._live_in:
            written, keys = set(), []
            for op in self.graph.blocks[block]:
                keys += [k for k in op.inputs if k not in written and k not in keys]
                written.update(op.outputs)
            self._live_in[block] = tuple(keys)
        return self._live_in[block]


def keep(env: dict, keys, meter=None) -> Kept:
    """The env tensors ``keys``, held (and counted by ``meter``) until the recomputation."""
    values = {k: env[k] for k in keys}
    handles = tuple(meter.hold(v) for v in values.values()) if meter is not None else ()
    return Kept(values, handles)
