"""A prepared run (``prepare``'s ``Prepared``) carried out: the distributed start, the model and
engine (ds_dhelix or plain DeepSpeed) resumed where the run left off, the loop, and the end.

    start(prep)               process group, batch table, leftovers of an interrupted save removed
    build(prep) -> engine     the model (preset from --seed, checkpoint shards, LoRA) and its engine
    train(prep, engine)       the loop to --steps (``train_loop``) -> TrainLog
    finish(prep, engine, log) checkpoint, HF export (or PEFT adapter), summary; on --stop-after the summary
    peers_lost_exit(engine)   a collective that failed because a peer is gone: one line, exit 1

train.py is these five calls; a script of one's own can make them too.
"""

from __future__ import annotations

import contextlib
import os
import sys

from .options import PROG
from .prepare import Prepared


def start(prep: Prepared) -> None:
    """torch's threads from OMP_NUM_THREADS, DeepSpeed's process group, the batch table (rank 0)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed()
    if dist.get_rank() == 0:
        print(prep.setup.batch.table())
        if prep.options.checkpoints.ds_checkpoint:
            from ..engine.resume import remove_leftovers

            remove_leftovers(os.path.abspath(prep.options.checkpoints.ds_checkpoint))


def run_dtype(ds) -> object:
    """The dtype DeepSpeed trains the parameters in (``ds``: the run's ``DeepSpeedSettings``):
    bf16 / fp16 when enabled, else fp32."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(ds.half, torch.float32)


def build_model_for(prep: Prepared):
    """``(model, weights)``: a preset built whole from --seed; a checkpoint directory under dhelix
    as an empty (meta) model whose shards each rank reads from ``weights`` during the build, in the
    run's dtype; under plain DeepSpeed loaded whole."""
    from hf_models.registry import build_model, is_preset

    m = prep.options.model
    if prep.setup.dh.enabled and not is_preset(m.model):
        from hf_models.loading import empty_model

        path = os.path.expanduser(m.model)
        return empty_model(path, run_dtype(prep.setup.ds), m.attn_implementation), path
    model, _ = build_model(m.model, seed=prep.options.seed, attn_implementation=m.attn_implementation)
    return model, None


def build(prep: Prepared):
    """The model, the engine (ds_dhelix or plain DeepSpeed) and the checkpoint it resumes from."""
    import deepspeed

    from ..runtime.memory import peak_rss_mib, reset_peak_rss
    from .resume import resume_engine

    reset_peak_rss()
    baseline = peak_rss_mib()
    model, weights = build_model_for(prep)
    if prep.lora is not None:
        import torch
        from peft import get_peft_model

        torch.manual_seed(prep.options.seed)  # the adapter's initial A (B starts at zero)
        model = get_peft_model(model, prep.lora)
    if prep.setup.dh.enabled:
        from ..engine.build import initialize

        first = prep.data.first_batch(prep.setup.batch.micro_batch_size)
        engine, *_ = initialize(model=model, config=prep.ds_config, weights=weights, example_batch=first)
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=prep.ds_config)
    report = getattr(engine, "load_report", None)
    prep.memory = {
        "baseline_rss_mib": baseline,
        "load_peak_rss_mib": report.peak_rss_mib if report is not None else peak_rss_mib(),
        "shard_mib": sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 2**20,
    }
    reset_peak_rss()  # the training peak is measured from here
    resume_engine(engine, prep.resume, prep.run_state, prog=PROG)
    return engine


def loop_options(prep: Prepared):
    """The loop's settings (``LoopOptions``) from the flags."""
    from .loop import LoopOptions

    o, c = prep.options, prep.options.checkpoints
    return LoopOptions(
        steps=o.steps,
        eval_interval=o.eval_interval,
        loss_average=o.objective.loss_average,
        checkpoint_dir=c.ds_checkpoint,
        save_interval=c.save_interval,
        keep_checkpoints=c.keep_checkpoints,
        stop_after=c.stop_after,
        save_on_signal=c.save_on_signal,
        prog=PROG,
    )


def train(prep: Prepared, engine):
    """The training loop (``train_loop``) to --steps; on an agreed stop every rank leaves the
    process at the same step boundary (with the loop's exit code)."""
    from .loop import train_loop

    log = train_loop(engine, prep.data, loop_options(prep), prep.run_state)
    if log.end == "stopped":
        sys.stdout.flush()
        os._exit(log.exit_code)
    return log


def _summary_fields(prep: Prepared) -> dict:
    """The summary's fields that come from the flags (``summarize``)."""
    o = prep.options
    return {
        "model": o.model.model,
        "attn_implementation": o.model.attn_implementation,
        "json_path": o.json_summary,
        "export_label": "PEFT adapter" if o.lora.asked and not o.lora.merge_lora else "HF checkpoint",
    }


def finish(prep: Prepared, engine, log) -> None:
    """The final checkpoint, the HF export, the summary line and JSON (``log``: the loop's
    ``TrainLog``); after --stop-after (the checkpoint saved) the summary only."""
    import torch.distributed as dist

    from ..engine.evaluation import watched
    from .loop import save_checkpoint
    from .summary import flush_tensorboard, memory_marks, probe_loss, summarize

    options = loop_options(prep)
    if log.end == "left":
        memory = memory_marks(engine, prep.memory)
        if dist.get_rank() == 0:
            summarize(log, engine, prep.data, options, **_summary_fields(prep), probe={}, memory=memory)
        return
    probe = probe_loss(engine, prep.data)
    if options.checkpoint_dir and log.start_step < engine.global_steps:  # (a resume at the end only exports)
        save_checkpoint(engine, options, prep.run_state)
    with watched(engine, "HF export"):
        path = _export(prep, engine)
    memory = memory_marks(engine, prep.memory)
    if dist.get_rank() == 0:
        summarize(log, engine, prep.data, options, **_summary_fields(prep), export=path, probe=probe, memory=memory)
    flush_tensorboard(engine)


def _export(prep: Prepared, engine) -> str:
    """The PEFT adapter (LoRA without --merge-lora) or the HF checkpoint in --output-dir."""
    out, size = prep.options.output.output_dir, prep.options.output.max_shard_size
    if prep.lora is not None and not prep.options.lora.merge_lora:
        return engine.export_adapter(out, base=prep.run_state["model"], tokenizer=prep.tokenizer)
    if prep.setup.dh.enabled:  # (a LoRA model: merged)
        return engine.export_hf(out, prep.tokenizer, max_shard_size=size)
    from ..engine.checkpoint import export_hf

    return export_hf(engine.module, out, prep.tokenizer, max_shard_size=size)


@contextlib.contextmanager
def peers_lost_exit(engine):
    """A collective that failed because a peer is gone ends the process: one line naming the rank,
    where and the step, then exit 1 (no clean teardown of the process group is possible)."""
    import torch.distributed as dist

    from ..runtime.comm import CollectiveError, is_comm_failure

    try:
        yield
    except RuntimeError as err:
        if not is_comm_failure(err):
            raise
        if not isinstance(err, CollectiveError):  # outside a step (a stop agreement, a save, the export)
            where = getattr(engine, "failure_position", lambda: "in plain DeepSpeed's engine")()
            err = CollectiveError(where, err, group=dist.group.WORLD)
        print(f"{PROG}: error: rank {dist.get_rank()}: {err} (step {_step(engine)})", file=sys.stderr, flush=True)
        os._exit(1)


def _step(engine) -> int | str:
    """The step that failed: the watchdog's (it knows a step between two of DeepSpeed's), else the
    engine's next one."""
    wd = getattr(engine, "watchdog", None)
    step = wd.step if wd is not None and wd.step is not None else engine.global_steps
    return step + 1 if isinstance(step, int) else step
