"""ZeRO-3 under SI projected on PCIe / Ethernet clusters (``dhelix predict``'s roofline, no GPU):

    python benchmarks/zero3_projection.py [--out benchmarks/results/zero3/projection.md]

For Llama-2-7B and Llama-3-70B on 16 nodes of 4 A10-class PCIe GPUs (DP 64, bf16, 4096-token
sequences, 8 micro-batches of 1 per rank and step) at 25, 50 and 100 Gbit/s per node: ds_dhelix
sequential and SI (the engine's ops replayed, ``--zero-stage 3``, gathers without prefetch), and
plain ZeRO-3 with a perfect prefetcher (each block's gather fully behind the previous block's
compute of the same micro-batch: per micro-batch max(compute_fwd, gathers) + max(compute_bwd,
gathers + reduce-scatters), a lower bound for DeepSpeed's own). Memory is not modelled here.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CONFIGS = os.path.join(ROOT, "benchmarks", "results", "predict", "configs")
MODELS = {"Llama-2-7B": "llama-2-7b.json", "Llama-3-70B": "llama-3-70b.json"}
NETWORKS = ("eth25", "eth50", "eth100")


def project(model_file: str, network: str) -> dict:
    from ds_dhelix.config.dims import ParallelDims
    from ds_dhelix.predict.costs import roofline_times
    from ds_dhelix.predict.hardware import load_hardware
    from ds_dhelix.predict.report import project as replay
    from ds_dhelix.predict.shapes import RunLayout, model_shape
    from hf_models.outline import config_of, model_outline

    config = config_of(model_file)
    dims = ParallelDims(64, tp=1)
    layout = RunLayout(dims, 4096, 1, 8, "bf16", 3)
    outline, shape = model_outline(config, dims), model_shape(config)
    hw = load_hardware("A10", network=network)
    times = roofline_times(outline, shape, layout, hw)
    modes = replay(
        shape, layout, lambda b: roofline_times(outline, shape, layout.with_micro_batch(b), hw), ["sequential", "si"]
    )
    fwd_c = sum(o.fwd_ms for b in times.blocks for o in b if not o.comm)
    bwd_c = sum(o.bwd_ms + o.wgrad_ms for b in times.blocks for o in b if not o.comm)
    gathers = sum(o.fwd_ms for b in times.blocks for o in b if o.name == "z3.in")
    reduces = sum(o.bwd_ms for b in times.blocks for o in b if o.name == "z3.in")
    per_mb = max(fwd_c, gathers) + max(bwd_c, gathers + reduces)
    tail = sum(times.tail.values())
    ideal_s = (per_mb * layout.micro_batches + tail) / 1e3
    m = modes["modes"]
    return {
        "compute_s": (fwd_c + bwd_c) * layout.micro_batches / 1e3,
        "zero3_comm_s": (2 * gathers + reduces) * layout.micro_batches / 1e3,
        "sequential_s": m["sequential"]["step_time_s"],
        "si_s": m["si"]["step_time_s"],
        "plain_ideal_prefetch_s": ideal_s,
        "tokens_per_step": layout.tokens_per_step,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the markdown table here too")
    args = p.parse_args(argv)
    lines = [
        "| model | network per node | compute s/step | ZeRO-3 traffic s/step | ours sequential s | ours SI s | "
        "SI vs sequential | plain ZeRO-3, perfect prefetch s | SI vs perfect prefetch |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, file in MODELS.items():
        for net in NETWORKS:
            r = project(os.path.join(CONFIGS, file), net)
            lines.append(
                f"| {name} | {net[3:]} Gbit/s | {r['compute_s']:.1f} | {r['zero3_comm_s']:.1f} | "
                f"{r['sequential_s']:.1f} | {r['si_s']:.1f} | {r['sequential_s'] / r['si_s']:.2f}x | "
                f"{r['plain_ideal_prefetch_s']:.1f} | {r['plain_ideal_prefetch_s'] / r['si_s']:.2f}x |"
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
