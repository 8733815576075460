"""The ``dhelix`` command. Each subcommand lives in ``ds_dhelix/commands/<name>.py`` and exposes
``register(subparsers)``, which adds its parser and sets ``func(args) -> int`` as the handler."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

from .config.flags import StrictParser

# Subcommand modules, in the order `dhelix --help` lists them.
COMMANDS = ("parity", "profile", "plan", "validate_plan", "simulate", "bench", "trace", "predict", "convert_checkpoint")


def build_parser() -> StrictParser:
    """``dhelix`` and its subcommands: flags never abbreviated, ``-``/``_`` alike, an unknown flag
    refused by its subcommand with a did-you-mean, defaults in ``--help`` (``StrictParser``)."""
    parser = StrictParser(
        prog="dhelix", description="ds_dhelix: strand interleaving (micro-batch co-execution) for DeepSpeed."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"ds_dhelix.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"ds_dhelix.commands.{name}":
                raise
            continue  # not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    # With --json, stdout carries only the JSON document (commands print it to ``args.stdout``);
    # everything else, DeepSpeed's log lines included, goes to stderr: at the file-descriptor level
    # when stdout is the process's fd 1, so spawned ranks' import-time lines go there too.
    args.stdout, quiet = sys.stdout, contextlib.nullcontext()
    if getattr(args, "json", False):
        if _is_fd1(sys.stdout):
            from .commands.common import stdout_to_stderr

            sys.stdout.flush()
            args.stdout, quiet = os.fdopen(os.dup(1), "w"), stdout_to_stderr(True)
        else:
            quiet = contextlib.redirect_stdout(sys.stderr)
    try:
        with quiet:
            return int(args.func(args) or 0)
    except ValueError as err:  # user mistakes: one clear line, no traceback
        print(f"dhelix {args.command}: error: {err}", file=sys.stderr)
        return 2
    finally:
        if args.stdout is not sys.stdout:
            args.stdout.close()


def _is_fd1(stream) -> bool:
    try:
        return stream.fileno() == 1
    except (AttributeError, OSError, ValueError):  # a captured or replaced stream
        return False


if __name__ == "__main__":
    sys.exit(main())
