"""Issue 9, coverage at 25% calibration labels (helper cover25): the reported SE matches the spread.

The paper's audited protocol as in `benchmarks/bench_protocol.py` (seven policies, labels on ``base`` at
25% of its rows plus 50-label audit slices, a judge that rewards length, ``unhelpful`` adversarial,
``covariates=["response_length"]``), n = 500 prompts a policy, on datasets disjoint from the benchmark's.
The protocol grid's 20-dataset cells suggested the reported SE of ``base`` was ~15% below the spread of its
estimate at 25% labels; 200 datasets (`benchmarks/bench_coverage_diag.py`, RESULTS.md "Issue 9: coverage at
25% labels") put the ratio at 0.96 and the coverage at 0.942. This pins both.

Tolerances (derived, not tuned):
* Coverage of the six transported policies' 95% intervals, D datasets. The six intervals of a dataset
  share the calibrator, so the unit is the dataset: the per-dataset share covered has a between-dataset
  SD of ~0.107 in this cell (measured on the benchmark's 200 datasets: a 20-dataset cell's SE is 0.024),
  so the SE over D = 200 is 0.107 / sqrt(200) = 0.0076 and 3 SE = 0.023. With B = 200 the percentile
  interval's ends are order statistics: the 2.5% quantile has an SE of sqrt(.025 .975 / B) / phi(1.96)
  = 0.19 sigma, which lowers the expected coverage by about 1.96 phi(1.96) Var = 0.004 (second-order
  expansion of Phi at both ends). Band: [0.95 - 0.004 - 0.023, 0.95 + 0.023] = [0.923, 0.973].
* SD of base's estimate over D datasets / the rms of its reported SE. The relative SE of a sample SD is
  sqrt((kappa - 1) / (4 (D - 1))) (kappa = kurtosis of the errors, measured 3.0-3.6 here; 3.6 taken):
  0.057 at D = 200, 3 SE = 0.17; the rms SE varies far less across datasets (its own spread over D is
  < 0.01 relative). Band: [0.83, 1.17]. An SE 15% below the spread (ratio 1.18) fails it.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from cje_engine import evaluate
from cje_engine.simulate.direct import PROTOCOL_TRANSPORTED, protocol_policies, simulate

TRANSPORTED = PROTOCOL_TRANSPORTED
POLICIES = protocol_policies()
D, B, N, FRAC, SEED0 = 200, 200, 500, 0.25, 93_000


@pytest.mark.slow
def test_protocol_25pct_reported_se_matches_spread_and_covers():
    """~90 s CPU (measured 86 s): D = 200 datasets of the audited protocol at 500 prompts, 25% of base labelled."""
    covered, err, se = [], [], []
    for r in range(D):
        sim = simulate(N, POLICIES, oracle_fraction=FRAC, label_design="calibration_policy",
                       calibration_policy="base", audit_labels=50, seed=SEED0 + r, judge_noise_sd=0.0)
        pols = evaluate(sim.frame, covariates=["response_length"], calibration_policies=["base"], n_bootstrap=B,
                        seed=r).to_dict()["policies"]
        covered.append(np.mean([pols[p]["ci"][0] <= sim.true_values[p] <= pols[p]["ci"][1] for p in TRANSPORTED]))
        err.append(pols["base"]["estimate"] - sim.true_values["base"])
        se.append(pols["base"]["se"])
    coverage = float(np.mean(covered))
    ratio = float(np.std(err, ddof=1) / math.sqrt(np.mean(np.square(se))))
    assert 0.923 <= coverage <= 0.973, (coverage, ratio)
    assert 0.83 <= ratio <= 1.17, (coverage, ratio)


@pytest.mark.slow
def test_pooled_rerun_adds_the_pooling_selection_to_the_intervals():
    """~180 s CPU (measured 177 s): the pooled design (every policy 5% labelled at random, the adversary among the sources), n = 1000.

    Robust pooling falsely excludes a clean source in ~3.5% of datasets and the six transported intervals then cover
    ~0.62 (RESULTS.md); ``pooling_bootstrap="rerun"`` reruns the pooling in each replicate. Paired on the same
    datasets and replicate weights, D = 150:
    * the per-dataset coverage share gains 0.0375 on average with a between-dataset SD of 0.108 (measured on the
      benchmark's 200 datasets), so over D = 150 the mean gain has SE 0.0088: asserting a gain > 0 fails with
      probability Phi(-4.3) ~ 1e-5 if the effect is as measured, and with probability ~1/2 if there is none;
    * the rerun's coverage lies within 3 SE of 0.95 less the B = 200 percentile allowance (0.004, module docstring):
      SE = 0.184 / sqrt(150) = 0.015 (between-dataset SD of the share covered in this cell): [0.901, 0.995].
    """
    from cje_engine import bootstrap_chunk, finalize, prepare

    Dp = 150
    gain, cov = [], []
    for r in range(Dp):
        sim = simulate(1000, POLICIES, oracle_fraction=0.05, seed=SEED0 + 10_000 + r, judge_noise_sd=0.0)
        prep = prepare(sim.frame, covariates=["response_length"], n_bootstrap=B, seed=r, pooling_bootstrap="rerun")
        replay, prep.replay = prep.replay, None
        fixed = bootstrap_chunk(prep, 0, B)
        res = finalize(prep, [fixed])
        prep.replay = replay
        reps = bootstrap_chunk(prep, 0, B) if replay is not None else fixed
        names = list(prep.design.data.policies)
        pols = res.to_dict()["policies"]
        a = b = 0.0
        for p in TRANSPORTED:
            t = sim.true_values[p]
            col = int(res.columns[names.index(p)])
            lo, hi = np.percentile(reps[:, col][np.isfinite(reps[:, col])], [2.5, 97.5])
            a += pols[p]["ci"][0] <= t <= pols[p]["ci"][1]
            b += lo <= t <= hi
        gain.append((b - a) / len(TRANSPORTED))
        cov.append(b / len(TRANSPORTED))
    assert np.mean(gain) > 0, (np.mean(gain), np.mean(cov))
    assert 0.901 <= np.mean(cov) <= 0.995, (np.mean(gain), np.mean(cov))
