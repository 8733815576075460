"""The training loop in the package (``ds_dhelix.training``):

one evaluation   DhelixTrainer.evaluate's eval_loss is train.py's Eval/loss on the same engine and
                 data (2 CPU ranks, tiny-llama TP=2 SI, prompt-completion records: answers of
                 varying length), bitwise; the Trainer's former plain mean of batch means is not
replica shares   the evaluation micro-batches of every data-parallel replica: each block once,
                 the fill-up weighed 0
options          bad LoopOptions are one ValueError naming the field
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from ds_dhelix.data import BlockDataset, valid_targets
from ds_dhelix.runtime.spawn import run_ranks
from ds_dhelix.training import LoopOptions, eval_microbatches
from tests.test_instruct import completion_records, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = 4


def _both_evaluations(rank, world, cfg: dict, data_path: str, out: str):
    """On one engine: DhelixTrainer.evaluate, the package's evaluate (what train.py reports as
    Eval/loss) and the mean of batch means DhelixTrainer reported before."""
    from transformers import TrainingArguments

    import ds_dhelix
    from ds_dhelix.data import DataOptions, load_data
    from ds_dhelix.training import evaluate
    from hf_models.registry import build_model, load_tokenizer_for

    tokenizer = load_tokenizer_for("tiny-llama")
    data = load_data(
        DataOptions(
            path=data_path,
            packing="none",
            seq_len=32,
            eval_fraction=0.25,
            pad_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        ),
        tokenizer,
    )
    args = TrainingArguments(
        output_dir=out,
        max_steps=1,
        per_device_train_batch_size=MICRO,
        per_device_eval_batch_size=MICRO,
        gradient_accumulation_steps=4,
        learning_rate=3e-3,
        adam_beta2=0.95,
        weight_decay=0.01,
        warmup_steps=10,
        use_cpu=True,
        report_to=[],
        deepspeed=cfg,
    )
    trainer = ds_dhelix.DhelixTrainer(model=build_model("tiny-llama", seed=0)[0], args=args, eval_dataset=data.eval)
    trainer_loss = trainer.evaluate()["eval_loss"]
    engine = trainer._engine
    train_py = evaluate(engine, data.eval, MICRO, prog="train.py")
    batch_means = [float(engine.eval_batch(iter([b]), num_microbatches=1)) for b in trainer.get_eval_dataloader()]
    targets = [valid_targets(b["labels"]) for b in trainer.get_eval_dataloader()]
    tp = engine.groups.tp_size
    engine.destroy()
    return {
        "trainer": trainer_loss,
        "train_py": train_py["loss"],
        "mean_of_means": sum(batch_means) / len(batch_means),
        "blocks": len(data.eval),
        "targets": targets,
        "tp": tp,
    }


@pytest.mark.timeout(400)
def test_trainer_eval_loss_is_train_py_eval_loss(tmp_path):
    with open(os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json")) as f:
        cfg = json.load(f)
    cfg["tensorboard"]["enabled"] = False
    path = str(tmp_path / "pc.jsonl")
    write_jsonl(path, completion_records(80))
    results = run_ranks(_both_evaluations, 2, args=(cfg, path, str(tmp_path / "out")), timeout=360)
    r = results[0]
    assert r["tp"] == 2 and r["blocks"] % MICRO == 0, r  # one replica: the same micro-batches on both paths
    assert len(set(r["targets"])) > 1, r  # answers of varying length: weighing by targets matters
    assert r["trainer"] == r["train_py"], r  # the same forwards, weighed and summed in the same order
    assert abs(r["mean_of_means"] - r["trainer"]) > 1e-3, r
    assert results[1]["trainer"] == r["trainer"] and results[1]["train_py"] == r["train_py"]


@pytest.mark.parametrize("blocks, dp", [(10, 1), (10, 2), (7, 2), (9, 4), (3, 4)])
def test_every_block_once_over_the_replicas_and_the_fill_up_weighs_nothing(blocks, dp):
    ids = torch.arange(blocks * 8).view(blocks, 8)
    data = BlockDataset({"input_ids": ids, "labels": ids.clone()})
    shares = [eval_microbatches(data, MICRO, r, dp) for r in range(dp)]
    assert len({len(batches) for batches, _ in shares}) == 1  # the same forwards on every replica
    seen = []
    for batches, weights in shares:
        for b, w in zip(batches, weights):
            assert b["input_ids"].shape == (MICRO, 8)
            if w:  # (a micro-batch of fill-up only keeps its labels: weighed 0, it counts nothing)
                assert w == valid_targets(b["labels"])
                real = b["labels"][:, 1:].ne(-100).any(dim=1)
                seen += b["input_ids"][real, 0].div(8, rounding_mode="floor").tolist()
    assert sorted(seen) == list(range(blocks))
    assert sum(sum(w) for _, w in shares) == blocks * 7


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"steps": 0}, "steps"),
        ({"steps": 5, "keep_checkpoints": 0}, "keep_checkpoints"),
        ({"steps": 5, "eval_interval": -1}, "eval_interval"),
        ({"steps": 5, "loss_average": "sum"}, "loss_average"),
        ({"steps": 5, "save_interval": 2}, "save_interval"),
        ({"steps": 5, "stop_after": 2}, "stop_after"),
        ({"steps": 5, "save_on_signal": True}, "save_on_signal"),
    ],
)
def test_bad_loop_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"LoopOptions.{field}"):
        LoopOptions(**kwargs)
