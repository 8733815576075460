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


class _GuardOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Adds the check right after ``deepspeed.runtime.engine`` is executed (then steps aside)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _guard_engine_class(module)


def install() -> None:
    """Guard DeepSpeedEngine now (deepspeed imported) or on its first import; idempotent."""
    if ENGINE_MODULE in sys.modules:
        _guard_engine_class(sys.modules[ENGINE_MODULE])
    elif not any(isinstance(f, _GuardOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardOnImport())
