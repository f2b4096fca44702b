"""Own-label interval functions (`cje_engine.inference.intervals`) against slow, obvious references."""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
from scipy.stats import t as student_t

from cje_engine import evaluate
from cje_engine.inference import intervals as iv
from cje_engine.simulate.direct import simulate

N01 = NormalDist()


def ref_quantile(x: list[float], p: float) -> float:
    """Linear interpolation between order statistics ("type 7"), written out."""
    s = sorted(x)
    h = (len(s) - 1) * p
    lo = math.floor(h)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (h - lo) * (s[hi] - s[lo])


def ref_jackknife_acceleration(x: list[float]) -> float:
    """Efron's acceleration from the delete-one jackknife of the mean, by an explicit loop."""
    n = len(x)
    loo = [(sum(x) - x[i]) / (n - 1) for i in range(n)]
    bar = sum(loo) / n
    num = sum((bar - v) ** 3 for v in loo)
    den = sum((bar - v) ** 2 for v in loo)
    return num / (6 * den**1.5)


def ref_bca(est: float, reps: list[float], accel: float, alpha: float, zq: float) -> tuple[float, float]:
    """BCa by the textbook recipe, one scalar at a time."""
    below = 0.0
    for r in reps:
        below += 1.0 if r < est else (0.5 if r == est else 0.0)
    share = min(max(below / len(reps), 0.5 / len(reps)), 1 - 0.5 / len(reps))
    z0 = N01.inv_cdf(share)
    out = []
    for z in (-zq, zq):
        w = z0 + z
        out.append(ref_quantile(reps, N01.cdf(z0 + w / (1 - accel * w))))
    return out[0], out[1]


def _skewed_sample(rng: np.random.Generator, n: int) -> np.ndarray:
    """Bimodal, right-skewed values: 70% near 0.1, 30% near 0.8."""
    hi = rng.random(n) < 0.3
    return np.where(hi, 0.8, 0.1) + 0.05 * rng.standard_normal(n)


def _mean_bootstrap(x: np.ndarray, B: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, (B, x.size))
    return x[idx].mean(axis=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_acceleration_equals_jackknife_acceleration_of_the_mean(seed):
    x = _skewed_sample(np.random.default_rng(seed), 37)
    infl = (x - x.mean()) / x.size  # influence of the mean, one cluster per value
    assert iv.acceleration(infl) == pytest.approx(ref_jackknife_acceleration(list(x)), rel=1e-10)
    assert iv.acceleration(infl) > 0  # right-skewed sample


def test_acceleration_is_scale_free_sign_aware_and_zero_when_degenerate():
    x = _skewed_sample(np.random.default_rng(5), 40)
    u = x - x.mean()
    assert iv.acceleration(3.0 * u) == pytest.approx(iv.acceleration(u))
    assert iv.acceleration(-u) == pytest.approx(-iv.acceleration(u))
    assert iv.acceleration(np.zeros(10)) == 0.0
    with_nan = np.concatenate([u, [np.nan]])  # a cluster outside the statistic counts as 0
    assert iv.acceleration(with_nan) == pytest.approx(iv.acceleration(np.concatenate([u, [0.0]])))


@pytest.mark.parametrize("seed,df", [(0, None), (1, None), (2, 24.0), (3, 49.0)])
def test_bca_interval_matches_the_textbook_recipe(seed, df):
    x = _skewed_sample(np.random.default_rng(seed), 25)
    reps = _mean_bootstrap(x, 401, seed)
    est = float(x.mean())
    infl = (x - est) / x.size
    alpha = 0.05
    zq = N01.inv_cdf(1 - alpha / 2) if df is None else math.sqrt((df + 1) / df) * student_t.ppf(1 - alpha / 2, df)
    want = ref_bca(est, list(reps), ref_jackknife_acceleration(list(x)), alpha, zq)
    got = iv.bca_interval(est, reps, infl, alpha, df=df)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_bca_counts_ties_half_and_drops_non_finite_replicates():
    reps = np.array([0.0, 1.0, 1.0, 2.0, np.nan, 3.0, np.inf])
    finite = [0.0, 1.0, 1.0, 2.0, 3.0]
    infl = np.array([-0.1, 0.0, 0.1])
    assert iv.bias_correction(1.0, reps) == pytest.approx(N01.inv_cdf(2.0 / 5))
    assert iv.bca_interval(1.0, reps, infl, 0.2) == pytest.approx(ref_bca(1.0, finite, 0.0, 0.2, N01.inv_cdf(0.9)))


def test_bca_without_bias_or_skew_is_the_percentile_interval():
    reps = np.linspace(-1, 1, 201)  # symmetric about the estimate 0: z0 = 0
    infl = np.array([-1.0, 1.0, -2.0, 2.0])  # symmetric: a = 0
    assert iv.bca_interval(0.0, reps, infl, 0.1) == pytest.approx(iv.percentile_interval(reps, 0.1))
    assert iv.percentile_interval(reps, 0.1) == pytest.approx((ref_quantile(list(reps), 0.05),
                                                              ref_quantile(list(reps), 0.95)))


def test_bca_moves_towards_the_long_tail():
    q = N01.inv_cdf(0.975)
    lev = iv.bca_levels(0.0, 0.05, [-q, q])  # positive acceleration: both levels rise
    assert lev[0] > 0.025 and lev[1] > 0.975
    x = np.random.default_rng(11).lognormal(0.0, 1.2, 20)  # strongly right-skewed
    reps = _mean_bootstrap(x, 4000, 11)
    est = float(x.mean())
    lo_p, hi_p = iv.percentile_interval(reps, 0.05)
    lo_b, hi_b = iv.bca_interval(est, reps, (x - est) / x.size, 0.05)
    assert lo_b > lo_p and hi_b > hi_p  # both ends move up


def test_bca_levels_saturate_where_the_formula_breaks_down():
    lev = iv.bca_levels(0.0, 2.0, [-1.96, 1.96])  # 1 - a z < 0 on the upper side
    assert lev[1] == 1.0 and 0 < lev[0] < 0.5


def test_expanded_quantile():
    assert iv.expanded_quantile(0.05, np.inf) == pytest.approx(1.959964, abs=1e-6)
    assert iv.expanded_quantile(0.05, 24) == pytest.approx(math.sqrt(25 / 24) * 2.063899, rel=1e-6)
    assert iv.expanded_quantile(0.05, 1000) == pytest.approx(1.96, abs=0.005)
    with pytest.raises(ValueError):
        iv.expanded_quantile(0.05, 0.5)


def test_t_bootstrap_se_interval():
    reps = np.array([0.9, 1.0, 1.1, 1.2, 0.8, np.nan])
    sd = float(np.std(reps[:5], ddof=1))
    lo, hi = iv.t_bootstrap_se_interval(1.0, reps, 0.05, 9)
    assert (lo, hi) == pytest.approx((1.0 - student_t.ppf(0.975, 9) * sd, 1.0 + student_t.ppf(0.975, 9) * sd))


def test_skew_t_interval_shifts_by_the_edgeworth_term():
    x = _skewed_sample(np.random.default_rng(3), 40)
    est = float(x.mean())
    infl = (x - est) / x.size
    se = float(np.std(x, ddof=1) / math.sqrt(x.size))
    q = student_t.ppf(0.975, 39)
    a = ref_jackknife_acceleration(list(x))
    lo, hi = iv.skew_t_interval(est, se, infl, 0.05, 39)
    assert (lo, hi) == pytest.approx((est - q * se + a * (2 * q * q + 1) * se, est + q * se + a * (2 * q * q + 1) * se))
    sym = np.array([-1.0, 1.0])
    assert iv.skew_t_interval(0.5, 0.1, sym, 0.05, 39) == pytest.approx((0.5 - q * 0.1, 0.5 + q * 0.1))


def test_own_label_interval_dispatch_and_errors():
    x = _skewed_sample(np.random.default_rng(8), 30)
    reps = _mean_bootstrap(x, 300, 8)
    est, infl = float(x.mean()), (x - x.mean()) / x.size
    kw = dict(alpha=0.05, df=29.0, infl=infl)
    assert iv.own_label_interval("bca_expanded", est, reps=reps, **kw) == iv.bca_interval(est, reps, infl, 0.05, df=29.0)
    assert iv.own_label_interval("bca", est, reps=reps, **kw) == iv.bca_interval(est, reps, infl, 0.05)
    assert iv.own_label_interval("percentile", est, reps=reps, **kw) == iv.percentile_interval(reps, 0.05)
    assert iv.own_label_interval("skew_t", est, se=0.05, **kw) == iv.skew_t_interval(est, 0.05, infl, 0.05, 29.0)
    q = student_t.ppf(0.975, 29)
    assert iv.own_label_interval("t", est, se=0.05, **kw) == pytest.approx((est - q * 0.05, est + q * 0.05))
    with pytest.raises(ValueError, match="replicates"):
        iv.own_label_interval("bca_expanded", est, **kw)
    with pytest.raises(ValueError, match="standard error"):
        iv.own_label_interval("skew_t", est, **kw)
    with pytest.raises(ValueError, match="unknown"):
        iv.own_label_interval("magic", est, se=0.05, **kw)
    assert iv.OWN_LABEL_BOOTSTRAP in iv.BOOTSTRAP_METHODS and iv.OWN_LABEL_ANALYTIC in iv.ANALYTIC_METHODS


@pytest.mark.parametrize("inference", ["bootstrap", "analytic"])
def test_pipeline_uses_the_own_label_method_on_own_label_columns_only(inference):
    sim = simulate(150, oracle_fraction=0.3, label_design="calibration_policy", calibration_policy="base",
                   audit_labels=25, seed=3)
    res = evaluate(sim.frame, calibration_policies=["base"], n_bootstrap=200, seed=1, inference=inference)
    d = res.to_dict()
    boot = inference == "bootstrap"
    assert d["inference"]["own_label_ci_method"] == (iv.OWN_LABEL_BOOTSTRAP if boot else iv.OWN_LABEL_ANALYTIC)
    K = len(d["policies"])
    for k, (name, p) in enumerate(d["policies"].items()):
        for col, summ in ((k, p["plug_in"]), (K + k, p["augmented"])):
            est = summ["estimate"]
            infl = res.influence[:, col]
            se_a = float(np.sqrt(np.sum((infl - infl.mean()) ** 2) * infl.size / (infl.size - 1)))
            assert summ["se_analytic"] == pytest.approx(se_a, rel=1e-9)
            df = float(len({pid for pid, lab, pol in zip(sim.frame.prompt_id, sim.frame.oracle_label,
                                                           sim.frame.policy) if pol == name and lab == lab}) - 1)
            if col >= K:
                want_a = iv.own_label_interval(iv.OWN_LABEL_ANALYTIC, est, alpha=0.05, df=df, infl=infl, se=se_a)
            else:
                want_a = (est - 1.959964 * se_a, est + 1.959964 * se_a)
            assert summ["ci_analytic"] == pytest.approx([max(want_a[0], 0.0), min(want_a[1], 1.0)], abs=1e-6)
            if boot:
                r = res.replicates[:, col]
                want_b = (iv.own_label_interval(iv.OWN_LABEL_BOOTSTRAP, est, alpha=0.05, df=df, infl=infl, reps=r)
                          if col >= K else iv.percentile_interval(r, 0.05))
                assert summ["ci_bootstrap"] == pytest.approx([max(want_b[0], 0.0), min(want_b[1], 1.0)], abs=1e-12)
                assert summ["ci"] == summ["ci_bootstrap"]
            else:
                assert summ["ci"] == summ["ci_analytic"]
