"""DeepSpeed's own pipelines as baselines of ``dhelix bench --pp``: the HF model's decoder layers
wrapped as plain pipeline layers (hidden state as the only activation, rotary embeddings
recomputed per layer; Llama-style models only), built into DeepSpeed's ``PipelineEngine`` (its
1F1B ``TrainSchedule``) or ``DualPipeVEngine`` (V-folded, pairs run one after the other).

    engine = build_deepspeed_pipe(model, pp=2, schedule="1f1b", ds_config=...)
    engine.train_batch(iter([(input_ids, labels), ...]))
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class HFEmbedPipe(nn.Module):
    """input_ids [b, s] -> hidden [b, s, h]."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, ids):
        return self.embed(ids)


class HFDecoderPipe(nn.Module):
    """One HF decoder layer on hidden [b, s, h] (causal sdpa, rotary from positions 0..s-1)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h):
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        out = self.layer(h, position_ids=pos, position_embeddings=self.rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out


class HFHeadPipe(nn.Module):
    """hidden -> logits (final norm + LM head)."""

    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, h):
        return self.head(self.norm(h))


def causal_lm_loss(logits, labels):
    """HF's causal-LM loss: position t predicts labels[t+1], mean over the valid targets."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def pipe_layers(model) -> list[nn.Module]:
    """[embed, decoder layers..., norm+head] of a Llama-style HF model, for a PipelineModule."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise ValueError(f"DeepSpeed's pipeline baselines wrap Llama-style models (model.embed_tokens/layers/norm/rotary_emb); "
                         f"{type(model).__name__} is not one; use tiny-llama or a Llama checkpoint")
    if model.config.tie_word_embeddings:
        raise ValueError("DeepSpeed's pipeline baselines: tied embeddings would need a TiedLayerSpec; use an untied model")
    return ([HFEmbedPipe(inner.embed_tokens)] + [HFDecoderPipe(layer, inner.rotary_emb) for layer in inner.layers]
            + [HFHeadPipe(inner.norm, model.lm_head)])


def build_deepspeed_pipe(model, pp: int, schedule: str, ds_config: dict):
    """DeepSpeed's own pipeline engine on the HF model's layers (``"1f1b"``: PipelineEngine with its
    TrainSchedule; ``"dualpipev"``: DualPipeVEngine); ``train_batch`` takes ``(ids, labels)`` pairs."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.pipe import PipelineModule
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
    if schedule not in ("1f1b", "dualpipev"):
        raise ValueError(f"schedule={schedule!r}: DeepSpeed's pipelines are '1f1b' and 'dualpipev'")
    micro_batches = ds_config.get("gradient_accumulation_steps", 1)
    if schedule == "dualpipev" and micro_batches < 2 * pp:
        raise ValueError(f"DeepSpeed's DualPipeV needs micro_batches >= 2 * pp = {2 * pp}, got {micro_batches}")
    deepspeed.init_distributed(dist_init_required=not dist.is_initialized())
    cls = DualPipeVModule if schedule == "dualpipev" else PipelineModule
    module = cls(layers=pipe_layers(model), num_stages=pp, loss_fn=causal_lm_loss,
                 partition_method="type:HFDecoderPipe")
    engine, *_ = deepspeed.initialize(model=module, config=ds_config,
                                      model_parameters=[p for p in module.parameters() if p.requires_grad])
    return engine
