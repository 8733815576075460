"""Pure-data tests of SIPlan: validation, JSON, fingerprint, text timeline, fixed plans."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_dhelix.graph.ops import backward_order, op_specs
from ds_dhelix.planning.plan import Round, SIPlan, default_plan, segment_has_comm, sequential_plan
from ds_dhelix.planning.planner import FINE_LAYER_OPS, LLAMA_LAYER_OPS, TINY_LAYER_OPS

LAYERS = [LLAMA_LAYER_OPS, FINE_LAYER_OPS, TINY_LAYER_OPS]

op_lists = st.lists(st.sampled_from(["comp", "comm"]), max_size=10).map(
    lambda kinds: op_specs((f"op{i}", k) for i, k in enumerate(kinds))
)


def _plan(ops, rounds, **kw) -> SIPlan:
    return SIPlan(ops, backward_order(ops), tuple(Round(f, b) for f, b in rounds), **kw)


def test_validate_rejects_gaps_empty_rounds_and_partial_cover():
    ops = TINY_LAYER_OPS  # 6 ops
    with pytest.raises(ValueError, match="does not continue"):
        _plan(ops, [((0, 2), (0, 0)), ((3, 6), (0, 6))])
    with pytest.raises(ValueError, match="is empty"):
        _plan(ops, [((0, 0), (0, 0)), ((0, 6), (0, 6))])
    with pytest.raises(ValueError, match="covers 6/6 forward and 5/6"):
        _plan(ops, [((0, 6), (0, 5))])


def test_comm_conflicts_finds_rounds_communicating_on_both_strands():
    ops = TINY_LAYER_OPS  # norm ag up down rs add; backward: add rs down up ag norm
    plan = _plan(ops, [((0, 1), (0, 1)), ((1, 2), (1, 2)), ((2, 6), (2, 6))])
    assert plan.comm_conflicts() == [1, 2]
    assert segment_has_comm(ops, (1, 2)) and not segment_has_comm(ops, (2, 4))


@pytest.mark.parametrize("ops", LAYERS, ids=["llama", "llama_fine", "tiny"])
def test_json_round_trip_is_exact(ops, tmp_path):
    plan = default_plan(ops, backward_order(ops))
    plan = SIPlan(
        plan.fwd_ops,
        plan.bwd_ops,
        plan.rounds,
        predicted_ms=0.1 + 0.2,
        source="dp",
        meta={"table_meta": {"tp": 8, "device": "x"}, "note": [1, 2.5, None]},
    )
    again = SIPlan.from_json(plan.to_json())
    assert again == plan
    assert again.meta == plan.meta and again.predicted_ms == plan.predicted_ms
    assert again.to_json() == plan.to_json()
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert SIPlan.load(str(path)) == plan


def test_from_json_rejects_wrong_format_and_names_that_disagree():
    plan = sequential_plan(TINY_LAYER_OPS, backward_order(TINY_LAYER_OPS))
    data = plan.to_dict()
    data["rounds"][0]["fwd_ops"][0] = "attn.qkv"
    with pytest.raises(ValueError, match="disagree with range"):
        SIPlan.from_dict(data)
    with pytest.raises(ValueError, match="version 7 is not supported"):
        SIPlan.from_dict({**plan.to_dict(), "version": 7})


def test_version_1_plans_with_steps_still_load():
    plan = default_plan(TINY_LAYER_OPS, backward_order(TINY_LAYER_OPS))
    data = plan.to_dict()
    data["version"], data["steps"] = 1, data.pop("rounds")
    assert SIPlan.from_dict(data) == plan
    with pytest.raises(ValueError, match="not a plan file"):
        SIPlan.from_dict({"format": "something else"})


def test_fingerprint_covers_schedule_not_annotations():
    ops = LLAMA_LAYER_OPS
    plan = default_plan(ops, backward_order(ops))
    same = SIPlan(plan.fwd_ops, plan.bwd_ops, plan.rounds, predicted_ms=3.0, source="dp", meta={"a": 1})
    assert plan.fingerprint() == same.fingerprint() == SIPlan.from_json(plan.to_json()).fingerprint()
    assert len(plan.fingerprint()) == 64
    assert plan.fingerprint() != sequential_plan(ops, backward_order(ops)).fingerprint()
    renamed = op_specs([("x" + o.name, o.kind.value) for o in ops])
    assert default_plan(renamed, backward_order(renamed)).fingerprint() != plan.fingerprint()


def test_render_text_draws_two_lanes_with_strand_tags():
    ops = LLAMA_LAYER_OPS
    plan = default_plan(ops, backward_order(ops))
    text = plan.render_text(round_ms=[1.0] * len(plan.rounds))
    lines = text.splitlines()
    assert "compute lane" in lines[1] and "communication lane" in lines[1]
    assert len(lines) == 2 + len(plan.rounds)
    step1 = lines[3]  # F attn.ag under the backward mlp.add
    comp, comm = step1.split("B mlp.add")
    assert "F attn.ag" in comm
    for op in ops:
        assert op.name in text
    with pytest.raises(ValueError, match="round_ms has 1 values"):
        plan.render_text(round_ms=[1.0])
    print(text)


@pytest.mark.parametrize("ops", LAYERS, ids=["llama", "llama_fine", "tiny"])
def test_default_plan_hides_every_comm_of_a_layer(ops):
    plan = default_plan(ops, backward_order(ops))
    assert plan.source == "default" and plan.comm_conflicts() == []
    for st_ in plan.rounds:
        f_comm, b_comm = segment_has_comm(ops, st_.fwd), segment_has_comm(plan.bwd_ops, st_.bwd)
        if f_comm:  # forward comm runs under backward compute, alone in its segment
            assert st_.fwd[1] - st_.fwd[0] == 1 and st_.bwd[1] > st_.bwd[0]
        if b_comm:
            assert st_.bwd[1] - st_.bwd[0] == 1 and st_.fwd[1] > st_.fwd[0]


def test_default_plan_pairs_llama_ag_and_rs_with_neighbouring_compute():
    ops = LLAMA_LAYER_OPS
    plan = default_plan(ops, backward_order(ops))
    pairs = {
        (tuple(o.name for o in ops[s.fwd[0] : s.fwd[1]]), tuple(o.name for o in plan.bwd_ops[s.bwd[0] : s.bwd[1]]))
        for s in plan.rounds
    }
    assert (("attn.ag",), ("mlp.add",)) in pairs
    assert (("attn.qkv", "attn.core", "attn.out"), ("mlp.rs",)) in pairs


@settings(max_examples=300, deadline=None)
@given(fwd=op_lists, bwd=op_lists, reverse=st.booleans())
def test_fixed_plans_are_valid_and_never_pair_comm_with_comm(fwd, bwd, reverse):
    if reverse:
        bwd = backward_order(fwd)
    for plan in (default_plan(fwd, bwd), sequential_plan(fwd, bwd)):
        plan.validate()
        assert plan.comm_conflicts() == []
        assert SIPlan.from_json(plan.to_json()) == plan
    seq = sequential_plan(fwd, bwd)
    assert all(s.fwd[0] == s.fwd[1] or s.bwd[0] == s.bwd[1] for s in seq.rounds)
    assert len(seq.rounds) == bool(fwd) + bool(bwd)
