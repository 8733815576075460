"""Bad input to train.py: one clear line of error, exit code 2, before any model is built."""
import json
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json")


def train(*args, world=2):
    env = dict(os.environ, WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def config(tmp_path, **changes):
    cfg = json.load(open(BASE))
    for key, value in changes.items():
        cfg[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("train.py: error:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


def test_missing_config():
    assert_one_line_error(train("--deepspeed", "/nonexistent/ds.json"), "/nonexistent/ds.json")


def test_invalid_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 4,,}')
    assert_one_line_error(train("--deepspeed", str(bad)), "line 1")


def test_unknown_preset():
    assert_one_line_error(train("--deepspeed", BASE, "--model", "tiny-lama"), "tiny-lama", "tiny-llama")


def test_missing_model_dir():
    assert_one_line_error(train("--deepspeed", BASE, "--model", "/nonexistent/ckpt"), "/nonexistent/ckpt")


def test_missing_data():
    assert_one_line_error(train("--deepspeed", BASE, "--data", "/nonexistent/data.txt"), "/nonexistent/data.txt")


def test_batch_arithmetic(tmp_path):
    path = config(tmp_path, train_batch_size=8)  # micro 4 x accum 4 x dp 1 = 16
    assert_one_line_error(train("--deepspeed", path), "train_batch_size 8", "micro 4", "accumulation 4",
                          "data-parallel size 1")


def test_tp_not_dividing_heads(tmp_path):
    cfg = json.load(open(BASE))
    cfg["dhelix"]["tensor_parallel"]["size"] = 3
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    proc = train("--deepspeed", str(path), world=3)
    assert_one_line_error(proc, "tensor_parallel.size 3", "valid TP sizes")


def test_unknown_dhelix_key(tmp_path):
    cfg = json.load(open(BASE))
    cfg["dhelix"]["schedul"] = "si"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert_one_line_error(train("--deepspeed", str(path)), "dhelix.schedul", "schedule")
