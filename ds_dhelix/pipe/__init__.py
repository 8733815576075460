"""Folded pipeline: layout (``folding``), schedules as data (``schedule``), replay simulator
(``simulate``) — plain data, no torch.distributed — and the runtime: the folded module
(``module``), the pipeline engine (``engine``) and DeepSpeed's own pipelines as baselines
(``baseline``). Runtime names load lazily so the pure modules stay import-light."""

_LAZY = {
    "FoldedPipelineModule": "module", "export_hf_pipeline": "module", "gather_hf_state_dict": "module",
    "FoldedPipelineEngine": "engine", "initialize_pipeline": "engine", "check_pipeline": "engine",
    "run_deepspeed_pipe": "baseline", "run_dhelix_pipe": "baseline",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
