"""Adapter tier, registry part: tiny presets build, train a step's forward/backward and round-trip
through save_pretrained -> from_pretrained with identical logits; family specs derive from their
base by difference."""

import ast
import dataclasses
import importlib
import inspect
import json

import pytest
import torch

from ds_dhelix.data import BOS_ID, EOS_ID, PAD_ID, batch_iterator, build_embedded_corpus, encode_text, train_tokenizer
from hf_models.adapters import ADAPTERS
from hf_models.moe_family import grouped_sigmoid_route
from hf_models.registry import PRESETS, build_model, is_preset, load_config, load_tokenizer_for

EXPECTED = {
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    "tiny-gpt2": dict(
        model_type="gpt2",
        n_embd=128,
        n_layer=4,
        n_head=4,
        n_positions=512,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
    ),
    "tiny-gpt-neox": dict(
        model_type="gpt_neox",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        use_parallel_residual=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    ),
    "tiny-phimoe": dict(
        model_type="phimoe",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        input_jitter_noise=0.0,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    ),
    "tiny-mixtral": dict(
        model_type="mixtral",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    ),
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    ),
    "tiny-olmoe": dict(
        model_type="olmoe",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", hidden_size=128, num_hidden_layers=4, num_key_value_heads=2, use_sliding_window=False
    ),
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=128, num_hidden_layers=4, num_key_value_heads=2, head_dim=32),
    "tiny-mistral": dict(
        model_type="mistral", hidden_size=128, num_hidden_layers=4, num_key_value_heads=2, sliding_window=8
    ),  # shorter than every test sequence: the window is exercised
    "tiny-gemma3": dict(
        model_type="gemma3_text",
        hidden_size=128,
        num_hidden_layers=4,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=8,
        tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "tiny-phi3": dict(
        model_type="phi3",
        hidden_size=128,
        num_hidden_layers=4,
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
        resid_pdrop=0.0,
        pad_token_id=0,
    ),
    "tiny-smollm3": dict(
        model_type="smollm3",
        hidden_size=128,
        num_hidden_layers=4,
        no_rope_layers=[1, 1, 1, 0],
        tie_word_embeddings=True,
        pad_token_id=0,
    ),
    "tiny-olmo3": dict(
        model_type="olmo3",
        hidden_size=128,
        num_hidden_layers=4,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "tiny-qwen2-moe": dict(
        model_type="qwen2_moe",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        qkv_bias=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    ),
    "tiny-deepseek-v3": dict(
        model_type="deepseek_v3",
        hidden_size=128,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    ),
    "tiny-glm4-moe": dict(
        model_type="glm4_moe",
        hidden_size=128,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
    ),
    "tiny-gpt-oss": dict(
        model_type="gpt_oss",
        hidden_size=128,
        num_hidden_layers=4,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_local_experts=4,
        num_experts_per_tok=2,
        attention_bias=True,
        output_router_logits=True,
    ),
    "tiny-qwen3-moe-mixed": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        num_hidden_layers=4,
        num_experts=4,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        output_router_logits=True,
    ),
    "tiny-qwen3-5": dict(
        model_type="qwen3_5_text",
        hidden_size=128,
        num_hidden_layers=4,
        head_dim=32,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    "tiny-qwen3-5-moe": dict(
        model_type="qwen3_5_moe_text",
        hidden_size=128,
        num_hidden_layers=4,
        head_dim=32,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=256,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    ),
}
EAGER = {"tiny-gpt-oss": "transformers has no sdpa kernel for gpt-oss's attention sinks"}
AUX_LOSS = (
    "tiny-phimoe",
    "tiny-mixtral",
    "tiny-qwen3-moe",
    "tiny-olmoe",
    "tiny-qwen2-moe",
    "tiny-gpt-oss",
    "tiny-qwen3-moe-mixed",
    "tiny-qwen3-5-moe",
)  # (DeepSeek-V3 and GLM-4.5 train no load-balancing loss)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "dhelix-cache"  # shared with test_data.py


@pytest.fixture(scope="session")
def batch(cache_dir):
    """One real micro-batch [2, 64] of the embedded corpus."""
    tokenizer = load_tokenizer_for("tiny-llama", cache_dir)
    ids = encode_text(tokenizer, build_embedded_corpus()[:20_000])
    return next(batch_iterator(ids, micro_batch_size=2, seq_len=64, seed=0))


TINY = tuple(n for n in PRESETS if n.startswith("tiny-"))


def test_preset_names():
    assert PRESETS == (
        "small-llama",
        "small-phimoe",
        "tiny-deepseek-v3",
        "tiny-gemma3",
        "tiny-glm4-moe",
        "tiny-gpt-neox",
        "tiny-gpt-oss",
        "tiny-gpt2",
        "tiny-llama",
        "tiny-mistral",
        "tiny-mixtral",
        "tiny-olmo3",
        "tiny-olmoe",
        "tiny-phi3",
        "tiny-phimoe",
        "tiny-qwen2",
        "tiny-qwen2-moe",
        "tiny-qwen3",
        "tiny-qwen3-5",
        "tiny-qwen3-5-moe",
        "tiny-qwen3-moe",
        "tiny-qwen3-moe-mixed",
        "tiny-smollm3",
    )
    assert all(is_preset(n) for n in PRESETS) and not is_preset("llama")


@pytest.mark.parametrize("name, params", [("small-llama", 98.6e6), ("small-phimoe", 98.7e6)])
def test_small_presets_have_real_shapes(name, params):
    """The memory / speed presets: hidden 1024, 8 layers, 16 heads, 8 KV heads, ~100M parameters
    (counted on the meta device: nothing is initialised)."""
    from hf_models.loading import empty_model

    config = load_config(name)
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
    ) == (1024, 8, 16, 8, 2048)
    if name == "small-phimoe":
        assert (config.num_local_experts, config.num_experts_per_tok) == (8, 2)
    else:
        assert config.intermediate_size == 2816
    n = sum(p.numel() for p in empty_model(None, config=config).parameters())
    assert abs(n - params) / params < 0.02, n


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_config_fields(name, cache_dir):
    config = load_config(name)
    for key, value in EXPECTED[name].items():
        assert getattr(config, key) == value, key
    tokenizer = load_tokenizer_for(name, cache_dir)
    assert config.vocab_size == len(tokenizer) == 2048
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)


def test_gpt_neox_partial_rotary():
    assert load_config("tiny-gpt-neox").rope_parameters["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("name", TINY)
def test_build_forward_backward_and_round_trip(name, batch, tmp_path):
    rng_before = torch.random.get_rng_state()
    model, info = build_model(name, seed=1234)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "build_model must not touch the global RNG"
    again, _ = build_model(name, seed=1234)
    other, _ = build_model(name, seed=1235)
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
    assert any(not torch.equal(a, c) for a, c in zip(model.state_dict().values(), other.state_dict().values()))
    assert info.source == "preset" and info.seed == 1234 and info.dtype == "float32"
    assert info.attn_implementation == ("eager" if name in EAGER else "sdpa")
    assert info.model_type == EXPECTED[name]["model_type"]
    assert info.num_parameters == sum(p.numel() for p in model.parameters())

    model.train()
    out = model(**batch)
    assert torch.isfinite(out.loss) and 6.0 < out.loss.item() < 9.0  # ~ln(2048) = 7.6 at random init
    if name in AUX_LOSS:
        assert out.aux_loss is not None and torch.isfinite(out.aux_loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

    model.eval()
    model.save_pretrained(tmp_path)
    loaded, loaded_info = build_model(tmp_path, seed=0)
    loaded.eval()
    assert loaded_info.source == "checkpoint" and loaded_info.seed is None
    assert loaded.state_dict().keys() == model.state_dict().keys()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=batch["input_ids"]).logits, model(input_ids=batch["input_ids"]).logits)


def test_phimoe_routing_deterministic_in_training(batch):
    """router_jitter_noise 0 makes sparsemixer's mask keep only the top expert, so the Gumbel sampling
    has one candidate: training-mode routing does not depend on the RNG."""
    model, _ = build_model("tiny-phimoe", seed=0)
    model.train()
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        losses.append(model(**batch).loss)
    assert torch.equal(losses[0], losses[1])


def test_load_config_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown preset 'tiny-lama'; did you mean 'tiny-llama'\?"):
        load_config("tiny-lama")
    with pytest.raises(ValueError, match=r"'\./no/such/dir' not found"):
        load_config("./no/such/dir")
    with pytest.raises(ValueError, match=r"neither a preset \(.*\) nor a local checkpoint") as err:
        load_config("bert-base")
    assert f"({', '.join(PRESETS)})" in str(err.value)  # every preset, in order
    with pytest.raises(ValueError, match="has no config.json"):
        load_config(tmp_path)


def test_load_tokenizer_for_checkpoint_dirs(tmp_path, cache_dir):
    model, _ = build_model("tiny-gpt2", seed=0)
    bare = tmp_path / "bare"
    model.save_pretrained(bare)
    assert len(load_tokenizer_for(bare, cache_dir)) == 2048  # no tokenizer in the dir: the embedded one

    own = tmp_path / "own"
    model.save_pretrained(own)
    train_tokenizer(build_embedded_corpus()[:50_000], 300).save_pretrained(own)
    assert len(load_tokenizer_for(own, cache_dir)) == 300
    assert json.loads((own / "config.json").read_text())["model_type"] == "gpt2"


# ---- family specs by difference (STYLE.md, "A family is a spec"): each derived spec is its base's
# ``like(...)`` and differs from it in exactly the fields listed here, so a new family of a known kind
# is a handful of lines and a spec cannot quietly restate (or drift from) its base.
SPEC_IDENTITY = {"name", "family", "hf"}  # what every derived family states: its own
SPEC_ROOTS = ("llama", "mixtral", "qwen3_moe", "gpt_oss")  # specs written in full
SPEC_MODULES = ("gpt2", "gpt_neox")  # adapters without a spec dataclass

SPEC_DERIVED = {  # model_type: (base model_type, the fields it states beyond SPEC_IDENTITY)
    "mistral": ("llama", set()),
    "qwen2": ("llama", set()),
    "smollm3": ("llama", set()),
    "qwen3": ("llama", {"qk_norm"}),
    "olmo3": ("llama", {"norms", "qk_norm"}),
    "phi3": ("llama", {"fused_qkv", "fused_gate_up", "resid_dropout"}),
    "gemma3_text": ("llama", {"qk_norm", "norms", "softcap"}),
    "qwen3_5_text": ("qwen3", {"attention", "linear_attention"}),
    "phimoe": ("mixtral", {"router", "block_jitter", "noise_keys"}),
    "qwen2_moe": ("qwen3_moe", {"shared_expert", "qk_norm"}),
    "olmoe": ("qwen3_moe", {"inter_key", "qk_norm"}),
    "qwen3_5_moe_text": ("qwen3_moe", {"shared_expert", "attention", "linear_attention"}),
    "deepseek_v3": ("qwen3_moe", {"experts_key", "shared_expert", "qk_norm", "attention", "route", "aux_loss"}),
    "glm4_moe": ("deepseek_v3", {"attention", "qk_norm"}),
}


def family_spec(model_type: str):
    module = importlib.import_module(ADAPTERS[model_type])
    assert module.ADAPTER.FAMILY is module.FAMILY  # the spec the registry's adapter runs
    return module.FAMILY


def spec_fields(family) -> dict:
    # not dataclasses.asdict: it deep-copies, and ``hf`` is a module
    return {f.name: getattr(family, f.name) for f in dataclasses.fields(family)}


def stated_keywords(model_type: str) -> set[str]:
    """The keywords of the module's ``FAMILY = <base>.like(...)``: what its source states."""
    tree = ast.parse(inspect.getsource(importlib.import_module(ADAPTERS[model_type])))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["FAMILY"]:
            call = node.value
            assert isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "like", model_type
            return {k.arg for k in call.keywords}
    raise AssertionError(f"{model_type}: no FAMILY = ....like(...)")


def test_every_family_is_a_root_or_derived():
    assert sorted(SPEC_ROOTS + SPEC_MODULES + tuple(SPEC_DERIVED)) == sorted(ADAPTERS)


@pytest.mark.parametrize("model_type", sorted(SPEC_DERIVED))
def test_derived_spec_differs_only_in_what_it_states(model_type):
    base_type, stated = SPEC_DERIVED[model_type]
    derived, base = spec_fields(family_spec(model_type)), spec_fields(family_spec(base_type))
    differing = {key for key in derived if derived[key] != base[key]}
    assert differing == SPEC_IDENTITY | stated, f"{model_type} vs its base {base_type}"
    assert stated_keywords(model_type) == SPEC_IDENTITY | stated, f"{model_type} states more than it changes"
    assert type(family_spec(model_type)) is type(family_spec(base_type))


def test_like_keeps_functions_and_checks_its_fields():
    glm = family_spec("glm4_moe")
    assert glm.route is grouped_sigmoid_route and glm.route is family_spec("deepseek_v3").route
    with pytest.raises(TypeError):
        family_spec("mixtral").like(no_such_field=1)
    with pytest.raises(AssertionError):  # DenseFamily's own checks run on the derived spec
        family_spec("llama").like(norms="nowhere")
