"""The "intra" schedule (Domino's intra-batch overlap on our op graph) and "schedule": "auto".

intra: each micro-batch cut in two halves along the batch, run as a forward pair then a backward
pair. It is held to sequential within the HF tolerances (one more split of each sum), and bitwise
to sequential over half-size micro-batches (``ds_dhelix.verify``). auto: the chooser's trial
phases and decisions, and real engines whose trial steps train exactly as the chosen schedule does.
"""

import pytest
import torch

from ds_dhelix.config.section import DhelixConfig
from ds_dhelix.engine.build import check_setup
from ds_dhelix.planning.autoschedule import AutoSchedule, describe
from ds_dhelix.runtime.interpreter import half_batches, half_serial
from ds_dhelix.verify import ParityOptions, run_parity
from hf_models.registry import load_config
from tests.conftest import run_ranks

# ---------------------------------------------------------------- halves


def test_half_batches_cut_rows_and_keep_the_whole_denominator():
    ids = torch.arange(3 * 5).view(3, 5)
    labels = ids.clone()
    labels[2, 1:3] = -100
    a, b = half_batches({"input_ids": ids, "labels": labels, "note": "kept"})
    assert torch.equal(a["input_ids"], ids[:2]) and torch.equal(b["input_ids"], ids[2:])  # odd: first half larger
    assert a["note"] == b["note"] == "kept"
    # shifted targets: 4 per row, two of row 2 ignored -> 10 for the whole micro-batch
    assert a["loss_denominator"] == b["loss_denominator"] == 10
    assert (a["loss_share"], b["loss_share"]) == (2 / 3, 1 / 3)
    given = half_batches({"input_ids": ids[:2], "loss_denominator": 7.5})
    assert [h["loss_denominator"] for h in given] == [7.5, 7.5]
    with pytest.raises(ValueError, match="1 row"):
        half_batches({"input_ids": ids[:1]})


def test_half_serials_are_those_of_half_size_microbatches():
    assert [half_serial(s, h) for s in (0, 1, 5) for h in (0, 1)] == [0, 1, 2, 3, 10, 11]


def _assert_intra(r):
    assert r["bitwise_equal_to_half_microbatches"], r["losses"]
    assert r["ok"], {k: v for k, v in r.items() if k != "options"}


def test_intra_tp2_close_to_sequential_and_bitwise_to_half_microbatches():
    r = run_parity(ParityOptions(model="tiny-llama", tp=2, schedule="intra", num_layers=2, seq_len=32), timeout=300)
    _assert_intra(r)
    assert not r["bitwise_equal"]  # one more split of each gradient sum: rounding, within the HF tolerances
    assert r["max_grad_diff_vs_sequential"] <= r["hf_grad_tolerance"] and r["hf_close"]


def test_intra_moe_balance_loss_per_half_is_bitwise_the_half_microbatches_run():
    """Each half's load-balancing loss weighted by its share of the rows (dropping the weight
    doubles the aux term: the half-size run then differs)."""
    r = run_parity(
        ParityOptions(
            model="tiny-phimoe",
            tp=1,
            dp=2,
            schedule="intra",
            num_layers=2,
            seq_len=32,
            extra={"expert_parallel": {"size": 2}},
        ),
        timeout=300,
    )
    _assert_intra(r)


def test_intra_parity_is_not_passed_when_nothing_judged_it():
    """MoE balance loss (not comparable with sequential) and no half-size run (odd micro-batch):
    the result says NOT JUDGED and is not ok; with the half-size run it is judged by it."""
    from ds_dhelix.verify import compare, judge_halves

    opts = ParityOptions(model="tiny-phimoe", tp=1, schedule="intra", micro_batch_size=3, dtype="bf16")
    params = {"w": torch.ones(2)}
    seq = {"losses": [1.0], "params": params, "peak_activation_bytes": 1}
    intra = {"losses": [1.1], "params": {"w": torch.ones(2) * 1.5}, "peak_activation_bytes": 1}
    out = judge_halves(compare(opts, seq, intra, None), intra, None)
    assert out["ok"] is False and "NOT JUDGED" in out["intra_tolerance"]
    out = judge_halves(compare(opts, seq, intra, None), intra, {"losses": [1.1], "params": intra["params"]})
    assert out["ok"] is True and out["bitwise_equal_to_half_microbatches"]


# ---------------------------------------------------------------- refusals


def _setup(section, micro=2, world=2):
    ds = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 4,
        "dhelix": {"enabled": True, "tensor_parallel": {"size": 2}, **section},
    }
    return check_setup(ds, load_config("tiny-llama"), world)


@pytest.mark.parametrize(
    "section, micro, match",
    [
        ({"schedule": "intra"}, 1, "train_micro_batch_size_per_gpu is 1"),
        ({"schedule": "intra", "si_execution": "plan"}, 2, "intra pairs the two halves"),
        ({"schedule": "si", "auto_trials": 5}, 2, "auto_trials is set but schedule is 'si'"),
        (
            {"auto_recheck_steps": 500},
            2,
            "auto_recheck_steps is set but schedule is 'si'",
        ),  # its default: still refused
        (
            {"schedule": "auto", "auto_candidates": ["si", "w"]},
            2,
            r"of \['sequential', 'si', 'intra'\] on one stage \('w'",
        ),
        (
            {"schedule": "auto", "pipeline": {"stages": 2}, "auto_candidates": ["w", "si"]},
            2,
            r"of \['sequential', 'w', 'dualpipev'\] with pipeline.stages = 2 \('si': one-stage schedule\)",
        ),
        ({"schedule": "auto", "auto_candidates": ["si"]}, 2, "two or more different"),
        ({"schedule": "auto", "auto_candidates": ["intra", "si"]}, 1, "leaves one candidate"),
        ({"schedule": "auto", "auto_trials": 0}, 2, "auto_trials"),
        ({"schedule": "intra", "pipeline": {"stages": 2}}, 2, "a pipeline runs one of"),
        ({"schedule": "auto", "si_execution": "plan"}, 2, "includes 'intra' with si_execution 'plan'"),
    ],
)
def test_intra_and_auto_refusals(section, micro, match):
    with pytest.raises(ValueError, match=match):
        _setup(section, micro, world=4)


def test_auto_defaults_and_pair_ends_with_auto():
    cfg = DhelixConfig.from_dict({"enabled": True, "schedule": "auto", "pair_ends": True})
    assert cfg.auto_schedules == ("sequential", "si", "intra") and cfg.auto_trials == 3
    piped = DhelixConfig.from_dict({"enabled": True, "schedule": "auto", "pipeline": {"stages": 2}})
    assert piped.auto_schedules == ("sequential", "w", "dualpipev")  # the pipeline's default
    assert DhelixConfig.from_dict(piped.to_dict()) == piped
    assert cfg.auto_recheck_steps == 500
    _setup({"schedule": "auto"}, micro=1)  # intra left out (the engine warns), two remain


# ---------------------------------------------------------------- the chooser


def _drive(auto, times: dict, steps: int):
    """Run ``steps`` steps, each taking ``times[schedule]``; the schedules and decisions seen."""
    ran, decided = [], []
    for step in range(1, steps + 1):
        name = auto.schedule()
        ran.append(name)
        d = auto.record(step, times[name])
        if d is not None:
            decided.append(d)
    return ran, decided


def test_auto_alternates_warms_up_once_and_keeps_the_fastest():
    auto = AutoSchedule(("sequential", "si", "intra"), trials=2, recheck_steps=4)
    ran, decided = _drive(auto, {"sequential": 3.0, "si": 1.0, "intra": 2.0}, 9 + 4 + 6)
    warm, trials = ran[:3], ran[3:9]
    assert warm == ["sequential", "si", "intra"]
    assert trials == ["sequential", "si", "intra", "si", "intra", "sequential"]  # rotated per round
    assert ran[9:13] == ["si"] * 4  # the choice, until the re-check
    assert ran[13:19] == trials  # re-check: no warm-up
    assert [d["chosen"] for d in decided] == ["si", "si"] and [d["step"] for d in decided] == [9, 19]
    assert decided[0]["figures"]["intra"] == {"median_s": 2.0, "min_s": 2.0, "max_s": 2.0}
    assert decided[1]["previous"] == "si"
    line = describe(decided[0])
    assert "chose 'si' after step 9" in line and "intra 2000.0 ms" in line and "(2.00x)" in line


def test_auto_decides_by_the_slowest_ranks_medians():
    """Every rank takes the element-wise max over ranks: here another rank is slower under si."""
    other_rank = {"sequential": 1.5, "si": 9.0}

    def reduce_max(values):
        theirs = [other_rank["sequential"]] * 3 + [other_rank["si"]] * 3
        return [max(a, b) for a, b in zip(values, theirs)]

    auto = AutoSchedule(("sequential", "si"), trials=3, recheck_steps=0, reduce_max=reduce_max)
    ran, decided = _drive(auto, {"sequential": 1.0, "si": 0.5}, 8 + 50)
    assert decided[0]["chosen"] == "sequential" and len(decided) == 1  # recheck 0: never again
    assert set(ran[8:]) == {"sequential"}


def test_auto_median_resists_one_slow_step():
    auto = AutoSchedule(("sequential", "si"), trials=3, recheck_steps=0)
    times = iter([1, 1] + [1.0, 5.0, 0.9, 1.0, 1.0, 0.9])  # warm-up, then si's first timed step is slow
    decided = None
    while decided is None:
        auto.schedule()
        decided = auto.record(0, next(times))
    assert decided["chosen"] == "si" and decided["figures"]["si"]["max_s"] == 5.0


def _graph(*kinds):
    """A ModelGraph of one layer block whose ops are of ``kinds`` ("comp" / "comm")."""
    from ds_dhelix.graph.model_graph import ModelGraph, comm, comp

    ops = [
        comm(f"op{i}", None, "x", "x") if kind == "comm" else comp(f"op{i}", ("x",), ("x",), None)
        for i, kind in enumerate(kinds)
    ]
    return ModelGraph(blocks=[[], ops, []], make_side=dict)


def test_auto_takes_sequential_without_a_trial_when_nothing_to_hide():
    """No COMM op in the graph (TP, EP, CP 1): sequential from step 1, no trial, no re-check, and
    the decision (its log line) says why; a graph with a collective is timed as before."""
    from ds_dhelix.planning.autoschedule import nothing_to_hide

    assert nothing_to_hide(_graph("comp", "comm", "comp")) is None
    reason = nothing_to_hide(_graph("comp", "comp"))
    assert reason.startswith("nothing to hide")
    auto = AutoSchedule(("sequential", "si", "intra"), trials=3, recheck_steps=2, untimed_reason=reason)
    assert auto.trial_steps_left == 0 and auto.chosen == "sequential"
    ran, decided = _drive(auto, {"sequential": 3.0, "si": 1.0, "intra": 2.0}, 10)
    assert ran == ["sequential"] * 10 and decided == []  # si "faster" here: not even looked at
    (d,) = auto.decisions
    assert d == {"step": 0, "chosen": "sequential", "previous": None, "trials": 0, "figures": {}, "reason": reason}
    assert describe(d) == f"ds_dhelix: schedule auto chose 'sequential' without a trial: {reason}"
    # sequential not a candidate: timed as usual, the reason says what was not possible
    auto = AutoSchedule(("si", "intra"), trials=1, recheck_steps=0, untimed_reason=reason)
    _, decided = _drive(auto, {"si": 1.0, "intra": 2.0}, 4)
    assert decided[0]["chosen"] == "si" and "'sequential' is not among the candidates" in decided[0]["reason"]
    timed = AutoSchedule(("sequential", "si"), trials=1, recheck_steps=0)
    assert timed.trial_steps_left == 4 and timed.decisions == []


# ---------------------------------------------------------------- real engines


def _auto_rank(rank, world, candidates, layout):
    from ds_dhelix.engine.build import build_engine
    from ds_dhelix.engine.checkpoint import full_state_dict
    from ds_dhelix.pipe.module import gather_hf_state_dict
    from ds_dhelix.verify import build, make_batches

    opts = ParityOptions(model="tiny-llama", seq_len=32, **layout)
    batches = make_batches(opts, load_config(opts.model).vocab_size)
    out = {}
    for name, extra in (
        ("auto", {"schedule": "auto", "auto_candidates": candidates, "auto_trials": 1, "auto_recheck_steps": 2}),
        ("chosen", None),
    ):
        if name == "chosen":  # the schedule auto settled on, from the start
            extra = {"schedule": out["auto"]["decisions"][0]["chosen"]}
        config = opts.ds_config("si")
        config["dhelix"].update(extra)
        engine = build_engine(build(opts), config)
        ran = []
        for step in batches:
            ran.append(engine.current_schedule if engine.auto is None else engine.auto.schedule())
            engine.train_batch(iter(step))
        gather = gather_hf_state_dict if opts.pp > 1 else full_state_dict
        out[name] = {
            "params": gather(engine.module, engine.groups.tp_grad_group, engine.groups.tp_size),
            "ran": ran,
            "decisions": engine.auto.decisions if engine.auto is not None else None,
        }
        engine.destroy()
    return out if rank == 0 else None


def test_auto_trial_steps_train_bitwise_as_the_chosen_schedule():
    """Candidates sequential and si (bitwise equal schedules): 2 warm-up + 2 timed steps, the
    choice for 2 steps, then a re-check phase; the weights are bitwise those of a run with the
    chosen schedule from the start."""
    layout = dict(tp=2, num_layers=2, micro_batches=2, steps=7)
    out = run_ranks(_auto_rank, 2, args=(["sequential", "si"], layout), timeout=240)[0]
    auto = out["auto"]
    assert len(auto["decisions"]) == 1 and auto["decisions"][0]["step"] == 4
    chosen = auto["decisions"][0]["chosen"]
    assert auto["ran"][:4] == ["sequential", "si", "sequential", "si"]
    assert auto["ran"][4:6] == [chosen] * 2 and auto["ran"][6] == "sequential"  # re-check begins
    assert all(torch.equal(auto["params"][k], out["chosen"]["params"][k]) for k in auto["params"])


def test_auto_at_tp1_dp2_takes_sequential_without_a_trial():
    """TP=1 x DP=2: the op graph has no collective, so the engine's auto runs sequential from its
    first step with no trial, its decision saying there is nothing to hide."""
    layout = dict(tp=1, dp=2, num_layers=1, micro_batches=2, steps=2)
    out = run_ranks(_auto_rank, 2, args=(None, layout), timeout=240)[0]
    auto = out["auto"]
    assert auto["ran"] == ["sequential", "sequential"]
    (d,) = auto["decisions"]
    assert d["chosen"] == "sequential" and d["trials"] == 0 and d["reason"].startswith("nothing to hide")


def test_pipeline_auto_trial_steps_train_bitwise_as_the_chosen_schedule():
    """A folded pipeline (PP=2): the sequential fold, w and dualpipev run on one fold and are
    bitwise equal, so auto may switch between them step by step: 3 warm-up + 3 timed steps, the
    choice for 2 steps, then the re-check phase begins; weights bitwise those of the chosen
    schedule from the start."""
    layout = dict(tp=1, pp=2, micro_batches=4, steps=9)
    out = run_ranks(_auto_rank, 2, args=(None, layout), timeout=240)[0]
    auto = out["auto"]
    assert len(auto["decisions"]) == 1 and auto["decisions"][0]["step"] == 6
    chosen = auto["decisions"][0]["chosen"]
    assert auto["ran"][:6] == ["sequential", "w", "dualpipev"] * 2
    assert auto["ran"][6:8] == [chosen] * 2 and auto["ran"][8] == "sequential"  # re-check begins
    assert all(torch.equal(auto["params"][k], out["chosen"]["params"][k]) for k in auto["params"])
