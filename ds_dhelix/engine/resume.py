"""DeepSpeed checkpoints a long job can trust: complete or absent, newest kept, exact to resume.

    <dir>/
      global_step20/          a complete checkpoint: DeepSpeed's files, one RNG file per rank,
                              dhelix_run_state.json (written last)
      global_step30/
      latest                  the newest complete tag (written after the rename)
      .tmp-global_step40/     a save that was interrupted: removed at the next start

A save writes everything under a temporary tag, then rank 0 publishes it with one rename and
rewrites ``latest``; an interrupted save leaves the previous checkpoint as it was. The run state
says what a continuation needs and what it must match: the optimizer step, the run's total steps
and LR schedule, the data position, the micro-batch and parallel layout, the model and the SI
plan. ``check_resume`` refuses a resume that would change any of them (naming both values) unless
the caller allows it. The checkpoint directory must be visible to every rank (one filesystem).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import torch
import torch.distributed as dist

from .reshard import load_if_resharded, write_record

RUN_STATE_FILE = "dhelix_run_state.json"
TMP_PREFIX = ".tmp-"
_TAG = re.compile(r"global_step(\d+)")

# run-state keys a resume must match, with what a change means
MUST_MATCH = {
    "total_steps": "the run's total optimizer steps (--steps), so the LR schedule",
    "lr_schedule": "the LR scheduler and its parameters",
    "optimizer": "the optimizer and its parameters",
    "precision": "ZeRO stage, gradient clipping and fp16/bf16",
    "layout": "the micro-batch and parallel layout",
    "model": "the model",
    "data": "the training data and its shuffle seed",
    "seq_len": "the sequence length",
    "draw_seed": "the base seed of dropout masks and router noise (dhelix.seed, else --seed)",
    "adapter": "the LoRA adapter (--lora-r, --lora-alpha, --lora-targets or --peft-config; none: full fine-tune)",
    "objective": "the loss (dhelix.objective / --objective, --beta; none: cross-entropy)",
}
"""Run-state keys a resume must match. The SI plan's fingerprint is recorded too but only reported
when it differs: every plan gives the same math."""


def tag_of(step: int) -> str:
    return f"global_step{step}"


def complete_tags(root: str) -> list[str]:
    """Complete checkpoints under ``root`` (those with a run-state file), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _TAG.fullmatch(name)
        if m and os.path.isfile(os.path.join(root, name, RUN_STATE_FILE)):
            found.append((int(m.group(1)), name))
    return [name for _, name in sorted(found)]


def is_checkpoint_dir(path: str) -> bool:
    """A directory this project's checkpoints were (or were being) written to: a ``latest`` file, a
    complete or interrupted tag, or the helper scripts DeepSpeed writes beside its tags."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return (
        "latest" in names
        or bool(complete_tags(path))
        or any(n.startswith(TMP_PREFIX + "global_step") for n in names)
        or bool({"zero_to_fp32.py", "zero_to_torch.py"} & set(names))
    )


def remove_leftovers(root: str) -> list[str]:
    """Delete what interrupted saves left under ``root`` (call on one rank before any save)."""
    gone = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                gone.append(name)
    return gone


def locate(path: str, flag: str = "--resume") -> tuple[str, str]:
    """``(root, tag)`` of the checkpoint ``path`` names: a checkpoint root (its ``latest`` tag, else
    its newest complete one) or one tag directory. ``ValueError`` when there is none."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, RUN_STATE_FILE)):
        return os.path.dirname(path), os.path.basename(path)
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r}: no such checkpoint directory")
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        if os.path.isfile(os.path.join(path, tag, RUN_STATE_FILE)):
            return path, tag
    tags = complete_tags(path)
    if not tags:
        raise ValueError(
            f"{flag} {path!r}: no complete ds_dhelix checkpoint there (a checkpoint holds "
            f"{RUN_STATE_FILE}); pass a directory written by --ds-checkpoint / --save-interval"
        )
    return path, tags[-1]


def read_run_state(root: str, tag: str) -> dict:
    path = os.path.join(root, tag, RUN_STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable run state ({err}); resume from another checkpoint") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{path}: not a ds_dhelix run state (no step); resume from another checkpoint")
    return state


def check_resume(saved: dict, current: dict, allow_change: bool = False) -> list[str]:
    """The differences between a checkpoint's run state and this run's, one line each;
    ``ValueError`` listing them unless ``allow_change``."""
    if saved.get("step", 0) > current["total_steps"]:
        raise ValueError(
            f"the checkpoint is at step {saved.get('step')}, past --steps {current['total_steps']} "
            f"(the run's total); pass --steps {saved.get('step')} or more (a larger --steps changes the "
            f"LR schedule: add --allow-resume-change)"
        )
    kinds = [(saved.get("optimizer") or {}).get("type"), (current.get("optimizer") or {}).get("type")]
    if kinds[0] and kinds[1] and kinds[0].lower() != kinds[1].lower():
        raise ValueError(
            f"the checkpoint's optimizer is {kinds[0]}, this run's {kinds[1]}: its state does not carry over "
            f"to another optimizer; resume with {kinds[0]}, or start from the run's HF export (--model DIR)"
        )
    diffs = [
        f"{what} ({key}): checkpoint {saved.get(key)!r}, this run {current.get(key)!r}"
        for key, what in MUST_MATCH.items()
        if _differs(key, saved.get(key), current.get(key))
    ]
    if diffs and not allow_change:
        raise ValueError(
            "the resume would change the run: "
            + "; ".join(diffs)
            + ". Resume with the same settings, or pass --allow-resume-change to accept this"
        )
    return diffs


def _differs(key: str, saved, current) -> bool:
    """A recorded setting differs. Of the data's, the fields the checkpoint recorded: one written
    before the data had a format and a loss mask lacks them (and was text with the loss on every
    token), which is not held against it."""
    if key == "data" and isinstance(saved, dict) and isinstance(current, dict) and "format" not in saved:
        return any(saved[k] != current.get(k) for k in saved) or current.get("format") != "text"
    return saved != current


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_path(root: str, tag: str, rank: int) -> str:
    return os.path.join(root, tag, f"dhelix_rng_rank{rank:04d}.pt")


def save(engine, root: str, run_state: dict, keep: int) -> str:
    """Save a checkpoint of ``engine`` at its current step (collective); keep the newest ``keep``
    complete checkpoints. Returns the published tag directory."""
    rank = dist.get_rank()
    tag = tag_of(engine.global_steps)
    tmp = TMP_PREFIX + tag
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(os.path.join(root, tmp), ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(root, tag=tmp, client_state={"dhelix_run_state": run_state}, save_latest=False)
    torch.save(rng_state(), _rng_path(root, tmp, rank))
    from .evaluation import is_dhelix

    if not is_dhelix(engine):  # (a ds_dhelix engine writes its shard records itself)
        write_record(engine, os.path.join(root, tmp))
    dist.barrier()
    if rank == 0:
        _publish(root, tmp, tag, run_state)
        older = [t for t in complete_tags(root) if t != tag]  # the one just published always stays
        for old in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    dist.barrier()
    return os.path.join(root, tag)


def _publish(root: str, tmp: str, tag: str, run_state: dict) -> None:
    """The run-state file completes the temporary checkpoint; one rename publishes it; ``latest``
    is rewritten (through a rename) last."""
    with open(os.path.join(root, tmp, RUN_STATE_FILE), "w", encoding="utf-8") as f:
        json.dump(run_state, f, indent=1)
    final = os.path.join(root, tag)
    if os.path.exists(final):  # the same step saved again (e.g. a stop right after a periodic save)
        shutil.rmtree(final)
    os.rename(os.path.join(root, tmp), final)
    with open(os.path.join(root, ".latest.tmp"), "w") as f:
        f.write(tag)
    os.replace(os.path.join(root, ".latest.tmp"), os.path.join(root, "latest"))


def load(engine, root: str, tag: str, current: dict | None = None) -> dict:
    """Load the checkpoint into ``engine`` (optimizer, LR schedule, step counters) and this rank's
    RNG state; returns its run state. A checkpoint of another parallel layout, ZeRO stage or
    precision, or one converted offline, is loaded resharded (``reshard.load_if_resharded``: a
    ds_dhelix engine's ``load_checkpoint`` decides, plain DeepSpeed's here; no RNG state then:
    every random draw is seeded by its micro-batch). ``current``: this run's state, whose optimizer
    settings apply over the checkpoint's."""
    from .evaluation import is_dhelix

    saved = None if is_dhelix(engine) else load_if_resharded(engine, root, tag)
    if saved is None:
        path, client = engine.load_checkpoint(root, tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {os.path.join(root, tag)}")
        rng = _rng_path(root, tag, dist.get_rank())
        if os.path.isfile(rng) and not getattr(engine, "loaded_resharded", False):
            set_rng_state(torch.load(rng, weights_only=False))
        saved = (client or {}).get("dhelix_run_state") or read_run_state(root, tag)
    if current is not None:
        apply_optimizer_settings(engine, current.get("optimizer"))
    return saved


def apply_optimizer_settings(engine, optimizer: dict | None) -> None:
    """This run's optimizer hyperparameters (betas, eps, weight decay; the LR too without a
    scheduler) over the checkpoint's, which DeepSpeed's load restores: a changed optimizer setting
    on resume is the run's, not silently the checkpoint's."""
    params = (optimizer or {}).get("params") or {}
    groups = getattr(engine.optimizer, "optimizer", engine.optimizer).param_groups
    for group in groups:
        for key, value in params.items():
            if key in group and (key != "lr" or engine.lr_scheduler is None):
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
