"""SIPlan: how one forward op list and one backward op list are co-executed.

A plan is a list of rounds. Each round runs a contiguous forward segment ``[f0, f1)`` together
with a contiguous backward segment ``[b0, b1)`` (either may be empty). Rounds run one after another
with a barrier between them; inside a round, communication ops are launched asynchronously and the
other strand's compute runs meanwhile. The segments of all rounds cover both op lists in order::

    round  compute lane             communication lane
       0   F attn.norm              .                      <- forward compute alone
       1   B mlp.add                F attn.ag              <- F's all-gather hides under B's compute
       2   F attn.qkv..attn.out     B mlp.rs
       ── barrier between rounds; within a strand, ops run in list order ──

Plans are data: JSON round trip (``to_json``/``from_json``, ``save``/``load``), a ``fingerprint``
that all ranks compare before running, and a text timeline (``render_text``). ``sequential_plan``
and ``default_plan`` build the two fixed plans used without a profiled table.

Plain data: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..graph.ops import OpKind, OpSpec, comm_runs
from .jsonfile import check_format, ops_from_json, ops_to_json, parse_range, write_atomic

PLAN_FORMAT = "dhelix.si_plan"
PLAN_VERSION = 2
"""2: ``rounds`` (version 1 called them ``steps``; still read)."""


@dataclass(frozen=True)
class Round:
    """A forward segment and a backward segment run together, up to a barrier."""

    fwd: tuple[int, int]  # half-open index range into the forward op list
    bwd: tuple[int, int]  # half-open index range into the backward op list


def segment_has_comm(ops: Sequence[OpSpec], seg: tuple[int, int]) -> bool:
    """True when any op of ``ops[seg[0]:seg[1]]`` is a COMM op."""
    return any(op.is_comm for op in ops[seg[0] : seg[1]])


@dataclass(frozen=True)
class SIPlan:
    """Rounds over ``fwd_ops`` (forward order) and ``bwd_ops`` (backward order)."""

    fwd_ops: tuple[OpSpec, ...]
    bwd_ops: tuple[OpSpec, ...]
    rounds: tuple[Round, ...]
    predicted_ms: float | None = None
    source: str = "default"  # "default", "dp", "default-within-noise", "sequential", "random", "exhaustive"
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError unless the rounds cover both op lists contiguously and in order."""
        f = b = 0
        for k, r in enumerate(self.rounds):
            if r.fwd[0] != f or r.bwd[0] != b or r.fwd[1] < r.fwd[0] or r.bwd[1] < r.bwd[0]:
                raise ValueError(f"plan round {k} {r} does not continue at fwd={f}, bwd={b}")
            if r.fwd[0] == r.fwd[1] and r.bwd[0] == r.bwd[1]:
                raise ValueError(f"plan round {k} is empty")
            f, b = r.fwd[1], r.bwd[1]
        if f != len(self.fwd_ops) or b != len(self.bwd_ops):
            raise ValueError(f"plan covers {f}/{len(self.fwd_ops)} forward and {b}/{len(self.bwd_ops)} backward ops")

    def comm_conflicts(self) -> list[int]:
        """Indices of the rounds that communicate on both strands at once (planners avoid these)."""
        return [
            k
            for k, r in enumerate(self.rounds)
            if segment_has_comm(self.fwd_ops, r.fwd) and segment_has_comm(self.bwd_ops, r.bwd)
        ]

    # ---- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """A JSON-ready dict: op names and kinds, rounds (ranges plus their op names), annotations."""
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "fwd_ops": ops_to_json(self.fwd_ops),
            "bwd_ops": ops_to_json(self.bwd_ops),
            "rounds": [
                {
                    "fwd": list(r.fwd),
                    "bwd": list(r.bwd),
                    "fwd_ops": [op.name for op in self.fwd_ops[r.fwd[0] : r.fwd[1]]],
                    "bwd_ops": [op.name for op in self.bwd_ops[r.bwd[0] : r.bwd[1]]],
                }
                for r in self.rounds
            ],
            "predicted_ms": self.predicted_ms,
            "source": self.source,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict) -> SIPlan:
        """Inverse of ``to_dict``; ValueError on a wrong format or round op names that disagree."""
        version = check_format(data, PLAN_FORMAT, (1, PLAN_VERSION), "plan")
        fwd_ops, bwd_ops = ops_from_json(data["fwd_ops"]), ops_from_json(data["bwd_ops"])
        rounds = []
        for k, item in enumerate(data["rounds" if version >= 2 else "steps"]):
            r = Round(fwd=parse_range(item["fwd"]), bwd=parse_range(item["bwd"]))
            for key, ops, seg in (("fwd_ops", fwd_ops, r.fwd), ("bwd_ops", bwd_ops, r.bwd)):
                names = [op.name for op in ops[seg[0] : seg[1]]]
                if key in item and list(item[key]) != names:
                    raise ValueError(
                        f"plan round {k}: {key} {item[key]} disagree with range {list(seg)} which holds {names}"
                    )
            rounds.append(r)
        predicted = data.get("predicted_ms")
        return cls(
            fwd_ops,
            bwd_ops,
            tuple(rounds),
            predicted_ms=None if predicted is None else float(predicted),
            source=data.get("source", "default"),
            meta=dict(data.get("meta") or {}),
        )

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> SIPlan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        """Write the plan as JSON atomically (a crash never leaves half a file)."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> SIPlan:
        with open(path, encoding="utf-8") as fh:
            return cls.from_json(fh.read())

    def fingerprint(self) -> str:
        """sha256 (hex) over what runs: op names, kinds and the rounds' ranges.

        ``predicted_ms``, ``source`` and ``meta`` are annotations and do not change it, so two ranks
        that must issue the same collectives in the same order compare exactly what matters.
        """
        content = {
            "fwd_ops": ops_to_json(self.fwd_ops),
            "bwd_ops": ops_to_json(self.bwd_ops),
            "rounds": [[*r.fwd, *r.bwd] for r in self.rounds],
        }
        blob = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    # ---- text timeline --------------------------------------------------------------------

    def render_text(self, round_ms: Sequence[float] | None = None) -> str:
        """One row per round with a compute lane and a communication lane.

        Forward-strand ops are tagged ``F``, backward-strand ops ``B``; ``.`` marks an idle lane.
        ``round_ms`` (one number per round, e.g. from ``planner.round_costs``) adds a time column.
        """
        if round_ms is not None and len(round_ms) != len(self.rounds):
            raise ValueError(f"round_ms has {len(round_ms)} values for {len(self.rounds)} rounds")
        rows = []
        for r in self.rounds:
            lanes = {OpKind.COMP: [], OpKind.COMM: []}
            for tag, ops, seg in (("F", self.fwd_ops, r.fwd), ("B", self.bwd_ops, r.bwd)):
                for kind in lanes:
                    names = [op.name for op in ops[seg[0] : seg[1]] if op.kind is kind]
                    if names:
                        lanes[kind].append(f"{tag} " + " ".join(names))
            rows.append((" | ".join(lanes[OpKind.COMP]) or ".", " | ".join(lanes[OpKind.COMM]) or "."))
        width = max([len("compute lane")] + [len(r[0]) for r in rows])
        ms_head = "        ms" if round_ms is not None else ""
        head = (
            f"SIPlan source={self.source} rounds={len(self.rounds)} "
            f"predicted_ms={_fmt_ms(self.predicted_ms)} fingerprint={self.fingerprint()[:12]}"
        )
        lines = [head, f"round{ms_head}  {'compute lane':<{width}}  communication lane"]
        for k, (comp, comm) in enumerate(rows):
            ms = f"  {round_ms[k]:8.3f}" if round_ms is not None else ""
            lines.append(f"{k:5d}{ms}  {comp:<{width}}  {comm}")
        return "\n".join(lines)


def sequential_plan(fwd_ops: Sequence[OpSpec], bwd_ops: Sequence[OpSpec]) -> SIPlan:
    """No co-execution: one round with the whole forward list, then one with the whole backward list."""
    fwd_ops, bwd_ops = tuple(fwd_ops), tuple(bwd_ops)
    nf, nb = len(fwd_ops), len(bwd_ops)
    rounds = []
    if nf:
        rounds.append(Round(fwd=(0, nf), bwd=(0, 0)))
    if nb:
        rounds.append(Round(fwd=(nf, nf), bwd=(0, nb)))
    return SIPlan(fwd_ops, bwd_ops, tuple(rounds), source="sequential")


def default_plan(fwd_ops: Sequence[OpSpec], bwd_ops: Sequence[OpSpec]) -> SIPlan:
    """The fixed plan used before any profiling: hide each COMM op under the other strand's compute.

    Both lists are cut into the runs of ``comm_runs`` (each COMM op alone, each stretch of COMP ops
    between them one run) and walked head by head. Pairing rule, at each round:

    * heads of different kinds (one COMM, one COMP run): pair them -- the communication of one
      strand runs under a whole compute run of the other (e.g. forward ``attn.ag`` with the
      backward ``mlp.add`` run, backward ``mlp.rs`` with the forward ``attn.qkv..attn.out`` run);
    * heads of the same kind (both compute, or both COMM): run the forward head alone. This shifts the
      strands by half a phase, so the next heads differ in kind and pair again. A layer's backward
      list is its forward list reversed, so after one such shift every COMM op finds compute;
    * one list exhausted: the rest of the other list runs alone.

    Consecutive alone rounds of the same strand merge into one round. No round communicates on
    both strands; every op is covered once, in order.
    """
    fwd_ops, bwd_ops = tuple(fwd_ops), tuple(bwd_ops)
    fg, bg = comm_runs(fwd_ops), comm_runs(bwd_ops)
    p = q = 0
    rounds: list[Round] = []
    while p < len(fg) or q < len(bg):
        f = fg[p] if p < len(fg) else None
        b = bg[q] if q < len(bg) else None
        if f and b and segment_has_comm(fwd_ops, f) != segment_has_comm(bwd_ops, b):
            rounds.append(Round(fwd=f, bwd=b))
            p, q = p + 1, q + 1
        elif f:
            at = b[0] if b else len(bwd_ops)
            _append_alone(rounds, Round(fwd=f, bwd=(at, at)))
            p += 1
        else:
            at = len(fwd_ops)
            _append_alone(rounds, Round(fwd=(at, at), bwd=b))
            q += 1
    return SIPlan(fwd_ops, bwd_ops, tuple(rounds), source="default")


def _append_alone(rounds: list[Round], new: Round) -> None:
    """Append an alone round, merging it into the previous round if that ran the same strand alone."""
    if rounds:
        last = rounds[-1]
        fwd_alone = last.bwd[0] == last.bwd[1] and new.bwd[0] == new.bwd[1]
        bwd_alone = last.fwd[0] == last.fwd[1] and new.fwd[0] == new.fwd[1]
        if fwd_alone and last.fwd[1] == new.fwd[0] and last.bwd == new.bwd:
            rounds[-1] = Round(fwd=(last.fwd[0], new.fwd[1]), bwd=last.bwd)
            return
        if bwd_alone and last.bwd[1] == new.bwd[0] and last.fwd == new.fwd:
            rounds[-1] = Round(fwd=last.fwd, bwd=(last.bwd[0], new.bwd[1]))
            return
    rounds.append(new)


def _fmt_ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.3f}"
