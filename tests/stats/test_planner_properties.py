"""Statistical properties of the budget planner: plan on a simulated pilot, then simulate at the
planned design many times and check the realised SE and power against the prediction.

Tolerances (derived, not tuned)
-------------------------------
* Realised SD of R independent, approximately normal estimates: its relative standard error is
  ``sqrt(1 / (2 (R - 1)))``.
* The predicted SE comes from a pilot: the variance estimate is a mean of n per-prompt squared
  influence terms ``c_i^2``, so its relative SE is ``sd(c^2) / (mean(c^2) sqrt(n))`` and the SE's
  is half that (delta method). We compute it from the pilot's own influence terms.
* Both errors are independent: the relative tolerance is 3 combined standard errors.
* Power: the rejection count is Binomial(R, pi) with pi the predicted power
  ``Phi(D/SE - z) + Phi(-D/SE - z)``; an SE off by a relative eps moves pi by about
  ``phi(D/SE - z) (D/SE) eps``. Tolerance: 3 * sqrt(pi (1 - pi) / R + (that shift at the pilot
  eps)^2).
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from cje_engine import evaluate
from cje_engine.inference.variance import cluster_cov
from cje_engine.pipeline.direct import finalize, prepare
from cje_engine.planning.planner import plan_from_data
from cje_engine.simulate.direct import PolicySpec, SimSpec, simulate, true_value

#: The planner's label model (m own labels per policy) is that of the own-label levels.
LEVELS = "robust"

ALPHA = 0.05
BASE_SHIFT = 0.8
TARGET_MDE = 0.05


def _policies(diff: float) -> tuple[PolicySpec, PolicySpec]:
    """Policy a better than b by exactly ``diff`` in true E[Y] (same spec defaults as simulate)."""
    spec = SimSpec(n_prompts=1)
    v0 = true_value(BASE_SHIFT, spec)
    delta = brentq(lambda d: true_value(BASE_SHIFT + d, spec) - v0 - diff, 0.0, 3.0)
    return PolicySpec("a", BASE_SHIFT + delta), PolicySpec("b", BASE_SHIFT)


def _pilot_rel_se(frame, pick) -> float:
    """Relative SE of the pilot's predicted SE for the statistic picked from the influence terms."""
    prep = prepare(frame, inference="analytic", level_estimator=LEVELS)
    res = finalize(prep, [])
    c = pick(np.nan_to_num(prep.infl["total"]), res.columns)
    c = c - c.mean()
    sq = c**2
    rel_var = float(np.std(sq, ddof=1) / (np.mean(sq) * np.sqrt(c.size)))
    # sanity: the contributions reproduce the pilot's analytic variance
    assert np.isclose(float(cluster_cov(c[:, None])[0, 0]), np.sum(sq) * c.size / (c.size - 1))
    return rel_var / 2


def _replicate(pols, n: int, m: int, reps: int, seed0: int):
    diffs, rejects, levels = [], [], []
    for s in range(reps):
        sd = simulate(n, pols, oracle_fraction=m / n, seed=seed0 + s)
        d = evaluate(sd.frame, inference="analytic", level_estimator=LEVELS).to_dict()
        comp = d["comparisons"][0]
        diffs.append(comp["diff"])
        rejects.append(comp["p_value"] <= ALPHA)
        levels.append(d["policies"]["a"]["estimate"])
    return np.array(diffs), np.array(rejects), np.array(levels)


def _check_mde_plan(reps: int) -> None:
    pols = _policies(TARGET_MDE)
    pilot = simulate(6000, pols, oracle_fraction=0.25, seed=20261129)
    plan = plan_from_data(pilot.frame, target="a - b", scope="target", target_mde=TARGET_MDE, alpha=ALPHA,
                          power=0.8, level_estimator=LEVELS)
    al = plan["allocation_for_mde"]
    assert al["mde"] <= TARGET_MDE * (1 + 1e-9)
    rel_pilot = _pilot_rel_se(pilot.frame, lambda T, cols: T[:, cols[0]] - T[:, cols[1]])
    diffs, rejects, _ = _replicate(pols, al["n"], al["m"], reps, seed0=50_000)

    # 1. realised SE of the difference vs the planner's prediction
    realised = float(np.std(diffs, ddof=1))
    tol = 3 * np.sqrt(1 / (2 * (reps - 1)) + rel_pilot**2)
    assert abs(realised / al["se"] - 1) <= tol, (realised, al["se"], tol)
    # the estimator is unbiased for the true difference, so the power computation is about D
    assert abs(np.mean(diffs) - TARGET_MDE) <= 3 * realised / np.sqrt(reps)

    # 2. power at the planned design reaches the predicted value (the MDE is achieved)
    z = norm.ppf(1 - ALPHA / 2)
    ratio = TARGET_MDE / al["se"]
    pi = float(norm.cdf(ratio - z) + norm.cdf(-ratio - z))
    assert pi >= 0.8 - 1e-9
    shift = norm.pdf(ratio - z) * ratio * rel_pilot
    tol_p = 3 * np.sqrt(pi * (1 - pi) / reps + shift**2)
    assert abs(np.mean(rejects) - pi) <= tol_p, (np.mean(rejects), pi, tol_p)


def _check_budget_plan(reps: int) -> None:
    pols = _policies(0.03)
    pilot = simulate(6000, pols, oracle_fraction=0.2, seed=7)
    plan = plan_from_data(pilot.frame, target="a", scope="target", budget=6000.0, c_S=1.0, c_Y=16.0,
                          level_estimator=LEVELS)
    al = plan["allocation_for_budget"]
    assert al["cost"] <= 6000.0
    rel_pilot = _pilot_rel_se(pilot.frame, lambda T, cols: T[:, cols[0]])
    _, _, levels = _replicate(pols, al["n"], al["m"], reps, seed0=90_000)
    realised = float(np.std(levels, ddof=1))
    tol = 3 * np.sqrt(1 / (2 * (reps - 1)) + rel_pilot**2)
    assert abs(realised / al["se"] - 1) <= tol, (realised, al["se"], tol)


def test_planned_mde_is_achieved_fast():
    _check_mde_plan(reps=300)


def test_planned_budget_se_is_realised_fast():
    _check_budget_plan(reps=200)


@pytest.mark.slow
def test_planned_mde_is_achieved_slow():
    _check_mde_plan(reps=1500)


@pytest.mark.slow
def test_planned_budget_se_is_realised_slow():
    _check_budget_plan(reps=1000)
