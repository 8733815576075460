"""Adapter tier: every HF family's op graph against the unpatched HF model (CPU, fp32).

    (a) TP=1 graph, sequential            vs HF: loss and every gradient, close
    (b) TP=2 on 2 gloo ranks, sequential  vs HF: summed loss and gathered gradients, close
    (c) TP=2 SI vs TP=2 sequential, 4 micro-batches: losses and gradients bitwise equal
    (d) sharding keeps the state_dict keys; gather_param and export_hf give back the HF tensors exactly
    (e) check_tp names the dimension TP does not divide and lists the valid sizes

Tolerance of (a) and (b): the graph is the same math as HF but not the same kernels: hidden
states are sequence-first ([s, b, h] instead of [b, s, h]), row-parallel GEMMs run without their
bias (added once after the reduce-scatter instead of fused into addmm) and with TP=2 each
row-parallel GEMM is two half-length dot products summed by the reduce-scatter. That reorders fp32
sums, so results differ by rounding only. Observed max abs diff (losses ~7.6): TP=1 losses <= 4.8e-7,
gradients <= 4.5e-8; TP=2 losses <= 9.5e-7, gradients <= 1.2e-7. We allow rtol=1e-4, atol=1e-5:
two orders above rounding, far below real bugs (a missing gradient hook on wpe gives 5e-2).
"""

from __future__ import annotations

import copy
import functools
import tempfile

import pytest
import torch
import torch.distributed as dist

from ds_dhelix.graph.ops import backward_order
from ds_dhelix.planning.plan import default_plan
from ds_dhelix.runtime.executor import Executor
from hf_models.adapters import adapter_for
from hf_models.common import gather_param
from hf_models.registry import load_config
from tests.conftest import gathered_grad, hf_reference, make_batches, make_config, make_model, process_groups, run_ranks

DENSE_FAMILIES = (
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-gemma3",
    "tiny-phi3",
    "tiny-smollm3",
    "tiny-olmo3",
    "tiny-qwen3-5",
)
"""The presets of the dense family machinery (``hf_models/dense_family.py``)."""
PRESETS = DENSE_FAMILIES + ("tiny-gpt2", "tiny-gpt-neox")
SUITE_OVERRIDES = {  # what these tests' short sequences (SEQ = 16) need to exercise each family's twist
    "tiny-gemma3": (("final_logit_softcapping", 30.0),),
    "tiny-qwen2": (
        ("use_sliding_window", True),
        ("sliding_window", 8),
        ("max_window_layers", 1),
        ("layer_types", ["full_attention", "sliding_attention"]),
    ),
    "tiny-smollm3": (("no_rope_layers", [1, 0]),),
}
TOL = dict(rtol=1e-4, atol=1e-5)  # see the module docstring


def run_graph(model, tp, tp_rank=0, tp_group=None, tp_grad_group=None, batches=(), schedule="sequential"):
    graph = adapter_for(model.config).build_graph(model, tp, tp_rank, tp_group, tp_grad_group)
    specs = graph.layer_specs()
    plan = default_plan(specs, backward_order(specs)) if schedule == "si" else None
    mbs = Executor(graph, plan).run_microbatches(list(batches), schedule, 1.0 / len(batches))
    return [mb.loss.detach().clone() for mb in mbs]


def max_abs(a, b) -> float:
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------------- (a) TP=1
@pytest.mark.timeout(60)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("preset", PRESETS)
def test_tp1_graph_matches_hf(preset, attn):
    config = make_config(preset, attn, **dict(SUITE_OVERRIDES.get(preset, ())))
    ref = make_model(config)
    model = copy.deepcopy(ref)
    batches = make_batches(config.vocab_size, 2)
    want = hf_reference(ref, batches)
    got = run_graph(model, 1, batches=batches)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


VARIANTS = [
    ("tiny-gpt-neox", "sdpa", dict(use_parallel_residual=False)),
    ("tiny-gpt-neox", "sdpa", dict(tie_word_embeddings=True)),
    ("tiny-gpt2", "sdpa", dict(tie_word_embeddings=False)),
    ("tiny-gpt2", "eager", dict(reorder_and_upcast_attn=True, scale_attn_by_inverse_layer_idx=True)),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "preset, attn, overrides",
    VARIANTS,
    ids=["neox-sequential-residual", "neox-tied", "gpt2-untied", "gpt2-upcast-layer-scale"],
)
def test_tp1_config_variants(preset, attn, overrides):
    config = make_config(preset, attn, **overrides)
    ref = make_model(config)
    model = copy.deepcopy(ref)
    batches = make_batches(config.vocab_size, 2)
    want = hf_reference(ref, batches)
    got = run_graph(model, 1, batches=batches)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    ref_params = dict(ref.named_parameters())
    assert ref_params.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


# --------------------------------------------------------------------------------- TP=2 ranks
def _tp2_rank(rank, world, preset, overrides, num_mb):
    """One rank of the TP=2 checks; returns plain numbers and flags (asserted in pytest)."""
    from ds_dhelix.engine.checkpoint import export_hf

    torch.manual_seed(123)  # anything not seeded explicitly must not matter
    layout = process_groups(tp=world)
    config = make_config(preset, **overrides)
    ref = make_model(config)
    keys = list(ref.state_dict().keys())
    batches = make_batches(config.vocab_size, num_mb)
    models, losses = {}, {}
    for schedule in ("sequential", "si"):
        models[schedule] = copy.deepcopy(ref)
        losses[schedule] = run_graph(
            models[schedule], world, layout.tp_rank, layout.tp, layout.tp_grad_group, batches, schedule
        )
    want = hf_reference(ref, batches)
    out = {
        "keys_equal": list(models["sequential"].state_dict().keys()) == keys,
        "num_sharded": sum(getattr(p, "tensor_model_parallel", False) for p in models["si"].parameters()),
    }
    total = [loss.clone() for loss in losses["sequential"]]
    for t in total:
        dist.all_reduce(t, group=layout.tp_grad_group)
    out["loss_diff"] = max(max_abs(t, w) for t, w in zip(total, want))
    out["loss_close"] = all(torch.allclose(t, w, **TOL) for t, w in zip(total, want))
    out["si_losses_equal"] = all(torch.equal(a, b) for a, b in zip(losses["si"], losses["sequential"]))
    ref_params = dict(ref.named_parameters())
    seq_params = dict(models["sequential"].named_parameters())
    out["grad_diff"], out["grad_far"], out["si_grads_differ"], out["params_inexact"] = 0.0, [], [], []
    for name, p in models["si"].named_parameters():
        q = seq_params[name]
        if not torch.equal(p.grad, q.grad):
            out["si_grads_differ"].append(name)
        full_grad = gathered_grad(q, layout.tp_grad_group, world)
        out["grad_diff"] = max(out["grad_diff"], max_abs(full_grad, ref_params[name].grad))
        if not torch.allclose(full_grad, ref_params[name].grad, **TOL):
            out["grad_far"].append(name)
        if not torch.equal(gather_param(q, layout.tp_grad_group, world), ref_params[name].detach()):
            out["params_inexact"].append(name)
    out["export_logits_equal"] = _export_round_trip(export_hf, models["sequential"], ref, batches[0], layout, world)
    return out


def _export_round_trip(export_hf, model, ref, batch, layout, world) -> bool | None:
    """export_hf of the sharded model -> from_pretrained -> the HF model's logits, bitwise (rank 0)."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = export_hf(model, f"{tmp}/hf", tp_group=layout.tp_grad_group, tp_size=world)
        if path is None:
            return None
        back = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=ref.config._attn_implementation
        )
        with torch.no_grad():
            return torch.equal(back(batch["input_ids"]).logits, ref.eval()(batch["input_ids"]).logits)


def _tp2_ranks(rank, world, runs):
    """Several families' TP=2 checks in one world: ``runs`` of (preset, overrides, num_mb)."""
    return [_tp2_rank(rank, world, preset, dict(overrides), num_mb) for preset, overrides, num_mb in runs]


SHAPE_VARIANTS = {  # other shapes than the presets': the adapters must not depend on them
    "qwen2-kv1": ("tiny-qwen2", (("num_key_value_heads", 1),)),  # TP=2 > 1 kv head: replicated (q/k/v biases)
    "llama-kv1": ("tiny-llama", (("num_key_value_heads", 1),)),
    "gemma3-h96": ("tiny-gemma3", (("hidden_size", 96), ("intermediate_size", 192))),
    "phi3-h192": ("tiny-phi3", (("hidden_size", 192), ("intermediate_size", 256))),
    "qwen3-h96": ("tiny-qwen3", (("hidden_size", 96), ("intermediate_size", 192))),
    "qwen3_5-h96": (
        "tiny-qwen3-5",
        (
            ("hidden_size", 96),
            ("intermediate_size", 192),
            ("attention_bias", True),
            ("linear_num_value_heads", 6),
            ("linear_value_head_dim", 16),
            ("linear_conv_kernel_dim", 3),
        ),
    ),
    "llama3-rope": (
        "tiny-llama",
        (
            (
                "rope_parameters",
                {  # Llama 3's rope_type: low frequencies rescaled
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
    ),
}


@functools.cache
def _suite_results() -> dict:
    runs = [(preset, SUITE_OVERRIDES.get(preset, ()), 4) for preset in PRESETS]
    runs += [(preset, SUITE_OVERRIDES.get(preset, ()) + over, 2) for preset, over in SHAPE_VARIANTS.values()]
    names = list(PRESETS) + list(SHAPE_VARIANTS)
    per_rank = run_ranks(_tp2_ranks, 2, args=(runs,), timeout=420)
    return {name: [results[i] for results in per_rank] for i, name in enumerate(names)}


def tp2_results(preset: str, overrides: tuple | None = None, num_mb: int = 4) -> list[dict]:
    """Both ranks' results of the TP=2 checks of ``preset``: the shared world of every preset with its
    suite overrides, or a world of its own for other overrides."""
    if overrides is None and num_mb == 4:
        return _suite_results()[preset]
    return run_ranks(_tp2_rank, 2, args=(preset, dict(overrides or ()), num_mb), timeout=120)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("preset", PRESETS)
def test_tp2_matches_hf(preset):
    for r in tp2_results(preset):
        assert r["loss_close"], f"loss max abs diff {r['loss_diff']}"
        assert not r["grad_far"], f"gradients not close (max abs diff {r['grad_diff']}): {r['grad_far']}"
        assert r["num_sharded"] > 0


@pytest.mark.timeout(480)
@pytest.mark.parametrize("preset", PRESETS)
def test_tp2_si_bitwise_equals_sequential(preset):
    for r in tp2_results(preset):
        assert r["si_losses_equal"]
        assert not r["si_grads_differ"], r["si_grads_differ"]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("preset", PRESETS)
def test_tp2_state_dict_round_trip(preset):
    results = tp2_results(preset)
    for r in results:
        assert r["keys_equal"]
        assert not r["params_inexact"], r["params_inexact"]
    assert results[0]["export_logits_equal"] is True


@pytest.mark.timeout(480)
@pytest.mark.parametrize("variant", list(SHAPE_VARIANTS))
def test_other_shapes_and_replicated_kv_heads(variant):
    """Other widths, Llama 3's RoPE, and TP=2 over one kv head: each rank holds the replicated head,
    the copies' gradients are summed over the ranks sharing it (the gathered gradient is HF's), one
    copy is exported."""
    results = _suite_results()[variant]
    for r in results:
        assert r["loss_close"] and not r["grad_far"], (r["loss_diff"], r["grad_far"])
        assert r["si_losses_equal"] and not r["si_grads_differ"], r["si_grads_differ"]
        assert r["keys_equal"] and not r["params_inexact"], r["params_inexact"]
    assert results[0]["export_logits_equal"] is True


@pytest.mark.timeout(300)
def test_kv_heads_replicated_on_four_ranks():
    """TP=4 over 2 kv heads (Llama) and over 1 (Qwen2, with q/k/v biases): replica groups of 2 and 4."""
    runs = [("tiny-llama", (("num_key_value_heads", 2),), 2), ("tiny-qwen2", (("num_key_value_heads", 1),), 2)]
    for results in zip(*run_ranks(_tp2_ranks, 4, args=(runs,), timeout=240)):
        for r in results:
            assert r["loss_close"] and not r["grad_far"], (r["loss_diff"], r["grad_far"])
            assert r["si_losses_equal"] and not r["si_grads_differ"]
            assert r["keys_equal"] and not r["params_inexact"], r["params_inexact"]
        assert results[0]["export_logits_equal"] is True


@pytest.mark.timeout(150)
def test_tp2_gpt_neox_sequential_residual_tied():
    """The other GPT-NeoX residual and tied embeddings (one Parameter, one gradient hook)."""
    for r in tp2_results("tiny-gpt-neox", (("use_parallel_residual", False), ("tie_word_embeddings", True)), 2):
        assert r["loss_close"] and not r["grad_far"], (r["loss_diff"], r["grad_far"])
        assert r["si_losses_equal"] and not r["si_grads_differ"]
        assert not r["params_inexact"]


# --------------------------------------------------------------------------------- (e) check_tp
@pytest.mark.parametrize(
    "preset, tp, named, valid",
    [
        ("tiny-llama", 3, ["num_attention_heads=4", "intermediate_size=352"], "[1, 2, 4]"),
        ("tiny-gpt2", 8, ["n_head=4"], "[1, 2, 4]"),
        ("tiny-gpt2", 3, ["n_head=4", "n_inner=512"], "[1, 2, 4]"),
        ("tiny-gpt-neox", 8, ["num_attention_heads=4"], "[1, 2, 4]"),
        ("tiny-gpt-neox", 3, ["num_attention_heads=4", "intermediate_size=512"], "[1, 2, 4]"),
    ],
)
def test_check_tp_names_bad_dimension(preset, tp, named, valid):
    config = load_config(preset)
    adapter = adapter_for(config)
    with pytest.raises(ValueError) as err:
        adapter.check_tp(config, tp)
    msg = str(err.value)
    assert f"tensor_parallel.size {tp}" in msg and f"valid TP sizes: {valid}" in msg, msg
    for item in named:
        assert item in msg, msg
    for dim in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "n_head", "n_inner"):
        if not any(item.startswith(dim + "=") for item in named):
            assert f"{dim}=" not in msg, msg  # only the dimensions TP does not divide are named
    adapter.check_tp(config, 2, world=4)  # a valid size passes


@pytest.mark.parametrize("preset", PRESETS)
def test_check_tp_names_world_size(preset):
    config = load_config(preset)
    with pytest.raises(ValueError, match="world_size=3"):
        adapter_for(config).check_tp(config, 2, world=3)


@pytest.mark.parametrize("kv, tp, fine", [(2, 4, True), (1, 4, True), (1, 2, True), (3, 2, False)])
def test_check_tp_kv_heads_divide_or_are_replicated(kv, tp, fine):
    config = load_config("tiny-qwen3")
    config.num_attention_heads, config.num_key_value_heads = 12, kv
    config.intermediate_size = 384
    if fine:
        adapter_for(config).check_tp(config, tp)
        return
    with pytest.raises(
        ValueError,
        match=r"num_key_value_heads=3: TP must divide the kv heads or be a multiple of "
        r"them .* valid TP sizes: \[1, 3, 6, 12\]",
    ):
        adapter_for(config).check_tp(config, tp)


def test_check_tp_refuses_replicated_kv_heads_in_a_fused_qkv():
    config = load_config("tiny-phi3")
    config.num_key_value_heads = 1
    with pytest.raises(ValueError, match="fused qkv_proj: replicating kv heads"):
        adapter_for(config).check_tp(config, 2)


def test_gpt2_check_tp_rejects_cross_attention():
    config = load_config("tiny-gpt2")
    config.add_cross_attention = True
    with pytest.raises(ValueError, match="add_cross_attention"):
        adapter_for(config).check_tp(config, 1)


@pytest.mark.parametrize("act", ["gelu_new", "silu_glu"])
def test_lean_activation_saves_its_inputs_only_and_gives_the_same_gradients(act):
    """``common.lean``: GPT-2's composite gelu_new (and a gate x up product) keeps only its inputs
    for backward, which runs it again: the gradients are bitwise plain autograd's."""
    from transformers.activations import ACT2FN

    from ds_dhelix.runtime.memory import ActivationMeter
    from hf_models.common import lean

    fn = ACT2FN["gelu_new"] if act == "gelu_new" else (lambda g, u: torch.nn.functional.silu(g) * u)
    n_in = 1 if act == "gelu_new" else 2
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(n_in)]
    runs = {}
    for name, call in (("plain", lambda *a: fn(*a)), ("lean", lambda *a: lean(fn, *a))):
        leaves = [x.clone().requires_grad_() for x in xs]
        meter = ActivationMeter()
        with meter.hooks():
            out = call(*leaves)
        out.backward(torch.ones_like(out))
        runs[name] = (out.detach(), [x.grad for x in leaves], meter.peak)
    (o0, g0, saved_plain), (o1, g1, saved_lean) = runs["plain"], runs["lean"]
    assert torch.equal(o0, o1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert saved_lean == n_in * xs[0].nbytes < saved_plain, (saved_lean, saved_plain)
