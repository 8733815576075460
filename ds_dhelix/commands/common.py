"""Argument types and helpers the ``dhelix`` subcommands share, and the layout flags, declared here
once: ``--model``, ``--tp``, ``--pp``, ``--ep``, ``--cp``, ``--cp-comm``, ``--dp``, ``--seq-len``,
``--micro-batch-size``, ``--micro-batches``, ``--num-layers``, ``--link-gbps`` and
``--link-burst-kb`` mean the same, parse the same and read the same in every command that has
them (``add_layout_flags``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ds_dhelix.bench.options import BenchOptions

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
        raise argparse.ArgumentTypeError(f"{text!r}: a link rate must be > 0 Gbit/s (or 'unshaped')")
    return value


def link_text(rate: float | str | None) -> str:
    """A parsed link rate as the command line writes it: ``2``, ``unshaped``, ``matched``."""
    return "unshaped" if rate is None else rate if isinstance(rate, str) else f"{rate:g}"


# ------------------------------------------------------------------------------ the layout flags
@dataclass(frozen=True)
class Default:
    """A command's default of a layout flag that is not a value argparse can show: what the parser
    leaves when the flag is absent (``value``: None, or ``argparse.SUPPRESS`` for no attribute at
    all) and what that means, for ``--help`` (``text``)."""

    value: object
    text: str


@dataclass(frozen=True)
class LayoutFlag:
    """One layout or link flag as every command that has it declares it: ``--<dest with dashes>``,
    its meaning, its standard default (a value or a ``Default``), its argparse type and metavar."""

    dest: str
    help: str
    default: object
    type: Callable[[str], object] | None = int
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


LINK_SWEEP_HELP = (
    "; several rates run one after another, and 'matched' is the rate at which the sequential "
    "run's comm/comp is 0.9-1.1 (calibrated by short sequential runs, reported)"
)
"""What ``--link-gbps`` adds where it sweeps rates (``add_layout_flags(..., sweep=True)``: dhelix bench)."""

LAYOUT_FLAGS = (
    LayoutFlag(
        "model",
        "preset name or local HF checkpoint dir",
        BenchOptions.model,
        type=None,
    ),
    LayoutFlag("tp", "tensor-parallel size", BenchOptions.tp),
    LayoutFlag("pp", "pipeline stages (pipeline-parallel size)", BenchOptions.pp),
    LayoutFlag(
        "ep", "expert-parallel size (MoE models): experts sharded over ep of the data-parallel ranks", BenchOptions.ep
    ),
    LayoutFlag("dp", "data-parallel size; world = tp x cp x pp x dp ranks", Default(None, "--ep")),
    LayoutFlag("cp", "context-parallel size: each sequence's tokens split over cp ranks", BenchOptions.cp),
    LayoutFlag(
        "cp_comm",
        "context parallelism's exchange: ulysses (all-to-alls, heads split over the CP ranks) "
        "or ring (ring attention: key/value blocks passed point to point, one COMM op per ring "
        "step, zig-zag split)",
        BenchOptions.cp_comm,
        type=None,
        choices=("ulysses", "ring"),
    ),
    LayoutFlag("seq_len", "tokens per sequence", BenchOptions.seq_len),
    LayoutFlag("micro_batch_size", "sequences per micro-batch", BenchOptions.micro_batch_size),
    LayoutFlag(
        "micro_batches",
        "micro-batches per optimizer step on each data-parallel rank (gradient accumulation)",
        BenchOptions.micro_batches,
    ),
    LayoutFlag("num_layers", "shrink the preset to this many decoder layers", Default(None, "the model's")),
    LayoutFlag(
        "link_gbps",
        "emulated link rate in Gbit/s (a token-bucket-shaped loopback), or 'unshaped' for plain loopback",
        Default(None, "unshaped"),
        type=link_rate,
        metavar="GBPS",
    ),
    LayoutFlag(
        "link_burst_kb",
        "token-bucket burst of the emulated link in KB (the default is just above the "
        "loopback MTU; a larger one lets an idle link bank credit)",
        BenchOptions.link_burst_kb,
        metavar="KB",
    ),
)
"""Every layout flag, in the order a command lists them."""


def layout_flag(dest: str) -> LayoutFlag:
    """The ``LayoutFlag`` of ``dest`` ("tp", "link_gbps", ...)."""
    for spec in LAYOUT_FLAGS:
        if spec.dest == dest:
            return spec
    raise KeyError(f"{dest!r} is not a layout flag: {', '.join(s.dest for s in LAYOUT_FLAGS)}")


def add_layout_flags(
    parser: argparse.ArgumentParser,
    which: Sequence[str],
    defaults: Mapping[str, object] | None = None,
    *,
    sweep: bool = False,
    given_only: bool = False,
    required: Sequence[str] = (),
    aliases: Mapping[str, Sequence[str]] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """Add the layout flags ``which`` (``LayoutFlag.dest`` names, in that order) to ``parser``, each with
    its one type, metavar and meaning.

    defaults    the command's own default of some of them, a value or a ``Default`` (the others
                keep the flag's standard default)
    sweep       ``--link-gbps`` takes several rates, and 'matched' (``bench_link_rate``)
    given_only  a flag not given parses to None (the command fills its defaults in later, as dhelix
                bench does for ``--quick``); ``--help`` still says what the defaults are
    required    flags the command cannot run without (no default)
    aliases     other spellings a command has long accepted (dhelix simulate's ``--stages``)
    notes       what a command adds to a flag's meaning (dhelix predict's ``--model`` reads a config.json)
    """
    defaults, aliases, notes = defaults or {}, aliases or {}, notes or {}
    stray = sorted(set(defaults) - set(which))
    assert not stray, f"defaults for flags not in which: {stray}"
    for dest in which:
        spec = layout_flag(dest)
        default = defaults.get(dest, spec.default)
        if given_only and not isinstance(default, Default):
            default = Default(None, str(default))
        meaning = spec.help + notes.get(dest, "")
        kwargs = {"type": spec.type, "choices": spec.choices, "metavar": spec.metavar, "help": meaning}
        if dest == "link_gbps" and sweep:
            kwargs.update(type=bench_link_rate, nargs="+", help=meaning + LINK_SWEEP_HELP)
        if dest in required:
            kwargs.update(required=True, help=f"{kwargs['help']} (required)")
        elif isinstance(default, Default):
            kwargs.update(default=default.value, help=f"{kwargs['help']} (default: {default.text})")
        else:
            kwargs.update(default=default, help=f"{kwargs['help']} (default: %(default)s)")
        parser.add_argument(spec.flag, *aliases.get(dest, ()), dest=dest, **kwargs)


def check_model(opts) -> None:
    """Bad model / TP / EP / sequence length: a ValueError before any process starts."""
    from ds_dhelix.config.dims import ParallelDims
    from hf_models.adapters import check_model
    from hf_models.registry import load_config

    config = load_config(opts.model)
    check_model(
        ParallelDims(
            opts.world,
            tp=opts.tp,
            pp=opts.pp,
            ep=opts.ep,
            cp=getattr(opts, "cp", 1),
            cp_comm=getattr(opts, "cp_comm", "ulysses"),
        ),
        config,
    )
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
