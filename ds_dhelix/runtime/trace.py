"""Chrome / Perfetto trace writer: a process per rank, a named thread ("lane") per stream of work.

    rank 0  compute  |attn.qkv|attn.core|      |mlp.fc1|...
            comm:tp           |attn.rs ------->|
            comm:ep    ...

Spans are complete events (``"ph": "X"``) with times from ``time.perf_counter`` written in
microseconds. Span names are op names (``"attn.qkv"``); args carry ``strand``, ``microbatch`` and
``op``. Per-rank files are merged into one with ``merge_traces`` and open in ui.perfetto.dev or
chrome://tracing. ``perf_counter`` is the machine's monotonic clock, so ranks on one host line up.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

# Lanes with a fixed thread id, so every rank draws them in the same order; others follow.
STANDARD_LANES = ("compute", "comm:tp", "comm:sp", "comm:ep", "comm:cp", "comm:pp", "comm:dp")


def span_args(strand: str | None = None, microbatch: int | None = None, op: str | None = None, **extra) -> dict:
    """The standard args of a span: ``{"strand", "microbatch", "op", ...extra}``."""
    return {"strand": strand, "microbatch": microbatch, "op": op, **extra}


def _cuda_record_function():
    try:
        import torch

        if torch.cuda.is_available():
            return torch.profiler.record_function
    except Exception:  # no torch, or a broken CUDA setup: the JSON trace still works
        pass
    return None


class TraceRecorder:
    """Collects spans of one rank in memory; ``dump`` writes them as a Chrome trace.

    ``record_function``: also label each ``span`` for ``torch.profiler`` (None = only when CUDA is
    available). With ``enabled=False`` every call is a no-op and ``dump`` writes only metadata.
    """

    def __init__(self, rank: int, enabled: bool = True, record_function: bool | None = None):
        self.rank = rank
        self.enabled = enabled
        self._lanes: dict[str, int] = {}
        self._spans: list[tuple[str, str, float, float, dict | None]] = []
        if record_function is None:
            self._record_function = _cuda_record_function() if enabled else None
        elif record_function:
            import torch

            self._record_function = torch.profiler.record_function
        else:
            self._record_function = None

    def stop(self) -> None:
        """Record nothing more (spans already recorded stay, for ``events`` / ``dump``)."""
        self.enabled = False
        self._record_function = None

    def _tid(self, lane: str) -> int:
        tid = self._lanes.get(lane)
        if tid is None:
            if lane in STANDARD_LANES:
                tid = STANDARD_LANES.index(lane) + 1
            else:
                tid = len(STANDARD_LANES) + 1 + sum(name not in STANDARD_LANES for name in self._lanes)
            self._lanes[lane] = tid
        return tid

    def label(self, name: str):
        """A ``torch.profiler`` range named ``name`` (a no-op context without ``record_function``):
        what the executor wraps each op in, so profiler ranges carry the trace's op names."""
        if self._record_function is None:
            return contextlib.nullcontext()
        return self._record_function(name)

    @contextlib.contextmanager
    def span(self, lane: str, name: str, args: dict | None = None) -> Iterator[None]:
        """Record the enclosed block as one span ``name`` on ``lane``."""
        if not self.enabled:
            yield
            return
        with self.label(name):
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.add_span(lane, name, t0, time.perf_counter(), args)

    def add_span(self, lane: str, name: str, t0: float, t1: float, args: dict | None = None) -> None:
        """Record a span timed elsewhere (``perf_counter`` seconds), e.g. async comm launch→wait."""
        if not self.enabled:
            return
        if t1 < t0:
            raise ValueError(f"add_span({lane!r}, {name!r}): end {t1} is before start {t0}")
        self._tid(lane)
        self._spans.append((lane, name, t0, t1, args))  # list.append: safe from comm threads

    def events(self) -> list[dict]:
        """Metadata events, then the spans sorted by lane and start time."""
        pid = self.rank
        events: list[dict] = [
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": f"rank {self.rank}"}},
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": self.rank}},
        ]
        for lane, tid in sorted(self._lanes.items(), key=lambda kv: kv[1]):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}})
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        spans = sorted(self._spans, key=lambda s: (self._lanes[s[0]], s[2], s[3]))
        for lane, name, t0, t1, args in spans:
            event = {
                "ph": "X",
                "pid": pid,
                "tid": self._lanes[lane],
                "name": name,
                "cat": lane,
                "ts": t0 * 1e6,
                "dur": (t1 - t0) * 1e6,
            }
            if args:
                event["args"] = args
            events.append(event)
        return events

    def dump(self, path: str | os.PathLike) -> str:
        """Write ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` to ``path``; return the path."""
        return _write_json(path, {"traceEvents": self.events(), "displayTimeUnit": "ms"})


def _write_json(path, obj) -> str:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # never leave a half-written trace behind
    return path


def merge_traces(paths: Iterable[str | os.PathLike], out_path: str | os.PathLike) -> dict:
    """Merge per-rank trace files into one; a rank (pid) appearing in two files is an error."""
    events: list[dict] = []
    owner: dict[Any, str] = {}
    for path in paths:
        with open(path) as f:
            trace = json.load(f)
        for pid in {e.get("pid") for e in trace.get("traceEvents", [])}:
            if pid in owner:
                raise ValueError(
                    f"merge_traces: pid (rank) {pid} is in both {owner[pid]} and {path}; pass one trace file per rank"
                )
            owner[pid] = os.fspath(path)
        events.extend(trace.get("traceEvents", []))
    meta = [e for e in events if e.get("ph") == "M"]
    rest = sorted(
        (e for e in events if e.get("ph") != "M"), key=lambda e: (e.get("pid", 0), e.get("tid", 0), e.get("ts", 0))
    )
    merged = {"traceEvents": meta + rest, "displayTimeUnit": "ms"}
    _write_json(out_path, merged)
    return merged


def validate_trace(obj: Any, lanes: Iterable[str] = ()) -> list[str]:
    """Problems with a loaded trace (empty list = valid).

    Checks the container, every event's fields, that every rank and every lane with spans is named
    (plus each of ``lanes`` on every rank), and that spans within a lane are sorted by start time
    and do not overlap.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        return ["trace is not an object with a 'traceEvents' list"]
    problems: list[str] = []
    process_names, lane_names = set(), {}
    spans: dict[tuple, list[dict]] = {}
    for i, e in enumerate(obj["traceEvents"]):
        if not isinstance(e, dict) or not {"ph", "pid", "name"} <= e.keys():
            problems.append(f"event {i} lacks ph/pid/name: {e!r}")
        elif e["ph"] == "M" and e["name"] == "process_name":
            process_names.add(e["pid"])
        elif e["ph"] == "M" and e["name"] == "thread_name":
            lane_names[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name")
        elif e["ph"] == "X":
            ts, dur = e.get("ts"), e.get("dur")
            if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)) or dur < 0:
                problems.append(f"span {e['name']!r} (event {i}) has bad ts={ts!r} dur={dur!r}")
            else:
                spans.setdefault((e["pid"], e.get("tid")), []).append(e)
    for pid in sorted({pid for pid, _ in spans} - process_names, key=str):
        problems.append(f"pid {pid} has spans but no process_name metadata")
    for pid in sorted(process_names, key=str):
        named = {name for (p, _), name in lane_names.items() if p == pid}
        problems.extend(f"pid {pid} has no lane {lane!r}" for lane in lanes if lane not in named)
    for (pid, tid), lane_spans in sorted(spans.items(), key=lambda kv: str(kv[0])):
        lane = lane_names.get((pid, tid))
        if lane is None:
            problems.append(f"pid {pid} tid {tid} has spans but no thread_name (lane) metadata")
        problems.extend(_lane_problems(pid, lane or f"tid {tid}", lane_spans))
    return problems


def _lane_problems(pid, lane: str, lane_spans: list[dict], eps_us: float = 1e-3) -> list[str]:
    problems = []
    for prev, cur in zip(lane_spans, lane_spans[1:]):
        if cur["ts"] < prev["ts"]:
            problems.append(
                f"pid {pid} lane {lane!r}: span {cur['name']!r} at {cur['ts']:.3f} us "
                f"is listed after {prev['name']!r} at {prev['ts']:.3f} us (unsorted)"
            )
        elif cur["ts"] + eps_us < prev["ts"] + prev["dur"]:
            problems.append(
                f"pid {pid} lane {lane!r}: span {cur['name']!r} starts at "
                f"{cur['ts']:.3f} us before {prev['name']!r} ends at "
                f"{prev['ts'] + prev['dur']:.3f} us (overlap)"
            )
    return problems
