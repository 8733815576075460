"""``ProcessGroups``: this rank's process groups for a ``ParallelDims`` layout.

Ranks are laid out TP-innermost (``dims.py``): with TP=2 and 4 ranks, TP groups are {0,1} and
{2,3}, DP groups {0,2} and {1,3}. Expert parallelism (EP) shards experts inside each DP group,
DeepSpeed's way: EP groups are runs of ``ep`` consecutive DP peers, expert-data-parallel (EDP)
groups the strided rest (TP=1, 4 ranks, EP=2: EP {0,1} {2,3}, EDP {0,2} {1,3}); they are
registered in ``deepspeed.utils.groups`` under ``ep_size_<ep>`` so ZeRO reduces expert gradients
over EDP; with context parallelism an EDP group spans the CP ranks too. With a pipeline, stage s
holds ranks ``[s*dp*cp*tp, (s+1)*dp*cp*tp)`` and DeepSpeed's own grid (built from ``topology``,
data axis DP x CP) provides the data and pipe groups its engine uses.

The op graph's collectives get ``StrandGroups`` (two groups over the same ranks, one per strand
of a pair: ``tp``, ``ep``, ``ep_counts``); the small blocking reductions get plain groups of their
own (``tp_grad_group``, ``dp_group``, ``edp_group``). For one stage ``ProcessGroups`` also answers
DeepSpeed's ``mpu`` protocol, so DeepSpeed reduces gradients over the DP group only (DP x CP with
context parallelism) and computes the global grad norm over the TP group.

With context parallelism (``cp`` > 1, TP=2, CP=2, 4 ranks): TP groups {0,1} {2,3}, CP groups
{0,2} {1,3} (``cp``, ``cp_group``), DP x CP groups {0,2} {1,3} (``replica_group``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..config.dims import ParallelDims
from .comm import StrandGroups


@dataclass(frozen=True)
class ContextShards:
    """Context parallelism of a graph: ``size`` CP ranks per sequence, this rank's ``rank`` among
    them, ``groups`` (``StrandGroups``) for the Ulysses all-to-alls, ``sequence_group`` the TP x CP
    ranks of one sequence (the MoE load-balancing sums), ``comm`` the exchange ("ulysses" or
    "ring"). With Ulysses a rank's sequence shard is number ``rank * tp + tp_rank`` of ``size * tp``
    contiguous shards; with ring attention see ``make_side_fn``."""

    size: int
    rank: int
    groups: object
    sequence_group: object = None
    comm: str = "ulysses"


@dataclass
class ExpertGroups:
    """This rank's expert-parallel groups (``ProcessGroups.expert_groups()`` builds it); a plain
    process group given for ``group`` / ``count_group`` serves both channels."""

    size: int = 1
    rank: int = 0
    group: object = None  # dispatch / combine all-to-all (StrandGroups)
    count_group: object = None  # token-count exchange (moe.counts; small, forward only; StrandGroups)
    name: str = "ep_size_1"  # DeepSpeed's expert group name (param.group_name)

    def __post_init__(self):
        self.group, self.count_group = StrandGroups.of(self.group), StrandGroups.of(self.count_group)


def expert_group_name(ep: int) -> str:
    """DeepSpeed's name of the expert-parallel groups of size ``ep`` (``param.group_name``)."""
    return f"ep_size_{ep}"


def _strand_groups(ranks: list[int]) -> StrandGroups:
    return StrandGroups(dist.new_group(ranks), dist.new_group(ranks))


@dataclass
class ProcessGroups:
    dims: ParallelDims
    rank: int
    tp: StrandGroups | None = None  # TP/SP collectives of the op graph (COMM ops)
    tp_grad_group: object = None  # gradient all-reduce of TP-replicated weights (small, blocking)
    dp_group: object = None
    ep: StrandGroups | None = None  # MoE dispatch / combine all-to-alls (COMM ops)
    ep_counts: StrandGroups | None = None  # MoE token-count exchange (moe.counts, asynchronous)
    edp_group: object = None  # expert-data-parallel: reduces expert gradients
    p2p_group: object = None  # pipeline sends and receives (pp > 1)
    topology: object = None  # DeepSpeed's pipe x data x model topology (pp > 1)
    cp: StrandGroups | None = None  # CP exchanges of the op graph: all-to-alls or ring steps (cp > 1)
    cp_group: object = None  # the loss sum over a sequence's CP shards (cp > 1)
    replica_group: object = None  # DP x CP: ranks holding the same weights (cp > 1)
    sequence_group: object = None  # TP x CP: the ranks of one sequence (MoE aux loss; cp > 1)

    @classmethod
    def create(cls, dims: ParallelDims) -> ProcessGroups:
        """Build the groups on an initialized default process group (collective on all ranks:
        every rank creates every group, in the same order)."""
        if dist.get_world_size() != dims.world:
            raise ValueError(
                f"the parallel layout is for {dims.world} ranks but torch.distributed has {dist.get_world_size()}"
            )
        out = cls(dims, dist.get_rank())
        me = dims.coords(out.rank)
        for stage in range(dims.pp):
            for d in range(dims.dp):
                for c in range(dims.cp):
                    ranks = [dims.rank_of(stage, d, c, t) for t in range(dims.tp)]
                    tp, grad = _strand_groups(ranks), dist.new_group(ranks)
                    if (stage, d, c) == (me.stage, me.dp_rank, me.cp_rank):
                        out.tp, out.tp_grad_group = tp, grad
            for c in range(dims.cp):
                for t in range(dims.tp):
                    ranks = [dims.rank_of(stage, d, c, t) for d in range(dims.dp)]
                    g = dist.new_group(ranks)
                    if (stage, c, t) == (me.stage, me.cp_rank, me.tp_rank):
                        out.dp_group = g
                    if dims.ep > 1:
                        out._create_expert_groups(ranks, stage, t)
            if dims.ep > 1:
                out._create_expert_data_groups(stage)
            if dims.cp > 1:
                out._create_context_groups(stage, me)
        if dims.pp > 1:
            from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

            out.p2p_group = dist.new_group(list(range(dims.world)))
            # DeepSpeed's data axis is DP x CP (the ranks holding the same weights): its rank order
            # ((stage * dp + d) * cp + c) * tp + t is ours
            out.topology = PipeModelDataParallelTopology(dims.pp, dims.tp, dims.dp * dims.cp)
        return out

    def _create_context_groups(self, stage: int, me) -> None:
        """CP groups (one sequence's CP shards: the CP exchanges, the loss sum), the DP x CP
        groups the weights are replicated over (DeepSpeed's data-parallel group) and the TP x CP
        groups of every shard of one sequence."""
        dims = self.dims
        for d in range(dims.dp):
            for t in range(dims.tp):
                ranks = [dims.rank_of(stage, d, c, t) for c in range(dims.cp)]
                cp, plain = _strand_groups(ranks), dist.new_group(ranks)
                if (stage, d, t) == (me.stage, me.dp_rank, me.tp_rank):
                    self.cp, self.cp_group = cp, plain
        for t in range(dims.tp):
            ranks = [dims.rank_of(stage, d, c, t) for d in range(dims.dp) for c in range(dims.cp)]
            g = dist.new_group(ranks)
            if (stage, t) == (me.stage, me.tp_rank):
                self.replica_group = g
        for d in range(dims.dp):
            ranks = [dims.rank_of(stage, d, c, t) for c in range(dims.cp) for t in range(dims.tp)]
            g = dist.new_group(ranks)
            if (stage, d) == (me.stage, me.dp_rank):
                self.sequence_group = g

    def _create_expert_groups(self, peers: list[int], stage: int, tp_rank: int) -> None:
        """EP groups inside one DP group ``peers`` (one CP rank's: each CP rank dispatches its own
        tokens to the experts of its EP group)."""
        from deepspeed.utils import groups as ds_groups

        ep = self.dims.ep
        name = expert_group_name(ep)
        for start in range(0, len(peers), ep):
            ranks = peers[start : start + ep]
            group, counts = _strand_groups(ranks), _strand_groups(ranks)
            if self.rank in ranks:
                self.ep, self.ep_counts = group, counts
                ds_groups._EXPERT_PARALLEL_GROUP[name] = group.forward
                ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ranks

    def _create_expert_data_groups(self, stage: int) -> None:
        """EDP groups: the ranks holding the same experts, EP rank ``pos`` of every EP group of
        the stage's DP groups at one TP rank, over every CP rank (an expert's replicas over CP
        each hold their sequence shard's share of its gradient, as the dense weights do over DP x
        CP). DeepSpeed reduces expert gradients over them."""
        from deepspeed.utils import groups as ds_groups

        dims, me = self.dims, self.dims.coords(self.rank)
        name = expert_group_name(dims.ep)
        for t in range(dims.tp):
            for pos in range(dims.ep):
                ranks = [dims.rank_of(stage, d, c, t) for d in range(pos, dims.dp, dims.ep) for c in range(dims.cp)]
                g = dist.new_group(sorted(ranks))
                if (stage, t) == (me.stage, me.tp_rank) and self.rank in ranks:
                    self.edp_group = g
                    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = g
                    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = sorted(ranks)

    # --- coordinates ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dims.world

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        return self.dims.coords(self.rank).cp_rank

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def tp_rank(self) -> int:
        return self.dims.coords(self.rank).tp_rank

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank).dp_rank

    @property
    def stage(self) -> int:
        return self.dims.coords(self.rank).stage

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.dims.ep

    def context_shards(self):
        """This rank's context parallelism for the op graph (``ContextShards``), None without it."""
        if self.dims.cp == 1:
            return None
        return ContextShards(self.dims.cp, self.cp_rank, self.cp, self.sequence_group, self.dims.cp_comm)

    def expert_groups(self):
        """This rank's EP groups for the MoE op graph (``ExpertGroups``)."""
        ep = self.dims.ep
        return ExpertGroups(ep, self.ep_rank, self.ep, self.ep_counts, expert_group_name(ep))

    # --- DeepSpeed mpu protocol (one stage) ----------------------------------------------------
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
        return self.rank - self.tp_rank

    # DeepSpeed's data-parallel group is every rank holding the same weights: DP x CP (with CP,
    # each CP rank's gradient is its sequence shard's share; the engine seeds the loss times cp,
    # so DeepSpeed's mean over DP x CP is the sum over CP and the mean over DP)
    def get_data_parallel_rank(self):
        return self.dp_rank * self.dims.cp + self.cp_rank

    def get_data_parallel_world_size(self):
        return self.dp_size * self.dims.cp

    def get_data_parallel_group(self):
        return self.replica_group if self.dims.cp > 1 else self.dp_group

    def get_data_parallel_group_ranks(self):
        me = self.dims.coords(self.rank)
        return [self.dims.rank_of(me.stage, d, c, me.tp_rank) for d in range(self.dp_size) for c in range(self.dims.cp)]

    def get_pipeline_model_parallel_world_size(self):
        return self.dims.pp

    def get_pipeline_model_parallel_rank(self):
        return self.stage
