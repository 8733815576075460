"""Adapter lookup: HF ``model_type`` -> the module that shards it and builds its op graph.

Each adapter module provides ``check_tp(config, tp, world=None)`` (ValueError before any model is
built) and ``build_graph(model, tp, tp_rank, tp_group, tp_grad_group) -> ModelGraph``.
"""
from __future__ import annotations

import importlib

ADAPTERS = {"llama": "hf_models.llama", "gpt2": "hf_models.gpt2", "gpt_neox": "hf_models.gpt_neox",
            "phimoe": "hf_models.phimoe"}


def adapter_for(config):
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(f"no ds_dhelix adapter for model_type {model_type!r}; supported: {sorted(ADAPTERS)}")
    try:
        return importlib.import_module(ADAPTERS[model_type])
    except ModuleNotFoundError as err:
        raise ValueError(f"the {model_type} adapter is not available in this build") from err


def check_layout(config, tp: int, ep: int = 1, dp: int | None = None, world: int | None = None):
    """Every size check of a model's parallel layout, before it is built: TP must divide the
    attention heads / KV heads / MLP width (and the world), EP the experts (and the DP size).
    ``ValueError`` naming the values and the valid sizes; returns the adapter."""
    adapter = adapter_for(config)
    adapter.check_tp(config, tp, world)
    if ep > 1:
        if not hasattr(adapter, "check_ep"):
            raise ValueError(f"expert-parallel size {ep}: model_type {config.model_type!r} has no experts; use 1")
        adapter.check_ep(config, ep, dp)
    return adapter
