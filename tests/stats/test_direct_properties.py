"""Statistical properties of Direct estimation on simulated data with known truth.

Tolerances are binomial: a coverage estimated from R independent datasets has standard
error sqrt(p(1-p)/R) at the nominal p = 0.95; a correct method lands within 3 standard
errors of nominal except with probability ~0.3% per check. Seeds are fixed, so a run is
reproducible; the bounds were derived from R, never tuned.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from cje_engine import evaluate
from cje_engine.simulate.direct import PolicySpec, simulate

NOMINAL = 0.95


def binomial_band(R: int, p: float = NOMINAL, k: float = 3.0) -> tuple[float, float]:
    se = math.sqrt(p * (1 - p) / R)
    return p - k * se, min(1.0, p + k * se)


def _coverage(R: int, n: int, frac: float, seed0: int, **opts) -> dict[str, float]:
    hits: dict[str, list[bool]] = {}
    for r in range(R):
        sim = simulate(n, oracle_fraction=frac, seed=seed0 + r)
        res = evaluate(sim.frame, seed=r, **opts).to_dict()
        for name, p in res["policies"].items():
            lo, hi = p["ci"]
            hits.setdefault(name, []).append(lo <= sim.true_values[name] <= hi)
    return {k: float(np.mean(v)) for k, v in hits.items()}


# The default simulator's judge rewards length and every policy's labels train the calibration with
# no covariate declared: the calibration does not transport to verbose/concise, so these properties
# are those of the own-label (robust) levels, valid without transport. The audited levels' coverage
# where the calibration transports is pinned in tests/stats/test_audited_protocol.py.
def test_analytic_intervals_cover_at_nominal_rate():
    R = 300
    lo, hi = binomial_band(R)  # [0.912, 0.988]
    cov = _coverage(R, n=400, frac=0.10, seed0=10_000, inference="analytic", level_estimator="robust")
    for name, c in cov.items():
        assert lo <= c <= hi, (name, c, (lo, hi))


def test_bootstrap_intervals_cover_at_nominal_rate():
    # Pooled over the 5 policies of each dataset; intervals within a dataset are correlated,
    # so the band uses R (datasets), not 5R: conservative.
    R = 120
    lo, hi = binomial_band(R)  # [0.890, 1.0]
    cov = _coverage(R, n=300, frac=0.10, seed0=20_000, inference="bootstrap", n_bootstrap=200,
                    level_estimator="robust")
    pooled = float(np.mean(list(cov.values())))
    assert lo <= pooled <= hi, (cov, (lo, hi))


@pytest.mark.slow
@pytest.mark.parametrize("frac,n", [(0.05, 500), (0.05, 1000), (0.25, 500)])
def test_bootstrap_coverage_slow(frac, n):
    R = 400
    lo, hi = binomial_band(R)
    cov = _coverage(R, n=n, frac=frac, seed0=30_000, inference="bootstrap", n_bootstrap=500,
                    level_estimator="robust")
    for name, c in cov.items():
        assert lo <= c <= hi, (name, c)


def test_augmented_estimates_are_unbiased_and_se_matches_spread():
    R = 300
    est: dict[str, list[float]] = {}
    ses: dict[str, list[float]] = {}
    truth = None
    for r in range(R):
        sim = simulate(400, oracle_fraction=0.10, seed=40_000 + r)
        truth = sim.true_values
        res = evaluate(sim.frame, inference="analytic", level_estimator="robust").to_dict()
        for name, p in res["policies"].items():
            est.setdefault(name, []).append(p["estimate"])
            ses.setdefault(name, []).append(p["se"])
    for name in est:
        e = np.array(est[name])
        # mean of R estimates: standard error sd/sqrt(R); 4 SE keeps the per-policy false failure < 1e-4
        assert abs(e.mean() - truth[name]) < 4 * e.std(ddof=1) / math.sqrt(R), name
        # the average reported SE should match the Monte Carlo spread; the sample SD of R=300
        # estimates has relative error ~ 1/sqrt(2R) = 4%, so 15% leaves room for the SE's own bias.
        assert 0.85 < np.mean(ses[name]) / e.std(ddof=1) < 1.15, name


def test_naive_raw_judge_intervals_almost_never_cover():
    """Context for the method: the raw judge mean with a textbook CI misses the oracle value."""
    R = 100
    miss = 0
    for r in range(R):
        sim = simulate(1000, oracle_fraction=0.05, seed=50_000 + r)
        f = sim.frame[sim.frame.policy == "base"]
        m, s = f.judge_score.mean(), f.judge_score.std(ddof=1) / math.sqrt(len(f))
        miss += not (m - 1.96 * s <= sim.true_values["base"] <= m + 1.96 * s)
    assert miss / R > 0.95


AUDIT_POLICIES = (
    PolicySpec("base", 0.8),
    PolicySpec("clone", 0.8),
    PolicySpec("clone2", 0.8),
    PolicySpec("unhelpful", -1.0, adversarial=True),
)


def test_audit_power_on_adversarial_and_false_alarms_on_transporting_policies():
    """Base calibrates; clones transport exactly, the adversarial policy does not.

    False alarms: each clone fails with probability <= alpha (per policy, no adjustment), so over R
    datasets the fail rate must stay below alpha + 3 sqrt(alpha(1-alpha)/R).
    Power: the adversarial residual is about -0.56 with SE ~0.03 (z ~ 18), so power is ~1;
    the bound 0.97 allows 3 misses in 100.
    """
    R = 100
    alpha = 0.05
    fails = {p.name: 0 for p in AUDIT_POLICIES}
    for r in range(R):
        sim = simulate(1000, AUDIT_POLICIES, oracle_fraction=0.2, label_design="calibration_policy",
                       audit_labels=50, seed=60_000 + r)
        res = evaluate(sim.frame, inference="analytic", calibration_policies=["base"], alpha=alpha,
                       level_estimator="audited").to_dict()
        for name, p in res["policies"].items():
            fails[name] += p["audit"]["verdict"] == "fail"
            if name == "unhelpful" and p["audit"]["verdict"] == "fail":
                # never the borrowed plug-in as the level: recalibrated from its own labels
                assert p["basis_code"] == "recalibrated"
                assert abs(p["estimate"] - sim.true_values[name]) < 5 * p["se"]
    bound = alpha + 3 * math.sqrt(alpha * (1 - alpha) / R)
    assert fails["clone"] / R <= bound and fails["clone2"] / R <= bound, fails
    assert fails["unhelpful"] / R >= 0.97, fails


def test_two_stage_reduces_length_bias_of_the_borrowed_plug_in():
    """A verbose policy calibrated on base: the judge over-scores long answers.

    Over R datasets, the mean plug-in error with two-stage (length covariate) must be smaller
    than with monotone calibration; both errors are measured against the exact truth.
    """
    pols = (PolicySpec("base", 0.8), PolicySpec("verbose", 0.8, verbosity=3.0))
    R = 40
    err = {"monotone": [], "two_stage": []}
    for r in range(R):
        sim = simulate(1500, pols, oracle_fraction=0.3, label_design="calibration_policy", audit_labels=0,
                       seed=70_000 + r, length_sd=0.8)
        for mode in err:
            res = evaluate(sim.frame, inference="analytic", calibration_policies=["base"], calibration_mode=mode,
                           covariates=["response_length"]).to_dict()
            err[mode].append(res["policies"]["verbose"]["plug_in"]["estimate"] - sim.true_values["verbose"])
    mono, two = np.array(err["monotone"]), np.array(err["two_stage"])
    # the paired difference of absolute mean errors, with its own standard error
    assert abs(two.mean()) < abs(mono.mean()) - 2 * np.std(mono - two, ddof=1) / math.sqrt(R), (mono.mean(), two.mean())
