"""A model's op lists without its weights: the config is built on the meta device (no memory is
allocated, so a 70B model costs seconds) and run through its adapter's graph builder, so every
block's op names, kinds and ``linear`` marks are the engine's own; plus each layer's sliding
window. What ``dhelix predict`` prices (``ds_dhelix.predict``)."""

from __future__ import annotations

import copy
import os

import torch

from ds_dhelix.graph.fuse import fuse
from ds_dhelix.predict.shapes import ModelOutline, OpLine
from ds_dhelix.runtime.groups import ContextShards, ExpertGroups

from .adapters import check_model
from .common import layer_window
from .registry import family_attn_implementation, load_config


def config_of(spec: str):
    """The config of a preset, a local checkpoint directory or a ``config.json`` file."""
    path = os.path.expanduser(spec)
    if path.endswith(".json") and os.path.isfile(path):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: {str(err).splitlines()[0]}") from None
    return load_config(spec)


def meta_model(config):
    """``config``'s causal LM on the meta device (shapes only)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=family_attn_implementation(config)
        )


def _windows(model) -> tuple[int | None, ...]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:  # GPT-2, GPT-NeoX: full attention everywhere
        return (None,) * model.config.num_hidden_layers
    return tuple(layer_window(layer.self_attn, model.config) or None for layer in layers)


def _line(op) -> OpLine:
    return OpLine(op.name, op.is_comm, op.linear, tuple(_line(m) for m in op.members))


def model_outline(config, dims, fused: bool = False) -> ModelOutline:
    """The op lists of ``config``'s graph on one rank of ``dims`` (a ``ParallelDims``; its checks
    run first: ValueError before anything is built); ``fused``: the COMP ops between two
    collectives as one op each, as the engine runs them (``dhelix.fuse_ops``, ``graph.fuse``)."""
    adapter = check_model(dims, config)
    options = {}
    if hasattr(adapter, "check_ep"):
        options["ep_groups"] = ExpertGroups(size=dims.ep, rank=0)
    if dims.cp > 1:
        options["cp"] = ContextShards(size=dims.cp, rank=0, groups=None, comm=dims.cp_comm)
    model = meta_model(config)
    graph = adapter.build_graph(model, dims.tp, 0, None, None, seed=0, **options)
    if fused:
        fuse(graph)
    blocks = tuple(tuple(_line(op) for op in block) for block in graph.blocks)
    return ModelOutline(blocks, _windows(model), fused)
