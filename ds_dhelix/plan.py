"""SIPlan: how one forward op list and one backward op list are co-executed.

A plan is a list of steps. Each step pairs a contiguous forward segment ``[f0, f1)`` with a
contiguous backward segment ``[b0, b1)`` (either may be empty). Steps run one after another with a
barrier between them; inside a step, communication ops are launched asynchronously and the other
strand's compute runs meanwhile. The segments of all steps cover both op lists in order::

    step   compute lane             communication lane
       0   F attn.norm              .                      <- forward compute alone
       1   B mlp.add                F attn.ag              <- F's all-gather hides under B's compute
       2   F attn.qkv..attn.out     B mlp.rs
       ── barrier between steps; within a strand, ops run in list order ──

Plans are data: JSON round trip (``to_json``/``from_json``, ``save``/``load``), a ``fingerprint``
that all ranks compare before running, and a text timeline (``render_text``). ``sequential_plan``
and ``default_plan`` build the two fixed plans used without a profiled table.

Plain data: no torch.distributed, no deepspeed.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Sequence

from .ops import OpKind, OpSpec, comm_groups

PLAN_FORMAT = "dhelix.si_plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class PlanStep:
    fwd: tuple[int, int]  # half-open index range into the forward op list
    bwd: tuple[int, int]  # half-open index range into the backward op list


def segment_has_comm(ops: Sequence[OpSpec], seg: tuple[int, int]) -> bool:
    """True when any op of ``ops[seg[0]:seg[1]]`` is a COMM op."""
    return any(op.is_comm for op in ops[seg[0]:seg[1]])


@dataclass(frozen=True)
class SIPlan:
    """Steps over ``fwd_ops`` (forward order) and ``bwd_ops`` (backward order)."""

    fwd_ops: tuple[OpSpec, ...]
    bwd_ops: tuple[OpSpec, ...]
    steps: tuple[PlanStep, ...]
    predicted_ms: float | None = None
    source: str = "default"  # "default", "dp", "sequential", "random", "exhaustive"
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError unless the steps cover both op lists contiguously and in order."""
        f = b = 0
        for k, st in enumerate(self.steps):
            if st.fwd[0] != f or st.bwd[0] != b or st.fwd[1] < st.fwd[0] or st.bwd[1] < st.bwd[0]:
                raise ValueError(f"plan step {k} {st} does not continue at fwd={f}, bwd={b}")
            if st.fwd[0] == st.fwd[1] and st.bwd[0] == st.bwd[1]:
                raise ValueError(f"plan step {k} is empty")
            f, b = st.fwd[1], st.bwd[1]
        if f != len(self.fwd_ops) or b != len(self.bwd_ops):
            raise ValueError(
                f"plan covers {f}/{len(self.fwd_ops)} forward and {b}/{len(self.bwd_ops)} backward ops")

    def comm_conflicts(self) -> list[int]:
        """Indices of the steps that communicate on both strands at once (planners avoid these)."""
        return [k for k, st in enumerate(self.steps)
                if segment_has_comm(self.fwd_ops, st.fwd) and segment_has_comm(self.bwd_ops, st.bwd)]

    # ---- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """A JSON-ready dict: op names and kinds, steps (ranges plus their op names), annotations."""
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "fwd_ops": _ops_to_json(self.fwd_ops),
            "bwd_ops": _ops_to_json(self.bwd_ops),
            "steps": [{"fwd": list(st.fwd), "bwd": list(st.bwd),
                       "fwd_ops": [op.name for op in self.fwd_ops[st.fwd[0]:st.fwd[1]]],
                       "bwd_ops": [op.name for op in self.bwd_ops[st.bwd[0]:st.bwd[1]]]}
                      for st in self.steps],
            "predicted_ms": self.predicted_ms,
            "source": self.source,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SIPlan":
        """Inverse of ``to_dict``; ValueError on a wrong format or step op names that disagree."""
        _check_format(data, PLAN_FORMAT, PLAN_VERSION, "plan")
        fwd_ops, bwd_ops = _ops_from_json(data["fwd_ops"]), _ops_from_json(data["bwd_ops"])
        steps = []
        for k, st in enumerate(data["steps"]):
            step = PlanStep(fwd=_range(st["fwd"]), bwd=_range(st["bwd"]))
            for side, ops, seg in (("fwd_ops", fwd_ops, step.fwd), ("bwd_ops", bwd_ops, step.bwd)):
                names = [op.name for op in ops[seg[0]:seg[1]]]
                if side in st and list(st[side]) != names:
                    raise ValueError(f"plan step {k}: {side} {st[side]} disagree with range {list(seg)}"
                                     f" which holds {names}")
            steps.append(step)
        predicted = data.get("predicted_ms")
        return cls(fwd_ops, bwd_ops, tuple(steps),
                   predicted_ms=None if predicted is None else float(predicted),
                   source=data.get("source", "default"), meta=dict(data.get("meta") or {}))

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "SIPlan":
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        """Write the plan as JSON atomically (a crash never leaves half a file)."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> "SIPlan":
        with open(path, encoding="utf-8") as fh:
            return cls.from_json(fh.read())

    def fingerprint(self) -> str:
        """sha256 (hex) over what runs: op names, kinds and the steps' ranges.

        ``predicted_ms``, ``source`` and ``meta`` are annotations and do not change it, so two ranks
        that must issue the same collectives in the same order compare exactly what matters.
        """
        content = {"fwd_ops": _ops_to_json(self.fwd_ops), "bwd_ops": _ops_to_json(self.bwd_ops),
                   "steps": [[*st.fwd, *st.bwd] for st in self.steps]}
        blob = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    # ---- text timeline --------------------------------------------------------------------

    def render_text(self, step_ms: Sequence[float] | None = None) -> str:
        """One row per step with a compute lane and a communication lane.

        Forward-strand ops are tagged ``F``, backward-strand ops ``B``; ``.`` marks an idle lane.
        ``step_ms`` (one number per step, e.g. from ``planner.step_costs``) adds a time column.
        """
        if step_ms is not None and len(step_ms) != len(self.steps):
            raise ValueError(f"step_ms has {len(step_ms)} values for {len(self.steps)} steps")
        rows = []
        for st in self.steps:
            lanes = {OpKind.COMP: [], OpKind.COMM: []}
            for tag, ops, seg in (("F", self.fwd_ops, st.fwd), ("B", self.bwd_ops, st.bwd)):
                for kind in lanes:
                    names = [op.name for op in ops[seg[0]:seg[1]] if op.kind is kind]
                    if names:
                        lanes[kind].append(f"{tag} " + " ".join(names))
            rows.append((" | ".join(lanes[OpKind.COMP]) or ".", " | ".join(lanes[OpKind.COMM]) or "."))
        width = max([len("compute lane")] + [len(r[0]) for r in rows])
        ms_head = "        ms" if step_ms is not None else ""
        head = (f"SIPlan source={self.source} steps={len(self.steps)} "
                f"predicted_ms={_fmt_ms(self.predicted_ms)} fingerprint={self.fingerprint()[:12]}")
        lines = [head, f"step{ms_head}  {'compute lane':<{width}}  communication lane"]
        for k, (comp, comm) in enumerate(rows):
            ms = f"  {step_ms[k]:8.3f}" if step_ms is not None else ""
            lines.append(f"{k:4d}{ms}  {comp:<{width}}  {comm}")
        return "\n".join(lines)


def sequential_plan(fwd_ops: Sequence[OpSpec], bwd_ops: Sequence[OpSpec]) -> SIPlan:
    """No co-execution: one step with the whole forward list, then one with the whole backward list."""
    fwd_ops, bwd_ops = tuple(fwd_ops), tuple(bwd_ops)
    nf, nb = len(fwd_ops), len(bwd_ops)
    steps = []
    if nf:
        steps.append(PlanStep(fwd=(0, nf), bwd=(0, 0)))
    if nb:
        steps.append(PlanStep(fwd=(nf, nf), bwd=(0, nb)))
    return SIPlan(fwd_ops, bwd_ops, tuple(steps), source="sequential")


def default_plan(fwd_ops: Sequence[OpSpec], bwd_ops: Sequence[OpSpec]) -> SIPlan:
    """The fixed plan used before any profiling: hide each COMM op under the other strand's compute.

    Both lists are cut into the groups of ``comm_groups`` (each COMM op alone, each run of COMP ops
    between them one group) and walked head by head. Pairing rule, at each step:

    * heads of different kinds (one COMM, one COMP group): pair them -- the communication of one
      strand runs under a whole compute group of the other (e.g. forward ``attn.ag`` with the
      backward ``mlp.add`` group, backward ``mlp.rs`` with the forward ``attn.qkv..attn.out`` group);
    * heads of the same kind (both compute, or both COMM): run the forward head alone. This shifts the
      strands by half a phase, so the next heads differ in kind and pair again. A layer's backward
      list is its forward list reversed, so after one such shift every COMM op finds compute;
    * one list exhausted: the rest of the other list runs alone.

    Consecutive alone steps of the same strand merge into one step. No step communicates on both
    strands; every op is covered once, in order.
    """
    fwd_ops, bwd_ops = tuple(fwd_ops), tuple(bwd_ops)
    fg, bg = comm_groups(fwd_ops), comm_groups(bwd_ops)
    p = q = 0
    steps: list[PlanStep] = []
    while p < len(fg) or q < len(bg):
        f = fg[p] if p < len(fg) else None
        b = bg[q] if q < len(bg) else None
        if f and b and segment_has_comm(fwd_ops, f) != segment_has_comm(bwd_ops, b):
            steps.append(PlanStep(fwd=f, bwd=b))
            p, q = p + 1, q + 1
        elif f:
            at = b[0] if b else len(bwd_ops)
            _append_alone(steps, PlanStep(fwd=f, bwd=(at, at)))
            p += 1
        else:
            at = len(fwd_ops)
            _append_alone(steps, PlanStep(fwd=(at, at), bwd=b))
            q += 1
    return SIPlan(fwd_ops, bwd_ops, tuple(steps), source="default")


def _append_alone(steps: list[PlanStep], step: PlanStep) -> None:
    """Append an alone step, merging it into the previous step if that ran the same strand alone."""
    if steps:
        last = steps[-1]
        fwd_alone = last.bwd[0] == last.bwd[1] and step.bwd[0] == step.bwd[1]
        bwd_alone = last.fwd[0] == last.fwd[1] and step.fwd[0] == step.fwd[1]
        if fwd_alone and last.fwd[1] == step.fwd[0] and last.bwd == step.bwd:
            steps[-1] = PlanStep(fwd=(last.fwd[0], step.fwd[1]), bwd=last.bwd)
            return
        if bwd_alone and last.bwd[1] == step.bwd[0] and last.fwd == step.fwd:
            steps[-1] = PlanStep(fwd=last.fwd, bwd=(last.bwd[0], step.bwd[1]))
            return
    steps.append(step)


# ---- JSON helpers shared with planner.OverlapTable -----------------------------------------

def _ops_to_json(ops: Sequence[OpSpec]) -> list[dict]:
    return [{"name": op.name, "kind": op.kind.value} for op in ops]


def _ops_from_json(items) -> tuple[OpSpec, ...]:
    try:
        return tuple(OpSpec(str(it["name"]), OpKind(it["kind"])) for it in items)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"bad op list entry ({err}); expected {{'name': str, 'kind': 'comp'|'comm'}}")


def _range(value) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise ValueError(f"expected a range [start, stop] of two ints, got {value!r}")
    return int(value[0]), int(value[1])


def _check_format(data: dict, fmt: str, version: int, what: str) -> None:
    if not isinstance(data, dict) or data.get("format") != fmt:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"not a {what} file: format is {got!r}, expected {fmt!r}")
    if data.get("version") != version:
        raise ValueError(f"{what} version {data.get('version')!r} is not supported (expected {version})")


def _fmt_ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.3f}"


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
