"""ds_dhelix: DHelix strand interleaving for DeepSpeed.

``ds_dhelix.initialize(...)`` mirrors ``deepspeed.initialize`` (``engine/build.py``). Importing the
package stays light: the public names below load on first use, and the pure layers (``graph``,
``schedule``, ``planning``, the pipeline's fold and schedules in ``pipe``) never import deepspeed
or torch.distributed.

The subpackages follow the data flow, each importing only the layers below it (import-linter
contracts in ``pyproject.toml``)::

    data, graph -> schedule, pipe.folding / pipe.schedule -> config, planning -> predict -> runtime
        -> moe -> hf_models -> engine, pipe.module / pipe.engine -> training, verify -> bench
        -> commands, cli
"""

__version__ = "0.1.0"

from .engine.guard import install as _install_guard
from .versions import check_versions as _check_versions

_check_versions()  # torch / deepspeed / transformers / peft inside pyproject.toml's tested ranges (versions.py)
_install_guard()  # a plain DeepSpeed engine built from an enabled dhelix config raises (engine/guard.py)

_LAZY = {
    "DhelixTrainer": "engine.trainer",
    "initialize": "engine.build",
    "build_engine": "engine.build",
    "check_setup": "engine.build",
    "DhelixEngine": "engine.dhelix_engine",
    "DhelixConfig": "config.section",
    "SIPlan": "planning.plan",
    "ParallelDims": "config.dims",
}
_LAZY_HF = {"empty_model": "hf_models.loading"}

__all__ = ["__version__", *_LAZY, *_LAZY_HF]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _LAZY_HF:
        import importlib

        return getattr(importlib.import_module(_LAZY_HF[name]), name)
    raise AttributeError(name)
