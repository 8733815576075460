"""Code structure the project promises (pure AST reading, no imports):

    no import cycle among the modules of ds_dhelix/ (imports inside functions count too)
    no private name (``_x``) imported from another project module
    no function in ds_dhelix/ or hf_models/ longer than MAX_FUNCTION_LINES
    no module-level mutable state rebound with ``global``
"""
from __future__ import annotations

import ast
import os

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


def _graph(known: dict[str, str]) -> dict[str, set[str]]:
    graph = {}
    for mod, path in known.items():
        edges = set()
        for base, names in _imports(mod, path):
            for target in [base] + [f"{base}.{n}" for n in names]:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    edges.add(target)
        graph[mod] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_ds_dhelix():
    known = _modules("ds_dhelix")
    assert len(known) > 30
    assert _cycles(_graph(known)) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


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
