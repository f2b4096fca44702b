"""`cje_engine.inference.distributions` gives scipy.stats' numbers without importing it.

Each function is compared with its ``scipy.stats`` counterpart (the reference) on a grid of arguments that
covers the tails, the centre and the degrees of freedom the engine meets (1 to 10^6 and infinity), to the
last bit: scipy.stats calls the same special function after its argument checks.  Kendall's tau-b of
`cje_engine.inference.comparisons` is compared with ``scipy.stats.kendalltau`` the same way, ties included.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from cje_engine.inference import distributions as dist
from cje_engine.inference.comparisons import rank_agreement

Q = np.concatenate([[1e-300, 1e-12, 1e-6, 0.001, 0.025, 0.05], np.linspace(0.06, 0.94, 23), [0.95, 0.975, 0.999, 1 - 1e-9]])
X = np.concatenate([-np.logspace(2, -6, 20), [0.0], np.logspace(-6, 2, 20)])
DF = [1.0, 2.0, 3.5, 9.0, 30.0, 299.0, 1e6, np.inf]


def _same(a, b) -> None:
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_normal_functions_equal_scipy_stats():
    _same(dist.norm_ppf(Q), stats.norm.ppf(Q))
    _same(dist.norm_isf(Q), stats.norm.isf(Q))
    _same(dist.norm_cdf(X), stats.norm.cdf(X))
    _same(dist.norm_sf(X), stats.norm.sf(X))
    assert float(dist.norm_ppf(0.975)) == float(stats.norm.ppf(0.975))  # scalars too


@pytest.mark.parametrize("df", DF)
def test_student_t_and_chi2_functions_equal_scipy_stats(df):
    _same(dist.t_ppf(Q, df), stats.t.ppf(Q, df))
    _same(dist.t_isf(Q, df), stats.t.isf(Q, df))
    _same(dist.t_cdf(X, df), stats.t.cdf(X, df))
    _same(dist.t_sf(X, df), stats.t.sf(X, df))
    if np.isfinite(df):
        chi = np.abs(X) * df
        _same(dist.chi2_sf(chi, df), stats.chi2.sf(chi, df))


def test_t_quantiles_over_an_array_of_dfs_equal_scipy_stats():
    dfs = np.array(DF)
    _same(dist.t_ppf(0.975, dfs), stats.t.ppf(0.975, dfs))


def test_tau_b_of_rank_agreement_equals_scipy_kendalltau_with_ties():
    rng = np.random.default_rng(7)
    for n in range(2, 9):
        for k in range(200):
            raw = rng.integers(0, 3, n).astype(float)
            est = rng.integers(0, 3, n) + (rng.random(n) if k % 2 else 0.0)
            names = [f"p{i}" for i in range(n)]
            got = rank_agreement(names, raw, est)["kendall_tau_b_raw_vs_calibrated"]
            want = stats.kendalltau(raw, est, variant="b").statistic
            assert (got is None and np.isnan(want)) or got == float(want), (raw, est, got, want)


def test_evaluating_imports_no_scipy_stats():
    code = ("import sys, flows.pipelines.evaluate, flows.cli.main, cje_engine.pipeline.calibration; "
            "print('scipy.stats' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
