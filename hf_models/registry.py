"""Model sources: tiny random-init presets (no download) or a local Hugging Face checkpoint directory.

    load_config("tiny-llama")          preset JSON in hf_models/presets/ -> transformers config
    load_config("/ckpt/llama-1b")      <dir>/config.json (local files only)
    build_model(name_or_path, seed)    -> (model, ModelInfo)
    load_tokenizer_for(name_or_path)   the checkpoint's tokenizer, else the embedded-corpus tokenizer

Attention runs with ``attn_implementation="sdpa"`` (torch scaled_dot_product_attention): it is faster
than "eager" on CPU and GPU and is deterministic on CPU in fp32, so schedule-parity checks stay exact
as long as both sides use the same implementation. Pass "eager" when attention weights are needed. A family without sdpa attention in transformers
(gpt-oss: its attention sinks) runs eager instead (``family_attn_implementation``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

PRESET_DIR = Path(__file__).resolve().parent / "presets"
PRESETS: tuple[str, ...] = tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))
"""Names of the built-in tiny presets (file stems in hf_models/presets/)."""

DEFAULT_ATTN_IMPLEMENTATION = "sdpa"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A checkpoint directory with one of these has a tokenizer of its own."""


@dataclass(frozen=True)
class ModelInfo:
    """What `build_model` built: where from, which family and how big."""

    name_or_path: str
    source: str  # "preset" (random init with seed) or "checkpoint" (weights from the directory)
    model_type: str
    num_parameters: int
    dtype: str
    attn_implementation: str
    seed: int | None  # the init seed for presets; None for checkpoints

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def is_preset(name: str) -> bool:
    """True for a built-in preset name such as "tiny-llama"."""
    return name in PRESETS


def check_weight_files(path: str) -> None:
    """``ValueError`` naming the file when a checkpoint directory's safetensors files are not whole:
    each header must parse and every tensor's bytes must lie inside the file."""
    import struct

    names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    for name in names:
        full = os.path.join(path, name)
        size = os.path.getsize(full)
        with open(full, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{full}: not a safetensors file ({size} bytes, no header); re-save the checkpoint")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise ValueError(
                    f"{full}: truncated (its header alone needs {length} bytes, the file has {size}); "
                    f"copy or save the checkpoint again"
                )
            try:
                header = json.loads(f.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{full}: unreadable safetensors header ({err})") from None
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
        need = 8 + length + max(ends, default=0)
        if need > size:
            raise ValueError(
                f"{full}: truncated (its tensors need {need} bytes, the file has {size}); "
                f"copy or save the checkpoint again"
            )


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def resolve_attn_implementation(requested: str | None, name_or_path: str | os.PathLike) -> str:
    """The attention implementation a run uses: ``requested``, else the checkpoint directory's own
    ``config.json`` setting, else sdpa. ``ValueError`` for an unknown name or flash attention
    without its package."""
    choice = requested
    name = os.path.expanduser(os.fspath(name_or_path))
    if choice is None and not is_preset(name) and os.path.isfile(os.path.join(name, "config.json")):
        with open(os.path.join(name, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        choice = raw.get("_attn_implementation") or raw.get("attn_implementation")
    if choice is None:
        choice = family_attn_implementation(load_config(name_or_path))
    if choice not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {choice!r} is not supported; use one of {list(ATTN_IMPLEMENTATIONS)}"
        )
    if choice == "sdpa" and not sdpa_supported(load_config(name_or_path)):
        raise ValueError(
            f"attention implementation 'sdpa': transformers' {load_config(name_or_path).model_type} model "
            f"has none (gpt-oss: its attention sinks); use eager (the default for it) or flash_attention_2"
        )
    if choice == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None or not torch.cuda.is_available():
            raise ValueError(
                "flash_attention_2 needs the flash-attn package and a CUDA device "
                "(pip install flash-attn); use sdpa or eager"
            )
    return choice


def sdpa_supported(config) -> bool:
    """Whether transformers' causal LM of ``config`` runs sdpa attention (gpt-oss does not)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return bool(getattr(cls, "_supports_sdpa", True))


def family_attn_implementation(config, requested: str = DEFAULT_ATTN_IMPLEMENTATION) -> str:
    """``requested``, except sdpa for a family without it: eager (gpt-oss)."""
    return "eager" if requested == "sdpa" and not sdpa_supported(config) else requested


def load_config(name_or_path: str | os.PathLike):
    """Transformers config of a preset name or a local checkpoint directory (holding config.json)."""
    from transformers import AutoConfig

    name = os.fspath(name_or_path)
    if is_preset(name):
        with open(PRESET_DIR / f"{name}.json", encoding="utf-8") as f:
            fields = json.load(f)
        model_type = fields.pop("model_type")
        return AutoConfig.for_model(model_type, **fields)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"checkpoint directory {path!r} has no config.json; pass a save_pretrained directory")
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}/config.json: {str(err).splitlines()[0]}") from None
    raise ValueError(_not_found_message(name))


def _not_found_message(name: str) -> str:
    close = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.6)
    if close:
        return f"unknown preset {name!r}; did you mean {close[0]!r}? presets: {', '.join(PRESETS)}"
    if os.sep in name or name.startswith((".", "~")):
        return f"checkpoint directory {name!r} not found (downloads are disabled: pass a local directory)"
    return (
        f"{name!r} is neither a preset ({', '.join(PRESETS)}) nor a local checkpoint directory (downloads are disabled)"
    )


def with_num_layers(config, num_layers: int):
    """A copy of ``config`` with only its first ``num_layers`` decoder layers (per-layer lists such as
    ``layer_types`` cut to match): a smaller preset for fast tests and benchmarks."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    config = copy.deepcopy(config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:num_layers]
    return config


def build_model(
    name_or_path: str | os.PathLike,
    seed: int,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION,
    num_layers: int | None = None,
    overrides: dict | None = None,
):
    """A causal-LM model and its `ModelInfo`.

    A preset is initialised randomly from ``seed`` (the global RNG state is left untouched); a checkpoint
    directory is loaded with ``from_pretrained`` from local files only. ``num_layers`` keeps only the
    first layers of a preset (random init: a smaller model of the same shape); ``overrides`` sets
    config keys before the model is made (e.g. dropout rates).
    """
    from transformers import AutoModelForCausalLM

    config = load_config(name_or_path)
    name = os.fspath(name_or_path)
    if num_layers is not None:
        if not is_preset(name):
            raise ValueError(f"num_layers shrinks a preset; {name!r} is a checkpoint directory")
        config = with_num_layers(config, num_layers)
    for key, value in (overrides or {}).items():  # e.g. dropout rates (config keys the model reads)
        if not hasattr(config, key):
            raise ValueError(f"{config.model_type} config has no key {key!r}")
        setattr(config, key, value)
    attn_implementation = family_attn_implementation(config, attn_implementation)
    if is_preset(name):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # from_config mutates the config it is given: hand it a copy
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(config), dtype=dtype, attn_implementation=attn_implementation
            )
        source, used_seed = "preset", seed
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.expanduser(name),
            config=copy.deepcopy(config),
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
        source, used_seed = "checkpoint", None
    info = ModelInfo(
        name_or_path=name,
        source=source,
        model_type=config.model_type,
        num_parameters=sum(p.numel() for p in model.parameters()),
        dtype=str(dtype).removeprefix("torch."),
        attn_implementation=attn_implementation,
        seed=used_seed,
    )
    return model, info


def load_tokenizer_for(
    name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, tokenizer: str | None = None
):
    """``tokenizer`` (a directory with tokenizer files, or "corpus": the embedded-corpus one), else
    the checkpoint directory's own tokenizer when it has one, else the embedded-corpus tokenizer.

    The embedded tokenizer's vocabulary is capped at the model's vocab_size so every id is valid.
    A checkpoint directory without tokenizer files whose vocabulary is larger than the embedded
    tokenizer's is refused (a tokenizer that would use a sliver of the embedding is a wrong run,
    not a default), naming ``--tokenizer``; so is a tokenizer with more tokens than the model has rows.
    """
    from ds_dhelix.data import DEFAULT_CACHE_DIR, DEFAULT_VOCAB_SIZE, get_tokenizer

    name = os.path.expanduser(os.fspath(name_or_path))
    vocab = load_config(name_or_path).vocab_size
    own = None
    if tokenizer not in (None, "corpus"):
        own = os.path.expanduser(tokenizer)
    elif tokenizer is None and not is_preset(name) and os.path.isdir(name):
        if any(os.path.isfile(os.path.join(name, f)) for f in TOKENIZER_FILES):
            own = name
        elif vocab > DEFAULT_VOCAB_SIZE:
            raise ValueError(
                f"{name} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) and a {vocab:,}-token vocabulary; "
                f"give --tokenizer DIR (the tokenizer the model was trained with), or --tokenizer corpus for the "
                f"embedded {DEFAULT_VOCAB_SIZE:,}-token one"
            )
    if own is None:
        return get_tokenizer(cache_dir or DEFAULT_CACHE_DIR, min(DEFAULT_VOCAB_SIZE, vocab))
    return _own_tokenizer(own, vocab)


def _own_tokenizer(path: str, vocab: int):
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"--tokenizer {path}: no tokenizer files there ({', '.join(TOKENIZER_FILES)})")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if len(tok) > vocab:
        raise ValueError(
            f"tokenizer {path} has {len(tok):,} tokens, the model's embedding {vocab:,} rows: ids past the "
            f"embedding would be out of range; give the model's own tokenizer"
        )
    return tok
