"""The run's PEFT ``LoraConfig`` from the LoRA flags (--lora-r / --lora-alpha / --lora-targets /
--lora-dropout, or a whole --peft-config file), checked against the model's family before any
model is built."""

from __future__ import annotations

import json
import os

from .options import LoraFlags, RunOptions, say


def lora_config(options: RunOptions, setup, model_config):
    """The LoraConfig of --lora / --lora-r / --peft-config; None for a full fine-tune."""
    flags = options.lora
    if not flags.asked:
        return None
    if not setup.dh.enabled:
        raise ValueError("--lora trains through the ds_dhelix engine: enable the ds_config's dhelix section")
    from hf_models.adapters import check_lora_targets, lora_target_names
    from hf_models.lora import check_config

    cfg = _from_file(flags.peft_config) if flags.peft_config is not None else _from_flags(flags, model_config)
    check_config(cfg)
    names = cfg.target_modules
    if not names or isinstance(names, str) and names != "all-linear":
        raise ValueError(
            f"LoRA target_modules {names!r}: give a list of module names, from: "
            f"{', '.join(lora_target_names(model_config))}"
        )
    if not isinstance(names, str):
        check_lora_targets(model_config, names)
    return cfg


def _from_file(path: str):
    from peft import LoraConfig

    try:
        with open(os.path.expanduser(path)) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--peft-config {path!r}: {err}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"--peft-config {path!r} is a {raw['peft_type']} adapter; ds_dhelix trains LoRA")
    known = set(LoraConfig.__dataclass_fields__)
    dropped = sorted(set(raw) - known)
    if dropped:
        say(f"--peft-config keys this PEFT's LoraConfig does not know, not used: {', '.join(dropped)}")
    cfg = LoraConfig(**{k: v for k, v in raw.items() if k in known and k != "peft_type"})
    if cfg.init_lora_weights is not True:  # (the engine's own check comes after the model is built)
        raise ValueError(
            f"--peft-config {path!r}: init_lora_weights={cfg.init_lora_weights!r}; train.py builds "
            f"the model empty and reads each rank's shards, then draws the factors as PEFT's default "
            f"does (A Kaiming-uniform, B zero): use init_lora_weights true"
        )
    return cfg


def _from_flags(flags: LoraFlags, model_config):
    from peft import LoraConfig

    from hf_models.adapters import check_lora_targets

    r = 8 if flags.lora_r is None else flags.lora_r
    targets = None if flags.lora_targets is None else [t.strip() for t in flags.lora_targets.split(",") if t.strip()]
    targets = check_lora_targets(model_config, targets, "--lora-targets")
    return LoraConfig(
        r=r, lora_alpha=flags.lora_alpha or 2 * r, target_modules=targets, lora_dropout=flags.lora_dropout or 0.0
    )
