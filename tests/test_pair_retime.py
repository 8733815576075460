"""Pair re-timing (benchmarks/pair_retime.py): the makespan of two strands' chains on one compute unit
and one shared link, by hand-checkable cases, and chains read back from a synthetic trace."""

import random

import pytest

from benchmarks.pair_retime import ChainOp, pair_chains, retime_pair, retime_trace, search_pair, wire_times


def comp(ms, deferred=0.0, depth=0):
    return ChainOp("c", False, ms, deferred, depth)


def comm(ms, depth=0):
    return ChainOp("m", True, ms, depth=depth)


def test_complementary_chains_reach_the_bound():
    # B computes while F's collective flies, then the other way round: 4 ms, both resources busy
    r = retime_pair([comp(2), comm(2)], [comm(2), comp(2)])
    assert r.makespan_ms == pytest.approx(4.0) == r.bound_ms


def test_collectives_in_flight_share_the_link():
    r = retime_pair([comm(2)], [comm(2)])
    assert r.makespan_ms == pytest.approx(4.0)  # two at once: each at half rate
    r = retime_pair([comm(2)], [comm(1)])
    assert r.makespan_ms == pytest.approx(3.0)  # F done at 2 (half rate), B's last 1 ms alone


def test_one_strand_is_a_chain():
    r = retime_pair([comp(1), comm(2), comp(1)], [])
    assert r.makespan_ms == pytest.approx(4.0)
    assert r.bound_ms == pytest.approx(2.0)


def test_deferred_weight_gradient_fills_the_wait():
    # B: input gradient 1 ms (weight gradient 3 ms left for later), then a 2 ms collective:
    # the weight gradient runs while it flies, and the strand ends at 1 + 3
    r = retime_pair([comp(1, deferred=3), comm(2)], [])
    assert r.makespan_ms == pytest.approx(4.0)
    assert r.compute_ms == pytest.approx(4.0)


def test_nearest_collective_goes_first():
    # F is one compute op from its collective, B two: F's op runs first (0-1), its 3 ms collective
    # flies beside B's two ops (1-3), then both collectives share the link: 1 ms left each -> 5.
    # B first would launch F's collective only at 3 -> 6.
    r = retime_pair([comp(1), comp(1), comm(1)], [comp(1), comm(3)])
    assert r.makespan_ms == pytest.approx(5.0)


def test_forward_strand_waits_for_the_backward_depth():
    # F's collective belongs to depth 1 while B works in depth 0: as in the executor it launches only
    # once B has left depth 0 (B's op 0-1, its collective 1-3, then F's 3-5); in the same depth it
    # would fly from 0 and share the link with B's (4)
    assert retime_pair([comp(1), comm(2)], [comm(2, depth=1)]).makespan_ms == pytest.approx(5.0)
    assert retime_pair([comp(1), comm(2)], [comm(2)]).makespan_ms == pytest.approx(4.0)


def test_search_finds_what_the_rule_misses():
    # both strands are one op from a collective, backward wins the tie: B 0-2, its collective 2-3,
    # F 2-3, F's 3 ms collective 3-6. Forward first launches the long collective at 1 and B's
    # shares the link from 3: both done at 5
    b, f = [comp(2), comm(1)], [comp(1), comm(3)]
    assert retime_pair(b, f).makespan_ms == pytest.approx(6.0)
    assert search_pair(b, f).makespan_ms == pytest.approx(5.0)


def test_search_is_never_worse_than_the_rule_nor_better_than_the_bound():
    rng = random.Random(0)

    def chain():
        out = []
        for _ in range(rng.randint(1, 4)):
            out += [comp(rng.choice((0.5, 1, 2, 3)), rng.choice((0, 0, 1))), comm(rng.choice((0.5, 1, 2, 3)))]
        return out

    gained = 0
    for _ in range(200):
        b, f = chain(), chain()
        rule, best = retime_pair(b, f), search_pair(b, f, width=500)
        assert best.bound_ms - 1e-9 <= best.makespan_ms <= rule.makespan_ms + 1e-9, (b, f)
        gained += best.makespan_ms < rule.makespan_ms - 1e-9
    assert gained  # the search does find better orders


def _span(pid, tid, name, ts, dur, mb, direction, block=1):
    return {
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "name": name,
        "ts": ts * 1e3,
        "dur": dur * 1e3,
        "args": {
            "microbatch": mb,
            "direction": direction,
            "block": block,
            "strand": "F" if direction == "forward" else "B",
        },
    }


def _lanes(pid):
    return [
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
        for tid, name in ((1, "compute"), (8, "comm:tp:F"), (9, "comm:tp:B"))
    ]


def test_chains_from_a_trace():
    """One step of 2 micro-batches on 2 ranks: F0 alone, then F1 (x) B0. Rank 1 launches F1's
    collective 1 ms late: its wire time is counted from the later launch."""
    ev = _lanes(0) + _lanes(1)
    for pid, late in ((0, 0.0), (1, 1.0)):
        # blocks 0..2: the pair's forward block 1 and backward block 1 share layer depth 1
        ev += [
            _span(pid, 1, "op", 0, 1, 0, "forward", block=0),  # F0 alone
            _span(pid, 1, "op", 2, 1, 1, "forward"),  # pair: F1 op
            _span(pid, 8, "ag", 3 + late, 3 - late, 1, "forward"),  # F1's collective, done at 6
            _span(pid, 1, "op", 3 + late, 2, 0, "backward"),  # B0's input gradient
            _span(pid, 1, "op.wgrad", 6, 1, 0, "backward"),  # its deferred weight gradient
            _span(pid, 1, "tail", 7, 1, 1, "forward", block=2),
        ]
    trace = {"traceEvents": ev}
    assert wire_times(trace) == {("ag", "forward"): pytest.approx(2.0)}
    ((measured, b, f),) = pair_chains(trace, pid=0)
    assert measured == pytest.approx(6.0)  # 2 .. 8
    assert b == [ChainOp("op", False, 2.0, 1.0, depth=1)]
    assert f == [
        ChainOp("op", False, 1.0, depth=1),
        ChainOp("ag", True, 2.0, depth=1),
        ChainOp("tail", False, 1.0, depth=2),
    ]
    r = retime_trace(trace)[0]
    # re-timing: both strands one compute op from their next collective (B has none left), backward
    # wins the tie: B0's op 0-2, F1's op 2-3, its collective 3-5 beside the weight gradient 3-4,
    # tail 5-6. Perfect overlap (bound) would be 5: the compute sum.
    assert r["pairs"] == 1 and r["retime_ms"] == pytest.approx(6.0) and r["bound_ms"] == pytest.approx(5.0)
    # forward first: F1's op 0-1, its collective 1-3 beside B0's op 1-3, the weight gradient 3-4
    # (the tail, depth 2, waits for it), tail 4-5: the bound
    assert r["search_ms"] == pytest.approx(5.0)


def test_wire_time_of_a_collective_never_alone():
    """Two collectives always in flight together: each gets its shortest instance (later launch to
    last completion)."""
    ev = _lanes(0) + _lanes(1)
    for pid in (0, 1):
        for rep, (dur_a, dur_b) in enumerate(((5, 4), (6, 7))):
            t = 20 * rep
            ev += [_span(pid, 8, "ag", t, dur_a, rep, "forward"), _span(pid, 9, "rs", t + 1, dur_b, rep, "backward")]
    assert wire_times({"traceEvents": ev}) == {
        ("ag", "forward"): pytest.approx(5.0),
        ("rs", "backward"): pytest.approx(4.0),
    }


def test_no_pairs_no_retiming():
    ev = _lanes(0) + [_span(0, 1, "op", 0, 1, 0, "forward"), _span(0, 1, "op", 1, 1, 0, "backward")]
    assert retime_trace({"traceEvents": ev}) == {}


def test_deferred_work_left_at_the_end_still_runs():
    # the executor drains deferred weight gradients before a pair ends; so does the re-timing
    r = retime_pair([comm(1), comp(1, deferred=2)], [])
    assert r.makespan_ms == pytest.approx(4.0) == r.compute_ms + 1.0
