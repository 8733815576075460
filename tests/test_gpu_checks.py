"""scripts/gpu_checks.py, the prepared GPU checks, dry-run on CPU so it does not rot between the
sessions that are lent a device: every check runs, SI and pair_ends are bitwise sequential."""

from __future__ import annotations

import json

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
    # stream_overlap, device_events, connections and tutel_overlap need CUDA
    assert list(rows) == [
        "env",
        "parity",
        "step_time",
        "profiler",
        "roofline",
        "planner_clock",
        "two_ranks",
        "layer_shapes",
        "tutel_kernels",
    ]
    assert rows["parity"]["si"]["bitwise"] and rows["parity"]["si-ends"]["bitwise"]
    assert rows["step_time"]["hf_ms"] > 0 and rows["step_time"]["si_ms"] > 0
    assert rows["profiler"]["spans"] > 0 and rows["profiler"]["missing_ranges"] == []
    assert (tmp_path / "profiler_trace.json.gz").stat().st_size > 0
    roofline = rows["roofline"]  # every op of the layer measured and projected (dhelix predict's costs)
    assert set(roofline["ops"]) >= {"embed", "attn.qkv", "attn.core", "mlp.up", "mlp.down", "head.loss"}
    assert all(v["fwd_ms"] > 0 and v["fwd_pred_ms"] >= 0 for v in roofline["ops"].values())
    assert roofline["predicted_ms"] > 0 and roofline["measured_ms"] > 0
    tutel = rows["tutel_kernels"]  # torch's and tutel's dispatch / combine on the same routes (or why not)
    assert tutel["ok"] and (
        tutel.get("skipped") or (tutel["float32"]["buffer_equal"] and tutel["float32"]["combined_equal"])
    )
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
    assert len(lines) == 9  # one JSON line per check


def test_cuda_connections_warning_names_the_setting():
    import torch

    from ds_dhelix.runtime.comm import cuda_connections_warning

    cuda = torch.device("cuda")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in cuda_connections_warning(cuda, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert cuda_connections_warning(cuda, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) is None
    assert cuda_connections_warning(cuda, {}) is None
    assert cuda_connections_warning(torch.device("cpu"), {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) is None
