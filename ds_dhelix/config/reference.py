"""The ``"dhelix"`` section described from its dataclasses: one row per key (dotted path, type,
default, allowed values, the field's docstring), for the generated configuration reference.

    rows()      [KeyDoc(key="tensor_parallel.size", type="int", default="1", choices=(), doc="..."), ...]
    markdown()  the reference table (the docs build puts it into ``docs/reference/config.md``)
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import typing
from dataclasses import dataclass

from .section import DhelixConfig, type_name


@dataclass(frozen=True)
class KeyDoc:
    key: str
    type: str
    default: str
    choices: tuple[str, ...]
    doc: str


def field_docs(cls) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string right after each field), one line each."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def rows(cls=DhelixConfig, prefix: str = "") -> list[KeyDoc]:
    """Every key the section accepts, nested sections flattened (``pipeline.stages``), in field order."""
    hints, docs, defaults, out = typing.get_type_hints(cls), field_docs(cls), cls(), []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += rows(tp, f"{prefix}{f.name}.")
            continue
        default = getattr(defaults, f.name)
        out.append(
            KeyDoc(
                prefix + f.name,
                type_name(tp),
                json.dumps(list(default) if isinstance(default, tuple) else default),
                tuple(cls.CHOICES.get(f.name, ())),
                docs.get(f.name, ""),
            )
        )
    return out


def markdown() -> str:
    """The reference as a Markdown table, one line per key."""
    lines = ["| key | type | default | allowed values | meaning |", "|---|---|---|---|---|"]
    for r in rows():
        choices = ", ".join(f"`{json.dumps(c)}`" for c in r.choices) or "–"
        doc = r.doc.replace("|", "\\|")
        lines.append(f"| `{r.key}` | {r.type} | `{r.default}` | {choices} | {doc} |")
    return "\n".join(lines) + "\n"
