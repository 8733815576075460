"""Adapter lookup: HF ``model_type`` -> the module that shards it and builds its op graph.

Each adapter module provides ``check_tp(config, tp, world=None)`` (ValueError before any model is
built) and ``build_graph(model, tp, tp_rank, tp_group, tp_grad_group) -> ModelGraph`` (``tp_group``:
a ``ds_dhelix.runtime.comm.StrandGroups`` or one process group); MoE adapters also ``check_ep(config, ep,
dp_size)`` and take ``ep_groups``, ``capacity_factor``, ``aux_loss_coef`` in ``build_graph``.
``check_model`` runs the checks, ``ds_dhelix.engine.build.shard_model`` the
build.
"""

from __future__ import annotations

import importlib

from ds_dhelix.config.dims import check_cp_heads

from .vocab import check_vocab

ADAPTERS = {
    "llama": "hf_models.llama",
    "gpt2": "hf_models.gpt2",
    "gpt_neox": "hf_models.gpt_neox",
    "qwen2": "hf_models.qwen2",
    "qwen3": "hf_models.qwen3",
    "mistral": "hf_models.mistral",
    "gemma3_text": "hf_models.gemma3",
    "phi3": "hf_models.phi3",
    "smollm3": "hf_models.smollm3",
    "olmo3": "hf_models.olmo3",
    "phimoe": "hf_models.phimoe",
    "mixtral": "hf_models.mixtral",
    "qwen3_moe": "hf_models.qwen3_moe",
    "qwen2_moe": "hf_models.qwen2_moe",
    "olmoe": "hf_models.olmoe",
    "deepseek_v3": "hf_models.deepseek_v3",
    "glm4_moe": "hf_models.glm4_moe",
    "gpt_oss": "hf_models.gpt_oss",
    "qwen3_5_text": "hf_models.qwen3_5",
    "qwen3_5_moe_text": "hf_models.qwen3_5_moe",
}

_TEXT_FIX = (
    "ds_dhelix trains its language model from a text checkpoint: write one with "
    "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(TEXT_DIR) (model_type {text}; the vision "
    "tower is left out) and pass TEXT_DIR"
)
REFUSED = {
    "qwen3_5": "a multimodal Qwen3.5 checkpoint (vision tower + language model); "
    + _TEXT_FIX.format(text="qwen3_5_text"),
    "qwen3_5_moe": "a multimodal Qwen3.5-MoE checkpoint (vision tower + language model); "
    + _TEXT_FIX.format(text="qwen3_5_moe_text"),
}
"""model_types refused with their own reason and fix (instead of "no adapter")."""


def adapter_for(config):
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        raise ValueError(f"model_type {model_type!r} is {REFUSED[model_type]}")
    if model_type not in ADAPTERS:
        raise ValueError(f"no ds_dhelix adapter for model_type {model_type!r}; supported: {sorted(ADAPTERS)}")
    try:
        module = importlib.import_module(ADAPTERS[model_type])
    except ModuleNotFoundError as err:
        raise ValueError(f"the {model_type} adapter is not available in this build") from err
    return getattr(module, "ADAPTER", module)  # MoE families: a MoeAdapter over the shared machinery


def check_model(dims, model_config):
    """TP must divide the attention heads, KV heads and MLP width; EP the experts (and the DP
    size); an EP size needs a model with experts. ``ValueError`` naming the values and the
    valid sizes, before any model is built. Returns the model's adapter."""
    adapter = adapter_for(model_config)
    adapter.check_tp(model_config, dims.tp)
    if dims.tp > 1:  # the vocabulary is split over TP (``vocab.py``)
        check_vocab(model_config.vocab_size, dims.tp)
    if dims.cp > 1 and dims.cp_comm == "ulysses":
        check_cp_heads(model_config, dims.tp, dims.cp)
    if dims.cp > 1 and hasattr(adapter, "check_cp"):
        adapter.check_cp(model_config, dims.cp, dims.cp_comm)
    if dims.cp > 1:
        if not getattr(adapter, "CONTEXT_PARALLEL", False):
            raise ValueError(
                f"context_parallel.size {dims.cp}: model_type {model_config.model_type!r} has no "
                f"context-parallel attention yet; use 1"
            )
    if hasattr(adapter, "check_ep"):
        adapter.check_ep(model_config, dims.ep, dims.dp)
    elif dims.ep > 1:
        raise ValueError(
            f"expert_parallel.size {dims.ep}: model_type {model_config.model_type!r} has no "
            f"experts; use 1 (or an MoE model, e.g. tiny-phimoe)"
        )
    return adapter


def check_packing(config, packing: str) -> None:
    """``ValueError`` for a data packing (``train.py --packing``: concat, docs, none) the family of
    ``config`` cannot honour (Gated DeltaNet layers refuse packed documents), before any model is built;
    a model without an adapter (plain DeepSpeed runs it) has none."""
    if getattr(config, "model_type", None) not in ADAPTERS:
        return
    check = getattr(adapter_for(config), "check_packing", None)
    if check is not None:
        check(config, packing)


EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Where a config without a ds_dhelix adapter may name its expert count (``num_experts``' fallback)."""


def moe_family(config):
    """The ``MoeFamily`` of ``config``'s model type (the one answer to "is this an MoE model?"), None
    for a dense family or a model type without an adapter."""
    if getattr(config, "model_type", None) not in ADAPTERS:
        return None
    adapter = adapter_for(config)
    return adapter.FAMILY if hasattr(adapter, "check_ep") else None


def num_experts(config) -> int:
    """The routed experts of ``config`` as its ``MoeFamily`` reads them (its ``experts_key``), 0 for a
    dense one; a model type without an adapter (plain DeepSpeed runs it): the first of
    ``EXPERT_KEYS`` it sets."""
    family = moe_family(config)
    if family is not None:
        return int(family.num_experts(config))
    if getattr(config, "model_type", None) in ADAPTERS:
        return 0
    return int(next((getattr(config, k) for k in EXPERT_KEYS if getattr(config, k, None)), 0))


def is_moe(config) -> bool:
    """Whether ``config`` is a mixture-of-experts model (``num_experts`` > 0)."""
    return num_experts(config) > 0


def dropout_overrides(config, p: float) -> dict:
    """Config keys that set every dropout rate of ``config``'s family to ``p``."""
    return {key: p for key in adapter_for(config).DROPOUT_KEYS}


def stochastic_keys(config) -> tuple[str, ...]:
    """Config keys of every stochastic setting ``config``'s family reads while training: its
    dropout rates (the adapter's ``DROPOUT_KEYS``) and its router noise (``NOISE_KEYS``, MoE
    families: Mixtral's ``router_jitter_noise``, Phi-MoE's ``router_jitter_noise`` and
    ``input_jitter_noise``)."""
    adapter = adapter_for(config)
    return tuple(adapter.DROPOUT_KEYS) + tuple(getattr(adapter, "NOISE_KEYS", ()))


def stochastic_settings(config) -> dict[str, float]:
    """``config``'s stochastic settings that are on: ``{key: value}`` of its nonzero
    ``stochastic_keys`` (a key the config lacks counts as 0), in that order."""
    values = {key: float(getattr(config, key, 0.0) or 0.0) for key in stochastic_keys(config)}
    return {key: value for key, value in values.items() if value}


def stochastic_off_overrides(config) -> dict[str, float]:
    """Config overrides (``registry.build_model``'s ``overrides``) that turn every stochastic
    setting of ``config`` off: 0 for each one ``stochastic_settings`` lists."""
    return {key: 0.0 for key in stochastic_settings(config)}


def unwrap_peft(model):
    """``(hf_model, LoraInfo)`` for a PEFT LoRA model (``hf_models.lora.from_peft``, with the
    family's LoRA targets), ``(model, None)`` for a plain HF model."""
    from .lora import from_peft, is_peft_model

    if not is_peft_model(model):
        return model, None
    adapter = adapter_for(model.config)
    return from_peft(model, getattr(adapter, "LORA_TARGETS", ()), model.config.model_type)


def lora_target_names(config) -> list[str]:
    """The module names LoRA may wrap in ``config``'s family (what its op graph calls with an adapter)."""
    from .lora import target_names

    return target_names(getattr(adapter_for(config), "LORA_TARGETS", ()))


def check_lora_targets(config, names, flag: str = "LoRA target") -> list[str]:
    """``names`` (a list of module names, None: every target of the family), checked against the
    family's targets: ``ValueError`` naming the unknown ones and the choices."""
    allowed = lora_target_names(config)
    if names is None:
        return allowed
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise ValueError(
            f"{flag} {', '.join(unknown)}: the {config.model_type} op graph does not call such a module "
            f"with an adapter; choose from: {', '.join(allowed)}"
        )
    return list(names)
