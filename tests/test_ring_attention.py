"""Ring attention (``"context_parallel": {"comm": "ring"}``): key/value blocks passed around the CP
ranks point to point (``attn.kv<i>`` COMM ops), zig-zag split, log-sum-exp merge.

    math       the ring steps of c = 2, 3, 4 ranks, run in one process with each rank's blocks
               handed over by hand, give full causal attention and its gradients (and the
               block-diagonal mask of packed documents)
    parity     CP=2 ring SI bitwise equal to sequential and close to unsharded HF: tiny-llama at
               seq 512, packed documents, GPT-2 (learned positions) at ZeRO-2, Phi-MoE; CP=4 on 4
               ranks (three ring steps); heads too few for Ulysses
    refused    a sequence the zig-zag split cannot cut, an adapter without a ring core
"""

from types import SimpleNamespace

import pytest
import torch

from ds_dhelix.config.dims import ParallelDims
from ds_dhelix.engine.build import check_setup
from ds_dhelix.graph.model_graph import comp
from ds_dhelix.runtime.groups import ContextShards
from hf_models.common import context_attention, make_side_fn
from hf_models.registry import load_config
from hf_models.ring import AttentionCore, zigzag_index
from tests.test_context_parallel import _assert_parity
from tests.test_context_parallel import _parity as cp_parity


def _config(cp=2, tp=1):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "dhelix": {"enabled": True, "tensor_parallel": {"size": tp}, "context_parallel": {"size": cp, "comm": "ring"}},
    }


# ------------------------------------------------------------------ the ring's math, one process
def test_zigzag_split_pairs_early_and_late_chunks():
    assert zigzag_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([zigzag_index(24, 3, r) for r in range(3)]).sort().values
    assert every.tolist() == list(range(24))


def _ring_by_hand(q, k, v, c, segments=None):
    """Every CP rank's ring ops on its zig-zag share of q/k/v [b, h, s, d]; the key/value block of
    step i taken from rank (r - i) mod c's first op, as the exchange would deliver it. Returns the
    attention output [b, h, s, d] back in sequence order."""
    b, h, s, d = q.shape
    module = SimpleNamespace(scaling=d**-0.5, training=False)
    core = comp("attn.core", ("q", "k", "v"), ("o",), AttentionCore(None, module))
    qkv = comp("attn.qkv", ("x",), ("q", "k", "v"), None)
    out = comp("attn.out", ("o",), ("ao",), None)
    ops, firsts, sides = {}, {}, {}
    for r in range(c):
        ops[r] = context_attention(ContextShards(c, r, None, comm="ring"), (h, k.shape[1]), qkv, core, out)
        index = zigzag_index(s, c, r)
        sides[r] = {"ring_index": index, "seq_len": s, **({"segments": segments} if segments is not None else {})}
        firsts[r] = ops[r][1].fn(sides[r], q[:, :, index], k[:, :, index], v[:, :, index])
    pieces = []
    for r in range(c):
        qr, _, o, lse = firsts[r]
        steps = [op for op in ops[r] if op.name.startswith("attn.ring")][1:]
        assert [op.name for op in ops[r] if op.name.startswith("attn.kv")] == [f"attn.kv{i}" for i in range(1, c)]
        res = (o, lse)
        for i, op in enumerate(steps, start=1):
            res = op.fn(sides[r], qr, firsts[(r - i) % c][1], *res)
        pieces.append(res[0])  # [s/c, b, h*d], this rank's tokens
    order = torch.cat([zigzag_index(s, c, r) for r in range(c)]).argsort()
    return torch.cat(pieces)[order].view(s, b, h, d).permute(1, 2, 0, 3)


def _reference(q, k, v, segments=None):
    s = q.shape[2]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])[:, None]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


@pytest.mark.parametrize("c", [2, 3, 4])
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_ring_steps_give_causal_attention_and_its_gradients(c, docs, fused, monkeypatch):
    # fused: torch's CPU flash-attention kernel with the widened backward (ring._FusedBlock);
    # else the scores through autograd (the path of attention dropout and of other devices)
    import hf_models.ring as ring

    calls = []
    if not fused:
        monkeypatch.setattr(ring, "_FUSED", None)
    elif ring._FUSED is None:
        pytest.skip("this torch has no CPU flash-attention kernel")
    else:
        apply = ring._FusedBlock.apply
        monkeypatch.setattr(ring._FusedBlock, "apply", lambda *a: calls.append(1) or apply(*a))
    torch.manual_seed(c)
    b, h, hk, s, d = 2, 4, 2, 8 * c, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64, requires_grad=True) for n in (h, hk, hk))
    segments = None
    if docs:  # packed documents: a query row may see nothing of a whole block
        starts = torch.zeros(b, s, dtype=torch.bool)
        starts[:, 0] = True
        starts[0, [3, s // 2 + 1]] = True
        starts[1, [s - 2]] = True
        segments = starts.long().cumsum(dim=1)
    grad = torch.randn(b, h, s, d, dtype=torch.float64)
    ours = _ring_by_hand(q, k, v, c, segments)
    ref = _reference(q, k, v, segments)
    # float64 in, the ring's float32 scores and merge: agreement to float32 rounding
    assert torch.allclose(ours.double(), ref, atol=1e-5), (ours.double() - ref).abs().max()
    g_ours = torch.autograd.grad(ours.double(), (q, k, v), grad)
    g_ref = torch.autograd.grad(ref, (q, k, v), grad)
    for a, e in zip(g_ours, g_ref):
        assert torch.isfinite(a).all()
        assert torch.allclose(a, e, atol=1e-4), (a - e).abs().max()
    assert (len(calls) == c * c) if fused else not calls  # every step of every rank took the chosen path


def _exchange(rank, world):
    import torch.distributed as dist

    from ds_dhelix.runtime.comm import RingPass, StrandGroups

    ring = RingPass(StrandGroups.of(dist.group.WORLD), world)
    x = torch.full((2, 3), float(rank))
    fwd = ring.forward(x, {}, 0).wait()
    bwd = ring.backward(x, {}, 1).wait()
    return fwd[0, 0].item(), bwd[0, 0].item()


@pytest.mark.timeout(120)
def test_ring_step_sends_forward_and_its_gradient_back():
    from ds_dhelix.runtime.spawn import run_ranks

    # 3 ranks, so r + 1 and r - 1 differ: forward receives from the previous rank, backward from the next
    got = run_ranks(_exchange, 3, timeout=90)
    assert got == [(2.0, 1.0), (0.0, 2.0), (1.0, 0.0)], got


def test_ring_side_inputs_hold_the_zig_zag_tokens():
    make_side = make_side_fn(2, 1, cp=ContextShards(2, 0, None, comm="ring"))
    ids = torch.arange(16).view(1, 16)
    side = make_side({"input_ids": ids})  # CP rank 0 holds chunks 0 and 3; TP rank 1 the second half
    assert side["ids"].tolist() == [[12, 13, 14, 15]] and side["positions"].tolist() == [[12, 13, 14, 15]]
    assert side["targets"].flatten().tolist() == [13, 14, 15, -100]  # shifted before the split
    assert side["ring_index"].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


# ------------------------------------------------------------------ refusals (no ranks)
def test_a_sequence_the_zig_zag_split_cannot_cut_is_refused():
    with pytest.raises(ValueError) as err:
        ParallelDims(4, tp=2, cp=2, cp_comm="ring").check_seq_len(100, "--seq-len")
    words = [
        "--seq-len 100 is not divisible by 2 x tensor_parallel.size 2 x context_parallel.size 2 = 8",
        "zig-zag",
        "multiple of 8",
    ]
    assert all(w in str(err.value) for w in words), str(err.value)
    ParallelDims(4, tp=2, cp=2).check_seq_len(100)  # Ulysses: tp x cp = 4 divides it
    make_side = make_side_fn(1, 0, cp=ContextShards(2, 1, None, comm="ring"))
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by 2 x tensor_parallel.size 1"):
        make_side({"input_ids": torch.arange(6).view(1, 6)})


def test_parity_command_refuses_an_odd_split_before_any_rank(capsys):
    from ds_dhelix.cli import main

    assert main(["parity", "--tp", "1", "--cp", "4", "--cp-comm", "ring", "--seq-len", "36"]) != 0
    err = capsys.readouterr().err
    assert (
        "dhelix parity: error: --seq-len 36 is not divisible by 2 x tensor_parallel.size 1 x "
        "context_parallel.size 4 = 8" in err
    ), err
    assert err.count("\n") == 1  # one line, no traceback


def test_ring_needs_no_head_split_that_ulysses_needs():
    # tiny-llama has 4 query heads: Ulysses cannot split them over 8 CP ranks, the ring can
    with pytest.raises(ValueError, match="or context_parallel.comm 'ring'"):
        check_setup(
            {**_config(cp=8), "dhelix": {**_config(cp=8)["dhelix"], "context_parallel": {"size": 8}}},
            load_config("tiny-llama"),
            8,
        )
    assert check_setup(_config(cp=8), load_config("tiny-llama"), 8).dims.cp_comm == "ring"


def test_an_attention_core_without_ring_parts_is_refused():
    plain = comp("attn.core", ("q", "k", "v"), ("o",), lambda side, q, k, v: (q,))
    with pytest.raises(ValueError, match="comm 'ring' needs an attention core"):
        context_attention(ContextShards(2, 0, None, comm="ring"), (4, 2), None, plain, None)


# ------------------------------------------------------------------ parity (real ranks)
def _parity(**kw):
    return cp_parity(cp_comm="ring", **kw)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_llama_ring_cp2_at_seq_512_matches_hf():
    res = _parity(model="tiny-llama", seq_len=512, micro_batch_size=1)
    _assert_parity(res)
    assert res["losses"]["hf"][0] > 7.0


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize(
    "model,kw",
    [("tiny-llama", {"packing": "docs", "seq_len": 128}), ("tiny-gpt2", {"zero_stage": 2}), ("tiny-phimoe", {})],
)
def test_ring_cp2_parity(model, kw):
    _assert_parity(_parity(model=model, **kw))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ring_cp4_on_four_ranks():
    # three ring steps per layer: blocks from earlier and from later ranks on every rank
    _assert_parity(_parity(model="tiny-llama", cp=4, steps=1, micro_batches=2, num_layers=1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ring_cp2_with_tp2_does_not_deadlock():
    """Ring CP=2 x TP=2 on four ranks: ring sends / receives cannot be polled, so the pairs run in
    the order of their op lists (a rank that waited on one strand's TP collective while the other
    strand's ring pass had completed unseen held back the launch its TP peer waited for: every
    rank stuck until the watchdog)."""
    _assert_parity(_parity(model="tiny-qwen3", tp=2, steps=1, micro_batches=2, num_layers=2, seq_len=32))
