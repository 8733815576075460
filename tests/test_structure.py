"""Code structure the project promises.

layers and cycles: import-linter's contracts (``[tool.importlinter]`` in pyproject.toml), run
                   with ``lint-imports``; imports inside functions count too
the rest by pure AST reading (no imports):
no private name (``_x``) imported from another project module
no function in ds_dhelix/ or hf_models/ longer than MAX_FUNCTION_LINES
no module-level mutable state rebound with ``global``
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("ds_dhelix", "hf_models")
MAX_FUNCTION_LINES = 60


def _modules(package: str) -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod.removesuffix(".__init__")] = path
    return out


def _imports(mod: str, path: str):
    """(imported module, imported names) of every import statement of a module, resolved."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield base, tuple(a.name for a in node.names)


LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def _lint_imports(root: str) -> subprocess.CompletedProcess:
    if not os.path.exists(LINT_IMPORTS):
        pytest.fail(f"{LINT_IMPORTS} is missing: install the dev extra (pip install -e '.[dev]')")
    env = {**os.environ, "PYTHONPATH": root}  # the tree under test, before the editable install
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_import_contracts_hold():
    """The layers of the data flow, no cycles, no DeepSpeed in the pure layers (pyproject.toml)."""
    out = _lint_imports(ROOT)
    assert out.returncode == 0 and "0 broken" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


@pytest.mark.parametrize(
    "module, line, broken",
    [
        (
            "ds_dhelix/graph/ops.py",
            "from ds_dhelix.engine import build",
            "ds_dhelix.graph.ops -> ds_dhelix.engine.build",
        ),
        (
            "ds_dhelix/runtime/executor.py",
            "from hf_models import common",
            "ds_dhelix.runtime.executor -> hf_models.common",
        ),
        ("ds_dhelix/planning/plan.py", "import deepspeed", "ds_dhelix.planning.plan -> deepspeed"),
        ("ds_dhelix/pipe/folding.py", "import torch", "ds_dhelix.pipe.folding -> torch"),  # the room's plain half
        ("ds_dhelix/pipe/folding.py", "from . import module", "ds_dhelix.pipe.folding -> ds_dhelix.pipe.module"),
    ],
)
def test_a_broken_contract_fails(tmp_path, module, line, broken):
    """The check can fail: one deliberate import against a contract, in a copy of the tree."""
    for name in ("ds_dhelix", "hf_models", "benchmarks"):
        shutil.copytree(os.path.join(ROOT, name), tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    with open(tmp_path / module, "a", encoding="utf-8") as f:
        f.write(f"\n{line}  # deliberately against a contract\n")
    out = _lint_imports(str(tmp_path))
    assert out.returncode != 0 and broken in out.stdout, out.stdout[-3000:]


def _module_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (every import statement, lazy ones too;
    ``from pkg import mod`` counts as importing ``pkg.mod``)."""
    known = {**_modules("ds_dhelix"), **_modules("hf_models")}
    graph = {}
    for mod, path in known.items():
        graph[mod] = set()
        for base, names in _imports(mod, path):
            for target in [f"{base}.{n}" for n in names] + [base]:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (as a path back to its start), or []."""
    state, stack = {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == "open":
                return stack[stack.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = "done"
        stack.pop()
        return []

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


def test_no_module_import_cycles():
    """No two modules of ds_dhelix / hf_models import each other in a cycle, across packages too
    (the acyclic contract squashes each package; the pipeline room spans two floors)."""
    assert _cycle(_module_graph()) == []
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]  # the check can fail


def test_no_private_name_imported_across_project_modules():
    known = {**_modules("ds_dhelix"), **_modules("hf_models"), **_modules("benchmarks")}
    bad = []
    for mod, path in known.items():
        for base, names in _imports(mod, path):
            if base.split(".")[0] in ("ds_dhelix", "hf_models", "benchmarks"):
                bad += [f"{mod}: from {base} import {n}" for n in names if n.startswith("_") and n != "__version__"]
    assert bad == []


def test_no_private_attribute_of_another_project_module():
    """``module._name`` where ``module`` is an imported project module (``import x.y as m``,
    ``from x import y``) reaches into its privates as much as ``from x.y import _name`` does."""
    known = {**_modules("ds_dhelix"), **_modules("hf_models"), **_modules("benchmarks")}
    bad = []
    for mod, path in known.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name in known}
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module if not node.level else None
                aliases |= {a.asname or a.name for a in node.names if base and f"{base}.{a.name}" in known}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                if isinstance(root, ast.Name) and root.id in aliases:
                    bad.append(f"{mod}:{node.lineno} {root.id}.{node.attr}")
    assert bad == []


def test_functions_fit_on_a_screen():
    long = []
    for package in PACKAGES:
        for path in _modules(package).values():
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_no_rebound_module_globals():
    hits = []
    for package in PACKAGES:
        for path in _modules(package).values():
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.Global):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} global {', '.join(node.names)}")
    assert hits == []


def test_the_specified_layout_is_there():
    """The project's top level as its specification lists it: the package, its MoE and pipeline
    rooms, the ready ds_configs, the HF adapters, the tests, train.py and pyproject.toml."""
    for path in ("ds_dhelix", "ds_dhelix/moe", "ds_dhelix/pipe", "ds_configs", "hf_models", "tests"):
        assert os.path.isdir(os.path.join(ROOT, path)), path
    for path in ("train.py", "pyproject.toml", "ds_dhelix/pipe/engine.py", "ds_dhelix/pipe/module.py"):
        assert os.path.isfile(os.path.join(ROOT, path)), path
