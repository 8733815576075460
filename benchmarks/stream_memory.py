"""Peak RSS of train.py streaming a 2 GB chat file against a 10 MB one, and the exit code of each
run (2 ranks, TP=2, SI, 5 steps).

    python -m benchmarks.stream_memory [--kinds parquet jsonl] [--dir DIR] [--runs 5] [--tree PATH]

Writes ``small.<kind>`` (10 MB) and ``big.<kind>`` (2 GB) of repeated chat records under ``--dir``
once (parquet: row groups of 20,000 rows), then prints one line per run: (exit code, the largest
rank's peak RSS in MiB: the most of its baseline, load and training peaks). ``--tree``: the
checkout whose train.py runs (another one to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make(directory: str, kind: str, size: int, name: str) -> str:
    from tests.test_instruct import chat_records, write_parquet

    path = os.path.join(directory, f"{name}.{kind}")
    if os.path.exists(path):
        return path
    records = chat_records(400)
    if kind == "parquet":
        write_parquet(path, records, size, group_rows=min(20_000, max(400, size // 2**16)))
        return path
    block = "".join(json.dumps(r) + "\n" for r in records).encode()
    with open(path, "wb") as f:
        for _ in range(size // len(block) + 1):
            f.write(block)
    return path


def run(tree: str, path: str) -> tuple[int, float | None]:
    from tests.conftest import free_port

    with open(os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json")) as f:
        cfg = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        cfg["tensorboard"]["output_path"] = os.path.join(tmp, "tb")
        cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 2, 2
        config = os.path.join(tmp, "ds.json")
        with open(config, "w") as f:
            json.dump(cfg, f)
        summary = os.path.join(tmp, "s.json")
        cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port",
               str(free_port()), os.path.join(tree, "train.py"), "--deepspeed", config, "--data", path,
               "--chat-template", "chatml", "--packing", "docs", "--seq-len", "64", "--steps", "5",
               "--output-dir", os.path.join(tmp, "hf"), "--json-summary", summary]  # fmt: skip
        proc = subprocess.run(cmd, cwd=tree, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
        if proc.returncode != 0:
            return proc.returncode, None
        with open(summary) as f:
            marks = json.load(f)["memory"]
    return 0, max(max(m["baseline_rss_mib"], m["load_peak_rss_mib"], m["train_peak_rss_mib"]) for m in marks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", default=["parquet", "jsonl"], choices=["parquet", "jsonl"])
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "dhelix-stream-data"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tree", default=ROOT)
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    for kind in args.kinds:
        small, big = make(args.dir, kind, 10 * 2**20, "small"), make(args.dir, kind, 2 * 2**30, "big")
        print(kind, "10 MB:", run(args.tree, small), flush=True)
        for i in range(args.runs):
            print(kind, f"2 GB run {i + 1}:", run(args.tree, big), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
