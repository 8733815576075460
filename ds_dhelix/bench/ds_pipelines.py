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
        raise ValueError(
            f"DeepSpeed's pipeline baselines wrap Llama-style models (model.embed_tokens/layers/norm/rotary_emb); "
            f"{type(model).__name__} is not one; use tiny-llama or a Llama checkpoint"
        )
    if model.config.tie_word_embeddings:
        raise ValueError(
            "DeepSpeed's pipeline baselines: tied embeddings would need a TiedLayerSpec; use an untied model"
        )
    return (
        [HFEmbedPipe(inner.embed_tokens)]
        + [HFDecoderPipe(layer, inner.rotary_emb) for layer in inner.layers]
        + [HFHeadPipe(inner.norm, model.lm_head)]
    )


# ------------------------------------------------------------- TP inside stages: our op graph's layers
class _Collective(torch.autograd.Function):
    """One COMM op of the op graph as an autograd step: its forward collective now, its backward
    collective (the adjoint: reduce-scatter for an all-gather, and so on) in the backward pass."""

    @staticmethod
    def forward(ctx, x, body, side):
        ctx.body, ctx.side = body, side
        return body.forward(x, side, 0).wait()

    @staticmethod
    def backward(ctx, grad):
        return ctx.body.backward(grad.contiguous(), ctx.side, 0).wait(), None, None


def run_ops(ops, side: dict, env: dict) -> dict:
    """Run op-graph ops one after the other under autograd (no co-execution): what a plain
    pipeline stage of ours would do."""
    for op in ops:
        if op.is_comm:
            env[op.outputs[0]] = _Collective.apply(env[op.inputs[0]], op.comm, side)
        else:
            env.update(zip(op.outputs, op.fn(side, *(env[k] for k in op.inputs))))
    return env


class GraphEmbedPipe(nn.Module):
    """The op graph's first block: input_ids [b, s] -> this TP rank's hidden shard [s/tp, b, h]."""

    def __init__(self, ops, embed: nn.Module, make_side):
        super().__init__()
        self.embed, self.ops, self.make_side = embed, ops, make_side

    def forward(self, ids):
        return run_ops(self.ops, self.make_side({"input_ids": ids}), {})["h"]


class GraphLayerPipe(nn.Module):
    """One decoder layer of the op graph (TP collectives included) on hidden [s/tp, b, h]. Its side
    inputs (rotary cos/sin, masks) depend only on the shape, so they are made once per shape."""

    def __init__(self, ops, layer: nn.Module, make_side, tp: int):
        super().__init__()
        self.layer, self.ops, self.make_side, self.tp = layer, ops, make_side, tp
        self._sides: dict = {}

    def forward(self, h):
        shape = (h.shape[1], h.shape[0] * self.tp)
        if shape not in self._sides:
            self._sides[shape] = self.make_side({"input_ids": torch.zeros(shape, dtype=torch.long, device=h.device)})
        return run_ops(self.ops, self._sides[shape], {"h": h})["h"]


class GraphHeadPipe(nn.Module):
    """The op graph's last block up to the logits of this TP rank's sequence shard."""

    def __init__(self, ops, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm, self.head, self.ops = norm, head, ops

    def forward(self, h):
        return run_ops(self.ops, {}, {"h": h})["logits"]


def graph_pipe_layers(model, tp: int, tp_rank: int, tp_group, seed: int = 0):
    """Shard a Llama-style ``model`` for TP rank ``tp_rank`` (in place) and return ``(layers,
    loss_fn, replicated)``: our op graph's blocks as pipeline layers (``GraphEmbedPipe``,
    ``GraphLayerPipe`` per decoder layer, ``GraphHeadPipe``), the loss of the graph's own
    ops after ``head.logits`` (its value the micro-batch's loss, summed over the TP ranks' shares; its
    gradient that of this rank's share), and the
    replicated weights whose gradients are summed over ``tp_group`` once per step."""
    from hf_models.adapters import adapter_for

    pipe_layers(model)  # the same model check as the HF-layer baselines
    graph = adapter_for(model.config).build_graph(model, tp, tp_rank, tp_group, tp_group, seed=seed)
    inner, pre, *body, post = model.model, *graph.blocks
    cut = 1 + next(i for i, op in enumerate(post) if op.name == "head.logits")
    head, loss_ops = post[:cut], post[cut:]  # (the vocab-parallel loss: its statistics' all-to-all too)
    layers = (
        [GraphEmbedPipe(pre, inner.embed_tokens, graph.make_side)]
        + [GraphLayerPipe(ops, layer, graph.make_side, tp) for ops, layer in zip(body, inner.layers)]
        + [GraphHeadPipe(head, inner.norm, model.lm_head)]
    )

    def loss_fn(logits, labels):
        share = run_ops(loss_ops, graph.make_side({"input_ids": labels, "labels": labels}), {"logits": logits})["loss"]
        total = share.detach().clone()
        torch.distributed.all_reduce(total, group=tp_group)
        return share + (total - share.detach())  # the micro-batch's loss; the gradient of this rank's share

    return layers, loss_fn, graph.replicated


def _sum_replicated_before_reduce(engine, replicated) -> None:
    """Make ``engine``'s ReduceGrads step first sum the TP-replicated weights' gradients over
    their TP group (what our executor does after a step's last backward): DeepSpeed's pipelines
    reduce over data parallelism only."""
    from deepspeed.runtime.pipe import schedule

    base = type(engine)._INSTRUCTION_MAP
    reduce = base[schedule.ReduceGrads]

    def reduce_grads(self):
        replicated.all_reduce()
        reduce(self)

    engine._INSTRUCTION_MAP = {**base, schedule.ReduceGrads: reduce_grads}


def build_deepspeed_pipe(model, pp: int, schedule: str, ds_config: dict, tp: int = 1, seed: int = 0):
    """DeepSpeed's own pipeline engine on the HF model's layers (``"1f1b"``: PipelineEngine with its
    TrainSchedule; ``"dualpipev"``: DualPipeVEngine); ``train_batch`` takes ``(ids, labels)`` pairs.
    ``tp > 1``: a pp x tp grid (DeepSpeed's topology, TP ranks adjacent) whose stages run our op
    graph's TP layers (``graph_pipe_layers``); the world must be ``pp * tp`` ranks."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.pipe import PipelineModule
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    if schedule not in ("1f1b", "dualpipev"):
        raise ValueError(f"schedule={schedule!r}: DeepSpeed's pipelines are '1f1b' and 'dualpipev'")
    micro_batches = ds_config.get("gradient_accumulation_steps", 1)
    if schedule == "dualpipev" and micro_batches < 2 * pp:
        raise ValueError(f"DeepSpeed's DualPipeV needs micro_batches >= 2 * pp = {2 * pp}, got {micro_batches}")
    deepspeed.init_distributed(dist_init_required=not dist.is_initialized())
    cls = DualPipeVModule if schedule == "dualpipev" else PipelineModule
    if tp == 1:
        layers, loss_fn, replicated, grid = pipe_layers(model), causal_lm_loss, None, {"num_stages": pp}
    else:
        if dist.get_world_size() != pp * tp:
            raise ValueError(f"DeepSpeed's pipeline with TP: world {dist.get_world_size()} != pp {pp} x tp {tp}")
        topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=1)
        tp_group = None
        for ranks in topology.get_axis_comm_lists("model"):  # every rank creates every group, in one order
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                tp_group = group
        tp_rank = topology.get_coord(dist.get_rank()).model
        layers, loss_fn, replicated = graph_pipe_layers(model, tp, tp_rank, tp_group, seed)
        grid = {"topology": topology}
        # each TP rank's activation is its own sequence shard: DeepSpeed's default of sending 1/tp of a
        # (replicated) activation and all-gathering it on the next stage would mix the shards
        ds_config = {
            **ds_config,
            "pipeline": {**ds_config.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False},
        }
    part = "type:GraphLayerPipe" if tp > 1 else "type:HFDecoderPipe"
    module = cls(layers=layers, loss_fn=loss_fn, partition_method=part, **grid)
    engine, *_ = deepspeed.initialize(
        model=module, config=ds_config, model_parameters=[p for p in module.parameters() if p.requires_grad]
    )
    if replicated is not None:
        _sum_replicated_before_reduce(engine, replicated)
    return engine
