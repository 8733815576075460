"""MoE with expert parallelism: routing bookkeeping (``router``), the dispatch/combine all-to-alls
(``dispatch``), expert shards and their computation (``experts``), per-step numbers
(``metrics``) and the dispatch / combine kernels (``kernels``: torch's or tutel's). May import ``runtime`` and the layers below it; the DeepSpeed engine that knows
about expert parameters is ``ds_dhelix.engine.moe_engine``.

    moe.router ─► moe.counts ─► moe.dispatch ─► moe.experts.{up,act,down} ─► moe.combine ─► moe.add
      (COMP)      (COMM, sizes)   (COMM a2a)          (3 x COMP)              (COMM a2a)     (COMP)

Model adapters (``hf_models/phimoe.py``) build these ops from HF modules.

Host reads of tensor values while a step runs: one per dropless layer per micro-batch, the split
sizes the dispatch all-to-all takes as lists, read at its launch from a copy ``moe.counts`` started
to pinned host memory on a side stream (``dispatch``); none in capacity mode; everything else stays
on the device (``router``, ``experts``, ``metrics``).
"""

from ..runtime.groups import ExpertGroups
from .dispatch import ExpertAllToAll
from .experts import check_ep, gather_expert_param, is_expert_param, valid_ep_sizes
from .router import Route

__all__ = [
    "ExpertAllToAll",
    "ExpertGroups",
    "Route",
    "check_ep",
    "gather_expert_param",
    "is_expert_param",
    "valid_ep_sizes",
]
