"""Folded pipeline schedules replayed for every rank: correctness, bubble closed form, and
corrupted schedules that the replay must catch."""
import json

import pytest

from ds_dhelix.cli import main
from ds_dhelix.pipe.schedule import (
    Backward, Forward, ForwardBackward, LoadMicroBatch, OptimizerStep, RecvActivation,
    ReduceGrads, SendActivation, SendGrad, WaitRecv, WaitSends, build_schedule,
    dualpipev_si_schedule, min_microbatches, sequential_fold_schedule, w_schedule)
from ds_dhelix.pipe.simulate import (
    replay, sequential_bubble_closed_form, w_bubble_closed_form)


def _cases(name, stages=(1, 2, 3, 4)):
    return [(p, m) for p in stages for m in range(min_microbatches(name, p), 3 * p + 1)]


# ---- correct schedules ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["w", "dualpipev", "sequential"])
def test_replay_passes_from_minimum_to_3p(name):
    for p, m in _cases(name):
        schedule = build_schedule(name, p, m)
        result = replay(schedule, m)
        assert result.ok, (name, p, m, [str(e) for e in result.errors])
        for rank in schedule:
            assert rank[-3:] == [WaitSends(), ReduceGrads(), OptimizerStep()]
        assert max(result.peak_activations) <= 2 * p  # p micro-batches of both chunks


def test_minimum_microbatches():
    assert [min_microbatches("w", p) for p in (1, 2, 3, 4)] == [2, 3, 4, 5]
    assert [min_microbatches("dualpipev", p) for p in (1, 2, 3, 4)] == [1, 3, 5, 7]
    assert min_microbatches("sequential", 4) == 1
    with pytest.raises(ValueError, match=r"num_microbatches >= p \+ 1 = 4, got 3"):
        w_schedule(3, 3)
    with pytest.raises(ValueError, match=r"num_microbatches >= 2 \* p - 1 = 5, got 4"):
        dualpipev_si_schedule(3, 4)
    with pytest.raises(ValueError, match="num_stages=0"):
        sequential_fold_schedule(0, 4)
    with pytest.raises(ValueError, match="schedule='x'"):
        min_microbatches("x", 2)


def _pairs(schedule):
    return [ins for rank in schedule for ins in rank if isinstance(ins, ForwardBackward)]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_w_pairs_travel_in_one_direction(p):
    m = 3 * p
    schedule = w_schedule(p, m)
    for rank in schedule:
        pairs = [ins for ins in rank if isinstance(ins, ForwardBackward)]
        assert len(pairs) == 2 * (m - p)  # every slot between warm-up and cool-down is SI
        for pair in pairs:
            assert pair.f_phase != pair.b_phase  # F0 with B1, F1 with B0
            assert pair.b_mb == pair.f_mb - p  # the backward strand trails by p micro-batches


def test_dualpipev_pairs_are_f0b1_and_f1b0():
    for p, m in _cases("dualpipev", (2, 3, 4)):
        pairs = _pairs(dualpipev_si_schedule(p, m))
        assert pairs and all(pair.f_phase != pair.b_phase for pair in pairs)


def test_sequential_runs_one_microbatch_at_a_time():
    schedule = sequential_fold_schedule(2, 2)
    assert not _pairs(schedule)
    computes = [ins for ins in schedule[1] if isinstance(ins, (Forward, Backward))]
    assert computes == [Forward(0, 0), Forward(0, 1), Backward(0, 1), Backward(0, 0),
                        Forward(1, 0), Forward(1, 1), Backward(1, 1), Backward(1, 0)]
    result = replay(schedule, 2, 1, 2)
    assert result.bubble_fraction == pytest.approx(sequential_bubble_closed_form(2, 2))


COSTS = [(1, 1, "max"), (1, 2, "max"), (1, 2, "sum"), (2, 1, 2.5), (1, 2, 4.0), (1.5, 2.5, 3.0)]


@pytest.mark.parametrize("fwd, bwd, pair", COSTS)
def test_w_bubble_closed_form_matches_replay(fwd, bwd, pair):
    for p, m in _cases("w", (2, 3, 4)):
        result = replay(w_schedule(p, m), m, fwd, bwd, pair)
        assert result.ok
        assert result.bubble_fraction == pytest.approx(w_bubble_closed_form(p, m, fwd, bwd, pair),
                                                       abs=1e-12), (p, m)


def test_w_bubble_closed_form_values_and_domain():
    assert w_bubble_closed_form(2, 4, 1, 1, 1) == pytest.approx(1 / 7)  # (p-1)/(m+2p-1)
    assert w_bubble_closed_form(4, 8, 1, 2, "sum") == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert w_bubble_closed_form(4, 8, 1, 2, "max") == pytest.approx(6 / 26)
    with pytest.raises(ValueError, match="c >= max"):
        w_bubble_closed_form(2, 4, 1, 2, 1.5)
    with pytest.raises(ValueError, match="m >= p\\+1 = 3"):
        w_bubble_closed_form(2, 2)


def test_render_timeline_w_p2_m4():
    text = replay(w_schedule(2, 4), 4, 1, 1).render_timeline().splitlines()
    assert text[1].split() == ["rank", "0", "F0", "F1", ".", "F0'", "F2B0'", "F1'", "F3B1'",
                               "F2'B0", "B2'", "F3'B1", "B3'", "B2", ".", "B3"]
    assert text[2].split()[2:4] == [".", "F0"]
    wide = replay(w_schedule(2, 3), 3, 1, 2).render_timeline()
    assert "F2B0'------" in wide  # a 2-unit pair spans two cells


# ---- corrupted schedules ----------------------------------------------------------------------

def _kinds(schedule, m):
    result = replay(schedule, m)
    assert not result.ok
    return {e.kind for e in result.errors}, " ".join(str(e) for e in result.errors)


def _index(rank, ins):
    return rank.index(ins)


def test_dropped_send_is_caught():
    schedule = w_schedule(2, 4)
    last = max(i for i, ins in enumerate(schedule[1]) if isinstance(ins, SendGrad))
    dropped = schedule[1].pop(last)
    kinds, text = _kinds(schedule, 4)
    assert kinds == {"unmatched"} and f"grad (mb {dropped.mb}, phase 0)" in text


def test_dropped_first_send_breaks_channel_order():
    schedule = w_schedule(2, 4)
    schedule[0].remove(SendActivation(0, 0, 1))
    kinds, text = _kinds(schedule, 4)
    assert "order" in kinds and "channel 0->1" in text


def test_swapped_order_deadlocks_and_names_every_stuck_rank():
    schedule = w_schedule(2, 4)
    rank0 = schedule[0]
    moved = [RecvActivation(0, 1, 1), WaitRecv("activation", 0, 1)]
    for ins in moved:
        rank0.remove(ins)
    schedule[0] = moved + rank0  # wait for the return trip before starting the outbound one
    kinds, text = _kinds(schedule, 4)
    assert kinds == {"deadlock"}
    assert "rank 0 stuck at #1" in text and "rank 1 stuck" in text


def test_doubled_forward_is_caught():
    schedule = w_schedule(3, 4)
    i = _index(schedule[1], Forward(0, 0))
    schedule[1].insert(i + 1, Forward(0, 0))
    kinds, text = _kinds(schedule, 4)
    assert kinds == {"work"} and "forwarded twice" in text


def test_doubled_backward_frees_twice():
    schedule = sequential_fold_schedule(2, 2)
    i = _index(schedule[0], Backward(1, 0))
    schedule[0].insert(i + 1, Backward(1, 0))
    kinds, text = _kinds(schedule, 2)
    assert kinds == {"work"} and "twice" in text


def test_missing_backward_is_caught():
    schedule = sequential_fold_schedule(2, 2)
    schedule[0].remove(Backward(1, 0))  # first chunk: nothing is sent after it
    kinds, text = _kinds(schedule, 2)
    assert kinds == {"work"} and "B1" in text


def test_use_before_receive_is_caught():
    schedule = w_schedule(2, 3)
    schedule[1].remove(WaitRecv("activation", 1, 0))
    kinds, text = _kinds(schedule, 3)
    assert kinds == {"buffer"} and "before it was received" in text


def test_receiving_twice_is_caught():
    schedule = w_schedule(2, 3)
    i = _index(schedule[1], RecvActivation(1, 0, 0))
    schedule[1].insert(i, RecvActivation(1, 0, 0))
    kinds, text = _kinds(schedule, 3)
    assert kinds == {"buffer"} and "received twice" in text


def test_wrong_peer_is_caught():
    schedule = w_schedule(3, 4)
    i = _index(schedule[1], SendActivation(0, 0, 2))
    schedule[1][i] = SendActivation(0, 0, 0)
    kinds, text = _kinds(schedule, 4)
    assert kinds == {"peer"} and "the fold sends it to rank 2" in text


def test_unmatched_receive_is_caught():
    schedule = w_schedule(2, 3)
    schedule[1].insert(0, RecvActivation(7, 0, 0))
    kinds, text = _kinds(schedule, 3)
    assert "unmatched" in kinds or "order" in kinds


def test_extra_trailing_receive_is_unmatched():
    schedule = w_schedule(2, 3)
    schedule[1].insert(len(schedule[1]) - 3, RecvActivation(7, 0, 0))
    kinds, text = _kinds(schedule, 3)
    assert "unmatched" in kinds and "mb 7" in text


def test_pairing_a_chunk_with_itself_is_caught():
    schedule = sequential_fold_schedule(1, 1)
    rank = schedule[0]
    i = _index(rank, Forward(0, 1))
    rank[i:i + 2] = [ForwardBackward(0, 1, 0, 1)]
    kinds, text = _kinds(schedule, 1)
    assert kinds == {"work"} and "its own backward" in text


def test_load_outside_rank0_is_caught():
    schedule = sequential_fold_schedule(2, 1)
    schedule[1].insert(0, LoadMicroBatch(0))
    kinds, _ = _kinds(schedule, 1)
    assert kinds == {"buffer"}


# ---- CLI ----------------------------------------------------------------------------------------

def test_cli_simulate_prints_timeline_and_bubble(capsys):
    assert main(["simulate", "--schedule", "w", "--stages", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "rank 0" in out and "rank 1" in out and out.strip().endswith("ok")
    assert "replayed 0.1667, closed form 0.1667" in out


def test_cli_simulate_json(capsys):
    assert main(["simulate", "--schedule", "dualpipev", "--stages", "3", "--microbatches", "5",
                 "--pair-cost", "sum", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["pair_cost"] == 3 and data["bubble_closed_form"] is None
    assert len(data["timeline"]) == 3


def test_cli_simulate_rejects_too_few_microbatches(capsys):
    assert main(["simulate", "--stages", "3", "--microbatches", "3"]) == 2
    assert "p + 1 = 4" in capsys.readouterr().err


def test_cli_simulate_exit_nonzero_on_error(monkeypatch, capsys):
    import ds_dhelix.commands.simulate as cmd

    def broken(name, p, m):
        schedule = build_schedule(name, p, m)
        schedule[0].remove(SendActivation(0, 0, 1))
        return schedule

    monkeypatch.setattr(cmd, "build_schedule", broken)
    assert main(["simulate", "--stages", "2", "--microbatches", "4"]) == 1
    assert "error: [order]" in capsys.readouterr().out


def test_latency_delays_the_receivers():
    fast = replay(w_schedule(2, 4), 4)
    slow = replay(w_schedule(2, 4), 4, latency=0.5)
    assert fast.ok and slow.ok and slow.makespan > fast.makespan
