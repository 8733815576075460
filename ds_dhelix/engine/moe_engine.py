"""``DhelixMoeEngine``: the DHelix engine for graphs with expert-parallel MoE layers.

DeepSpeed finds MoE layers by class (``deepspeed.moe.layer.MoE``); our experts are HF modules whose
shards are marked like DeepSpeed's (``allreduce = False``, ``group_name``). This engine tells
DeepSpeed the model has MoE layers before it builds the optimizer, so ZeRO puts expert shards in
their own parameter groups and reduces their gradients over the expert-data-parallel group
(divided by the full data-parallel size, DeepSpeed's convention). After each step it exposes:

    engine.moe_aux_loss         mean load-balancing loss of the step (unscaled; over micro-batches and DP)
    engine.moe_expert_load      [layers, experts] token copies routed to each expert, summed over DP
    engine.moe_dropped_tokens   copies dropped by capacity in the step, summed over layers and DP
    engine.moe_a2a_ms           this rank's dispatch/combine all-to-all time (launch to completion)
    engine.moe_a2a_exposed_ms   ... of which the executor was blocked waiting (not hidden by SI)

and logs ``MoE/aux_loss``, ``MoE/dropped_tokens``, ``MoE/all_to_all_ms``, ``MoE/all_to_all_exposed_ms``,
``MoE/all_to_all_hidden_fraction``, ``MoE/layer<i>/max_load_fraction`` (scalars) and
``MoE/layer<i>/tokens_per_expert`` (histogram) to TensorBoard.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.engine import DeepSpeedEngine

from .dhelix_engine import DhelixEngine


class ExpertShardsMixin:
    """Tells DeepSpeed a model has MoE layers when trained parameters are marked as expert shards
    (``allreduce = False``, ``group_name``), before it builds the optimizer and broadcasts the
    model: each EP rank keeps its own experts, their gradients reduced over the expert-data-parallel
    group. (DeepSpeed itself only recognises its own ``MoE`` module class.) At ZeRO stage 3 the
    shards are placed as DeepSpeed places AutoEP's experts (``ds_zero_placement_family``):
    partitioned over their expert-data-parallel group."""

    def _configure_distributed_model(self, model):
        if any(is_moe_param(p) and p.requires_grad for p in model.parameters()):  # trained experts, sharded
            self.has_moe_layers = True
            from hf_models.adapters import num_experts

            self.num_experts.append(num_experts(model.config))
            if self.zero_optimization_stage() == 3:
                for p in model.parameters():
                    if is_moe_param(p):
                        p.ds_zero_placement_family, p.ds_zero_partition_group_name = "autoep_expert", p.group_name
        super()._configure_distributed_model(model)

    def _validate_zero3_moe_compatibility(self):
        """DeepSpeed asks its own ``MoE`` or AutoEP layer classes of a stage-3 MoE model; ours are HF
        modules with marked shards, and what stage 3 cannot take with them is refused from the
        config before the model is built (``zero3.check_zero3``)."""


class DeepSpeedExpertEngine(ExpertShardsMixin, DeepSpeedEngine):
    """Plain DeepSpeed on a model whose expert shards are marked (the bench's tutel peer)."""


class DhelixMoeEngine(ExpertShardsMixin, DhelixEngine):
    moe_aux_loss: float | None = None
    moe_expert_load: torch.Tensor | None = None
    moe_dropped_tokens: int = 0
    moe_a2a_ms: float = 0.0
    moe_a2a_exposed_ms: float = 0.0

    def clip_fp32_gradients(self):
        """ZeRO 0 clipping with the exact global norm. DeepSpeed's ``clip_grad_norm_`` averages the
        per-rank norms when experts are sharded (each rank sees only its experts), so ranks clip by
        an approximate norm; here the expert part is summed over the EP group instead. (ZeRO 1/2
        already sum every partition over the DP group: exact.)"""
        if not self.has_moe_layers:
            return super().clip_fp32_gradients()
        lay = self.groups
        params = [p for p in self.module.parameters() if p.grad is not None]
        counted = [p for p in params if lay.tp_rank == 0 or getattr(p, "tensor_model_parallel", False)]
        sq = torch.zeros(2, dtype=torch.float32, device=params[0].grad.device)
        for p in counted:
            sq[1 if is_moe_param(p) else 0] += p.grad.detach().float().norm() ** 2
        if lay.tp_size > 1:
            dist.all_reduce(sq, group=lay.tp_grad_group)
        expert = sq[1:].clone()
        dist.all_reduce(expert, group=lay.ep.forward)
        total = (sq[0] + expert[0]).sqrt()
        coef = torch.clamp(self.gradient_clipping() / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.device))
        return total

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint + one file of expert shards per EP rank (DeepSpeed's model-state
        file holds only DP rank 0's experts, which every rank would load). At stage 3 each rank's
        optimizer-state file holds its partitions of its experts: nothing more to write."""
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        out = super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        if self.has_moe_layers and self.zero_optimization_stage() < 3:  # (stage 3: every rank saves its partitions)
            lay = self.groups
            if lay.tp_rank == 0 and lay.cp_rank == 0 and lay.dp_rank < lay.ep_size:  # one writer per EP rank
                shards = {
                    n: {"expert_ids": list(p.expert_ids), "tensor": p.detach().cpu().clone()}
                    for n, p in self.module.named_parameters()
                    if is_moe_param(p)
                }
                path = self._expert_shard_path(save_dir, tag, lay.ep_rank)
                torch.save({"ep_size": lay.ep_size, "ep_rank": lay.ep_rank, "shards": shards}, path + ".tmp")
                os.replace(path + ".tmp", path)
            dist.barrier()
        return out

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        """DeepSpeed's load, then this EP rank's expert shards, checked against their global ids."""
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if os.path.isfile(latest):
                with open(latest) as f:
                    tag = f.read().strip()
        out = super().load_checkpoint(load_dir, tag=tag, **kwargs)
        if self.has_moe_layers and tag is not None and not self.loaded_resharded and self.zero_optimization_stage() < 3:
            self._load_expert_shards(load_dir, str(tag))
        return out

    @staticmethod
    def _expert_shard_path(save_dir, tag, ep_rank) -> str:
        return os.path.join(save_dir, tag, f"dhelix_experts_ep_rank_{ep_rank:02d}.pt")

    def _load_expert_shards(self, load_dir, tag) -> None:
        lay = self.groups
        path = self._expert_shard_path(load_dir, tag, lay.ep_rank)
        if not os.path.isfile(path):
            raise ValueError(
                f"checkpoint {os.path.join(load_dir, tag)} has no expert shard file for EP rank "
                f"{lay.ep_rank} of {lay.ep_size} ({os.path.basename(path)}): it was saved with another "
                f"expert_parallel.size or without ds_dhelix; export an HF checkpoint and load "
                f"that instead"
            )
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved["ep_size"] != lay.ep_size:
            raise ValueError(
                f"checkpoint was saved with expert_parallel.size {saved['ep_size']}, this run uses "
                f"{lay.ep_size}; resume with the same EP size or load its HF export"
            )
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                if not is_moe_param(p):
                    continue
                shard = saved["shards"][name]
                if shard["expert_ids"] != list(p.expert_ids):
                    raise ValueError(
                        f"{name}: checkpoint shard holds experts {shard['expert_ids']}, this rank "
                        f"holds experts {list(p.expert_ids)}"
                    )
                p.copy_(shard["tensor"])
        if self.zero_optimization_stage() in (1, 2) and not self.zero_load_from_fp32_weights():
            self.optimizer._restore_from_bit16_weights()

    @property
    def moe_metrics(self):
        return self.graph.meta["moe_metrics"]

    def train_batch(self, data_iter=None) -> torch.Tensor:
        self.moe_metrics.reset()
        return super().train_batch(data_iter)

    def _reduce_moe_metrics(self) -> None:
        """The step's MoE numbers, packed on the device, summed over the DP (and CP) ranks, then read
        on the host once (the step's only read of them: the routers and losses kept them on the device)."""
        m = self.moe_metrics
        aux = m.aux_mean()
        load = m.load if m.load is not None else torch.zeros(m.num_layers, m.num_experts, dtype=torch.float64)
        dev = aux.device if aux is not None else load.device
        tail = torch.zeros(2, dtype=torch.float64, device=dev)  # dropped copies, aux loss
        if m.dropped is not None:
            tail[0] = m.dropped.sum()
        if aux is not None:
            tail[1] = aux
        packed = torch.cat([load.flatten().to(dev, torch.float64), tail])
        n = m.num_layers * m.num_experts
        if self.groups.cp_size > 1:  # each CP rank routed its own tokens; the aux loss is the sequence's already
            dist.all_reduce(packed[: n + 1], group=self.groups.cp_group)
        if self.groups.dp_size > 1:
            dist.all_reduce(packed, group=self.groups.dp_group)
        host = packed.tolist()
        self.moe_expert_load = torch.tensor(host[:n], dtype=torch.float64).view(m.num_layers, m.num_experts)
        self.moe_dropped_tokens = int(host[n])
        self.moe_aux_loss = None if aux is None else host[n + 1] / self.groups.dp_size
        self.moe_a2a_ms, self.moe_a2a_exposed_ms = m.a2a_busy_s * 1e3, m.a2a_exposed_s * 1e3

    def log_step(self, batches) -> None:
        self._reduce_moe_metrics()  # every rank (a DP all-reduce), at the end of each step
        super().log_step(batches)
        if not self.logs_this_step():
            return
        step = self.global_steps
        events = [("MoE/dropped_tokens", float(self.moe_dropped_tokens), step)]
        if self.moe_a2a_ms > 0:
            hidden = max(0.0, 1 - self.moe_a2a_exposed_ms / self.moe_a2a_ms)
            events += [
                ("MoE/all_to_all_ms", self.moe_a2a_ms, step),
                ("MoE/all_to_all_exposed_ms", self.moe_a2a_exposed_ms, step),
                ("MoE/all_to_all_hidden_fraction", hidden, step),
            ]
        if self.moe_aux_loss is not None:
            events.append(("MoE/aux_loss", self.moe_aux_loss, step))
        load = self.moe_expert_load
        for layer in range(load.shape[0]):
            total = float(load[layer].sum())
            if total > 0:
                events.append((f"MoE/layer{layer}/max_load_fraction", float(load[layer].max()) / total, step))
        self.monitor.write_events(events)
        writer = getattr(getattr(self.monitor, "tb_monitor", None), "summary_writer", None)
        if writer is not None:
            for layer in range(load.shape[0]):
                writer.add_histogram(f"MoE/layer{layer}/tokens_per_expert", load[layer], step)
