"""Overlap tables and the SI planner: exact DP over joint segmentations, with a brute-force reference.

An ``OverlapTable`` holds, for one layer type on one machine/shape/parallel layout, the time of each
candidate forward segment alone, each candidate backward segment alone, and each (forward, backward)
segment pair co-executed. Candidate segments are contiguous stretches of ops inside one run of
``ops.comm_runs`` (a COMM op is a segment on its own), as in the paper.

The planner walks the grid of states ``(i, j)`` = (forward ops done, backward ops done)::

    T(0, 0) = 0
    T(i', j ) <- T(i, j) + alone_f[i:i']                    forward segment alone
    T(i , j') <- T(i, j) + alone_b[j:j']                    backward segment alone
    T(i', j') <- T(i, j) + pair[(i:i'), (j:j')]             co-executed (never COMM on both sides)

and answers ``T(Nf, Nb)``: the exact optimum over every segmentation of both lists and every
interleaving, in O(Nf * Nb * moves) time. ``plan_exhaustive`` enumerates the same plans one by one
(no memoization) and is the reference the DP is tested against.

Noise: a profiled entry is the median of a few runs, and a plan that takes the minimum over
hundreds of them favours entries measured low by chance (the winner's curse). Entries carry their
run-to-run spread and sample count (``spread_ms``, ``samples``); ``plan_dp`` then prices each
entry at an upper bound of its median, ``ms + risk x standard error`` (``noise_aware``), so a
pair that only looks fast because of one lucky sample does not win, reports the plan's
prediction from the medians with its error bar (``predicted_spread_ms``), and keeps the default
plan unless the DP plan beats it by more than the noise. ``profile.profile_layer``
re-measures noisy entries and the chosen plan's own entries until the plan stops changing.

Plain data: no torch, no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..graph.ops import OpSpec, comm_runs, op_specs
from .jsonfile import check_format, ops_from_json, ops_to_json, parse_range, write_atomic
from .plan import Round, SIPlan, default_plan, segment_has_comm

Segment = tuple[int, int]  # half-open range of op indices

TABLE_FORMAT = "dhelix.overlap_table"
TABLE_VERSION = 3  # 2: entries carry spread_ms and samples; 3: the other blocks' op times (``block_ops``)
REPROFILE_HINT = "re-profile (dhelix profile ...) or use planner.profile=off"
EMPTY: Segment = (0, 0)
"""The absent side of an alone entry's key: ``(seg, EMPTY)`` forward alone, ``(EMPTY, seg)`` backward."""
NOISE_RISK = 1.0
"""Standard errors added to each entry's median in the DP's cost (about an 84% upper bound)."""
MEDIAN_SE = 1.2533
"""The standard error of a median of n normal samples is about 1.2533 x sigma / sqrt(n)."""


def candidate_segments(ops: Sequence[OpSpec]) -> list[Segment]:
    """Every contiguous stretch of ops inside one run of ``comm_runs(ops)``, in order."""
    return [
        (start, stop)
        for g0, g1 in comm_runs(tuple(ops))
        for start in range(g0, g1)
        for stop in range(start + 1, g1 + 1)
    ]


def split_at_runs(ops: Sequence[OpSpec], seg: Segment) -> list[Segment]:
    """Cut ``seg`` at run boundaries; each piece is a candidate segment."""
    return [(max(seg[0], g0), min(seg[1], g1)) for g0, g1 in comm_runs(tuple(ops)) if g0 < seg[1] and seg[0] < g1]


def op_names(ops: Sequence[OpSpec], seg: Segment) -> list[str]:
    """The names of ``ops[seg[0]:seg[1]]``."""
    return [op.name for op in ops[seg[0] : seg[1]]]


# ---- overlap table -----------------------------------------------------------------------


@dataclass
class OverlapTable:
    """Profiled times (ms) for one layer's forward and backward op lists.

    ``meta`` says what was measured (device, model shape, dtype, parallel layout, link; opaque
    key/values compared by ``check_matches``). ``fwd_alone_ms[(a, b)]`` is forward ops ``a..b-1``
    run alone, ``bwd_alone_ms`` likewise for the backward list, and ``pair_ms[((a, b), (c, d))]``
    both co-executed. Every key must be a candidate segment; a pair never has COMM on both sides.
    Missing entries are allowed: the planner just does not use them.
    """

    meta: dict
    fwd_ops: tuple[OpSpec, ...]
    bwd_ops: tuple[OpSpec, ...]
    fwd_alone_ms: dict[Segment, float] = field(default_factory=dict)
    bwd_alone_ms: dict[Segment, float] = field(default_factory=dict)
    pair_ms: dict[tuple[Segment, Segment], float] = field(default_factory=dict)
    spread_ms: dict[tuple[Segment, Segment], float] = field(default_factory=dict)
    """Run-to-run spread of an entry (robust sigma: 1.4826 x the median absolute deviation), keyed
    ``(fwd, bwd)`` with ``EMPTY`` for the absent side of an alone entry; missing: not known."""
    samples: dict[tuple[Segment, Segment], int] = field(default_factory=dict)
    """Runs each entry's median is taken over (same keys as ``spread_ms``)."""
    info: dict = field(default_factory=dict)
    """How the table was measured (repeats, re-measured entries, seconds); not compared."""
    block_ops: dict = field(default_factory=dict)
    """The embedding and head blocks' ops timed alone, one at a time (ms, median over runs):
    ``{"pre" | "post": {"ops": [names], "fwd_ms": [...], "bwd_ms": [...]}}``, backward times in
    forward op order. The planner does not use them; ``dhelix predict --hardware cpu`` does."""
    comm_cpu_ms: dict = field(default_factory=dict)
    """CPU time a collective costs beside the rank's compute thread (its process's CPU time
    while the COMM op runs alone, less the main thread's; ms, median over runs):
    ``{"fwd": [...], "bwd": [...]}`` along ``fwd_ops`` / ``bwd_ops``, None for compute ops. On a
    CPU it is what the collective takes from the cores; ``dhelix predict --hardware cpu`` reads it."""

    def __post_init__(self):
        self.fwd_ops, self.bwd_ops = tuple(self.fwd_ops), tuple(self.bwd_ops)
        fwd_cands, bwd_cands = set(candidate_segments(self.fwd_ops)), set(candidate_segments(self.bwd_ops))
        for what, entries, cands in (
            ("forward", self.fwd_alone_ms, fwd_cands),
            ("backward", self.bwd_alone_ms, bwd_cands),
        ):
            for seg, ms in entries.items():
                _check_segment(seg, cands, what)
                _check_ms(ms, f"{what} segment {seg}")
        for (fseg, bseg), ms in self.pair_ms.items():
            _check_segment(fseg, fwd_cands, "forward")
            _check_segment(bseg, bwd_cands, "backward")
            if segment_has_comm(self.fwd_ops, fseg) and segment_has_comm(self.bwd_ops, bseg):
                raise ValueError(
                    f"pair {fseg} x {bseg} communicates on both strands; such pairs are "
                    "never co-executed and must not be in the table"
                )
            _check_ms(ms, f"pair {fseg} x {bseg}")

    def entry_ms(self, key: tuple[Segment, Segment]) -> float | None:
        """The median of entry ``key`` (``(fwd, EMPTY)``, ``(EMPTY, bwd)`` or a pair), or None."""
        fseg, bseg = key
        if bseg == EMPTY:
            return self.fwd_alone_ms.get(fseg)
        if fseg == EMPTY:
            return self.bwd_alone_ms.get(bseg)
        return self.pair_ms.get(key)

    def set_entry(
        self, key: tuple[Segment, Segment], ms: float, spread: float | None = None, samples: int | None = None
    ) -> None:
        fseg, bseg = key
        if bseg == EMPTY:
            self.fwd_alone_ms[fseg] = ms
        elif fseg == EMPTY:
            self.bwd_alone_ms[bseg] = ms
        else:
            self.pair_ms[key] = ms
        if spread is not None:
            self.spread_ms[key] = spread
        if samples is not None:
            self.samples[key] = samples

    def standard_error(self, key) -> float:
        """The standard error of entry ``key``'s median (0 when its spread is not known)."""
        spread, n = self.spread_ms.get(key), self.samples.get(key)
        return MEDIAN_SE * spread / math.sqrt(n) if spread and n else 0.0

    @property
    def fused(self) -> bool:
        """Whether its ops ran as fused runs (``dhelix.fuse_ops``): ``meta["op_graph"]`` says so."""
        return str(self.meta.get("op_graph", "")).endswith("+fused")

    def check_matches(
        self, expected_meta: dict, fwd_ops: Sequence[OpSpec] | None = None, bwd_ops: Sequence[OpSpec] | None = None
    ) -> None:
        """Raise ValueError naming every key of ``expected_meta`` whose value differs in this table
        (and the op lists, when given). Keys only the table has (e.g. a date) are not compared."""
        diffs = [
            f"{key}: table has {self.meta.get(key, '<missing>')!r}, this run has {value!r}"
            for key, value in expected_meta.items()
            if self.meta.get(key, _MISSING) != value
        ]
        for what, mine, theirs in (("fwd_ops", self.fwd_ops, fwd_ops), ("bwd_ops", self.bwd_ops, bwd_ops)):
            if theirs is not None and tuple(theirs) != mine:
                diffs.append(f"{what}: table has {[o.name for o in mine]}, this run has {[o.name for o in theirs]}")
        if diffs:
            raise ValueError("overlap table does not match this run: " + "; ".join(diffs) + f". {REPROFILE_HINT}")

    # ---- JSON ----

    def _noise(self, key) -> dict:
        out = {}
        if key in self.spread_ms:
            out["spread_ms"] = self.spread_ms[key]
        if key in self.samples:
            out["samples"] = self.samples[key]
        return out

    def to_dict(self) -> dict:
        """JSON-ready dict; segments appear as ranges and as op names (for people reading it)."""

        def alone(ops, entries, key):
            return [
                {"seg": list(seg), "ops": op_names(ops, seg), "ms": ms, **self._noise(key(seg))}
                for seg, ms in sorted(entries.items())
            ]

        pairs = []
        for (fseg, bseg), ms in sorted(self.pair_ms.items()):
            entry = {
                "fwd": list(fseg),
                "bwd": list(bseg),
                "fwd_ops": op_names(self.fwd_ops, fseg),
                "bwd_ops": op_names(self.bwd_ops, bseg),
                "ms": ms,
                **self._noise((fseg, bseg)),
            }
            a, b = self.fwd_alone_ms.get(fseg), self.bwd_alone_ms.get(bseg)
            if a is not None and b is not None:  # the paper's columns, for reading only
                entry["sequential_ms"] = a + b
                entry["ratio"] = ms / (a + b) if a + b > 0 else None
            pairs.append(entry)
        return {
            "format": TABLE_FORMAT,
            "version": TABLE_VERSION,
            "meta": self.meta,
            "info": self.info,
            "fwd_ops": ops_to_json(self.fwd_ops),
            "bwd_ops": ops_to_json(self.bwd_ops),
            "fwd_alone": alone(self.fwd_ops, self.fwd_alone_ms, lambda seg: (seg, EMPTY)),
            "bwd_alone": alone(self.bwd_ops, self.bwd_alone_ms, lambda seg: (EMPTY, seg)),
            "pairs": pairs,
            "block_ops": self.block_ops,
            "comm_cpu_ms": self.comm_cpu_ms,
        }

    @classmethod
    def from_dict(cls, data: dict) -> OverlapTable:
        """Inverse of ``to_dict``; ValueError when op names disagree with the ranges."""
        check_format(data, TABLE_FORMAT, tuple(range(1, TABLE_VERSION + 1)), "overlap table")
        fwd_ops, bwd_ops = ops_from_json(data["fwd_ops"]), ops_from_json(data["bwd_ops"])

        def seg_of(entry, key, names_key, ops):
            seg = parse_range(entry[key])
            names = [op.name for op in ops[seg[0] : seg[1]]]
            if names_key in entry and list(entry[names_key]) != names:
                raise ValueError(
                    f"table entry {key}={list(seg)} names {entry[names_key]} but the op list holds {names} there"
                )
            return seg

        fwd = {seg_of(e, "seg", "ops", fwd_ops): float(e["ms"]) for e in data["fwd_alone"]}
        bwd = {seg_of(e, "seg", "ops", bwd_ops): float(e["ms"]) for e in data["bwd_alone"]}
        pairs = {
            (seg_of(e, "fwd", "fwd_ops", fwd_ops), seg_of(e, "bwd", "bwd_ops", bwd_ops)): float(e["ms"])
            for e in data["pairs"]
        }
        table = cls(
            dict(data.get("meta") or {}),
            fwd_ops,
            bwd_ops,
            fwd,
            bwd,
            pairs,
            info=dict(data.get("info") or {}),
            block_ops=_block_ops(data.get("block_ops") or {}),
            comm_cpu_ms=_comm_cpu(data.get("comm_cpu_ms") or {}, len(fwd_ops)),
        )
        keyed = [((parse_range(e["seg"]), EMPTY), e) for e in data["fwd_alone"]]
        keyed += [((EMPTY, parse_range(e["seg"])), e) for e in data["bwd_alone"]]
        keyed += [((parse_range(e["fwd"]), parse_range(e["bwd"])), e) for e in data["pairs"]]
        for key, e in keyed:
            if "spread_ms" in e:
                _check_ms(e["spread_ms"], f"spread of entry {key}")
                table.spread_ms[key] = float(e["spread_ms"])
            if "samples" in e:
                table.samples[key] = int(e["samples"])
        return table

    def save(self, path: str) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str) -> OverlapTable:
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))


_MISSING = object()


def _comm_cpu(data: dict, n: int) -> dict:
    """``comm_cpu_ms`` of a table file, checked: a value or None per op, each direction."""
    if not data:
        return {}
    if set(data) != {"fwd", "bwd"} or any(len(data[d]) != n for d in data):
        raise ValueError(f"table comm_cpu_ms: need 'fwd' and 'bwd' lists of {n} entries, got {data!r}")
    for ms in data["fwd"] + data["bwd"]:
        if ms is not None:
            _check_ms(ms, "comm_cpu_ms")
    return {d: [None if ms is None else float(ms) for ms in data[d]] for d in ("fwd", "bwd")}


def _block_ops(data: dict) -> dict:
    """``block_ops`` of a table file, checked: each block names its ops and one time per op and direction."""
    out = {}
    for name, entry in data.items():
        ops, fwd, bwd = entry.get("ops"), entry.get("fwd_ms"), entry.get("bwd_ms")
        if name not in ("pre", "post") or not ops or not (len(ops) == len(fwd or ()) == len(bwd or ())):
            raise ValueError(
                f"table block_ops[{name!r}]: need 'pre'/'post' with ops, fwd_ms and bwd_ms of equal "
                f"length, got {entry!r}"
            )
        for ms in list(fwd) + list(bwd):
            _check_ms(ms, f"block_ops[{name!r}]")
        out[name] = {"ops": list(ops), "fwd_ms": [float(x) for x in fwd], "bwd_ms": [float(x) for x in bwd]}
    return out


def _check_segment(seg, cands: set, what: str) -> None:
    if seg not in cands:
        raise ValueError(
            f"{what} segment {seg} is not a candidate segment (a contiguous stretch inside "
            "one comm run); see planner.candidate_segments"
        )


def _check_ms(ms, what: str) -> None:
    if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
        raise ValueError(f"{what}: time {ms!r} ms is not a finite number >= 0")


# ---- cost model --------------------------------------------------------------------------


def round_ms(table: OverlapTable, fwd: Segment, bwd: Segment) -> float:
    """Cost of one round under the table: the pair time, or the alone time of the non-empty side.

    An alone segment that spans several runs (as in ``sequential_plan``) costs the sum of its
    pieces cut at run boundaries: running ops alone back to back gains nothing from a barrier.
    """
    f_empty, b_empty = fwd[0] == fwd[1], bwd[0] == bwd[1]
    if not f_empty and not b_empty:
        ms = table.pair_ms.get((fwd, bwd))
        if ms is None:
            why = (
                "communicates on both strands"
                if segment_has_comm(table.fwd_ops, fwd) and segment_has_comm(table.bwd_ops, bwd)
                else "is not in the overlap table"
            )
            raise ValueError(
                f"pair forward {op_names(table.fwd_ops, fwd)} x backward {op_names(table.bwd_ops, bwd)} {why}"
            )
        return ms
    ops, entries, seg, what = (
        (table.fwd_ops, table.fwd_alone_ms, fwd, "forward")
        if b_empty
        else (table.bwd_ops, table.bwd_alone_ms, bwd, "backward")
    )
    total = 0.0
    for piece in split_at_runs(ops, seg):
        ms = entries.get(piece)
        if ms is None:
            raise ValueError(f"{what} segment {op_names(ops, piece)} alone is not in the overlap table")
        total += ms
    return total


def round_costs(table: OverlapTable, plan: SIPlan) -> list[float]:
    """The cost of each round of ``plan``; ValueError when the plan's op lists differ from the table's."""
    if plan.fwd_ops != table.fwd_ops or plan.bwd_ops != table.bwd_ops:
        raise ValueError(
            "plan and overlap table are for different op lists: plan "
            f"{[o.name for o in plan.fwd_ops]}, table {[o.name for o in table.fwd_ops]}"
        )
    return [round_ms(table, r.fwd, r.bwd) for r in plan.rounds]


def predict_ms(table: OverlapTable, plan: SIPlan) -> float:
    """Predicted makespan of ``plan``: the sum of its round costs (rounds are barrier-separated)."""
    total = 0.0
    for ms in round_costs(table, plan):
        total += ms
    return total


def round_keys(table: OverlapTable, fwd: Segment, bwd: Segment) -> list[tuple[Segment, Segment]]:
    """The table entries one round is priced from (``round_ms``): its pair, or its alone pieces."""
    if fwd[0] != fwd[1] and bwd[0] != bwd[1]:
        return [(fwd, bwd)]
    if bwd[0] == bwd[1]:
        return [(piece, EMPTY) for piece in split_at_runs(table.fwd_ops, fwd)]
    return [(EMPTY, piece) for piece in split_at_runs(table.bwd_ops, bwd)]


def plan_keys(table: OverlapTable, plan: SIPlan) -> list[tuple[Segment, Segment]]:
    """Every table entry ``plan``'s prediction uses, in round order."""
    return [k for r in plan.rounds for k in round_keys(table, r.fwd, r.bwd)]


def predicted_spread_ms(table: OverlapTable, plan: SIPlan) -> float:
    """The prediction's error bar for one run of ``plan``: the entries' run-to-run spreads added
    in quadrature (rounds are timed apart, so their noise is taken as independent)."""
    return math.sqrt(sum(table.spread_ms.get(k, 0.0) ** 2 for k in plan_keys(table, plan)))


def noise_aware(table: OverlapTable, risk: float = NOISE_RISK) -> OverlapTable:
    """The table with each entry priced at ``median + risk x standard error`` (entries without a
    known spread unchanged): what the DP minimises, so entries measured low by chance lose their edge."""

    def bump(entries, key):
        return {seg: ms + risk * table.standard_error(key(seg)) for seg, ms in entries.items()}

    return OverlapTable(
        table.meta,
        table.fwd_ops,
        table.bwd_ops,
        bump(table.fwd_alone_ms, lambda seg: (seg, EMPTY)),
        bump(table.bwd_alone_ms, lambda seg: (EMPTY, seg)),
        bump(table.pair_ms, lambda key: key),
    )


# ---- search ------------------------------------------------------------------------------

Move = tuple[int, int, float]  # (next i, next j, cost)


def _moves(table: OverlapTable) -> dict[tuple[int, int], list[Move]]:
    """For every state (i, j) that has one, the moves out of it: alone segments and table pairs."""
    nf, nb = len(table.fwd_ops), len(table.bwd_ops)
    fwd_from: dict[int, list[tuple[int, float]]] = {}
    bwd_from: dict[int, list[tuple[int, float]]] = {}
    for (a, b), ms in sorted(table.fwd_alone_ms.items()):
        fwd_from.setdefault(a, []).append((b, ms))
    for (c, d), ms in sorted(table.bwd_alone_ms.items()):
        bwd_from.setdefault(c, []).append((d, ms))
    pairs_from: dict[tuple[int, int], list[Move]] = {}
    for ((a, b), (c, d)), ms in sorted(table.pair_ms.items()):
        pairs_from.setdefault((a, c), []).append((b, d, ms))
    moves = {}
    for i in range(nf + 1):
        for j in range(nb + 1):
            out = [(b, j, ms) for b, ms in fwd_from.get(i, ())]
            out += [(i, d, ms) for d, ms in bwd_from.get(j, ())]
            out += pairs_from.get((i, j), [])
            if out:
                moves[(i, j)] = out
    return moves


def _plan_from_states(table: OverlapTable, states: list[tuple[int, int]], predicted: float, source: str) -> SIPlan:
    rounds = tuple(Round(fwd=(i, i2), bwd=(j, j2)) for (i, j), (i2, j2) in zip(states, states[1:]))
    return SIPlan(
        table.fwd_ops,
        table.bwd_ops,
        rounds,
        predicted_ms=predicted,
        source=source,
        meta={"table_meta": dict(table.meta)},
    )


def _no_plan(table: OverlapTable) -> ValueError:
    return ValueError(
        "the overlap table admits no complete plan: some op has no alone time and no "
        f"pair covering it. {REPROFILE_HINT}"
    )


def plan_dp(table: OverlapTable, risk: float = NOISE_RISK) -> SIPlan:
    """The optimal plan under ``table`` (exact DP over states (i, j), see the module docstring),
    each entry priced ``noise_aware`` with ``risk`` (0: the medians alone, and no fallback). Its
    ``predicted_ms`` is from the medians; ``meta["predicted_spread_ms"]`` is its error bar when
    spreads are known. With spreads, the default plan is kept instead (``source``
    "default-within-noise") unless the DP plan is predicted faster by more than the two plans'
    one-run spreads in quadrature. That margin is deliberately one run's noise, not the medians'
    standard errors (which shrink with samples): a plan picked from hundreds of noisy entries that
    wins by less than that has measured 7-10% slower than predicted on this machine's tiny-llama
    layer in every run, the default plan within 4% of its prediction."""
    if not (risk and table.spread_ms):
        return _plan_dp(table)
    plan = _annotated(table, _plan_dp(noise_aware(table, risk)), "dp", risk)
    try:
        default = _annotated(table, default_plan(table.fwd_ops, table.bwd_ops), "default-within-noise", risk)
    except ValueError:  # the table cannot price the default plan: nothing to fall back on
        return plan
    margin = math.hypot(plan.meta["predicted_spread_ms"], default.meta["predicted_spread_ms"])
    if default.predicted_ms - plan.predicted_ms > margin or default.fingerprint() == plan.fingerprint():
        return plan
    default.meta["dp_plan_predicted_ms"] = plan.predicted_ms
    default.meta["margin_ms"] = margin
    return default


def _annotated(table: OverlapTable, plan: SIPlan, source: str, risk: float) -> SIPlan:
    """``plan`` priced by ``table``'s medians, with its error bar."""
    return dataclasses.replace(
        plan,
        predicted_ms=predict_ms(table, plan),
        source=source,
        meta={"table_meta": dict(table.meta), "risk": risk, "predicted_spread_ms": predicted_spread_ms(table, plan)},
    )


def _plan_dp(table: OverlapTable) -> SIPlan:
    nf, nb = len(table.fwd_ops), len(table.bwd_ops)
    moves = _moves(table)
    best = [[math.inf] * (nb + 1) for _ in range(nf + 1)]
    back: dict[tuple[int, int], tuple[int, int]] = {}
    best[0][0] = 0.0
    for i in range(nf + 1):  # every move raises i or j, so row-major order is topological
        for j in range(nb + 1):
            t = best[i][j]
            if t == math.inf:
                continue
            for i2, j2, ms in moves.get((i, j), ()):
                if t + ms < best[i2][j2]:
                    best[i2][j2] = t + ms
                    back[(i2, j2)] = (i, j)
    if best[nf][nb] == math.inf:
        raise _no_plan(table)
    states = [(nf, nb)]
    while states[-1] != (0, 0):
        states.append(back[states[-1]])
    return _plan_from_states(table, states[::-1], best[nf][nb], "dp")


def count_plans(table: OverlapTable) -> int:
    """How many valid plans the table admits (exact integer)."""
    return _completions(table, _moves(table))[(0, 0)]


def _completions(table: OverlapTable, moves) -> dict[tuple[int, int], int]:
    """For each state, the number of move sequences from it to (Nf, Nb)."""
    nf, nb = len(table.fwd_ops), len(table.bwd_ops)
    ways = {(nf, nb): 1}
    for i in range(nf, -1, -1):
        for j in range(nb, -1, -1):
            if (i, j) != (nf, nb):
                ways[(i, j)] = sum(ways[(i2, j2)] for i2, j2, _ in moves.get((i, j), ()))
    return ways


EXHAUSTIVE_MAX_OPS = 12
EXHAUSTIVE_MAX_PLANS = 2_000_000


def plan_exhaustive(table: OverlapTable, max_plans: int = EXHAUSTIVE_MAX_PLANS) -> SIPlan:
    """The reference: enumerate every valid plan one by one (no memoization) and keep the cheapest.

    Written independently of ``plan_dp``: at each state it tries every candidate segment of each
    list and every pair of them, and prices each round with ``round_ms``. Refuses (ValueError) op
    lists longer than ``EXHAUSTIVE_MAX_OPS`` or tables with more than ``max_plans`` plans. Ties keep
    the first plan found.
    """
    nf, nb = len(table.fwd_ops), len(table.bwd_ops)
    if max(nf, nb) > EXHAUSTIVE_MAX_OPS:
        raise ValueError(
            f"exhaustive search refuses op lists of {nf} forward / {nb} backward ops "
            f"(limit {EXHAUSTIVE_MAX_OPS} each); use plan_dp"
        )
    num = count_plans(table)
    if num > max_plans:
        raise ValueError(f"exhaustive search refuses {num} plans (limit {max_plans}); use plan_dp")
    fwd_cands, bwd_cands = candidate_segments(table.fwd_ops), candidate_segments(table.bwd_ops)
    best_cost, best_path, path = math.inf, None, [(0, 0)]

    def steps_from(i: int, j: int):
        fwd = [seg for seg in fwd_cands if seg[0] == i]
        bwd = [seg for seg in bwd_cands if seg[0] == j]
        yield from ((f, (j, j)) for f in fwd if f in table.fwd_alone_ms)
        yield from (((i, i), b) for b in bwd if b in table.bwd_alone_ms)
        yield from ((f, b) for f in fwd for b in bwd if (f, b) in table.pair_ms)

    def visit(i: int, j: int, cost: float) -> None:
        nonlocal best_cost, best_path
        if (i, j) == (nf, nb):
            if cost < best_cost:
                best_cost, best_path = cost, list(path)
            return
        for f, b in steps_from(i, j):
            path.append((f[1], b[1]))
            visit(f[1], b[1], cost + round_ms(table, f, b))
            path.pop()

    visit(0, 0, 0.0)
    if best_path is None:
        raise _no_plan(table)
    return _plan_from_states(table, best_path, best_cost, "exhaustive")


def random_plan(table: OverlapTable, rng: random.Random) -> SIPlan:
    """A valid plan drawn uniformly at random among all ``count_plans(table)`` plans."""
    nf, nb = len(table.fwd_ops), len(table.bwd_ops)
    moves = _moves(table)
    ways = _completions(table, moves)
    if ways[(0, 0)] == 0:
        raise _no_plan(table)
    states, cost = [(0, 0)], 0.0
    while states[-1] != (nf, nb):
        pick = rng.randrange(ways[states[-1]])
        for i2, j2, ms in moves[states[-1]]:
            if pick < ways[(i2, j2)]:
                states.append((i2, j2))
                cost += ms
                break
            pick -= ways[(i2, j2)]
    return _plan_from_states(table, states, cost, "random")


# ---- synthetic tables (tests and the CLI demo; not measurements) ------------------------

# The op list of one Llama decoder layer under TP + sequence parallelism, as the Llama adapter
# (hf_models/llama.py) emits it: every TP collective is an explicit op. attn.norm is the input
# RMSNorm; mlp.norm also adds the attention residual.
LLAMA_LAYER_OPS = op_specs(
    [
        ("attn.norm", "comp"),
        ("attn.ag", "comm"),
        ("attn.qkv", "comp"),
        ("attn.core", "comp"),
        ("attn.out", "comp"),
        ("attn.rs", "comm"),
        ("mlp.norm", "comp"),
        ("mlp.ag", "comm"),
        ("mlp.up", "comp"),
        ("mlp.down", "comp"),
        ("mlp.rs", "comm"),
        ("mlp.add", "comp"),
    ]
)

# A hypothetical finer split of the same layer (no adapter emits it): separate projections, rope
# per tensor, residual split. It shows how the planner scales with longer op lists.
FINE_LAYER_OPS = op_specs(
    [
        ("attn.norm", "comp"),
        ("attn.ag", "comm"),
        ("attn.q", "comp"),
        ("attn.k", "comp"),
        ("attn.v", "comp"),
        ("attn.rope_q", "comp"),
        ("attn.rope_k", "comp"),
        ("attn.core", "comp"),
        ("attn.out", "comp"),
        ("attn.rs", "comm"),
        ("attn.add", "comp"),
        ("mlp.norm", "comp"),
        ("mlp.ag", "comm"),
        ("mlp.gate", "comp"),
        ("mlp.up", "comp"),
        ("mlp.act", "comp"),
        ("mlp.mul", "comp"),
        ("mlp.down", "comp"),
        ("mlp.rs", "comm"),
        ("mlp.add", "comp"),
    ]
)

TINY_LAYER_OPS = op_specs(
    [
        ("mlp.norm", "comp"),
        ("mlp.ag", "comm"),
        ("mlp.up", "comp"),
        ("mlp.down", "comp"),
        ("mlp.rs", "comm"),
        ("mlp.add", "comp"),
    ]
)

# Illustrative forward times (ms) for Llama-70B (h=8192, ffn=28672, 64 heads / 8 kv heads),
# seq 4096, micro-batch 1, bf16, TP=8 + SP on an NVLink node. Rough estimates, not measurements.
LLAMA70B_FWD_MS = {
    "attn.norm": 0.03,
    "attn.ag": 0.45,
    "attn.qkv": 0.16,
    "attn.core": 0.26,
    "attn.out": 0.12,
    "attn.rs": 0.45,
    "mlp.norm": 0.04,
    "mlp.ag": 0.45,
    "mlp.up": 0.85,
    "mlp.down": 0.48,
    "mlp.rs": 0.45,
    "mlp.add": 0.02,
    # the finer split's own ops
    "attn.q": 0.11,
    "attn.k": 0.025,
    "attn.v": 0.025,
    "attn.rope_q": 0.03,
    "attn.rope_k": 0.01,
    "attn.add": 0.02,
    "mlp.gate": 0.43,
    "mlp.act": 0.05,
    "mlp.mul": 0.03,
}
FINE_UP_MS = 0.43  # mlp.up of the finer split (the gate projection is its own op there)

LLAMA70B_META = {
    "device": "synthetic",
    "model": "llama-70b",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_heads": 64,
    "num_kv_heads": 8,
    "seq_len": 4096,
    "micro_batch": 1,
    "dtype": "bf16",
    "tp": 8,
    "sp": True,
    "pp": 1,
    "ep": 1,
    "link": "synthetic",
}


def synthetic_table(
    fwd_ops: Sequence[OpSpec],
    bwd_ops: Sequence[OpSpec],
    rng: random.Random,
    op_ms: dict[str, float] | None = None,
    meta: dict | None = None,
) -> OverlapTable:
    """A complete random table over all candidate segments and all allowed pairs.

    Per-op forward times come from ``op_ms`` (backward compute costs twice its forward, a COMM op
    the same) or are drawn at random. A segment alone costs the sum of its ops times a random
    factor in [0.9, 1]; a pair costs a random value between max(a, b) and a + b, so overlap helps.
    """
    fwd_ops, bwd_ops = tuple(fwd_ops), tuple(bwd_ops)

    def op_time(op: OpSpec, backward: bool) -> float:
        if op_ms is not None:
            return op_ms[op.name] * (2.0 if backward and not op.is_comm else 1.0)
        return rng.uniform(0.2, 1.5) if op.is_comm else rng.uniform(0.05, 2.0)

    def alone(ops, backward):
        times = [op_time(op, backward) for op in ops]
        return {seg: sum(times[seg[0] : seg[1]]) * rng.uniform(0.9, 1.0) for seg in candidate_segments(ops)}

    fwd_alone, bwd_alone = alone(fwd_ops, False), alone(bwd_ops, True)
    pairs = {}
    for fseg, a in fwd_alone.items():
        for bseg, b in bwd_alone.items():
            if not (segment_has_comm(fwd_ops, fseg) and segment_has_comm(bwd_ops, bseg)):
                pairs[(fseg, bseg)] = rng.uniform(max(a, b), a + b)
    return OverlapTable(dict(meta or {"device": "synthetic"}), fwd_ops, bwd_ops, fwd_alone, bwd_alone, pairs)


def llama70b_table(rng: random.Random, fine: bool = False) -> OverlapTable:
    """A synthetic table shaped like one Llama-70B decoder layer under TP=8 + SP (``fine``: the
    hypothetical finer op split)."""
    ops = FINE_LAYER_OPS if fine else LLAMA_LAYER_OPS
    op_ms = dict(LLAMA70B_FWD_MS, **({"mlp.up": FINE_UP_MS, "mlp.down": 0.43} if fine else {}))
    meta = dict(LLAMA70B_META, ops="fine" if fine else "adapter")
    return synthetic_table(ops, tuple(reversed(ops)), rng, op_ms=op_ms, meta=meta)
