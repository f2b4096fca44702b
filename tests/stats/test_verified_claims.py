"""Verified claims stay valid where the judge is inflated (issue 24), on simulated data with known truth.

Design (the paper's protocol: labels on ``base`` at 10%, 50-label audit slices on the other
policies; judge noise 0 and no length bias, so the honest policies' calibration E[Y | S] is base's):
``better`` (+0.03 above base), ``worse`` (-0.03), and ``mild``, truly 0.013 *below* base, whose judge
inflation puts its borrowed plug-in 0.015 *above* base (a plug-in bias of 0.028, about one audit SE at
50 labels: inside the audit's resolution); ``mild_blind`` is the same policy with no labels of its own.
A second design adds an ``adversary`` (0.10 below base, plug-in 0.10 above: +0.20 off).
benchmarks/bench_verified.py runs the same situations over >= 100 datasets per cell.

Tolerances are binomial and derived from R, never tuned: a rate over R datasets has Monte Carlo SE
sqrt(p (1 - p) / R); the intervals of one dataset share the calibrator, so coverage bands count
datasets, not intervals (conservative); each bound is the rate a valid procedure may have plus 3 SE
(a ~0.1% chance of a false failure per check). Seeds are fixed.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import brentq

from cje_engine import evaluate
from cje_engine.simulate.direct import PolicySpec, SimSpec, simulate, true_value

BASE = 0.8
SIM = {"judge_noise_sd": 0.0, "length_bias": 0.0}
N, FRAC, B = 1000, 0.10, 200


def _shift(delta: float) -> float:
    """Quality shift whose exact true value is ``delta`` from base's."""
    spec = SimSpec(n_prompts=1, **SIM)
    target = true_value(BASE, spec) + delta
    return float(brentq(lambda m: true_value(m, spec) - target, -5.0, 5.0))


def _band(R: int, p: float) -> float:
    return 3 * math.sqrt(p * (1 - p) / R)


def _data(policies, boost: float, seed: int, blind: tuple[str, ...] = ()):
    sim = simulate(N, policies, oracle_fraction=FRAC, label_design="calibration_policy", audit_labels=50,
                   seed=seed, adversarial_boost=boost, **SIM)
    blind_rows = sim.frame["policy"].isin(blind)
    sim.frame.loc[blind_rows, ["oracle_label", "label_probability"]] = np.nan
    return sim


def _mild_design():
    mild = _shift(-0.013)
    pols = (PolicySpec("base", BASE), PolicySpec("better", _shift(0.03)), PolicySpec("worse", _shift(-0.03)),
            PolicySpec("mild", mild, adversarial=True), PolicySpec("mild_blind", mild, adversarial=True))
    return pols, _shift(0.015) - mild


def _claims_mild_better(d: dict, policy: str) -> bool:
    """A verified claim that ``policy`` beats base: named best, a significant comparison in its
    favour, or the baseline gate's ``better``."""
    best = d.get("best_policy")
    best = best.get("policy") if isinstance(best, dict) else best
    if best == policy:
        return True
    for c in d.get("comparisons") or []:
        if c.get("significant") and {c.get("a"), c.get("b")} == {policy, "base"}:
            diff = c["diff"] if c["a"] == policy else -c["diff"]
            if diff > 0:
                return True
    return any(c.get("policy") == policy and c.get("better") for c in d.get("baseline_comparisons") or [])


def test_mild_inflation_is_not_a_verified_win_and_verified_intervals_cover():
    """R=30 datasets, n=1000, 10% base labels, B=200 (bootstrap, the default route).

    * ``mild`` (truly 0.013 below base) is claimed better than base (best, significant comparison
      or baseline ``better``) in at most 0.025 + 3 SE of the datasets: a valid one-sided 2.5% claim
      (two-sided 5% test); bound 0.025 + 3 sqrt(0.025 * 0.975 / 30) = 0.11, i.e. <= 3 of 30 (the
      audited protocol claimed it in most datasets, issue 24);
    * ``mild_blind`` (no own labels) never has a verified level and is never in a verified claim;
    * verified intervals cover: pooled coverage >= 0.95 - 3 sqrt(0.95 * 0.05 / 30) = 0.83 (datasets
      as the unit, conservative), and every policy's coverage over R >= the same bound."""
    pols, boost = _mild_design()
    R = 30
    wins = 0
    cover = {p.name: [] for p in pols}
    for r in range(R):
        sim = _data(pols, boost, 24_100 + r, blind=("mild_blind",))
        d = evaluate(sim.frame, n_bootstrap=B, seed=r, baseline="base").to_dict()
        wins += _claims_mild_better(d, "mild")
        blind = d["policies"]["mild_blind"]
        # no verified level: assumes_transport (estimate null) or refused (estimate kept for ranking only)
        assert blind["level_claim"] != "ok" and blind["verified"] is None, (r, blind["level_claim"])
        assert blind["level_claim"] == "refused" or blind["estimate"] is None, r
        assert not _claims_mild_better(d, "mild_blind"), r
        assert not any(c.get("significant") for c in d["comparisons"] if "mild_blind" in (c["a"], c["b"])), r
        for p, e in d["policies"].items():
            if e["level_claim"] == "ok":
                cover[p].append(e["ci"][0] <= sim.true_values[p] <= e["ci"][1])
    assert wins / R <= 0.025 + _band(R, 0.025), wins
    pooled = [c for v in cover.values() for c in v]
    lower = 0.95 - _band(R, 0.95)
    assert np.mean(pooled) >= lower, np.mean(pooled)
    for p in ("base", "better", "worse", "mild"):
        assert len(cover[p]) == R, (p, len(cover[p]))  # every labelled policy has a verified level
        assert np.mean(cover[p]) >= lower, (p, np.mean(cover[p]))


def test_adversary_is_never_reported_verified_at_its_borrowed_level():
    """R=10 datasets: the ``adversary`` (plug-in +0.20 off, 50 own labels) and ``adversary_few``
    (8 own labels, below the engine's minimum) are never reported as a verified level at their
    borrowed value (a verified estimate nearer the plug-in than the truth is a > 5 SE event for a
    valid level at 50 labels, SE ~0.025: 0 of 10 expected); ``adversary`` beats nobody."""
    adv = _shift(-0.10)
    pols = (PolicySpec("base", BASE), PolicySpec("better", _shift(0.03)),
            PolicySpec("adversary", adv, adversarial=True), PolicySpec("adversary_few", adv, adversarial=True))
    boost = _shift(0.10) - adv
    for r in range(10):
        sim = _data(pols, boost, 24_200 + r)
        few = sim.frame.index[(sim.frame["policy"] == "adversary_few") & sim.frame["oracle_label"].notna()]
        few = np.random.default_rng(r).permutation(few)  # 8 of a simple random sample: one of the rows
        sim.frame.loc[few[8:], ["oracle_label", "label_probability"]] = np.nan
        sim.frame.loc[few[:8], "label_probability"] = 8 / N
        d = evaluate(sim.frame, n_bootstrap=B, seed=r, baseline="base").to_dict()
        for p in ("adversary", "adversary_few"):
            e, truth = d["policies"][p], sim.true_values[p]
            plug = e["plug_in"]["estimate"]
            assert plug - truth > 0.1, (r, p, plug, truth)  # the scenario is what it says
            if e["level_claim"] == "ok":
                assert abs(e["estimate"] - truth) < abs(e["estimate"] - plug), (r, p, e["estimate"])
        assert not _claims_mild_better(d, "adversary"), r


def test_a_refused_policy_without_a_verified_level_flags_nothing_in_the_verified_lists():
    """n=250, 5% base labels (~12 calibration labels): ``blind`` (truly 0.03 below base, plug-in 0.04 above,
    no own labels) is often refused for limited calibration support. Whether refused or assuming transport,
    no entry of ``comparisons`` or ``baseline_comparisons`` that is not a verified claim may be flagged
    ``significant``, ``better`` or ``non_inferior`` (a consumer or gate reading the flag would act on it).
    A logical invariant on 10 fixed datasets; seeds 24300 and 24301 give a refused ``blind``."""
    strong = _shift(-0.03)
    pols = (PolicySpec("base", BASE), PolicySpec("better", _shift(0.03)), PolicySpec("worse", strong),
            PolicySpec("blind", strong, adversarial=True))
    boost = _shift(0.04) - strong
    flagged = []
    for r in range(10):
        sim = simulate(250, pols, oracle_fraction=0.05, label_design="calibration_policy", audit_labels=50,
                       seed=24_300 + r, adversarial_boost=boost, **SIM)
        sim.frame.loc[sim.frame["policy"] == "blind", ["oracle_label", "label_probability"]] = np.nan
        d = evaluate(sim.frame, n_bootstrap=B, seed=r, baseline="base").to_dict()
        flagged += [(r, c["a"], c["b"]) for c in d["comparisons"]
                    if c.get("significant") and c.get("claim_kind") != "verified"]
        flagged += [(r, c["policy"]) for c in d["baseline_comparisons"]
                    if (c.get("better") or c.get("non_inferior")) and c.get("claim_kind") != "verified"]
    assert not flagged, flagged
