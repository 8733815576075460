"""Golden losses: the losses of every tiny preset, trained sequentially and with SI on a CPU gloo world
(fp32, fixed seed and data), kept in ``tests/golden/losses.json``. ``tests/test_golden.py`` checks
both schedules against the file, so a change that moves SI and sequential together (an adapter's
math, the data, the optimizer settings) fails even though they still agree with each other.

Regenerate only on purpose, after a change that is meant to move the losses, and say why in the
commit:

    python -m scripts.update_golden            # from the project root, ~1 minute
    python -m scripts.update_golden tiny-qwen3 # only these presets (a new family); the rest kept
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_PATH = os.path.join(ROOT, "tests", "golden", "losses.json")
WORLD = 2

# preset -> its layout on the 2-rank world (dense: TP=2; MoE: EP=2 over DP=2)
LAYOUTS = {
    "tiny-llama": {"tp": 2},
    "tiny-gpt2": {"tp": 2},
    "tiny-gpt-neox": {"tp": 2},
    "tiny-qwen2": {"tp": 2},
    "tiny-qwen3": {"tp": 2},
    "tiny-mistral": {"tp": 2},
    "tiny-gemma3": {"tp": 2},
    "tiny-phi3": {"tp": 2},
    "tiny-smollm3": {"tp": 2},
    "tiny-olmo3": {"tp": 2},
    "tiny-phimoe": {"tp": 1, "dp": 2, "extra": {"expert_parallel": {"size": 2}}},
    "tiny-mixtral": {"tp": 1, "dp": 2, "extra": {"expert_parallel": {"size": 2}}},
    "tiny-qwen3-moe": {"tp": 1, "dp": 2, "extra": {"expert_parallel": {"size": 2}}},
    "tiny-olmoe": {"tp": 1, "dp": 2, "extra": {"expert_parallel": {"size": 2}}},
    "tiny-qwen2-moe": {"tp": 1, "dp": 2, "extra": {"expert_parallel": {"size": 2}}},
    "tiny-deepseek-v3": {"tp": 1, "dp": 2, "extra": {"expert_parallel": {"size": 2}}},
    "tiny-glm4-moe": {"tp": 1, "dp": 2, "extra": {"expert_parallel": {"size": 2}}},
    "tiny-gpt-oss": {"tp": 1, "dp": 2, "extra": {"expert_parallel": {"size": 2}}},
    "tiny-qwen3-moe-mixed": {"tp": 1, "dp": 2, "extra": {"expert_parallel": {"size": 2}}},
    "tiny-qwen3-5": {"tp": 2},
    "tiny-qwen3-5-moe": {"tp": 1, "dp": 2, "extra": {"expert_parallel": {"size": 2}}},
}


def golden_options(preset: str):
    from ds_dhelix.verify import ParityOptions

    return ParityOptions(
        model=preset,
        steps=3,
        micro_batches=4,
        micro_batch_size=2,
        seq_len=32,
        num_layers=2,
        zero_stage=1,
        seed=1234,
        **LAYOUTS[preset],
    )


def _rank(rank, world, presets):
    from ds_dhelix.verify import make_batches, train_schedule
    from hf_models.registry import load_config

    out = {}
    for preset in presets:
        opts = golden_options(preset)
        batches = make_batches(opts, load_config(preset).vocab_size)
        out[preset] = {s: train_schedule(opts, s, batches)["losses"] for s in ("sequential", "si")}
    return out


def run_golden(presets=tuple(LAYOUTS), timeout: float = 600.0) -> dict:
    """``{preset: {"sequential": [losses], "si": [losses]}}`` measured now."""
    from ds_dhelix.runtime.spawn import run_ranks

    return run_ranks(_rank, WORLD, args=(tuple(presets),), timeout=timeout)[0]


def main(argv: list[str] | None = None) -> int:
    import deepspeed
    import torch

    only = list(sys.argv[1:] if argv is None else argv)
    unknown = sorted(set(only) - set(LAYOUTS))
    if unknown:
        print(f"update_golden: error: no layout for {unknown}; known: {sorted(LAYOUTS)}", file=sys.stderr)
        return 2
    losses = run_golden(tuple(only or LAYOUTS))
    if only and os.path.exists(GOLDEN_PATH):  # the other presets keep the losses they have
        with open(GOLDEN_PATH) as f:
            losses = {**json.load(f)["losses"], **losses}
    doc = {
        "about": "losses of 3 optimizer steps per preset (scripts/update_golden.py); regenerate only on purpose",
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "options": {
            p: {k: v for k, v in vars(golden_options(p)).items() if k != "extra"} | LAYOUTS[p] for p in LAYOUTS
        },
        "losses": losses,
    }
    os.makedirs(os.path.dirname(GOLDEN_PATH), exist_ok=True)
    with open(GOLDEN_PATH, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for preset, runs in losses.items():
        print(f"{preset:<14} sequential {runs['sequential']}\n{'':<14} si         {runs['si']}")
    print(f"wrote {GOLDEN_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
