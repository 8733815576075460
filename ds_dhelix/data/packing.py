"""Encoded records -> blocks of ``seq_len`` tokens, one record at a time (so a streamed file packs
the same way as a whole one), with counts of what the loss will see.

    Packer(seq_len, packing, whole_records).blocks(records) -> {"input_ids", "labels"
        (+ "position_ids" | "attention_mask")} per block; Packer.stats

Two ways to place records:

- flowing (text, and every format under ``concat``): records back to back, a record crossing a
  block boundary continues in the next block (``docs``: its positions restart there);
- whole (chat and prompt-completion under ``docs`` / ``none``): a block takes whole records only
  (``docs``: as many as fit, then padding; ``none``: one), so an answer never loses its prompt; a
  record longer than ``seq_len`` is cut to it, or dropped (``drop_long``); a record left without
  any target (its answer began past ``seq_len``) is left out and counted (``no_loss``).

Labels are the input ids where the record's loss mask is 1, else -100; under ``docs`` also -100
at a record's first token (the previous record does not predict it), as HF's packed-sequence
collators do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass
class PackStats:
    """What packing read and made: records read, their tokens, the targets the loss counts in the
    blocks (``loss_tokens``), records cut to ``seq_len`` (``truncated``) or left out as longer
    (``dropped``), whole records left out because no target was left in them (``no_loss``: an
    answer that began past ``seq_len``, or none at all), and the padding share of the blocks'
    tokens."""

    records: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    dropped: int = 0
    no_loss: int = 0
    blocks: int = 0
    padding_tokens: int = 0
    seq_len: int = 0

    @property
    def padding_fraction(self) -> float:
        return self.padding_tokens / max(self.blocks * self.seq_len, 1)

    def as_dict(self) -> dict:
        out = asdict(self)
        del out["seq_len"]
        out["padding_fraction"] = self.padding_fraction
        return out


def check_ids(ids, vocab_size: int | None, where: str) -> None:
    """``ValueError`` naming ``where`` and the id when a token id is outside ``[0, vocab_size)``: the
    embedding would index past its rows (split over TP, every rank would give it a zero row and
    train on silently)."""
    if vocab_size is None or len(ids) == 0:
        return
    ids = np.asarray(ids)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(
            f"{where}: token id {int(bad[0])} is outside the model's vocabulary of {vocab_size} ids "
            f"(0..{vocab_size - 1}); the records were tokenised for another model or tokenizer"
        )


class Packer:
    """Blocks of ``seq_len`` from encoded records (``{"input_ids", "loss_mask"}``), see the module
    docstring; ``stats`` counts as the blocks go out."""

    def __init__(
        self,
        seq_len: int,
        packing: str,
        whole_records: bool,
        drop_long: bool = False,
        pad_id: int = 0,
        vocab_size: int | None = None,
    ):
        from .batches import PACKINGS

        if packing not in PACKINGS:
            raise ValueError(f"packing {packing!r}: use one of {', '.join(PACKINGS)}")
        self.seq_len, self.packing, self.pad_id, self.drop_long = seq_len, packing, pad_id, drop_long
        self.vocab_size = vocab_size  # ids at or beyond it (or negative) are refused, naming the record
        self.whole = whole_records and packing != "concat"
        self.stats = PackStats(seq_len=seq_len)

    def blocks(self, records: Iterable[dict]) -> Iterator[dict[str, torch.Tensor]]:
        pending: list[tuple[np.ndarray, np.ndarray]] = []  # (ids, labels) of records not yet in a block
        size = 0
        for record in records:
            ids = np.asarray(record["input_ids"], dtype=np.int64)
            labels = np.where(np.asarray(record["loss_mask"], dtype=bool), ids, -100)
            self.stats.records += 1
            self.stats.tokens += ids.size
            if ids.size == 0:
                continue
            check_ids(ids, self.vocab_size, f"record {self.stats.records}")
            if self.whole:
                cut = ids.size > self.seq_len
                if cut and self.drop_long:
                    self.stats.dropped += 1
                    continue
                ids, labels = ids[: self.seq_len], labels[: self.seq_len]
                if not (labels[1:] != -100).any():
                    self.stats.no_loss += 1
                    continue
                self.stats.truncated += cut
                if self.packing == "none" or size + ids.size > self.seq_len:
                    if pending:
                        yield self._emit(pending)
                    pending, size = [], 0
            elif self.packing == "none":
                for lo in range(0, ids.size, self.seq_len):
                    yield self._emit([(ids[lo : lo + self.seq_len], labels[lo : lo + self.seq_len])])
                continue
            pending.append((ids, labels))
            size += ids.size
            while not self.whole and size >= self.seq_len:
                block, pending, size = _take(pending, self.seq_len)
                yield self._emit(block)
        if self.whole and pending:
            yield self._emit(pending)

    def _emit(self, parts: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
        """One block from whole or cut records (padded to ``seq_len`` where they fall short)."""
        s = self.seq_len
        ids = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        starts = np.zeros(ids.size, dtype=bool)
        starts[np.cumsum([0] + [p[0].size for p in parts[:-1]])] = True
        pad = s - ids.size
        if pad:
            ids = np.concatenate([ids, np.full(pad, self.pad_id, dtype=np.int64)])
            labels = np.concatenate([labels, np.full(pad, -100, dtype=np.int64)])
            starts = np.concatenate([starts, [True], np.zeros(pad - 1, dtype=bool)])
        out = {"input_ids": torch.from_numpy(ids)}
        if self.packing == "docs":
            index = np.arange(s)
            positions = index - np.maximum.accumulate(np.where(starts, index, 0))
            labels = labels.copy()
            labels[1:][starts[1:]] = -100
            out["position_ids"] = torch.from_numpy(positions)
        elif self.packing == "none":
            mask = np.ones(s, dtype=np.int64)
            mask[s - pad :] = 0
            out["attention_mask"] = torch.from_numpy(mask)
        out["labels"] = torch.from_numpy(labels)
        self.stats.blocks += 1
        self.stats.padding_tokens += pad
        self.stats.loss_tokens += int((labels[1:] != -100).sum())
        return out


def _take(pending, n):
    """The first ``n`` tokens of the pending records (a record cut at the boundary leaves its rest,
    which starts the next block), and what is left."""
    block, left, got = [], [], 0
    for k, (ids, labels) in enumerate(pending):
        if got + ids.size <= n:
            block.append((ids, labels))
            got += ids.size
            if got == n:
                left = pending[k + 1 :]
                break
        else:
            cut = n - got
            block.append((ids[:cut], labels[:cut]))
            left = [(ids[cut:], labels[cut:])] + pending[k + 1 :]
            break
    return block, left, sum(p[0].size for p in left)


def stack_blocks(blocks: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Blocks -> fields [n, seq_len] (a BlockDataset's)."""
    blocks = list(blocks)
    if not blocks:
        return {}
    return {k: torch.stack([b[k] for b in blocks]) for k in blocks[0]}
