"""A model whose vocabulary is most of it, trained for a few steps with ``train.py`` at TP=2: the
parameters, optimizer state and training peak per rank, and the step time (what the vocabulary
split over TP changes; ``hf_models/vocab.py``).

    python -m benchmarks.vocab_memory [--out DIR] [--steps 3] [--seq-len 128] [--tree PATH]

Writes Qwen2.5-0.5B's layout (24 layers, hidden 896, vocabulary 151,936, tied; random weights,
fp32) under ``--out`` once, then runs ``deepspeed --num_gpus 2 train.py`` on it from ``--tree``
(default: this checkout; give another checkout to measure it side by side) and prints one JSON
line of the summary's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

LAYOUT = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    "zero_optimization": {"stage": 1},
    "dhelix": {"enabled": True, "schedule": "si", "tensor_parallel": {"size": 2}},
}


def write_checkpoint(path: str) -> str:
    """Qwen2.5-0.5B's layout with random weights at ``path`` (kept when already there)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**LAYOUT), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def run(tree: str, model: str, steps: int, seq_len: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg, out = os.path.join(tmp, "ds.json"), os.path.join(tmp, "summary.json")
        with open(cfg, "w") as f:
            json.dump(CONFIG, f)
        launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        cmd = [launcher, "--num_gpus", "2", os.path.join(tree, "train.py"), "--deepspeed", cfg, "--model", model,
               "--tokenizer", "corpus", "--steps", str(steps), "--seq-len", str(seq_len), "--output-dir", os.path.join(tmp, "out"),
               "--json-summary", out]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": tree}
        subprocess.run(cmd, cwd=tmp, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            s = json.load(f)
    mem = s["memory"]
    return {
        "tree": tree,
        "parameters_per_rank_M": [m["parameters"] / 1e6 for m in mem],
        "optimizer_state_GiB": [m["optimizer_state_bytes"] / 2**30 for m in mem],
        "train_peak_GiB": [m["train_peak_rss_mib"] / 1024 for m in mem],
        "median_step_s": s["median_step_s"],
        "losses": s["losses"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/qwen2.5-0.5b-layout")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--tree", action="append", help="checkout(s) to run train.py from (default: this one)")
    args = p.parse_args(argv)
    model = write_checkpoint(args.out)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for tree in args.tree or [here]:
        print(json.dumps(run(os.path.abspath(tree), model, args.steps, args.seq_len)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
