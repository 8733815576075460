"""Everything a run can check before any model is built: ``prepare(options) -> Prepared``.

    flags (check_options) ─► ds_config (+ --watchdog-s, --seed, --objective) ─► model config and
    checkpoint files ─► check_setup (layout, batch, schedule) ─► lengths, outputs ─► LoRA config ─►
    tokenizer and data (objective vs records) ─► run state, resume point

Each mistake is one ``ValueError`` line naming the flag or key and the fix; train.py prints it on
rank 0 and exits 2. ``options`` comes back resolved (the packing, the attention kernel and the
loss average a flag left to its default are filled in).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .options import PROG, RunOptions, check_options, say
from .run_data import data_options, load_run_data, resolve_packing
from .run_lora import lora_config


@dataclass
class Prepared:
    """What the checks before any model is built established."""

    options: RunOptions  # the flags, resolved (packing, attention kernel, loss average)
    ds_config: dict
    setup: object  # ds_dhelix.engine.build.Setup
    tokenizer: object
    data: object  # ds_dhelix.data.TrainingData: the training (and evaluation) blocks
    run_state: dict  # what a checkpoint of this run records
    resume: tuple[str, str] | None  # (checkpoint root, tag)
    memory: dict | None = None  # this rank's host memory marks (filled by build)
    lora: object = None  # the peft LoraConfig of --lora / --peft-config, else None


def prepare(options: RunOptions) -> Prepared:
    """Every check that needs no model, in the order a user meets them: one ValueError line per mistake."""
    from ..config.section import load_ds_config
    from ..engine.build import check_setup
    from .resume import adapter_state, resume_point, run_state

    check_options(options)
    options = resolve_packing(options)
    data_options(options)  # the data flags' own values
    ds_config = load_ds_config(options.deepspeed)
    _apply_flags(options, ds_config)
    model_config = _model_config(options.model.model, (ds_config.get("dhelix") or {}).get("enabled"))
    options = dataclasses.replace(options, model=_resolve_attention(options.model))
    from ..engine.checkpoint import parse_size

    parse_size(options.output.max_shard_size, "--max-shard-size")
    setup = check_setup(ds_config, model_config, int(os.environ.get("WORLD_SIZE", 1)))
    if "optimizer" not in ds_config:
        raise ValueError(
            'the ds_config has no "optimizer" section: train.py trains, so it needs one '
            '(e.g. "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}})'
        )
    _check_lengths(options, setup, model_config)
    _check_outputs(options)
    set_schedule_length(ds_config, options.steps)
    lora = lora_config(options, setup, model_config)
    tokenizer, data, options = load_run_data(options, setup, model_config, lora)
    model, steps, average = options.model.model, options.steps, options.objective.loss_average
    state = run_state(ds_config, setup, data, model, steps, average, adapter_state(lora))
    c = options.checkpoints
    resume = resume_point(c.resume, c.ds_checkpoint, state, c.allow_resume_change, prog=PROG)
    return Prepared(options, ds_config, setup, tokenizer, data, state, resume, lora=lora)


def _apply_flags(options: RunOptions, ds_config: dict) -> None:
    """--watchdog-s, --seed and --objective / --beta into the ds_config's dhelix section."""
    enabled = (ds_config.get("dhelix") or {}).get("enabled")
    if options.watchdog_s is not None:
        if not enabled:
            raise ValueError(
                "--watchdog-s sets the ds_dhelix engine's watchdog; this ds_config does not enable "
                "dhelix (plain DeepSpeed has none)"
            )
        ds_config["dhelix"]["watchdog_s"] = options.watchdog_s
    if enabled:
        ds_config["dhelix"].setdefault("seed", options.seed)  # dropout masks and router noise follow --seed
    o = options.objective
    given = [f for f, v in (("--objective", o.objective), ("--beta", o.beta)) if v is not None]
    if not given:
        return
    if not enabled:
        raise ValueError(f"{given[0]} sets the ds_dhelix engine's loss: enable the ds_config's dhelix section")
    section = ds_config["dhelix"].setdefault("objective", {})
    if o.objective is not None:
        section["name"] = o.objective
    if o.beta is not None:
        section["beta"] = o.beta


def _model_config(name: str, dhelix: bool):
    """The model's config (an unknown preset or a missing directory: ValueError); a checkpoint's
    weight files checked whole (and, under dhelix, as safetensors every rank reads its shards of)."""
    from hf_models.registry import check_weight_files, is_preset, load_config

    model_config = load_config(name)
    if not is_preset(name):
        check_weight_files(os.path.expanduser(name))
        if dhelix:
            from hf_models.loading import CheckpointFiles

            CheckpointFiles(os.path.expanduser(name))  # each rank reads its shards: safetensors only
    return model_config


def _resolve_attention(model):
    from hf_models.registry import resolve_attn_implementation

    return dataclasses.replace(
        model, attn_implementation=resolve_attn_implementation(model.attn_implementation, model.model)
    )


def set_schedule_length(ds_config: dict, steps: int) -> None:
    """WarmupCosineLR / WarmupDecayLR run over --steps; a warmup longer than a fifth of them is
    shortened to that (and said so)."""
    sched = ds_config.get("scheduler") or {}
    if sched.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        params = sched.setdefault("params", {})
        params["total_num_steps"] = steps
        warmup = params.get("warmup_num_steps", 0)
        params["warmup_num_steps"] = min(warmup, max(steps // 5, 1))
        if params["warmup_num_steps"] != warmup:
            say(
                f"scheduler warmup_num_steps {warmup} shortened to {params['warmup_num_steps']} "
                f"(a fifth of --steps {steps})"
            )


def _check_packing(options: RunOptions, setup, model_config) -> None:
    from hf_models.adapters import check_packing, is_moe

    packing = options.data.packing
    objective_rows = setup.dh.objective.name != "cross_entropy"  # (pairs and rollouts are padded rows)
    if packing == "none" and setup.dh.enabled and is_moe(model_config) and not objective_rows:
        raise ValueError(
            "--packing none pads documents, and the MoE router's load-balancing loss would count the "
            "padded tokens (HF leaves them out); use --packing docs (or concat) with an MoE model"
        )
    if packing == "docs" and options.model.attn_implementation == "flash_attention_2":
        raise ValueError(
            "--packing docs masks attention across documents, which the ds_dhelix graph does not yet "
            "pass to flash_attention_2; use sdpa or eager"
        )
    # the family's own (Gated DeltaNet layers: no packed documents; plain DeepSpeed's HF model
    # would not keep them apart either)
    check_packing(model_config, packing)


def _check_lengths(options: RunOptions, setup, model_config) -> None:
    _check_packing(options, setup, model_config)
    setup.dims.check_seq_len(options.seq_len, "--seq-len")
    limit = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if limit and options.seq_len > limit:
        raise ValueError(f"--seq-len {options.seq_len} exceeds the model's {limit} positions")


def _check_outputs(options: RunOptions) -> None:
    from ..engine.checkpoint import check_output_dir, is_export
    from ..engine.resume import is_checkpoint_dir

    out, ckpt, overwrite = (
        options.output.output_dir,
        options.checkpoints.ds_checkpoint,
        options.output.overwrite_output_dir,
    )
    check_output_dir(out, "--output-dir", overwrite, ours=is_export)
    if ckpt:
        ckpt, out = (os.path.abspath(os.path.expanduser(p)) for p in (ckpt, out))
        if os.path.commonpath([ckpt, out]) == out:
            raise ValueError(
                f"--ds-checkpoint {ckpt!r} lies in --output-dir {out!r}: the HF export replaces that "
                f"directory whole, checkpoints included; give them separate paths"
            )
        if os.path.isfile(ckpt):
            raise ValueError(f"--ds-checkpoint {ckpt!r} is a regular file; checkpoints need a directory there")
        check_output_dir(ckpt, "--ds-checkpoint", overwrite, ours=is_checkpoint_dir)
    if options.json_summary:
        folder = os.path.dirname(os.path.abspath(options.json_summary))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--json-summary {options.json_summary!r}: {folder!r} is not a writable directory")
