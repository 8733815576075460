"""Schedules as data, replayed for every rank: the registry's one-stage and folded pipeline
schedules, correctness, bubble closed form, and corrupted schedules that the replay must catch."""

import json

import pytest

from ds_dhelix.cli import main
from ds_dhelix.pipe.schedule import dualpipev_si_schedule, sequential_fold_schedule, w_schedule
from ds_dhelix.schedule import registry as R
from ds_dhelix.schedule.instructions import (
    Backward,
    BackwardBackward,
    FixActivationBudget,
    Forward,
    ForwardBackward,
    ForwardForward,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    ReduceGrads,
    SendActivation,
    SendGrad,
    WaitRecv,
    WaitSends,
    forward_only,
)
from ds_dhelix.schedule.simulate import replay, sequential_bubble_closed_form, w_bubble_closed_form


def build_schedule(name, p, m):
    return R.build(name, R.PIPELINE, p, m)


def min_microbatches(name, p):
    return R.lookup(name, R.PIPELINE).minimum.of(p)


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
    with pytest.raises(ValueError, match="unknown pipeline schedule 'x'"):
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
    assert computes == [
        Forward(0, 0),
        Forward(0, 1),
        Backward(0, 1),
        Backward(0, 0),
        Forward(1, 0),
        Forward(1, 1),
        Backward(1, 1),
        Backward(1, 0),
    ]
    result = replay(schedule, 2, 1, 2)
    assert result.bubble_fraction == pytest.approx(sequential_bubble_closed_form(2, 2))


COSTS = [(1, 1, "max"), (1, 2, "max"), (1, 2, "sum"), (2, 1, 2.5), (1, 2, 4.0), (1.5, 2.5, 3.0)]


@pytest.mark.parametrize("fwd, bwd, pair", COSTS)
def test_w_bubble_closed_form_matches_replay(fwd, bwd, pair):
    for p, m in _cases("w", (2, 3, 4)):
        result = replay(w_schedule(p, m), m, fwd, bwd, pair)
        assert result.ok
        assert result.bubble_fraction == pytest.approx(w_bubble_closed_form(p, m, fwd, bwd, pair), abs=1e-12), (p, m)


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
    assert text[1].split() == [
        "rank",
        "0",
        "F0",
        "F1",
        ".",
        "F0'",
        "F2B0'",
        "F1'",
        "F3B1'",
        "F2'B0",
        "B2'",
        "F3'B1",
        "B3'",
        "B2",
        ".",
        "B3",
    ]
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
    rank[i : i + 2] = [ForwardBackward(0, 1, 0, 1)]
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
    assert (
        main(
            [
                "simulate",
                "--schedule",
                "dualpipev",
                "--stages",
                "3",
                "--microbatches",
                "5",
                "--pair-cost",
                "sum",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["pair_cost"] == 3 and data["bubble_closed_form"] is None
    assert len(data["timeline"]) == 3


def test_cli_simulate_rejects_too_few_microbatches(capsys):
    assert main(["simulate", "--stages", "3", "--microbatches", "3"]) == 2
    assert "p + 1 = 4" in capsys.readouterr().err


def test_cli_simulate_exit_nonzero_on_error(monkeypatch, capsys):
    import ds_dhelix.commands.simulate as cmd

    real = cmd.lookup

    def broken(name, layout):
        spec = real(name, layout)

        def build(p, m):
            schedule = spec.build(p, m)
            schedule[0].remove(SendActivation(0, 0, 1))
            return schedule

        return R.ScheduleSpec(spec.name, spec.layout, spec.summary, build, spec.minimum)

    monkeypatch.setattr(cmd, "lookup", broken)
    assert main(["simulate", "--stages", "2", "--microbatches", "4"]) == 1
    assert "error: [order]" in capsys.readouterr().out


def test_latency_delays_the_receivers():
    fast = replay(w_schedule(2, 4), 4)
    slow = replay(w_schedule(2, 4), 4, latency=0.5)
    assert fast.ok and slow.ok and slow.makespan > fast.makespan


# ---- one stage -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", R.names(R.ONE_STAGE, built=True))
def test_one_stage_schedules_replay(name):
    """Every one-stage row of the registry replays clean for 1..6 micro-batches: each micro-batch
    forwarded once, backwarded once after, the step's end once; the activations held at once
    stay within what the schedule promises (si: one micro-batch; si-ends / intra: two)."""
    spec = R.lookup(name, R.ONE_STAGE)
    for m in range(1, 7):
        (rank,) = spec.schedule(1, m)
        result = replay([rank], spec.units(m), one_stage=True)
        assert result.ok, (name, m, [str(e) for e in result.errors])
        assert rank[-2:] == [ReduceGrads(), OptimizerStep()]
        assert max(result.peak_activations) <= (2 if name == "intra" or (name == "si-ends" and m > 1) else 1)


def test_one_stage_lists_read_as_the_executor_runs_them():
    assert R.build("si", R.ONE_STAGE, 1, 3)[0] == [
        LoadMicroBatch(0),
        Forward(0),
        FixActivationBudget(),
        LoadMicroBatch(1),
        ForwardBackward(1, 0, 0, 0),
        LoadMicroBatch(2),
        ForwardBackward(2, 0, 1, 0),
        Backward(2),
        ReduceGrads(),
        OptimizerStep(),
    ]
    ends = [i for i in R.build("si-ends", R.ONE_STAGE, 1, 4)[0] if not isinstance(i, LoadMicroBatch)]
    assert ends[:4] == [
        ForwardForward(0, 1),
        ForwardBackward(2, 0, 0, 0),
        ForwardBackward(3, 0, 1, 0),
        BackwardBackward(2, 3),
    ]
    intra = [i for i in R.build("intra", R.ONE_STAGE, 1, 2)[0] if not isinstance(i, LoadMicroBatch)]
    assert intra[:4] == [ForwardForward(0, 1), BackwardBackward(0, 1), ForwardForward(2, 3), BackwardBackward(2, 3)]
    assert [i for i in forward_only(R.build("si", R.ONE_STAGE, 1, 2)[0]) if not isinstance(i, LoadMicroBatch)] == [
        Forward(0),
        Forward(1),
    ]


def test_the_replay_catches_a_broken_one_stage_list():
    (rank,) = R.build("si", R.ONE_STAGE, 1, 3)
    twice = [*rank[:2], Forward(0), *rank[2:]]
    assert "forwarded twice" in str(replay([twice], 3, one_stage=True).errors[0])
    itself = [LoadMicroBatch(0), ForwardForward(0, 0), BackwardBackward(0, 1), ReduceGrads(), OptimizerStep()]
    assert "with itself" in str(replay([itself], 2, one_stage=True).errors[0])
    missing = [i for i in rank if i != Backward(2)]
    assert any("backward" in str(e) for e in replay([missing], 3, one_stage=True).errors)


def test_registry_is_the_one_list_of_names():
    """Config, bench, predict and the CLI read their schedule names from the registry."""
    from ds_dhelix.bench.options import DHELIX_MODES, PP_MODES
    from ds_dhelix.config.section import ONE_STAGE_SCHEDULES, PIPELINE_SCHEDULES, SCHEDULES
    from ds_dhelix.predict.pipeline import PIPE_MODES
    from ds_dhelix.predict.step import MODES

    assert ONE_STAGE_SCHEDULES == R.names(R.ONE_STAGE, configured=True)
    assert PIPELINE_SCHEDULES == R.names(R.PIPELINE, configured=True)
    assert set(SCHEDULES) == set(ONE_STAGE_SCHEDULES) | set(PIPELINE_SCHEDULES)
    assert set(DHELIX_MODES) == set(R.names()) and set(R.names(R.PIPELINE)) <= set(PP_MODES)
    assert MODES == R.names(R.ONE_STAGE, built=True) and set(R.names(R.PIPELINE, built=True)) <= set(PIPE_MODES)
    assert R.lookup("dualpipev-si", R.PIPELINE).name == "dualpipev"  # the old name still reads
    with pytest.raises(ValueError, match="did you mean 'si'"):
        R.lookup("sii", R.ONE_STAGE)


def test_cli_simulate_one_stage(capsys):
    assert main(["simulate", "--schedule", "si", "--microbatches", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and [e["label"] for e in data["timeline"][0]] == ["F0", "F1B0", "F2B1", "F3B2", "B3"]
    assert main(["simulate", "--schedule", "w", "--microbatches", "4"]) == 2
    assert "pass --pp" in capsys.readouterr().err


# ---- the documented example --------------------------------------------------------------------


def _diff_additions(text: str) -> dict[str, str]:
    """The added lines of each file of the first ```diff block in ``text``."""
    block = text.split("```diff\n", 1)[1].split("```", 1)[0]
    out, current = {}, None
    for line in block.splitlines():
        if line.startswith("+++ "):
            current = line.split("/", 1)[1]
            out[current] = ""
        elif line.startswith("+") and current:
            out[current] += line[1:] + "\n"
    return out


def test_the_documented_example_schedule(monkeypatch):
    """docs/guides/schedules.md's diff (one builder, one registry row) applied as written: the new
    schedule is a config value, replays clean and runs through the executor bitwise like sequential."""
    import copy
    import os

    import torch

    from ds_dhelix.runtime.executor import Executor
    from ds_dhelix.schedule import one_stage
    from hf_models.adapters import adapter_for
    from tests.conftest import make_batches, make_config, make_model

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    added = _diff_additions(open(os.path.join(root, "docs", "guides", "schedules.md")).read())
    assert set(added) == {"ds_dhelix/schedule/one_stage.py", "ds_dhelix/schedule/registry.py"}
    space = vars(one_stage).copy()
    exec(added["ds_dhelix/schedule/one_stage.py"], space)
    monkeypatch.setattr(one_stage, "si_lead2_schedule", space["si_lead2_schedule"], raising=False)
    row = eval(added["ds_dhelix/schedule/registry.py"].strip().rstrip(","), vars(R).copy())
    monkeypatch.setattr(R, "REGISTRY", (*R.REGISTRY, row))
    spec = R.lookup("si-lead2", R.ONE_STAGE)
    for m in range(2, 7):
        assert replay(spec.schedule(1, m), m, one_stage=True).ok
    assert "si-lead2" in R.names(R.ONE_STAGE, configured=True)  # what config.section.SCHEDULES is made of
    config = make_config("tiny-llama")
    ref = make_model(config)
    batches = make_batches(config.vocab_size, 4)
    out = {}
    for name in ("sequential", "si-lead2"):
        model = copy.deepcopy(ref)
        mbs = Executor(adapter_for(config).build_graph(model), defer_weight_grads=True).run_microbatches(
            list(batches), name, 0.25
        )
        out[name] = ([mb.loss for mb in mbs], {n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(a, b) for a, b in zip(out["si-lead2"][0], out["sequential"][0]))
    assert all(torch.equal(g, out["sequential"][1][n]) for n, g in out["si-lead2"][1].items())
