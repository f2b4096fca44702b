"""Coverage of own-label (augmented / recalibrated) intervals with 25 and 50 own labels.

Design (as benchmarks/bench_intervals.py): the default simulated policies, ``base`` labels a share
of its rows and calibrates (``calibration_policies=["base"]``), every other policy has exactly L own
labels. ``unhelpful`` fools the judge, so its residuals under base's calibration are bimodal and
right-skewed (sample skewness ~ +0.7); ``clone`` transports (residuals near-symmetric).

Tolerance (binomial Monte Carlo error, not tuned): the coverage of one policy's interval over R
independent seeded datasets is a binomial proportion with SE sqrt(p (1 - p) / R) at the nominal
p = 0.95. A correct method lands within 3 SE of nominal except with probability ~0.27% per check:
R = 1000 gives SE 0.0069 and the band [0.929, 0.971] (the issue's target [0.93, 0.97]); the default
run's R = 150 gives SE 0.0178 and [0.897, 1.0] (a smoke check of the wiring at small cost).

Equal tails: an equal-tailed method misses below (and above) the truth with probability 0.025; over
R = 1000 datasets that share has SE sqrt(0.025 * 0.975 / 1000) = 0.0049, so each tail's share must be at
most 0.025 + 3 SE = 0.040. The skew is what breaks this for the percentile interval (adversarial
policy, 25 labels: 0.042 of misses below in benchmarks/RESULTS.md).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from cje_engine import evaluate
from cje_engine.simulate.direct import simulate

NOMINAL = 0.95


def binomial_band(R: int, p: float = NOMINAL, k: float = 3.0) -> tuple[float, float]:
    se = math.sqrt(p * (1 - p) / R)
    return p - k * se, min(1.0, p + k * se)


def own_label_coverage(R: int, n: int, frac: float, labels: int, seed0: int,
                       **opts) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """Coverage and the shares of misses (below, above) of clone's and unhelpful's own-label intervals."""
    hits: dict[str, list[bool]] = {}
    tails: dict[str, list[tuple[bool, bool]]] = {}
    for r in range(R):
        sim = simulate(n, oracle_fraction=frac, label_design="calibration_policy", calibration_policy="base",
                       audit_labels=labels, seed=seed0 + r)
        res = evaluate(sim.frame, calibration_policies=["base"], seed=r, **opts).to_dict()
        for name in ("clone", "unhelpful"):
            lo, hi = res["policies"][name]["augmented"]["ci"]
            truth = sim.true_values[name]
            hits.setdefault(name, []).append(lo <= truth <= hi)
            tails.setdefault(name, []).append((hi < truth, lo > truth))
    cov = {k: float(np.mean(v)) for k, v in hits.items()}
    return cov, {k: tuple(np.mean(np.array(v), axis=0).tolist()) for k, v in tails.items()}


def test_own_label_intervals_cover_smoke():
    R = 150
    lo, hi = binomial_band(R)
    cov, _ = own_label_coverage(R, n=150, frac=0.3, labels=25, seed0=51_000, n_bootstrap=200)
    for name, c in cov.items():
        assert lo <= c <= hi, (name, c, (lo, hi))


@pytest.mark.slow
@pytest.mark.parametrize("labels", [25, 50])
@pytest.mark.parametrize("inference", ["bootstrap", "analytic"])
def test_own_label_intervals_cover_at_25_and_50_labels(labels, inference):
    R = 1000
    lo, hi = binomial_band(R)  # [0.929, 0.971]
    opts = {"n_bootstrap": 400} if inference == "bootstrap" else {}
    cov, tails = own_label_coverage(R, n=1000, frac=0.1, labels=labels, seed0=52_000 + 10_000 * labels,
                                    inference=inference, covariates=["response_length"], **opts)
    tail_max = 0.025 + 3 * math.sqrt(0.025 * 0.975 / R)  # 0.040
    for name, c in cov.items():
        assert lo <= c <= hi, (name, labels, inference, c, (lo, hi))
        assert max(tails[name]) <= tail_max, (name, labels, inference, tails[name], tail_max)
