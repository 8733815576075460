"""The tested dependency ranges: declared once in pyproject.toml, read back from the installed
package, and an installed version outside them refused at import in one line."""

from __future__ import annotations

import importlib.metadata
import pathlib

import pytest
import tomllib

from ds_dhelix import versions

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_ranges_are_pyproject_s():
    from packaging.requirements import Requirement

    declared = {}
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(line)
        if req.name in versions.CHECKED:
            declared[req.name] = str(req.specifier)
    assert set(declared) == set(versions.CHECKED) and all(declared.values()), declared
    assert versions.declared_ranges() == declared  # the installed metadata: pip install -e . after an edit


def test_what_is_installed_here_is_inside_them():
    versions.check_versions()


def test_a_version_outside_its_range_is_refused_in_one_line(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(versions.metadata, "version", lambda name: "4.57.6" if name == "transformers" else real(name))
    with pytest.raises(versions.UnsupportedVersion) as err:
        versions.check_versions()
    spec = versions.declared_ranges()["transformers"]
    text = str(err.value)
    assert "\n" not in text and f"transformers{spec}" in text and "transformers 4.57.6 is installed" in text, text
    assert (
        versions.out_of_range({"torch": ">=2.13"}, {"torch": "2.13.0+cpu"}) == []
    )  # a local build tag is that version


def test_the_floors_are_what_make_test_min_installs():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "scripts/floors.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = out.stdout.split()
    for name, spec in versions.declared_ranges().items():
        floor = spec.split(",")[0].lstrip(">=~")
        assert f"{name}=={floor}" in lines, (name, spec, lines)


@pytest.mark.extended
@pytest.mark.timeout(3000)
def test_make_test_min_passes_at_the_floors():
    """Builds .venv-min at the floors and runs the smoke subset there (scripts/test_min.sh)."""
    import subprocess

    run = subprocess.run(["make", "test-min"], cwd=ROOT, capture_output=True, text=True, timeout=2900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "test-min: the floors pass" in run.stdout
