"""Document-aware data: EOS between documents, --packing docs (positions restart, attention masked
across documents) and --packing none (right padding honoured), against HF's own masked loss, SI
equal to sequential bit for bit in every mode; masks the op graph cannot honour are refused."""

from __future__ import annotations

import pytest
import torch

from ds_dhelix.data import (
    TokenDataset,
    batch_iterator,
    document_positions,
    encode_documents,
    hf_model_inputs,
    split_documents,
)
from ds_dhelix.engine.stepping import check_attention_mask
from ds_dhelix.runtime.executor import Executor
from hf_models.adapters import adapter_for
from hf_models.registry import build_model

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from ds_dhelix.data import get_tokenizer

    return get_tokenizer(tmp_path_factory.getbasetemp() / "dhelix-cache", 2048)  # the session's cache


def _docs_batch(seed=0, b=2, s=32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 2000, (b, s), generator=g)
    ids[0, 10], ids[1, 5], ids[1, 20] = EOS, EOS, EOS
    return {"input_ids": ids, **document_positions(ids, EOS)}


def _padded_batch(seed=0, b=2, s=32, lengths=(20, 32)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 2000, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def test_documents_end_with_eos_and_positions_restart(tokenizer):
    docs = split_documents("first document\n\nsecond one here\n\n\n\nthird")
    assert docs == ["first document", "second one here", "third"]
    ids = encode_documents(tokenizer, docs)
    assert (ids == tokenizer.eos_token_id).sum() == 3 and ids[-1] == tokenizer.eos_token_id
    blocks = torch.tensor([[5, 6, EOS, 7, 8, EOS, 9, 10]])
    out = document_positions(blocks, EOS)
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert out["labels"].tolist() == [[5, 6, EOS, -100, 8, EOS, -100, 10]]  # no target across a boundary


def test_packing_none_pads_each_document(tokenizer):
    ids = torch.tensor([5, 6, EOS, 7, 8, 9, 10, 11, EOS, 12, EOS])
    ds = TokenDataset(ids, 4, packing="none", eos_id=EOS, pad_id=0)
    assert ds.fields["input_ids"].tolist() == [[5, 6, EOS, 0], [7, 8, 9, 10], [11, EOS, 0, 0], [12, EOS, 0, 0]]
    assert ds.fields["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert ds.fields["labels"][0].tolist() == [5, 6, EOS, -100]
    batch = next(batch_iterator(ids, 2, 4, seed=0, packing="none", eos_id=EOS))
    assert set(batch) == {"input_ids", "labels", "attention_mask"} and batch["input_ids"].shape == (2, 4)
    docs = next(batch_iterator(torch.arange(3, 67), 2, 8, seed=0, packing="docs", eos_id=EOS))
    assert set(docs) == {"input_ids", "labels", "position_ids"}


def _hf_loss(preset, attn, batch):
    model, _ = build_model(preset, seed=0, attn_implementation=attn)
    inputs = hf_model_inputs(batch, torch.float32 if attn == "eager" else None)
    return float(model(**inputs).loss.detach())


def _graph_losses(preset, attn, batches, schedule):
    model, _ = build_model(preset, seed=0, attn_implementation=attn)
    graph = adapter_for(model.config).build_graph(model)
    mbs = Executor(graph).run_microbatches(batches, schedule, 1.0 / len(batches))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [float(mb.loss) for mb in mbs], grads


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "tiny-gpt-neox"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_docs_and_padding_match_hf_masked_loss(preset, attn):
    """The op graph's loss on packed documents equals HF's with the same position_ids and block
    mask; on right padding, HF's with the attention_mask (4e-6: float rounding of different kernel
    orders; a mask left out moves the loss by ~1e-2)."""
    for batch in (_docs_batch(), _padded_batch()):
        ours, _ = _graph_losses(preset, attn, [batch], "sequential")
        assert abs(ours[0] - _hf_loss(preset, attn, batch)) < 4e-6, (preset, attn, sorted(batch))
    docs = _docs_batch()
    plain = {"input_ids": docs["input_ids"], "labels": docs["labels"]}  # same targets, no document mask
    assert abs(_graph_losses(preset, attn, [docs], "sequential")[0][0] - _hf_loss(preset, attn, plain)) > 1e-3


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-phimoe"])
def test_si_equals_sequential_bitwise_for_docs(preset):
    batches = [_docs_batch(seed) for seed in range(4)]
    seq, g_seq = _graph_losses(preset, "sdpa", batches, "sequential")
    si, g_si = _graph_losses(preset, "sdpa", batches, "si")
    assert seq == si and all(torch.equal(g_seq[k], g_si[k]) for k in g_seq)


def test_si_equals_sequential_bitwise_for_padding():
    batches = [_padded_batch(seed, lengths=(10 + seed, 32)) for seed in range(4)]
    seq, g_seq = _graph_losses("tiny-llama", "sdpa", batches, "sequential")
    si, g_si = _graph_losses("tiny-llama", "sdpa", batches, "si")
    assert seq == si and all(torch.equal(g_seq[k], g_si[k]) for k in g_seq)


def test_masks_the_graph_cannot_honour_are_refused():
    ok = _padded_batch()
    check_attention_mask(ok, 0)  # right padding, ignored targets
    left = {**ok, "attention_mask": ok["attention_mask"].flip(1)}
    with pytest.raises(ValueError, match="left padding or holes"):
        check_attention_mask(left, 1)
    counted = {**ok, "labels": ok["input_ids"]}
    with pytest.raises(ValueError, match="must be -100"):
        check_attention_mask(counted, 2)
    with pytest.raises(ValueError, match="load-balancing loss"):
        check_attention_mask(ok, 3, moe=True)
    with pytest.raises(ValueError, match="shape"):
        check_attention_mask({**ok, "attention_mask": torch.zeros(2, 1, 32, 32)}, 4)


@pytest.mark.timeout(300)
def test_parity_packing_docs_bitwise_and_matches_hf_document_masked_loss():
    from ds_dhelix.verify import ParityOptions, run_parity

    r = run_parity(ParityOptions(model="tiny-llama", tp=2, schedule="si", packing="docs"), timeout=280)
    assert r["bitwise_equal"] and r["hf_close"], r
    assert "block-diagonal causal mask" in r["hf_comparison"]
    assert r["max_loss_diff_vs_hf"] <= 1e-5
