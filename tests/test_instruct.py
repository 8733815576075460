"""Instruction data: chat and prompt/completion records read through ``datasets``, the loss on the
answers (the positions equal transformers' own assistant mask, token for token), whole-record
packing, streaming, evaluation during a train.py run, resume mid-epoch, and train.py against
examples/trainer_sft.py on the same file."""

import glob
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from ds_dhelix.data.records import CHATML_TEMPLATE, RecordEncoder, open_records
from ds_dhelix.data.sources import DataOptions, load_data
from tests.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
PLAIN_CHATML = CHATML_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def _say(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat_records(n=60, seed=0, long_every=7):
    """Chats with and without a system message, one to three user/assistant turns; every
    ``long_every``-th has a long answer (longer than the test's --seq-len)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": _say(rng, 4)}] if i % 2 else []
        for _ in range(1 + i % 3):
            messages += [
                {"role": "user", "content": _say(rng, rng.randint(2, 8))},
                {"role": "assistant", "content": _say(rng, 80 if i % long_every == 0 else rng.randint(2, 12))},
            ]
        out.append({"messages": messages})
    return out


def completion_records(n=60, seed=1):
    rng = random.Random(seed)
    return [
        {"prompt": _say(rng, rng.randint(3, 10)), "completion": _say(rng, 60 if i % 7 == 0 else rng.randint(2, 10))}
        for i in range(n)
    ]


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    from hf_models.registry import load_tokenizer_for

    return load_tokenizer_for("tiny-llama")


def _hf_masks(tokenizer, records):
    out = []
    for r in records:
        got = tokenizer.apply_chat_template(
            r["messages"],
            chat_template=CHATML_TEMPLATE,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        out.append((list(got["input_ids"]), list(got["assistant_masks"])))
    return out


def _unpadded(fields):
    """(ids, loss flags) of each block's tokens in order, padding left out (the pad id 0 is never
    a token of the records' text)."""
    ids, loss = [], []
    for b in range(fields["input_ids"].shape[0]):
        row, lab = fields["input_ids"][b], fields["labels"][b]
        keep = fields["attention_mask"][b].bool() if "attention_mask" in fields else row != 0
        ids.append(row[keep].tolist())
        loss.append((lab[keep] != -100).tolist())
    return ids, loss


@pytest.mark.parametrize("packing", ["docs", "none"])
def test_chat_loss_positions_are_transformers_assistant_mask(tmp_path, tokenizer, packing):
    records = chat_records()
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    seq = 96
    data = load_data(DataOptions(path=path, chat_template="chatml", packing=packing, seq_len=seq), tokenizer)
    assert data.format == "chat" and data.loss_on == "answers"
    expected_ids, expected_mask, no_loss, long = [], [], 0, 0
    for ids, mask in _hf_masks(tokenizer, records):
        if not any(mask[1:seq]):  # an answer that begins past --seq-len: nothing to learn, left out
            no_loss += 1
            continue
        long += len(ids) > seq
        expected_ids += ids[:seq]
        expected_mask += [bool(m) for m in mask[:seq]]
    got_ids, got_loss = _unpadded(data.train.fields)
    flat_ids = [t for row in got_ids for t in row]
    flat_loss = [f for row in got_loss for f in row]
    assert flat_ids == expected_ids  # whole records, in file order, cut to --seq-len
    assert flat_loss == expected_mask  # token for token
    s = data.stats
    assert s.loss_tokens == sum(expected_mask)
    assert s.truncated == long > 0 and s.no_loss == no_loss and s.dropped == 0 and s.records == len(records)
    dropped = load_data(
        DataOptions(path=path, chat_template="chatml", packing=packing, seq_len=seq, drop_long=True), tokenizer
    )
    too_long = sum(len(ids) > seq for ids, _ in _hf_masks(tokenizer, records))
    assert dropped.stats.dropped == too_long and dropped.stats.truncated == 0


def test_options_the_records_would_not_use_are_refused(tmp_path, tokenizer):
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_records(8))
    pc = write_jsonl(tmp_path / "pc.jsonl", completion_records(8))
    for options, words in (
        (DataOptions(path=pc, chat_template="chatml"), "--chat-template renders chat"),
        (DataOptions(path=chat, chat_template="chatml", drop_long=True), "--drop-long"),
        (DataOptions(drop_long=True, packing="docs"), "text records under --packing docs"),
        (DataOptions(path=chat, chat_template="chatml", workers=2, stream_above=1), "--data-workers 2"),
    ):
        with pytest.raises(ValueError, match=words):
            load_data(options, tokenizer)


def test_template_without_markers_gives_the_same_mask(tokenizer):
    records = chat_records(12)
    marked = RecordEncoder(tokenizer, "chat", chat_template=CHATML_TEMPLATE)
    plain = RecordEncoder(tokenizer, "chat", chat_template=PLAIN_CHATML)
    assert marked.marked and not plain.marked
    batch = {"messages": [r["messages"] for r in records]}
    assert marked(batch) == plain(batch)


def test_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    rewrites = PLAIN_CHATML.replace(
        "{{ m['content'] }}<|im_end|>", "{{ m['content'] if loop.last else '...' }}<|im_end|>"
    )
    encoder = RecordEncoder(tokenizer, "chat", chat_template=rewrites)
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        encoder({"messages": [chat_records(3)[2]["messages"]]})


def test_prompt_completion_loss_is_the_completion(tmp_path, tokenizer):
    records = completion_records()
    path = write_jsonl(tmp_path / "pc.jsonl", records)
    seq = 48
    data = load_data(DataOptions(path=path, packing="docs", seq_len=seq), tokenizer)
    assert data.format == "prompt-completion"
    expected_ids, expected_mask = [], []
    for r in records:
        p = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        c = tokenizer(r["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        expected_ids += (p + c)[:seq]
        expected_mask += ([False] * len(p) + [True] * len(c))[:seq]
    got_ids, got_loss = _unpadded(data.train.fields)
    assert [t for row in got_ids for t in row] == expected_ids
    assert [f for row in got_loss for f in row] == expected_mask
    assert data.stats.loss_tokens == sum(expected_mask)
    everything = load_data(DataOptions(path=path, packing="docs", seq_len=seq, loss_on="all"), tokenizer)
    assert everything.stats.loss_tokens > data.stats.loss_tokens  # the prompts too


def test_file_kinds_read_the_same_records(tmp_path, tokenizer):
    """.jsonl, .json, .parquet and a save_to_disk directory: the same blocks."""
    import datasets

    records = completion_records(30)
    jsonl = write_jsonl(tmp_path / "d.jsonl", records)
    (tmp_path / "d.json").write_text(json.dumps(records))
    ds = datasets.Dataset.from_list(records)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    opts = dict(packing="docs", seq_len=48)
    base = load_data(DataOptions(path=jsonl, **opts), tokenizer).train.fields
    for other in ("d.json", "d.parquet", "saved"):
        got = load_data(DataOptions(path=str(tmp_path / other), **opts), tokenizer).train.fields
        assert all(torch.equal(base[k], got[k]) for k in base), other


def test_tokenisation_is_cached_across_runs(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(40))
    cache_dir = os.path.dirname(open_records(path).cache_files[0]["filename"])

    def cached():
        return sorted(glob.glob(os.path.join(cache_dir, "cache-*.arrow")))

    first = load_data(DataOptions(path=path, chat_template="chatml", packing="docs", seq_len=96), tokenizer)
    files = cached()
    assert files  # the tokenised records were written beside datasets' copy of the file
    again = load_data(DataOptions(path=path, chat_template="chatml", packing="docs", seq_len=96), tokenizer)
    assert cached() == files  # read back: nothing tokenised a second time
    assert all(torch.equal(first.train.fields[k], again.train.fields[k]) for k in first.train.fields)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_stream_packs_the_blocks_of_the_whole_file_and_resumes(tmp_path, tokenizer, kind):
    """A streamed file gives the blocks of the whole one (parquet: read a batch of rows at a time
    by ``records.ParquetRecords``, not datasets' streaming), and a resumed stream continues."""
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(50))
    if kind == "parquet":
        import datasets

        from ds_dhelix.data.records import ParquetRecords

        path = str(tmp_path / "chat.parquet")
        datasets.Dataset.from_list(chat_records(50)).to_parquet(path, batch_size=16)  # several row groups
        assert isinstance(open_records(path, streaming=True), ParquetRecords)
    opts = dict(path=path, chat_template="chatml", packing="docs", seq_len=96)
    whole = load_data(DataOptions(**opts, stream_above=None), tokenizer)
    stream = load_data(DataOptions(**opts, stream_above=1), tokenizer)
    assert stream.streaming and not whole.streaming
    blocks = list(stream.stream(0))
    assert torch.equal(torch.stack([b["input_ids"] for b in blocks]), whole.train.fields["input_ids"])
    assert stream.stats.as_dict() == whole.stats.as_dict()
    for make in (
        lambda start: stream.batches(2, seed=3, rank=1, replicas=2, start=start),
        lambda start: whole.batches(2, seed=3, rank=1, replicas=2, start=start),
    ):
        straight = [next(it) for it in [make(0)] for _ in range(40)]  # several epochs
        resumed = [next(it) for it in [make(17)] for _ in range(23)]
        assert all(torch.equal(a[k], b[k]) for a, b in zip(straight[17:], resumed) for k in a)


def test_eval_fraction_holds_records_out(tmp_path, tokenizer):
    records = chat_records(50)
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    data = load_data(
        DataOptions(path=path, chat_template="chatml", packing="none", seq_len=96, eval_fraction=0.2), tokenizer
    )
    assert data.stats.records == 40 and data.eval.stats.records == 10
    train_rows = {tuple(r.tolist()) for r in data.train.fields["input_ids"]}
    assert not any(tuple(r.tolist()) in train_rows for r in data.eval.fields["input_ids"])


# ---------------------------------------------------------------- train.py, end to end


def _config(tmp_path, schedule):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": schedule},
        "dhelix": {"enabled": True, "schedule": schedule, "tensor_parallel": {"size": 2}},
    }
    path = tmp_path / f"{schedule}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _train(tmp_path, name, schedule, *extra, script="train.py"):
    out = tmp_path / name
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        os.path.join(ROOT, script),
        "--deepspeed",
        _config(tmp_path, schedule),
        "--output-dir",
        str(out / "hf"),
        "--json-summary",
        str(tmp_path / f"{name}.json"),
        *extra,
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / f"{name}.json").read_text()), proc


def _scalars(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for f in glob.glob(os.path.join(tb_dir, "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(f)
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            found.update({e.step: e.value for e in acc.Scalars(tag)})
    return found


@pytest.mark.slow
@pytest.mark.extended  # (resume is covered by test_long_job in the main tier: the CI budget)
def test_chat_run_evaluates_and_si_equals_sequential_across_a_resume(tmp_path, tokenizer):
    """20 steps on a chat file, TP=2, --eval-interval 5: sequential straight through; SI stopped
    inside its second epoch and resumed. Losses and eval losses bitwise equal; Eval/loss at
    5/10/15/20 in TensorBoard; the data fields say what the loss was computed on."""
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(40, long_every=5))
    common = [
        "--data",
        path,
        "--chat-template",
        "chatml",
        "--packing",
        "docs",
        "--seq-len",
        "64",
        "--steps",
        "20",
        "--eval-fraction",
        "0.15",
        "--eval-interval",
        "5",
    ]
    blocks = len(
        load_data(
            DataOptions(path=path, chat_template="chatml", packing="docs", seq_len=64, eval_fraction=0.15, seed=1234),
            tokenizer,
        ).train
    )
    epoch_steps = blocks // 4  # micro 2 x accumulation 2, one replica
    stop = next(k for k in range(epoch_steps + 1, 20) if k % epoch_steps)  # inside the second epoch
    seq, _ = _train(tmp_path, "seq", "sequential", *common)
    ckpt = str(tmp_path / "ckpt")
    first, _ = _train(tmp_path, "si1", "si", *common, "--ds-checkpoint", ckpt, "--stop-after", str(stop))
    second, proc = _train(tmp_path, "si2", "si", *common, "--ds-checkpoint", ckpt, "--resume", "auto")
    assert second["start_step"] == stop
    assert first["losses"] + second["losses"] == seq["losses"]  # bitwise
    from transformers import AutoTokenizer

    exported = AutoTokenizer.from_pretrained(tmp_path / "seq" / "hf")  # with the template it trained on
    assert exported.chat_template == CHATML_TEMPLATE
    assert first["eval_losses"] + second["eval_losses"] == seq["eval_losses"]
    assert [e["step"] for e in seq["eval_losses"]] == [5, 10, 15, 20]
    assert seq["eval_losses"][-1]["loss"] < seq["eval_losses"][0]["loss"]
    tb = _scalars(str(tmp_path / "tb"), "Eval/loss")
    assert sorted(tb) == [5, 10, 15, 20]
    assert abs(tb[20] - seq["eval_losses"][-1]["loss"]) < 1e-6  # (TensorBoard stores float32)
    d = seq["data"]
    assert d["format"] == "chat" and d["loss_on"] == "answers" and d["truncated"] > 0 and d["records"] == 34
    assert 0 < d["loss_tokens"] < d["tokens"] and 0 < d["padding_fraction"] < 1 and d["eval"]["records"] == 6
    assert _scalars(str(tmp_path / "tb"), "Data/loss_tokens")[0] == d["loss_tokens"]
    assert (
        f"step 20 {second['eval_losses'][-1]['loss']:.4f}" in proc.stdout
        and "chat records, loss on answers" in proc.stdout
    )


@pytest.mark.slow
def test_train_py_and_trainer_example_first_step_loss(tmp_path):
    """The same chat file through train.py and through examples/trainer_sft.py (DhelixTrainer,
    --train-py-order): the same micro-batches, so the same first-step loss."""
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(40))
    common = ["--data", path, "--chat-template", "chatml", "--packing", "docs", "--seq-len", "64"]
    ours, _ = _train(tmp_path, "train_py", "si", *common, "--steps", "2")
    theirs, _ = _train(
        tmp_path, "trainer", "si", *common, "--max-steps", "2", "--train-py-order", script="examples/trainer_sft.py"
    )
    print(f"first-step loss: train.py {ours['losses'][0]!r}, trainer_sft.py {theirs['losses'][0]!r}")
    # the same engine and batches; the Trainer averages the micro-batch losses itself (float32
    # sums in another order): equal to ~1e-7, held to 1e-5
    assert abs(ours["losses"][0] - theirs["losses"][0]) < 1e-5, (ours["losses"], theirs["losses"])


def write_parquet(path, records, size: int, group_rows: int = 20_000) -> None:
    """``records`` repeated into a parquet file of about ``size`` bytes, row group by row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(records)
    table = pa.concat_tables([table] * max(1, group_rows // len(records)))
    with pq.ParquetWriter(path, table.schema) as w:
        while True:
            w.write_table(table, row_group_size=group_rows)
            if os.path.getsize(path) >= size:
                break


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_1gb_file_streams_with_flat_memory(tmp_path, kind):
    """5 steps on a 1 GB chat file (streamed: above --stream-above 256MB) against the same run on
    a 1 MB file: the peak RSS grows by less than 200 MiB; jsonl through datasets' streaming, parquet
    row group by row group (``records.ParquetRecords``)."""
    small, big = tmp_path / f"small.{kind}", tmp_path / f"big.{kind}"
    if kind == "parquet":
        write_parquet(small, chat_records(400), 2**20, group_rows=400)
        write_parquet(big, chat_records(400), 2**30)
    else:
        lines = [json.dumps(r) + "\n" for r in chat_records(400)]
        block = "".join(lines).encode()
        small.write_bytes((block * (2**20 // len(block) + 1))[: 2**20].rsplit(b"\n", 1)[0] + b"\n")
        with open(big, "wb") as f:
            for _ in range(2**30 // len(block) + 1):
                f.write(block)
    common = ["--chat-template", "chatml", "--packing", "docs", "--seq-len", "64", "--steps", "5"]
    runs = {}
    for name, path in (("small", small), ("big", big)):
        summary, _ = _train(tmp_path, name, "si", "--data", str(path), *common)
        m = summary["memory"][0]
        runs[name] = (max(m["baseline_rss_mib"], m["load_peak_rss_mib"], m["train_peak_rss_mib"]), summary["data"])
    assert runs["big"][1]["streaming"] and not runs["small"][1]["streaming"]
    growth = runs["big"][0] - runs["small"][0]
    print(f"peak RSS: 1 MB file {runs['small'][0]:.0f} MiB, 1 GB file {runs['big'][0]:.0f} MiB (+{growth:.0f})")
    assert growth < 200, runs


def test_a_checkpoint_from_before_data_formats_resumes_text_only():
    """A checkpoint written before records had a format recorded source, tokens, seed and packing;
    it resumes a text run with those, and is refused for a chat run or other tokens."""
    from ds_dhelix.engine.resume import check_resume

    old = {"source": "/d.txt", "tokens": 100, "seed": 1, "packing": "docs"}
    new = {
        "source": "/d.txt",
        "seed": 1,
        "format": "text",
        "loss_on": "all",
        "packing": "docs",
        "drop_long": False,
        "streaming": False,
        "eval_fraction": 0.0,
        "chat_template": None,
        "tokens": 100,
        "records": 9,
        "loss_average": "microbatches",
    }
    state = {"total_steps": 10, "data": new}
    assert check_resume({"step": 5, "total_steps": 10, "data": old}, state) == []
    for changed in ({"format": "chat", "loss_on": "answers"}, {"tokens": 101}):
        with pytest.raises(ValueError, match="training data"):
            check_resume({"step": 5, "total_steps": 10, "data": old}, {"total_steps": 10, "data": {**new, **changed}})
    with pytest.raises(ValueError, match="training data"):  # a checkpoint of this version: every field
        check_resume(
            {"step": 5, "total_steps": 10, "data": new}, {"total_steps": 10, "data": {**new, "drop_long": True}}
        )


def test_a_stream_too_short_for_one_step_is_refused_before_any_model(tmp_path, monkeypatch, capsys):
    import train

    path = write_jsonl(tmp_path / "pc.jsonl", completion_records(3))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train, "run", lambda *a: pytest.fail("started"))
    rc = train.main(
        [
            "--deepspeed",
            os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json"),
            "--data",
            path,
            "--packing",
            "none",
            "--stream-above",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "fewer than 4 blocks" in err and "one micro-batch (4)" in err, err


STANDARD_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("prompt", [False, True])
def test_builtin_chatml_renders_standard_chatml_byte_for_byte(tokenizer, prompt):
    """What inference with a stock ChatML template sees is what the model was trained on: a newline
    after every turn's <|im_end|> (transformers' trim_blocks would drop one written after a block tag)."""
    for r in chat_records(n=6):
        ours = tokenizer.apply_chat_template(
            r["messages"], chat_template=CHATML_TEMPLATE, tokenize=False, add_generation_prompt=prompt
        )
        standard = tokenizer.apply_chat_template(
            r["messages"], chat_template=STANDARD_CHATML, tokenize=False, add_generation_prompt=prompt
        )
        assert ours == standard
        assert "<|im_end|>\n<|im_start|>" in ours
