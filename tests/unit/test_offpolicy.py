"""Unit tests of the off-policy core: log-space weights, estimators vs slow loop references,
SIMCal, the exact projections and QP, diagnostics, gates, the bootstrap wrapper and the simulator."""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np
import pytest
from scipy.optimize import minimize
from sklearn.isotonic import IsotonicRegression

from cje_engine.data.frame import fold_of
from cje_engine.errors import CJEInputError
from cje_engine.offpolicy.bootstrap import bootstrap_target
from cje_engine.offpolicy.diagnostics import cle_floor, judge_score_affinity, target_typical_coverage
from cje_engine.offpolicy.estimators import (
    estimate_direct,
    estimate_dr,
    estimate_ips,
    estimate_snips,
    estimate_weighted,
    stack_estimates,
)
from cje_engine.offpolicy.gates import OffPolicyGates, gate_verdicts
from cje_engine.offpolicy.inputs import FreshData, LoggedData, Rewards
from cje_engine.offpolicy.target import OffPolicyConfig, evaluate_target
from cje_engine.simulate.logs import oracle_curve, population_value, simulate_logs
from cje_engine.offpolicy.weights import (
    SIMCal,
    ess_fraction,
    hill_tail_index,
    isotonic_fit,
    isotonic_predict,
    log_importance_weights,
    mean_one_weights,
    max_weight_share,
    project_monotone_mean_one,
    solve_simplex_qp,
)


def _small(seed: int = 0, n: int = 60, n_prompts: int = 25):
    rng = np.random.default_rng(seed)
    lp0 = -rng.uniform(1, 20, n)
    lp1 = lp0 + rng.normal(0, 0.7, n)
    lp1 = np.minimum(lp1, 0.0)
    pids = np.array([f"p{rng.integers(n_prompts)}" for _ in range(n)])
    R = rng.uniform(0, 1, n)
    S = np.round(rng.uniform(0, 1, n), 1)
    return lp0, lp1, pids, R, S


def _ref_cluster_se(phi_over_n: list[float], pids) -> float:
    sums: dict[str, float] = defaultdict(float)
    for p, v in zip(pids, phi_over_n):
        sums[p] += v
    g = len(sums)
    return math.sqrt(g / (g - 1) * sum(v * v for v in sums.values()))


# ------------------------------------------------------------------------------------------
# log-space weights
# ------------------------------------------------------------------------------------------


def test_log_weights_match_naive_exp_where_representable():
    lp0, lp1, *_ = _small()
    log_w = log_importance_weights(lp0, lp1)
    naive = np.array([math.exp(b - a) for a, b in zip(lp0, lp1)])
    np.testing.assert_allclose(np.exp(log_w), naive, rtol=1e-12)
    np.testing.assert_allclose(mean_one_weights(log_w), naive / naive.mean(), rtol=1e-12)


def test_weights_spanning_130_orders_of_magnitude_stay_finite():
    rng = np.random.default_rng(1)
    lp0 = -rng.uniform(100, 600, 500)
    lp1 = lp0 + rng.uniform(-150, 150, 500)   # log w spans 300 nats = 130 orders of magnitude
    lp1 = np.minimum(lp1, 0.0)
    log_w = log_importance_weights(lp0, lp1)
    assert (log_w.max() - log_w.min()) / math.log(10) > 125
    with np.errstate(over="ignore"):
        naive = np.exp(log_w)
    assert not np.all(np.isfinite(naive)) or naive.max() > 1e60  # the naive route is useless here
    W = mean_one_weights(log_w)
    assert np.all(np.isfinite(W))
    assert W.mean() == pytest.approx(1.0, rel=1e-12)
    # the largest weight dominates: its share equals exp(max) / sum exp computed in log space
    assert max_weight_share(W) == pytest.approx(1.0 / np.sum(np.exp(log_w - log_w.max())), rel=1e-12)
    assert 0 < ess_fraction(W) <= 1


@pytest.mark.parametrize(
    "lp0, lp1, column, row, what",
    [
        ([-1.0, np.nan, -2.0], [-1.0, -1.0, -1.0], "base_policy_logprob", 1, "NaN"),
        ([-1.0, -1.0, -2.0], [-1.0, np.nan, -1.0], "target_policy_logprob", 1, "NaN"),
        ([-1.0, -1.0, np.inf], [-1.0, -1.0, -1.0], "base_policy_logprob", 2, "+inf"),
        ([-1.0, -1.0, -1.0], [np.inf, -1.0, -1.0], "target_policy_logprob", 0, "+inf"),
        ([-1.0, -np.inf, -1.0], [-1.0, -1.0, -1.0], "base_policy_logprob", 1, "-inf"),
        ([-1.0, 0.5, -1.0], [-1.0, -1.0, -1.0], "base_policy_logprob", 1, "positive"),
        ([-1.0, -1.0, -1.0], [-1.0, -1.0, 2.0], "target_policy_logprob", 2, "positive"),
    ],
)
def test_bad_log_probabilities_are_named(lp0, lp1, column, row, what):
    with pytest.raises(CJEInputError) as exc:
        log_importance_weights(lp0, lp1, source="logs.jsonl")
    assert exc.value.column == column and exc.value.row == row and exc.value.source == "logs.jsonl"
    assert what in str(exc.value)


def test_length_mismatch_empty_and_all_zero_weights():
    with pytest.raises(CJEInputError, match="length mismatch"):
        log_importance_weights([-1.0, -2.0], [-1.0])
    with pytest.raises(CJEInputError, match="no logged responses"):
        log_importance_weights([], [])
    with pytest.raises(CJEInputError, match="all importance weights are zero"):
        log_importance_weights([-1.0, -2.0], [-np.inf, -np.inf])
    # a single zero weight is legitimate (the target can never write that response)
    lw = log_importance_weights([-1.0, -2.0], [-np.inf, -2.0])
    assert mean_one_weights(lw).tolist() == [0.0, 2.0]


def test_rounding_noise_above_zero_is_tolerated():
    lw = log_importance_weights([1e-9, -1.0], [-1.0, 1e-8])
    np.testing.assert_allclose(lw, [-1.0, 1.0])


def test_logged_and_fresh_data_validation():
    lp0, lp1, pids, R, S = _small()
    with pytest.raises(CJEInputError) as exc:
        LoggedData(pids, S[:-1], lp0, lp1)
    assert exc.value.column == "judge_score"
    bad = S.copy()
    bad[3] = np.nan
    with pytest.raises(CJEInputError) as exc:
        LoggedData(pids, bad, lp0, lp1)
    assert exc.value.row == 3
    pid_bad = pids.copy()
    pid_bad[5] = ""
    with pytest.raises(CJEInputError, match="prompt id") as exc:
        LoggedData(pid_bad, S, lp0, lp1)
    assert exc.value.row == 5
    with pytest.raises(CJEInputError, match="length must be positive"):
        LoggedData(pids, S, lp0, lp1, lengths=np.zeros_like(S))
    with pytest.raises(CJEInputError, match="no fresh draws"):
        FreshData(np.array([], dtype=str), np.array([]))
    with pytest.raises(CJEInputError, match="positive"):
        FreshData(np.array(["a"]), np.array([0.5]), target_logprob=np.array([0.3]))


def test_rewards_validation():
    lp0, lp1, pids, R, S = _small()
    logged = LoggedData(pids, S, lp0, lp1)
    with pytest.raises(CJEInputError, match="one per row"):
        evaluate_target(logged, Rewards(R[:-1]))
    with pytest.raises(CJEInputError, match="both q_logged and q_fresh"):
        Rewards(R, R[:5], q_logged=R).checked(len(R), 5)
    with pytest.raises(CJEInputError, match="no calibrated rewards"):
        Rewards(R).checked(len(R), 5)
    with pytest.raises(CJEInputError, match="no fresh draws"):
        Rewards(R, R[:5]).checked(len(R), None)


# ------------------------------------------------------------------------------------------
# estimators vs slow loop references
# ------------------------------------------------------------------------------------------


def test_ips_and_snips_match_loop_reference():
    lp0, lp1, pids, R, S = _small(2)
    log_w = log_importance_weights(lp0, lp1)
    w = [math.exp(b - a) for a, b in zip(lp0, lp1)]
    n = len(w)
    ips_ref = sum(wi * ri for wi, ri in zip(w, R)) / n
    ips_se = _ref_cluster_se([(wi * ri - ips_ref) / n for wi, ri in zip(w, R)], pids)
    est = estimate_ips(log_w, R, pids)
    assert est.value == pytest.approx(ips_ref, rel=1e-10)
    assert est.se == pytest.approx(ips_se, rel=1e-8)
    sw = sum(w)
    snips_ref = sum(wi * ri for wi, ri in zip(w, R)) / sw
    snips_se = _ref_cluster_se([wi * (ri - snips_ref) / sw for wi, ri in zip(w, R)], pids)
    est = estimate_snips(mean_one_weights(log_w), R, pids)
    assert est.value == pytest.approx(snips_ref, rel=1e-10)
    assert est.se == pytest.approx(snips_se, rel=1e-8)
    lo, hi = est.ci(0.95)
    assert lo == pytest.approx(snips_ref - 1.959963984540054 * snips_se, rel=1e-9)
    assert hi > est.value > lo


def test_ips_overflow_is_reported_not_hidden():
    lp0 = np.full(10, -800.0)
    lp1 = np.zeros(10)
    lp1[1:] = -800.0
    est = estimate_ips(log_importance_weights(lp0, lp1), np.ones(10), np.arange(10).astype(str))
    assert est.value == np.inf  # mean raw weight is exp(797): not representable


def test_dr_and_direct_match_loop_reference():
    lp0, lp1, pids, R, S = _small(3)
    rng = np.random.default_rng(3)
    q = np.clip(R + rng.normal(0, 0.1, R.shape[0]), 0, 1)
    fp = np.array([f"p{rng.integers(25)}" for _ in range(40)])
    qf = rng.uniform(0, 1, 40)
    W = mean_one_weights(log_importance_weights(lp0, lp1))
    n, m = len(W), len(qf)
    corr = sum(W[i] * (R[i] - q[i]) for i in range(n)) / n
    base = sum(qf) / m
    est = estimate_dr(W, W, R, q, qf, pids, fp)
    assert est.value == pytest.approx(base + corr, rel=1e-12)
    contrib = [W[i] * (R[i] - q[i] - corr) / n for i in range(n)] + [(qf[j] - base) / m for j in range(m)]
    assert est.se == pytest.approx(_ref_cluster_se(contrib, list(pids) + list(fp)), rel=1e-8)
    d = estimate_direct(qf, fp)
    assert d.value == pytest.approx(base)
    assert d.se == pytest.approx(_ref_cluster_se([(v - base) / m for v in qf], fp), rel=1e-8)


def test_weighted_estimator_uses_influence_weights_for_se():
    lp0, lp1, pids, R, S = _small(4)
    W = mean_one_weights(log_importance_weights(lp0, lp1))
    a = estimate_weighted("x", W, W, R, pids)
    b = estimate_weighted("x", W, 2 * W, R, pids)
    assert a.value == b.value
    assert b.se > a.se


# ------------------------------------------------------------------------------------------
# isotonic helpers, exact projection, simplex QP
# ------------------------------------------------------------------------------------------


def test_isotonic_fit_matches_sklearn_with_ties():
    rng = np.random.default_rng(5)
    s = np.round(rng.uniform(0, 1, 200), 1)
    y = s + rng.normal(0, 0.3, 200)
    for inc in (True, False):
        knots, vals = isotonic_fit(s, y, increasing=inc)
        ref = IsotonicRegression(increasing=inc).fit(s, y).predict(knots)
        np.testing.assert_allclose(vals, ref, atol=1e-10)
        assert np.sum(vals[np.searchsorted(knots, s)]) == pytest.approx(np.sum(y))  # mean preserving
    knots, vals = isotonic_fit(s, y)
    assert isotonic_predict(knots, vals, np.array([-5.0]))[0] == vals[0]  # flat outside range


def _slsqp_projection(s, u, increasing):
    order = np.argsort(s, kind="stable")
    cons = [{"type": "eq", "fun": lambda v: v.mean() - 1.0}]
    for a, b in zip(order[:-1], order[1:]):
        if s[a] == s[b]:
            cons.append({"type": "eq", "fun": lambda v, a=a, b=b: v[b] - v[a]})
        elif increasing:
            cons.append({"type": "ineq", "fun": lambda v, a=a, b=b: v[b] - v[a]})
        else:
            cons.append({"type": "ineq", "fun": lambda v, a=a, b=b: v[a] - v[b]})
    res = minimize(lambda v: np.sum((v - u) ** 2), np.ones_like(u), constraints=cons,
                   bounds=[(0, None)] * len(u), method="SLSQP", options={"ftol": 1e-12, "maxiter": 500})
    return res.x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_one_projection_is_the_exact_projection(seed):
    rng = np.random.default_rng(seed)
    s = np.round(rng.uniform(0, 1, 12), 1)
    u = rng.lognormal(0, 1.5, 12) - 0.8  # some negative entries force the v >= 0 constraint
    for inc in (True, False):
        v = project_monotone_mean_one(s, u, increasing=inc)
        assert v.mean() == pytest.approx(1.0, abs=1e-12)
        assert np.all(v >= 0)
        order = np.argsort(s, kind="stable")
        diffs = np.diff(v[order])
        assert np.all(diffs >= -1e-12) if inc else np.all(diffs <= 1e-12)
        ref = _slsqp_projection(s, u, inc)
        assert np.sum((v - u) ** 2) <= np.sum((ref - u) ** 2) + 1e-7


def test_projection_cannot_increase_variance():
    rng = np.random.default_rng(7)
    for _ in range(20):
        s = rng.uniform(0, 1, 50)
        u = rng.lognormal(0, 1, 50)
        u /= u.mean()
        v = project_monotone_mean_one(s, u, increasing=bool(rng.integers(2)))
        assert np.var(v) <= np.var(u) + 1e-12


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_simplex_qp_matches_slsqp_and_vertices(k):
    rng = np.random.default_rng(k)
    for _ in range(5):
        A = rng.normal(size=(30, k))
        sigma = A.T @ A / 30
        b = solve_simplex_qp(sigma)
        assert np.all(b >= 0) and b.sum() == pytest.approx(1.0)
        val = b @ sigma @ b
        assert val <= np.min(np.diag(sigma)) + 1e-12  # never worse than the best single candidate
        res = minimize(lambda x: x @ sigma @ x, np.ones(k) / k, method="SLSQP", bounds=[(0, 1)] * k,
                       constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1}], options={"ftol": 1e-14})
        assert val <= res.fun + 1e-9


def test_simplex_qp_singular_and_bad_input():
    sigma = np.array([[1.0, 1.0], [1.0, 1.0]])  # perfectly correlated: any point is optimal
    b = solve_simplex_qp(sigma)
    assert b.sum() == pytest.approx(1.0) and b @ sigma @ b == pytest.approx(1.0)
    with pytest.raises(CJEInputError):
        solve_simplex_qp(np.zeros((0, 0)))
    with pytest.raises(CJEInputError):
        solve_simplex_qp(np.array([[np.nan]]))


# ------------------------------------------------------------------------------------------
# SIMCal
# ------------------------------------------------------------------------------------------


def _sim_weights(seed=0, n=600, spread=1.0):
    rng = np.random.default_rng(seed)
    s = np.round(rng.uniform(0, 1, n), 2)
    log_w = 4.0 * (s - 0.5) + rng.normal(0, spread, n)  # log-normal noise around a trend in S
    pids = np.array([f"q{i // 2}" for i in range(n)])
    R = oracle_curve(s)
    return log_w, s, pids, R


@pytest.mark.parametrize("rho", [0.2, 1.0, 5.0])
def test_simcal_mean_one_and_variance_cap(rho):
    log_w, s, pids, R = _sim_weights(spread=2.5)  # heavy tails: the cap binds
    cal = SIMCal(rho=rho).fit(log_w, s, pids, y=R)
    assert cal.weights_.mean() == pytest.approx(1.0, abs=1e-12)
    assert np.var(cal.weights_) <= rho + 1e-12
    assert np.all(cal.weights_ >= 0)
    assert cal.alpha_ == pytest.approx(min(1.0, rho / cal.var_stack_))
    assert cal.projection_.startswith("exact-")
    assert cal.ess_after_ >= cal.ess_before_
    assert cal.stack_coef_.sum() == pytest.approx(1.0) and np.all(cal.stack_coef_ >= 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simcal_stacking_follows_the_trend(seed):
    log_w, s, pids, R = _sim_weights(seed)
    up = SIMCal().fit(log_w, s, pids, y=R)
    down = SIMCal().fit(-log_w, s, pids, y=R)
    # the weights grow with S: the increasing candidate wins the out-of-fold stacking (and the
    # decreasing one when the trend is reversed)
    assert up.stack_coef_[up.candidate_names_.index("increasing")] > 0.5
    assert down.stack_coef_[down.candidate_names_.index("decreasing")] > 0.5
    assert up.projection_ == "exact-increasing" and down.projection_ == "exact-decreasing"


def test_simcal_candidates_are_out_of_fold_by_prompt():
    log_w, s, pids, R = _sim_weights(1)
    folds = fold_of(pids, 5)
    a = SIMCal().fit(log_w, s, pids, y=R)
    changed = log_w.copy()
    changed[folds == 2] += np.random.default_rng(0).normal(0, 3, (folds == 2).sum())
    b = SIMCal().fit(changed, s, pids, y=R)
    # fold-2 rows' candidates come from models that never saw fold 2 ... up to the global
    # mean-one normalisation of W, which changes with every weight
    ratio = b.candidates_oof_[folds == 2] / a.candidates_oof_[folds == 2]
    np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-10)
    assert not np.allclose(b.candidates_oof_[folds != 2], a.candidates_oof_[folds != 2])


def test_simcal_rescale_option_is_reported():
    log_w, s, pids, R = _sim_weights(2)
    cal = SIMCal(rho=0.5, projection="rescale").fit(log_w, s, pids, y=R)
    assert cal.projection_ == "rescale"
    assert cal.weights_.mean() == pytest.approx(1.0)


def test_simcal_is_deterministic_and_validates():
    log_w, s, pids, R = _sim_weights(3)
    a = SIMCal().fit(log_w, s, pids, y=R)
    b = SIMCal().fit(log_w, s, pids, y=R)
    np.testing.assert_array_equal(a.weights_, b.weights_)
    with pytest.raises(CJEInputError, match="rho"):
        SIMCal(rho=0).fit(log_w, s, pids)
    with pytest.raises(CJEInputError, match="at least one candidate"):
        SIMCal(directions=()).fit(log_w, s, pids)
    with pytest.raises(CJEInputError, match="direction"):
        SIMCal(directions=("sideways",)).fit(log_w, s, pids)
    with pytest.raises(CJEInputError, match="projection"):
        SIMCal(projection="magic").fit(log_w, s, pids)
    with pytest.raises(CJEInputError, match="length mismatch"):
        SIMCal().fit(log_w, s[:-1], pids)
    bad = s.copy()
    bad[4] = np.inf
    with pytest.raises(CJEInputError) as exc:
        SIMCal().fit(log_w, bad, pids)
    assert exc.value.row == 4


def test_simcal_variance_stacking_prefers_flat_weights():
    """Why MSE is the default: variance-only stacking picks the nearly flat wrong-direction fit."""
    log_w, s, pids, R = _sim_weights(4)
    mse = SIMCal(stack_by="mse").fit(log_w, s, pids, y=R)
    var = SIMCal(stack_by="if_variance").fit(log_w, s, pids, y=R)
    assert np.var(var.stacked_weights_) < np.var(mse.stacked_weights_)
    snips = np.mean(mean_one_weights(log_w) * R)
    assert abs(np.mean(mse.weights_ * R) - snips) < abs(np.mean(var.weights_ * R) - snips)


# ------------------------------------------------------------------------------------------
# IF stacking
# ------------------------------------------------------------------------------------------


def test_stacking_on_simplex_and_never_worse_than_best_candidate():
    lp0, lp1, pids, R, S = _small(6, n=200, n_prompts=80)
    log_w = log_importance_weights(lp0, lp1)
    W = mean_one_weights(log_w)
    cands = [estimate_snips(W, R, pids), estimate_ips(log_w, R, pids),
             estimate_weighted("flat", np.ones_like(W), np.ones_like(W), R, pids)]
    st = stack_estimates(cands)
    coef = np.array(list(st.coef.values()))
    assert np.all(coef >= 0) and coef.sum() == pytest.approx(1.0)
    assert st.se <= min(c.se for c in cands) + 1e-12
    assert st.value == pytest.approx(sum(st.coef[c.name] * c.value for c in cands))


def test_stacking_aligns_different_cluster_sets():
    a = estimate_direct(np.array([0.1, 0.5, 0.9]), np.array(["a", "b", "c"]))
    b = estimate_direct(np.array([0.4, 0.6]), np.array(["c", "d"]))
    st = stack_estimates({"a": a, "b": dataclasses.replace(b, name="b")})
    assert list(st.clusters) == ["a", "b", "c", "d"]


def test_stacking_errors_for_missing_candidates():
    with pytest.raises(CJEInputError, match="no candidate"):
        stack_estimates([])
    a = estimate_direct(np.array([0.1, 0.5]), np.array(["a", "b"]))
    with pytest.raises(CJEInputError, match="distinct"):
        stack_estimates([a, a])
    bad = dataclasses.replace(a, name="bad", value=float("nan"))
    with pytest.raises(CJEInputError, match="'bad'"):
        stack_estimates([a, bad])
    lp0, lp1, pids, R, S = _small()
    with pytest.raises(CJEInputError, match="unknown stacking candidate"):
        evaluate_target(LoggedData(pids, S, lp0, lp1), Rewards(R), config=OffPolicyConfig(stack=("bogus",)))


# ------------------------------------------------------------------------------------------
# diagnostics
# ------------------------------------------------------------------------------------------


def test_ess_max_share_and_hill_reference():
    w = np.array([1.0, 2.0, 3.0, 10.0])
    assert ess_fraction(w) == pytest.approx(16 ** 2 / (4 * (1 + 4 + 9 + 100)))
    assert max_weight_share(w) == pytest.approx(10 / 16)
    rng = np.random.default_rng(8)
    alpha = 3.0
    x = rng.pareto(alpha, 20000) + 1.0  # Pareto tail index 3
    k = 1000
    # Hill's estimator has sd ~ alpha / sqrt(k) = 0.095; 4 sd tolerance
    assert hill_tail_index(np.log(x), k=k) == pytest.approx(alpha, abs=4 * alpha / math.sqrt(k))
    assert math.isnan(hill_tail_index(np.zeros(10)))
    assert hill_tail_index(np.zeros(100)) == math.inf


def test_ttc_identical_policies_is_the_mass_and_far_policies_collapse():
    sim = simulate_logs(n_prompts=5000, length=8, targets={"same": 0.0, "far": 1.5}, seed=11)
    ld, fd = sim.logged_data("same"), sim.fresh_data("same")
    np.testing.assert_array_equal(ld.log_w, 0.0)
    r = target_typical_coverage(ld.logger_logprob, ld.target_logprob, lengths=ld.lengths,
                                fresh_target_logprob=fd.target_logprob, fresh_lengths=fd.lengths)
    # binomial sd of the logged share ~ sqrt(.09/5000) = .0042, same again for the fresh quantile
    assert r.ttc == pytest.approx(0.9, abs=4 * math.sqrt(2 * 0.09 / 5000))
    assert r.reference == "fresh" and r.per_token
    w = target_typical_coverage(ld.logger_logprob, ld.target_logprob)
    assert w.ttc == pytest.approx(0.9, abs=4 * math.sqrt(0.09 / 5000)) and w.reference == "weighted-logs"
    ld, fd = sim.logged_data("far"), sim.fresh_data("far")
    far = target_typical_coverage(ld.logger_logprob, ld.target_logprob, fresh_target_logprob=fd.target_logprob)
    assert far.ttc < 0.3
    with pytest.raises(CJEInputError, match="mass"):
        target_typical_coverage(ld.logger_logprob, ld.target_logprob, mass=1.0)
    with pytest.raises(CJEInputError, match="lengths"):
        target_typical_coverage(ld.logger_logprob, ld.target_logprob, lengths=ld.lengths,
                                fresh_target_logprob=fd.target_logprob)


def test_cle_floor_formula():
    W = np.array([0.5, 1.0, 1.5, 1.0, 1.0])
    R = np.array([0.2, 0.4, 0.6, 0.8, 1.0])
    lp = np.array([-1.0, -2.0, -3.0, -4.0, -5.0])
    ttc = target_typical_coverage(lp, lp)  # identical: T = the 90% least surprising
    res = cle_floor(W, R, ttc)
    T = ttc.in_region
    wt = W[T] / W[T].mean()
    p = W[T] / W[T].sum()
    sigma = math.sqrt(np.sum(p * (R[T] - np.sum(p * R[T])) ** 2))
    factor = ttc.alpha / math.sqrt(ttc.ttc) * math.sqrt(1 + np.var(wt))
    assert res.factor == pytest.approx(factor)
    assert res.floor_se == pytest.approx(sigma * factor / math.sqrt(5))


def test_bhattacharyya_affinity():
    s = np.array([0.1, 0.2, 0.2, 0.5, 0.9])
    assert judge_score_affinity(s, target_scores=s) == pytest.approx(1.0)
    assert judge_score_affinity(s, target_scores=s + 5) == 0.0
    t = np.array([0.2, 0.5, 0.5, 0.7])
    vals = sorted(set(s) | set(t))
    ref = sum(math.sqrt(np.mean(s == v) * np.mean(t == v)) for v in vals)
    assert judge_score_affinity(s, target_scores=t) == pytest.approx(ref)
    w = np.array([0.0, 1.0, 1.0, 1.0, 2.0])
    refw = sum(math.sqrt(np.mean(s == v) * w[s == v].sum() / w.sum()) for v in set(s))
    assert judge_score_affinity(s, weights=w) == pytest.approx(refw)
    with pytest.raises(CJEInputError):
        judge_score_affinity(s)
    rng = np.random.default_rng(0)
    cont = rng.uniform(0, 1, 4000)
    assert judge_score_affinity(cont, target_scores=rng.uniform(0, 1, 4000)) > 0.98


# ------------------------------------------------------------------------------------------
# evaluate_target and gates
# ------------------------------------------------------------------------------------------


def _report(eta, length, fresh=True, seed=0, n=800):
    sim = simulate_logs(n_prompts=n, length=length, targets={"t": eta}, seed=seed)
    ld, fd = sim.logged_data("t"), sim.fresh_data("t")
    R, Rf = oracle_curve(sim.scores), oracle_curve(fd.scores)
    rw = Rewards(R, Rf) if fresh else Rewards(R)
    return evaluate_target(ld, rw, fd if fresh else None, target="t"), sim


def test_near_clone_passes_every_gate():
    rep, sim = _report(0.05, 4)
    assert rep.logs_only_verdict.claim == "level"
    assert all(v.claim == "level" for v in rep.verdicts.values()), rep.verdicts
    d = rep.diagnostics
    assert d.ttc >= 0.7 and d.ess_raw >= 0.3 and d.ttc_reference == "fresh/per-token"
    assert d.orthogonality is not None and d.orthogonality.mean == pytest.approx(0.0, abs=1e-12)
    # q defaults to the calibrated rewards, so DR equals Direct exactly
    assert rep.estimates["dr"].value == pytest.approx(rep.estimates["direct"].value)
    out = rep.to_dict()
    assert out["verdicts"]["calibrated_ips"]["claim"] == "level"
    assert set(out["estimates"]) == {"ips", "snips", "calibrated_ips", "dr", "direct", "stacked"}


def test_far_target_is_refused_with_reason_and_recommendation():
    rep, _ = _report(1.0, 64, fresh=False)
    v = rep.logs_only_verdict
    assert v.claim == "refused"
    assert any("TTC" in r for r in v.reasons)
    assert v.recommendation is not None and "fresh draws" in v.recommendation and "Direct" in v.recommendation
    assert rep.verdicts["ips"].claim == "refused" and rep.verdicts["snips"].claim == "refused"
    assert "dr" not in rep.verdicts  # logs only: no fresh draws, no DR
    rep, _ = _report(1.0, 64, fresh=True)
    assert rep.verdicts["dr"].claim == "downgraded"
    assert "Direct estimate from the fresh draws" in rep.verdicts["calibrated_ips"].recommendation


def test_each_gate_alone():
    rep, _ = _report(0.05, 4)
    d, g = rep.diagnostics, OffPolicyGates()

    def verdicts(**kw):
        return gate_verdicts(rep.estimates, dataclasses.replace(d, **kw), g, "t")

    v = verdicts(ttc=0.5)
    assert v["calibrated_ips"].claim == "refused" and v["dr"].claim == "downgraded"
    v = verdicts(ess_raw=0.2)
    assert v["snips"].claim == "refused" and v["calibrated_ips"].claim == "level"
    assert "effective sample of 20%" in v["snips"].reasons[0]
    v = verdicts(ess_stabilised=0.2)
    assert v["calibrated_ips"].claim == "refused" and v["snips"].claim == "level"
    v = verdicts(hill_index=1.5)
    assert v["ips"].claim == "downgraded" and v["calibrated_ips"].claim == "level"
    assert v["direct"].claim == "level"  # Direct needs no overlap
    # a custom threshold is honoured
    strict = gate_verdicts(rep.estimates, d, OffPolicyGates(min_ttc=0.99), "t")
    assert strict["calibrated_ips"].claim == "refused"


def test_stacked_verdict_follows_its_components():
    rep, _ = _report(0.05, 4)
    d = dataclasses.replace(rep.diagnostics, ttc=0.1)
    st = rep.estimates["stacked"]
    heavy = dataclasses.replace(st, coef={"calibrated_ips": 0.5, "direct": 0.5})
    light = dataclasses.replace(st, coef={"calibrated_ips": 0.01, "direct": 0.99})
    none = dataclasses.replace(st, coef={"calibrated_ips": 0.0, "direct": 1.0})
    for s, want in ((heavy, "refused"), (light, "downgraded"), (none, "level")):
        ests = dict(rep.estimates, stacked=s)
        assert gate_verdicts(ests, d, OffPolicyGates(), "t")["stacked"].claim == want


# ------------------------------------------------------------------------------------------
# bootstrap
# ------------------------------------------------------------------------------------------


class _Refit:
    def __init__(self, sim, fresh=True):
        self.sim, self.fresh, self.calls = sim, fresh, []

    def __call__(self, li, fi):
        self.calls.append((li.copy(), None if fi is None else fi.copy()))
        lab = self.sim.labelled[li]
        k, v = isotonic_fit(self.sim.scores[li][lab], self.sim.oracle[li][lab])
        R = isotonic_predict(k, v, self.sim.scores[li])
        if fi is None:
            return Rewards(R)
        return Rewards(R, isotonic_predict(k, v, self.sim.fresh["t"].scores[fi]))


def test_bootstrap_same_seed_same_numbers_and_refits_every_replicate():
    sim = simulate_logs(n_prompts=150, length=4, targets={"t": 0.2}, seed=5, label_fraction=0.5)
    ld, fd = sim.logged_data("t"), sim.fresh_data("t")
    r1 = _Refit(sim)
    a = bootstrap_target(ld, r1, fd, n_boot=20, seed=7)
    b = bootstrap_target(ld, _Refit(sim), fd, n_boot=20, seed=7)
    c = bootstrap_target(ld, _Refit(sim), fd, n_boot=20, seed=8)
    for k in a.replicates:
        np.testing.assert_array_equal(a.replicates[k], b.replicates[k])
    assert not np.array_equal(a.replicates["direct"], c.replicates["direct"])
    assert len(r1.calls) == 21  # the point estimate plus one refit per replicate
    li, fi = r1.calls[3]
    # whole prompts are resampled: a logged row and the fresh draw of its prompt come together
    counts_l = np.bincount(li, minlength=ld.n)
    counts_f = np.bincount(fi, minlength=fd.n)
    np.testing.assert_array_equal(counts_l, counts_f)  # one logged row and one draw per prompt
    lo, hi = a.ci("direct")
    assert lo <= a.point["direct"] <= hi and a.se("direct") > 0
    assert set(a.replicates) == {"ips", "snips", "calibrated_ips", "dr", "direct", "stacked"}


def test_bootstrap_logs_only_and_refit_errors():
    sim = simulate_logs(n_prompts=100, length=4, targets={"t": 0.2}, seed=6, label_fraction=0.5)
    ld = sim.logged_data("t")
    res = bootstrap_target(ld, _Refit(sim), n_boot=5, seed=1)
    assert set(res.replicates) == {"ips", "snips", "calibrated_ips", "stacked"}
    with pytest.raises(CJEInputError, match="Rewards"):
        bootstrap_target(ld, lambda li, fi: np.zeros(len(li)), n_boot=5)
    with pytest.raises(CJEInputError, match="one per row"):
        bootstrap_target(ld, lambda li, fi: Rewards(np.zeros(3)), n_boot=5)
    with pytest.raises(CJEInputError, match="n_boot"):
        bootstrap_target(ld, _Refit(sim), n_boot=1)


# ------------------------------------------------------------------------------------------
# simulator
# ------------------------------------------------------------------------------------------


def test_simulator_truth_and_log_probabilities():
    sim = simulate_logs(n_prompts=3000, length=10, targets={"a": 0.3}, seed=9, fresh_per_prompt=4)
    f = sim.fresh["a"]
    # truth is exact over the simulated prompts; the fresh draws' mean h(S) estimates it with
    # sd <= 0.45 / sqrt(12000) ~ 0.004 (h in [0.05, 0.95])
    assert np.mean(oracle_curve(f.scores)) == pytest.approx(sim.truth["a"], abs=4 * 0.45 / math.sqrt(12000))
    assert np.mean(f.oracle) == pytest.approx(sim.truth["a"], abs=4 * 0.5 / math.sqrt(12000))
    assert sim.truth["a"] > sim.truth["logger"]
    assert np.all(sim.logger_logprob <= 0) and np.all(f.target_logprob <= 0)
    assert np.all((sim.scores >= 0) & (sim.scores <= 1))
    # the population value averages the per-prompt truths over the prompt distribution
    pop = population_value(0.3, length=10)
    assert pop == pytest.approx(sim.truth["a"], abs=0.01)
    again = simulate_logs(n_prompts=3000, length=10, targets={"a": 0.3}, seed=9, fresh_per_prompt=4)
    np.testing.assert_array_equal(again.scores, sim.scores)
    with pytest.raises(CJEInputError, match="unknown target"):
        sim.logged_data("zzz")
    with pytest.raises(CJEInputError):
        simulate_logs(length=0)


def test_overlap_collapses_with_length():
    ess = []
    for T in (1, 16, 128):
        sim = simulate_logs(n_prompts=1000, length=T, targets={"t": 0.6}, seed=10)
        ess.append(ess_fraction(mean_one_weights(sim.logged_data("t").log_w)))
    assert ess[0] > ess[1] > ess[2] and ess[2] < 0.05


# ------------------------------------------------------------------------------------------
# real data: the Arena sample's logged file
# ------------------------------------------------------------------------------------------


def test_arena_logs_only_gates(arena_dir):
    import json

    rows = [json.loads(line) for line in open(arena_dir / "logged_data.jsonl", encoding="utf-8")]
    s = np.array([r["judge_score"] for r in rows], dtype=float)
    y = np.array([np.nan if r.get("oracle_label") is None else r["oracle_label"] for r in rows], dtype=float)
    lab = ~np.isnan(y)
    knots, vals = isotonic_fit(s[lab], y[lab])
    R = isotonic_predict(knots, vals, s)
    pids = np.array([r["metadata"]["prompt_id"] for r in rows])
    lp0 = np.array([r["base_policy_logprob"] for r in rows], dtype=float)
    claims, reports = {}, {}
    for t in ("clone", "parallel_universe_prompt", "unhelpful"):
        lp1 = np.array([r["target_policy_logprobs"][t] for r in rows], dtype=float)
        rep = evaluate_target(LoggedData(pids, s, lp0, lp1), Rewards(R), target=t)
        claims[t], reports[t] = rep.logs_only_verdict.claim, rep
    # the clone (same system prompt) is the only target the logs cover; the other two are refused
    assert claims == {"clone": "level", "parallel_universe_prompt": "refused", "unhelpful": "refused"}
    assert reports["clone"].diagnostics.ttc >= 0.7
    # what the refusal prevents: logs-only says the adversarial policy is about as good as the
    # logger, while its own oracle probe (50 labels, mean 0.159) says it is far worse
    probe = [json.loads(line)["oracle_label"] for line in open(arena_dir / "probe_slice" / "unhelpful_probe.jsonl")]
    assert reports["unhelpful"].estimates["calibrated_ips"].value > np.mean(probe) + 0.4


def test_stack_leaves_out_refused_candidates():
    rep, _ = _report(1.0, 64, fresh=True)
    assert rep.verdicts["snips"].claim == "refused"
    assert set(rep.stack_candidates) == {"dr", "direct"}
    assert set(rep.estimates["stacked"].coef) == {"dr", "direct"}
    assert rep.verdicts["stacked"].claim in ("level", "downgraded")
    lo_only, _ = _report(1.0, 64, fresh=False)
    # with every candidate refused the stack uses them all and is refused itself
    assert set(lo_only.stack_candidates) == {"snips", "calibrated_ips"}
    assert lo_only.verdicts["stacked"].claim == "refused"
