"""The op graph: the op vocabulary (``ops``: COMP / COMM specs, backward order), a model's blocks
of ops (``model_graph``), seeded random draws (``draws``), recompute policies (``recompute``) and
which part of a full HF tensor a shard is (``shards``). Plain data and autograd glue: imports
nothing else of ds_dhelix, never torch.distributed.

``from ds_dhelix.graph import ModelGraph, comm, comp`` keeps working (re-exported).
"""

from .model_graph import ModelGraph, Op, comm, comp

__all__ = ["ModelGraph", "Op", "comm", "comp"]
