"""The documentation site builds cleanly and its generated references match the code.

mkdocs build --strict      no broken link, no missing page, no unresolved API reference
configuration reference    every key the "dhelix" section accepts, its allowed values real
CLI reference              every flag of train.py and of each `dhelix` subcommand
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from ds_dhelix.config.reference import markdown as config_markdown
from ds_dhelix.config.reference import rows
from ds_dhelix.config.section import DhelixConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MKDOCS = os.path.join(os.path.dirname(sys.executable), "mkdocs")


def _hook():
    spec = importlib.util.spec_from_file_location(
        "dhelix_docs_hook", os.path.join(ROOT, "docs", "hooks", "reference.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flat_keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out |= _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
    return out


def test_config_reference_lists_every_key_the_section_accepts():
    documented = re.findall(r"^\| `([a-z0-9_.]+)` \|", config_markdown(), re.M)
    accepted = _flat_keys(DhelixConfig(schedule="auto").to_dict())  # auto keeps the auto_* keys
    assert len(documented) == len(set(documented))
    assert set(documented) == accepted
    for key in documented:  # and each really is a key: set to its default, it parses
        section, _, leaf = key.rpartition(".")
        row = next(r for r in rows() if r.key == key)
        value = json.loads(row.default)
        d = {"schedule": "auto"} if leaf.startswith("auto_") else {}
        (d.setdefault(section, {}) if section else d)[leaf] = value
        DhelixConfig.from_dict(d)


@pytest.mark.parametrize("row", [r for r in rows() if r.choices], ids=lambda r: r.key)
def test_listed_choices_are_what_the_section_accepts(row):
    section, _, leaf = row.key.rpartition(".")

    def config(value):
        d = {"schedule": "auto"} if leaf.startswith("auto_") else {}
        (d.setdefault(section, {}) if section else d)[leaf] = value
        if section == "objective" and leaf != "name":  # (the objective's other choices are grpo's)
            d[section]["name"] = "grpo"
        return DhelixConfig.from_dict(d)

    if leaf == "auto_candidates":  # a list of schedules: each layout's whole list
        config(["sequential", "si", "intra"])
        DhelixConfig.from_dict(
            {"schedule": "auto", "pipeline": {"stages": 2}, "auto_candidates": ["sequential", "w", "dualpipev"]}
        )
        assert set(row.choices) == {"sequential", "si", "intra", "w", "dualpipev"}
    else:
        for choice in row.choices:
            config(choice)
        with pytest.raises(ValueError, match=re.escape(row.key.split(".")[-1])):
            config("no-such-value")


def test_cli_reference_lists_every_flag():
    hook = _hook()
    text = hook.cli_markdown()
    parsers = {"train.py": hook.train_parser(), **{f"dhelix {n}": p for n, (_, p) in hook.subcommand_parsers().items()}}
    assert len(parsers) >= 8
    for title, parser in parsers.items():
        section = text.split(f"## `{title}`\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in section, (title, flag)


@pytest.mark.skipif(not os.path.exists(MKDOCS), reason="the docs extra is not installed (pip install -e '.[docs]')")
def test_site_builds_strict(tmp_path):
    out = subprocess.run(
        [MKDOCS, "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    api_page = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "tensor_parallel.size" in config_page and "dhelix:config-reference" not in config_page
    assert "--ds-checkpoint" in cli_page and "dhelix validate-plan" in cli_page
    assert "ds_dhelix.engine.build.initialize" in api_page


def test_architecture_names_every_module():
    """docs/architecture.md has a line for every module of the product, the harness and the tests
    (a module added without its line there fails here)."""
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    missing = []
    for top in ("ds_dhelix", "hf_models", "benchmarks", "tests"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            if "__pycache__" in folder or "results" in folder:
                continue
            missing += [
                os.path.relpath(os.path.join(folder, f), ROOT)
                for f in files
                if f.endswith(".py") and f != "__init__.py" and not re.search(rf"\b{re.escape(f)}\b", text)
            ]
    assert missing == [], f"docs/architecture.md has no line for {missing}"
