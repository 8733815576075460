"""The dependency ranges the project is tested with, checked when ``ds_dhelix`` is imported.

The ranges are declared once, in ``pyproject.toml``'s ``dependencies``, and read back from the
installed package's metadata; a torch / DeepSpeed / transformers / PEFT outside its range is refused
in one line naming the range and the fix (``make test-min`` runs the smoke subset at the floors).
Where the package is not installed (a source tree on ``PYTHONPATH``), there is nothing to read and
nothing is checked.
"""

from __future__ import annotations

import importlib.metadata as metadata

CHECKED = ("torch", "deepspeed", "transformers", "peft")
"""The dependencies whose API the engine and the adapters are written against."""


class UnsupportedVersion(ImportError):
    """An installed dependency outside the range ds_dhelix is tested with."""


def declared_ranges() -> dict[str, str]:
    """``{name: specifier}`` of the CHECKED dependencies, as the installed package declares them."""
    from packaging.requirements import Requirement

    try:
        requires = metadata.requires("ds_dhelix") or []
    except metadata.PackageNotFoundError:
        return {}
    ranges = {}
    for line in requires:
        req = Requirement(line)
        if req.name in CHECKED and req.marker is None:
            ranges[req.name] = str(req.specifier)
    return ranges


def out_of_range(ranges: dict[str, str], installed: dict[str, str | None]) -> list[str]:
    """The one-line refusals for every installed version outside its range."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    lines = []
    for name, spec in ranges.items():
        version = installed.get(name)
        if version is None or not spec or Version(version) in SpecifierSet(spec, prereleases=True):
            continue
        lines.append(
            f"ds_dhelix is tested with {name}{spec}, and {name} {version} is installed; "
            f"pip install '{name}{spec}' (the ranges are pyproject.toml's)"
        )
    return lines


def check_versions() -> None:
    """``UnsupportedVersion`` naming the first dependency outside its tested range."""
    ranges = declared_ranges()
    installed = {}
    for name in ranges:
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed[name] = None  # its own import fails, naming it
    lines = out_of_range(ranges, installed)
    if lines:
        raise UnsupportedVersion(lines[0])
