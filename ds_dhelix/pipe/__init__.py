"""Folded pipeline: the layer fold (``folding``), schedules as data (``schedule``), the replay
simulator (``simulate``) — plain data, no torch.distributed — and the runtime: the folded module
(``module``) and the pipeline engine (``engine``). Runtime names load lazily so the pure modules
stay import-light."""

_LAZY = {"FoldedPipelineModule": "module", "export_hf_pipeline": "module", "gather_hf_state_dict": "module",
         "FoldedPipelineEngine": "engine"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
