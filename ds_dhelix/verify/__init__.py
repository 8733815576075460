"""The verification harness: a schedule against sequential (bitwise) and against the unsharded HF
model (within stated tolerances) on a spawned gloo world (``dhelix parity``), and the synthetic
batches every check draws from. It sits between the engine (which it builds and trains) and the
bench and commands (which run it); the tests import it too.

    tolerances   each tolerance with its reason
    options      ParityOptions, the model every leg starts from (build)
    batches      random_batches (the one synthetic-batch builder), parity's steps, their halves
    legs         a schedule trained, the first step through the executor alone, HF on one process
    judge        compare, compare_kernels, judge_halves: a parity result from the legs
    pipeline     PP=p with a folded schedule against PP=1 sequential
    parity       run_parity / run_parities: the legs on a spawned world, judged
"""

from .batches import EOS_ID, halve_batches, make_batches, random_batches
from .judge import compare, compare_kernels, describe_settings, judge_halves, max_diff
from .legs import first_step, result_note, train_hf, train_schedule
from .options import DTYPES, ParityOptions, build, trained_stochastic, with_lora
from .parity import run_parities, run_parity
from .pipeline import pipe_label, run_pipe_parity, train_pipeline
from .tolerances import (
    CAPACITY_NOTE,
    HF_GRAD_TOLERANCE,
    HF_LOSS_TOLERANCE,
    INTRA_LOSS_TOLERANCE_LOW_PRECISION,
    KERNELS_GRAD_TOLERANCE,
    PP_TOLERANCE,
)

__all__ = [
    "CAPACITY_NOTE",
    "DTYPES",
    "EOS_ID",
    "HF_GRAD_TOLERANCE",
    "HF_LOSS_TOLERANCE",
    "INTRA_LOSS_TOLERANCE_LOW_PRECISION",
    "KERNELS_GRAD_TOLERANCE",
    "PP_TOLERANCE",
    "ParityOptions",
    "build",
    "compare",
    "compare_kernels",
    "describe_settings",
    "first_step",
    "halve_batches",
    "judge_halves",
    "make_batches",
    "max_diff",
    "pipe_label",
    "random_batches",
    "result_note",
    "run_parities",
    "run_parity",
    "run_pipe_parity",
    "train_hf",
    "train_pipeline",
    "train_schedule",
    "trained_stochastic",
    "with_lora",
]
