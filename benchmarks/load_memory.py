"""Host memory of loading one TP rank's shard: the whole-model path (``from_pretrained``, then cut)
against sharded loading (meta model, cut, sliced reads), side by side, each in a fresh process.

    python -m benchmarks.load_memory [--model small-llama] [--tp 2] [--out DIR]

Writes fp32 and bf16 checkpoints of the preset (random init) under ``--out`` once, then for each
checkpoint and path prints the peak resident memory over the process's baseline (after imports)
and the rank's shard bytes, with the target ``1.25 x shard + 64 MiB``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _measure(path: str, how: str, tp: int, rank: int) -> dict:
    """In this process: load rank ``rank``'s TP shard of checkpoint ``path`` by ``how``."""
    import torch

    from ds_dhelix.runtime.memory import peak_rss_mib, reset_peak_rss
    from hf_models.adapters import adapter_for
    from hf_models.loading import CheckpointFiles, empty_model, materialize
    from hf_models.registry import load_config

    config = load_config(path)
    adapter = adapter_for(config)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[str(config.dtype).removeprefix("torch.")]
    reset_peak_rss()
    base = peak_rss_mib()
    if how == "whole":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        adapter.shard(model, tp, rank)
    else:
        model = empty_model(path, dtype)
        adapter.shard(model, tp, rank)
        materialize(model, CheckpointFiles(path))
    shard = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {"load_mib": peak_rss_mib() - base, "shard_mib": shard}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small-llama")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", default="runs/load_memory")
    p.add_argument("--child", nargs=3, metavar=("PATH", "HOW", "RANK"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        path, how, rank = args.child
        print(json.dumps(_measure(path, how, args.tp, int(rank))))
        return 0
    import torch

    from hf_models.registry import build_model

    dirs = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        dirs[name] = os.path.join(args.out, f"{args.model}-{name}")
        if not os.path.isfile(os.path.join(dirs[name], "config.json")):
            model, _ = build_model(args.model, seed=0, dtype=dtype)
            model.save_pretrained(dirs[name])
            del model
    print(f"{args.model}, TP={args.tp}, rank 0: peak RSS over the baseline while loading (MiB)")
    print(f"{'checkpoint':<11}{'path':<10}{'load':>8}{'shard':>8}{'target':>8}  within")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name, path in dirs.items():
        for how in ("whole", "sharded"):
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.load_memory", "--tp", str(args.tp), "--child", path, how, "0"],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            target = 1.25 * r["shard_mib"] + 64
            print(
                f"{name:<11}{how:<10}{r['load_mib']:>8.0f}{r['shard_mib']:>8.0f}{target:>8.0f}  "
                f"{'yes' if r['load_mib'] <= target else 'no'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
