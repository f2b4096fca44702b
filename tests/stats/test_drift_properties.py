"""Seeded statistical properties of the drift monitor (cje_engine.drift.monitor).

Fast tier (default run): 60-300 monitors per check. Slow tier (-m slow): 400-1000. The
independent judge-data generator is tests/stats/drift_judge_data.py.
Every tolerance is derived from a binomial standard error in the comment next to it.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from cje_engine.drift.kendall import kendall_tau_b
from cje_engine.drift.monitor import DEFAULT_WEIGHTS, METRICS, DriftMonitor
from cje_engine.simulate.drift import DEFAULT_EFFECT, detection_study, false_alarm_study, simulate_monitor

from .drift_judge_data import JudgePanel, PanelWorld, first_alarms

logger = logging.getLogger(__name__)

ALPHA = 0.05


def binomial_upper(p: float, n: int) -> float:
    """p + 3 binomial standard errors: a correct procedure exceeds it with prob ~0.0013."""
    return p + 3 * math.sqrt(p * (1 - p) / n)


# ---------------------------------------------------------------------------------------------
# family-wise false alarms over 50 scheduled looks
# ---------------------------------------------------------------------------------------------


def _check_false_alarms(n_reps: int, **kwargs) -> dict:
    out = false_alarm_study(n_reps, n_looks=50, seed=101, **kwargs)
    logger.info("false alarms: %s", out)
    # The guarantee is P(any alarm in 50 looks, any metric) <= alpha. With n_reps independent
    # monitors the observed rate of a procedure at exactly alpha has SE sqrt(a(1-a)/n_reps);
    # it stays below alpha + 3 SE with probability ~0.9987.
    assert out["false_alarm_rate"] <= binomial_upper(ALPHA, n_reps), out
    # Without the spending, testing every metric at every look at 0.05 alarms far more often:
    # that rate must exceed the same bound, or the monitor would be guarding against nothing.
    assert out["naive_per_look_rate"] > binomial_upper(ALPHA, n_reps), out
    return out


def _panel_false_alarms(n_reps: int, seed: int, shared: float, n_looks: int = 50) -> tuple[float, dict]:
    """Family-wise false-alarm rate of the independent generator (prompts passed as clusters)."""
    alarms, by_metric = 0, {m: 0 for m in METRICS}
    for ss in np.random.SeedSequence(seed).spawn(n_reps):
        first = first_alarms(PanelWorld(ss, "none", shared=shared), n_looks)
        alarms += any(v is not None for v in first.values())
        for m in METRICS:
            by_metric[m] += first[m] is not None
    return alarms / n_reps, {m: c / n_reps for m, c in by_metric.items()}


def test_false_alarm_rate_shared_noise_with_clusters_fast():
    # The failing case: the judge's noise shared within a prompt (30% of its variance),
    # four responses per prompt passed as clusters, independent generator, 50 looks.
    # P(any alarm) <= alpha = 0.05; with 100 monitors the bound is 0.05 + 3 sqrt(0.05 0.95 / 100)
    # = 0.115 (exceeded by a valid monitor w.p. ~0.001).
    n_reps = 100
    rate, by_metric = _panel_false_alarms(n_reps, seed=111, shared=0.3)
    logger.info("shared-noise false alarms: %.3f %s", rate, by_metric)
    assert rate <= binomial_upper(ALPHA, n_reps), (rate, by_metric)


@pytest.mark.slow
def test_false_alarm_rate_shared_noise_with_clusters_slow():
    # 1000 monitors: bound 0.05 + 3 * 0.0069 = 0.071; and no metric spends more than twice its
    # share 0.05 * w_m (<= 0.035) plus 3 SE of that share (the issue saw two metrics at 2x).
    n_reps = 1000
    rate, by_metric = _panel_false_alarms(n_reps, seed=112, shared=0.3)
    logger.info("shared-noise false alarms: %.3f %s", rate, by_metric)
    assert rate <= binomial_upper(ALPHA, n_reps), (rate, by_metric)
    for m, r in by_metric.items():
        share = ALPHA * DEFAULT_WEIGHTS[m]
        assert r <= binomial_upper(share, n_reps), (m, r, share)


@pytest.mark.slow
def test_false_alarm_rate_over_50_looks_slow():
    _check_false_alarms(1000)


@pytest.mark.slow
def test_false_alarm_rate_with_stated_horizon_slow():
    _check_false_alarms(1000, monitor_kwargs={"horizon": 50})


@pytest.mark.slow
def test_false_alarm_rate_simulator_shared_noise_slow():
    # the engine's simulator with prompts of 4 anchors and 30% shared noise, clusters passed
    _check_false_alarms(1000, anchors_per_prompt=4, shared_noise=0.3)


def test_per_look_p_values_are_valid_for_every_metric():
    # One look of 300 no-drift monitors (the simulator, 4 anchors per prompt, 30% shared noise,
    # clusters passed): each metric's p-value must satisfy P(p <= 0.05) <= 0.05.
    # Bound: 0.05 + 3 * sqrt(0.05 * 0.95 / 300) = 0.088 (a valid test exceeds it w.p. ~0.0013
    # per metric, ~0.007 over the five). The rank metric is one-sided and its two windows
    # coincide at look 1 (the replicate is the baseline), so the same bound applies.
    n_reps = 300
    seeds = np.random.SeedSequence(202).spawn(n_reps)
    pv = np.array([simulate_monitor("none", n_looks=1, seed=s, anchors_per_prompt=4, shared_noise=0.3).p_values[0]
                   for s in seeds])
    assert not np.isnan(pv).any()
    rate = (pv <= 0.05).mean(axis=0)
    for m, r in zip(METRICS, rate):
        assert r <= binomial_upper(0.05, n_reps), (m, r)


# ---------------------------------------------------------------------------------------------
# detection of each scenario
# ---------------------------------------------------------------------------------------------

CHANGE_AT, WITHIN = 10, 5


def _check_detection(scenario: str, n_reps: int) -> dict:
    out = detection_study(scenario, n_reps, change_at=CHANGE_AT, within=WITHIN, seed=303)
    logger.info("detection %s: %s", scenario, out)
    # Stated requirement: power >= 0.9 to alarm within WITHIN looks of a change at look
    # CHANGE_AT, at the effect DEFAULT_EFFECT[scenario] (docs/drift.md). Power here is
    # unconditional: runs that falsely alarmed before the change (<= alpha = 5% of them) count
    # as misses, so the true power is at most ~0.95-0.96. We assert the requirement directly on
    # the observed share: if the true power is >= 0.95, the observed share falls below 0.9 with
    # probability P(Bin(n, 0.95) < 0.9 n), i.e. 2.3 SEs below at n = 100 (~0.01), far less at
    # n = 1000.
    assert out["power"] >= 0.9, out
    assert out["delay_max"] is not None and 0 <= out["delay_max"] <= WITHIN - 1
    # no-drift looks before the change obey the family-wise bound as well
    assert out["alarmed_before_change"] <= binomial_upper(ALPHA, n_reps), out
    return out


@pytest.mark.parametrize("scenario", ["shift", "reorder", "remap"])
def test_detection_fast(scenario):
    out = _check_detection(scenario, 100)
    # The metric built for the scenario is the one that alarms first in most detected runs.
    share = out["first_alarm_metric_share"]
    expected = {"shift": "mean_shift", "reorder": "tau_b", "remap": "calibration_loss"}[scenario]
    assert share[expected] >= 0.5, share


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["shift", "reorder", "remap"])
def test_detection_slow(scenario):
    _check_detection(scenario, 1000)


def _rank_power(n_reps: int, seed: int, shared: float = 0.0) -> float:
    """Share of monitors whose rank metric (tau_b) first alarms within WITHIN looks of the change
    to a judge preferring long responses (long +10, short -10 on 0-100), independent generator."""
    hits = 0
    for ss in np.random.SeedSequence(seed).spawn(n_reps):
        first = first_alarms(PanelWorld(ss, "length", change_at=CHANGE_AT, shared=shared), CHANGE_AT + WITHIN - 1)
        hits += first["tau_b"] is not None and first["tau_b"] >= CHANGE_AT
    return hits / n_reps


def test_rank_metric_power_length_reorder_fast():
    # Target: power >= 0.8 (issue 17; measured 0.87 with 150 monitors and other seeds). At n = 60
    # a true power of 0.8 is observed above 0.8 - 3 sqrt(0.8 0.2 / 60) = 0.645 w.p. ~0.999: a
    # smaller share is evidence that the power is below the target.
    n_reps = 60
    power = _rank_power(n_reps, seed=121)
    logger.info("rank-metric power (length reorder): %.3f", power)
    assert power >= 0.8 - 3 * math.sqrt(0.8 * 0.2 / n_reps), power


@pytest.mark.slow
@pytest.mark.parametrize("shared", [0.0, 0.3])
def test_rank_metric_power_length_reorder_slow(shared):
    # 400 monitors: the target itself on the observed share. If the true power is 0.86 (measured
    # 0.87 and 0.80-0.86 at shared noise 0.3 in bench_drift), the observed share falls below 0.8
    # with probability P(Z < -0.06 / 0.0173) ~ 0.0003; at shared noise 0.3 we allow 3 SE (0.06).
    n_reps = 400
    power = _rank_power(n_reps, seed=122 + int(10 * shared), shared=shared)
    logger.info("rank-metric power (length reorder, shared %.1f): %.3f", shared, power)
    floor = 0.8 if shared == 0 else 0.8 - 3 * math.sqrt(0.8 * 0.2 / n_reps)
    assert power >= floor, power


def test_stated_effects_are_the_documented_ones():
    assert DEFAULT_EFFECT == {"none": 0.0, "shift": 0.1, "reorder": 0.5, "remap": 45.0, "length": 0.1,
                              "compress": 0.5, "slow": 0.005}


# ---------------------------------------------------------------------------------------------
# degenerate cases and the one-sided floor
# ---------------------------------------------------------------------------------------------


def test_tau_floor_is_one_sided():
    # The issue: a declared floor of 0.50 below the true test-retest tau (~0.58-0.60 in the
    # independent generator) alarmed at look 1 in 42.5% of monitors (two-sided). One-sided, tau
    # above the floor never alarms: P(alarm) <= the look-1 budget 0.05 * 0.3 / 2 = 0.0075;
    # with 200 monitors the bound is 0.0075 + 3 sqrt(0.0075 * 0.9925 / 200) = 0.026.
    n_reps, alarms = 200, 0
    for ss in np.random.SeedSequence(131).spawn(n_reps):
        panel = JudgePanel(np.random.default_rng(ss))
        mon = DriftMonitor(tau_floor=0.5, rank_window=1)
        look = mon.update(panel.score(), panel.score(), clusters=panel.clusters)
        assert look.metrics["tau_b"].detail["comparison"] == "tau_floor"
        alarms += look.metrics["tau_b"].alarm
    assert alarms / n_reps <= binomial_upper(0.05 * 0.3 / 2, n_reps)
    # and a tau well below the floor does alarm (the test has power)
    panel = JudgePanel(np.random.default_rng(7), noise=1.5)
    look = DriftMonitor(tau_floor=0.9, rank_window=1).update(panel.score(), panel.score(), clusters=panel.clusters)
    assert look.metrics["tau_b"].alarm


# ---------------------------------------------------------------------------------------------
# coverage of the tau-b confidence interval (ties everywhere)
# ---------------------------------------------------------------------------------------------

# Joint distribution of two discrete scores on 5 levels each (heavy ties).
_P = np.array(
    [
        [8, 4, 2, 1, 0],
        [4, 8, 4, 2, 1],
        [2, 4, 10, 4, 2],
        [1, 2, 4, 8, 4],
        [0, 1, 2, 4, 8],
    ],
    dtype=float,
)
_P /= _P.sum()


def population_tau_b(p: np.ndarray) -> float:
    """tau_b = (P_c - P_d) / sqrt((1 - sum_a p_a.^2)(1 - sum_b p_.b^2)) for a joint pmf."""
    k, m = p.shape
    diff = 0.0
    for a in range(k):
        for b in range(m):
            for a2 in range(k):
                for b2 in range(m):
                    diff += p[a, b] * p[a2, b2] * np.sign(a2 - a) * np.sign(b2 - b)
    return diff / math.sqrt((1 - np.sum(p.sum(1) ** 2)) * (1 - np.sum(p.sum(0) ** 2)))


def _tau_coverage(se_method: str, n_reps: int, seed: int = 404, n: int = 150) -> float:
    tau0 = population_tau_b(_P)
    rng = np.random.default_rng(seed)
    cells = rng.choice(_P.size, size=(n_reps, n), p=_P.ravel())
    hits = 0
    for row in cells:
        x, y = np.divmod(row, 5)
        lo, hi = kendall_tau_b(x.astype(float), y.astype(float), se_method=se_method).ci
        hits += lo <= tau0 <= hi
    cover = hits / n_reps
    logger.info("tau-b CI coverage (%s, n=%d, %d samples): %.4f", se_method, n, n_reps, cover)
    # Nominal 0.95; SE of the observed coverage sqrt(0.95*0.05/n_reps) (0.0097 at 500). A
    # correct interval lies within 0.95 +/- 3 SE with probability ~0.997.
    se = math.sqrt(0.95 * 0.05 / n_reps)
    assert 0.95 - 3 * se <= cover <= 0.95 + 3 * se, cover
    return cover


@pytest.mark.parametrize("se_method", ["jackknife", "influence"])
def test_tau_b_ci_covers_population_value(se_method):
    _tau_coverage(se_method, 500)


@pytest.mark.slow
@pytest.mark.parametrize("se_method", ["jackknife", "influence"])
def test_tau_b_ci_covers_population_value_slow(se_method):
    _tau_coverage(se_method, 2000)


def _clustered_coverage(n_reps: int, seed: int = 505) -> tuple[float, float]:
    # Clusters of 4 pairs share a cluster effect, so a pair-level SE would be too small.
    # Population: x = round(u + e_x), y = round(u + e_y) with u = cluster effect + own effect;
    # tau0 is estimated once from a very large sample of pairs from distinct clusters (MC error
    # ~0.002). A sample's tau-b also counts within-cluster pairs (3 of 159 partners, ~2%), a
    # bias far below the per-sample SE ~0.05.
    rng = np.random.default_rng(seed)

    def draw(n_clusters: int):
        g = np.repeat(rng.normal(size=n_clusters), 4)
        own = rng.normal(size=g.shape[0])
        u = 0.8 * g + 0.6 * own
        x = np.clip(np.round(u + 0.7 * rng.normal(size=u.shape[0])), -2, 2)
        y = np.clip(np.round(u + 0.7 * rng.normal(size=u.shape[0])), -2, 2)
        return x, y, np.repeat(np.arange(n_clusters), 4)

    xb, yb, _ = draw(200_000)
    tau0 = kendall_tau_b(xb[::4], yb[::4]).tau  # one pair per cluster: i.i.d. pairs
    hits = hits_naive = 0
    for _ in range(n_reps):
        x, y, g = draw(40)
        lo, hi = kendall_tau_b(x, y, clusters=g).ci
        hits += lo <= tau0 <= hi
        lo_n, hi_n = kendall_tau_b(x, y).ci
        hits_naive += lo_n <= tau0 <= hi_n
    cover, naive = hits / n_reps, hits_naive / n_reps
    logger.info("clustered tau-b CI coverage (%d samples): %.4f, ignoring clusters %.4f", n_reps, cover, naive)
    se = math.sqrt(0.95 * 0.05 / n_reps)
    # clustered: within 0.95 +/- 3 SE (SE = 0.011 at 400); the delete-cluster jackknife with
    # G = 40 clusters and a t(39) quantile is close to nominal.
    assert 0.95 - 3 * se <= cover <= 0.95 + 3 * se, cover
    # the unclustered interval has the same centre and a smaller SE here: it must cover less
    assert naive < cover
    return cover, naive


def test_tau_b_clustered_ci_covers_with_cluster_correlation():
    _clustered_coverage(400)


@pytest.mark.slow
def test_tau_b_clustered_ci_covers_with_cluster_correlation_slow():
    _clustered_coverage(2000)
