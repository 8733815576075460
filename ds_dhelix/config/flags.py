"""Command lines declared as dataclasses, and the parser every ds_dhelix command line uses.

A field of an options dataclass is one flag: its type (the annotation), default, help, metavar,
choices and check sit in one declaration (``flag(...)``); ``add_flags`` builds the argparse flags
from the class, ``from_namespace`` the dataclass from what argparse parsed, ``check_flags`` runs
the fields' checks (one ``ValueError`` line naming the flag)::

    @dataclass
    class Run:
        steps: int = flag(100, "total optimizer steps", check=at_least(1))
        data: str | None = flag(None, "training data")

``StrictParser`` is argparse with one rule for every command (train.py and ``dhelix``): flags are
never abbreviated (``--step 5`` is not ``--steps 5``); a flag is accepted with ``-`` or ``_`` between
its words whichever it was declared with (``--lora_r`` is ``--lora-r``, ``--local-rank`` is
``--local_rank``); an unknown flag is refused by the command it was given to, with the closest
declared name (``did you mean --steps?``); ``--help`` shows each flag's default.

Plain stdlib: no torch, no DeepSpeed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

FLAG = "ds_dhelix.flag"
"""The field-metadata key of a flag's declaration."""
GROUP = "ds_dhelix.flag_group"
"""The field-metadata key of a nested options dataclass (its ``--help`` heading)."""


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line (see ``flag``)."""

    help: str | Callable[[], str]
    name: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    choices: tuple | None = None
    parse: Callable[[str], object] | None = None
    check: Callable[[object], str | None] | None = None
    required: bool = False
    env_default: Callable[[], object] | None = None
    default_text: str | None = None

    def option(self, field_name: str) -> str:
        """The flag's declared spelling: ``name``, else ``--`` and the field's words joined by ``-``."""
        return self.name or "--" + field_name.replace("_", "-")


def flag(
    default,
    help: str | Callable[[], str],
    *,
    name: str | None = None,
    aliases: Sequence[str] = (),
    metavar: str | None = None,
    choices: Sequence | None = None,
    parse: Callable[[str], object] | None = None,
    check: Callable[[object], str | None] | None = None,
    required: bool = False,
    env_default: Callable[[], object] | None = None,
    default_text: str | None = None,
):
    """A dataclass field that is one flag. ``parse``: argparse's ``type`` (default: the annotation's
    int / float / str); ``check(value)``: None when the value is fine, else what is wrong with it
    ("must be >= 1, got 0"), reported as ``--flag <that>``; ``env_default``: the parser's default
    taken when the parser is built (an environment variable); ``help`` may be a function, called
    when the parser is built (a list read from disk); ``default_text``: ``--help``'s words
    for a default that is not a plain value."""
    meta = Flag(
        help,
        name,
        tuple(aliases),
        metavar,
        None if choices is None else tuple(choices),
        parse,
        check,
        required,
        env_default,
        default_text,
    )
    return dataclasses.field(default=default, metadata={FLAG: meta})


def group(cls, title: str):
    """A dataclass field holding a nested options dataclass: its flags listed under ``title``."""
    return dataclasses.field(default_factory=cls, metadata={GROUP: title})


def at_least(low, note: str = "") -> Callable[[object], str | None]:
    """A check: the value is ``>= low`` (``note``: what the smallest value means, "(0: off)")."""
    text = f" {note}" if note else ""
    return lambda v: None if v is None or v >= low else f"must be >= {low}{text}, got {v}"


def above(low) -> Callable[[object], str | None]:
    """A check: the value is ``> low``."""
    return lambda v: None if v is None or v > low else f"must be > {low}, got {v}"


def flag_fields(cls) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of ``cls`` that are flags, in declaration order, with their declarations."""
    return [(f, f.metadata[FLAG]) for f in dataclasses.fields(cls) if FLAG in f.metadata]


def _scalar(annotation):
    """The flag's value type of an annotation: ``int | None`` -> int, ``bool`` -> bool."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation


def groups(cls) -> list[tuple[dataclasses.Field, type]]:
    """The nested options dataclasses of ``cls`` (fields made by ``group``) with their classes."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if GROUP in f.metadata]


def add_flags(
    parser: argparse.ArgumentParser, cls, title: str | None = None, only: Sequence[str] | None = None
) -> None:
    """One argparse flag per field of ``cls`` (under a ``--help`` heading when ``title`` is given),
    then its groups' under theirs; ``only``: just these fields."""
    into = parser.add_argument_group(title) if title else parser
    hints = typing.get_type_hints(cls)
    for f, meta in flag_fields(cls):
        if only is not None and f.name not in only:
            continue
        kind = _scalar(hints[f.name])
        names = (meta.option(f.name), *meta.aliases)
        text = meta.help() if callable(meta.help) else meta.help
        if kind is bool:
            into.add_argument(*names, dest=f.name, action="store_true", help=text)
            continue
        kwargs = {"dest": f.name, "help": text, "metavar": meta.metavar, "required": meta.required}
        if meta.choices is not None:
            kwargs["choices"] = list(meta.choices)
        if not meta.required:
            kwargs["default"] = meta.env_default() if meta.env_default else f.default
        action = into.add_argument(*names, type=meta.parse or (kind if kind in (int, float) else None), **kwargs)
        action.default_text = meta.default_text
    for f, sub in groups(cls):
        if only is None:
            add_flags(parser, sub, f.metadata[GROUP])


def from_namespace(cls, namespace: argparse.Namespace, **given):
    """``cls`` (and its groups) from the flags argparse parsed (``given``: fields that are not flags)."""
    values = {f.name: getattr(namespace, f.name) for f, _ in flag_fields(cls) if hasattr(namespace, f.name)}
    values.update({f.name: from_namespace(sub, namespace) for f, sub in groups(cls)})
    return cls(**values, **given)


def check_flags(options) -> None:
    """Every field's own check, groups included: ``ValueError("--flag must be >= 1, got 0")`` for
    the first that fails."""
    for f, meta in flag_fields(type(options)):
        if meta.check is not None:
            problem = meta.check(getattr(options, f.name))
            if problem:
                raise ValueError(f"{meta.option(f.name)} {problem}")
    for f, _ in groups(type(options)):
        check_flags(getattr(options, f.name))


class DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` with each flag's default: "(default: X)" after a help that does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = getattr(action, "default_text", None) or _shown_default(action)
        if default is None or "default" in text.lower():
            return text
        return f"{text} (default: {default.replace('%', '%%')})"


class RawDescriptionDefaultsFormatter(DefaultsFormatter, argparse.RawDescriptionHelpFormatter):
    """``DefaultsFormatter`` keeping the description's line breaks (a command's diagram or examples)."""


def _shown_default(action: argparse.Action) -> str | None:
    if action.required or action.nargs == 0 or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
        return None
    value = action.default
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _canonical(option: str) -> str:
    return option.replace("_", "-")


class StrictParser(argparse.ArgumentParser):
    """argparse without abbreviations, with ``-``/``_`` spellings alike, a did-you-mean for an unknown
    flag (from the command it was given to) and defaults in ``--help``. Subcommand parsers made by
    ``add_subparsers`` are ``StrictParser`` too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def declared(self) -> list[str]:
        """Every option string of this parser (its own, not its subcommands')."""
        return [o for a in self._actions for o in a.option_strings]

    def _spelled(self, args: Sequence[str]) -> list[str]:
        """``args`` with each flag in its declared spelling (``--lora_r`` -> ``--lora-r``)."""
        spelling = {_canonical(o): o for o in self.declared() if o.startswith("--")}
        out = []
        for i, arg in enumerate(args):
            if arg == "--":
                return out + list(args[i:])
            name, eq, value = arg.partition("=")
            if arg.startswith("--") and _canonical(name) in spelling:
                arg = spelling[_canonical(name)] + eq + value
            out.append(arg)
        return out

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._spelled(args), namespace)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self._chosen(namespace)
            owner.error(owner.unknown_message(extras))
        return namespace

    def _chosen(self, namespace) -> StrictParser:
        """The (sub)command parser the command line chose: the one its unknown flags were given to."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None) or "")
                if isinstance(chosen, StrictParser):
                    return chosen._chosen(namespace)
        return self

    def unknown_message(self, extras: Sequence[str]) -> str:
        """'unrecognized arguments: --step 5 (--step: did you mean --steps?)': the declared flag the
        unknown one abbreviates, else the closest by spelling."""
        declared = sorted({_canonical(o): o for o in self.declared() if o.startswith("--")}.items())
        hints = []
        for arg in extras:
            name = arg.partition("=")[0]
            if not name.startswith("--"):
                continue
            longer = [o for c, o in declared if c.startswith(_canonical(name))]
            close = difflib.get_close_matches(_canonical(name), [c for c, _ in declared], n=1, cutoff=0.6)
            guess = longer[0] if len(longer) == 1 else dict(declared)[close[0]] if close else None
            if guess:
                hints.append(f"{name}: did you mean {guess}?")
        text = f"unrecognized arguments: {' '.join(extras)}"
        return text + (f" ({'; '.join(hints)})" if hints else "")
