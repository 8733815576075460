"""Hugging Face Trainer, accelerate and multi-node launches (2 CPU ranks, every run bounded):

DhelixTrainer     examples/trainer_sft.py under torchrun: a ds_dhelix engine with TP=2 and SI,
                  20 steps bitwise equal to "schedule": "sequential", and close to a plain
                  transformers.Trainer (data parallel, the same samples per step); the HF
                  checkpoint loads with from_pretrained; TensorBoard has the loss and the
                  hidden-communication fraction; resume from checkpoint-10 to 20 == uninterrupted
launchers         deepspeed --num_gpus 2 and accelerate launch (ds_configs/accelerate_deepspeed.yaml)
                  give the torchrun losses; Phi-MoE EP=2 trains through DhelixTrainer; CP=2
                  gives TP=2's losses; a PEFT LoRA model: SI = sequential bitwise, close to the
                  plain Trainer with the same PEFT model, the adapter written by save_model
two nodes         train.py as two DeepSpeed nodes on one machine (--hostfile, --no_ssh, --node_rank)
                  == the one-node 2-rank run; every global rank writes its checkpoint files
no silent run     a plain Trainer given an enabled dhelix section raises DhelixConfigIgnored;
                  DhelixTrainer refuses settings the op graph cannot honour
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
EXAMPLE = os.path.join(ROOT, "examples", "trainer_sft.py")
STEPS = 20
# fp32 on both sides; the plain Trainer sums each matmul over the whole hidden size and the whole
# batch in one rank, the sharded run in TP shares and sequence-first order: rounding differs by ~1e-7
# per step and Adam carries it on; 20 steps measured 9.5e-7 (a mean of micro-batch means: 0.06)
PLAIN_TOLERANCE = 1e-4


def _run(cmd, timeout=300, env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    env.pop("ACCELERATE_DEEPSPEED_CONFIG_FILE", None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _config(tmp, name="tiny_llama_cpu.json", **dhelix) -> str:
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        cfg = json.load(f)
    cfg["dhelix"].update(dhelix)
    cfg["tensorboard"]["enabled"] = False
    path = tmp / f"{'-'.join(f'{k}{v}' for k, v in dhelix.items()) or 'cfg'}-{name}"
    path.write_text(json.dumps(cfg))
    return str(path)


def _sft(launcher: list[str], cfg: str, out, *extra, packing="none") -> list[str]:
    # packing none: one right-padded document per row, where the Trainer's num_items_in_batch
    # weighting differs from a mean of micro-batch means, so the comparison with the plain Trainer
    # checks it (MoE models refuse padding: their router loss would count it)
    return [
        *launcher,
        EXAMPLE,
        "--deepspeed",
        cfg,
        "--seq-len",
        "32",
        "--packing",
        packing,
        "--output-dir",
        str(out),
        "--json-summary",
        str(out) + ".json",
        *extra,
    ]


def _torchrun() -> list[str]:
    return [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port())]


def _summary(out) -> dict:
    with open(str(out) + ".json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def si_run(tmp_path_factory):
    """The reference: tiny-llama TP=2 SI, 20 steps, a Trainer checkpoint at step 10."""
    tmp = tmp_path_factory.mktemp("trainer")
    out = tmp / "si"
    _ok(_run(_sft(_torchrun(), _config(tmp), out, "--max-steps", str(STEPS), "--save-steps", "10")))
    return tmp, out, _summary(out)


@pytest.mark.timeout(300)
def test_context_parallel_through_the_trainer(si_run):
    """CP=2 instead of TP=2 (one data-parallel replica in both, so the same samples per step, on the
    right-padded documents): the Trainer's token count divided by tp x cp, losses as TP=2's."""
    tmp, _, si = si_run
    out = tmp / "cp"
    _ok(
        _run(
            _sft(
                _torchrun(),
                _config(tmp, tensor_parallel={"size": 1}, context_parallel={"size": 2}),
                out,
                "--max-steps",
                str(STEPS),
            )
        )
    )
    cp = _summary(out)
    assert (cp["engine"], cp["tp_size"], cp["cp_size"], cp["schedule"]) == ("DhelixEngine", 1, 2, "si")
    gap = max(abs(a - b) for a, b in zip(cp["losses"], si["losses"], strict=True))
    assert gap < PLAIN_TOLERANCE, (gap, cp["losses"], si["losses"])  # sums in another order, as vs plain


@pytest.mark.timeout(400)
def test_dhelix_trainer_si_sequential_plain(si_run):
    tmp, out, si = si_run
    assert si["engine"] == "DhelixEngine" and si["tp_size"] == 2 and si["schedule"] == "si"
    assert len(si["losses"]) == STEPS
    seq_out = tmp / "seq"
    _ok(_run(_sft(_torchrun(), _config(tmp, schedule="sequential"), seq_out, "--max-steps", str(STEPS))))
    seq = _summary(seq_out)
    assert seq["schedule"] == "sequential" and seq["losses"] == si["losses"]  # bitwise
    plain_out = tmp / "plain"
    _ok(_run(_sft(_torchrun(), _config(tmp), plain_out, "--max-steps", str(STEPS), "--plain")))
    plain = _summary(plain_out)
    assert plain["engine"] == "DeepSpeedEngine" and plain["tp_size"] == 1
    gap = max(abs(a - b) for a, b in zip(plain["losses"], si["losses"], strict=True))
    assert gap < PLAIN_TOLERANCE, (gap, plain["losses"], si["losses"])
    assert si["losses"][-1] < si["losses"][0] - 0.3  # it trains

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(si["hf_checkpoint"])
    assert hf.model.layers[0].self_attn.q_proj.weight.shape[0] == hf.config.num_attention_heads * hf.config.head_dim

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/loss" in tags and "train/dhelix/hidden_comm_fraction" in tags, tags
    assert len(events.Scalars("train/loss")) == STEPS
    assert all(0.0 <= e.value <= 1.0 for e in events.Scalars("train/dhelix/hidden_comm_fraction"))


@pytest.mark.timeout(300)
def test_trainer_resume_is_exact(si_run):
    tmp, out, si = si_run
    ckpt = out / "checkpoint-10"
    assert glob.glob(str(ckpt / "global_step10")) and (ckpt / "trainer_state.json").exists()
    resumed_out = tmp / "resumed"
    _ok(
        _run(
            _sft(
                _torchrun(), _config(tmp), resumed_out, "--max-steps", str(STEPS), "--resume-from-checkpoint", str(ckpt)
            )
        )
    )
    assert _summary(resumed_out)["losses"] == si["losses"][10:]  # steps 11-20, bitwise


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["deepspeed", "accelerate"])
def test_other_launchers_give_the_torchrun_losses(si_run, launcher):
    tmp, _, si = si_run
    port, cfg = str(free_port()), _config(tmp)
    # the shipped accelerate config, pointed at this test's copy of the ds_config
    with open(os.path.join(ROOT, "ds_configs", "accelerate_deepspeed.yaml")) as f:
        shipped = f.read()
    assert "deepspeed_config_file: ds_configs/tiny_llama_cpu.json" in shipped
    accelerate_yaml = tmp / "accelerate.yaml"
    accelerate_yaml.write_text(shipped.replace("ds_configs/tiny_llama_cpu.json", cfg))
    cmd = {
        "deepspeed": [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", port],
        "accelerate": [
            os.path.join(BIN, "accelerate"),
            "launch",
            "--main_process_port",
            port,
            "--config_file",
            str(accelerate_yaml),
        ],
    }[launcher]
    out = tmp / launcher
    # the schedule is written in the ds_config (120 steps), so 3 steps are the first 3 of the 20
    _ok(_run(_sft(cmd, cfg, out, "--max-steps", "3")))
    got = _summary(out)
    assert (got["engine"], got["tp_size"], got["schedule"]) == ("DhelixEngine", 2, "si")
    assert got["losses"] == si["losses"][:3]


@pytest.mark.timeout(600)
def test_peft_lora_model_through_the_trainer(tmp_path):
    """A PEFT LoRA model (--lora-r 8) through DhelixTrainer: SI = sequential bitwise, close to the
    plain Trainer with the same PEFT model, and save_model writes the adapter PEFT loads."""
    runs = {}
    for name, cfg, extra in (
        ("si", _config(tmp_path), ()),
        ("seq", _config(tmp_path, schedule="sequential"), ()),
        ("plain", _config(tmp_path), ("--plain",)),
    ):
        out = tmp_path / f"lora-{name}"
        _ok(_run(_sft(_torchrun(), cfg, out, "--max-steps", "8", "--lora-r", "8", *extra)))
        runs[name] = _summary(out)
    assert runs["si"]["losses"] == runs["seq"]["losses"]
    gap = max(abs(a - b) for a, b in zip(runs["plain"]["losses"], runs["si"]["losses"], strict=True))
    assert gap < PLAIN_TOLERANCE, (gap, runs["plain"]["losses"], runs["si"]["losses"])
    from peft import PeftConfig

    final = runs["si"]["hf_checkpoint"]
    assert os.path.isfile(os.path.join(final, "adapter_model.safetensors"))
    assert PeftConfig.from_pretrained(final).r == 8


@pytest.mark.timeout(300)
def test_phimoe_expert_parallel_through_the_trainer(tmp_path):
    out = tmp_path / "moe"
    _ok(
        _run(
            _sft(
                _torchrun(),
                _config(tmp_path, "phimoe_ep2.json"),
                out,
                "--model",
                "tiny-phimoe",
                "--max-steps",
                "3",
                "--eval-blocks",
                "8",
                packing="concat",
            )
        )
    )
    got = _summary(out)
    assert (got["engine"], got["ep_size"], got["schedule"]) == ("DhelixMoeEngine", 2, "si")
    assert len(got["losses"]) == 3 and all(torch.isfinite(torch.tensor(got["losses"])))
    assert got["eval_loss"] is not None and got["eval_loss"] > 0


@pytest.mark.timeout(300)
def test_two_nodes_on_one_machine_equal_one_node(tmp_path):
    cfg = _config(tmp_path)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    args = [
        "--deepspeed",
        cfg,
        "--model",
        "tiny-llama",
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--ds-checkpoint",
        str(tmp_path / "ck"),
        "--save-interval",
        "3",
    ]
    deepspeed = os.path.join(BIN, "deepspeed")
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                deepspeed,
                "--hostfile",
                str(hostfile),
                "--no_ssh",
                "--node_rank",
                str(r),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                os.path.join(ROOT, "train.py"),
                *args,
                "--output-dir",
                str(tmp_path / "two"),
                "--json-summary",
                str(tmp_path / "two.json"),
            ],
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        logs = [n.communicate(timeout=240)[0] for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    for n, log in zip(nodes, logs):
        assert n.returncode == 0, log[-3000:]
    assert "nnodes=2, num_local_procs=1, node_rank=1" in logs[1]
    one = tmp_path / "one"
    _ok(
        _run(
            [
                deepspeed,
                "--num_gpus",
                "2",
                "--master_port",
                str(free_port()),
                os.path.join(ROOT, "train.py"),
                *args[:-4],
                "--output-dir",
                str(one),
                "--json-summary",
                str(one) + ".json",
            ]
        )
    )
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["losses"] == json.loads((tmp_path / "one.json").read_text())["losses"]
    step = tmp_path / "ck" / "global_step3"
    assert sorted(p.name for p in step.glob("*rng*")) == ["dhelix_rng_rank0000.pt", "dhelix_rng_rank0001.pt"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "two")  # exported by global rank 0


BAD_TRAINER_SCRIPT = r"""
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import ds_dhelix
from ds_dhelix.engine.guard import DhelixConfigIgnored
from transformers import Trainer, TrainingArguments
from hf_models.registry import build_model
from ds_dhelix.data import TokenDataset
cfg = json.load(open(sys.argv[1]))
data = TokenDataset([3 + i % 1000 for i in range(32 * 64)], 32)
def args(**kw):
    return TrainingArguments(output_dir=os.path.join(sys.argv[3], "out"), max_steps=2, per_device_train_batch_size=4,
                             gradient_accumulation_steps=4, learning_rate=3e-3, adam_beta2=0.95, weight_decay=0.01,
                             warmup_steps=10, use_cpu=True, report_to=[], deepspeed=cfg, **kw)

# "auto" values follow TrainingArguments, as in HF's DeepSpeed integration
auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto",
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": 1}, "dhelix": {"enabled": True, "schedule": "si"}}
targs = TrainingArguments(output_dir=os.path.join(sys.argv[3], "auto"), max_steps=2, per_device_train_batch_size=2,
                          gradient_accumulation_steps=3, learning_rate=2e-3, max_grad_norm=0.5, seed=7, use_cpu=True,
                          report_to=[], deepspeed=auto)
trainer = ds_dhelix.DhelixTrainer(model=build_model("tiny-llama", seed=0)[0], args=targs, train_dataset=data)
trainer.train()
engine = trainer.model_wrapped
print("AUTO", type(engine).__name__, engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
      engine.gradient_clipping(), engine.optimizer.param_groups[0]["initial_lr"], trainer.state.global_step,
      "seed", engine.dhelix.seed)
engine.destroy()
from accelerate.state import AcceleratorState, PartialState
AcceleratorState._reset_state(True)  # the next Trainers bring their own DeepSpeed plugin

model = build_model("tiny-llama", seed=0)[0]
try:
    Trainer(model=model, args=args(), train_dataset=data).train()
    print("PLAIN TRAINED")
except DhelixConfigIgnored as err:
    print("PLAIN REFUSED:", err)
try:
    ds_dhelix.DhelixTrainer(model=model, args=args(gradient_checkpointing=True), train_dataset=data)
    print("CHECKPOINTING ACCEPTED")
except ValueError as err:
    print("CHECKPOINTING REFUSED:", err)
class DPOTrainer(Trainer):  # (TRL's class name: TRL itself is not a dependency)
    pass
class Mixed(ds_dhelix.DhelixTrainer, DPOTrainer):
    pass
try:
    Mixed(model=model, args=args(), train_dataset=data)
    print("DPO MIX ACCEPTED")
except ValueError as err:
    print("DPO MIX REFUSED:", err)
AcceleratorState._reset_state(True)
dpo = dict(cfg, dhelix=dict(cfg["dhelix"], objective={"name": "dpo"}))
try:
    ds_dhelix.DhelixTrainer(model=model, args=TrainingArguments(output_dir=os.path.join(sys.argv[3], "dpo"),
                            max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=4, use_cpu=True,
                            report_to=[], deepspeed=dpo), train_dataset=data)
    print("OBJECTIVE ACCEPTED")
except ValueError as err:
    print("OBJECTIVE REFUSED:", err)
"""


@pytest.mark.timeout(200)
def test_no_silent_plain_trainer_and_refused_settings(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(BAD_TRAINER_SCRIPT)
    cfg = json.loads(open(os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json")).read())
    cfg["dhelix"]["tensor_parallel"]["size"] = 1
    cfg.pop("scheduler")
    cfg["tensorboard"]["enabled"] = False
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    proc = _run(
        [sys.executable, str(script), str(tmp_path / "cfg.json"), str(free_port()), str(tmp_path)],
        env={"PYTHONPATH": ROOT},
    )
    _ok(proc)
    # the Trainer's LR schedule (no "scheduler" in the config) wraps DeepSpeed's optimizer
    # ... and the draws' base seed follows TrainingArguments.seed
    assert "AUTO DhelixEngine 2 3 0.5 0.002 2 seed 7" in proc.stdout, proc.stdout[-3000:]
    assert "PLAIN REFUSED:" in proc.stdout and "DhelixTrainer" in proc.stdout, proc.stdout[-3000:]
    assert "CHECKPOINTING REFUSED:" in proc.stdout and '"recompute": "full"' in proc.stdout, proc.stdout[-3000:]
    assert "DPO MIX REFUSED: DhelixTrainer mixed with TRL's DPOTrainer" in proc.stdout, proc.stdout[-3000:]
    assert "OBJECTIVE REFUSED:" in proc.stdout and "train.py --objective" in proc.stdout, proc.stdout[-3000:]


def test_example_refuses_a_resume_folder_that_is_no_checkpoint(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("trainer_sft_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cfg = os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json")
    with pytest.raises(SystemExit) as err:
        example.parse_args(["--deepspeed", cfg, "--resume-from-checkpoint", str(tmp_path)])
    assert err.value.code == 2 and "is not a Trainer checkpoint" in capsys.readouterr().err
