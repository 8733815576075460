"""Model folding: the layer list cut into 2p chunks and folded into a U over p pipeline ranks.

Chunk ``c`` (``0 <= c < 2p``) is the c-th slice of the layer list. Rank ``r`` holds chunk ``r``
(phase 0, outbound) and chunk ``2p-1-r`` (phase 1, return). A micro-batch's forward runs the chunks
in order, so it leaves rank 0, turns on rank p-1 and comes back; backward runs the reverse::

    p = 3        phase 0 (outbound)            phase 1 (return)
    rank 0   [embed] chunk 0 ──►                ◄── chunk 5 [norm, head, loss]
    rank 1           chunk 1 ──►                ◄── chunk 4
    rank 2           chunk 2 ─────── turn ──────►   chunk 3

Rank 0 therefore holds the embedding (start of phase 0) and the final norm, LM head and loss (end of
phase 1); tied embeddings need no cross-rank gradient reduction.

Uneven layer counts (``num_layers = q * 2p + e``): every chunk gets ``q`` layers and the ``e`` extra
layers go one per chunk to the ranks farthest from rank 0, both chunks of a rank before the next
rank inward (rank p-1 phase 0, rank p-1 phase 1, rank p-2 phase 0, ...). So no chunk differs from
another by more than one layer, rank 0 (which also runs embedding, head and loss) gets extras last,
and a rank's two chunks, which SI co-executes, differ by at most one layer.

Plain data: no torch, no deepspeed.
"""

from __future__ import annotations

from dataclasses import dataclass

PHASE_OUT = 0  # outbound: rank 0 -> p-1
PHASE_RETURN = 1  # return: rank p-1 -> 0


def _check_stages(num_stages: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r}: the fold needs at least 1 pipeline rank; pass a positive integer")


def chunk_index(rank: int, phase: int, num_stages: int) -> int:
    """The chunk (position in the forward data flow, 0..2p-1) that ``rank`` runs in ``phase``."""
    assert 0 <= rank < num_stages and phase in (0, 1), (rank, phase, num_stages)
    return rank if phase == PHASE_OUT else 2 * num_stages - 1 - rank


def chunk_owner(chunk: int, num_stages: int) -> tuple[int, int]:
    """``(rank, phase)`` that holds ``chunk``; the inverse of :func:`chunk_index`."""
    assert 0 <= chunk < 2 * num_stages, (chunk, num_stages)
    if chunk < num_stages:
        return chunk, PHASE_OUT
    return 2 * num_stages - 1 - chunk, PHASE_RETURN


def next_chunk_owner(rank: int, phase: int, num_stages: int) -> tuple[int, int] | None:
    """Where the forward output of ``(rank, phase)`` goes; ``None`` after the last chunk (loss)."""
    chunk = chunk_index(rank, phase, num_stages) + 1
    return chunk_owner(chunk, num_stages) if chunk < 2 * num_stages else None


def prev_chunk_owner(rank: int, phase: int, num_stages: int) -> tuple[int, int] | None:
    """Where the forward input of ``(rank, phase)`` comes from; ``None`` for the first chunk."""
    chunk = chunk_index(rank, phase, num_stages) - 1
    return chunk_owner(chunk, num_stages) if chunk >= 0 else None


def balanced_split(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """The default chunk sizes (see the module docstring for where extra layers go)."""
    num_chunks = 2 * num_stages
    base, extra = divmod(num_layers, num_chunks)
    sizes = [base] * num_chunks
    for k in range(extra):
        rank, phase = num_stages - 1 - k // 2, k % 2
        sizes[chunk_index(rank, phase, num_stages)] += 1
    return tuple(sizes)


@dataclass(frozen=True)
class LayerFold:
    """Which layers each (rank, phase) holds. Build it with :func:`fold_layers`."""

    num_layers: int
    num_stages: int
    chunk_sizes: tuple[int, ...]  # layers per chunk, in forward data-flow order

    def chunk_layers(self, chunk: int) -> range:
        """The layer indices of ``chunk``."""
        start = sum(self.chunk_sizes[:chunk])
        return range(start, start + self.chunk_sizes[chunk])

    def layers(self, rank: int, phase: int) -> range:
        """The layer indices that ``rank`` runs in ``phase``."""
        if not 0 <= rank < self.num_stages or phase not in (0, 1):
            raise ValueError(f"rank={rank}, phase={phase}: need 0 <= rank < {self.num_stages} and phase in (0, 1)")
        return self.chunk_layers(chunk_index(rank, phase, self.num_stages))

    def rank_layers(self, rank: int) -> list[int]:
        """All layer indices held by ``rank`` (both phases), ascending."""
        return sorted([*self.layers(rank, 0), *self.layers(rank, 1)])

    def owner(self, layer: int) -> tuple[int, int]:
        """``(rank, phase)`` holding ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer}: the model has layers 0..{self.num_layers - 1}")
        for chunk in range(2 * self.num_stages):
            if layer in self.chunk_layers(chunk):
                return chunk_owner(chunk, self.num_stages)
        raise AssertionError("chunk sizes do not cover the layers")

    def holds_embedding(self, rank: int) -> bool:
        return rank == 0

    def holds_head(self, rank: int) -> bool:
        """Final norm, LM head and loss run at the end of phase 1, on rank 0."""
        return rank == 0

    def table(self) -> str:
        """Printable layer -> (rank, phase) table, embedding first and head/loss last."""
        rows = [("embedding", "-", "0", "0 (start)")]
        for chunk in range(2 * self.num_stages):
            rank, phase = chunk_owner(chunk, self.num_stages)
            for layer in self.chunk_layers(chunk):
                rows.append((str(layer), str(chunk), str(rank), str(phase)))
        rows.append(("norm+head+loss", "-", "0", "1 (end)"))
        header = ("layer", "chunk", "rank", "phase")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows])


def fold_layers(num_layers: int, num_stages: int, split=None) -> LayerFold:
    """Cut ``num_layers`` layers into ``2 * num_stages`` chunks and fold them over the ranks.

    ``split`` (optional): the 2p chunk sizes in data-flow order (chunk c runs on rank c for c < p,
    on rank 2p-1-c otherwise); each at least 1, summing to ``num_layers``. Without it the sizes are
    :func:`balanced_split`. Raises ValueError naming the values and the fix.
    """
    _check_stages(num_stages)
    num_chunks = 2 * num_stages
    if not isinstance(num_layers, int) or num_layers < num_chunks:
        fix = (
            f"use num_stages <= {num_layers // 2} or a deeper model"
            if isinstance(num_layers, int) and num_layers >= 2
            else "use a model with layers"
        )
        raise ValueError(
            f"num_layers={num_layers!r} < {num_chunks} chunks: folding over "
            f"num_stages={num_stages} needs at least 2*{num_stages}={num_chunks} "
            f"layers (one per chunk); {fix}"
        )
    if split is None:
        sizes = balanced_split(num_layers, num_stages)
    else:
        sizes = tuple(split)
        if len(sizes) != num_chunks:
            raise ValueError(
                f"split={list(sizes)} has {len(sizes)} entries; num_stages="
                f"{num_stages} needs 2*{num_stages}={num_chunks} chunk sizes"
            )
        if any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"split={list(sizes)}: every chunk needs an integer >= 1 layers")
        if sum(sizes) != num_layers:
            raise ValueError(
                f"split={list(sizes)} sums to {sum(sizes)} but "
                f"num_layers={num_layers}; the sizes must add up to the layer count"
            )
    return LayerFold(num_layers, num_stages, sizes)
