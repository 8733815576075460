"""The floor of every dependency range in pyproject.toml, as pip requirements (``name==floor``):
what ``make test-min`` installs. A range without a floor (``accelerate``) is left to pip."""

from __future__ import annotations

import pathlib
import sys

import tomllib
from packaging.requirements import Requirement


def floors(pyproject: pathlib.Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    out = []
    for line in deps:
        req = Requirement(line)
        low = [s.version for s in req.specifier if s.operator in (">=", "==", "~=")]
        out.append(f"{req.name}=={low[0]}" if low else req.name)
    return out


if __name__ == "__main__":
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    print("\n".join(floors(root / "pyproject.toml")))
