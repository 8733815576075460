"""``ParallelDims``: every parallel degree of a run, and every check that the degrees fit the world
and the model, in one place.

    world = pp x dp x cp x tp      rank = ((stage * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    ep shards the experts inside the data-parallel group (ep divides dp)

Tensor parallelism is innermost (TP groups are consecutive ranks), the pipeline outermost, as
DeepSpeed's pipe x data x model topology orders them. Context parallelism (``cp``) shards each
sequence further: a CP group holds one data-parallel replica's sequence, ``cp`` consecutive TP
groups; the weights are replicated over DP x CP (DeepSpeed reduces gradients over both).

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
    cp_comm: str = "ulysses"  # context parallelism's exchange: "ulysses" (all-to-alls) or "ring"

    def __post_init__(self):
        for name in ("world", "tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel size {name} must be a positive integer, got {value!r}")
        model = self.tp * self.pp * self.cp
        if self.world % model:
            cp = f" x context_parallel.size {self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"world size {self.world} is not divisible by tensor_parallel.size {self.tp} x "
                f"pipeline.stages {self.pp}{cp} = {model}; tp x pp{' x cp' if cp else ''} must be "
                f"one of {divisors(self.world)}"
            )
        if self.cp_comm not in ("ulysses", "ring"):
            raise ValueError(f"context_parallel.comm {self.cp_comm!r}: choose ulysses or ring")
        if self.dp % self.ep:
            raise ValueError(
                f"expert_parallel.size {self.ep} does not divide the data-parallel size {self.dp} "
                f"(world {self.world} / tp {self.tp} / pp {self.pp}; experts are sharded inside "
                f"the data-parallel group); valid ep sizes: {divisors(self.dp)}"
            )

    @classmethod
    def from_config(cls, dh, world: int) -> ParallelDims:
        """The degrees a ``DhelixConfig`` asks for on ``world`` ranks (a disabled section: pure DP)."""
        if not dh.enabled:
            return cls(world)
        return cls(
            world,
            tp=dh.tensor_parallel.size,
            pp=dh.pipeline.stages,
            ep=dh.expert_parallel.size,
            cp=dh.context_parallel.size,
            cp_comm=dh.context_parallel.comm,
        )

    @property
    def dp(self) -> int:
        """Data-parallel size: replicas of the dense parameters."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def shards(self) -> int:
        """Sequence shards of one micro-batch: tp x cp (a rank holds 1/shards of every sequence)."""
        return self.tp * self.cp

    @property
    def seq_multiple(self) -> int:
        """What every sequence length must divide by: the shards, and with ring attention twice
        that (each CP rank holds two chunks of the zig-zag split, each cut by TP)."""
        return self.shards * (2 if self.cp > 1 and self.cp_comm == "ring" else 1)

    def check_seq_len(self, seq_len: int, what: str = "sequence length") -> None:
        """``ValueError`` naming the sizes when ``seq_len`` does not split over the shards."""
        m = self.seq_multiple
        if seq_len % m == 0:
            return
        if self.cp == 1:
            how = f"tensor_parallel.size {self.tp}"
        elif self.cp_comm == "ring":
            how = (
                f"2 x tensor_parallel.size {self.tp} x context_parallel.size {self.cp} = {m} (ring attention's "
                f"zig-zag split: {2 * self.cp} chunks, each cut by TP)"
            )
        else:
            how = f"tensor_parallel.size {self.tp} x context_parallel.size {self.cp} = {m}"
        raise ValueError(
            f"{what} {seq_len} is not divisible by {how}; use a multiple of {m} (e.g. {max(m, round(seq_len / m) * m)})"
        )

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

    def describe(self) -> str:
        cp = f" cp={self.cp}" + (" (ring)" if self.cp_comm == "ring" else "") if self.cp > 1 else ""
        return f"world={self.world} dp={self.dp} tp={self.tp}{cp} pp={self.pp} ep={self.ep}"


def check_cp_heads(model_config, tp: int, cp: int) -> None:
    """Ulysses gives each of the tp x cp ranks of a sequence whole query heads, and each query-head
    group its kv heads (``nk/cp`` of a TP rank's ``nk``, or the one head it shares when ``cp`` is a
    multiple of ``nk``): ``ValueError`` naming the head counts that do not fit and the
    context-parallel sizes that would."""
    heads = model_config.num_attention_heads
    kv = getattr(model_config, "num_key_value_heads", None) or heads

    def fits(c: int) -> bool:
        nk = max(kv // tp, 1)  # TP > kv heads: each TP rank holds one replicated kv head
        return heads % (tp * c) == 0 and (nk % c == 0 or c % nk == 0)

    if not fits(cp):
        valid = [c for c in divisors(heads // tp) if fits(c)]
        raise ValueError(
            f"context_parallel.size {cp} with tensor_parallel.size {tp}: num_attention_heads={heads}, "
            f"num_key_value_heads={kv} do not split into {cp} whole query-head groups per TP rank "
            f"(each with kv heads {max(kv // tp, 1)} / {cp} or one shared head); valid context_parallel.size "
            f"with tensor_parallel.size {tp}: {valid}; or context_parallel.comm 'ring' (no head "
            f"condition beyond TP's)"
        )
