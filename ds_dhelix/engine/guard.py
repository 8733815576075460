"""No silent plain-DeepSpeed run of a dhelix config.

DeepSpeed ignores keys it does not know, so ``deepspeed.initialize``, a plain ``transformers.Trainer``
or accelerate's DeepSpeed plugin given a ds_config with ``"dhelix": {"enabled": true}`` would train a
plain data-parallel ``DeepSpeedEngine``: no tensor or expert parallelism, no strand interleaving,
and nothing would say so. Once ``ds_dhelix`` is imported, :func:`install` makes every
``DeepSpeedEngine`` built from such a config (other than ds_dhelix's own engines, which remove the
section before DeepSpeed sees it) raise ``DhelixConfigIgnored`` before it touches the model.

``install`` never imports deepspeed itself: if deepspeed is already imported the check is added
now, else when ``deepspeed.runtime.engine`` is first imported.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import sys

ENGINE_MODULE = "deepspeed.runtime.engine"


class DhelixConfigIgnored(RuntimeError):
    """A plain DeepSpeed engine was about to run a ds_config whose dhelix section is enabled."""


def enabled_dhelix_section(config) -> bool:
    """Whether a ds_config (dict, JSON path, or a DeepSpeedConfig) has ``"dhelix": {"enabled": true}``."""
    params = getattr(config, "_param_dict", config)
    if isinstance(params, str):
        try:
            with open(params) as f:
                params = json.load(f)
        except (OSError, ValueError):
            return False  # DeepSpeed reports an unreadable config itself
    section = params.get("dhelix") if isinstance(params, dict) else None
    return isinstance(section, dict) and section.get("enabled") is True


def refusal() -> str:
    return (
        'the ds_config has "dhelix": {"enabled": true}, but a plain DeepSpeed engine is being built '
        "(deepspeed.initialize, a plain transformers.Trainer or accelerate): DeepSpeed ignores the "
        "dhelix section, so tensor/expert parallelism and strand interleaving would not be active. "
        "Use ds_dhelix.DhelixTrainer in place of transformers.Trainer, or ds_dhelix.initialize in place "
        'of deepspeed.initialize; or set "dhelix": {"enabled": false} to train plain DeepSpeed on purpose'
    )


def _guard_engine_class(module) -> None:
    engine = module.DeepSpeedEngine
    if getattr(engine.__init__, "_dhelix_guarded", False):
        return
    original = engine.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if not getattr(self, "dhelix_engine", False):
            config = kwargs.get("config_class") or kwargs.get("config")
            if config is None and len(args) > 9:  # positional: (args, model, ..., config)
                config = args[9]
            if enabled_dhelix_section(config):
                raise DhelixConfigIgnored(refusal())
        original(self, *args, **kwargs)

    __init__._dhelix_guarded = True
    engine.__init__ = __init__


HF_CONFIG_MODULE = "accelerate.utils.deepspeed"


def _own_zero3(module) -> None:
    """With an enabled dhelix section, HF's DeepSpeed config answers ``is_zero3()`` False: a model
    built after ``TrainingArguments(deepspeed=...)`` is then built whole (not inside DeepSpeed's
    ``zero.Init``), so ds_dhelix can shard it for TP / EP and read only its shards; its engine
    partitions it for ZeRO-3 itself (``zero3.py``), and HF's own ZeRO-3 paths (gathering for a
    resize, for a save) stay out of the way of a model whose partitions are ds_dhelix's."""
    cls = module.HfDeepSpeedConfig
    if getattr(cls.is_zero3, "_dhelix_guarded", False):
        return
    original = cls.is_zero3

    @functools.wraps(original)
    def is_zero3(self):
        return original(self) and not enabled_dhelix_section(getattr(self, "config", None))

    is_zero3._dhelix_guarded = True
    cls.is_zero3 = is_zero3


GUARDED = {ENGINE_MODULE: _guard_engine_class, HF_CONFIG_MODULE: _own_zero3}
"""Modules patched right after they are first executed (or at ``install`` when imported already)."""


class _GuardOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches a module of ``GUARDED`` right after it is executed (then steps aside for it)."""

    def __init__(self):
        self.waiting = set(GUARDED)
        self._loaders: dict = {}  # module name -> its own loader

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.waiting:
            return None
        self.waiting.discard(fullname)
        if not self.waiting:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        self._loaders[fullname] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module):
        self._loaders.pop(module.__name__).exec_module(module)
        GUARDED[module.__name__](module)


def install() -> None:
    """Guard DeepSpeedEngine and HF's DeepSpeed config now (imported already) or on their first
    import; idempotent."""
    hook = _GuardOnImport()
    for name, patch in GUARDED.items():
        if name in sys.modules:
            patch(sys.modules[name])
            hook.waiting.discard(name)
    if hook.waiting and not any(isinstance(f, _GuardOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, hook)
