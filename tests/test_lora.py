"""LoRA (PEFT models) and partial fine-tuning through the real DeepSpeed engine on gloo ranks.

layouts      one 2-rank world for TP=2 (Llama, GPT-2's fused Conv1D c_attn, Phi-3's fused qkv_proj and
             gate_up_proj, GPT-NeoX), kv heads replicated (kv=1 at TP=2, LoRA on k/v), ZeRO-2, EP=2 (LoRA on
             an MoE family's attention), Ulysses CP=2; PP=2 W in its own worlds. For each: LoRA with SI
             equals LoRA sequential bitwise over 3 steps, and losses and first-step adapter gradients
             are close to the unsharded single-process PEFT model (``ds_dhelix.verify``'s tolerances)
refusals     what the engine cannot honour of a PEFT model: one ValueError line naming it
initialize   DeepSpeed's idiom model_parameters=[p ... if p.requires_grad] maps onto the sharded
             parameters, frozen ones stay bit for bit; a PEFT model's adapter export loads with
             PeftModel.from_pretrained and its merged export with plain transformers, both
             reproducing the trained model's loss
train.py     --lora-r from a checkpoint directory (sharded loading, factors drawn per shard): the
             adapter reproduces the run's probe loss, the base files are untouched, checkpoints
             hold only the adapter, and a stopped run resumed is bitwise the uninterrupted one
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from ds_dhelix.verify import ParityOptions, run_parities, run_parity
from tests.conftest import free_port, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KV1_DIR = os.path.join(tempfile.gettempdir(), "dhelix-test-llama-kv1")


def kv1_dir() -> str:
    """A 2-layer Llama checkpoint with one kv head (TP=2 replicates it)."""
    if not os.path.isfile(os.path.join(KV1_DIR, "config.json")):
        from hf_models.registry import build_model

        model, _ = build_model("tiny-llama", seed=5, num_layers=2, overrides={"num_key_value_heads": 1})
        model.save_pretrained(KV1_DIR)
    return KV1_DIR


def lora(targets, r=4) -> dict:
    return {"r": r, "lora_alpha": 8, "target_modules": list(targets)}


LAYOUTS = {
    "llama-tp2": dict(model="tiny-llama", lora=lora(ALL_LLAMA)),
    "gpt2-tp2": dict(model="tiny-gpt2", lora=lora(["c_attn", "c_proj", "c_fc"])),
    "phi3-tp2": dict(model="tiny-phi3", lora=lora(["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])),
    "neox-tp2": dict(model="tiny-gpt-neox", lora=lora(["query_key_value", "dense_4h_to_h"])),
    "kv1-tp2-zero2": dict(model=KV1_DIR, num_layers=None, zero_stage=2, lora=lora(["q_proj", "k_proj", "v_proj"])),
    "qwen3moe-ep2": dict(
        model="tiny-qwen3-moe",
        tp=1,
        dp=2,
        extra={"expert_parallel": {"size": 2}},
        lora=lora(["q_proj", "k_proj", "v_proj", "o_proj"]),
    ),
    "qwen3-cp2": dict(model="tiny-qwen3", tp=1, cp=2, lora=lora(["q_proj", "v_proj", "down_proj"])),
    # MLA: the latent projections stay whole on both TP ranks, their factors too; q_b / kv_b are cut
    "deepseek-tp2": dict(
        model="tiny-deepseek-v3", lora=lora(["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])
    ),
}


def options(name: str) -> ParityOptions:
    return ParityOptions(**{"num_layers": 2, "seq_len": 32, "steps": 3, **LAYOUTS[name]})


@functools.cache
def results() -> dict:
    kv1_dir()
    return dict(zip(LAYOUTS, run_parities([options(n) for n in LAYOUTS], timeout=840)))


def _judge(r: dict, label: str = "si") -> None:
    assert r["bitwise_equal"], r["max_abs_diff_vs_sequential"]
    assert r["losses"][label] == r["losses"]["sequential"]
    assert r["hf_close"] and r["ok"], (r["max_abs_diff_vs_hf"], r["max_loss_diff_vs_hf"], r["losses"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_si_bitwise_and_close_to_peft(layout):
    r = results()[layout]
    _judge(r)
    assert r["losses"]["si"][0] != r["losses"]["si"][-1]  # the adapter trains


@pytest.mark.timeout(600)
def test_lora_folded_pipeline_w():
    r = run_parity(
        ParityOptions(
            model="tiny-llama",
            tp=1,
            pp=2,
            schedule="w",
            num_layers=4,
            seq_len=32,
            steps=3,
            lora=lora(["q_proj", "v_proj", "gate_proj", "down_proj"]),
        ),
        timeout=580,
    )
    _judge(r, "pp2-w")


# ---------------------------------------------------------------------------------- refusals
def _peft(config: dict, model="tiny-llama", second=None):
    from peft import LoraConfig, get_peft_model

    from hf_models.registry import build_model

    model = get_peft_model(build_model(model, seed=1, num_layers=1)[0], LoraConfig(**config))
    if second is not None:
        model.add_adapter("other", LoraConfig(**second))
    return model


@pytest.mark.parametrize(
    "config, second, model, named",
    [
        (dict(r=4, target_modules=["q_proj"], use_dora=True), None, "tiny-llama", "use_dora=True"),
        (dict(r=4, target_modules=["q_proj"], bias="lora_only"), None, "tiny-llama", "bias='lora_only'"),
        (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), None, "tiny-llama", "modules_to_save"),
        (dict(r=4, target_modules=["lm_head"]), None, "tiny-llama", "LoRA on lm_head"),
        (dict(r=4, target_modules=["embed_tokens"]), None, "tiny-llama", "embed_tokens"),
        (
            dict(r=4, target_modules=["gate"]),
            None,
            "tiny-qwen3-moe",
            "target_parameters",
        ),  # the router: PEFT targets its tensor
        (dict(r=4, target_modules=["q_proj"]), dict(r=2, target_modules=["v_proj"]), "tiny-llama", "2 adapters"),
    ],
)
def test_unsupported_peft_settings_are_refused_in_one_line(config, second, model, named):
    from hf_models.adapters import unwrap_peft

    with pytest.raises(ValueError) as err:
        unwrap_peft(_peft(config, model, second))
    msg = str(err.value)
    assert named in msg and "\n" not in msg, msg


def test_another_adapter_type_is_refused():
    from peft import IA3Config, get_peft_model

    from hf_models.adapters import unwrap_peft
    from hf_models.registry import build_model

    model = get_peft_model(
        build_model("tiny-llama", seed=1, num_layers=1)[0],
        IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
    )
    with pytest.raises(ValueError, match="PEFT adapter type IA3: ds_dhelix shards and schedules LoRA only"):
        unwrap_peft(model)


# ---------------------------------------------------------------------------------- initialize
def _rank_initialize(rank, world, out_dir):
    import ds_dhelix
    from ds_dhelix.verify import make_batches, with_lora
    from hf_models.registry import build_model

    opts = ParityOptions(model="tiny-llama", num_layers=2, seq_len=32, steps=3)
    batches = make_batches(opts, 2048)
    # partial fine-tuning with DeepSpeed's idiom: embeddings and attention frozen
    model = build_model("tiny-llama", seed=3, num_layers=2)[0]
    for name, p in model.named_parameters():
        p.requires_grad = not ("embed" in name or "self_attn" in name)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine, *_ = ds_dhelix.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=opts.ds_config("si")
    )
    trained_before = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    for step in batches:
        engine.train_batch(iter(step))
    from ds_dhelix.engine.checkpoint import full_state_dict

    after = full_state_dict(engine.module, engine.groups.tp_grad_group, engine.groups.tp_size)
    frozen_same = all(torch.equal(after[n], frozen[n]) for n in frozen)
    trained_moved = all(
        not torch.equal(p.detach(), trained_before[n]) for n, p in engine.module.named_parameters() if p.requires_grad
    )
    engine.destroy()
    # a PEFT model: adapter and merged exports of what it trained. Each rank draws its own factors and
    # norm (as a script without a seed would): initialize makes the TP-replicated copies rank 0's
    peft_model = with_lora(build_model("tiny-llama", seed=3, num_layers=2)[0], lora(ALL_LLAMA), seed=3 + rank)
    with torch.no_grad():
        peft_model.base_model.model.model.norm.weight.add_(rank)
    engine, *_ = ds_dhelix.initialize(model=peft_model, config=opts.ds_config("si"))
    replicated = [p.detach().clone() for p in engine.graph.replicated.params]
    copies = [None] * world
    torch.distributed.all_gather_object(copies, replicated)
    tp_copies_equal = all(torch.equal(a, b) for a, b in zip(*copies))
    for step in batches:
        engine.train_batch(iter(step))
    probe = {"input_ids": batches[0][0]["input_ids"], "labels": batches[0][0]["labels"]}
    loss = float(engine.eval_batch(iter([probe] * opts.micro_batches)))
    engine.export_adapter(os.path.join(out_dir, "adapter"))
    engine.export_hf(os.path.join(out_dir, "merged"))
    engine.destroy()
    return (
        {
            "frozen_same": frozen_same,
            "frozen": len(frozen),
            "trained_moved": trained_moved,
            "tp_copies_equal": (tp_copies_equal, len(replicated)),
            "loss": loss,
            "probe": probe["input_ids"],
        }
        if rank == 0
        else None
    )


@pytest.mark.timeout(600)
def test_initialize_idiom_frozen_parameters_and_both_exports(tmp_path):
    out = run_ranks(_rank_initialize, 2, args=(str(tmp_path),), timeout=580)[0]
    assert out["frozen"] > 0 and out["frozen_same"] and out["trained_moved"], out
    assert out["tp_copies_equal"][0] and out["tp_copies_equal"][1] > 10, out["tp_copies_equal"]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_models.registry import build_model

    ids = out["probe"]
    base = build_model("tiny-llama", seed=3, num_layers=2)[0]
    with torch.no_grad():
        peft_loss = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids, labels=ids).loss
        merged_loss = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=ids, labels=ids).loss
    # fp32: the sharded model sums TP partial products in another order, the merge adds B @ A once: ~1e-6
    assert abs(float(peft_loss) - out["loss"]) < 1e-4, (float(peft_loss), out["loss"])
    assert abs(float(merged_loss) - out["loss"]) < 1e-4, (float(merged_loss), out["loss"])


# ---------------------------------------------------------------------------------- train.py
def _train(tmp_path, name: str, *extra: str) -> dict:
    summary = tmp_path / f"{name}.json"
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        os.path.join(ROOT, "train.py"),
        "--deepspeed",
        os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json"),
        "--seq-len",
        "32",
        "--steps",
        "6",
        "--json-summary",
        str(summary),
        *extra,
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(summary.read_text()) if summary.exists() else {}


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_py_lora_adapter_resume_and_untouched_base(tmp_path):
    from hf_models.registry import build_model, load_tokenizer_for

    base = tmp_path / "base"
    build_model("tiny-llama", seed=1234)[0].save_pretrained(base)
    load_tokenizer_for("tiny-llama").save_pretrained(base)
    before = _sha(base / "model.safetensors")
    lora_args = ("--model", str(base), "--lora-r", "8")
    whole = _train(tmp_path, "whole", *lora_args, "--output-dir", str(tmp_path / "adapter"))
    assert _sha(base / "model.safetensors") == before
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter").eval()
    ids = torch.tensor(whole["probe_input_ids"])
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    # fp32; the sharded model sums TP partial products in another order: ~1e-6 relative
    assert abs(loss - whole["probe_loss"]) < 1e-4, (loss, whole["probe_loss"])
    assert whole["memory"][0]["trainable_parameters"] < 0.1 * whole["memory"][0]["parameters"]
    # stopped after 3 steps with a checkpoint, resumed to 6: bitwise the uninterrupted run
    ckpt = tmp_path / "ckpt"
    _train(
        tmp_path,
        "first",
        *lora_args,
        "--output-dir",
        str(tmp_path / "a1"),
        "--ds-checkpoint",
        str(ckpt),
        "--stop-after",
        "3",
    )
    states = [os.path.join(dp, f) for dp, _, fs in os.walk(ckpt) for f in fs if f.endswith("model_states.pt")]
    module = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    assert module and all(k.endswith((".lora_A", ".lora_B")) for k in module), sorted(module)[:4]
    resumed = _train(
        tmp_path,
        "resumed",
        *lora_args,
        "--output-dir",
        str(tmp_path / "a2"),
        "--ds-checkpoint",
        str(ckpt),
        "--resume",
        "auto",
    )
    assert resumed["start_step"] == 3 and resumed["losses"] == whole["losses"][3:], (resumed["losses"], whole["losses"])
    assert resumed["probe_loss"] == whole["probe_loss"]


def test_the_handed_over_peft_model_refuses_to_save_an_empty_adapter(tmp_path):
    from hf_models.adapters import unwrap_peft

    model = _peft(dict(r=4, target_modules=["q_proj"]))
    hf, info = unwrap_peft(model)
    assert (
        list(info.scales) == ["model.layers.0.self_attn.q_proj"]
        and hf.model.layers[0].self_attn.q_proj.lora_A.shape[0] == 4
    )
    with pytest.raises(RuntimeError, match="engine.export_adapter"):
        model.save_pretrained(tmp_path)


def test_parity_lora_flags_name_a_target_the_family_lacks(capsys):
    from ds_dhelix import cli

    assert cli.main(["parity", "--model", "tiny-qwen3", "--lora-r", "4", "--lora-targets", "q_proj,embed_tokens"]) == 2
    err = capsys.readouterr().err
    assert "--lora-targets embed_tokens: the qwen3 op graph does not call such a module" in err, err
    assert cli.main(["parity", "--model", "tiny-qwen3", "--lora-targets", "q_proj"]) == 2
    assert "add --lora-r R" in capsys.readouterr().err


def test_an_init_the_meta_path_cannot_draw_is_refused(tmp_path):
    """Sharded loading draws the factors as PEFT's default does; another init_lora_weights is refused."""
    from peft import LoraConfig, get_peft_model

    from hf_models.adapters import unwrap_peft
    from hf_models.loading import empty_model
    from hf_models.lora import init_meta_factors
    from hf_models.registry import build_model

    build_model("tiny-llama", seed=1, num_layers=1)[0].save_pretrained(tmp_path)
    for init, ok in ((True, True), ("gaussian", False)):
        hf, info = unwrap_peft(
            get_peft_model(
                empty_model(str(tmp_path)), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=init)
            )
        )
        hf.dhelix_lora = info
        if ok:
            assert init_meta_factors(hf, seed=3) == 2 and not hf.model.layers[0].self_attn.q_proj.lora_A.is_meta
            assert torch.count_nonzero(hf.model.layers[0].self_attn.q_proj.lora_B) == 0
        else:
            with pytest.raises(ValueError, match="init_lora_weights='gaussian' on a model built on the meta device"):
                init_meta_factors(hf, seed=3)
