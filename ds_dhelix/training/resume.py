"""The resume contract: what a checkpoint of a run records (``run_state``), the checkpoint a run
continues from, checked against it before any model is built (``resume_point``), and the load
into the built engine (``resume_engine``). The checkpoints themselves: ``ds_dhelix.engine.resume``.

    state = run_state(ds_config, setup, data, model, steps)        before any model
    point = resume_point("auto", checkpoint_dir, state)            None: a fresh start
    engine = ds_dhelix.initialize(...)
    resume_engine(engine, point, state)                            the plan's fingerprint, the load
"""

from __future__ import annotations

import os
import sys

from .loop import loss_average


def run_state(
    ds_config: dict,
    setup,
    data,
    model: str,
    steps: int,
    loss_average_choice: str | None = None,
    adapter: dict | None = None,
) -> dict:
    """What a checkpoint of this run records and a resume must match (``engine.resume.MUST_MATCH``):
    ``setup`` is ``ds_dhelix.engine.build.check_setup``'s, ``data`` the ``TrainingData``, ``model``
    a preset name or a checkpoint directory, ``steps`` the run's total, ``adapter`` the LoRA
    config's ``adapter_state`` (None: a full fine-tune). The SI plan's fingerprint is filled in
    when the engine is built (``resume_engine``)."""
    d, b = setup.dims, setup.batch
    path = data.options.path
    source = os.path.abspath(os.path.expanduser(path)) if path else "embedded corpus"
    model = model if not os.path.isdir(os.path.expanduser(model)) else os.path.abspath(model)
    precision = {
        "zero_stage": setup.ds.zero.stage,
        "gradient_clipping": ds_config.get("gradient_clipping"),
        "fp16": ds_config.get("fp16"),
        "bf16": ds_config.get("bf16"),
    }
    layout = {
        "world": d.world,
        "dp": d.dp,
        "tp": d.tp,
        "pp": d.pp,
        "ep": d.ep,
        **({"cp": d.cp, "cp_comm": d.cp_comm} if d.cp > 1 else {}),
        "micro_batch_size": b.micro_batch_size,
        "gradient_accumulation_steps": b.gradient_accumulation_steps,
    }
    return {
        "step": 0,
        "total_steps": steps,
        "lr_schedule": ds_config.get("scheduler"),
        "optimizer": ds_config.get("optimizer"),
        "precision": precision,
        "layout": layout,
        "model": model,
        "data": {
            "source": source,
            "seed": data.options.seed,
            **data.identity(),
            "loss_average": loss_average(loss_average_choice, data),
        },
        "seq_len": data.options.seq_len,
        "draw_seed": setup.dh.seed,
        "plan_fingerprint": None,
        "adapter": adapter,
        # a preference objective and its settings (None: cross-entropy, as a checkpoint from before objectives)
        "objective": setup.dh.objective.to_dict() if setup.dh.objective.name != "cross_entropy" else None,
    }


def adapter_state(cfg) -> dict | None:
    """What a resume must match of a peft ``LoraConfig`` (None: full fine-tune)."""
    if cfg is None:
        return None
    names = cfg.target_modules
    state = {
        "r": cfg.r,
        "alpha": cfg.lora_alpha,
        "targets": names if isinstance(names, str) else sorted(names),
        "rslora": cfg.use_rslora,
    }
    if cfg.lora_dropout:  # (recorded only when on: a checkpoint from before dropout matches 0)
        state["dropout"] = cfg.lora_dropout
    if getattr(cfg, "target_parameters", None):  # LoRA on the experts' tensors (likewise)
        state["parameters"] = sorted(cfg.target_parameters)
    return state


def resume_point(
    resume: str | None, checkpoint_dir: str | None, state: dict, allow_change: bool = False, prog: str = "ds_dhelix"
) -> tuple[str, str] | None:
    """``(root, tag)`` of the checkpoint to continue from, its run state checked against ``state``
    (``ValueError`` naming what differs, unless ``allow_change``; then rank 0 says it). ``resume``:
    a checkpoint directory or one of its tags, "auto" (the newest complete one under
    ``checkpoint_dir``; None when there is none yet: a fresh start) or None."""
    from ds_dhelix.engine.reshard import check_reshard, needs_reshard
    from ds_dhelix.engine.resume import check_resume, complete_tags, locate, read_run_state

    if not resume:
        return None
    if resume == "auto":
        root = os.path.abspath(checkpoint_dir)
        if not complete_tags(root):
            return None  # nothing saved yet: a fresh start
    root, tag = locate(checkpoint_dir if resume == "auto" else resume)
    saved = read_run_state(root, tag)
    diffs = check_resume(saved, state, allow_change)
    if needs_reshard(saved, state) or saved.get("layout") != state.get("layout"):
        check_reshard(saved, state)
    if diffs and int(os.environ.get("RANK", 0)) == 0:
        print(f"{prog}: resuming with changes (--allow-resume-change): " + "; ".join(diffs), file=sys.stderr)
        if needs_reshard(saved, state):
            print(
                f"{prog}: the checkpoint is resharded to this run's layout (model and optimizer state)", file=sys.stderr
            )
    return root, tag


def resume_engine(engine, point: tuple[str, str] | None, state: dict, prog: str = "ds_dhelix") -> None:
    """Record the engine's SI plan fingerprint in ``state`` and, with a ``point``, load that
    checkpoint into the engine (optimizer, LR schedule, step, RNG). A plan other than the
    checkpoint's is said, not refused: every plan gives the same math."""
    from ds_dhelix.engine.evaluation import is_dhelix

    plan = getattr(engine, "plan", None) if is_dhelix(engine) else None
    fingerprint = plan.fingerprint() if plan is not None else None
    state["plan_fingerprint"] = fingerprint
    if point is None:
        return
    from ds_dhelix.engine.resume import load

    saved = load(engine, *point, current=state)
    if saved.get("plan_fingerprint") != fingerprint and int(os.environ.get("RANK", 0)) == 0:
        print(
            f"{prog}: the SI plan differs from the checkpoint's ({saved.get('plan_fingerprint')} -> "
            f"{fingerprint}); every plan gives the same math, so the run continues",
            file=sys.stderr,
        )
