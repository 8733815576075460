"""The folded pipeline module: one pipeline rank's two chunks of an HF causal LM, as a DeepSpeed
``PipelineModule`` (so DeepSpeed's ``PipelineEngine`` accepts it).

Built from the whole HF model and its op graph (see :mod:`ds_dhelix.graph.model_graph`; built on the full model,
sharded for this rank's TP slice). Stage ``r`` keeps the parameters of the layers of chunk ``r``
(phase 0) and chunk ``2p-1-r`` (phase 1); stage 0 also keeps the embedding, final norm and LM head,
so tied embeddings stay on one rank. Every other parameter is dropped from the module tree (its
slot holds an empty, non-persistent buffer), so the stages together hold exactly one copy of the
parameters and every kept parameter keeps its HF name::

    p = 2, 4 layers        stage 0                         stage 1
    hf_model params        embed, layer 0, layer 3, norm,  layer 1, layer 2
                           lm_head
    graph blocks           phase 0: [pre, 1]               phase 0: [2]
                           phase 1: [4, post]              phase 1: [3]

:func:`gather_hf_state_dict` / :func:`export_hf_pipeline` gather the stages back into one HF
state_dict / ``save_pretrained`` directory on global rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule
from torch import nn

from .folding import LayerFold, chunk_index


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The HF model's list of decoder layers: the first ``ModuleList`` as long as the config's
    ``num_hidden_layers`` (``model.layers``, ``transformer.h``, ``gpt_neox.layers``)."""
    n = model.config.num_hidden_layers
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            return mod
    raise ValueError(
        f"{type(model).__name__} has no ModuleList of its {n} decoder layers; "
        f"the pipeline needs an HF causal LM with a layer list"
    )


def stage_owns(fold: LayerFold, stage: int):
    """Predicate on a layer index (None = a parameter outside the layer list): does ``stage`` keep it?"""
    layers = set(fold.rank_layers(stage))
    outer = fold.holds_embedding(stage) or fold.holds_head(stage)
    return lambda layer: outer if layer is None else layer in layers


def prune_to_stage(model: nn.Module, fold: LayerFold, stage: int) -> int:
    """Drop, in place, every parameter ``stage`` does not hold; return the number of kept elements.
    A dropped parameter leaves an empty non-persistent buffer of its dtype in its slot (code that
    only reads a weight's dtype/device, such as rotary embeddings, keeps working); the stand-ins are
    listed in ``model._dhelix_stand_ins`` as (module, name), for :func:`cast_stand_ins`."""
    owns = stage_owns(fold, stage)
    stand_ins = []
    layer_of = {id(p): i for i, layer in enumerate(decoder_layers(model)) for p in layer.parameters()}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or owns(layer_of.get(id(p))):
                continue
            del module._parameters[name]
            device = "cpu" if p.is_meta else p.device  # (a model built empty: its shards are read later)
            module.register_buffer(
                name, torch.empty((0,) + tuple(p.shape[1:]), dtype=p.dtype, device=device), persistent=False
            )
            stand_ins.append((module, name))
    model._dhelix_stand_ins = stand_ins
    return sum(p.numel() for p in model.parameters())


def cast_stand_ins(model: nn.Module, dtype: torch.dtype) -> None:
    """The floating stand-ins of dropped parameters in ``dtype``, the one DeepSpeed cast the kept
    parameters to (it casts parameters only): a stage without the embedding reads the rotary
    tables' dtype from the embedding's stand-in, and in bf16 / fp16 they must be the stage's."""
    for module, name in getattr(model, "_dhelix_stand_ins", ()):
        buf = module._buffers[name]
        if buf.is_floating_point() and buf.dtype != dtype:
            module._buffers[name] = buf.to(dtype)


class FoldedPipelineModule(PipelineModule):
    """This stage's chunks of an HF model for the folded (W / DualPipeV) pipeline engine.

    ``model``: the HF causal LM (pruned in place); ``graph``: its op graph; ``fold``: the layout;
    ``topology``: DeepSpeed's pipe x data x model topology. Exposes ``hf_model`` (HF names),
    ``graph``, ``fold``, ``chunk_blocks(phase)`` and ``stage_id``. ``forward`` is not used: the
    engine runs the graph blocks through the SI executor. ``on_pruned(model)`` runs once the other
    stages' layers are gone and before DeepSpeed moves the module to its device (the build reads
    this stage's shards from a checkpoint there).
    """

    def __init__(self, model: nn.Module, graph, fold: LayerFold, topology, on_pruned=None):
        # PipelineModule.__init__ calls _partition_layers and _build, which need these
        object.__setattr__(self, "_pending", (model, graph, fold, on_pruned))
        super().__init__(layers=list(range(fold.num_layers)), topology=topology, partition_method="uniform")
        object.__delattr__(self, "_pending")

    def _partition_layers(self, method="uniform"):
        fold = self._pending[2]
        assert self.num_stages == fold.num_stages, (self.num_stages, fold.num_stages)
        self.parts = [sum(fold.chunk_sizes[:c]) for c in range(2 * fold.num_stages + 1)]
        phase0 = fold.layers(self.stage_id, 0)
        self._local_start, self._local_stop = phase0.start, phase0.stop

    def _build(self):
        model, graph, fold, on_pruned = self._pending
        self.fold, self.graph = fold, graph
        prune_to_stage(model, fold, self.stage_id)
        if on_pruned is not None:
            on_pruned(model)
        self.hf_model = model
        for p in self.parameters():
            p.ds_pipe_replicated = False

    def stage_owner(self, layer_idx):
        return self.fold.owner(layer_idx)[0]

    def chunk_blocks(self, phase: int) -> list[int]:
        """Graph block indices this stage runs in ``phase``, in forward order (block 0 = embedding,
        block i+1 = layer i, the last block = norm/head/loss)."""
        fold = self.fold
        chunk = chunk_index(self.stage_id, phase, fold.num_stages)
        blocks = [layer + 1 for layer in fold.chunk_layers(chunk)]
        if chunk == 0:
            blocks.insert(0, 0)
        if chunk == 2 * fold.num_stages - 1:
            blocks.append(fold.num_layers + 1)
        return blocks

    def forward(self, *args, **kwargs):
        raise RuntimeError("FoldedPipelineModule runs through its engine's train_batch(); it has no forward()")

    # DeepSpeed checkpoints (save_checkpoint / load_checkpoint): one file per stage and TP rank
    def _ckpt_path(self, ckpt_dir: str) -> str:
        import os

        tp_rank = self._grid.get_slice_parallel_rank()
        return os.path.join(ckpt_dir, f"folded_stage_{self.stage_id:02d}-tp_{tp_rank:02d}-model_states.pt")

    def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
        if self._grid.data_parallel_id != 0:
            return
        state = {
            k: v
            for k, v in self.hf_model.state_dict().items()
            if not exclude_frozen_params or self.hf_model.get_parameter(k).requires_grad
        }
        checkpoint_engine.makedirs(save_dir, exist_ok=True)
        checkpoint_engine.save({k: v.clone() for k, v in state.items()}, self._ckpt_path(save_dir))

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        state = checkpoint_engine.load(self._ckpt_path(load_dir), map_location=lambda storage, loc: storage)
        self.hf_model.load_state_dict(state, strict=strict)


def export_hf_pipeline(
    module: FoldedPipelineModule, out_dir: str, tokenizer=None, tp_group=None, tp_size: int = 1, max_shard_size="5GB"
) -> str | None:
    """Write the whole pipelined model as an HF checkpoint, streamed from global rank 0 with
    :func:`ds_dhelix.engine.checkpoint.export_hf`'s writer; returns the path on rank 0."""
    from ..engine.checkpoint import export_hf

    return export_hf(
        module.hf_model,
        out_dir,
        tokenizer,
        max_shard_size=max_shard_size,
        tensors=pipeline_tensors(module, tp_group, tp_size),
    )


def pipeline_tensors(module: FoldedPipelineModule, tp_group=None, tp_size: int = 1, only=None):
    """``(name, full HF tensor)`` of every parameter of the whole model, one at a time, yielded on
    global rank 0 (collective): each stage gathers its tensors over its TP group and the rank of
    global rank 0's pipeline sends each to it, stage by stage. ``only(name)``: the parameters it
    accepts (a LoRA adapter's factors), default all."""
    from ..engine.checkpoint import hf_tensors

    grid = module._grid
    pipe = grid.get_pipe_parallel_group()
    mine = [name for name, _ in module.hf_model.named_parameters() if only is None or only(name)]
    by_stage = [None] * grid.get_pipe_parallel_world_size()
    dist.all_gather_object(by_stage, (module.stage_id, mine), group=pipe)
    root = dist.get_rank() == 0
    in_root_pipeline = grid.stage_to_global(0) == 0  # this rank's pipeline is global rank 0's
    dtype = next(module.hf_model.parameters()).dtype if root else None
    for stage, names in sorted(by_stage):
        if stage == module.stage_id:
            for name, full in hf_tensors(module.hf_model, tp_group, tp_size, only):
                if root:
                    yield name, full
                elif in_root_pipeline:  # its full shape (a LoRA factor's is the model's own), then the tensor
                    dist.send(torch.tensor([full.dim(), *full.shape, *[0] * (8 - full.dim())]), dst=0)
                    dist.send(full.contiguous(), dst=0)
        elif root:
            src = grid.stage_to_global(stage)
            for name in names:
                head = torch.empty(9, dtype=torch.int64)
                dist.recv(head, src=src)
                buf = torch.empty(head[1 : 1 + int(head[0])].tolist(), dtype=dtype)
                dist.recv(buf, src=src)
                yield name, buf


def gather_hf_state_dict(module: FoldedPipelineModule, tp_group=None, tp_size: int = 1) -> dict | None:
    """Every parameter of the whole model as its full HF tensor, on global rank 0 (None elsewhere;
    collective): :func:`pipeline_tensors` collected (for comparisons; the export streams instead)."""
    full = dict(pipeline_tensors(module, tp_group, tp_size))
    return full if dist.get_rank() == 0 else None
