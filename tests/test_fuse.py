"""Fused runs (``dhelix.fuse_ops``, ``ds_dhelix/graph/fuse.py``): each block's COMP ops between two
collectives run as one op.

    the fused blocks are the runs between the collectives, with the inputs and outputs liveness
    gives (written out by hand for tiny-llama at TP = 2); selective recompute keeps its ops apart;
    what crosses a pipeline boundary does not change
    fused tiny-llama (TP = 1) gives HF's gradients bit for bit; SI with deferred weight gradients is
    sequential bit for bit on the fused graph, in one engine call per fused op, fused and unfused
    agreeing to rounding: ``tests/test_wgrad.py`` (its SI test runs both graphs)
    through the engine (TP = 2, gloo): fused by default, ``"fuse_ops": false`` runs the adapter's
    ops, SI = sequential bitwise either way, fused ~ unfused
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from ds_dhelix.graph.fuse import fuse
from ds_dhelix.pipe.engine import live_keys
from ds_dhelix.verify import ParityOptions, random_batches
from hf_models.adapters import adapter_for
from hf_models.registry import build_model
from tests.conftest import run_ranks
from tests.test_wgrad import FUSED_VS_UNFUSED_ATOL, _step


def _names(graph):
    return [[(op.name, op.inputs, op.outputs) for op in block] for block in graph.blocks]


def test_fused_blocks_are_the_runs_between_collectives():
    model, _ = build_model("tiny-llama", seed=0, num_layers=2)
    graph = fuse(adapter_for(model.config).build_graph(model, 2, 0, None, None))
    layer = [
        ("attn.norm", ("h",), ("x",)),
        ("attn.ag", ("x",), ("xf",)),
        ("attn.qkv+attn.core+attn.out", ("xf",), ("ao",)),
        ("attn.rs", ("ao",), ("ar",)),
        ("mlp.norm", ("h", "ar"), ("h2", "x2")),
        ("mlp.ag", ("x2",), ("x2f",)),
        ("mlp.up+mlp.down", ("x2f",), ("mo",)),
        ("mlp.rs", ("mo",), ("mr",)),
        ("mlp.add", ("h2", "mr"), ("h",)),
    ]
    assert _names(graph) == [
        [("embed", (), ("he",)), ("embed.rs", ("he",), ("h",))],
        layer,
        layer,
        [
            ("head.norm", ("h",), ("y",)),
            ("head.ag", ("y",), ("yf",)),
            ("head.logits+head.lse", ("yf",), ("st",)),
            ("head.lse_a2a", ("st",), ("stf",)),
            ("head.loss", ("stf",), ("loss",)),
        ],
    ]
    fused = graph.blocks[1][2]
    assert fused.linear and [m.name for m in fused.members] == ["attn.qkv", "attn.core", "attn.out"]


def test_selective_recompute_keeps_its_ops_apart():
    model, _ = build_model("tiny-llama", seed=0, num_layers=1)
    graph = fuse(adapter_for(model.config).build_graph(model, 2, 0, None, None), "selective")
    assert [op.name for op in graph.blocks[1]] == [
        "attn.norm",
        "attn.ag",
        "attn.qkv",
        "attn.core",  # selective: recomputed alone
        "attn.out",
        "attn.rs",
        "mlp.norm",
        "mlp.ag",
        "mlp.up",
        "mlp.down",  # selective
        "mlp.rs",
        "mlp.add",
    ]


def test_pipeline_boundaries_carry_what_they_carried():
    model, _ = build_model("tiny-qwen3-moe", seed=0, num_layers=3)
    plain = adapter_for(model.config).build_graph(model)
    fused = fuse(adapter_for(model.config).build_graph(copy.deepcopy(model)))
    assert [len(b) for b in fused.blocks] == [1, 1, 1, 1, 1]
    for block in range(len(plain.blocks) - 1):
        assert live_keys(fused, block) == live_keys(plain, block)


def test_fused_llama_gives_hfs_gradients_bitwise():
    ref, _ = build_model("tiny-llama", seed=0, num_layers=2)
    batches = random_batches(ref.config.vocab_size, 2, 1, 16)
    hf = copy.deepcopy(ref)
    hf_losses = []
    for b in batches:
        loss = hf(input_ids=b["input_ids"], labels=b["labels"]).loss / len(batches)
        loss.backward()
        hf_losses.append(loss.detach() * len(batches))
    losses, grads, _, _ = _step(copy.deepcopy(ref), batches, "sequential", False, fused=True)
    grads = {n: g for n, g in grads.items() if g is not None}
    assert all(torch.equal(a, b) for a, b in zip(losses, hf_losses))
    assert set(grads) == {n for n, p in hf.named_parameters() if p.grad is not None}
    assert [n for n, p in hf.named_parameters() if p.grad is not None and not torch.equal(grads[n], p.grad)] == []


def _legs(rank, world, opts: ParityOptions, batches_of):
    from ds_dhelix.verify import make_batches, train_schedule
    from hf_models.registry import load_config

    batches = make_batches(opts, load_config(opts.model).vocab_size)
    out = {}
    for fused in (True, False):
        leg = replace(opts, extra={"fuse_ops": fused})
        for schedule in ("sequential", "si"):
            out[fused, schedule] = train_schedule(leg, schedule, batches)
    return out if rank == 0 else None


@pytest.mark.timeout(400)
def test_engine_fuses_by_default_and_fuse_ops_false_runs_the_adapters_ops():
    opts = ParityOptions(model="tiny-llama", tp=2, num_layers=2, seq_len=32, steps=2)
    out = run_ranks(_legs, 2, args=(opts, None), timeout=360)[0]
    for fused in (True, False):
        seq, si = out[fused, "sequential"], out[fused, "si"]
        assert si["losses"] == seq["losses"]
        assert all(torch.equal(si["params"][k], seq["params"][k]) for k in seq["params"])
    a, b = out[True, "sequential"], out[False, "sequential"]
    assert "attn.qkv+attn.core+attn.out" in a["ops"] and "attn.qkv+attn.core+attn.out" not in b["ops"]
    assert {"attn.qkv", "attn.core", "attn.out"} <= set(b["ops"])
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= FUSED_VS_UNFUSED_ATOL
    assert max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"]) <= FUSED_VS_UNFUSED_ATOL
