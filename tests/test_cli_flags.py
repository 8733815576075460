"""The layout flags of the ``dhelix`` commands (``--model``, ``--tp``, ..., ``--link-gbps``) are declared
once, in ``ds_dhelix/commands/common.py``: every command that has one gets it from
``add_layout_flags``, with the same type, metavar, choices and meaning, and the defaults that differ
between commands are the ones listed here. ``--link-gbps unshaped`` parses wherever a link is."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os

import pytest

from ds_dhelix.commands.common import LAYOUT_FLAGS, Default, bench_link_rate, layout_flag, link_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS_DIR = os.path.join(ROOT, "ds_dhelix", "commands")

OWN_DEFAULTS = {  # command -> {dest: default}: where a command's default is not the flag's standard one
    "parity": {"tp": None, "micro_batches": 4, "micro_batch_size": 2, "seq_len": 64},
    "predict": {"link_gbps": argparse.SUPPRESS},  # absent: not in the namespace (--hardware cpu needs it)
    "simulate": {"pp": None},  # absent: a one-stage schedule
}
REQUIRED = {("simulate", "micro_batches")}  # a replay needs its micro-batch count
NOTES = {("predict", "model"): ", or a config.json file (the prediction needs only the shapes)"}
"""What a command adds to a flag's standard meaning (``add_layout_flags(..., notes=)``)."""
GIVEN_ONLY = {"bench"}  # every layout flag parses to None when not given (--quick fills in its own)
LINK_COMMANDS = {"profile", "validate-plan", "bench", "trace", "predict"}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    spec = importlib.util.spec_from_file_location(
        "dhelix_docs_hook", os.path.join(ROOT, "docs", "hooks", "reference.py")
    )
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return {name: parser for name, (_, parser) in hook.subcommand_parsers().items()}


PARSERS = _parsers()


def _standard_default(dest: str):
    default = layout_flag(dest).default
    return default.value if isinstance(default, Default) else default


def _layout_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    dests = {f.dest for f in LAYOUT_FLAGS}
    return {a.dest: a for a in parser._actions if a.dest in dests}


def test_no_command_declares_a_layout_flag_itself():
    flags = {f.flag for f in LAYOUT_FLAGS}
    found = []
    for name in sorted(os.listdir(COMMANDS_DIR)):
        if not name.endswith(".py") or name == "common.py":
            continue
        tree = ast.parse(open(os.path.join(COMMANDS_DIR, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                names = {a.value for a in node.args if isinstance(a, ast.Constant)}
                found += [f"{name}:{node.lineno} {n}" for n in names & flags]
    assert not found, f"declare these with common.add_layout_flags: {found}"


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_layout_flags_come_from_the_common_helper(command):
    for dest, action in _layout_actions(PARSERS[command]).items():
        spec = layout_flag(dest)
        assert action.option_strings[0] == spec.flag, (command, action.option_strings)
        sweep = command == "bench" and dest == "link_gbps"
        assert action.type is (bench_link_rate if sweep else spec.type), (command, dest)
        assert action.metavar == spec.metavar and action.choices == spec.choices, (command, dest)
        tail = "; " if sweep else " (required)" if (command, dest) in REQUIRED else " (default"
        assert action.help.startswith(spec.help + NOTES.get((command, dest), "") + tail), (command, dest, action.help)
        expected = OWN_DEFAULTS.get(command, {}).get(dest, _standard_default(dest))
        if command in GIVEN_ONLY:
            expected = None
        if (command, dest) in REQUIRED:
            assert action.required, (command, dest)
            continue
        assert not action.required and action.default == expected, (command, dest, action.default)


def test_layout_flags_cover_the_commands_that_have_a_layout():
    have = {name: set(_layout_actions(p)) for name, p in PARSERS.items()}
    assert {n for n, dests in have.items() if "link_gbps" in dests} == LINK_COMMANDS
    assert {"model", "tp", "ep", "cp", "cp_comm"} <= have["profile"] & have["validate-plan"] & have["trace"]
    assert {"model", "tp", "pp", "ep", "dp", "cp", "seq_len", "micro_batch_size", "micro_batches"} <= (
        have["parity"] & have["bench"] & have["predict"]
    )
    assert have["plan"] == set()


def _argv(command: str, *extra: str) -> list[str]:
    """``extra`` and each required flag of ``command`` given a placeholder."""
    required = [
        x for a in PARSERS[command]._actions if a.required and a.option_strings for x in (a.option_strings[0], "1")
    ]
    return [*required, *extra]


@pytest.mark.parametrize("command", sorted(LINK_COMMANDS))
def test_link_gbps_unshaped_parses_wherever_a_link_is(command, capsys):
    parser = PARSERS[command]
    many = command == "bench"
    assert parser.parse_args(_argv(command, "--link-gbps", "unshaped")).link_gbps == ([None] if many else None)
    assert parser.parse_args(_argv(command, "--link-gbps", "2.5")).link_gbps == ([2.5] if many else 2.5)
    for bad, message in (("0", "must be > 0"), ("fast", "expected Gbit/s like 2 or 'unshaped'")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(_argv(command, "--link-gbps", bad))
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert link_rate("unshaped") is None and bench_link_rate("matched") == "matched"


def test_given_only_and_suppressed_defaults():
    bench = PARSERS["bench"].parse_args([])
    assert all(getattr(bench, dest) is None for dest in _layout_actions(PARSERS["bench"]))
    assert "(default: 1 2 5 10 unshaped)" in _layout_actions(PARSERS["bench"])["link_gbps"].help
    assert "link_gbps" not in vars(PARSERS["predict"].parse_args(_argv("predict")))


def test_trace_defaults_are_its_options_defaults():
    from ds_dhelix.bench.tracing import TraceOptions

    args = PARSERS["trace"].parse_args([])
    d = TraceOptions()
    for dest in _layout_actions(PARSERS["trace"]):
        assert getattr(args, dest) == getattr(d, dest), dest


def test_profile_and_validate_plan_take_unshaped_as_no_link(tmp_path, capsys):
    """The two commands that took a plain float: 'unshaped' is the unshaped run (None), as when absent."""
    import random

    from ds_dhelix.cli import main
    from ds_dhelix.commands.profile import options
    from ds_dhelix.planning import planner

    args = PARSERS["profile"].parse_args(["--out", str(tmp_path / "t.json"), "--link-gbps", "unshaped"])
    assert options(args)["link_gbps"] is None
    ops = planner.TINY_LAYER_OPS
    table = planner.synthetic_table(ops, tuple(reversed(ops)), random.Random(0), meta={"link_gbps": 2.0})
    table.save(str(tmp_path / "t2.json"))
    assert main(["validate-plan", "--table", str(tmp_path / "t2.json"), "--link-gbps", "unshaped"]) == 2
    err = capsys.readouterr().err
    assert "profiled at --link-gbps 2, this run has --link-gbps unshaped" in err and err.count("\n") == 1
