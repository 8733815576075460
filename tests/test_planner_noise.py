"""A planner that noise cannot fool: entries carry their spread, the DP prices an upper bound of
each median, and profiling re-measures noisy entries and the plan's own until the plan stays.
Pure (no processes): a fake probe stands in for the timed layer."""

import math
import random

import pytest

from ds_dhelix.planning.plan import default_plan
from ds_dhelix.planning.planner import (
    EMPTY,
    MEDIAN_SE,
    TINY_LAYER_OPS,
    OverlapTable,
    noise_aware,
    plan_dp,
    plan_keys,
    predict_ms,
    predicted_spread_ms,
    synthetic_table,
)
from ds_dhelix.runtime.profiler import StreamClock, _refine_plan, _remeasure_noisy, _Samples, robust_spread

FWD, BWD = TINY_LAYER_OPS, tuple(reversed(TINY_LAYER_OPS))


def _table(seed=0):
    return synthetic_table(FWD, BWD, random.Random(seed))


def _all_keys(t: OverlapTable):
    return [(s, EMPTY) for s in t.fwd_alone_ms] + [(EMPTY, s) for s in t.bwd_alone_ms] + list(t.pair_ms)


def test_robust_spread_ignores_one_outlier():
    assert robust_spread([1.0, 1.0, 1.0, 1.0, 50.0]) == 0.0
    assert robust_spread([1.0, 2.0, 3.0]) == pytest.approx(1.4826)


def test_noise_aware_prices_the_median_plus_risk_standard_errors():
    t = _table()
    key = next(iter(t.pair_ms))
    t.spread_ms[key], t.samples[key] = 0.4, 4
    bumped = noise_aware(t, risk=2.0)
    assert bumped.pair_ms[key] == pytest.approx(t.pair_ms[key] + 2.0 * MEDIAN_SE * 0.4 / math.sqrt(4))
    other = next(k for k in t.pair_ms if k != key)
    assert bumped.pair_ms[other] == t.pair_ms[other]  # no spread known: unchanged


def test_a_pair_low_by_chance_does_not_win():
    """One pair measured far below everything else but with a wide spread over 3 runs: the median
    DP takes it, the noise-aware DP does not (it costs more than the plan it displaced once its
    error is counted); measured as steady as the others it is trusted again."""
    t = _table(1)
    base = plan_dp(t, risk=0)
    for k in _all_keys(t):
        t.spread_ms[k], t.samples[k] = 0.01 * t.entry_ms(k), 5
    lucky = next(k for k in t.pair_ms if k not in plan_keys(t, base) and k[0][1] - k[0][0] > 1)
    t.pair_ms[lucky] = 0.05 * t.pair_ms[lucky]
    t.spread_ms[lucky], t.samples[lucky] = 50.0, 3
    assert lucky in plan_keys(t, plan_dp(t, risk=0))
    assert lucky not in plan_keys(t, plan_dp(t))
    t.spread_ms[lucky], t.samples[lucky] = 0.01 * t.pair_ms[lucky], 5
    assert lucky in plan_keys(t, plan_dp(t))


def test_plan_reports_median_prediction_and_error_bar():
    t = _table(2)
    for k in _all_keys(t):
        t.spread_ms[k], t.samples[k] = 0.1, 5
    plan = plan_dp(t)
    assert plan.predicted_ms == pytest.approx(predict_ms(t, plan))  # medians, not the bumped cost
    keys = plan_keys(t, plan)
    assert plan.meta["predicted_spread_ms"] == pytest.approx(0.1 * math.sqrt(len(keys)))
    assert predicted_spread_ms(t, default_plan(FWD, BWD)) > 0


def test_spreads_round_trip_and_version_1_tables_load(tmp_path):
    t = _table(3)
    key = next(iter(t.pair_ms))
    t.spread_ms[key], t.samples[key], t.info = 0.25, 7, {"repeats": 5}
    path = tmp_path / "t.json"
    t.save(str(path))
    again = OverlapTable.load(str(path))
    assert again.spread_ms == t.spread_ms and again.samples == t.samples and again.info == t.info
    assert again.pair_ms == t.pair_ms
    old = t.to_dict()
    old["version"] = 1
    for e in old["pairs"]:
        e.pop("spread_ms", None), e.pop("samples", None)
    v1 = OverlapTable.from_dict(old)
    assert v1.spread_ms == {} and plan_dp(v1).fingerprint() == plan_dp(v1, risk=0).fingerprint()


class _FakeProbe:
    """Times from a hidden truth; one pair reads very low on its first ``lucky`` runs."""

    def __init__(self, truth: OverlapTable, lucky_key, lucky: int, rng):
        self.truth, self.lucky_key, self.lucky, self.rng = truth, lucky_key, lucky, rng
        self.clock = StreamClock("cpu")  # the reduction over ranks (one process: the values)

    def time_round(self, fseg, bseg):
        key = (fseg, bseg)
        ms = self.truth.entry_ms(key) * self.rng.uniform(0.99, 1.01)
        if key == self.lucky_key and self.lucky > 0:
            self.lucky -= 1
            ms *= 0.05
        return ms / 1e3


def test_refinement_re_measures_the_plans_entries_until_it_stays():
    """Profiling with 3 runs per entry, where one pair's three runs all came out lucky: the first
    plan uses it, its re-measurement shows the truth, and the refined plan is the true optimum."""
    truth = _table(4)
    best = plan_dp(truth, risk=0)
    lucky_key = next(k for k in truth.pair_ms if k not in plan_keys(truth, best))
    probe = _FakeProbe(truth, lucky_key, lucky=3, rng=random.Random(0))
    samples = _Samples(probe, {}, FWD, BWD)
    for key in _all_keys(truth):
        samples.measure(key, 3)
    first = samples.table()
    assert lucky_key in plan_keys(first, plan_dp(first))  # fooled before refinement
    table, rounds = _refine_plan(samples, first, repeats=3, show=False)
    assert rounds >= 2  # the plan changed once, then stayed
    assert plan_dp(table).fingerprint() == best.fingerprint()


def test_noisy_entries_get_more_runs_within_the_budget():
    truth = _table(5)
    rng = random.Random(1)

    class Noisy(_FakeProbe):
        def time_round(self, fseg, bseg):
            spread = 0.5 if (fseg, bseg) in noisy else 0.001
            return truth.entry_ms((fseg, bseg)) * (1 + rng.uniform(-spread, spread)) / 1e3

    noisy = set(list(truth.pair_ms)[:3])
    samples = _Samples(Noisy(truth, None, 0, rng), {}, FWD, BWD)
    for key in _all_keys(truth):
        samples.measure(key, 5)
    added = _remeasure_noisy(samples, samples.table(), repeats=5, budget_s=5.0, show=False)
    assert added > 0
    assert all(len(samples.runs[k]) > 5 for k in noisy)
    assert all(len(samples.runs[k]) == 5 for k in samples.runs if k not in noisy)
    assert _remeasure_noisy(samples, samples.table(), repeats=5, budget_s=0.0, show=False) <= 5 * len(noisy)


def test_dp_keeps_the_default_plan_unless_it_wins_by_more_than_the_noise():
    t = _table(6)
    found = plan_dp(t, risk=0)
    default = default_plan(FWD, BWD)
    gain = predict_ms(t, default) - predict_ms(t, found)
    assert gain > 0 and found.fingerprint() != default.fingerprint()
    for k in _all_keys(t):  # every entry as noisy as the gain: within the noise
        t.spread_ms[k], t.samples[k] = gain, 5
    kept = plan_dp(t)
    assert kept.source == "default-within-noise" and kept.fingerprint() == default.fingerprint()
    assert kept.meta["dp_plan_predicted_ms"] == pytest.approx(predict_ms(t, found)) and kept.meta["margin_ms"] > gain
    for k in _all_keys(t):  # quiet entries: the DP plan's gain is real
        t.spread_ms[k] = gain / 100
    assert plan_dp(t).source == "dp" and plan_dp(t).fingerprint() == found.fingerprint()
