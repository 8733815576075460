"""train.py's typed options (``ds_dhelix.training.options``) and the one parser rule of every
command line (``ds_dhelix.config.flags.StrictParser``).

tests/golden/train_flags.json is train.py's argparse parser as it was before the flags became
``RunOptions`` fields (every flag's spellings, default, help, choices, metavar, type): the typed
parser must list the same flags with the same meaning (the --model help now lists the presets on
disk, which it missed two of).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from ds_dhelix.config.flags import StrictParser, check_flags, flag_fields, groups
from ds_dhelix.training.options import RunOptions, build_parser, parse_options, presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "train_flags.json")
CFG = os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json")


def _actions(parser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if not isinstance(a, argparse._HelpAction)}


def test_every_flag_of_before_with_its_default_and_help(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    before = {row["dest"]: row for row in json.load(open(GOLDEN))}
    now = _actions(build_parser())
    assert set(now) == set(before)
    for dest, row in before.items():
        a = now[dest]
        assert a.option_strings == row["flags"], dest
        assert a.default == (0 if row["default"] == "$LOCAL_RANK" else row["default"]), dest
        assert (a.choices, a.metavar, a.nargs, a.required) == (
            row["choices"],
            row["metavar"],
            row["nargs"],
            row["required"],
        )
        assert getattr(a.type, "__name__", None) == row["type"], dest
        if dest != "model":
            assert a.help == row["help"], dest


def test_model_help_lists_every_preset():
    names = {p[: -len(".json")] for p in os.listdir(os.path.join(ROOT, "hf_models", "presets"))}
    assert {"tiny-qwen3-5", "tiny-qwen3-5-moe"} <= names
    text = _actions(build_parser())["model"].help
    assert names <= set(re.findall(r"[a-z][a-z0-9-]*", text)), text
    dense, moe, small = presets()
    assert "tiny-llama" in dense and "tiny-qwen3-5-moe" in moe and "small-phimoe" in small


@pytest.mark.parametrize(
    "given, meant",
    [("--step", "--steps"), ("--seq", "--seq-len"), ("--lora_rr", "--lora-r"), ("--output", "--output-dir")],
)
def test_no_abbreviation_and_a_did_you_mean(capsys, given, meant):
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--deepspeed", CFG, given, "5"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and err.startswith("train.py: error: unrecognized arguments"), err
    assert f"did you mean {meant}?" in err, err


def test_underscores_and_hyphens_are_one_flag(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    hyphens = parse_options(
        ["--deepspeed", CFG, "--lora-r", "4", "--output-dir", "o", "--seq-len=64", "--local_rank=3"]
    )
    underscores = parse_options(
        ["--deepspeed", CFG, "--lora_r", "4", "--output_dir", "o", "--seq_len=64", "--local-rank=3"]
    )
    assert hyphens == underscores
    assert (hyphens.lora.lora_r, hyphens.output.output_dir, hyphens.seq_len, hyphens.local_rank) == (4, "o", 64, 3)
    assert parse_options(["--deepspeed_config", CFG]).deepspeed == CFG


def _help_entries(parser) -> dict[str, str]:
    """``--help``'s text of each flag (from its line to the next flag's), by its first spelling."""
    entries, name = {}, None
    for line in parser.format_help().split("options:", 1)[1].splitlines():
        if re.match(r"^  -", line):
            name = line.split()[0].rstrip(",")
        if name:
            entries[name] = entries.get(name, "") + " " + line.strip()
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_help_shows_the_defaults():
    shown = _help_entries(build_parser())
    for name, default in (
        ("--model", "tiny-llama"),
        ("--steps", "100"),
        ("--seq-len", "128"),
        ("--output-dir", "outputs/run"),
        ("--save-interval", "0"),
        ("--keep-checkpoints", "2"),
        ("--stream-above", "256MB"),
    ):
        assert shown[name].endswith(f"(default: {default})"), shown[name]
    assert "(default" not in shown["--drop-long"].replace("(default: cut", "")  # a switch: off unless given


def _bad_value(check):
    """A value each kind of check refuses (at_least(n): n - 1; above(0): 0; a fraction: 1.0)."""
    for value in (-1, 0, 1.0):
        if check(value):
            return value
    raise AssertionError("a check that refuses nothing")


def _with(options, path: str, value):
    head, _, rest = path.partition(".")
    if not rest:
        return dataclasses.replace(options, **{head: value})
    return dataclasses.replace(options, **{head: _with(getattr(options, head), rest, value)})


def _checked_fields(cls, prefix=""):
    out = [(prefix + f.name, meta) for f, meta in flag_fields(cls) if meta.check is not None]
    for f, sub in groups(cls):
        out += _checked_fields(sub, f"{f.name}.")
    return out


@pytest.mark.parametrize("path, meta", _checked_fields(RunOptions), ids=lambda x: x if isinstance(x, str) else "")
def test_each_flag_check_names_its_flag(path, meta):
    options = parse_options(["--deepspeed", CFG])
    check_flags(options)  # the defaults pass
    bad = _bad_value(meta.check)
    with pytest.raises(ValueError) as err:
        check_flags(_with(options, path, bad))
    assert str(err.value).startswith(f"{meta.option(path.rpartition('.')[2])} must be"), str(err.value)


def test_train_py_stays_a_thin_script():
    lines = open(os.path.join(ROOT, "train.py")).read().splitlines()
    assert len(lines) <= 150, len(lines)
    assert not any(line.lstrip().startswith(("p.add_argument", "parser.add_argument")) for line in lines)


def test_the_example_declares_train_py_flags_from_the_same_groups():
    spec = importlib.util.spec_from_file_location("trainer_sft_flags", os.path.join(ROOT, "examples", "trainer_sft.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    ours = _actions(build_parser())
    import ds_dhelix.config.flags as flags

    theirs = argparse.ArgumentParser()
    flags.add_flags(theirs, type(parse_options(["--deepspeed", CFG]).data), only=example.SFT_DATA_FLAGS)
    for dest, action in _actions(theirs).items():
        assert (action.help, action.choices, action.default) == (
            ours[dest].help,
            ours[dest].choices,
            ours[dest].default,
        )
    args = example.parse_args(["--deepspeed", CFG, "--data_format", "chat", "--model", "tiny-qwen3"])
    assert args.data_flags.data_format == "chat" and args.model_flags.model == "tiny-qwen3"


def _dhelix(*argv):
    return subprocess.run(
        [sys.executable, "-m", "ds_dhelix.cli", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_dhelix_refuses_in_the_subcommand_with_a_did_you_mean():
    out = _dhelix("bench", "--tpp", "2")
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith("dhelix bench: error: unrecognized arguments: --tpp 2"), out.stderr
    assert "did you mean --tp?" in last
    out = _dhelix("parity", "--micro-batch", "2")  # an abbreviation of --micro-batches: refused
    assert out.returncode == 2 and "did you mean --micro-batches?" in out.stderr, out.stderr


def test_dhelix_help_defaults_and_the_model_flag_per_command():
    from ds_dhelix.cli import build_parser as dhelix_parser

    parser = dhelix_parser()
    assert isinstance(parser, StrictParser)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert all(isinstance(p, StrictParser) and not p.allow_abbrev for p in sub.choices.values())
    assert "predict" not in _actions(sub.choices["parity"])["model"].help
    assert "config.json" in _actions(sub.choices["predict"])["model"].help
    plan = " ".join(sub.choices["plan"].format_help().split())
    assert "(default: " in plan
