"""The two-stage index on a link scale (issue #9): calibration on base transports to policies whose
lengths differ when the judge's length bias is additive on its latent (probit) scale.

Design (the paper's protocol, as `benchmarks/bench_protocol.py`): six policies whose calibration given
length transports (judge noise 0) plus an adversary; labels on base (``frac`` of its rows) plus 50-label
audit slices; ``covariates=["response_length"]``, two-stage forced so the test is about the index.

Tolerances. Coverage over R datasets of the six transported policies: the six intervals of a dataset
share one calibrator, so the band counts datasets, not intervals (conservative): 3 SE of a binomial
proportion over R, sqrt(0.95 * 0.05 / R) * 3 (0.084 at R = 60: a loose check; the protocol grid in
benchmarks/RESULTS.md measures coverage to ~0.02). The plug-in bias of the long/short
policies is averaged over R datasets, SE = SD / sqrt(R); the bound is 3 SE plus the 0.0025 the judge's
21-level rounding leaves even for the true E[Y | S, L] of base (docs/statistics.md, "The two-stage
index's link": -0.0012 to +0.0023 measured on 300,000 rows). Seeds fixed; bounds derived, not tuned.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from cje_engine import evaluate
from cje_engine.simulate.direct import PROTOCOL_TRANSPORTED, protocol_policies, simulate

POLICIES = protocol_policies()
TRANSPORTED = PROTOCOL_TRANSPORTED
ROUNDING = 0.0025


def _run(R: int, n: int, frac: float, seed0: int, B: int):
    cover, err = 0, {p: [] for p in TRANSPORTED}
    for r in range(R):
        sim = simulate(n, POLICIES, oracle_fraction=frac, label_design="calibration_policy", audit_labels=50,
                       seed=seed0 + r, judge_noise_sd=0.0)
        res = evaluate(sim.frame, covariates=["response_length"], calibration_policies=["base"],
                       calibration_mode="two_stage", n_bootstrap=B, seed=r).to_dict()
        pols = res["policies"]
        for p in TRANSPORTED:
            e = pols[p]
            cover += e["ci"][0] <= sim.true_values[p] <= e["ci"][1]
            err[p].append(e["plug_in"]["estimate"] - sim.true_values[p])
    return cover / (len(TRANSPORTED) * R), {p: np.array(v) for p, v in err.items()}


@pytest.mark.slow
@pytest.mark.parametrize("n,frac", [(5000, 0.25), (1000, 0.25)])
def test_two_stage_plug_ins_transport_and_cover_slow(n, frac):
    """Where issue #9 measured the least-squares index's bias (n=5000, 25%: concise -0.0076, worse
    +0.0070 with SE ~0.006, coverage 0.842), the logit index's plug-ins are unbiased within 3 SE plus
    the rounding floor, and the reported intervals cover within 3 SE of 0.95."""
    R = 60
    coverage, err = _run(R, n, frac, 123_000 + n, B=400)
    for p in ("verbose", "concise", "worse"):
        e = err[p]
        bound = 3 * e.std(ddof=1) / math.sqrt(R) + ROUNDING
        assert abs(e.mean()) <= bound, (p, e.mean(), bound)
    assert abs(coverage - 0.95) <= 3 * math.sqrt(0.95 * 0.05 / R), coverage
