"""ds_dhelix: DHelix strand interleaving for DeepSpeed.

``ds_dhelix.initialize(...)`` mirrors ``deepspeed.initialize`` (``build.py``); importing the package
itself stays light (the planner, plans and schedules never import deepspeed or torch.distributed).
"""
__version__ = "0.1.0"

from .guard import install as _install_guard

_install_guard()  # a plain DeepSpeed engine built from an enabled dhelix config raises (guard.py)

_LAZY = {"DhelixTrainer": "trainer", "initialize": "build", "build_engine": "build", "check_setup": "build",
         "DhelixEngine": "engine"}
_LAZY_HF = {"empty_model": "hf_models.loading"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _LAZY_HF:
        import importlib
        return getattr(importlib.import_module(_LAZY_HF[name]), name)
    raise AttributeError(name)
