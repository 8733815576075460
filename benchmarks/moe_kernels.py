"""Dispatch + combine kernels of the MoE ops, torch's against tutel's (``dhelix.moe.kernels``), on
one process at a bench step's shapes: per call, the encode (token rows -> the expert-sorted send
buffer, inside ``moe.router``), the decode (expert outputs -> each token's weighted sum, inside
``moe.add``) and their backward; per step, that times the MoE layers and micro-batches of a rank.

    python -m benchmarks.moe_kernels --model tiny-mixtral --tokens 1024 --repeats 30

The routing is the model's router on random hidden states (its top-k, its expert count); the
"experts" between encode and decode are an identity, so only the kernels are timed. Medians and
[min-max] over ``--repeats`` timed calls after ``--warmup`` untimed ones, the two kernels alternated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def time_kernels(kernels, x, logits, top_k: int, num_experts: int, cf: float | None) -> tuple[float, float]:
    """One encode + decode (forward) and their backward: ``(forward_s, backward_s)``."""
    from ds_dhelix.moe.router import route_tokens

    x = x.detach().requires_grad_()
    logits = logits.detach().requires_grad_()
    weights, selected = torch.topk(logits.softmax(-1), top_k)
    t0 = time.perf_counter()
    xs, route = route_tokens(x, selected, num_experts, cf, kernels)
    y = kernels.decode(xs, weights, route)
    t1 = time.perf_counter()
    y.backward(torch.ones_like(y))
    return t1 - t0, time.perf_counter() - t1


def measure(model: str, tokens: int, repeats: int, warmup: int, cf: float | None, seed: int = 0) -> dict:
    from ds_dhelix.moe.kernels import make_kernels
    from hf_models.adapters import num_experts
    from hf_models.registry import load_config

    config = load_config(model)
    experts, top_k, hidden = num_experts(config), config.num_experts_per_tok, config.hidden_size
    g = torch.Generator().manual_seed(seed)
    x, logits = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, experts, generator=g)
    kernels = {name: make_kernels(name) for name in ("torch", "tutel")}
    times = {name: [] for name in kernels}
    for rep in range(warmup + repeats):
        for name in list(kernels) if rep % 2 == 0 else list(kernels)[::-1]:
            fwd, bwd = time_kernels(kernels[name], x, logits, top_k, experts, cf)
            if rep >= warmup:
                times[name].append((fwd, bwd))
    out = {}
    for name, pairs in times.items():
        total = [f + b for f, b in pairs]
        out[name] = {
            "forward_ms": 1e3 * statistics.median(f for f, _ in pairs),
            "backward_ms": 1e3 * statistics.median(b for _, b in pairs),
            "call_ms": 1e3 * statistics.median(total),
            "call_min_ms": 1e3 * min(total),
            "call_max_ms": 1e3 * max(total),
        }
    return {
        "model": model,
        "tokens": tokens,
        "hidden": hidden,
        "experts": experts,
        "top_k": top_k,
        "capacity_factor": cf,
        "repeats": repeats,
        "kernels": out,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-mixtral")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of one micro-batch on one rank (4 x 256)")
    p.add_argument(
        "--calls-per-step",
        type=int,
        default=64,
        help="MoE layers x micro-batches of a rank's step (tiny-mixtral: 4 layers x 16)",
    )
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    r = measure(args.model, args.tokens, args.repeats, args.warmup, args.capacity_factor)
    r["calls_per_step"] = args.calls_per_step
    for k in r["kernels"].values():
        k["per_step_ms"] = k["call_ms"] * args.calls_per_step
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(
        f"{args.model}: {args.tokens} tokens x hidden {r['hidden']}, {r['experts']} experts, top-{r['top_k']}, "
        f"{'dropless' if args.capacity_factor is None else f'capacity factor {args.capacity_factor:g}'}, "
        f"median [min-max] of {args.repeats}"
    )
    for name, k in r["kernels"].items():
        print(
            f"  {name:<6} encode+decode {k['forward_ms']:.3f} ms, backward {k['backward_ms']:.3f} ms, call "
            f"{k['call_ms']:.3f} [{k['call_min_ms']:.3f}-{k['call_max_ms']:.3f}] ms, per step "
            f"({args.calls_per_step} calls) {k['per_step_ms']:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
