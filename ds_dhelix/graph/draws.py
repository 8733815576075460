"""Random draws of the op graph (dropout masks, MoE router noise) that do not depend on the schedule.

Every draw runs on a private RNG stream seeded by what identifies it, never by the order it runs
in: the run's base seed, the micro-batch's number in the run (``side["serial"]``), the layer, the op
and the rank (each TP rank holds another sequence shard or other heads, each DP rank other data).
SI, sequential and a resumed run therefore draw the same masks; the global RNG is untouched.

    draws = Draws(seed)                                   # one per graph
    h = draws.dropout(h, 0.1, side, layer=3, op="mlp.resid", training=module.training)
    with draws.rng(x.device, side, layer=3, op="attn.core"):
        out = sdpa(q, k, v, dropout_p=0.1)                # a kernel's own draws, seeded alike
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib

import torch
import torch.nn.functional as F

_MOD = 2**63 - 1


def draw_seed(base: int, serial: int, layer: int, rank: int, op: str = "") -> int:
    """The seed of one draw (``op`` empty: the MoE router's noise, as it has always been seeded)."""
    seed = (((base * 1_000_003 + serial) * 1_009 + layer) * 65_537 + rank) % _MOD
    return (seed * 1_000_033 + zlib.crc32(op.encode())) % _MOD if op else seed


@contextlib.contextmanager
def seeded_rng(device: torch.device, seed: int):
    """Run the body on a private RNG stream seeded with ``seed``; the global stream is untouched."""
    if device.type == "cuda":
        with torch.random.fork_rng(devices=[device.index if device.index is not None else 0], device_type="cuda"):
            torch.cuda.manual_seed(seed)
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            yield


_SIDE: contextvars.ContextVar = contextvars.ContextVar("dhelix_op_side", default=None)


@contextlib.contextmanager
def op_side(side: dict):
    """The micro-batch side inputs of the op running inside (``current_side``): what a module called
    by an op reads to seed its draws (LoRA dropout), where the op does not pass the side on."""
    token = _SIDE.set(side)
    try:
        yield
    finally:
        _SIDE.reset(token)


def current_side() -> dict | None:
    """The side of the op running now (``op_side``), None outside the executor's ops."""
    return _SIDE.get()


class Draws:
    """The seeds of one graph's draws: ``seed`` (None: ``torch.initial_seed()``) and this rank."""

    def __init__(self, seed: int | None = None, rank: int | None = None):
        import torch.distributed as dist

        self.base = torch.initial_seed() % (2**31) if seed is None else seed
        self.rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank

    def rng(self, device, side: dict, layer: int, op: str):
        return seeded_rng(device, draw_seed(self.base, side["serial"], layer, self.rank, op))

    def dropout(self, x: torch.Tensor, p: float, side: dict, layer: int, op: str, training: bool) -> torch.Tensor:
        """``F.dropout(x, p)`` with this draw's mask; ``x`` itself when not training or ``p`` is 0."""
        if not training or not p:
            return x
        with self.rng(x.device, side, layer, op):
            return F.dropout(x, p, training=True)
