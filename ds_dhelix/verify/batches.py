"""Synthetic batches: deterministic random token ids, the one builder (``random_batches``) that
parity, the bench, the GPU checks and the tests draw from; parity's steps (``make_batches``) and
their halves (``halve_batches``)."""

from __future__ import annotations

import torch

from .options import ParityOptions

EOS_ID = 2  # the presets' EOS token: random ids are drawn from 3 on, so only placed ones end documents


def random_batches(
    vocab: int, num: int, rows: int, seq: int, *, seed: int = 1, generator=None, packing: str = "concat", device=None
) -> list[dict]:
    """``num`` micro-batches of ``[rows, seq]`` random token ids drawn from 3 on (ids 0-2 are the
    presets' special tokens), deterministic: from ``generator`` when given (a run of calls then
    continues one sequence), else a fresh one seeded with ``seed``. ``packing="docs"``: each row
    holds documents of random lengths (an EOS ends each, ~4 a row) with their ``position_ids`` and
    -100 targets across document boundaries; else ``labels`` are the ids. ``device``: where the
    tensors go (drawn on the CPU either way, so every device gets the same ids)."""
    from ..data import document_positions

    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = torch.randint(3, vocab, (rows, seq), generator=g)
        if packing == "docs":
            docs = ids.masked_fill(torch.rand(ids.shape, generator=g) < 4.0 / seq, EOS_ID)
            batch = {"input_ids": docs, **document_positions(docs, EOS_ID)}
        else:
            batch = {"input_ids": ids}
        if device is not None:
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if "labels" not in batch:
            batch["labels"] = batch["input_ids"].clone()
        out.append(batch)
    return out


def make_batches(opts: ParityOptions, vocab: int) -> list[list[dict]]:
    """``[step][dp_rank * m + k]`` micro-batches of random token ids (``random_batches``, one
    sequence over the steps seeded by ``opts.seed``), packed as ``opts.packing`` says."""
    g = torch.Generator().manual_seed(opts.seed + 1)
    return [
        random_batches(
            vocab, opts.dp * opts.micro_batches, opts.micro_batch_size, opts.seq_len, generator=g, packing=opts.packing
        )
        for _ in range(opts.steps)
    ]


def halve_batches(batches):
    """``make_batches``' steps with every micro-batch cut into its two halves, in order."""
    from ..runtime.interpreter import half_batches

    out = []
    for step in batches:
        out.append(
            [
                {k: v for k, v in half.items() if k not in ("loss_denominator", "loss_share")}
                for b in step
                for half in half_batches(b)
            ]
        )
    return out
