"""The training loop of train.py, for any script that builds an engine (``ds_dhelix.initialize``,
or plain DeepSpeed's): steps to a total, evaluation, checkpoints and resume, stops, the summary.

    loop        LoopOptions, train_loop -> TrainLog; the target-weighted step loss, checkpoints, stops
    evaluation  evaluate: the held-out blocks' target-weighted loss (Eval/loss)
    plain       plain DeepSpeed's optimizer step
    resume      the resume contract: run_state, resume_point, resume_engine, adapter_state
    summary     probe_loss, memory_marks, summarize (printed, JSON), flush_tensorboard

The evaluation's core, which ``DhelixTrainer.evaluate`` reports too, is
``ds_dhelix.engine.evaluation`` (the engine layer cannot import this one). May import
``ds_dhelix.engine``, ``hf_models`` and every layer below; train.py, the bench, the commands and
``benchmarks/`` sit above.

    engine, *_ = ds_dhelix.initialize(model=model, config=ds_config)
    data = load_data(DataOptions(path="sft.jsonl", seq_len=512, eval_fraction=0.05), tokenizer)
    log = train_loop(engine, data, LoopOptions(steps=200, eval_interval=50))
    teardown(engine)
"""

from .evaluation import eval_microbatches, evaluate
from .loop import (
    LOSS_AVERAGES,
    LoopOptions,
    TrainLog,
    loss_average,
    save_checkpoint,
    teardown,
    train_loop,
    weighed_by_targets,
)
from .plain import plain_step
from .resume import adapter_state, resume_engine, resume_point, run_state
from .summary import flush_tensorboard, memory_marks, probe_loss, summarize

__all__ = [
    "LOSS_AVERAGES",
    "LoopOptions",
    "TrainLog",
    "adapter_state",
    "eval_microbatches",
    "evaluate",
    "flush_tensorboard",
    "loss_average",
    "memory_marks",
    "plain_step",
    "probe_loss",
    "resume_engine",
    "resume_point",
    "run_state",
    "save_checkpoint",
    "summarize",
    "teardown",
    "train_loop",
    "weighed_by_targets",
]
