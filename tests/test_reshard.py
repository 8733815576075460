"""Resume on another layout (``ds_dhelix.engine.reshard``).

carried over   a checkpoint saved at layout A and loaded by an engine at layout B (other random
               init; DeepSpeed's load_checkpoint, which sees the other layout in the shard records,
               or the offline conversion): every trained parameter's fp32 master and both Adam
               moments, gathered to full HF tensors on each side, are bitwise A's; the optimizer
               step, the LR and the step counters continue. TP=2 -> TP=1 x DP=2, DP=2 -> TP=2 in
               bf16, ZeRO-1 -> ZeRO-2 and -> ZeRO-0, ZeRO-0 -> TP=2, EP=2 -> EP=1 (tiny-qwen3-moe),
               CP=2 -> DP=2, Phi-3's fused rows, LoRA factors, PP=2 (W) -> DP=2 and TP=2 -> PP=2.
               Two spawned worlds per case.
refusals       another global batch, ZeRO-0 with EP, records missing,
               the offline command's output checks: one line each, before any model
end to end     (train.py, the real launcher; slow tier) TP=2 -> TP=1 x DP=2 -> one rank and
               ZeRO-1 -> ZeRO-2 and EP=2 -> EP=1: the resumed losses equal a straight run's on the
               new layout; a checkpoint converted offline resumes bitwise on its own layout; the HF
               Trainer's resume_from_checkpoint on another layout (extended tier)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ds_dhelix.runtime.spawn import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def _opts(model: str, layout: dict, seed: int):
    from ds_dhelix.verify import ParityOptions

    ep = layout.pop("ep", 1)
    layout = {"num_layers": 2, "micro_batches": 2, **layout}
    opts = ParityOptions(model=model, steps=2, seq_len=16, seed=seed, **layout)
    if ep > 1 or model.endswith("moe"):
        opts.extra = {"expert_parallel": {"size": ep, "capacity_factor": None}}
    return opts


def _config(opts) -> dict:
    cfg = opts.ds_config("w" if opts.pp > 1 else "si")
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}}
    return cfg


def _layout_state(opts) -> dict:
    return {
        "step": 2,
        "layout": {
            "tp": opts.tp,
            "dp": opts.dp,
            "ep": (opts.extra.get("expert_parallel") or {}).get("size", 1),
            "micro_batch_size": opts.micro_batch_size,
            "gradient_accumulation_steps": opts.micro_batches,
        },
        "precision": {"zero_stage": opts.zero_stage},
    }


def _lr(engine) -> float:
    return engine.optimizer.param_groups[0]["lr"]


def _save_world(rank, world, model, layout, root):
    import ds_dhelix
    from ds_dhelix.engine.reshard import gather_universal
    from ds_dhelix.engine.resume import save
    from ds_dhelix.verify import build, make_batches

    opts = _opts(model, dict(layout), seed=1234)
    engine, *_ = ds_dhelix.initialize(model=build(opts), config=_config(opts))
    batches = make_batches(opts, 2048)
    for step in batches[:2]:
        engine.train_batch(iter(step))
    save(engine, root, _layout_state(opts), keep=1)
    state = gather_universal(engine, KINDS)  # (a pipeline stage's own: every rank answers, the test merges)
    return (state, _lr(engine), engine.global_steps) if rank == 0 or opts.pp > 1 else None


def _load_world(rank, world, model, layout, tag_dir, converted):
    import ds_dhelix
    from ds_dhelix.engine.reshard import gather_universal, load_universal
    from ds_dhelix.verify import build

    opts = _opts(model, dict(layout), seed=999)  # another init: everything must come from the checkpoint
    engine, *_ = ds_dhelix.initialize(model=build(opts), config=_config(opts))
    if converted:
        load_universal(engine, tag_dir)
    else:  # DeepSpeed's API: the engine sees the other layout in the shard records and reshards
        engine.load_checkpoint(os.path.dirname(tag_dir))
    state = gather_universal(engine, KINDS)
    step = (
        {float(s["step"]) for s in engine.optimizer.optimizer.state.values()}
        if hasattr(engine.optimizer, "optimizer")
        else {float(s["step"]) for s in engine.optimizer.state.values()}
    )
    return (
        (state, _lr(engine), engine.global_steps, step, getattr(engine, "loaded_resharded", None))
        if rank == 0 or opts.pp > 1
        else None
    )


ZERO3 = {"zero_stage": 3, "zero": {"stage3_param_persistence_threshold": 0}}
FOUR = {"num_layers": 4, "micro_batches": 4}  # (the W fold over 2 stages: a layer per chunk, 3+ micro-batches)
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"]}


def _merged(results: list):
    """Rank 0's answer, its state merged with the other ranks' (pipeline stages hold their own)."""
    first = list(results[0])
    for other in results[1:]:
        if other is not None:
            for kind in KINDS:
                first[0][kind] = {**other[0][kind], **first[0][kind]}
    return first


CASES = {
    "tp2-to-dp2": ("tiny-llama", {"tp": 2, "dp": 1}, {"tp": 1, "dp": 2}),
    "dp2-to-tp2-bf16": ("tiny-llama", {"tp": 1, "dp": 2, "dtype": "bf16"}, {"tp": 2, "dp": 1, "dtype": "bf16"}),
    "zero1-to-zero2": ("tiny-llama", {"tp": 1, "dp": 2}, {"tp": 1, "dp": 2, "zero_stage": 2}),
    "zero1-to-zero0": ("tiny-llama", {"tp": 2, "dp": 1}, {"tp": 1, "dp": 2, "zero_stage": 0}),
    "zero0-to-tp2": ("tiny-llama", {"tp": 1, "dp": 2, "zero_stage": 0}, {"tp": 2, "dp": 1}),
    "ep2-to-ep1": ("tiny-qwen3-moe", {"tp": 1, "dp": 2, "ep": 2}, {"tp": 1, "dp": 2, "ep": 1}),
    "cp2-to-dp2": ("tiny-llama", {"tp": 1, "dp": 1, "cp": 2}, {"tp": 1, "dp": 2}),
    "phi3-fused-tp2-to-dp2": ("tiny-phi3", {"tp": 2, "dp": 1}, {"tp": 1, "dp": 2}),  # rows picked by index
    "pp2-to-dp2": ("tiny-llama", {"tp": 1, "dp": 1, "pp": 2, **FOUR}, {"tp": 1, "dp": 2, **FOUR}),
    "tp2-to-pp2": ("tiny-llama", {"tp": 2, "dp": 1, **FOUR}, {"tp": 1, "dp": 1, "pp": 2, **FOUR}),
    "lora-tp2-to-dp2": ("tiny-llama", {"tp": 2, "dp": 1, "lora": LORA}, {"tp": 1, "dp": 2, "lora": LORA}),
    # ZeRO-3 (every parameter partitioned): its partitions out to TP=2, and EP=2 shards into ZeRO-3 partitions
    "zero3-to-tp2-bf16": (
        "tiny-llama",
        {"tp": 1, "dp": 2, **ZERO3, "dtype": "bf16"},
        {"tp": 2, "dp": 1, "dtype": "bf16"},
    ),
    "ep2-zero2-to-zero3": (
        "tiny-qwen3-moe",
        {"tp": 1, "dp": 2, "ep": 2, "zero_stage": 2},
        {"tp": 1, "dp": 2, "ep": 2, **ZERO3},
    ),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(CASES))
def test_resharded_load_carries_the_state_over(tmp_path, case):
    from ds_dhelix.engine.reshard import to_universal

    model, a, b = CASES[case]
    root = str(tmp_path / "ck")
    saved, lr_a, steps_a = _merged(run_ranks(_save_world, 2, args=(model, a, root), timeout=180))
    converted = case.startswith("zero0")  # these convert first; the others let load_checkpoint do it
    if converted:
        to_universal(root, "global_step2")
    folder = os.path.join(root, "global_step2", "universal")
    args = (model, b, os.path.dirname(folder), converted)
    loaded, lr_b, steps_b, opt_steps, resharded = _merged(run_ranks(_load_world, 2, args=args, timeout=180))
    # CP ranks are DeepSpeed's data-parallel ranks: CP=2 -> DP=2 writes the same files, loaded as they are
    assert converted or resharded == (case != "cp2-to-dp2")
    if not os.path.isdir(folder):
        to_universal(root, "global_step2")  # (the reference the loaded state is held to)
    from safetensors.torch import load_file

    for kind in KINDS:
        files = {}
        for name in sorted(os.listdir(os.path.join(folder, kind))):
            files.update(load_file(os.path.join(folder, kind, name)))
        assert set(saved[kind]) == set(loaded[kind]) == set(files), kind
        for name, full in saved[kind].items():
            assert torch.equal(full.float(), files[name]), (kind, name)
            assert torch.equal(files[name], loaded[kind][name].float()), (kind, name)
        assert any(bool(t.abs().sum() > 0) for t in files.values()), kind  # (moments really trained)
    assert lr_b == lr_a and steps_b == steps_a == 2 and opt_steps == {2.0}


def test_offline_command_refuses_bad_outputs(tmp_path):
    from ds_dhelix.cli import main

    ck = tmp_path / "ck" / "global_step2"
    ck.mkdir(parents=True)
    (ck / "dhelix_run_state.json").write_text(json.dumps({"step": 2, "layout": {"pp": 1}}))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["convert-checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "full")]) == 2
    assert main(["convert-checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "ck" / "in")]) == 2
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_dhelix.cli",
            "convert-checkpoint",
            str(tmp_path / "ck"),
            "--out",
            str(tmp_path / "new"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "no shard layout records" in proc.stderr, proc.stderr
    assert not (tmp_path / "new").exists()  # nothing half-written left behind


def _state(zero: int = 1, **layout) -> dict:
    base = {"tp": 1, "dp": 2, "pp": 1, "ep": 1, "micro_batch_size": 4, "gradient_accumulation_steps": 2}
    return {"layout": {**base, **layout}, "precision": {"zero_stage": zero}}


def test_what_a_reshard_cannot_honour_is_named():
    from ds_dhelix.engine.reshard import check_reshard, needs_reshard

    assert not needs_reshard(_state(), _state())
    assert needs_reshard(_state(tp=2, dp=1, gradient_accumulation_steps=4), _state())
    check_reshard(_state(tp=2, dp=1, gradient_accumulation_steps=4), _state())  # same global batch: fine
    with pytest.raises(ValueError, match=r"global batch .* 32, this run's 16; set gradient_accumulation_steps 4"):
        check_reshard(_state(tp=2, dp=1, gradient_accumulation_steps=8), _state())
    assert needs_reshard(_state(pp=2, dp=1, gradient_accumulation_steps=4), _state())
    check_reshard(_state(pp=2, dp=1, gradient_accumulation_steps=4), _state())  # pipeline stages reshard too
    s = _state(zero=0, ep=2)
    with pytest.raises(ValueError, match="ZeRO stage 0 with expert parallelism is not supported"):
        check_reshard(_state(), s)
    with pytest.raises(ValueError, match="written at ZeRO stage 0 with expert parallelism"):
        check_reshard(s, _state())


# ------------------------------------------------------------------------- end to end: train.py
def _train(tmp, name: str, ranks: int, model: str, *extra, **cfg_changes) -> dict:
    """One train.py run through DeepSpeed's launcher; its JSON summary."""
    from tests.conftest import free_port

    with open(os.path.join(ROOT, "ds_configs", cfg_changes.pop("base", "tiny_llama_cpu.json"))) as f:
        cfg = json.load(f)
    cfg["tensorboard"] = {"enabled": False}
    cfg["zero_optimization"]["stage"] = cfg_changes.get("zero", 1)
    cfg["gradient_accumulation_steps"] = cfg_changes.get("gas", 4)
    section = "expert_parallel" if "ep" in cfg_changes else "tensor_parallel"
    cfg["dhelix"][section] = {"size": cfg_changes.get("ep", cfg_changes.get("tp", 1))}
    if section == "expert_parallel":
        cfg["dhelix"][section]["capacity_factor"] = None
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [
        deepspeed,
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(free_port()),
        os.path.join(ROOT, "train.py"),
        "--deepspeed",
        str(path),
        "--model",
        model,
        "--seq-len",
        "32",
        "--output-dir",
        str(tmp / f"out-{name}"),
        "--json-summary",
        str(tmp / f"{name}-summary.json"),
        *extra,
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(tmp / f"{name}-summary.json") as f:
        return json.load(f) | {"stderr": proc.stderr}


CLOSE = 1e-6
"""Relative tolerance of a run resumed on another layout against a straight run on that layout: the
steps before the checkpoint summed their gradients in the old layout's order (TP partial sums, DP
all-reduces), which moves the last bits of the state; on this CPU the tiny models meet it bitwise."""


def _close(resumed: list[float], straight: list[float]) -> None:
    assert len(resumed) == len(straight)
    for a, b in zip(resumed, straight):
        assert abs(a - b) <= CLOSE * abs(b), (resumed, straight)


@pytest.mark.slow
@pytest.mark.extended  # (the in-process cases above cover the mechanism in the main tier: the CI budget)
@pytest.mark.timeout(900)
def test_tp2_then_dp2_then_one_rank_continues_the_run(tmp_path):
    ck = str(tmp_path / "ck")
    steps = ("--steps", "6", "--ds-checkpoint", ck)
    _train(tmp_path, "a", 2, "tiny-llama", *steps, "--stop-after", "2", tp=2)  # global batch 4 x 4 x 1
    b = _train(
        tmp_path,
        "b",
        2,
        "tiny-llama",
        *steps,
        "--stop-after",
        "2",
        "--resume",
        "auto",
        "--allow-resume-change",
        tp=1,
        gas=2,
    )
    assert "resharded to this run's layout" in b["stderr"]
    c = _train(tmp_path, "c", 1, "tiny-llama", *steps, "--resume", "auto", "--allow-resume-change", tp=1)
    straight_dp2 = _train(
        tmp_path,
        "dp2",
        2,
        "tiny-llama",
        "--steps",
        "6",
        "--stop-after",
        "4",
        "--ds-checkpoint",
        str(tmp_path / "ck-dp2"),
        tp=1,
        gas=2,
    )
    straight_one = _train(tmp_path, "one", 1, "tiny-llama", "--steps", "6", tp=1)
    assert (b["start_step"], c["start_step"]) == (2, 4)
    _close(b["losses"], straight_dp2["losses"][2:4])
    _close(c["losses"], straight_one["losses"][4:6])


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_zero1_to_zero2_and_ep2_to_ep1_and_offline_conversion(tmp_path):
    from ds_dhelix.cli import main

    ck, steps = str(tmp_path / "ck"), ("--steps", "4")
    _train(tmp_path, "z1", 2, "tiny-llama", *steps, "--stop-after", "2", "--ds-checkpoint", ck, gas=2)
    z2 = _train(tmp_path, "z2", 2, "tiny-llama", *steps, "--resume", ck, "--allow-resume-change", gas=2, zero=2)
    straight_z2 = _train(tmp_path, "sz2", 2, "tiny-llama", *steps, gas=2, zero=2)
    _close(z2["losses"], straight_z2["losses"][2:])

    moe, ep1_ck = {"base": "phimoe_ep2.json"}, str(tmp_path / "ck-ep1")
    _train(
        tmp_path,
        "e2",
        2,
        "tiny-phimoe",
        *steps,
        "--stop-after",
        "2",
        "--ds-checkpoint",
        str(tmp_path / "ck-ep"),
        ep=2,
        **moe,
    )
    e1 = _train(
        tmp_path,
        "e1",
        2,
        "tiny-phimoe",
        *steps,
        "--resume",
        str(tmp_path / "ck-ep"),
        "--allow-resume-change",
        ep=1,
        **moe,
    )
    straight_e1 = _train(
        tmp_path, "se1", 2, "tiny-phimoe", *steps, "--stop-after", "2", "--ds-checkpoint", ep1_ck, ep=1, **moe
    )
    assert main(["convert-checkpoint", ep1_ck, "--out", str(tmp_path / "conv")]) == 0
    again = _train(tmp_path, "again", 2, "tiny-phimoe", *steps, "--resume", str(tmp_path / "conv"), ep=1, **moe)
    full_e1 = _train(tmp_path, "fe1", 2, "tiny-phimoe", *steps, ep=1, **moe)
    assert straight_e1["losses"] == full_e1["losses"][:2]
    _close(e1["losses"], full_e1["losses"][2:])
    assert again["losses"] == full_e1["losses"][2:]  # the converted checkpoint on its own layout: bitwise


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_hf_trainer_resumes_on_another_layout(tmp_path):
    """examples/trainer_sft.py (DhelixTrainer): a checkpoint-2 folder written at TP=2 resumed at
    TP=1 x DP=2 through the Trainer's resume_from_checkpoint (DeepSpeed's load_checkpoint)."""
    from tests.conftest import free_port

    def trainer(name, tp, gas, *extra):
        with open(os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json")) as f:
            cfg = json.load(f)
        cfg["tensorboard"] = {"enabled": False}
        cfg["gradient_accumulation_steps"] = gas
        cfg["dhelix"]["tensor_parallel"] = {"size": tp}
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        cmd = [deepspeed, "--num_gpus", "2", "--master_port", str(free_port()),
               os.path.join(ROOT, "examples", "trainer_sft.py"), "--deepspeed", str(tmp_path / f"{name}.json"),
               "--model", "tiny-llama", "--max-steps", "4", "--seq-len", "32", "--output-dir", str(tmp_path / name),
               "--json-summary", str(tmp_path / f"{name}-summary.json"), *extra]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(tmp_path / f"{name}-summary.json") as f:
            return json.load(f)["losses"]

    straight = trainer("a", 2, 4, "--save-steps", "2")
    resumed = trainer("b", 1, 2, "--resume-from-checkpoint", str(tmp_path / "a" / "checkpoint-2"))
    assert (tmp_path / "a" / "checkpoint-2" / "global_step2" / "universal").is_dir()  # (it was resharded)
    _close(resumed, straight[2:])
