"""Selective intervals after a failed audit (`cje_engine.inference.selective`) against slow, obvious references."""
from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from scipy.stats import norm, truncnorm

from cje_engine.audit import audit_policies
from cje_engine.inference import selective as sv
from cje_engine.inference.multiplicity import holm

INF = math.inf


def ref_trunc_tails(x: float, mean: float, sd: float, intervals: list[tuple[float, float]]) -> tuple:
    """(P(X <= x | X in S), P(X >= x | X in S)) in 60-digit arithmetic, one piece at a time; each piece's mass
    from the side of the distribution it lies on (upper pieces by survival), so that neither tail cancels."""
    mpmath.mp.dps = 60

    def mass(a: float, b: float):
        za = (mpmath.mpf(a) - mean) / sd if math.isfinite(a) else (-mpmath.inf if a < 0 else mpmath.inf)
        zb = (mpmath.mpf(b) - mean) / sd if math.isfinite(b) else (-mpmath.inf if b < 0 else mpmath.inf)
        if za + zb > 0:
            return mpmath.ncdf(-za) - mpmath.ncdf(-zb)
        return mpmath.ncdf(zb) - mpmath.ncdf(za)

    tot = sum(mass(a, b) for a, b in intervals)
    below = sum(mass(a, min(b, x)) for a, b in intervals if a < x)
    above = sum(mass(max(a, x), b) for a, b in intervals if b > x)
    return below / tot, above / tot


# --------------------------------------------------------------------------- the truncated-normal pivot

@pytest.mark.parametrize("a,b", [(-1.0, 2.0), (0.5, INF), (-INF, -0.3), (-3.0, 0.0)])
@pytest.mark.parametrize("mu", [-1.5, 0.0, 0.7])
def test_pivot_matches_scipy_truncnorm_on_one_interval(a, b, mu):
    for x in np.linspace(max(a, -4), min(b, 4), 7)[1:-1]:
        assert sv.truncated_pivot(x, mu, 1.3, [(a, b)]) == pytest.approx(
            truncnorm.cdf(x, (a - mu) / 1.3, (b - mu) / 1.3, loc=mu, scale=1.3), rel=1e-9, abs=1e-14)


def test_pivot_on_two_intervals_and_far_tails_matches_60_digit_reference():
    cases = [(2.5, 0.0, 1.0, [(-INF, -2.0), (2.0, INF)]),      # the audit's two-sided event
             (-2.5, 0.3, 0.5, [(-INF, -2.0), (2.0, INF)]),
             (41.0, 0.0, 1.0, [(-INF, -40.0), (40.0, INF)]),   # far tail: 1 - Phi(40) ~ 1e-350 underflows
             (-41.0, 0.0, 1.0, [(-INF, -40.0), (40.0, INF)]),
             (0.2, 30.0, 1.0, [(-INF, 0.5), (1.0, INF)])]      # the observation 29 SDs below the mean
    for x, mu, sd, ivs in cases:
        below, above = ref_trunc_tails(x, mu, sd, ivs)
        lf, ls = sv.truncated_log_cdf(x, mu, sd, ivs)
        assert lf == pytest.approx(float(mpmath.log(below)), rel=1e-9, abs=1e-12)
        assert ls == pytest.approx(float(mpmath.log(above)), rel=1e-9, abs=1e-12)


def test_log_normal_mass_both_tails():
    assert float(sv.log_normal_mass(-INF, INF)) == 0.0
    assert float(sv.log_normal_mass(1.0, 1.0)) == -INF
    mpmath.mp.dps = 60
    for u, v in [(-50.0, -49.0), (49.0, 50.0), (-1.0, 3.0), (8.0, INF)]:
        mass = mpmath.ncdf(-u) - mpmath.ncdf(-v) if u + v > 0 else mpmath.ncdf(v) - mpmath.ncdf(u)
        ref = mpmath.log(mass)
        assert float(sv.log_normal_mass(u, v)) == pytest.approx(float(ref), rel=1e-10)


# --------------------------------------------------------------------------- Holm's threshold

def test_holm_threshold_against_brute_force_grid():
    rng = np.random.default_rng(3)
    alpha = 0.05
    for _ in range(60):
        m = int(rng.integers(1, 7))
        p = rng.uniform(0, 0.08, m) ** rng.uniform(0.5, 2)
        if m > 2:
            p[rng.integers(m)] = np.nan  # a policy outside the family
        k = int(rng.choice(np.flatnonzero(np.isfinite(p))))
        t = sv.holm_threshold(p, k, alpha)
        fam = np.flatnonzero(np.isfinite(p))
        pos = int(np.flatnonzero(fam == k)[0])
        for pk in np.linspace(0, 0.06, 601):  # brute force: is k rejected at pk?
            q = p[fam].copy()
            q[pos] = pk
            rejected = holm(q)[pos] <= alpha
            if abs(pk - t) > 1e-9:
                assert rejected == (pk < t), (p, k, pk, t)


# --------------------------------------------------------------------------- the interval

def test_no_truncation_gives_the_ordinary_interval():
    lo, hi = sv.truncated_normal_interval(0.3, [(-INF, INF)], 0.05, sd_lo=0.1, sd_hi=0.2)
    z = norm.ppf(0.975)
    assert lo == pytest.approx(0.3 - z * 0.1, abs=1e-10) and hi == pytest.approx(0.3 + z * 0.2, abs=1e-10)


def test_huge_z_keeps_the_ordinary_interval_to_1e6():
    # a true adversary: |z| = 30 against c = 2.5; asymmetric ordinary interval (BCa-like)
    out = sv.audit_selective_interval(0.2, (0.13, 0.29), 0.04**2, 0.9 * 0.04**2, -0.9, 0.03, 2.5, 0.05)
    assert out["ci"] == pytest.approx(out["ci_unconditional"], abs=1e-6)
    assert out["log_selection_mass"] > -1e-6


def test_z_just_past_c_contains_the_unselected_value_and_inverts_the_pivot():
    # L = R (b = 1, the level is the residual mean): the two-sided |L| > c s truncation, observed at its edge.
    # The ordinary interval excludes 0; the conditional one contains it (the unselected value: no residual),
    # and its ends are where the 60-digit pivot equals alpha/2 and 1 - alpha/2.
    s, c = 0.02, 2.5
    for sign in (1, -1):
        x = sign * (c * s + 1e-4)
        ordinary = (x - 1.96 * s, x + 1.96 * s)
        assert not ordinary[0] <= 0 <= ordinary[1]
        out = sv.audit_selective_interval(x, ordinary, s**2, s**2, x, s, c, 0.05)
        lo, hi = out["ci"]
        assert lo < 0 < hi
        assert out["truncation"] == [[-INF, -c * s], [c * s, INF]]
        ivs = [(-INF, -c * s), (c * s, INF)]
        sd = (ordinary[1] - x) / norm.ppf(0.975)
        assert float(ref_trunc_tails(x, hi, sd, ivs)[0]) == pytest.approx(0.025, rel=1e-7)
        assert float(ref_trunc_tails(x, lo, sd, ivs)[1]) == pytest.approx(0.025, rel=1e-7)


def test_one_sided_truncation_at_its_edge_gives_a_very_wide_interval():
    # X >= 1 observed at 1.001: almost no information about how low theta is (Lee et al.'s wide intervals)
    lo, hi = sv.truncated_normal_interval(1.001, [(1.0, INF)], 0.05, sd=1.0)
    # (the upper end too lies below x: an observation at the edge is unlikely unless theta is far below it)
    assert lo < -100 and hi < 1.001 - 1.96
    # beyond MAX_SCALES scales the end is unbounded (the caller clips it to the label scale)
    lo, _ = sv.truncated_normal_interval(1.0 + 1e-7, [(1.0, INF)], 0.05, sd=1.0)
    assert lo == -INF


def test_two_tails_of_the_truncation_are_mirror_images():
    kw = dict(var_level=0.03**2, cov_level_resid=0.8 * 0.03**2, se_resid=0.025, critical_z=2.4, alpha=0.05)
    up = sv.audit_selective_interval(0.5, (0.44, 0.56), resid=0.062, **kw)
    # mirror: level -> 1 - level, residual -> -residual
    down = sv.audit_selective_interval(0.5, (0.44, 0.56), resid=-0.062, **kw)
    assert up["ci"][0] == pytest.approx(1 - down["ci"][1], abs=1e-9)
    assert up["ci"][1] == pytest.approx(1 - down["ci"][0], abs=1e-9)
    assert up["ci"][1] < 0.56 and down["ci"][0] > 0.44  # each moves away from the side its selection favours


def test_selection_region_and_bad_input():
    assert sv.selection_region(0.0, -2.0, 1.0) == [(-INF, -0.5), (0.5, INF)]
    assert sv.selection_region(3.0, 0.0, 1.0) == [(-INF, INF)]
    assert sv.selection_region(0.5, 0.0, 1.0) == []
    with pytest.raises(ValueError, match="outside the truncation set"):
        sv.truncated_normal_interval(0.0, [(-INF, -1.0), (1.0, INF)], 0.05, sd=1.0)
    with pytest.raises(ValueError, match="positive scales"):
        sv.truncated_normal_interval(2.0, [(1.0, INF)], 0.05, sd=0.0)


@pytest.mark.parametrize("df", [None, np.array([4.0, 9.5, 15.0, 60.0, 12.0, 7.0])])
def test_audit_critical_z_is_the_audit_s_own_fail_boundary(df):
    """`selective_level` rebuilds the audit's event as |R/s| > c with `audit_critical_z` (the Holm threshold's
    quantile in the audit's reference: normal, or Student-t with the audit's df for a borrowed calibrator).
    For every policy of many random families, the audit fails exactly when |z| > c; and the p-value is the
    reference's two-sided tail, so the boundary is the one the selection assumes."""
    from scipy.stats import t as student_t

    rng = np.random.default_rng(7)
    checked = fails = 0
    for _ in range(200):
        se = rng.uniform(0.01, 0.05, 6)
        delta = se * rng.normal(0.0, 2.5, 6)
        out = audit_policies(delta, se, np.full(6, 50), np.full(6, 50), 0.05, 0.05, df=df)
        p = np.array([a["p_value"] for a in out])
        for k, a in enumerate(out):
            z = abs(delta[k] / se[k])
            ref = 2 * (norm.sf(z) if df is None else student_t.sf(z, df[k]))
            assert a["p_value"] == pytest.approx(ref, rel=1e-10)
            crit, threshold = sv.audit_critical_z(p, k, 0.05, None if df is None else float(df[k]))
            assert (a["verdict"] == "fail") == (z > crit)
            assert (a["verdict"] == "fail") == (p[k] <= threshold)
            checked += 1
            fails += a["verdict"] == "fail"
    assert checked == 1200 and 100 < fails < 1100  # both sides of the boundary were exercised


# --------------------------------------------------------------------------- conditional coverage, Monte Carlo

@pytest.mark.stats  # Monte Carlo: CI's service tier (docs/testing.md)
@pytest.mark.parametrize("mu_r", [0.0, 1.5])
def test_conditional_coverage_on_a_bivariate_normal(mu_r):
    """(L, R) bivariate normal, Var 1 and 1.2, Cov 0.9 (L = P + R-like); selected when |R|/sqrt(1.2) > 1.96.

    Among 1000 selected draws the selective interval must cover theta = E[L] at 0.95 +/- 3 binomial SEs
    (SE = sqrt(0.95 * 0.05 / 1000) = 0.0069, so [0.929, 0.971]), whatever E[R] (the nuisance W removes);
    the ordinary interval, for contrast, under-covers when E[R] = 0 (computed, not asserted loosely: < 0.85).
    """
    rng = np.random.default_rng(20261201)
    theta, var_l, var_r, cov = 0.4, 1.0, 1.2, 0.9
    chol = np.linalg.cholesky([[var_l, cov], [cov, var_r]])
    s, c = math.sqrt(var_r), 1.96
    draws = rng.standard_normal((60000, 2)) @ chol.T + [theta, mu_r]
    sel = draws[np.abs(draws[:, 1]) / s > c][:1000]
    assert sel.shape[0] == 1000
    z = norm.ppf(0.975)
    cov_sel = cov_ord = 0
    for l, r in sel:
        out = sv.audit_selective_interval(l, (l - z, l + z), var_l, cov, r, s, c, 0.05)
        cov_sel += out["ci"][0] <= theta <= out["ci"][1]
        cov_ord += l - z <= theta <= l + z
    assert 0.929 <= cov_sel / 1000 <= 0.971
    if mu_r == 0.0:
        assert cov_ord / 1000 < 0.85
