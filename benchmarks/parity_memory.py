"""Memory of `dhelix parity` against `train.py` on the same model and shapes: the machine's peak (the
sum of the process tree's resident memory, sampled every 0.2 s) and the largest single process's.

    python -m benchmarks.parity_memory --model DIR [--tree <older checkout>] [--tree .]

DIR: an HF checkpoint directory (e.g. Qwen2.5-0.5B's layout with 2 layers, random weights:
``python -m benchmarks.vocab_memory`` writes the 24-layer one). Both commands run at TP=2 on 2 ranks,
2 steps of 4 micro-batches of 2 x 64 tokens (parity's defaults). One JSON line per (tree, command).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
    "zero_optimization": {"stage": 1},
    "dhelix": {"enabled": True, "schedule": "si", "tensor_parallel": {"size": 2}},
}


def watch(cmd: list[str], env: dict) -> dict:
    """Run ``cmd``; its return code, the machine's and the largest process's peak RSS (GiB)."""
    import psutil

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    reader = threading.Thread(target=lambda: tail.extend(proc.stdout.readlines()[-20:]))
    reader.start()
    root, peak_sum, peak_one = psutil.Process(proc.pid), 0, 0
    while proc.poll() is None:
        rss = []
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    rss.append(p.memory_info().rss)
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        if rss:
            peak_sum, peak_one = max(peak_sum, sum(rss)), max(peak_one, max(rss))
        time.sleep(0.2)
    reader.join()
    if proc.returncode != 0:
        sys.stderr.write("".join(tail))
    return {"rc": proc.returncode, "machine_peak_gib": round(peak_sum / 2**30, 2),
            "largest_process_peak_gib": round(peak_one / 2**30, 2)}  # fmt: skip


def run(tree: str, model: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    bin_dir = os.path.dirname(sys.executable)
    out = []
    parity = [sys.executable, "-m", "ds_dhelix.cli", "parity", "--model", model, "--tp", "2", "--steps", "2",
              "--seq-len", "64"]  # fmt: skip
    out.append({"tree": tree, "command": "dhelix parity", **watch(parity, env)})
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "ds.json")
        with open(cfg, "w") as f:
            json.dump(CONFIG, f)
        train = [os.path.join(bin_dir, "deepspeed"), "--num_gpus", "2", os.path.join(tree, "train.py"), "--deepspeed",
                 cfg, "--model", model, "--tokenizer", "corpus", "--steps", "2", "--seq-len", "64", "--output-dir",
                 os.path.join(tmp, "out")]  # fmt: skip
        out.append({"tree": tree, "command": "train.py", **watch(train, env)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--tree", action="append", help="checkout(s) to run from (default: this one)")
    args = p.parse_args()
    for tree in args.tree or ["."]:
        for row in run(os.path.abspath(tree), os.path.abspath(args.model)):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
