"""Process groups of a run: data parallel (DP) x tensor/sequence parallel (TP).

Ranks are laid out TP-innermost: with TP=2 and 4 ranks, TP groups are {0,1} and {2,3}, DP groups
{0,2} and {1,3}. Expert parallelism (EP) shards experts inside each DP group, DeepSpeed's way: EP
groups are runs of ``ep`` consecutive DP peers, expert-data-parallel (EDP) groups the strided rest
(TP=1, 4 ranks, EP=2: EP {0,1} {2,3}, EDP {0,2} {1,3}); they are registered in
``deepspeed.utils.groups`` under ``ep_size_<ep>`` so ZeRO reduces expert gradients over EDP.
``ParallelLayout`` also answers DeepSpeed's ``mpu`` protocol, so DeepSpeed reduces gradients over
the DP group only and computes the global grad norm over the TP group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .comm import register_backward_group


def valid_sizes(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelLayout:
    world_size: int
    rank: int
    tp_size: int
    tp_group: object = None        # TP/SP collectives of the op graph (COMM ops; backward ones on its twin)
    tp_grad_group: object = None   # gradient all-reduce of replicated weights (small, blocking)
    dp_group: object = None
    ep_size: int = 1
    ep_group: object = None        # MoE dispatch / combine all-to-all (COMM ops; backward ones on its twin)
    ep_count_group: object = None  # MoE token-count exchange (moe.counts, asynchronous)
    edp_group: object = None       # expert-data-parallel: reduces expert gradients

    @classmethod
    def create(cls, tp_size: int, ep_size: int = 1) -> "ParallelLayout":
        """Build the groups on an initialized default process group (collective on all ranks)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % tp_size:
            raise ValueError(f"world size {world} is not divisible by tensor_parallel.size {tp_size}; "
                             f"valid sizes: {valid_sizes(world)}")
        layout = cls(world, rank, tp_size)
        for start in range(0, world, tp_size):  # every rank creates every group, same order
            ranks = list(range(start, start + tp_size))
            g, gg, gb = dist.new_group(ranks), dist.new_group(ranks), dist.new_group(ranks)
            if rank in ranks:
                layout.tp_group, layout.tp_grad_group = g, gg
                register_backward_group(g, gb)
        for offset in range(tp_size):
            ranks = list(range(offset, world, tp_size))
            g = dist.new_group(ranks)
            if rank in ranks:
                layout.dp_group = g
        if ep_size > 1:
            layout._create_expert_groups(ep_size)
        return layout

    def _create_expert_groups(self, ep: int) -> None:
        if self.dp_size % ep:
            raise ValueError(f"expert_parallel.size {ep} does not divide the data-parallel size {self.dp_size} "
                             f"(world {self.world_size} / tp {self.tp_size}); valid sizes: {valid_sizes(self.dp_size)}")
        from deepspeed.utils import groups as ds_groups
        self.ep_size = ep
        name = f"ep_size_{ep}"
        for t in range(self.tp_size):  # every rank creates every group, same order
            peers = list(range(t, self.world_size, self.tp_size))  # one DP group
            for start in range(0, len(peers), ep):
                ranks = peers[start:start + ep]
                g, cg, gb, cgb = (dist.new_group(ranks) for _ in range(4))
                if self.rank in ranks:
                    self.ep_group, self.ep_count_group = g, cg
                    register_backward_group(g, gb)
                    register_backward_group(cg, cgb)  # a second forward strand's counts (pair_ends)
                    ds_groups._EXPERT_PARALLEL_GROUP[name] = g
                    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ranks
            for pos in range(ep):
                ranks = peers[pos::ep]
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    self.edp_group = g
                    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = g
                    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = ranks

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep_size

    def expert_groups(self):
        """This rank's EP groups for the MoE op graph (``ds_dhelix.moe.ExpertGroups``)."""
        from .moe.dispatch import ExpertGroups
        return ExpertGroups(self.ep_size, self.ep_rank, self.ep_group, self.ep_count_group, f"ep_size_{self.ep_size}")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    # --- DeepSpeed mpu protocol -------------------------------------------------------------
    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_world_size(self):
        return self.tp_size

    def get_model_parallel_group(self):
        return self.tp_grad_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return self.dp_rank * self.tp_size

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self):
        return list(range(self.tp_rank, self.world_size, self.tp_size))

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_rank(self):
        return 0
