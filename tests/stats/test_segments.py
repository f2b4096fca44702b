"""Segments on simulated data with known per-segment truth (`cje_engine.simulate.segments`).

Three scenarios, each over many datasets (`benchmarks/bench_segments.py` runs the same `study`):
(a) ``loser``: ``new`` better overall, worse in segment d -> the losing segment is claimed with the power
    measured in docs/segments.md (0.93 at 2,000 prompts, 10% labels, analytic route);
(b) ``opposite``: the judge over-rates a and under-rates b, the pooled mean residual ~0 -> the omnibus test
    fails in >= 80% while the pooled audit passes;
(c) ``null``: nothing differs -> false segment claims (any claim at all) and false omnibus / family audit
    failures at most alpha family-wise; coverage of the shown segment intervals in [0.93, 0.97].

The default tier runs `N_FAST` datasets per scenario with tolerances derived from the binomial law at the
rates measured on 200 datasets (docs/segments.md): a bound that the measured rate would breach by chance
with probability below ~0.5%. The slow tier runs `N_SLOW` datasets and checks the stated bounds themselves,
each with 2 Monte Carlo SEs of slack where the bound is the nominal alpha.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binom

from cje_engine.simulate.segments import segment_study as study

ALPHA = 0.05
N_FAST = 12
N_SLOW = 100
#: measured on 200 datasets per scenario (docs/segments.md)
POWER = 0.93
COVERAGE = 0.95


def _at_least(rate: float, n: int, tail: float = 0.005) -> float:
    """The smallest share of ``n`` draws at rate ``rate`` reached with probability at least 1 - ``tail``."""
    return float(binom.ppf(tail, n, rate)) / n


def _at_most(rate: float, n: int, tail: float = 0.005) -> float:
    """The largest share of ``n`` draws at rate ``rate`` exceeded with probability at most ``tail``."""
    return float(binom.isf(tail, n, rate)) / n


@pytest.fixture(scope="module")
def fast():
    return study(N_FAST, "analytic", 2000, seed0=1000)


def test_fast_losing_segment_found_and_no_false_claims(fast):
    assert fast["a_power_losing_segment"][0] >= _at_least(POWER, N_FAST)
    assert fast["a_false_claim_proportion"] <= 0.1
    assert fast["c_any_false_claim"][0] <= _at_most(ALPHA, N_FAST)


def test_fast_omnibus_catches_cancelling_miscalibration_the_pooled_audit_misses(fast):
    assert fast["b_omnibus_reject_and_pooled_pass"][0] >= _at_least(0.80, N_FAST)
    assert fast["c_omnibus_false_reject"][0] <= _at_most(ALPHA, N_FAST)
    assert fast["c_audit_family_false_fail"][0] <= _at_most(ALPHA, N_FAST)


def test_fast_coverage_of_shown_segment_intervals(fast):
    n = fast["n_shown_intervals"]
    assert n == 2 * N_FAST * 8
    p = fast["coverage_shown_intervals"][0]
    lo, hi = binom.ppf(0.0025, n, COVERAGE) / n, binom.isf(0.0025, n, COVERAGE) / n
    assert lo <= p <= hi, (p, lo, hi)


@pytest.mark.slow
def test_slow_segment_claims_omnibus_and_coverage_over_100_datasets():
    r = study(N_SLOW, "analytic", 2000, seed0=5000)
    se = lambda p: np.sqrt(p * (1 - p) / N_SLOW)  # noqa: E731
    assert r["a_power_losing_segment"][0] >= 0.85
    assert r["b_omnibus_reject"][0] >= 0.80 and r["b_pooled_audit_pass"][0] >= 0.90
    assert r["b_omnibus_reject_and_pooled_pass"][0] >= 0.80
    assert r["c_any_false_claim"][0] <= ALPHA + 2 * se(ALPHA)
    assert r["c_omnibus_false_reject"][0] <= ALPHA + 2 * se(ALPHA)
    assert r["c_audit_family_false_fail"][0] <= ALPHA + 2 * se(ALPHA)
    assert r["a_fcr_selected_intervals"][0] <= ALPHA + 2 * se(ALPHA)
    assert 0.93 <= r["coverage_shown_intervals"][0] <= 0.97
