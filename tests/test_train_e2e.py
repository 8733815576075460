"""End to end: the real DeepSpeed launcher runs train.py on 2 CPU ranks (TP=2, SI): the loss falls,
TensorBoard has the loss scalar, and the exported HF checkpoint reproduces the trained model."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(tmp_path, steps=40, extra=()):
    with open(os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json")) as f:
        cfg = json.load(f)
    cfg["tensorboard"]["output_path"] = str(tmp_path / "tb")
    cfg_path = tmp_path / "ds.json"
    cfg_path.write_text(json.dumps(cfg))
    summary = tmp_path / "summary.json"
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        os.path.join(ROOT, "train.py"),
        "--deepspeed",
        str(cfg_path),
        "--steps",
        str(steps),
        "--seq-len",
        "64",
        "--output-dir",
        str(tmp_path / "hf"),
        "--json-summary",
        str(summary),
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(summary.read_text()), proc


@pytest.mark.slow
def test_launcher_trains_logs_and_exports(tmp_path):
    summary, proc = run_train(tmp_path)
    assert summary["loss_last"] < summary["loss_first"] - 0.5, summary
    # the LR each step ran at: DeepSpeed's WarmupCosineLR runs step 1 at 0 (its warm-up starts there)
    assert summary["lrs"][0] == 0.0 < summary["lrs"][1] < summary["lrs"][2], summary["lrs"][:3]
    assert "hidden" in proc.stdout  # summary line says how much communication was hidden
    # TensorBoard event files hold the loss scalar
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(tmp_path / "tb" / "**" / "events.out.tfevents.*"), recursive=True)
    assert files, "no TensorBoard event file"
    tags = set()
    for f in files:
        acc = EventAccumulator(f)
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"Train/loss", "Train/lr", "Train/tokens_per_s", "Train/grad_norm"} <= tags, tags
    # the HF checkpoint, loaded by plain transformers, reproduces the trained model's loss
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert glob.glob(str(tmp_path / "hf" / "*.safetensors"))
    ids = torch.tensor(summary["probe_input_ids"])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    # fp32; the sharded model sums TP partial products in another order: ~1e-6 relative
    assert abs(loss - summary["probe_loss"]) < 1e-4, (loss, summary["probe_loss"])
