"""scripts/gpu_checks.py, the prepared GPU checks, dry-run on CPU so it does not rot between the
sessions that are lent a device: every check runs, SI and pair_ends are bitwise sequential."""

from __future__ import annotations

import json
import time

import pytest

from scripts.gpu_checks import main


@pytest.mark.timeout(300)
def test_gpu_checks_dry_run_on_cpu(tmp_path, capsys):
    rc = main(
        [
            "--device",
            "cpu",
            "--steps",
            "1",
            "--micro-batches",
            "3",
            "--micro-batch-size",
            "1",
            "--seq-len",
            "32",
            "--out",
            str(tmp_path),
        ]
    )
    rows = {r["check"]: r for r in json.loads((tmp_path / "gpu_checks.json").read_text())}
    assert rc == 0, rows
    assert list(rows) == [
        "env",
        "parity",
        "step_time",
        "profiler",
        "stream_overlap",
        "device_events",
        "connections",
        "host_syncs",
        "roofline",
        "planner_clock",
        "two_ranks",
        "layer_shapes",
        "tutel_kernels",
        "tutel_overlap",
    ]
    for name in ("stream_overlap", "device_events", "connections", "host_syncs", "tutel_overlap"):
        assert rows[name]["ok"] is None and rows[name]["skipped"], rows[name]  # a row saying why, not a pass
    assert all(r["ok"] is True for n, r in rows.items() if n not in CUDA_ONLY and "skipped" not in r), rows
    assert rows["parity"]["si"]["bitwise"] and rows["parity"]["si-ends"]["bitwise"]
    assert rows["step_time"]["hf_ms"] > 0 and rows["step_time"]["si_ms"] > 0
    assert rows["profiler"]["spans"] > 0 and rows["profiler"]["missing_ranges"] == []
    assert (tmp_path / "profiler_trace.json.gz").stat().st_size > 0
    roofline = rows["roofline"]  # every op of the layer measured and projected (dhelix predict's costs)
    assert set(roofline["ops"]) >= {"embed", "attn.qkv", "attn.core", "mlp.up", "mlp.down", "head.loss"}
    assert all(v["fwd_ms"] > 0 and v["fwd_pred_ms"] >= 0 for v in roofline["ops"].values())
    assert roofline["predicted_ms"] > 0 and roofline["measured_ms"] > 0
    kernels = rows["tutel_kernels"]  # torch's and tutel's dispatch / combine on the same routes (or why not)
    try:
        import tutel  # noqa: F401 -- installed from ../shared/wheels when that folder exists
    except ImportError:  # without it the row says why, and is no pass
        assert kernels["ok"] is None and "tutel is not importable" in kernels["skipped"], kernels
    else:
        assert kernels["ok"] and kernels["float32"]["buffer_equal"] and kernels["float32"]["combined_equal"], kernels
    clock = rows["planner_clock"]  # the planner's timer and reduction on the device (CPU here)
    assert clock["ok"] and clock["round_ms"] > 0 and clock["reduced"] == [1.0, 2.0]
    two = rows["two_ranks"]  # TP=2 and EP=2 in two processes on the one device: SI bitwise sequential
    assert all(two[name]["bitwise"] for name in ("tiny-llama-tp2", "tiny-mixtral-ep2")), two
    layers = rows["layer_shapes"]  # both layers through HF, sequential, SI, with and without fakes
    for name in ("llama-tp8", "moe-ep8"):
        row = layers[name]
        assert all(row[m]["step_ms"] > 0 for m in ("hf", "sequential", "si", "sequential+fakes", "si+fakes"))
        assert row["fake_collectives"]["per_step"] > 0 and "si_hidden" in row
    lines = [line for line in capsys.readouterr().out.strip().splitlines() if line.startswith("{")]
    assert len(lines) == len(rows)  # one JSON line per check


CUDA_ONLY = {"stream_overlap", "device_events", "connections", "host_syncs", "tutel_overlap"}
TINY = ["--device", "cpu", "--steps", "1", "--micro-batches", "2", "--micro-batch-size", "1", "--seq-len", "16"]


def _quick(monkeypatch):
    """Only the cheap checks run for real (the others say skipped): the row logic is under test."""
    import scripts.gpu_checks as g

    for name in ("check_step_time", "check_profiler", "check_roofline", "check_layer_shapes", "check_planner_clock"):
        monkeypatch.setattr(g, name, lambda *a, **k: {"skipped": "left out by the test"})
    monkeypatch.setattr(g, "check_two_ranks", lambda *a, **k: {"case": {"skipped": "left out by the test"}})
    return g


def test_a_failed_case_is_not_ok(tmp_path, monkeypatch):
    """A check whose verdict does not hold, an error inside one case of a check, and a check past
    its time bound: each ``ok: false`` with why, the rest written, the exit code 1."""
    g = _quick(monkeypatch)
    monkeypatch.setattr(g, "check_parity", lambda ref, b: {"si": {"bitwise": False}, "si-ends": {"bitwise": True}})
    monkeypatch.setattr(g, "check_two_ranks", lambda *a, **k: {"ep2": {"error": "ModuleNotFoundError: deepspeed"}})

    def slow(*a, **k):
        time.sleep(5)
        return {}

    monkeypatch.setattr(g, "check_roofline", slow)
    monkeypatch.setitem(g.BUDGET_S, "roofline", 1)
    rc = g.main([*TINY, "--out", str(tmp_path)])
    rows = {r["check"]: r for r in json.loads((tmp_path / "gpu_checks.json").read_text())}
    assert rc == 1
    assert rows["parity"]["ok"] is False and "not bitwise: si" in rows["parity"]["failed"]
    assert rows["two_ranks"]["ok"] is False and "deepspeed" in rows["two_ranks"]["failed"]
    assert rows["roofline"]["ok"] is False and "timed out" in rows["roofline"]["error"]
    assert rows["env"]["ok"] is True and rows["step_time"]["ok"] is None  # skipped is not a pass either


def test_an_error_before_the_checks_still_writes_the_file(tmp_path, monkeypatch):
    g = _quick(monkeypatch)
    monkeypatch.setattr(g, "build_model", lambda *a, **k: (_ for _ in ()).throw(OSError("no such model")))
    assert g.main([*TINY, "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert [r["check"] for r in rows] == ["env", "setup"] and "no such model" in rows[1]["error"]


def test_the_whole_run_is_bounded(tmp_path, monkeypatch):
    g = _quick(monkeypatch)
    monkeypatch.setattr(g, "TOTAL_BUDGET_S", 0)
    assert g.main([*TINY, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert all(
        r["ok"] is None and r["skipped"] in ("needs CUDA", "out of time: the script's 0 s were spent") for r in rows
    )
    assert sum("out of time" in r["skipped"] for r in rows) >= 8, rows


def test_cuda_connections_warning_names_the_setting():
    import torch

    from ds_dhelix.runtime.comm import cuda_connections_warning

    cuda = torch.device("cuda")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in cuda_connections_warning(cuda, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert cuda_connections_warning(cuda, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) is None
    assert cuda_connections_warning(cuda, {}) is None
    assert cuda_connections_warning(torch.device("cpu"), {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) is None
