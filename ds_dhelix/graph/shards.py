"""Which part of a full Hugging Face tensor a sharded weight is.

A TP or EP shard cut from a parameter records ``hf_selection`` (dim -> ``slice`` or index
tensor): sharded loading reads exactly that part from the checkpoint files, and the export
gathers the shards back into the full tensor.
"""

from __future__ import annotations

import torch


def select(p: torch.Tensor, dim: int, sel) -> dict:
    """The ``hf_selection`` of a shard cut from ``p`` along ``dim`` by ``sel`` (a ``slice`` or an
    index tensor), composed with the part of the full HF tensor ``p`` itself already is."""
    prior = dict(getattr(p, "hf_selection", None) or {})
    if dim in prior:
        old = prior[dim]
        base = torch.arange(old.start, old.stop) if isinstance(old, slice) else old
        if isinstance(old, slice) and isinstance(sel, slice):
            sel = slice(old.start + sel.start, old.start + sel.stop)
        else:
            sel = base[sel] if isinstance(sel, slice) else base.index_select(0, sel.cpu())
    prior[dim] = sel if isinstance(sel, slice) else sel.detach().cpu().long()
    return prior
