"""Token ids to fixed-length micro-batches: blocks by packing, shuffled by seed, sharded over
data-parallel replicas, resumable at any micro-batch; the one-shape check every step relies on.

    batch_iterator(ids, micro, seq_len, seed, rank, replicas, start, packing)
        -> {"input_ids", "labels"} [micro, seq_len] (+ "position_ids" | "attention_mask")
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .inputs import document_positions

PACKINGS = ("concat", "docs", "none")
"""How documents become blocks of ``seq_len`` tokens (``train.py --packing``):

- ``concat``: documents back to back, EOS between them; positions run on and attention crosses
  documents (classic GPT packing);
- ``docs``: the same blocks, plus ``position_ids`` that restart at each document and targets across
  a document boundary ignored (-100); the op graph masks attention across documents (a
  block-diagonal causal mask built from ``position_ids``);
- ``none``: each document padded to its own block(s) (a longer one is cut into several), with an
  ``attention_mask`` and -100 targets on the padding."""


class TokenDataset(torch.utils.data.Dataset):
    """Blocks of ``seq_len`` tokens; item = {"input_ids", "labels"} (labels = inputs, the HF
    causal-LM model shifts them), plus "position_ids" (``packing="docs"``) or "attention_mask"
    (``packing="none"``). ``eos_id``: the document separator in ``token_ids`` (needed by "docs"
    and "none"); ``pad_id``: the padding of "none". The tail shorter than a block is left out
    (``concat`` / ``docs``)."""

    def __init__(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        seq_len: int,
        packing: str = "concat",
        eos_id: int | None = None,
        pad_id: int = 0,
    ):
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        _check_positive("seq_len", seq_len)
        if packing not in PACKINGS:
            raise ValueError(f"packing {packing!r}: use one of {', '.join(PACKINGS)}")
        if packing != "concat" and eos_id is None:
            raise ValueError(f"packing {packing!r} needs the EOS id that separates documents")
        self.seq_len, self.packing = seq_len, packing
        if packing == "none":
            self.fields = _padded_documents(ids, seq_len, eos_id, pad_id)
        else:
            if ids.numel() < seq_len:
                raise ValueError(f"{ids.numel()} tokens are fewer than one block of seq_len {seq_len}")
            blocks = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
            self.fields = {"input_ids": blocks, "labels": blocks}
            if packing == "docs":
                self.fields = {"input_ids": blocks, **document_positions(blocks, eos_id)}
        self.blocks = self.fields["input_ids"]

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows(torch.tensor([i]), squeeze=True)

    def rows(self, index: torch.Tensor, squeeze: bool = False) -> dict[str, torch.Tensor]:
        out = {k: v[index].clone() for k, v in self.fields.items()}
        return {k: v[0] for k, v in out.items()} if squeeze else out


class BlockDataset(torch.utils.data.Dataset):
    """Packed blocks (``packing.stack_blocks``) with TokenDataset's interface; ``stats``: the
    ``PackStats`` of their packing."""

    def __init__(self, fields: dict[str, torch.Tensor], stats=None):
        self.fields, self.stats = fields, stats
        self.blocks = fields.get("input_ids", torch.zeros(0, 0, dtype=torch.long))

    __len__ = TokenDataset.__len__
    __getitem__ = TokenDataset.__getitem__
    rows = TokenDataset.rows


def block_batches(
    dataset, micro_batch_size: int, seed: int, rank: int = 0, num_replicas: int = 1, start: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """``batch_iterator`` over blocks already packed (a ``TokenDataset`` or ``BlockDataset``)."""
    _check_start(start)
    num_batches = len(dataset) // num_replicas // micro_batch_size
    if num_batches == 0:
        raise ValueError(
            f"{len(dataset)} blocks cannot fill one micro-batch of {micro_batch_size} on each of "
            f"{num_replicas} replicas; use more data, a shorter seq_len or a smaller micro-batch"
        )
    return _batches(dataset, micro_batch_size, seed, rank, num_replicas, num_batches, start)


def stream_batches(
    epoch_blocks,
    micro_batch_size: int,
    seed: int,
    rank: int = 0,
    num_replicas: int = 1,
    start: int = 0,
    buffer: int = 1024,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches from a stream of blocks read as it goes: ``epoch_blocks(epoch)``
    gives one epoch's blocks in file order; they are shuffled in a window of ``buffer`` blocks
    (seeded by ``seed + epoch``) and dealt in rounds of ``micro_batch_size x num_replicas``,
    replica ``rank`` taking every ``num_replicas``-th block of a round (the last incomplete round
    of an epoch is left out on every replica). ``start`` micro-batches are skipped (a resume reads
    the stream again up to them: the same blocks in the same order)."""
    _check_start(start)
    per_round = micro_batch_size * num_replicas
    done, epoch = 0, 0
    while True:
        made = 0
        rounds = _chunks(_window_shuffle(epoch_blocks(epoch), buffer, seed + epoch), per_round)
        for round_ in rounds:
            made += 1
            done += 1
            if done > start:
                yield {k: torch.stack([b[k] for b in round_[rank::num_replicas]]) for k in round_[0]}
        if made == 0:
            raise ValueError(
                f"the data stream cannot fill one micro-batch of {micro_batch_size} on each of {num_replicas} replicas"
            )
        epoch += 1


def _window_shuffle(items, size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    window = []
    for item in items:
        window.append(item)
        if len(window) == size:
            yield window.pop(int(torch.randint(len(window), (), generator=gen)))
    order = torch.randperm(len(window), generator=gen).tolist()
    yield from (window[i] for i in order)


def _chunks(items, n: int):
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []


def _check_start(start) -> None:
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")


def _padded_documents(ids: torch.Tensor, seq_len: int, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    ends = (ids == eos_id).nonzero().flatten().tolist()
    rows, lo = [], 0
    for end in ends + ([ids.numel() - 1] if not ends or ends[-1] != ids.numel() - 1 else []):
        doc = ids[lo : end + 1]
        lo = end + 1
        rows += [doc[i : i + seq_len] for i in range(0, doc.numel(), seq_len)]
    if not rows:
        raise ValueError("no documents to pad")
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for r, row in enumerate(rows):
        input_ids[r, : row.numel()] = row
        mask[r, : row.numel()] = 1
    return {"input_ids": input_ids, "labels": input_ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def batch_iterator(
    token_ids: Sequence[int] | torch.Tensor,
    micro_batch_size: int,
    seq_len: int,
    seed: int,
    rank: int = 0,
    num_replicas: int = 1,
    start: int = 0,
    packing: str = "concat",
    eos_id: int | None = None,
    pad_id: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches {"input_ids", "labels"} (+ "position_ids" / "attention_mask" by
    ``packing``, see ``PACKINGS``): LongTensor [micro_batch_size, seq_len].

    Each epoch shuffles the blocks with ``seed + epoch``; replica ``rank`` takes every
    ``num_replicas``-th block, so replicas see disjoint blocks and the same number of batches.
    ``start``: skip the first ``start`` micro-batches of this replica (a resumed run continues where
    the checkpoint's run stopped: epoch ``start // batches_per_epoch``, batch ``start % ...``).
    """
    _check_start(start)
    _check_positive("micro_batch_size", micro_batch_size)
    _check_positive("num_replicas", num_replicas)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be an int in [0, {num_replicas}), got {rank!r}")
    dataset = TokenDataset(token_ids, seq_len, packing, eos_id, pad_id)
    per_replica = len(dataset) // num_replicas
    num_batches = per_replica // micro_batch_size
    if num_batches == 0:
        raise ValueError(
            f"{len(dataset)} blocks of seq_len {seq_len} cannot fill one micro-batch of {micro_batch_size} "
            f"on each of {num_replicas} replicas (need {micro_batch_size * num_replicas} blocks); "
            f"use more text, a shorter seq_len or a smaller micro-batch"
        )
    return _batches(dataset, micro_batch_size, seed, rank, num_replicas, num_batches, start)


def _batches(dataset, micro_batch_size, seed, rank, num_replicas, num_batches, start=0):
    epoch, first = divmod(start, num_batches)
    while True:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[: num_batches * micro_batch_size * num_replicas][rank::num_replicas]
        for b in range(first, num_batches):
            yield dataset.rows(mine[b * micro_batch_size : (b + 1) * micro_batch_size])
        epoch, first = epoch + 1, 0


def check_batch_shape(batch: dict[str, torch.Tensor], expected: tuple[int, int]) -> None:
    """Raise ValueError unless input_ids and labels are LongTensors of shape ``expected`` = (micro, seq).

    Every micro-batch of a run must have one shape: the schedules pair micro-batches and the peers'
    collectives assume the same sizes, so a changed length would hang or mis-train.
    """
    micro, seq = expected
    for key in ("input_ids", "labels"):
        if key not in batch:
            raise ValueError(f"batch has no '{key}' (keys: {sorted(batch)})")
        t = batch[key]
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"batch['{key}'] must be a 2-D tensor [micro_batch, seq_len], got {_describe(t)}")
        if t.shape[1] != seq:
            raise ValueError(
                f"sequence length changed: expected {seq}, got {t.shape[1]} (batch['{key}'] shape {tuple(t.shape)}); "
                f"every micro-batch must have the same length: pad or pack the data to {seq} tokens"
            )
        if t.shape[0] != micro:
            raise ValueError(
                f"micro-batch size changed: expected {micro}, got {t.shape[0]} "
                f"(batch['{key}'] shape {tuple(t.shape)}); "
                f"drop the last partial batch or set train_micro_batch_size_per_gpu to {t.shape[0]}"
            )
        if t.dtype != torch.long:
            raise ValueError(f"batch['{key}'] must hold token ids (torch.long), got {t.dtype}")


def _describe(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
