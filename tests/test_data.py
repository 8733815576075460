"""Embedded corpus, tokenizer (round trip, cache, concurrent builders) and the batch loader."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ds_dhelix.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TokenDataset,
    batch_iterator,
    build_embedded_corpus,
    check_batch_shape,
    corpus,  # get_tokenizer calls corpus.train_tokenizer
    corpus_hash,
    encode_text,
    get_tokenizer,
    load_text,
    train_tokenizer,
)

SAMPLES = [
    "Return the number of items in a container.",
    "def f(x):\n    return x ** 2  # square\n\n\tTabs, CRLF\r\nand  double  spaces ",
    "Unicode: naïve café — 東京 🙂, and bytes \x00\x7f.",
    " leading space and trailing newline\n",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenizer cache for the whole session (test_presets.py reuses it)."""
    return tmp_path_factory.getbasetemp() / "dhelix-cache"


@pytest.fixture(scope="session")
def tokenizer(cache_dir):
    return get_tokenizer(cache_dir, 2048)


# ---------------------------------------------------------------- corpus


def test_corpus_size_and_content():
    text = build_embedded_corpus()
    assert 800_000 < len(text.encode("utf-8")) < 1_600_000
    assert "# assignment" in text  # pydoc topic
    assert "## json.dumps" in text  # stdlib docstring
    assert "warning_once" not in text  # methods patched in by installed libraries are left out


def test_corpus_same_in_a_fresh_process():
    """The cache key (and every rank's tokenizer) depends on the corpus being the same everywhere."""
    code = "from ds_dhelix.data import build_embedded_corpus, corpus_hash; print(corpus_hash(build_embedded_corpus()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == corpus_hash(build_embedded_corpus())


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_specials(tokenizer):
    assert len(tokenizer) == 2048
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert all(0 <= i < 2048 for i in ids)
    # BPE merges learned on English compress it well below one token per byte
    sample = build_embedded_corpus()[:20_000]
    assert len(tokenizer.encode(sample, add_special_tokens=False)) < len(sample.encode()) / 2.5


def test_encode_text_round_trip(tokenizer):
    text = build_embedded_corpus()[:50_000]
    ids = encode_text(tokenizer, text)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert tokenizer.decode(ids.tolist()) == text


def test_tokenizer_cache_is_reused(cache_dir, tokenizer, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("tokenizer retrained although cached")

    monkeypatch.setattr(corpus, "train_tokenizer", no_training)
    again = get_tokenizer(cache_dir, 2048)
    assert again.get_vocab() == tokenizer.get_vocab()
    entries = os.listdir(cache_dir)
    assert len(entries) == 1 and entries[0].startswith("tokenizer-") and "-v2048-" in entries[0]


def test_tokenizer_save_pretrained(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded.decode(loaded.encode(SAMPLES[1], add_special_tokens=False)) == SAMPLES[1]


def test_concurrent_builder_losing_the_race(cache_dir, tokenizer, tmp_path, monkeypatch):
    """Another rank renames its copy into place while we train: we use theirs and leave no temp dir."""
    (winner,) = os.listdir(cache_dir)
    real_train = corpus.train_tokenizer

    def train_while_other_rank_finishes(text, vocab_size):
        tok = real_train(text[:100_000], vocab_size)
        shutil.copytree(cache_dir / winner, tmp_path / winner)
        return tok

    monkeypatch.setattr(corpus, "train_tokenizer", train_while_other_rank_finishes)
    got = get_tokenizer(tmp_path, 2048)
    assert got.get_vocab() == tokenizer.get_vocab()
    assert os.listdir(tmp_path) == [winner]


def test_training_is_deterministic_and_checks_vocab():
    text = build_embedded_corpus()[:100_000]
    a, b = train_tokenizer(text, 512), train_tokenizer(text, 512)
    assert a.get_vocab() == b.get_vocab() and len(a) == 512
    with pytest.raises(ValueError, match="vocab_size must be an int >= 259"):
        train_tokenizer(text, 100)
    with pytest.raises(ValueError, match="empty text"):
        train_tokenizer("", 512)


# ---------------------------------------------------------------- user text


def test_load_text(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world\n", encoding="utf-8")
    assert load_text(txt) == "hello world\n"
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 2}) + "\n")
    assert load_text(jl) == "one\n\ntwo"


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("missing.txt", None, "not found"),
        ("empty.txt", "  \n", "holds no text"),
        ("data.csv", "a,b", r"unsupported text file .*\.txt, \.jsonl"),
        ("bad.jsonl", '{"text": "ok"}\n{"text": \n', r"bad\.jsonl:2: not valid JSON"),
        ("nofield.jsonl", '{"body": "x"}\n', r'nofield\.jsonl:1: .*"text" string field'),
        ("binary.txt", b"\xff\xfe\x00abc", "cannot read text file .* as UTF-8"),
    ],
)
def test_load_text_errors(tmp_path, name, content, match):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_text(path)


def test_load_text_directory(tmp_path):
    d = tmp_path / "dir.txt"
    d.mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        load_text(d)


# ---------------------------------------------------------------- batches


def take(it, n):
    return [next(it) for _ in range(n)]


def test_batch_shapes_and_labels():
    ids = torch.arange(1000)
    it = batch_iterator(ids, micro_batch_size=4, seq_len=16, seed=0)
    for batch in take(it, 30):  # 62 blocks -> 15 batches per epoch: crosses epochs
        check_batch_shape(batch, (4, 16))
        assert torch.equal(batch["input_ids"], batch["labels"])
        assert batch["input_ids"].dtype == torch.long
        # blocks are contiguous runs of the token stream, starting at a block boundary
        first = batch["input_ids"][:, 0]
        assert torch.all(first % 16 == 0)
        assert torch.equal(batch["input_ids"] - first[:, None], torch.arange(16).expand(4, 16))


def test_batches_deterministic_by_seed_and_reshuffled_per_epoch():
    ids = torch.arange(4096)
    a = take(batch_iterator(ids, 2, 32, seed=7), 20)
    b = take(batch_iterator(ids, 2, 32, seed=7), 20)
    c = take(batch_iterator(ids, 2, 32, seed=8), 20)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))
    epochs = take(batch_iterator(ids, 4, 32, seed=0), 64)  # 128 blocks / 4 = 32 batches per epoch
    first = torch.cat([e["input_ids"][:, 0] for e in epochs[:32]])
    second = torch.cat([e["input_ids"][:, 0] for e in epochs[32:]])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(0, 4096, 32))
    assert not torch.equal(first, second)


def test_sharding_disjoint_and_complete():
    ids = torch.arange(100 * 8)  # 100 blocks; 3 replicas x 2 per batch -> 16 batches each, 96 blocks used
    starts = []
    for rank in range(3):
        batches = take(batch_iterator(ids, 2, 8, seed=3, rank=rank, num_replicas=3), 16)
        starts.append({int(s) for b in batches for s in b["input_ids"][:, 0]})
        assert len(starts[-1]) == 32
    assert not (starts[0] & starts[1]) and not (starts[0] & starts[2]) and not (starts[1] & starts[2])
    assert len(starts[0] | starts[1] | starts[2]) == 96


def test_dataset_items():
    ds = TokenDataset(list(range(50)), seq_len=8)
    assert len(ds) == 6
    assert ds[1]["input_ids"].tolist() == list(range(8, 16))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(micro_batch_size=4, seq_len=64), r"cannot fill one micro-batch of 4 on each of 2 replicas"),
        (dict(micro_batch_size=1, seq_len=1000), "fewer than one block"),
        (dict(micro_batch_size=0, seq_len=8), "micro_batch_size must be a positive int"),
        (dict(micro_batch_size=1, seq_len=8, rank=2), r"rank must be an int in \[0, 2\)"),
    ],
)
def test_batch_iterator_errors(kwargs, match):
    args = dict(seed=0, num_replicas=2) | kwargs
    with pytest.raises(ValueError, match=match):
        batch_iterator(torch.arange(256), **args)


def test_check_batch_shape_errors():
    good = {"input_ids": torch.zeros(2, 128, dtype=torch.long), "labels": torch.zeros(2, 128, dtype=torch.long)}
    check_batch_shape(good, (2, 128))
    short = {"input_ids": torch.zeros(2, 96, dtype=torch.long), "labels": torch.zeros(2, 96, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"sequence length changed: expected 128, got 96"):
        check_batch_shape(short, (2, 128))
    with pytest.raises(ValueError, match=r"micro-batch size changed: expected 4, got 2"):
        check_batch_shape(good, (4, 128))
    with pytest.raises(ValueError, match="batch has no 'labels'"):
        check_batch_shape({"input_ids": good["input_ids"]}, (2, 128))
    with pytest.raises(ValueError, match="torch.long"):
        check_batch_shape({k: v.float() for k, v in good.items()}, (2, 128))


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_record():
    """Every path ids enter by (packed records, preference pairs, rollouts' own ids) refuses an id
    outside [0, vocab_size) with the record; ``vocab_size`` None checks nothing."""
    from ds_dhelix.data.packing import Packer, check_ids

    records = [{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}, {"input_ids": [4, 50, 6], "loss_mask": [1, 1, 1]}]
    with pytest.raises(ValueError, match=r"record 2: token id 50 is outside the model's vocabulary of 10 ids \(0..9\)"):
        list(Packer(4, "concat", whole_records=False, vocab_size=10).blocks(records))
    assert len(list(Packer(3, "concat", whole_records=False).blocks(records))) == 2
    check_ids([0, 9], 10, "x")
    with pytest.raises(ValueError, match="x: token id -1"):
        check_ids([3, -1], 10, "x")


def test_the_vocabulary_check_on_row_records(tmp_path):
    from ds_dhelix.data.preference import PairEncoder, load_pairs
    from ds_dhelix.data.rollouts import RolloutEncoder, load_rollouts
    from hf_models.registry import load_tokenizer_for

    tok = load_tokenizer_for("tiny-llama")
    pair = {"prompt": "question", "chosen": "a good answer", "rejected": "a bad one"}
    assert len(load_pairs([pair], PairEncoder(tok), 32, 0, vocab_size=len(tok))) == 1
    with pytest.raises(ValueError, match="record 1: token id .* outside the model's vocabulary of 3 ids"):
        load_pairs([pair], PairEncoder(tok), 32, 0, vocab_size=3)
    rollout = {"prompt_ids": [5, 6], "completion_ids": [[7, 8], [2048]], "rewards": [1.0, 0.0]}
    with pytest.raises(ValueError, match="record 1: token id 2048"):
        load_rollouts([rollout], RolloutEncoder(tok), 8, 0, vocab_size=2048)


def test_the_embedding_refuses_an_id_outside_the_vocabulary_on_the_device():
    """The engine's own backstop (data from a script or the Trainer, not checked by train.py):
    the vocabulary-parallel embedding and loss assert on the device, without a host sync."""
    import torch
    from torch import nn

    from hf_models.vocab import VocabShard, embed_ops, refuse_outside

    shard = VocabShard(vocab=10, tp=2, rank=0)
    lookup = embed_ops(nn.Embedding(5, 4), shard)[0].fn
    (he,) = lookup({"tp_ids": torch.tensor([[1, 9]])})
    assert he.shape == (2, 1, 4)
    with pytest.raises(RuntimeError, match="outside the model's vocabulary of 10 ids"):
        lookup({"tp_ids": torch.tensor([[1, 10]])})
    refuse_outside(torch.tensor([3, -100]), 10, ignore=-100)
    with pytest.raises(RuntimeError, match="vocabulary of 10 ids"):
        refuse_outside(torch.tensor([3, -100]), 10)
