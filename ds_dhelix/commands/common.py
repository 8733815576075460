"""Argument types and helpers the ``dhelix`` subcommands share."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys


MATCHED = "matched"
"""The link rate ``dhelix bench`` chooses itself: the sequential run's comm/comp near 1."""


def bench_link_rate(text: str) -> float | str | None:
    """``link_rate``, or "matched": ``dhelix bench`` calibrates the rate (``ds_dhelix.bench.match_link``)."""
    return MATCHED if text.lower() == MATCHED else link_rate(text)


def link_rate(text: str) -> float | None:
    """argparse type of a link rate: Gbit/s (> 0), or None for "unshaped" / "none" / "loopback"."""
    if text.lower() in ("unshaped", "none", "loopback"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected Gbit/s like 2 or 'unshaped'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a link rate must be > 0 Gbit/s")
    return value


def check_model(opts) -> None:
    """Bad model / TP / EP / sequence length: a ValueError before any process starts."""
    from ds_dhelix.config.dims import ParallelDims
    from hf_models.adapters import check_model
    from hf_models.registry import load_config
    config = load_config(opts.model)
    check_model(ParallelDims(opts.world, tp=opts.tp, pp=opts.pp, ep=opts.ep, cp=getattr(opts, "cp", 1),
                             cp_comm=getattr(opts, "cp_comm", "ulysses")), config)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit and opts.seq_len > limit:
        raise ValueError(f"--seq-len {opts.seq_len} exceeds the model's {limit} positions")


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool):
    """Send everything written to stdout (libraries' log lines included) to stderr meanwhile."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
