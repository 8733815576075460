"""The vocabulary split over TP (``hf_models/vocab.py``): each TP rank holds ceil(V/t) rows of the
embedding and head, the loss never gathers the logits, a vocabulary that TP does not divide is
padded and the padding reaches no probability, gradient or checkpoint.

The family suites (``test_dense_families``, ``test_moe_families``; GPT-2 and GPT-NeoX in
``test_adapters``) run every family at TP=2 with the split; here: vocabularies of 2047 rows (TP=2
pads one row), tied and untied, with softcapping, SI bitwise to sequential and close to HF."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from hf_models.vocab import VocabShard, check_vocab, pad_rows, shard_vocab, trim_padding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rows_start_and_padding_of_each_rank():
    shards = [VocabShard(2047, 2, r) for r in range(2)]
    assert [(s.rows, s.start, s.real) for s in shards] == [(1024, 0, 1024), (1024, 1024, 1023)]
    ids = torch.tensor([0, 1023, 1024, 2046])
    rows, inside = shards[1].local(ids)
    assert rows.tolist() == [0, 0, 0, 1022] and inside.tolist() == [False, False, True, True]
    with pytest.raises(
        ValueError,
        match=r"size 4: rank 3 would hold padding only; the largest TP size below it that gives every rank a token is 3 ",
    ):
        check_vocab(3, 4)
    check_vocab(2047, 2)  # rank 1 holds 1023 real rows


def test_shard_pads_ties_and_the_gather_trims():
    """Both ranks' rows put together (as the export does) are the original matrix; the tie stays one
    parameter; the padding row is zero; sharded loading pads what it reads."""
    torch.manual_seed(0)
    full = torch.randn(2047, 8)
    parts = []
    for rank in range(2):
        embed = torch.nn.Embedding(2047, 8, padding_idx=2040)
        embed.weight.data.copy_(full)
        head = torch.nn.Linear(8, 2047, bias=False)
        head.weight = embed.weight
        shard = shard_vocab(embed, head, 2, rank, group=None)
        assert head.weight is embed.weight and embed.weight.shape == (1024, 8)
        assert embed.weight.hf_selection == {0: slice(rank * 1024, rank * 1024 + shard.real)}
        assert embed.padding_idx == (None if rank == 0 else 2040 - 1024)
        parts.append(embed.weight)
    assert torch.equal(parts[1][-1], torch.zeros(8))
    assert torch.equal(trim_padding(parts[1], torch.cat([p.data for p in parts])), full)
    assert pad_rows(parts[1], full[1024:]).shape == (1024, 8)


def _checkpoint(root, preset: str, **changes) -> str:
    from transformers import AutoModelForCausalLM

    from hf_models.registry import load_config

    config = load_config(preset)
    config.num_hidden_layers = 2
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:2]
    for k, v in changes.items():
        setattr(config, k, v)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    out = root / f"{preset}-{config.vocab_size}"
    model.save_pretrained(out)
    return str(out)


LLAMA = ("tiny-llama", {"vocab_size": 2047, "tie_word_embeddings": False})
GEMMA = ("tiny-gemma3", {"vocab_size": 2047, "final_logit_softcapping": 30.0})  # tied, scaled embedding
CASES = {  # name: (preset, config changes, parity options)
    "untied": (*LLAMA, {}),
    "tied": ("tiny-gpt2", {"vocab_size": 2047}, {}),  # GPT-2: learned positions, tied head
    "softcap": (*GEMMA, {}),
    # the head and loss 24 tokens at a time (64 per micro-batch: chunks of 24, 24, 16)
    "softcap-chunked": (*GEMMA, {"extra": {"head_chunk": 24}}),
    "untied-tp1": (*LLAMA, {"tp": 1, "dp": 2}),
    "untied-tp1-chunked": (*LLAMA, {"tp": 1, "dp": 2, "extra": {"head_chunk": 24}}),
}
CHUNKED = {"softcap-chunked": "softcap", "untied-tp1-chunked": "untied-tp1"}


@functools.cache
def _results(root) -> dict:
    from ds_dhelix.verify import ParityOptions, run_parities

    made = {}
    opts = {}
    for name, (preset, changes, extra) in CASES.items():
        key = (preset, tuple(sorted(changes.items())))
        if key not in made:
            made[key] = _checkpoint(root, preset, **changes)
        opts[name] = ParityOptions(model=made[key], **{"tp": 2, "seq_len": 32, "steps": 2, **extra})
    return dict(zip(opts, run_parities(list(opts.values()), timeout=840)))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _results(tmp_path_factory.mktemp("vocab"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES)
def test_odd_vocabulary_si_bitwise_and_close_to_hf(results, case):
    r = results[case]
    assert r["bitwise_equal"], r["max_abs_diff_vs_sequential"]
    assert r["hf_close"] and r["ok"], json.dumps({k: r[k] for k in ("max_abs_diff_vs_hf", "max_loss_diff_vs_hf")})


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CHUNKED)
def test_chunked_head_trains_as_the_whole_one(results, case):
    """Chunks change only the order of the weight gradient's sums (one GEMM per chunk, added):
    the losses agree to fp32 rounding (1e-6 on losses of ~7.6)."""
    got, whole = results[case]["losses"]["si"], results[CHUNKED[case]]["losses"]["si"]
    assert max(abs(a - b) for a, b in zip(got, whole)) < 1e-6, (got, whole)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_py_exports_the_whole_vocabulary(tmp_path):
    """train.py at TP=2 on a checkpoint whose 2047-row vocabulary TP pads (tied, softcapped, in
    64-token head chunks): the export has 2047 rows and, loaded by plain transformers, reproduces
    the trained model's loss; its config and generation config carry the tokenizer's special ids."""
    from transformers import AutoModelForCausalLM

    from tests.test_train_e2e import run_train

    # a config without special ids (the export takes them from the tokenizer)
    model_dir = _checkpoint(tmp_path, GEMMA[0], **GEMMA[1], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = tmp_path / "ds.json"
    with open(os.path.join(ROOT, "ds_configs", "tiny_llama_cpu.json")) as f:
        ds = json.load(f)
    ds["dhelix"]["head_chunk"] = 64
    ds["tensorboard"]["output_path"] = str(tmp_path / "tb")
    cfg.write_text(json.dumps(ds))
    summary, _ = run_train(tmp_path, steps=4, extra=("--model", model_dir, "--deepspeed", str(cfg)))
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert out.get_input_embeddings().weight.shape[0] == 2047
    from hf_models.registry import load_tokenizer_for

    tok = load_tokenizer_for("tiny-llama")
    for cfg in (out.config, out.generation_config):
        assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
            tok.bos_token_id,
            tok.eos_token_id,
            tok.pad_token_id,
        )
    assert out.lm_head.weight.data_ptr() == out.get_input_embeddings().weight.data_ptr()  # still tied
    ids = torch.tensor(summary["probe_input_ids"])
    with torch.no_grad():
        loss = out(input_ids=ids, labels=ids).loss.item()
    assert abs(loss - summary["probe_loss"]) < 1e-4, (loss, summary["probe_loss"])
