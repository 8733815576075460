"""The top-level ds_config keys DeepSpeed reads, and the check that refuses any other.

DeepSpeed ignores keys it does not know, so ``"gradient_acumulation_steps": 4`` trains with
accumulation 1 and nobody notices. The set of known keys is derived from DeepSpeed's own config
code, not typed by hand: a ``DeepSpeedConfig`` is built on a dict that records every top-level key
DeepSpeed looks up while it parses (``get``, ``[]``, ``in``, ``keys()``), and the keys of
DeepSpeed's removed-key table (it raises its own message for those). ``EXTRA_KEYS`` are the few it
reads outside that parse.
"""

from __future__ import annotations

import difflib
import functools
import logging
import warnings

EXTRA_KEYS = frozenset(
    {
        "sequence_parallel_size",
        "data_parallel_size",  # read by deepspeed.initialize / DeepSpeedConfig
        # only in a distributed world (Ulysses mesh)
        "dhelix",  # this project's section
    }
)


class _Keys:
    """``dict.keys()`` stand-in that records membership tests."""

    def __init__(self, data: dict, seen: set):
        self.data, self.seen = data, seen

    def __contains__(self, key):
        self.seen.add(key)
        return dict.__contains__(self.data, key)

    def __iter__(self):
        return iter(dict.keys(self.data))

    def __len__(self):
        return dict.__len__(self.data)


class _RecordingDict(dict):
    """A dict that notes every key looked up in it (``copy.copy`` shares the note)."""

    seen: set

    def get(self, key, *default):
        self.seen.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def setdefault(self, key, *default):
        self.seen.add(key)
        return super().setdefault(key, *default)

    def pop(self, key, *default):
        self.seen.add(key)
        return super().pop(key, *default)

    def keys(self):
        return _Keys(self, self.seen)


@functools.cache
def deepspeed_keys() -> frozenset[str]:
    """Every top-level key the installed DeepSpeed reads (see the module docstring)."""
    from deepspeed.runtime import config as ds_config_module
    from deepspeed.utils import logger

    probe = _RecordingDict({"train_batch_size": 1})
    probe.seen = set()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        ds_config_module.DeepSpeedConfig(probe)
    except Exception:  # noqa: BLE001 -- the keys are recorded while parsing, before any batch check
        pass
    finally:
        logger.setLevel(level)
    removed = set(getattr(ds_config_module, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
    known = frozenset(k for k in probe.seen | removed if isinstance(k, str)) | EXTRA_KEYS
    if not {"train_batch_size", "optimizer", "zero_optimization"} <= known:
        raise RuntimeError(
            f"could not read DeepSpeed's config keys (found {sorted(known)}); "
            f"set dhelix.allow_unknown_deepspeed_keys to true to skip the check"
        )
    return known


def check_deepspeed_keys(ds_config: dict, allow_unknown: bool = False) -> list[str]:
    """``ValueError`` for the first top-level key DeepSpeed does not read, naming the closest known
    key; with ``allow_unknown`` a warning instead (for keys of a newer DeepSpeed). Returns the
    unknown keys."""
    known = deepspeed_keys()
    unknown = [k for k in ds_config if k not in known]
    if not unknown:
        return []
    import deepspeed

    key = unknown[0]
    close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    others = f" (and {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else ""
    text = (
        f"unknown DeepSpeed config key '{key}'{others}{hint} DeepSpeed {deepspeed.__version__} would ignore it silently"
    )
    if allow_unknown:
        warnings.warn(f"{text}; kept because dhelix.allow_unknown_deepspeed_keys is true", stacklevel=2)
        return unknown
    raise ValueError(
        f'{text}; fix the key, or set "dhelix": {{"allow_unknown_deepspeed_keys": true}} for a key of a newer DeepSpeed'
    )
