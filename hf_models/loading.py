"""Sharded loading: each rank reads only the slices it holds, straight from the safetensors files.

    model = empty_model(path, dtype)          # HF model on the meta device (tied weights tied)
    graph = adapter.build_graph(model, ...)   # TP / EP shards are cut on meta tensors; each records
                                              # which part of the full HF tensor it is (hf_selection)
    materialize(model, CheckpointFiles(path), dtype)   # sliced reads (safe_open(...).get_slice)

A parameter's full HF tensor is found in the checkpoint under its own name, under a tied alias, or,
for families whose files keep the older layout (Phi-MoE: one ``w1``/``w2``/``w3`` per expert), by the
adapter's ``checkpoint_source(name, config)``: a tree of ``Key`` (one tensor in the files) and
``Joined`` (parts concatenated or stacked along a dim). The same tree tells the export which file
tensors to write (:func:`file_tensors`), so an exported checkpoint has the names ``save_pretrained``
writes.

Reads happen in the checkpoint's dtype, one shard at a time, then the shard is cast to the run's
dtype: a bf16 checkpoint is never upcast whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from .lora import is_factor_name
from .vocab import pad_rows, real_shape

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ----------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class Key:
    """One tensor of the checkpoint files."""

    name: str


@dataclass(frozen=True)
class Joined:
    """A full tensor made of ``parts`` joined along ``dim``: concatenated (``sizes``: each part's
    extent along ``dim``) or, with ``stack``, stacked (each part one index of ``dim``)."""

    dim: int
    parts: tuple
    sizes: tuple = ()
    stack: bool = False

    def extents(self) -> list[int]:
        return [1] * len(self.parts) if self.stack else list(self.sizes)


def checkpoint_source(model, name: str):
    """Where the full tensor of ``model``'s parameter ``name`` lives in the files ``save_pretrained``
    writes: the adapter's mapping (experts stored one by one), else the name under transformers'
    own renamings (GPT-NeoX's ``lm_head`` is ``embed_out`` in files)."""
    from .adapters import adapter_for

    mapping = getattr(adapter_for(model.config), "checkpoint_source", None)
    source = mapping(name, model.config) if mapping is not None else None
    return source if source is not None else Key(file_name(model, name))


def file_name(model, name: str) -> str:
    """``name`` as transformers' ``save_pretrained`` writes it (its key renamings reversed)."""
    try:
        from transformers.core_model_loading import apply_renamings
    except ImportError:  # a transformers without key renamings: files use the model's names
        return name
    if type(model) not in _RENAMINGS:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightRenaming

        transforms = [
            t
            for t in get_model_conversion_mapping(model, add_legacy=False)
            if isinstance(t, WeightRenaming) and not isinstance(t, PrefixChange)
        ]
        _RENAMINGS[type(model)] = [t.reverse_transform() for t in transforms[::-1]]
    return apply_renamings(name, _RENAMINGS[type(model)])


_RENAMINGS: dict[type, list] = {}  # model class -> transformers' renamings, reversed (model -> files)


def prefixed_source(model, source):
    """``source`` under transformers' prefix changes of ``model`` (model names -> the names of files
    that keep a prefix: a Qwen3.5 language model saved from its multimodal checkpoint keeps
    ``model.language_model.``), or None when the model's files have none."""
    if type(model) not in _PREFIXES:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange
        except ImportError:  # a transformers without key renamings
            _PREFIXES[type(model)] = []
        else:
            _PREFIXES[type(model)] = [
                t.reverse_transform()
                for t in get_model_conversion_mapping(model, add_legacy=False)
                if isinstance(t, PrefixChange)
            ]
    changes = _PREFIXES[type(model)]
    return _renamed(source, changes) if changes else None


def _renamed(source, renamings):
    from transformers.core_model_loading import apply_renamings

    if isinstance(source, Key):
        return Key(apply_renamings(source.name, renamings))
    return Joined(source.dim, tuple(_renamed(p, renamings) for p in source.parts), source.sizes, source.stack)


_PREFIXES: dict[type, list] = {}  # model class -> transformers' prefix changes, reversed (model -> files)


# -------------------------------------------------------------------------------------- selections
def _as_index(sel, size: int) -> torch.Tensor:
    if isinstance(sel, slice):
        return torch.arange(*sel.indices(size))
    return sel


def selected_shape(full: list[int], selection: dict) -> list[int]:
    """The shape of the part ``selection`` (dim -> slice | index tensor) of a tensor of shape ``full``."""
    return [(_as_index(selection[d], n).numel() if d in selection else n) for d, n in enumerate(full)]


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """Contiguous ascending runs ``[lo, hi)`` of the sorted unique values of ``index``."""
    values = torch.unique(index).tolist()
    runs, lo = [], values[0]
    for a, b in zip(values, values[1:] + [None]):
        if b != a + 1:
            runs.append((lo, a + 1))
            lo = b
    return runs


# ------------------------------------------------------------------------------------------- files
class CheckpointFiles:
    """The safetensors files of a checkpoint directory (one file, or shards named by an index file):
    shapes without reading, and sliced reads of any tensor."""

    def __init__(self, path: str):
        self.path = os.path.abspath(os.path.expanduser(path))
        self._where = self._map_keys()
        self._open: dict[str, object] = {}

    def _map_keys(self) -> dict[str, str]:
        from safetensors import safe_open

        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f'{index}: no "weight_map"; save the checkpoint again with save_pretrained')
            missing = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(self.path, v))})
            if missing:
                raise ValueError(f"{index} names files that are not there: {missing}")
            return dict(weight_map)
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            bins = sorted(f for f in os.listdir(self.path) if f.endswith(".bin"))
            what = f"only {bins[0]}" + (f" (+{len(bins) - 1} more)" if len(bins) > 1 else "") if bins else "no weights"
            raise ValueError(
                f"{self.path}: {what}; ds_dhelix reads safetensors files slice by slice. Convert once with "
                f"AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR, safe_serialization=True)"
            )
        where = {}
        for name in files:
            with safe_open(os.path.join(self.path, name), framework="pt") as f:
                where.update({k: name for k in f.keys()})
        return where

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self):
        return self._where.keys()

    def _slice(self, key: str):
        from safetensors import safe_open

        name = self._where[key]
        if name not in self._open:
            self._open[name] = safe_open(os.path.join(self.path, name), framework="pt")
        return self._open[name].get_slice(key)

    def shape(self, source) -> list[int]:
        if isinstance(source, Key):
            if source.name not in self:
                raise KeyError(source.name)
            return list(self._slice(source.name).get_shape())
        first = self.shape(source.parts[0])
        if source.stack:
            return first[: source.dim] + [len(source.parts)] + first[source.dim :]
        first[source.dim] = sum(source.extents())
        return first

    def read(self, source, selection: dict | None = None) -> torch.Tensor:
        """The part ``selection`` (dim -> slice | index tensor) of ``source``'s full tensor."""
        selection = selection or {}
        if isinstance(source, Key):
            return self._read_key(source.name, selection)
        d = source.dim
        sel = selection.get(d)
        offsets = [0]
        for n in source.extents():
            offsets.append(offsets[-1] + n)
        index = _as_index(sel if sel is not None else slice(None), offsets[-1])
        pieces, order = [], []
        for i, part in enumerate(source.parts):
            lo, hi = offsets[i], offsets[i + 1]
            hit = ((index >= lo) & (index < hi)).nonzero().flatten()
            if hit.numel() == 0:
                continue
            order.append(hit)
            inner = {(k if k < d else k - 1) if source.stack else k: v for k, v in selection.items() if k != d}
            if not source.stack:
                inner[d] = index[hit] - lo
            piece = self.read(part, inner)
            pieces.append(
                piece.unsqueeze(d).expand(*piece.shape[:d], hit.numel(), *piece.shape[d:]) if source.stack else piece
            )
        out = torch.cat(pieces, dim=d)
        position = torch.cat(order)
        if not torch.equal(position, torch.arange(len(position))):  # parts read in part order: restore
            out = out.index_select(d, torch.argsort(position))
        return out

    def _read_key(self, key: str, selection: dict) -> torch.Tensor:
        handle = self._slice(key)
        bounds, picks = [], []
        for d, size in enumerate(handle.get_shape()):
            sel = selection.get(d, slice(None))
            if isinstance(sel, slice):
                bounds.append(slice(*sel.indices(size)[:2]))
            else:
                bounds.append(slice(int(sel.min()), int(sel.max()) + 1))
                picks.append((d, sel))
        if not picks:
            return handle[tuple(bounds)]
        d0, rows = picks[0]  # the first indexed dim is read run by run, not as its bounding box
        pieces = []
        for lo, hi in _runs(rows):
            box = list(bounds)
            box[d0] = slice(lo, hi)
            pieces.append(handle[tuple(box)])
        kept = torch.unique(rows)  # the rows read, ascending
        block = torch.cat(pieces, dim=d0).index_select(d0, torch.searchsorted(kept, rows))
        for d, idx in picks[1:]:
            block = block.index_select(d, idx - bounds[d].start)
        return block


# --------------------------------------------------------------------------------------- the model
def empty_model(path: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", config=None):
    """The HF causal LM of checkpoint directory ``path`` with its parameters on the meta device
    (buffers such as rotary frequencies are real) and tied weights tied; nothing is read."""
    import copy

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from .registry import family_attn_implementation, load_config

    config = copy.deepcopy(config if config is not None else load_config(path))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=family_attn_implementation(config, attn_implementation)
        )
    model.tie_weights()
    return model


def _aliases(model) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def materialize(model, files: CheckpointFiles, dtype: torch.dtype | None = None, progress=None) -> int:
    """Read every meta parameter of ``model`` (this rank's shards) from ``files``, cast to ``dtype``
    (None: each parameter's own); the parameter objects stay the same (optimizers, replicated-grad
    lists and the op graph hold them). Returns the bytes read into parameters. ``ValueError``
    naming the tensor when the checkpoint lacks it or its shape does not fit."""
    aliases = _aliases(model)
    total = 0
    todo = [(n, p) for n, p in model.named_parameters() if p.is_meta and not is_factor_name(n)]  # (LoRA: drawn)
    for i, (name, p) in enumerate(todo):
        source = _find(model, files, aliases[id(p)])
        full = files.shape(source)
        selection = getattr(p, "hf_selection", None) or {}
        if selected_shape(full, selection) != real_shape(p):
            raise ValueError(
                f"{files.path}: {name} is {full} in the checkpoint; this rank's shard of it "
                f"{list(p.shape)} does not fit (does config.json match the weights?)"
            )
        data = pad_rows(p, files.read(source, selection).to(dtype or p.dtype).contiguous())
        keep = dict(p.__dict__)
        torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))
        p.__dict__.update(keep)
        total += data.numel() * data.element_size()
        if progress is not None:
            progress(i + 1, len(todo), name)
    with torch.no_grad():
        total += load_buffers(model, files)
    return total


def persistent_buffers(model):
    """``(name, tensor)`` of every buffer ``model``'s state_dict holds (DeepSeek-V3's and GLM-4.5's
    ``e_score_correction_bias``; rotary frequencies are not persistent): read and written with the
    parameters."""
    for path, module in model.named_modules():
        for leaf, buf in module._buffers.items():
            if buf is not None and leaf not in module._non_persistent_buffers_set:
                yield (f"{path}.{leaf}" if path else leaf), buf


def load_buffers(model, files: CheckpointFiles) -> int:
    """Copy every persistent buffer of ``model`` from ``files``, in the buffer's own dtype (fp32 where
    HF keeps it so); ``ValueError`` naming it when the checkpoint lacks it. Returns the bytes read."""
    total = 0
    for name, buf in persistent_buffers(model):
        source = _find(model, files, [name])
        if files.shape(source) != list(buf.shape):
            raise ValueError(
                f"{files.path}: {name} is {files.shape(source)} in the checkpoint, the model's is "
                f"{list(buf.shape)} (does config.json match the weights?)"
            )
        buf.copy_(files.read(source, {}).to(buf.dtype))
        total += buf.numel() * buf.element_size()
    return total


def _find(model, files: CheckpointFiles, names: list[str]):
    tried = []
    for name in names:
        plain = (Key(name), checkpoint_source(model, name))
        for source in plain + tuple(s for s in (prefixed_source(model, p) for p in plain) if s is not None):
            leaves = _leaves(source)
            if all(leaf.name in files for leaf in leaves):
                return source
            tried += [leaf.name for leaf in leaves if leaf.name not in files]
    raise ValueError(
        f"{files.path}: no tensor for parameter {names[0]} (looked for {sorted(set(tried))[:4]}); "
        f"is this checkpoint of model_type {model.config.model_type!r}?"
    )


def _leaves(source) -> list[Key]:
    if isinstance(source, Key):
        return [source]
    return [leaf for part in source.parts for leaf in _leaves(part)]


def file_tensors(source, full: torch.Tensor):
    """``(file key, tensor)`` pairs that store ``full`` under ``source``'s layout (the export's side)."""
    if isinstance(source, Key):
        yield source.name, full
        return
    offset = 0
    for part, n in zip(source.parts, source.extents()):
        piece = full.narrow(source.dim, offset, n)
        yield from file_tensors(part, piece.squeeze(source.dim) if source.stack else piece)
        offset += n
