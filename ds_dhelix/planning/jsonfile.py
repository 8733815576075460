"""JSON file helpers shared by plans (``plan.py``) and overlap tables (``planner.py``): op lists,
index ranges, format/version headers, atomic writes.

Plain data: no torch.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

from ..graph.ops import OpKind, OpSpec


def ops_to_json(ops: Sequence[OpSpec]) -> list[dict]:
    return [{"name": op.name, "kind": op.kind.value} for op in ops]


def ops_from_json(items) -> tuple[OpSpec, ...]:
    try:
        return tuple(OpSpec(str(it["name"]), OpKind(it["kind"])) for it in items)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"bad op list entry ({err}); expected {{'name': str, 'kind': 'comp'|'comm'}}") from err


def parse_range(value) -> tuple[int, int]:
    """``[start, stop]`` -> ``(start, stop)``; ValueError for anything else."""
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise ValueError(f"expected a range [start, stop] of two ints, got {value!r}")
    return int(value[0]), int(value[1])


def check_format(data: dict, fmt: str, versions: Sequence[int], what: str) -> int:
    """ValueError unless ``data`` is a ``fmt`` document of one of ``versions``; returns its version."""
    if not isinstance(data, dict) or data.get("format") != fmt:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"not a {what} file: format is {got!r}, expected {fmt!r}")
    if data.get("version") not in versions:
        raise ValueError(f"{what} version {data.get('version')!r} is not supported (expected one of {list(versions)})")
    return data["version"]


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
