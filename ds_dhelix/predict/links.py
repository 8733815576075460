"""Collectives on GPUs: which ranks each group holds (the rank order ``ParallelDims`` uses, TP
innermost, the pipeline outermost), which link its traffic crosses, and an alpha-beta time.

A group inside one node runs at the intra-node link's rate (NVLink or PCIe). A group spanning
nodes crosses the network: every GPU of a node communicates at once (SPMD), so a group with k
ranks on a node gets k / (GPUs per node) of the node's network ports; a ring runs at its slowest
hop. With n ranks, S bytes::

    all-gather, reduce-scatter  alpha(n - 1 steps) + (n-1)/n S / bw
    all-reduce                  alpha(2(n - 1) steps) + 2(n-1)/n S / bw
    all-to-all                  alpha(1 step) + max(on-node part / intra bw, off-node part / network share)
    p2p                         alpha(1 step) + S / bw

alpha: NCCL's own latency model (base + a hop latency per ring step by the link crossed); bw: the
nominal rate times ``link_efficiency``. Plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.dims import ParallelDims
from .hardware import Hardware

GROUP_KINDS = ("tp", "cp", "ep", "replica", "edp", "pp")


def group_ranks(dims: ParallelDims, kind: str) -> list[list[int]]:
    """Every group of ``kind``: "tp", "cp", "ep" (runs of ``ep`` consecutive DP peers), "replica"
    (DP x CP: the ranks holding the same dense weights), "edp" (expert data parallel, with the CP
    ranks), "pp" (neighbouring stages' peers)."""
    r, out = dims.rank_of, []
    for st in range(dims.pp):
        for d in range(dims.dp):
            for c in range(dims.cp):
                if kind == "tp":
                    out.append([r(st, d, c, t) for t in range(dims.tp)])
                if kind == "pp" and st + 1 < dims.pp:
                    out += [[r(st, d, c, t), r(st + 1, d, c, t)] for t in range(dims.tp)]
        for t in range(dims.tp):
            out += _data_groups(dims, kind, st, t)
    return out


def _data_groups(dims: ParallelDims, kind: str, st: int, t: int) -> list[list[int]]:
    r, out = dims.rank_of, []
    if kind == "cp":
        out += [[r(st, d, c, t) for c in range(dims.cp)] for d in range(dims.dp)]
    if kind == "replica":
        out.append([r(st, d, c, t) for d in range(dims.dp) for c in range(dims.cp)])
    for c in range(dims.cp):
        if kind == "ep":
            out += [[r(st, d, c, t) for d in range(k * dims.ep, (k + 1) * dims.ep)] for k in range(dims.dp // dims.ep)]
    if kind == "edp":
        out += [[r(st, d, c, t) for d in range(j, dims.dp, dims.ep) for c in range(dims.cp)] for j in range(dims.ep)]
    return out


@dataclass(frozen=True)
class Placement:
    """How a group of ``size`` ranks sits: on ``nodes`` nodes, at most ``per_node`` on one."""

    size: int
    nodes: int
    per_node: int

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def placement(dims: ParallelDims, kind: str, gpus_per_node: int) -> Placement:
    """The worst-placed group of ``kind`` (most nodes spanned): it sets the pace of the collective."""
    groups = group_ranks(dims, kind) or [[0]]
    worst = None
    for ranks in groups:
        nodes = {rank // gpus_per_node for rank in ranks}
        per_node = max(sum(1 for rank in ranks if rank // gpus_per_node == n) for n in nodes)
        p = Placement(len(ranks), len(nodes), per_node)
        if worst is None or (p.nodes, -p.per_node) > (worst.nodes, -worst.per_node):
            worst = p
    return worst


def _rates(hw: Hardware, p: Placement) -> tuple[float, float]:
    """(intra-node bytes/s, this group's network share in bytes/s) after efficiency."""
    eff = hw.assumptions.link_efficiency
    intra = hw.intra_link.gbs * 1e9 * eff
    net = hw.node_network_bps * eff * p.per_node / hw.gpus_per_node
    return intra, net


def _alpha_us(hw: Hardware, p: Placement, steps: int, inter_steps: int) -> float:
    a = hw.assumptions
    return (
        a.nccl_base_us + (steps - inter_steps) * a.nccl_hop_us[hw.intra_link.kind] + inter_steps * a.nccl_hop_us["net"]
    )


def collective_ms(hw: Hardware, p: Placement, kind: str, nbytes: float) -> float:
    """Time of one collective of ``kind`` over a group placed as ``p`` (see the module docstring)."""
    n = p.size
    if n <= 1:
        return 0.0
    intra, net = _rates(hw, p)
    ring_bw = min(intra, net) if p.crosses_nodes else intra
    inter = p.nodes - 1 if p.crosses_nodes else 0
    if kind in ("all_gather", "reduce_scatter"):
        secs = (n - 1) / n * nbytes / ring_bw + _alpha_us(hw, p, n - 1, inter) * 1e-6
    elif kind == "all_reduce":
        secs = 2 * (n - 1) / n * nbytes / ring_bw + _alpha_us(hw, p, 2 * (n - 1), 2 * inter) * 1e-6
    elif kind == "all_to_all":
        local = (p.per_node - 1) / n * nbytes / intra
        remote = (n - p.per_node) / n * nbytes * p.per_node / net if p.crosses_nodes else 0.0
        secs = max(local, remote) + _alpha_us(hw, p, 1, int(p.crosses_nodes)) * 1e-6
    elif kind == "p2p":
        secs = nbytes / ring_bw + _alpha_us(hw, p, 1, int(p.crosses_nodes)) * 1e-6
    else:
        raise ValueError(f"unknown collective {kind!r}")
    return secs * 1e3
