"""Bad input to train.py: exactly one ``train.py: error:`` line naming the problem, exit code 2, no
traceback, and no model built (the batch table that starts a run is never printed).

One table over every mistake: the case builds its arguments (files in a temporary directory), the
row lists words the error line must contain. Most rows run ``train.main`` in this process (the
checks run before any distributed start-up); a few run the real script in a subprocess, to see
the whole output of a real invocation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json")
PP = os.path.join(ROOT, "ds_configs", "tiny_llama_pp2_w.json")


def _config(tmp, change=None, base=BASE) -> str:
    cfg = json.load(open(base))
    if change:
        change(cfg)
    path = tmp / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _file(tmp, name, text) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def _truncated_checkpoint(tmp) -> str:
    from hf_models.registry import build_model

    model, _ = build_model("tiny-llama", seed=0)
    out = tmp / "ckpt"
    model.save_pretrained(out)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return str(out)


def _bin_only_checkpoint(tmp) -> str:
    from hf_models.registry import build_model

    model, _ = build_model("tiny-llama", seed=0)
    out = tmp / "bin-ckpt"
    model.save_pretrained(out)
    os.remove(out / "model.safetensors")
    (out / "pytorch_model.bin").write_bytes(b"weights")
    return str(out)


def _big_vocab_checkpoint(tmp) -> str:
    """tiny-llama with a 4,096-row vocabulary and no tokenizer files."""
    from transformers import AutoModelForCausalLM

    from hf_models.registry import load_config

    config = load_config("tiny-llama")
    config.vocab_size = 4096
    out = tmp / "big-vocab"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return str(out)


def _pairs(tmp, refs=False) -> str:
    """Eight preference records (``refs``: with reference log-probabilities; "first": on the first only)."""
    lines = []
    for k in range(8):
        record = {"prompt": f"question {k}", "chosen": "a good answer", "rejected": "a bad one"}
        if refs is True or (refs == "first" and k == 0):
            record.update(ref_chosen_logps=-10.0, ref_rejected_logps=-12.0)
        lines.append(json.dumps(record))
    return _file(tmp, "pairs.jsonl", "\n".join(lines) + "\n")


def _unpaired(tmp, refs=None, label=None) -> str:
    """Eight KTO records (``refs`` "one": only ``ref_logps``; ``label``: every record's label)."""
    lines = []
    for k in range(8):
        record = {"prompt": f"question {k}", "completion": "an answer", "label": k % 2 == 0 if label is None else label}
        if refs == "one":
            record["ref_logps"] = -10.0
        lines.append(json.dumps(record))
    return _file(tmp, "unpaired.jsonl", "\n".join(lines) + "\n")


def _rollouts(tmp, ids=False, old_on_text=False, bad_id=None) -> str:
    """Eight groups of two completions with rewards (``ids``: as token ids with the reference's
    per-token log-probabilities; ``old_on_text``: text completions with sampling log-probabilities;
    ``bad_id``: record 3's second token of its first completion)."""
    lines = []
    for k in range(8):
        if ids:
            first = [8, bad_id] if bad_id is not None and k == 2 else [8, 9]
            record = {"prompt_ids": [5, 6, 7], "completion_ids": [first, [10]], "ref_logps": [[-1.0, -2.0], [-3.0]]}
        else:
            record = {"prompt": f"question {k}", "completions": ["a good answer", "a bad one"]}
            if old_on_text:
                record["old_logps"] = [[-1.0] * 3, [-1.0] * 3]
        lines.append(json.dumps({**record, "rewards": [1.0, 0.0]}))
    return _file(tmp, "rollouts.jsonl", "\n".join(lines) + "\n")


def _setdh(key, value):
    def change(cfg):
        cfg["dhelix"][key] = value

    return change


def _pop(key):
    return lambda cfg: cfg.pop(key)


def _set(key, value):
    return lambda cfg: cfg.__setitem__(key, value)


# (id, world, argv builder(tmp) -> list, words the error line must contain)
CASES = [
    ("missing-config", 2, lambda t: ["--deepspeed", "/nonexistent/ds.json"], ["/nonexistent/ds.json"]),
    ("invalid-json", 2, lambda t: ["--deepspeed", _file(t, "bad.json", '{"train_batch_size": 4,,}')], ["line 1"]),
    ("unknown-preset", 2, lambda t: ["--deepspeed", BASE, "--model", "tiny-lama"], ["tiny-lama", "tiny-llama"]),
    ("missing-model-dir", 2, lambda t: ["--deepspeed", BASE, "--model", "/nonexistent/ckpt"], ["/nonexistent/ckpt"]),
    (
        "truncated-safetensors",
        2,
        lambda t: ["--deepspeed", BASE, "--model", _truncated_checkpoint(t)],
        ["model.safetensors", "truncated"],
    ),
    (
        "no-tokenizer-for-the-vocabulary",
        2,
        lambda t: ["--deepspeed", BASE, "--model", _big_vocab_checkpoint(t)],
        ["no tokenizer files", "4,096-token", "--tokenizer DIR", "--tokenizer corpus"],
    ),
    (
        "tokenizer-dir-without-files",
        2,
        lambda t: ["--deepspeed", BASE, "--tokenizer", str(t)],
        ["--tokenizer", "no tokenizer files there"],
    ),
    (
        "peft-config-gaussian-init",
        2,
        lambda t: [
            "--deepspeed",
            BASE,
            "--peft-config",
            _file(t, "adapter_config.json", '{"r": 4, "target_modules": ["q_proj"], "init_lora_weights": "gaussian"}'),
        ],
        ["adapter_config.json", "init_lora_weights='gaussian'", "init_lora_weights true"],
    ),
    (
        "expert-lora-with-dropout",
        2,
        lambda t: [
            "--deepspeed",
            _config(t, lambda c: c["dhelix"].update(tensor_parallel={"size": 1}, expert_parallel={"size": 2})),
            "--model",
            "tiny-qwen3-moe",
            "--peft-config",
            _file(
                t,
                "adapter_config.json",
                '{"r": 4, "target_modules": ["q_proj"], "target_parameters": ["experts.gate_up_proj"], '
                '"lora_dropout": 0.1}',
            ),
        ],
        ["target_parameters and lora_dropout=0.1", "lora_dropout=0"],
    ),
    ("missing-data", 2, lambda t: ["--deepspeed", BASE, "--data", "/nonexistent/data.txt"], ["/nonexistent/data.txt"]),
    (
        "malformed-jsonl",
        2,
        lambda t: ["--deepspeed", BASE, "--data", _file(t, "d.jsonl", '{"text": "a"}\n{"text": \n')],
        ["d.jsonl:2", "not valid JSON"],
    ),
    (
        "jsonl-without-text",
        2,
        lambda t: ["--deepspeed", BASE, "--data", _file(t, "d.jsonl", '{"txt": "a"}\n')],
        ["d.jsonl: record 1", "cannot tell the format", "'messages'", "--data-format"],
    ),
    (
        "record-without-its-field",
        2,
        lambda t: ["--deepspeed", BASE, "--data", _file(t, "d.jsonl", '{"text": "a"}\n{"text": 3}\n')],
        ["d.jsonl: record 2 (text)", "'text' must be a str"],
    ),
    (
        "chat-without-a-template",
        2,
        lambda t: [
            "--deepspeed",
            BASE,
            "--data",
            _file(
                t,
                "c.jsonl",
                '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n',
            ),
        ],
        ["chat template", "--chat-template"],
    ),
    (
        "chat-bad-role",
        2,
        lambda t: [
            "--deepspeed",
            BASE,
            "--chat-template",
            "chatml",
            "--data",
            _file(t, "c.jsonl", '{"messages": [{"role": "human", "content": "hi"}]}\n'),
        ],
        ["record 1 (chat)", "message 0", "role"],
    ),
    ("answers-of-text", 2, lambda t: ["--deepspeed", BASE, "--loss-on", "answers"], ["--loss-on answers", "text"]),
    (
        "eval-interval-without-data",
        2,
        lambda t: ["--deepspeed", BASE, "--eval-interval", "5"],
        ["--eval-interval", "--eval-data"],
    ),
    (
        "eval-fraction-out-of-range",
        2,
        lambda t: ["--deepspeed", BASE, "--data", _file(t, "d.txt", "x " * 50), "--eval-fraction", "1.5"],
        ["--eval-fraction", "[0, 1)"],
    ),
    ("bad-stream-size", 2, lambda t: ["--deepspeed", BASE, "--stream-above", "lots"], ["--stream-above", "256MB"]),
    (
        "unknown-data-suffix",
        2,
        lambda t: ["--deepspeed", BASE, "--data", _file(t, "d.csv", "a,b\n")],
        ["--data", "d.csv", ".parquet"],
    ),
    ("empty-data", 2, lambda t: ["--deepspeed", BASE, "--data", _file(t, "d.txt", "\n \n")], ["d.txt", "no text"]),
    (
        "data-too-short",
        2,
        lambda t: ["--deepspeed", BASE, "--data", _file(t, "d.txt", "a few words only")],
        ["tokens", "fewer than one micro-batch"],
    ),
    (
        "bin-only-checkpoint",
        2,
        lambda t: ["--deepspeed", BASE, "--model", _bin_only_checkpoint(t)],
        ["pytorch_model.bin", "safe_serialization=True"],
    ),
    (
        "padding-with-moe",
        2,
        lambda t: [
            "--deepspeed",
            os.path.join(ROOT, "ds_configs", "phimoe_ep2.json"),
            "--model",
            "tiny-phimoe",
            "--packing",
            "none",
        ],
        ["--packing none", "load-balancing"],
    ),
    (
        "max-shard-size",
        2,
        lambda t: ["--deepspeed", BASE, "--max-shard-size", "big"],
        ["--max-shard-size 'big'", "5GB"],
    ),
    (
        "flash-attention-unavailable",
        2,
        lambda t: ["--deepspeed", BASE, "--attn-implementation", "flash_attention_2"],
        ["flash_attention_2", "flash-attn", "sdpa"],
    ),
    ("seq-len-0", 2, lambda t: ["--deepspeed", BASE, "--seq-len", "0"], ["--seq-len must be >= 1"]),
    ("steps-0", 2, lambda t: ["--deepspeed", BASE, "--steps", "0"], ["--steps must be >= 1"]),
    (
        "seq-len-not-divisible",
        2,
        lambda t: ["--deepspeed", BASE, "--seq-len", "63"],
        ["--seq-len 63", "tensor_parallel.size 2"],
    ),
    (
        "batch-arithmetic",
        2,
        lambda t: ["--deepspeed", _config(t, _set("train_batch_size", 8))],
        ["train_batch_size 8", "micro 4", "accumulation 4", "data-parallel size 1"],
    ),
    (
        "tp-not-dividing-heads",
        3,
        lambda t: ["--deepspeed", _config(t, _setdh("tensor_parallel", {"size": 3}))],
        ["tensor_parallel.size 3", "valid TP sizes"],
    ),
    (
        "unknown-dhelix-key",
        2,
        lambda t: ["--deepspeed", _config(t, _setdh("schedul", "si"))],
        ["dhelix.schedul", "schedule"],
    ),
    (
        "misspelled-deepspeed-key",
        2,
        lambda t: ["--deepspeed", _config(t, _set("gradient_acumulation_steps", 4))],
        ["gradient_acumulation_steps", "did you mean 'gradient_accumulation_steps'"],
    ),
    (
        "optimiser",
        2,
        lambda t: ["--deepspeed", _config(t, lambda c: c.__setitem__("optimiser", c.pop("optimizer")))],
        ["'optimiser'", "did you mean 'optimizer'"],
    ),
    (
        "zero-without-optimizer",
        2,
        lambda t: ["--deepspeed", _config(t, _pop("optimizer"))],
        ["zero_optimization.stage = 1", '"optimizer"'],
    ),
    (
        "zero-3-nvme-offload",
        2,
        lambda t: [
            "--deepspeed",
            _config(t, _set("zero_optimization", {"stage": 3, "offload_param": {"device": "nvme"}})),
        ],
        ["zero_optimization.offload_param.device = 'nvme'", "not supported yet"],
    ),
    (
        "zero-3-pipeline",
        2,
        lambda t: [
            "--deepspeed",
            _config(
                t,
                _set("zero_optimization", {"stage": 3}),
                base=os.path.join(ROOT, "ds_configs", "tiny_llama_pp2_w.json"),
            ),
        ],
        ["zero_optimization.stage = 3 with dhelix.pipeline.stages = 2", "use stage 0 or 1"],
    ),
    (
        "grad-accum-dtype",
        2,
        lambda t: [
            "--deepspeed",
            _config(t, lambda c: c.update(data_types={"grad_accum_dtype": "fp32"}, fp16={"enabled": True})),
        ],
        ["data_types.grad_accum_dtype = 'fp32' with fp16 training", 'remove "grad_accum_dtype"'],
    ),
    (
        "zero-2-with-pipeline",
        2,
        lambda t: ["--deepspeed", _config(t, _set("zero_optimization", {"stage": 2}), base=PP)],
        ["zero_optimization.stage = 2", "pipeline.stages = 2"],
    ),
    (
        "activation-checkpointing",
        2,
        lambda t: ["--deepspeed", _config(t, _set("activation_checkpointing", {"partition_activations": True}))],
        ["activation_checkpointing"],
    ),
    (
        "sequence-parallel-off",
        2,
        lambda t: ["--deepspeed", _config(t, _setdh("tensor_parallel", {"size": 2, "sequence_parallel": False}))],
        ["dhelix.tensor_parallel.sequence_parallel"],
    ),
    (
        "output-dir-is-a-file",
        2,
        lambda t: ["--deepspeed", BASE, "--output-dir", _file(t, "out", "x")],
        ["--output-dir", "regular file", "--overwrite-output-dir"],
    ),
    (
        "output-dir-under-a-file",
        2,
        lambda t: ["--deepspeed", BASE, "--output-dir", _file(t, "f", "x") + "/run"],
        ["--output-dir", "is not a directory"],
    ),
    (
        "ds-checkpoint-foreign-dir",
        2,
        lambda t: ["--deepspeed", BASE, "--ds-checkpoint", os.path.dirname(_file(t, "notes.txt", "mine"))],
        ["--ds-checkpoint", "did not write"],
    ),
    (
        "save-interval-without-dir",
        2,
        lambda t: ["--deepspeed", BASE, "--save-interval", "5"],
        ["--save-interval needs --ds-checkpoint"],
    ),
    ("resume-missing", 2, lambda t: ["--deepspeed", BASE, "--resume", "/nonexistent/ck"], ["/nonexistent/ck"]),
    (
        "checkpoint-inside-output-dir",
        2,
        lambda t: ["--deepspeed", BASE, "--output-dir", str(t / "x"), "--ds-checkpoint", str(t / "x" / "ck")],
        ["lies in --output-dir"],
    ),
    (
        "json-summary-in-missing-dir",
        2,
        lambda t: ["--deepspeed", BASE, "--json-summary", "/nonexistent/s.json"],
        ["--json-summary", "not a writable directory"],
    ),
    (
        "zero-optimization-not-an-object",
        2,
        lambda t: ["--deepspeed", _config(t, _set("zero_optimization", True))],
        ['"zero_optimization" must be a JSON object'],
    ),
    (
        "ulysses-sequence-parallel",
        2,
        lambda t: ["--deepspeed", _config(t, _set("sequence_parallel_size", 2))],
        ["sequence_parallel_size", "not supported"],
    ),
    (
        "disabled-section-with-settings",
        2,
        lambda t: ["--deepspeed", _config(t, _setdh("enabled", False))],
        ["dhelix.enabled is false", "schedule"],
    ),
    (
        "watchdog-on-plain-deepspeed",
        2,
        lambda t: ["--deepspeed", _config(t, _pop("dhelix")), "--watchdog-s", "5"],
        ["--watchdog-s", "does not enable dhelix"],
    ),
    (
        "preference-pairs-with-cross-entropy",
        2,
        lambda t: ["--deepspeed", BASE, "--data", _pairs(t)],
        ["preference pairs", "--objective dpo"],
    ),
    (
        "preference-objective-on-text",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "simpo", "--data", _file(t, "d.jsonl", '{"text": "a b"}\n')],
        ["'simpo'", "text records", "chosen"],
    ),
    (
        "dpo-full-fine-tune-without-references",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "dpo", "--data", _pairs(t)],
        ["'dpo'", "ref_chosen_logps", "--lora"],
    ),
    (
        "references-with-simpo",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "simpo", "--data", _pairs(t, refs=True)],
        ["'simpo'", "no reference", "ref_chosen_logps"],
    ),
    (
        "references-for-some-records",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "dpo", "--data", _pairs(t, refs="first")],
        ["record 2", "some records only"],
    ),
    (
        "preference-token-average",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "orpo", "--data", _pairs(t), "--loss-average", "tokens"],
        ["--loss-average tokens", "mean over pairs"],
    ),
    (
        "preference-packed",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "orpo", "--data", _pairs(t), "--packing", "concat"],
        ["preference records", "padded rows", "--packing none"],
    ),
    (
        "preference-evaluation",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "orpo", "--data", _pairs(t), "--eval-fraction", "0.1"],
        ["--eval-fraction", "not built yet"],
    ),
    (
        "objective-on-plain-deepspeed",
        2,
        lambda t: ["--deepspeed", _config(t, _pop("dhelix")), "--objective", "dpo"],
        ["--objective", "enable the ds_config's dhelix section"],
    ),
    (
        "objective-with-intra",
        2,
        lambda t: ["--deepspeed", _config(t, _setdh("schedule", "intra")), "--objective", "orpo", "--data", _pairs(t)],
        ["'orpo'", "'intra'", "schedule"],
    ),
    (
        "reference-pass-with-a-pipeline",
        2,
        lambda t: ["--deepspeed", PP, "--objective", "dpo", "--lora", "--data", _pairs(t)],
        ["'dpo'", "pipeline (2 stages)", "reference log-probabilities in the data"],
    ),
    (
        "chat-template-on-text-pairs",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "orpo", "--data", _pairs(t), "--chat-template", "chatml"],
        ["--chat-template", "preference records' prompts are not chat messages"],
    ),
    (
        "loss-on-with-pairs",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "orpo", "--data", _pairs(t), "--loss-on", "all"],
        ["--loss-on", "loss is on the completions"],
    ),
    (
        "data-workers-with-rollouts",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "grpo", "--data", _rollouts(t), "--data-workers", "2"],
        ["--data-workers", "rollouts records", "one by one"],
    ),
    (
        "simpo-gamma-on-dpo",
        2,
        lambda t: [
            "--deepspeed",
            _config(t, _setdh("objective", {"name": "dpo", "simpo_gamma": 1.0})),
            "--data",
            _pairs(t),
        ],
        ["dhelix.objective.simpo_gamma", "applies to simpo"],
    ),
    (
        "max-completion-length-without-dr-grpo",
        2,
        lambda t: [
            "--deepspeed",
            _config(t, _setdh("objective", {"name": "grpo", "max_completion_length": 64})),
            "--data",
            _rollouts(t),
        ],
        ["max_completion_length", "'dr_grpo'"],
    ),
    (
        "kto-on-preference-pairs",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "kto", "--data", _pairs(t)],
        ["'kto'", "unpaired completions", "preference records"],
    ),
    (
        "unpaired-with-cross-entropy",
        2,
        lambda t: ["--deepspeed", BASE, "--data", _unpaired(t)],
        ["unpaired completions", "--objective kto"],
    ),
    (
        "kto-full-fine-tune-without-references",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "kto", "--data", _unpaired(t)],
        ["'kto'", "ref_logps / ref_KL_logps", "--lora"],
    ),
    (
        "kto-one-reference-of-two",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "kto", "--data", _unpaired(t, refs="one")],
        ["record 1", "both ref_logps and ref_KL_logps"],
    ),
    (
        "kto-label-not-a-bool",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "kto", "--lora", "--data", _unpaired(t, label=1)],
        ["record 1", "'label' must be true"],
    ),
    (
        "grpo-on-preference-pairs",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "grpo", "--data", _pairs(t)],
        ["'grpo'", "rollouts", "preference records"],
    ),
    (
        "rollouts-with-cross-entropy",
        2,
        lambda t: ["--deepspeed", BASE, "--data", _rollouts(t)],
        ["rollouts", "--objective grpo"],
    ),
    (
        "grpo-kl-without-references",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "grpo", "--beta", "0.04", "--data", _rollouts(t)],
        ["beta 0.04", "ref_logps", "or beta 0"],
    ),
    (
        "grpo-references-without-kl",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "grpo", "--data", _rollouts(t, ids=True)],
        ["ref_logps would not be read", "--beta"],
    ),
    (  # TP=2: the vocabulary-parallel embedding would give it a zero row on every rank
        "rollout-id-beyond-the-vocabulary-tp2",
        2,
        lambda t: [
            "--deepspeed",
            BASE,
            "--objective",
            "grpo",
            "--beta",
            "0.04",
            "--data",
            _rollouts(t, True, bad_id=5000),
        ],
        ["record 3", "token id 5000", "vocabulary of 2048 ids"],
    ),
    (
        "rollout-id-beyond-the-vocabulary-tp1",
        1,
        lambda t: [
            "--deepspeed",
            _config(t, _setdh("tensor_parallel", {"size": 1})),
            "--objective",
            "grpo",
            "--beta",
            "0.04",
            "--data",
            _rollouts(t, True, bad_id=-1),
        ],
        ["record 3", "token id -1", "vocabulary of 2048 ids"],
    ),
    (
        "grpo-sampling-log-probs-of-text",
        2,
        lambda t: ["--deepspeed", BASE, "--objective", "grpo", "--data", _rollouts(t, old_on_text=True)],
        ["record 1", "prompt_ids and completion_ids"],
    ),
    (
        "grpo-average-of-another-loss-type",
        2,
        lambda t: [
            "--deepspeed",
            BASE,
            "--objective",
            "grpo",
            "--data",
            _rollouts(t),
            "--loss-average",
            "microbatches",
        ],
        ["--loss-average microbatches", "'dapo'"],
    ),
    (
        "grpo-key-on-dpo",
        2,
        lambda t: [
            "--deepspeed",
            _config(t, _setdh("objective", {"name": "dpo", "epsilon": 0.3})),
            "--data",
            _pairs(t),
        ],
        ["dhelix.objective.epsilon", "applies to grpo"],
    ),
    (
        "label-smoothing-on-ipo",
        2,
        lambda t: [
            "--deepspeed",
            _config(t, _setdh("objective", {"name": "ipo", "label_smoothing": 0.1})),
            "--data",
            _pairs(t, refs=True),
        ],
        ["dhelix.objective.label_smoothing", "dpo and simpo"],
    ),
]


@pytest.mark.parametrize("case, world, argv, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_before_any_model(tmp_path, monkeypatch, capsys, case, world, argv, words):
    import train

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.chdir(tmp_path)  # default --output-dir under the temporary directory
    started = []
    monkeypatch.setattr(train, "run", lambda *a: started.append(a) or 0)  # what would start the ranks
    rc = train.main(argv(tmp_path))
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("train.py: error:")]
    assert rc == 2 and len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]
    assert started == []  # refused before any process group or model


def _train(*args, world=2):
    env = dict(os.environ, WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--deepspeed", "/nonexistent/ds.json"], "/nonexistent/ds.json"),
        (["--deepspeed", BASE, "--model", "tiny-lama"], "tiny-lama"),
    ],
    ids=["missing-config", "unknown-preset"],
)
def test_real_invocation_prints_one_line_and_no_traceback(argv, word):
    proc = _train(*argv)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and word in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "world size" not in proc.stdout


def test_unknown_deepspeed_key_can_be_allowed_with_a_warning(tmp_path):
    """dhelix.allow_unknown_deepspeed_keys turns the refusal into a warning (keys of a newer DeepSpeed)."""
    from ds_dhelix.config.ds_keys import check_deepspeed_keys, deepspeed_keys

    assert {
        "train_batch_size",
        "optimizer",
        "scheduler",
        "zero_optimization",
        "bf16",
        "fp16",
        "tensorboard",
        "activation_checkpointing",
        "gradient_clipping",
        "dhelix",
    } <= deepspeed_keys()
    with pytest.warns(UserWarning, match="future_key"):
        assert check_deepspeed_keys({"future_key": 1, "train_batch_size": 2}, allow_unknown=True) == ["future_key"]
    with pytest.raises(ValueError, match="future_key"):
        check_deepspeed_keys({"future_key": 1})


def test_a_refusal_is_printed_by_rank_0_only(tmp_path, monkeypatch, capsys):
    """Under the launcher every rank runs the checks: rank 0 says why, the others exit with the
    same code in silence."""
    import train

    argv = ["--deepspeed", "/nonexistent/ds.json"]
    for rank, lines in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        assert train.main(argv) == 2
        err = capsys.readouterr().err
        assert len([x for x in err.splitlines() if x.startswith("train.py: error:")]) == lines, err


def test_a_checkpoint_without_a_tokenizer_says_which_one_the_run_uses(tmp_path, monkeypatch, capsys):
    """Its vocabulary fits the embedded-corpus tokenizer: the run goes on with it and says so first
    (the export carries that tokenizer); with --tokenizer given nothing is said."""
    import train
    from hf_models.registry import build_model

    model, _ = build_model("tiny-llama", seed=0)
    model.save_pretrained(tmp_path / "ckpt")  # weights and config, no tokenizer files
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train, "run", lambda prep: 0)
    argv = ["--deepspeed", BASE, "--model", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "out")]
    assert train.main(argv) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "has no tokenizer files" in line]
    assert len(said) == 1 and "embedded-corpus tokenizer (2,048 tokens)" in said[0] and "--tokenizer DIR" in said[0]
    assert train.main([*argv, "--tokenizer", "corpus"]) == 0
    assert "has no tokenizer files" not in capsys.readouterr().err
