"""cje_engine.inference.changes: changes across windows with alpha spending over windows."""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from cje_engine.drift.monitor import look_spending
from cje_engine.errors import CJEInputError
from cje_engine.inference.changes import WindowValue, changes_by_policy, series_from_results, window_changes

N = NormalDist()


def _series(values, se=0.01, refused=()):
    return [WindowValue(f"w{i}", v, se, i not in refused, "overlap" if i in refused else None, 100)
            for i, v in enumerate(values)]


def test_change_matches_a_hand_computation():
    vals = [WindowValue("a", 0.70, 0.010), WindowValue("b", 0.66, 0.012)]
    pc = window_changes(vals, alpha=0.05)
    c = pc.consecutive[1]
    se = math.sqrt(0.010 ** 2 + 0.012 ** 2)  # independent windows
    assert c.diff == pytest.approx(-0.04) and c.se == pytest.approx(se)
    assert c.ci == pytest.approx((-0.04 - 1.959964 * se, -0.04 + 1.959964 * se), abs=1e-6)
    assert c.p_value == pytest.approx(2 * (1 - N.cdf(0.04 / se)))
    spent = 0.05 * look_spending(1, None) / 2  # look 1 spends alpha/2, split over the two tests
    assert c.alpha_spent == pytest.approx(spent)
    z = N.inv_cdf(1 - spent / 2)
    assert c.ci_anytime == pytest.approx((-0.04 - z * se, -0.04 + z * se))
    assert c.significant == (c.p_value <= spent) and c.status == "regression"
    assert pc.against_baseline[1].diff == pytest.approx(-0.04)  # baseline = first window
    assert pc.alarms == ["b"] and pc.consecutive[0] is None


def test_budget_over_all_windows_is_at_most_alpha():
    pc = window_changes(_series([0.7] * 200), alpha=0.05)
    total = sum(c.alpha_spent for i in range(200) for c in pc.tests_at(i))
    assert [len(pc.tests_at(i)) for i in (0, 1, 2, 4, 8)] == [0, 2, 3, 4, 5]  # pooled k = 2, 4, 8 join in
    assert total <= 0.05 and total > 0.049  # 1 - 1/200 of the budget spent by window 199


def test_refused_window_is_not_estimable_and_keeps_its_budget_unused():
    pc = window_changes(_series([0.7, 0.7, 0.5, 0.7], refused={2}), alpha=0.05)
    c2, c3 = pc.consecutive[2], pc.consecutive[3]
    assert c2.status == "not_estimable" and c2.diff is None and "overlap" in c2.reason
    assert c3.status == "not_estimable" and "reference window (w2)" in c3.reason
    assert pc.against_baseline[3].look == 3  # the look index is the window position, not the count of tests
    assert pc.against_baseline[3].status == "stable" and pc.alarms == []


def test_baseline_pinned_and_windows_before_it_untested():
    pc = window_changes(_series([0.6, 0.7, 0.7, 0.64]), baseline="w1", alpha=0.05)
    assert pc.baseline == "w1" and pc.consecutive[:2] == [None, None]
    assert pc.against_baseline[3].diff == pytest.approx(-0.06) and pc.against_baseline[3].ref == "w1"
    with pytest.raises(CJEInputError, match="baseline window"):
        window_changes(_series([0.6]), baseline="nope")


def test_undecided_drop_says_how_many_labels_would_decide_it():
    vals = [WindowValue("a", 0.70, 0.005, n_labelled=100), WindowValue("b", 0.675, 0.02, n_labelled=100)]
    c = window_changes(vals, alpha=0.05, decision_margin=0.02).consecutive[1]
    assert c.status == "undecided" and not c.significant
    z = N.inv_cdf(1 - c.alpha_spent / 2)
    need_cur = math.sqrt((0.025 / z) ** 2 - 0.005 ** 2)
    assert c.labels_needed == math.ceil(100 * (0.02 ** 2 / need_cur ** 2 - 1))
    # with those labels the drop would reach the critical value (variance ~ 1 / labels)
    se_after = math.sqrt(0.02 ** 2 * 100 / (100 + c.labels_needed) + 0.005 ** 2)
    assert 0.025 / se_after >= z - 1e-9
    # a reference window that is itself too noisy: labels here cannot decide it
    vals = [WindowValue("a", 0.70, 0.05, n_labelled=100), WindowValue("b", 0.675, 0.02, n_labelled=100)]
    c = window_changes(vals, alpha=0.05).consecutive[1]
    assert c.status == "undecided" and c.labels_needed is None


@pytest.mark.stats  # Monte Carlo: CI's service tier (docs/testing.md)
def test_false_alarm_rate_over_50_windows_holds():
    # 400 sequences x 50 windows with no change (more in benchmarks/bench_monitoring.py). The family-wise rate is
    # <= alpha by the union bound; tolerance: 3 binomial SEs at p = 0.05 (3 * sqrt(.05 * .95 / 400) = 0.033).
    rng = np.random.default_rng(0)
    alarms = 0
    for _ in range(400):
        est = 0.7 + 0.01 * rng.standard_normal(50)
        alarms += bool(window_changes(_series(list(est)), alpha=0.05).alarms)
    assert alarms / 400 <= 0.05 + 0.033


def test_step_change_detected_on_the_day_it_happens_or_the_next():
    # A drop of 0.05 (3.5 SEs of a difference at se=0.01 per window) at window 3 of 5: at look 3 the budget
    # 0.05/12 is split over 3 tests, critical value z(1 - 0.05/72) = 3.20, so the baseline test alone detects at
    # window 3 with probability ~0.64; at window 4 (budget 0.05/20 over 4 tests, z = 3.42) the pooled mean of
    # windows 3-4 (SE 0.0122, 4.1 SEs) adds ~0.74: detection by window 4 ~0.9; before window 3 only false alarms
    # (<= alpha). Checked over 400 sequences.
    rng = np.random.default_rng(1)
    first = []
    for _ in range(400):
        est = 0.7 + 0.01 * rng.standard_normal(5)
        est[3:] -= 0.05
        first.append(window_changes(_series(list(est)), alpha=0.05).first_alarm)
    early = sum(f in ("w1", "w2") for f in first) / 400
    on_time = sum(f in ("w3", "w4") for f in first) / 400
    assert early <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 400)
    assert on_time >= 0.75


def test_series_from_results_handles_refused_and_missing_policies():
    r1 = {"policies": {"a": {"estimate": 0.7, "se": 0.01, "level_claim": "ok", "n_labelled": 50}}}
    r2 = {"policies": {"a": {"estimate": 0.9, "se": 0.01, "level_claim": "refused",
                             "refusal_reasons": ["overlap: TTC 0.3"]},
                       "b": {"estimate": 0.5, "se": 0.02, "level_claim": "ok"}}}
    s = series_from_results([("d1", r1), ("d2", r2)])
    assert s["a"][1].estimable is False and s["a"][1].reason == "overlap: TTC 0.3"
    assert s["b"][0].reason == "not evaluated in this window" and s["a"][0].n_labelled == 50
    ch = changes_by_policy([("d1", r1), ("d2", r2)])
    assert ch["a"].consecutive[1].status == "not_estimable" and ch["b"].baseline == "d2"
    assert ch["a"].to_dict()["alarms"] == []


def test_bad_parameters_are_input_errors():
    with pytest.raises(CJEInputError):
        window_changes(_series([0.1]), alpha=1.5)
    with pytest.raises(CJEInputError):
        window_changes(_series([0.1, 0.2]), horizon=0)
    with pytest.raises(CJEInputError, match="distinct"):
        window_changes([WindowValue("a", 0.1, 0.1), WindowValue("a", 0.1, 0.1)])


def test_pooled_test_is_the_mean_of_the_last_windows_against_the_baseline():
    vals = _series([0.70, 0.70, 0.69, 0.68, 0.68], se=0.01)
    pc = window_changes(vals, alpha=0.05)
    k4 = next(c for c in pc.pooled[4] if c.n_windows == 4)
    assert k4.kind == "pooled" and k4.ref == "w0"
    assert k4.diff == pytest.approx((0.70 + 0.69 + 0.68 + 0.68) / 4 - 0.70)
    assert k4.se == pytest.approx(math.sqrt(4 * 0.01 ** 2 / 16 + 0.01 ** 2))
    assert k4.alpha_spent == pytest.approx(0.05 * look_spending(4, None) / 4)
    refused = window_changes(_series([0.7, 0.7, 0.7, 0.7], refused={2}), alpha=0.05)
    assert all(c.status == "not_estimable" and "w2" in c.reason for c in refused.pooled[3])


def test_baseline_period_is_the_mean_of_its_windows_and_testing_starts_after_it():
    vals = _series([0.70, 0.72, 0.68, 0.70, 0.60], se=0.01)
    pc = window_changes(vals, alpha=0.05, baseline_windows=3)
    assert pc.consecutive[:3] == [None, None, None] and pc.against_baseline[3].look == 1
    b = pc.against_baseline[4]
    assert b.ref == "w0..w2" and b.diff == pytest.approx(0.60 - 0.70)
    assert b.se == pytest.approx(math.sqrt(0.01 ** 2 + 3 * 0.01 ** 2 / 9))
    with pytest.raises(CJEInputError, match="baseline_windows"):
        window_changes(vals, baseline_windows=0)
