"""``ParallelDims``: every parallel degree of a run, and every check that the degrees fit the world
and the model, in one place.

    world = pp x dp x cp x tp      rank = ((stage * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    ep shards the experts inside the data-parallel group (ep divides dp)

Tensor parallelism is innermost (TP groups are consecutive ranks), the pipeline outermost, as
DeepSpeed's pipe x data x model topology orders them. ``cp`` (context parallelism) has its place
in the rank order but no implementation yet: it must be 1.

Plain data: no torch.distributed. ``ProcessGroups.create(dims)`` (``groups.py``) builds the groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


class RankCoords(NamedTuple):
    """Where one rank sits: pipeline stage, data-parallel, context-parallel and TP rank."""

    stage: int
    dp_rank: int
    cp_rank: int
    tp_rank: int


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a run; ``ValueError`` naming the sizes and the valid choices when they do not
    fit together. ``dp`` is derived: world / (pp x cp x tp)."""

    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in ("world", "tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel size {name} must be a positive integer, got {value!r}")
        if self.cp != 1:
            raise ValueError(f"context parallel size {self.cp}: context parallelism is not available yet; use 1")
        model = self.tp * self.pp * self.cp
        if self.world % model:
            raise ValueError(f"world size {self.world} is not divisible by tensor_parallel.size {self.tp} x "
                             f"pipeline.stages {self.pp} = {model}; tp x pp must be one of "
                             f"{divisors(self.world)}")
        if self.dp % self.ep:
            raise ValueError(f"expert_parallel.size {self.ep} does not divide the data-parallel size {self.dp} "
                             f"(world {self.world} / tp {self.tp} / pp {self.pp}; experts are sharded inside "
                             f"the data-parallel group); valid ep sizes: {divisors(self.dp)}")

    @classmethod
    def from_config(cls, dh, world: int) -> "ParallelDims":
        """The degrees a ``DhelixConfig`` asks for on ``world`` ranks (a disabled section: pure DP)."""
        if not dh.enabled:
            return cls(world)
        return cls(world, tp=dh.tensor_parallel.size, pp=dh.pipeline.stages, ep=dh.expert_parallel.size)

    @property
    def dp(self) -> int:
        """Data-parallel size: replicas of the dense parameters."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert shard (DeepSpeed's definition)."""
        return self.dp // self.ep

    def coords(self, rank: int) -> RankCoords:
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        return RankCoords(rank // (self.tp * self.cp * self.dp), dp_rank, cp_rank, tp_rank)

    def rank_of(self, stage: int, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        return ((stage * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def check_model(self, model_config):
        """TP must divide the attention heads, KV heads and MLP width; EP the experts (and the DP
        size); an EP size needs a model with experts. ``ValueError`` naming the values and the
        valid sizes, before any model is built. Returns the model's adapter."""
        from hf_models.adapters import adapter_for
        adapter = adapter_for(model_config)
        adapter.check_tp(model_config, self.tp)
        if hasattr(adapter, "check_ep"):
            adapter.check_ep(model_config, self.ep, self.dp)
        elif self.ep > 1:
            raise ValueError(f"expert_parallel.size {self.ep}: model_type {model_config.model_type!r} has no "
                             f"experts; use 1 (or an MoE model, e.g. tiny-phimoe)")
        return adapter

    def describe(self) -> str:
        return f"world={self.world} dp={self.dp} tp={self.tp} pp={self.pp} ep={self.ep}"
