"""DeepSpeed's own pipelines as benchmark baselines, and ours on the same data, timed per step.

    run_deepspeed_pipe(model, pp, "1f1b")       DeepSpeed PipelineEngine (1F1B TrainSchedule)
    run_deepspeed_pipe(model, pp, "dualpipev")  DeepSpeed DualPipeVEngine (pairs one after the other)
    run_dhelix_pipe(model, pp, "w")             ours: W schedule, SI pairs (also "dualpipev", "sequential")

Each runs on every rank of an initialized world (``deepspeed`` launcher, ``run_ranks``, ``dhelix
bench``) and returns the same dict on every rank: ``{"engine", "schedule", "pp", "dp",
"step_s": [...], "median_step_s", "losses": [...]}`` (warm-up steps excluded). DeepSpeed's
pipelines get the HF decoder layers wrapped as plain pipeline layers (hidden state as the only
activation, rotary embeddings recomputed per layer); Llama-style models only.
"""
from __future__ import annotations

import copy
import statistics
import time

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


def _build(model_name: str, seed: int, num_layers: int | None):
    from hf_models.registry import build_model, load_config
    if num_layers is None:
        return build_model(model_name, seed=seed)[0]
    from transformers import AutoModelForCausalLM
    config = copy.deepcopy(load_config(model_name))
    config.num_hidden_layers = num_layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def pipe_layers(model) -> list[nn.Module]:
    """[embed, decoder layers..., norm+head] of a Llama-style HF model, for a PipelineModule."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise ValueError(f"run_deepspeed_pipe wraps Llama-style models (model.embed_tokens/layers/norm/rotary_emb); "
                         f"{type(model).__name__} is not one; use tiny-llama or a Llama checkpoint")
    if model.config.tie_word_embeddings:
        raise ValueError("run_deepspeed_pipe: tied embeddings would need a TiedLayerSpec; use an untied model")
    return ([HFEmbedPipe(inner.embed_tokens)] + [HFDecoderPipe(layer, inner.rotary_emb) for layer in inner.layers]
            + [HFHeadPipe(inner.norm, model.lm_head)])


def _batches(vocab: int, micro_batches: int, micro_batch_size: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(3, vocab, (micro_batch_size, seq_len), generator=g) for _ in range(micro_batches)]


def _ds_config(micro_batches, micro_batch_size, zero_stage, lr) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": micro_batches,
            "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "zero_optimization": {"stage": zero_stage},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}}}


def _time_steps(engine, make_iter, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    import torch.distributed as dist
    times, losses = [], []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine.train_batch(make_iter())
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            losses.append(float(loss))
    return times, losses


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


def run_deepspeed_pipe(model_name: str, pp: int, schedule: str = "1f1b", steps: int = 3, micro_batches: int = 4,
                       micro_batch_size: int = 2, seq_len: int = 64, zero_stage: int = 0, lr: float = 1e-3,
                       seed: int = 1234, num_layers: int | None = None, warmup: int = 1) -> dict:
    """Time ``steps`` training steps of DeepSpeed's own pipeline (``"1f1b"``: PipelineEngine with
    its TrainSchedule; ``"dualpipev"``: DualPipeVEngine) on the HF model, DP = world / pp."""
    import torch.distributed as dist
    model = _build(model_name, seed, num_layers)
    vocab = model.config.vocab_size
    engine = build_deepspeed_pipe(model, pp, schedule, _ds_config(micro_batches, micro_batch_size, zero_stage, lr))
    data = _batches(vocab, micro_batches, micro_batch_size, seq_len, seed)
    times, losses = _time_steps(engine, lambda: iter([(ids, ids) for ids in data]), steps, warmup)
    engine.destroy()
    return _result("deepspeed", schedule, pp, dist.get_world_size() // pp, times, losses)


def run_dhelix_pipe(model_name: str, pp: int, schedule: str = "w", steps: int = 3, micro_batches: int = 4,
                    micro_batch_size: int = 2, seq_len: int = 64, zero_stage: int = 0, lr: float = 1e-3,
                    seed: int = 1234, num_layers: int | None = None, warmup: int = 1, tp: int = 1) -> dict:
    """The same measurement for our folded pipeline (``"w"``, ``"dualpipev"`` with SI pairs,
    ``"sequential"`` fold), DP = world / (pp x tp)."""
    import torch.distributed as dist

    import ds_dhelix
    model = _build(model_name, seed, num_layers)
    vocab = model.config.vocab_size
    config = _ds_config(micro_batches, micro_batch_size, zero_stage, lr)
    config["dhelix"] = {"enabled": True, "schedule": schedule, "pipeline": {"stages": pp},
                        "tensor_parallel": {"size": tp}}
    engine, *_ = ds_dhelix.initialize(model=model, config=config)
    data = _batches(vocab, micro_batches, micro_batch_size, seq_len, seed)
    times, losses = _time_steps(engine, lambda: iter([{"input_ids": ids, "labels": ids} for ids in data]),
                                steps, warmup)
    engine.destroy()
    return _result("dhelix", schedule, pp, dist.get_world_size() // (pp * tp), times, losses)


def _result(engine: str, schedule: str, pp: int, dp: int, times, losses) -> dict:
    return {"engine": engine, "schedule": schedule, "pp": pp, "dp": dp, "step_s": times,
            "median_step_s": statistics.median(times) if times else None, "losses": losses}


def compare_pipelines(rank, world, model_name: str = "tiny-llama", pp: int = 2, steps: int = 3, **kw) -> list[dict]:
    """``run_ranks`` entry: DeepSpeed 1F1B, DeepSpeed DualPipeV, ours W and DualPipeV+SI, one world."""
    return [run_deepspeed_pipe(model_name, pp, "1f1b", steps, **kw),
            run_deepspeed_pipe(model_name, pp, "dualpipev", steps, **kw),
            run_dhelix_pipe(model_name, pp, "w", steps, **kw),
            run_dhelix_pipe(model_name, pp, "dualpipev", steps, **kw)]
