"""MkDocs hook: the configuration and command-line reference pages are generated from the code
when the site is built, so neither can drift from it.

    docs/reference/config.md  <!-- dhelix:config-reference -->  the "dhelix" dataclasses (ds_dhelix.config.reference)
    docs/reference/cli.md     <!-- dhelix:cli-reference -->     train.py's and every `dhelix` subcommand's argparse parser
    docs/reference/compatibility.md  <!-- dhelix:compatibility -->  the feature matrix (ds_dhelix.verify.features)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

# the pages are generated from the code on any machine: DeepSpeed is told its accelerator (else its
# import logs a "Setting accelerator to CPU" warning into the build's output)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_MARKER = "<!-- dhelix:config-reference -->"
CLI_MARKER = "<!-- dhelix:cli-reference -->"
COMPATIBILITY_MARKER = "<!-- dhelix:compatibility -->"


def config_markdown() -> str:
    from ds_dhelix.config.reference import markdown

    return markdown()


def train_parser() -> argparse.ArgumentParser:
    """train.py's parser, as the script builds it (from ``ds_dhelix.training.options``)."""
    spec = importlib.util.spec_from_file_location("dhelix_train_script", os.path.join(ROOT, "train.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module.build_parser()


def subcommand_parsers() -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """``dhelix <command>`` -> (its one-line help, its parser), in the order ``dhelix --help`` lists them."""
    from ds_dhelix.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help for a in sub._choices_actions}
    return {name: (helps.get(name) or "", p) for name, p in sub.choices.items()}


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
    if action.nargs == 0:
        return names
    if action.choices:
        value = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        value = action.metavar or action.dest.upper()
        if isinstance(value, tuple):
            value = " ".join(value)
    many = " ..." if action.nargs in ("+", "*") else ""
    return f"{names} `{value}{many}`"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0:
        return "off"
    if action.default is None or action.default == argparse.SUPPRESS:
        return "–"
    value = action.default
    return f"`{' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}`"


def parser_markdown(title: str, summary: str, parser: argparse.ArgumentParser) -> str:
    lines = [f"## `{title}`", ""]
    if summary:
        lines += [_cell(summary), ""]
    lines += ["| flag | default | meaning |", "|---|---|---|"]
    formatter = argparse.HelpFormatter(parser.prog)  # the help as written: the default has its own column
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        meaning = formatter._expand_help(action) if action.help else ""  # "%%" -> "%", "%(default)s"
        lines.append(f"| {_flag(action)} | {_default(action)} | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"


def cli_markdown() -> str:
    train = train_parser()
    parts = [parser_markdown("train.py", train.description, train)]
    for name, (summary, parser) in subcommand_parsers().items():
        parts.append(parser_markdown(f"dhelix {name}", summary, parser))
    return "\n".join(parts)


def compatibility_markdown() -> str:
    from ds_dhelix.verify.features import covering_array, markdown

    return markdown(covering_array(full=True))


GENERATED = {
    "reference/config.md": (CONFIG_MARKER, config_markdown),
    "reference/cli.md": (CLI_MARKER, cli_markdown),
    "reference/compatibility.md": (COMPATIBILITY_MARKER, compatibility_markdown),
}


def on_page_markdown(markdown: str, page, config, files) -> str:
    uri = page.file.src_uri
    if uri not in GENERATED:
        return markdown
    marker, make = GENERATED[uri]
    if marker not in markdown:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"{uri} lost its marker {marker}: the generated reference would be missing")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return markdown.replace(marker, make())
