"""What a micro-batch carries to the model besides its token ids: HF's causal-LM targets, the
positions and the causal (block-diagonal for packed documents) attention mask."""

from __future__ import annotations

import torch


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM targets of ``[b, s]`` labels: position t predicts labels[t+1], the last
    position predicts nothing (-100)."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def valid_targets(labels: torch.Tensor) -> int:
    """How many targets of ``labels`` the loss counts (``shifted_targets`` other than -100)."""
    return int((labels[:, 1:] != -100).sum())


def document_positions(blocks: torch.Tensor, eos_id: int) -> dict[str, torch.Tensor]:
    """``position_ids`` restarting after every EOS (and at each block's start), and ``labels`` with
    -100 at each document's first token inside a block (the previous document's EOS does not
    predict it)."""
    b, s = blocks.shape
    start = torch.zeros_like(blocks, dtype=torch.bool)
    start[:, 0] = True
    start[:, 1:] = blocks[:, :-1] == eos_id
    index = torch.arange(s).expand(b, s)
    last_start = torch.where(start, index, torch.zeros_like(index)).cummax(dim=1).values
    labels = blocks.clone()
    labels[:, 1:][start[:, 1:]] = -100
    return {"labels": labels, "position_ids": index - last_start}


def attention_mask(
    seq_len: int, position_ids: torch.Tensor | None = None, additive_dtype=None, device=None, window: int | None = None
):
    """The causal mask [b or 1, 1, s, s], block-diagonal over packed documents when
    ``position_ids`` are given (a document starts where its position is 0), cut to a sliding
    ``window`` when given (query i sees keys i - window + 1 .. i, as HF's sliding-window layers):
    boolean (True: may attend; sdpa), or additive in ``additive_dtype`` (eager attention adds it to
    the scores)."""
    device = position_ids.device if position_ids is not None else device
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if window is not None:
        allowed = allowed & ~torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril(-window)
    allowed = allowed.unsqueeze(0)
    if position_ids is not None:
        segment = (position_ids == 0).cumsum(dim=1)
        allowed = (segment[:, :, None] == segment[:, None, :]) & allowed
    allowed = allowed[:, None]
    if additive_dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=additive_dtype, device=device).masked_fill(
        ~allowed, torch.finfo(additive_dtype).min
    )


def hf_model_inputs(batch: dict, eager_dtype: torch.dtype | None = None, windows=None) -> dict:
    """The keyword arguments a plain HF causal LM takes for ``batch``: packed documents
    (``position_ids``) also get the block-diagonal causal mask the op graph builds from them
    (:func:`attention_mask`; additive in ``eager_dtype`` for eager attention). ``windows``: the
    model's sliding windows, as one window every layer has (a mask cut to it) or as
    ``{layer kind: window or None}`` (a mask per kind, for models that take a dict of masks); see
    ``hf_models.common.hf_mask_windows``."""
    pos = batch.get("position_ids")
    if pos is None:
        return batch
    if isinstance(windows, dict):
        mask = {kind: attention_mask(pos.shape[1], pos, eager_dtype, window=w) for kind, w in windows.items()}
    else:
        mask = attention_mask(pos.shape[1], pos, eager_dtype, window=windows)
    return {**batch, "attention_mask": mask}
