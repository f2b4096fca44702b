"""Unit tests of cje_engine.drift.monitor: reference computations, inputs, alarms and state."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from cje_engine.drift import kendall as drift
from cje_engine.drift.inputs import as_scores, scores_from_frame
from cje_engine.drift.kendall import kendall_tau_b, tau_b_influence, tau_b_leave_one_out
from cje_engine.drift.metrics import distribution_change, paired_mean
from cje_engine.drift.monitor import DEFAULT_WEIGHTS, METRICS, DriftMonitor, look_spending
from cje_engine.drift.signflip import BD_CONSTANT, sign_flip_bound_p, sign_flip_interval, sign_flip_p
from cje_engine.errors import CJEInputError
from cje_engine.simulate.drift import (
    DEFAULT_EFFECT,
    Judge,
    drifted_judge,
    fit_calibration,
    make_anchor_set,
    simulate_monitor,
)

# ---------------------------------------------------------------------------------------------
# slow references
# ---------------------------------------------------------------------------------------------


def slow_tau_b(x, y) -> float:
    """O(n^2) textbook tau-b: (C - D) / sqrt((n0 - n1)(n0 - n2))."""
    n = len(x)
    conc = disc = tie_x = tie_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0:
                tie_x += 1
            if dy == 0:
                tie_y += 1
            if dx * dy > 0:
                conc += 1
            elif dx * dy < 0:
                disc += 1
    n0 = n * (n - 1) / 2
    return (conc - disc) / math.sqrt((n0 - tie_x) * (n0 - tie_y))


def slow_jackknife_se(x, y, groups=None) -> float:
    """Delete-one(-group) jackknife SE by recomputing tau-b with scipy each time."""
    if groups is None:
        groups = np.arange(len(x))
    reps = np.array([stats.kendalltau(x[groups != g], y[groups != g]).statistic for g in np.unique(groups)])
    G = reps.shape[0]
    return math.sqrt((G - 1) / G * np.sum((reps - reps.mean()) ** 2))


def slow_influence_se(x, y) -> float:
    """Delta-method SE from per-observation kernel means computed with explicit loops."""
    n = len(x)
    hs, hx, hy = np.zeros(n), np.zeros(n), np.zeros(n)
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            hs[i] += np.sign(x[i] - x[j]) * np.sign(y[i] - y[j])
            hx[i] += x[i] != x[j]
            hy[i] += y[i] != y[j]
    hs, hx, hy = hs / (n - 1), hx / (n - 1), hy / (n - 1)
    Us, Ux, Uy = hs.mean(), hx.mean(), hy.mean()
    tau = Us / math.sqrt(Ux * Uy)
    infl = 2 * ((hs - Us) / math.sqrt(Ux * Uy) - tau / 2 * ((hx - Ux) / Ux + (hy - Uy) / Uy))
    return math.sqrt(np.sum(infl**2)) / n


def tied_pair(n: int, seed: int, levels: int = 5):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, levels, n).astype(float)
    y = np.clip(x + rng.integers(-2, 3, n), 0, levels + 1).astype(float)
    return x, y


# ---------------------------------------------------------------------------------------------
# tau-b
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,seed,levels", [(10, 1, 3), (60, 2, 5), (150, 3, 11), (120, 4, 400)])
def test_tau_b_matches_scipy_and_slow_loop(n, seed, levels):
    x, y = tied_pair(n, seed, levels)
    res = kendall_tau_b(x, y)
    assert res.tau == pytest.approx(stats.kendalltau(x, y).statistic, abs=1e-12)
    assert res.tau == pytest.approx(slow_tau_b(x, y), abs=1e-12)


def test_tau_b_blocked_path_matches_table_path(monkeypatch):
    rng = np.random.default_rng(5)
    x = rng.normal(size=700).round(1)
    y = (x + rng.normal(size=700)).round(1)
    table = kendall_tau_b(x, y)
    monkeypatch.setattr(drift, "_MAX_TABLE_CELLS", 0)
    monkeypatch.setattr(drift, "_BLOCK", 97)  # blocks that do not divide n
    blocked = kendall_tau_b(x, y)
    assert blocked.tau == pytest.approx(table.tau, abs=1e-12)
    assert blocked.se == pytest.approx(table.se, abs=1e-12)
    assert blocked.tau == pytest.approx(stats.kendalltau(x, y).statistic, abs=1e-12)


def test_tau_b_smallest_sample():
    x, y = np.array([1.0, 1.0, 2.0]), np.array([0.0, 1.0, 1.0])
    assert kendall_tau_b(x, y).tau == pytest.approx(slow_tau_b(x, y)) == pytest.approx(0.5)


def test_tau_b_extremes():
    x = np.array([1.0, 2, 2, 3, 4])
    assert kendall_tau_b(x, 2 * x).tau == pytest.approx(1.0)
    assert kendall_tau_b(x, -x).tau == pytest.approx(-1.0)


def test_leave_one_out_matches_recomputation():
    x, y = tied_pair(80, 7)
    tau, loo = tau_b_leave_one_out(x, y)
    ref = np.array([stats.kendalltau(np.delete(x, i), np.delete(y, i)).statistic for i in range(80)])
    assert tau == pytest.approx(stats.kendalltau(x, y).statistic, abs=1e-12)
    np.testing.assert_allclose(loo, ref, atol=1e-12)


def test_leave_one_cluster_out_matches_recomputation():
    x, y = tied_pair(90, 8)
    rng = np.random.default_rng(8)
    groups = np.array([f"p{g:03d}" for g in rng.integers(0, 25, 90)])
    _, loo = tau_b_leave_one_out(x, y, clusters=groups)
    ref = np.array([stats.kendalltau(x[groups != g], y[groups != g]).statistic for g in np.unique(groups)])
    np.testing.assert_allclose(loo, ref, atol=1e-12)


def test_jackknife_se_matches_slow_reference():
    x, y = tied_pair(70, 9)
    assert kendall_tau_b(x, y).se == pytest.approx(slow_jackknife_se(x, y), rel=1e-10)
    groups = np.repeat(np.arange(35), 2)
    res = kendall_tau_b(x, y, clusters=groups)
    assert res.n_clusters == 35
    assert res.se == pytest.approx(slow_jackknife_se(x, y, groups), rel=1e-10)


def test_influence_se_matches_slow_loop_and_jackknife():
    x, y = tied_pair(40, 10)
    res = kendall_tau_b(x, y, se_method="influence")
    assert res.se == pytest.approx(slow_influence_se(x, y), rel=1e-10)
    # Both SEs estimate the same asymptotic variance; jackknife pseudo-values equal the
    # influence values up to O(1/n) terms, so the ratio is 1 + O(1/n). At n = 2000 a 5%
    # tolerance is 100/n, far above that order, yet catches a wrong factor (e.g. 2 or sqrt 2).
    xb, yb = tied_pair(2000, 11)
    jk = kendall_tau_b(xb, yb).se
    inf = kendall_tau_b(xb, yb, se_method="influence").se
    assert inf / jk == pytest.approx(1.0, abs=0.05)


def test_influence_se_equals_classical_ase_for_tables():
    # Non-null asymptotic SE of tau-b for an r x c table (Agresti; SAS PROC FREQ "ASE"):
    # ASE = sqrt(sum n_ij (2 w d_ij + tau v_ij)^2 - n^3 tau^2 (w_r + w_c)^2) / w^2,
    # w_r = n^2 - sum n_i.^2, w_c = n^2 - sum n_.j^2, w = sqrt(w_r w_c), d_ij = concordant minus
    # discordant cell weight, v_ij = n_i. w_c + n_.j w_r.
    x, y = tied_pair(300, 15, levels=4)
    _, cx = np.unique(x, return_inverse=True)
    _, cy = np.unique(y, return_inverse=True)
    T = np.zeros((cx.max() + 1, cy.max() + 1))
    np.add.at(T, (cx, cy), 1)
    n, ni, nj = T.sum(), T.sum(1), T.sum(0)
    wr, wc = n * n - np.sum(ni**2), n * n - np.sum(nj**2)
    w = math.sqrt(wr * wc)
    d = np.zeros_like(T)
    for i in range(T.shape[0]):
        for j in range(T.shape[1]):
            conc = T[:i, :j].sum() + T[i + 1 :, j + 1 :].sum()
            disc = T[:i, j + 1 :].sum() + T[i + 1 :, :j].sum()
            d[i, j] = conc - disc
    tau = np.sum(T * d) / w
    v = ni[:, None] * wc + nj[None, :] * wr
    ase = math.sqrt(np.sum(T * (2 * w * d + tau * v) ** 2) - n**3 * tau**2 * (wr + wc) ** 2) / w**2
    res = kendall_tau_b(x, y, se_method="influence")
    assert res.tau == pytest.approx(tau, abs=1e-12)
    assert res.se == pytest.approx(ase, rel=1e-9)


def test_clustered_influence_se_matches_hand_computation():
    x, y = tied_pair(60, 12)
    groups = np.repeat(np.arange(20), 3)
    _, infl = tau_b_influence(x, y)
    tot = np.bincount(groups, weights=infl)
    expected = math.sqrt(20 / 19 * np.sum(tot**2)) / 60
    assert kendall_tau_b(x, y, se_method="influence", clusters=groups).se == pytest.approx(expected, rel=1e-12)


def test_tau_ci_uses_t_quantile_and_stays_in_range():
    x, y = tied_pair(50, 13)
    res = kendall_tau_b(x, y, alpha=0.1)
    q = stats.t.ppf(0.95, 49)
    assert res.ci[0] == pytest.approx(max(-1, res.tau - q * res.se))
    assert res.ci[1] == pytest.approx(min(1, res.tau + q * res.se))
    perfect = kendall_tau_b(np.arange(10.0), np.arange(10.0))
    assert perfect.ci == (1.0, 1.0) and perfect.se == 0.0
    d = res.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["n"] == 50 and d["se_method"] == "jackknife"


@pytest.mark.parametrize(
    "x,y,kwargs,match",
    [
        ([1, 1, 1, 1], [1, 2, 3, 4], {}, "all x values equal"),
        ([1, 2, 3, 4], [5, 5, 5, 5], {}, "all y values equal"),
        ([1, 2, 3], [1, 2], {}, "same length"),
        ([1, 2], [1, 2], {}, "at least 3"),
        ([1, np.nan, 3], [1, 2, 3], {}, "finite"),
        ([1, 2, 3], [1, 2, 3], {"se_method": "bootstrap"}, "se_method"),
        ([1, 2, 3], [1, 2, 3], {"alpha": 1.5}, "alpha"),
        ([1, 2, 3], [1, 2, 3], {"clusters": [1, 2]}, "one entry per observation"),
        ([[1, 2], [3, 4]], [1, 2], {}, "one-dimensional"),
        (["a", "b", "c"], [1, 2, 3], {}, "numbers"),
    ],
)
def test_tau_b_bad_input(x, y, kwargs, match):
    with pytest.raises(CJEInputError, match=match):
        kendall_tau_b(x, y, **kwargs)


def test_tau_b_error_names_row():
    with pytest.raises(CJEInputError) as err:
        kendall_tau_b([1.0, 2.0, np.inf, 4.0], [1, 2, 3, 4])
    assert err.value.row == 2 and err.value.column == "x"


# ---------------------------------------------------------------------------------------------
# paired mean and distribution change
# ---------------------------------------------------------------------------------------------


def test_paired_mean_plain_and_clustered():
    d = np.array([0.1, -0.2, 0.3, 0.0, 0.4, 0.2])
    mean, se, df = paired_mean(d)
    assert mean == pytest.approx(d.mean()) and df == 5
    assert se == pytest.approx(d.std(ddof=1) / math.sqrt(6))
    codes = np.array([0, 0, 1, 1, 2, 2])
    mean_c, se_c, df_c = paired_mean(d, codes)
    u = np.array([d[:2].sum(), d[2:4].sum(), d[4:].sum()]) - 2 * d.mean()
    assert se_c == pytest.approx(math.sqrt(3 / 2 * np.sum(u**2)) / 6) and df_c == 2


def test_distribution_change_identical_is_null():
    r = np.array([0.1, 0.2, 0.2, 0.5, 0.9])
    dc = distribution_change(r, r.copy())
    assert dc.ks == 0 and dc.tv == 0 and dc.p_value == 1.0 and dc.n_thresholds == 0


def test_distribution_change_exact_sign_test_by_hand():
    # 10 anchors move from 0 to 1, 2 move from 1 to 0, 8 stay: one threshold (v = 0) with
    # m = 12 discordant anchors of which k = 2 have current <= 0.
    ref = np.array([0.0] * 10 + [1.0] * 2 + [0.0] * 4 + [1.0] * 4)
    cur = np.array([1.0] * 10 + [0.0] * 2 + [0.0] * 4 + [1.0] * 4)
    dc = distribution_change(ref, cur)
    expected = 2 * stats.binom.cdf(2, 12, 0.5)
    assert dc.p_value == pytest.approx(expected)
    assert dc.n_thresholds == 1 and dc.worst_threshold == 0.0
    assert dc.ks == pytest.approx(8 / 20)
    assert dc.tv == pytest.approx(0.5 * (8 + 8) / 20)


def test_distribution_change_bonferroni_and_quantile_thresholds():
    rng = np.random.default_rng(14)
    ref = rng.normal(size=300)
    cur = ref + 0.5 + rng.normal(scale=0.1, size=300)
    dc = distribution_change(ref, cur, max_thresholds=10)
    assert 1 <= dc.n_thresholds <= 10
    assert dc.p_value < 1e-6
    F = lambda a, v: np.mean(a <= v)  # noqa: E731
    assert dc.ks >= abs(F(cur, dc.worst_threshold) - F(ref, dc.worst_threshold)) - 1e-12


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def test_scores_from_frame_and_errors():
    frame = pd.DataFrame(
        {"anchor_id": ["a", "b", "c"], "judge_score": [0.1, 0.5, 0.9], "judge_version": "v1", "ts": "2024"}
    )
    s = scores_from_frame(frame)
    assert list(s.index) == ["a", "b", "c"] and s["b"] == 0.5
    with pytest.raises(CJEInputError) as err:
        scores_from_frame(pd.DataFrame({"anchor_id": ["a", "b", "a"], "judge_score": [1, 2, 3]}), source="look.csv")
    assert err.value.row == 2 and err.value.column == "anchor_id" and "look.csv" in str(err.value)
    with pytest.raises(CJEInputError) as err:
        scores_from_frame(pd.DataFrame({"anchor_id": ["a", "b"], "judge_score": [1, "high"]}))
    assert err.value.row == 1 and "'high'" in str(err.value)
    with pytest.raises(CJEInputError) as err:
        scores_from_frame(pd.DataFrame({"anchor_id": ["a", "b"], "judge_score": [1, np.nan]}))
    assert err.value.row == 1 and "finite" in str(err.value)
    with pytest.raises(CJEInputError, match="missing column 'judge_score'"):
        scores_from_frame(pd.DataFrame({"anchor_id": ["a"], "score": [1]}))


def test_as_scores_accepts_mapping_series_frame():
    m = as_scores({1: 0.5, 2: 0.7}, "x")
    assert list(m.index) == ["1", "2"]
    s = as_scores(pd.Series([0.1, 0.2], index=["p", "q"]), "x")
    assert s["q"] == 0.2
    lab = as_scores({"a": 1.0, "b": None}, "labels", value_column="oracle_label", allow_missing=True)
    assert np.isnan(lab["b"])
    with pytest.raises(CJEInputError, match="expected a pandas Series"):
        as_scores([0.1, 0.2], "current_scores")
    with pytest.raises(CJEInputError, match="anchor 'b'"):
        as_scores({"a": 0.1, "b": "x"}, "current_scores")


# ---------------------------------------------------------------------------------------------
# the monitor
# ---------------------------------------------------------------------------------------------


def _world(n=120, seed=0):
    rng = np.random.default_rng(seed)
    anchors = make_anchor_set(n, 0.5, rng=rng)
    judge = Judge()
    calib = fit_calibration(judge, rng=rng)
    ref = judge.score(anchors, rng)
    rep = judge.score(anchors, rng)
    return rng, anchors, judge, calib, ref, rep


def test_look_spending_sums_to_at_most_one():
    total = sum(look_spending(t, None) for t in range(1, 100_001))
    # the tail beyond T is exactly 1 / (T + 1)
    assert total + 1 / 100_001 == pytest.approx(1.0, abs=1e-12)
    assert sum(look_spending(t, 50) for t in range(1, 51)) == pytest.approx(1.0)
    with pytest.raises(CJEInputError, match="past the monitor's horizon"):
        look_spending(51, 50)
    with pytest.raises(CJEInputError, match="look must be"):
        look_spending(0, None)


def test_alpha_spent_over_metrics_and_looks_within_budget():
    mon = DriftMonitor(alpha=0.05, horizon=40)
    total = sum(mon.alpha_spent(t, m) for t in range(1, 41) for m in METRICS)
    assert total == pytest.approx(0.05)
    mon2 = DriftMonitor(alpha=0.05, weights={"mean_shift": 0.7, "tau_b": 0.3})
    assert mon2.alpha_spent(1, "distribution") == 0.0
    assert mon2.alpha_spent(3, "mean_shift") == pytest.approx(0.05 * 0.7 / 12)


def test_update_no_drift_reports_all_metrics():
    rng, anchors, judge, calib, ref, rep = _world()
    mon = DriftMonitor()
    look = mon.update(ref, judge.score(anchors, rng), anchors.labels(), calib.predict, reference_replicate=rep,
                      meta={"judge_version": "v1", "ts": pd.Timestamp("2024-05-01T00:00:00Z")})
    assert set(look.metrics) == set(METRICS)
    assert look.look == 1 and look.n_anchors == 120 and look.n_missing == 0 and look.n_labelled == 60
    for m in METRICS:
        res = look.metrics[m]
        assert res.estimate is not None and res.p_value is not None
        assert res.alpha_spent == pytest.approx(0.05 * DEFAULT_WEIGHTS[m] / 2)
    tau = look.metrics["tau_b"]
    assert tau.detail["comparison"] == "rank_change" and tau.alternative == "less"
    assert tau.estimate == pytest.approx(tau.detail["tau_between"] - tau.detail["tau_within"])
    # look 1, one replicate: between = mean(tau(r, c), tau(r', c)), within = tau(r, r')
    assert tau.detail["tau_within"] == pytest.approx(stats.kendalltau(ref, rep).statistic)
    assert look.warnings and "no clusters given" in look.warnings[0] and look.n_clusters is None
    d = look.to_dict()
    text = json.dumps(d, allow_nan=False)
    assert '"judge_version": "v1"' in text and "2024-05-01 00:00:00+00:00" in text
    json.dumps(mon.to_dict(), allow_nan=False)
    assert d["metrics"]["mean_shift"]["estimate"] == look.metrics["mean_shift"].estimate
    assert d["alarm"] is look.alarm and d["look"] == 1


def test_alarm_iff_anytime_ci_excludes_zero():
    rng, anchors, judge, calib, ref, rep = _world(seed=1)
    mon = DriftMonitor()
    shifted = drifted_judge("shift", judge, anchors.n, 0.2, rng)
    seen_alarm = seen_quiet = False
    for t in range(6):
        j = judge if t % 2 == 0 else shifted
        look = mon.update(ref, j.score(anchors, rng), anchors.labels(), calib.predict, reference_replicate=rep)
        for m in ("tau_b", "mean_shift", "residual_mean", "calibration_loss"):
            res = look.metrics[m]
            lo, hi = res.ci_anytime
            excludes = lo > res.null_value or hi < res.null_value
            if res.method in ("jackknife_t", "sign_flip_gaussian_bound"):
                assert res.alarm == excludes  # the interval is the test inverted
            else:  # an exact sign-flip p-value is at most the bound the interval inverts
                assert res.alarm or not excludes
            assert lo <= res.ci[0] and res.ci[1] <= hi  # the anytime CI is the wider one
            seen_alarm |= res.alarm
            seen_quiet |= not res.alarm
    assert seen_alarm and seen_quiet
    assert mon.first_alarm_["mean_shift"] == 2  # first shifted look; alarms are sticky in first_alarm_
    assert mon.alarmed


def test_uniform_shift_raises_mean_shift_alarm():
    rng, anchors, judge, calib, ref, rep = _world(seed=2)
    mon = DriftMonitor()
    cur = ref + 0.3  # every anchor moves up by 0.3
    look = mon.update(ref, cur)
    ms = look.metrics["mean_shift"]
    assert ms.estimate == pytest.approx(0.3) and ms.se == pytest.approx(0.0, abs=1e-12)
    assert ms.alarm and "mean_shift" in look.alarms and look.alarm
    assert look.metrics["distribution"].alarm


def test_pairing_by_anchor_id_and_missing_anchors():
    rng, anchors, judge, calib, ref, rep = _world(seed=3)
    cur = judge.score(anchors, rng)
    cur_shuffled = cur.sample(frac=1.0, random_state=0).iloc[:-10]  # order must not matter
    cur_shuffled["extra_anchor"] = 0.5
    mon_a, mon_b = DriftMonitor(), DriftMonitor()
    a = mon_a.update(ref, cur_shuffled)
    b = mon_b.update(ref.loc[cur_shuffled.index[:-1]], cur.loc[cur_shuffled.index[:-1]])
    assert a.n_anchors == 110 and a.n_missing == 10
    assert a.metrics["mean_shift"].estimate == pytest.approx(b.metrics["mean_shift"].estimate)
    assert a.metrics["tau_b"].estimate == pytest.approx(b.metrics["tau_b"].estimate)


def test_update_accepts_frames():
    rng, anchors, judge, calib, ref, rep = _world(seed=4)
    cur = judge.score(anchors, rng)
    frame_ref = pd.DataFrame({"anchor_id": ref.index, "judge_score": ref.to_numpy(), "judge_version": "v1"})
    frame_cur = pd.DataFrame({"anchor_id": cur.index, "judge_score": cur.to_numpy(), "judge_version": "v2"})
    labels = pd.DataFrame({"anchor_id": anchors.anchor_ids, "oracle_label": anchors.labels().to_numpy()})
    a = DriftMonitor().update(frame_ref, frame_cur, labels, calib.predict)
    b = DriftMonitor().update(ref, cur, anchors.labels(), calib)  # object with .predict
    for m in METRICS:
        assert a.metrics[m].p_value == b.metrics[m].p_value


def test_tau_modes_floor_and_none():
    rng, anchors, judge, calib, ref, rep = _world(seed=5)
    cur = judge.score(anchors, rng)
    none = DriftMonitor().update(ref, cur).metrics["tau_b"]
    assert none.detail["comparison"] == "none" and not none.alarm and none.p_value is None
    assert none.estimate == pytest.approx(stats.kendalltau(ref.to_numpy(), cur.to_numpy()).statistic)
    floor_high = DriftMonitor(tau_floor=0.99).update(ref, cur).metrics["tau_b"]
    assert floor_high.alarm and floor_high.null_value == 0.99
    floor_ok = DriftMonitor(tau_floor=none.estimate).update(ref, cur).metrics["tau_b"]
    assert not floor_ok.alarm


def test_constant_current_scores_do_not_crash():
    rng, anchors, judge, calib, ref, rep = _world(seed=6)
    cur = pd.Series(1.0, index=ref.index)
    look = DriftMonitor().update(ref, cur, reference_replicate=rep)
    assert look.metrics["tau_b"].estimate is None and "undefined" in look.metrics["tau_b"].note
    assert look.metrics["distribution"].alarm and look.metrics["mean_shift"].alarm


def test_residual_metrics_skip_with_too_few_labels():
    rng, anchors, judge, calib, ref, rep = _world(seed=7)
    labels = anchors.labels()
    labels.iloc[:] = np.nan
    labels.iloc[:5] = 0.5
    look = DriftMonitor(min_labels=10).update(ref, judge.score(anchors, rng), labels, calib.predict)
    for m in ("residual_mean", "calibration_loss"):
        assert look.metrics[m].estimate is None and "only 5 labelled" in look.metrics[m].note
        assert not look.metrics[m].alarm


def test_residual_metrics_by_hand():
    ref = pd.Series(np.linspace(0, 1, 30), index=[f"a{i}" for i in range(30)])
    cur = ref.copy()
    cur.iloc[:10] += 0.1
    labels = pd.Series(np.linspace(0.2, 0.8, 30), index=ref.index)
    f = lambda s: 0.5 * s + 0.25  # noqa: E731
    look = DriftMonitor(min_anchors=10).update(ref, cur, labels, f)
    r_ref = labels.to_numpy() - f(ref.to_numpy())
    r_cur = labels.to_numpy() - f(cur.to_numpy())
    assert look.metrics["residual_mean"].estimate == pytest.approx(np.mean(r_cur - r_ref))
    assert look.metrics["calibration_loss"].estimate == pytest.approx(np.mean(r_cur**2 - r_ref**2))
    assert look.metrics["residual_mean"].detail["mean_residual_current"] == pytest.approx(r_cur.mean())


def test_clustered_update():
    rng, anchors, judge, calib, ref, rep = _world(seed=8)
    clusters = pd.Series([f"p{i // 4}" for i in range(anchors.n)], index=anchors.anchor_ids)
    look = DriftMonitor().update(ref, judge.score(anchors, rng), anchors.labels(), calib.predict,
                                 reference_replicate=rep, clusters=clusters)
    d = look.metrics["mean_shift"]
    assert d.ci[1] - d.ci[0] == pytest.approx(2 * stats.t.ppf(0.975, 29) * d.se)  # df = 30 clusters - 1
    with pytest.raises(CJEInputError, match="no cluster given for anchor"):
        DriftMonitor().update(ref, judge.score(anchors, rng), clusters=clusters.iloc[1:])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"alpha": 0}, "alpha"),
        ({"horizon": 0}, "horizon"),
        ({"weights": {"bogus": 0.5}}, "unknown metric"),
        ({"weights": {"tau_b": 0.8, "mean_shift": 0.8}}, "sum to <= 1"),
        ({"weights": {"tau_b": -0.1}}, ">= 0"),
        ({"se_method": "x"}, "se_method"),
        ({"min_anchors": 2}, "min_anchors"),
        ({"min_labels": 1}, "min_labels"),
        ({"tau_floor": 2.0}, "tau_floor"),
        ({"max_thresholds": 0}, "max_thresholds"),
    ],
)
def test_monitor_config_errors(kwargs, match):
    with pytest.raises(CJEInputError, match=match):
        DriftMonitor(**kwargs)


def test_update_input_errors():
    rng, anchors, judge, calib, ref, rep = _world(seed=9)
    cur = judge.score(anchors, rng)
    mon = DriftMonitor()
    with pytest.raises(CJEInputError, match="only 10 of 120 reference anchors") as err:
        mon.update(ref, cur.iloc[:10])
    assert err.value.source == "current_scores"
    with pytest.raises(CJEInputError, match="without a calibrate"):
        mon.update(ref, cur, anchors.labels())
    with pytest.raises(CJEInputError, match="returned 1 values"):
        mon.update(ref, cur, anchors.labels(), lambda s: np.array([0.5]))
    with pytest.raises(CJEInputError, match="non-finite") as err:
        mon.update(ref, cur, anchors.labels(), lambda s: np.where(s > 0.5, np.nan, s))
    assert err.value.column == "calibrate"
    with pytest.raises(CJEInputError, match="must be a callable"):
        mon.update(ref, cur, anchors.labels(), "isotonic")
    with pytest.raises(CJEInputError, match="have no replicate score") as err:
        mon.update(ref, cur, reference_replicate=rep.iloc[:5])
    assert err.value.source == "reference_replicate"
    bad = cur.copy()
    bad.iloc[3] = np.inf
    with pytest.raises(CJEInputError) as err:
        mon.update(ref, bad)
    assert err.value.row == 3 and err.value.source == "current_scores"
    assert mon.n_looks_ == 0  # failed looks spend nothing


def test_horizon_refuses_extra_look():
    rng, anchors, judge, calib, ref, rep = _world(seed=10)
    mon = DriftMonitor(horizon=2)
    mon.update(ref, judge.score(anchors, rng))
    mon.update(ref, judge.score(anchors, rng))
    with pytest.raises(CJEInputError, match="horizon of 2 looks"):
        mon.update(ref, judge.score(anchors, rng))


def test_state_round_trip_continues_identically():
    rng, anchors, judge, calib, ref, rep = _world(seed=11)
    shifted = drifted_judge("shift", judge, anchors.n, 0.15, rng)
    looks = [(judge if t < 3 else shifted).score(anchors, rng) for t in range(6)]
    straight = DriftMonitor(alpha=0.1, weights={"mean_shift": 0.5, "distribution": 0.5})
    out_a = [straight.update(ref, c, anchors.labels(), calib.predict) for c in looks]
    mon = DriftMonitor(alpha=0.1, weights={"mean_shift": 0.5, "distribution": 0.5})
    out_b = []
    for c in looks:  # a scheduled flow: load state, one look, save state as JSON
        out_b.append(mon.update(ref, c, anchors.labels(), calib.predict))
        mon = DriftMonitor.from_dict(json.loads(json.dumps(mon.to_dict(), allow_nan=False)))
    for a, b in zip(out_a, out_b):
        assert a.to_dict() == b.to_dict()
    assert mon.n_looks_ == 6 and mon.first_alarm_ == straight.first_alarm_
    assert mon.get_config() == straight.get_config()
    assert len(mon.history_) == 6 and mon.history_[-1]["look"] == 6
    assert any(v is not None for v in mon.first_alarm_.values())


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda s: s.pop("config"), "lacks key 'config'"),
        (lambda s: s.update(state_version=99), "version 99"),
        (lambda s: s.update(n_looks=-1), "non-negative"),
        (lambda s: s["config"].update(bogus=1), "bad monitor config"),
        (lambda s: s["first_alarm"].pop("tau_b"), "first_alarm must have keys"),
        (lambda s: s["config"].update(alpha=3), "alpha"),
    ],
)
def test_from_dict_errors(mutate, match):
    state = DriftMonitor().to_dict()
    mutate(state)
    with pytest.raises(CJEInputError, match=match):
        DriftMonitor.from_dict(state)
    with pytest.raises(CJEInputError, match="must be a mapping"):
        DriftMonitor.from_dict([1, 2])


# ---------------------------------------------------------------------------------------------
# simulator
# ---------------------------------------------------------------------------------------------


def test_simulated_judges_have_the_stated_effects():
    rng = np.random.default_rng(12)
    n = 20_000
    q, v = rng.standard_normal(n), rng.standard_normal(n)
    ref = Judge()
    base = ref.score_traits(q, v, rng)
    assert len(np.unique(base)) == 11  # discrete 0, 0.1, ..., 1
    # shift: scores move up by about the effect (less at the top because of clipping)
    shifted = drifted_judge("shift", ref, n, 0.1, rng).score_traits(q, v, rng)
    assert 0.07 < shifted.mean() - base.mean() <= 0.1
    # remap: same marginal distribution (KS two-sample test at n = 20000 would see a 0.02 gap),
    # lower agreement with the oracle-driving quality trait
    remap = drifted_judge("remap", ref, n, 45.0, rng)
    rs = remap.score_traits(q, v, rng)
    assert stats.ks_2samp(base, rs).statistic < 0.02
    assert stats.kendalltau(rs, q).statistic < stats.kendalltau(base, q).statistic - 0.1
    # reorder: a permutation of half of the anchors, same marginal
    ro = drifted_judge("reorder", ref, n, 0.5, rng)
    moved = ro.order != np.arange(n)
    assert moved.mean() == pytest.approx(0.5, abs=1e-3)
    assert np.array_equal(np.sort(ro.order), np.arange(n))
    assert stats.ks_2samp(base, ro.score_traits(q, v, rng)).statistic < 0.02
    assert drifted_judge("none", ref, n, None, rng) is ref
    assert DEFAULT_EFFECT["shift"] == 0.1


def test_simulator_errors():
    rng = np.random.default_rng(0)
    with pytest.raises(CJEInputError, match="unknown scenario"):
        drifted_judge("explode", Judge(), 10, None, rng)
    with pytest.raises(CJEInputError, match="share of anchors"):
        drifted_judge("reorder", Judge(), 10, 2.0, rng)
    with pytest.raises(CJEInputError, match="n_anchors"):
        make_anchor_set(2, rng=rng)
    with pytest.raises(CJEInputError, match="label_fraction"):
        make_anchor_set(10, 1.5, rng=rng)
    with pytest.raises(CJEInputError, match="n_looks"):
        simulate_monitor(n_looks=0)


def test_simulate_monitor_is_seeded_and_stops_at_alarm():
    a = simulate_monitor("shift", effect=0.3, n_looks=5, seed=3, stop_at_first_alarm=True)
    b = simulate_monitor("shift", effect=0.3, n_looks=5, seed=3, stop_at_first_alarm=True)
    np.testing.assert_array_equal(a.p_values, b.p_values)
    assert a.first_alarm_look == 1 and a.n_looks_run == 1
    none = simulate_monitor("none", n_looks=3, seed=3)
    assert none.n_looks_run == 3 and none.p_values.shape == (3, len(METRICS))


# ---------------------------------------------------------------------------------------------
# issue 17: exact tests with few clusters, degenerate looks, ids, clusters, the rank metric
# ---------------------------------------------------------------------------------------------


def brute_sign_flip(s: np.ndarray) -> float:
    """P(|sum eps s| >= |sum s|) by listing all sign vectors."""
    import itertools

    obs = abs(s.sum())
    sums = [abs(np.dot(e, s)) for e in itertools.product((-1, 1), repeat=s.shape[0])]
    return float(np.mean(np.array(sums) >= obs - 1e-9))


def test_sign_flip_p_matches_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(20):
        k = int(rng.integers(1, 13))
        s = rng.integers(-6, 7, k).astype(float) * 0.1  # a lattice of step 0.1
        p, method = sign_flip_p(s)
        assert p == pytest.approx(brute_sign_flip(s), abs=1e-12), (s, method)
        s2 = rng.normal(size=k)  # no lattice: enumeration
        p2, method2 = sign_flip_p(s2)
        assert method2 == "exact" and p2 == pytest.approx(brute_sign_flip(s2), abs=1e-12)
    # many clusters, lattice: the convolution agrees with the binomial sign test for +-1 values
    s = np.array([1.0] * 30 + [-1.0] * 10)
    p, method = sign_flip_p(s)
    assert method == "lattice" and p == pytest.approx(stats.binomtest(30, 40).pvalue, rel=1e-9)


def test_sign_flip_bound_is_valid_and_not_far_from_exact():
    # the Bentkus-Dzindzalieta bound is >= the exact tail (it is a bound), within its constant
    rng = np.random.default_rng(4)
    for _ in range(10):
        s = rng.integers(-5, 6, 40).astype(float) + 0.5
        exact, _ = sign_flip_p(s)
        bound = sign_flip_bound_p(s)
        assert bound >= exact - 1e-12
        assert bound <= max(exact * 2 * BD_CONSTANT * 2, 1e-300) or bound == 1.0
    lo, hi = sign_flip_interval(rng.normal(0.5, 1, 200), None, 0.01)
    assert lo < 0.5 < hi and hi - lo < 1.0


def test_degenerate_looks_do_not_alarm():
    # 5 anchors all shifted +5: the sign-flip p-value is 2/32 = 1/16, no alarm at any budget < 1/16
    ref = pd.Series([60.0, 70, 80, 90, 50], index=list("abcde"))
    mon = DriftMonitor(min_anchors=5)
    look = mon.update(ref, ref + 5)
    ms = look.metrics["mean_shift"]
    assert ms.p_value == pytest.approx(1 / 16) and ms.se == 0 and not ms.alarm
    assert not look.alarm and look.metrics["distribution"].p_value > 0.05
    # 24 anchors in 2 clusters all shifted +5: p = 2/4 = 0.5 (the SE-0 alarm)
    ref24 = pd.Series(np.tile([50.0, 60, 70, 80, 90, 100], 4), index=[f"x{i}" for i in range(24)])
    cl = pd.Series(["p1"] * 12 + ["p2"] * 12, index=ref24.index)
    look = DriftMonitor().update(ref24, ref24 - 5, clusters=cl)
    assert look.metrics["mean_shift"].p_value == pytest.approx(0.5)
    assert look.metrics["distribution"].p_value >= 0.5 and not look.alarm
    assert look.n_clusters == 2 and look.warnings == []


def test_rank_metric_with_few_clusters_uses_a_permutation_test():
    rng = np.random.default_rng(5)
    q = rng.normal(size=24)
    score = lambda: pd.Series(np.round(q + rng.normal(0, 0.5, 24), 1), index=[f"x{i}" for i in range(24)])  # noqa: E731
    cl = pd.Series([f"p{i // 6}" for i in range(24)], index=[f"x{i}" for i in range(24)])
    look = DriftMonitor().update(score(), score(), reference_replicate=score(), clusters=cl)
    tau = look.metrics["tau_b"]
    assert tau.method == "permutation_999" and 1 / 1000 <= tau.p_value <= 1 and not tau.alarm


def test_rank_metric_matches_its_definition_and_window():
    rng, anchors, judge, calib, ref, rep = _world(seed=6)
    mon = DriftMonitor(rank_window=3)
    cur = [judge.score(anchors, rng) for _ in range(3)]
    for c in cur:
        look = mon.update(ref, c, reference_replicate=rep)
    d = look.metrics["tau_b"].detail
    kt = lambda a, b: stats.kendalltau(a, b).statistic  # noqa: E731
    # window 3: between = mean over {ref, rep} x {c1, c2, c3}; within = (ref, rep) and the 3 look pairs
    between = np.mean([kt(b, c) for b in (ref, rep) for c in cur])
    within = np.mean([kt(ref, rep), kt(cur[0], cur[1]), kt(cur[0], cur[2]), kt(cur[1], cur[2])])
    if d["window"] == 3:
        assert d["tau_between"] == pytest.approx(between) and d["tau_within"] == pytest.approx(within)
    assert set(d["p_by_window"]) == {"1", "3"}
    assert d["tau"] == pytest.approx(kt(ref, cur[-1]))
    # the stored window survives a state round trip
    again = DriftMonitor.from_dict(json.loads(json.dumps(mon.to_dict())))
    assert again.recent_ == mon.recent_ and len(again.recent_) == 2


def test_mixed_int_and_str_anchor_ids_are_duplicates():
    with pytest.raises(CJEInputError, match="appears more than once") as err:
        as_scores({1: 0.5, "1": 0.7, 2: 0.1}, "current_scores")
    assert err.value.column == "anchor_id"
    s = as_scores({1: 0.5, 2: 0.7}, "x")
    assert list(s.index) == ["1", "2"]
    with pytest.raises(CJEInputError, match="appears more than once"):
        scores_from_frame(pd.DataFrame({"anchor_id": [1, "1"], "judge_score": [0.1, 0.2]}))
    # ints and strings pair up across inputs
    ref = pd.Series(np.linspace(0, 1, 30), index=range(30))
    cur = pd.Series(np.linspace(0, 1, 30), index=[str(i) for i in range(30)])
    assert DriftMonitor().update(ref, cur).n_anchors == 30


def test_clusters_with_duplicate_or_missing_anchors_are_refused():
    rng, anchors, judge, calib, ref, rep = _world(seed=7)
    cur = judge.score(anchors, rng)
    with pytest.raises(CJEInputError, match="no cluster given"):
        DriftMonitor().update(ref, cur, clusters=pd.Series(["p"] * 5, index=ref.index[:5]))
    ids = list(ref.index)
    bad = pd.Series(["p"] * (len(ids) + 1), index=ids + [ids[0]])
    with pytest.raises(CJEInputError, match="appears more than once"):
        DriftMonitor().update(ref, cur, clusters=bad)


def test_distribution_test_with_clusters_is_exact_sign_flip():
    rng = np.random.default_rng(8)
    r = rng.integers(0, 5, 40).astype(float)
    c = np.clip(r + rng.integers(-1, 2, 40), 0, 4)
    codes = np.repeat(np.arange(10), 4)
    dc = distribution_change(r, c, clusters=codes)
    # reference: per threshold, brute-force sign flips of the cluster sums; Bonferroni over them
    ps = []
    for v in np.unique(np.concatenate([r, c]))[:-1]:
        z = (c <= v).astype(float) - (r <= v)
        zg = np.bincount(codes, weights=z)
        if np.any(zg != 0):
            ps.append(brute_sign_flip(zg))
    assert dc.p_value == pytest.approx(min(1.0, len(ps) * min(ps)), abs=1e-12)
    assert dc.method.startswith("sign_flip")


def test_version_1_state_reads_with_its_options():
    mon = DriftMonitor()
    state = mon.to_dict()
    state["state_version"] = 1
    del state["recent"]
    del state["config"]["rank_window"]
    state["config"]["weights"] = {m: 0.2 for m in METRICS}
    old = DriftMonitor.from_dict(state)
    assert old.rank_window == 1 and old.weights["tau_b"] == 0.2 and old.recent_ == []
    state["state_version"] = 9
    with pytest.raises(CJEInputError, match="not supported"):
        DriftMonitor.from_dict(state)
