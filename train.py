"""Fine-tune an HF causal LM with DeepSpeed (+ ds_dhelix when the ds_config enables it).

    deepspeed --num_gpus 2 train.py --deepspeed ds_configs/tiny_llama_cpu.json

On a machine without GPUs DeepSpeed's CPU accelerator runs the ranks over gloo. Everything the run
needs is checked before any model is built; bad input gets one line of error and exit code 2.
``--steps`` is the run's total: a resumed run continues from the checkpoint's step to it.

This script is five calls into ``ds_dhelix.training``: the flags (``options``: typed, one field
per flag with its check), ``prepare`` (every check that needs no model), then ``run``'s ``start``,
``build``, ``train`` and ``finish``. A script of one's own can make the same calls.
"""

from __future__ import annotations

import sys

from ds_dhelix.training.options import PROG, build_parser, parse_options
from ds_dhelix.training.prepare import prepare

__all__ = ["build_parser", "main", "run"]


def main(argv=None) -> int:
    options = parse_options(argv)  # argparse's own mistakes: usage and exit 2
    try:
        prep = prepare(options)
    except ValueError as err:
        return _refuse(err)
    return run(prep)


def run(prep) -> int:
    """The prepared run: the ranks start, the engine is built (and resumed), trains, and the run ends."""
    from ds_dhelix.training import teardown
    from ds_dhelix.training.run import build, finish, peers_lost_exit, start, train

    start(prep)
    try:
        engine = build(prep)
    except ValueError as err:  # a checkpoint that does not fit the model: every rank finds it
        return _refuse(err)
    with peers_lost_exit(engine):
        finish(prep, engine, train(prep, engine))
        teardown(engine)
    return 0


def _refuse(err: ValueError) -> int:
    """One ``train.py: error:`` line from rank 0 (under the launcher every rank finds the same), exit 2."""
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{PROG}: error: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
