"""Pure-data tests of overlap tables and the SI planner: DP against brute force (hypothesis)."""

from __future__ import annotations

import collections
import json
import random
import time

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from ds_dhelix import cli
from ds_dhelix.graph.ops import backward_order, comm_runs, op_specs
from ds_dhelix.planning import planner
from ds_dhelix.planning.plan import SIPlan, default_plan, sequential_plan
from ds_dhelix.planning.planner import (
    OverlapTable,
    candidate_segments,
    count_plans,
    plan_dp,
    plan_exhaustive,
    predict_ms,
    random_plan,
    synthetic_table,
)

TOL = 1e-9


def _ops(kinds: str, prefix: str = "op"):
    """'cmcc' -> comp, comm, comp, comp."""
    return op_specs((f"{prefix}{i}", "comm" if k == "m" else "comp") for i, k in enumerate(kinds))


# ---- candidate segments -----------------------------------------------------------------


def test_candidate_segments_are_runs_inside_comm_runs():
    ops = _ops("ccmcm")
    assert candidate_segments(ops) == [(0, 1), (0, 2), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert candidate_segments(()) == []


@given(st.text(alphabet="cm", max_size=12))
def test_candidate_segments_match_definition(kinds):
    ops = _ops(kinds)
    groups = comm_runs(ops)
    expected = {
        (a, b)
        for a in range(len(ops))
        for b in range(a + 1, len(ops) + 1)
        if any(g0 <= a and b <= g1 for g0, g1 in groups)
    }
    assert set(candidate_segments(ops)) == expected
    assert all(b - a == 1 for a, b in candidate_segments(ops) if ops[a].is_comm)


# ---- DP against brute force --------------------------------------------------------------


@st.composite
def tables(draw):
    """Small random tables: random COMM/COMP patterns, some entries missing, sometimes ties."""

    def kinds(least: int):
        return st.integers(least, 6).flatmap(lambda n: st.text(alphabet="cm", min_size=n, max_size=n))

    fwd = _ops(draw(kinds(1)), "f")
    bwd = backward_order(fwd) if draw(st.booleans()) else _ops(draw(kinds(0)), "b")
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    table = synthetic_table(fwd, bwd, rng)
    if draw(st.booleans()):  # integer times: many ties between plans
        table = _map_times(table, lambda ms: float(round(ms)))
    drop = draw(st.sampled_from([0.0, 0.0, 0.3, 0.7]))
    table.pair_ms = {k: v for k, v in table.pair_ms.items() if rng.random() >= drop}
    for entries in (table.fwd_alone_ms, table.bwd_alone_ms):  # single ops stay: a plan always exists
        for seg in [s for s in entries if s[1] - s[0] > 1 and rng.random() < drop]:
            del entries[seg]
    num = count_plans(table)
    assume(num <= 100_000)
    event(f"ops {len(fwd)}+{len(bwd)}")
    event(f"plans < 10^{len(str(num))}")
    return table


def _map_times(table: OverlapTable, fn) -> OverlapTable:
    return OverlapTable(
        table.meta,
        table.fwd_ops,
        table.bwd_ops,
        {k: fn(v) for k, v in table.fwd_alone_ms.items()},
        {k: fn(v) for k, v in table.bwd_alone_ms.items()},
        {k: fn(v) for k, v in table.pair_ms.items()},
    )


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(tables())
def test_dp_matches_exhaustive_optimum(table):
    dp, ref = plan_dp(table), plan_exhaustive(table)
    assert abs(dp.predicted_ms - ref.predicted_ms) <= TOL
    for plan in (dp, ref):
        plan.validate()
        assert plan.comm_conflicts() == []
        assert predict_ms(table, plan) == plan.predicted_ms  # same sums in the same order
        for s in plan.rounds:  # every step is a table entry: nothing missing was used
            if s.fwd[0] < s.fwd[1] and s.bwd[0] < s.bwd[1]:
                assert (s.fwd, s.bwd) in table.pair_ms
            elif s.fwd[0] < s.fwd[1]:
                assert s.fwd in table.fwd_alone_ms
            else:
                assert s.bwd in table.bwd_alone_ms
    assert dp.source == "dp" and ref.source == "exhaustive"


@settings(max_examples=100, deadline=None)
@given(tables(), st.integers(0, 1000))
def test_dp_never_worse_than_fixed_or_random_plans(table, seed):
    for tab in (table, synthetic_table(table.fwd_ops, table.bwd_ops, random.Random(seed))):
        best = plan_dp(tab).predicted_ms
        for k in range(3):
            assert best <= predict_ms(tab, random_plan(tab, random.Random(seed + k))) + TOL
    # the fixed plans run whole groups (alone or paired), so they need the complete table
    for fixed in (sequential_plan, default_plan):
        assert best <= predict_ms(tab, fixed(tab.fwd_ops, tab.bwd_ops)) + TOL


def test_random_plan_is_uniform_over_all_plans():
    table = synthetic_table(_ops("c", "f"), _ops("cc", "b"), random.Random(1))
    num = count_plans(table)
    rng = random.Random(7)
    seen = collections.Counter(random_plan(table, rng).fingerprint() for _ in range(60 * num))
    assert len(seen) == num
    assert min(seen.values()) > 30 and max(seen.values()) < 95  # expected 60 each


def test_plan_dp_on_llama70b_shape(capsys):
    shapes = {
        "llama70b": planner.llama70b_table(random.Random(0)),
        "llama70b-fine": planner.llama70b_table(random.Random(0), fine=True),
        "stress-40ops-groups-of-8": synthetic_table(*(2 * [_ops("c" * 8 + "m") * 4 + _ops("cccc")]), random.Random(0)),
    }
    for name, table in shapes.items():
        t0 = time.perf_counter()
        plan = plan_dp(table)
        seconds = time.perf_counter() - t0
        with capsys.disabled():
            print(
                f"\nplan_dp {name}: {len(table.fwd_ops)} ops/list, {len(table.pair_ms)} pairs, "
                f"{seconds * 1e3:.1f} ms, predicted {plan.predicted_ms:.3f} ms "
                f"(default {predict_ms(table, default_plan(table.fwd_ops, table.bwd_ops)):.3f}, "
                f"sequential {predict_ms(table, sequential_plan(table.fwd_ops, table.bwd_ops)):.3f})"
            )
        assert plan.comm_conflicts() == []
        assert plan.predicted_ms <= predict_ms(table, default_plan(table.fwd_ops, table.bwd_ops))


def test_no_plan_and_oversized_exhaustive_raise():
    fwd = _ops("cc", "f")
    table = OverlapTable({}, fwd, backward_order(fwd), {(0, 1): 1.0}, {(0, 2): 1.0}, {})
    with pytest.raises(ValueError, match="admits no complete plan"):
        plan_dp(table)
    with pytest.raises(ValueError, match="admits no complete plan"):
        plan_exhaustive(table)
    with pytest.raises(ValueError, match="refuses op lists of 20"):
        plan_exhaustive(planner.llama70b_table(random.Random(0), fine=True))
    with pytest.raises(ValueError, match="refuses 1232107232 plans"):
        plan_exhaustive(planner.llama70b_table(random.Random(0)))
    with pytest.raises(ValueError, match="refuses 26 plans"):
        plan_exhaustive(synthetic_table(fwd, fwd, random.Random(0)), max_plans=10)


def test_predict_ms_names_missing_and_comm_comm_pairs():
    ops = _ops("cm")
    table = synthetic_table(ops, ops, random.Random(0))
    del table.pair_ms[((0, 1), (0, 1))]
    plan = SIPlan(ops, ops, (planner.Round((0, 1), (0, 1)), planner.Round((1, 2), (1, 2))))
    with pytest.raises(ValueError, match=r"\['op0'\] x backward \['op0'\] is not in the overlap table"):
        predict_ms(table, plan)
    table.pair_ms[((0, 1), (0, 1))] = 1.0
    with pytest.raises(ValueError, match="communicates on both strands"):
        predict_ms(table, plan)


# ---- tables: validation, JSON, meta check -----------------------------------------------


def test_table_rejects_bad_entries():
    ops = _ops("ccm")
    with pytest.raises(ValueError, match=r"segment \(1, 3\) is not a candidate"):
        OverlapTable({}, ops, ops, {(1, 3): 1.0}, {}, {})
    with pytest.raises(ValueError, match="communicates on both strands"):
        OverlapTable({}, ops, ops, {}, {}, {((2, 3), (2, 3)): 1.0})
    with pytest.raises(ValueError, match="not a finite number"):
        OverlapTable({}, ops, ops, {}, {(0, 1): float("nan")}, {})


def test_table_json_round_trip_is_exact(tmp_path):
    table = planner.llama70b_table(random.Random(3))
    path = tmp_path / "table.json"
    table.save(str(path))
    again = OverlapTable.load(str(path))
    assert again == table
    assert plan_dp(again).to_json() == plan_dp(table).to_json()
    data = json.loads(path.read_text())
    pair = data["pairs"][0]
    assert pair["fwd_ops"] and pair["bwd_ops"] and pair["sequential_ms"] >= pair["ms"]
    data["fwd_alone"][0]["ops"] = ["wrong.op"]
    with pytest.raises(ValueError, match="names \\['wrong.op'\\]"):
        OverlapTable.from_dict(data)


def test_check_matches_names_every_differing_key():
    table = planner.llama70b_table(random.Random(0))
    table.check_matches({"tp": 8, "dtype": "bf16"}, table.fwd_ops, table.bwd_ops)
    with pytest.raises(ValueError) as err:
        table.check_matches({"tp": 4, "dtype": "bf16", "device": "NVIDIA H200", "cp": 2})
    text = str(err.value)
    assert "tp: table has 8, this run has 4" in text
    assert "device: table has 'synthetic', this run has 'NVIDIA H200'" in text
    assert "cp: table has '<missing>', this run has 2" in text
    assert "dtype" not in text
    assert "re-profile (dhelix profile ...) or use planner.profile=off" in text
    with pytest.raises(ValueError, match="fwd_ops: table has"):
        table.check_matches({}, fwd_ops=planner.TINY_LAYER_OPS)


# ---- CLI ---------------------------------------------------------------------------------


def test_cli_plan_json_with_exhaustive(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--synthetic", "tiny", "--exhaustive", "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("plan", "predicted_ms", "exhaustive_ms", "dp_seconds", "exhaustive_seconds"):
        assert key in result
    assert abs(result["predicted_ms"] - result["exhaustive_ms"]) <= TOL
    plan = SIPlan.load(str(out))
    assert plan == SIPlan.from_dict(result["plan"]) and plan.fingerprint() == result["fingerprint"]


def test_cli_plan_text_from_table_file(capsys, tmp_path):
    path = tmp_path / "table.json"
    planner.llama70b_table(random.Random(0)).save(str(path))
    assert cli.main(["plan", "--table", str(path)]) == 0
    text = capsys.readouterr().out
    assert "compute lane" in text and "predicted_ms:" in text and "F attn.ag" in text
    assert cli.main(["plan", "--synthetic", "llama70b", "--exhaustive"]) == 2  # refused, clear error
    assert "exhaustive search refuses" in capsys.readouterr().err


def test_empty_op_lists_give_an_empty_plan():
    table = synthetic_table((), (), random.Random(0))
    for plan in (plan_dp(table), plan_exhaustive(table), random_plan(table, random.Random(0))):
        assert plan.rounds == () and plan.predicted_ms == 0.0
    one = synthetic_table(_ops("cm"), (), random.Random(0))
    assert plan_dp(one).predicted_ms == plan_exhaustive(one).predicted_ms
