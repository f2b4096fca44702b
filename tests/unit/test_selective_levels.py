"""Recalibrated levels after a failed audit get the selective interval (`cje_engine.pipeline.policies`), rebuilt
here from the result's own numbers and the replicates by a slow, explicit computation."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import norm
from scipy.stats import t as student_t

from cje_engine import bootstrap_chunk, evaluate, finalize, prepare
from cje_engine.inference.selective import audit_selective_interval
from cje_engine.inference.variance import cluster_cov
from cje_engine.result.validate import validate_result
from cje_engine.simulate.direct import PolicySpec, simulate

PROTOCOL = (PolicySpec("base", 0.8), PolicySpec("clone", 0.8), PolicySpec("verbose", 0.7, verbosity=2.0),
            PolicySpec("unhelpful", -1.0, adversarial=True))


@pytest.fixture(scope="module")
def sim():
    return simulate(600, PROTOCOL, oracle_fraction=0.2, label_design="calibration_policy", audit_labels=60, seed=3,
                    length_bias=0.0)


def _holm_critical_z(audits: dict, name: str, alpha: float) -> float:
    """The |z| beyond which `name`'s audit fails: audits are not adjusted over policies (cje_engine.audit), so
    the two-sided alpha quantile of the audit's reference (Student-t with the audit's df when it has one)."""
    df = audits[name].get("df")
    return float(norm.isf(alpha / 2) if df is None else student_t.isf(alpha / 2, df))


def test_bootstrap_route_selective_interval_rebuilt_from_the_replicates(sim):
    prep = prepare(sim.frame, calibration_policies=["base"], n_bootstrap=300, seed=5, level_estimator="audited")
    reps = bootstrap_chunk(prep, 0, 300)
    res = finalize(prep, [reps]).to_dict()
    validate_result(res)
    K = len(prep.design.data.policies)
    p = res["policies"]["unhelpful"]
    assert p["audit"]["verdict"] == "fail" and p["basis_code"] == "recalibrated"
    assert p["ci_method"] == "selective" and p["ci"] == p["selective"]["ci"]
    assert p["selective"]["ci_unconditional"] == p["augmented"]["ci"]  # both numbers kept
    assert p["selective"]["unconditional_method"] == "bca_expanded"
    assert "conditional on the audit having failed" in p["basis"]
    k = prep.design.data.policies.index("unhelpful")
    L = reps[:, K + k]
    R = reps[:, K + k] - reps[:, k]  # the replicates' first 2K columns: plug-in, augmented
    mL, mR = L.mean(), R.mean()
    var_l = sum((x - mL) ** 2 for x in L) / (L.size - 1)
    cov_lr = sum((x - mL) * (y - mR) for x, y in zip(L, R)) / (L.size - 1)
    crit = _holm_critical_z({n: e["audit"] for n, e in res["policies"].items()}, "unhelpful", 0.05)
    assert p["selective"]["critical_z"] == pytest.approx(crit, abs=1e-3)  # the grid's resolution
    assert p["selective"]["regression_coef"] == pytest.approx(cov_lr / var_l, rel=1e-9)
    # the same interval from these numbers (the unconditional interval unclipped: it lies inside [0, 1] here)
    ref = audit_selective_interval(p["estimate"], p["selective"]["ci_unconditional"], var_l, cov_lr,
                                   p["audit"]["residual_mean"], p["audit"]["se"], p["selective"]["critical_z"], 0.05)
    assert p["ci"] == pytest.approx(ref["ci"], abs=1e-12)
    for name in ("base", "clone", "verbose"):
        e = res["policies"][name]
        assert e["selective"] is None and e["ci_method"] == ("percentile" if e["basis_code"] == "plug_in"
                                                             else "bca_expanded")


def test_analytic_route_uses_the_influence_terms(sim):
    prep = prepare(sim.frame, calibration_policies=["base"], inference="analytic", level_estimator="audited")
    res = finalize(prep, []).to_dict()
    validate_result(res)
    K = len(prep.design.data.policies)
    k = prep.design.data.policies.index("unhelpful")
    p = res["policies"]["unhelpful"]
    assert p["ci_method"] == "selective" and p["selective"]["unconditional_method"] == "skew_t"
    c = cluster_cov(np.column_stack([prep.infl["total"][:, K + k], prep.infl["audit"][:, k]]))
    assert p["selective"]["regression_coef"] == pytest.approx(c[0, 1] / c[0, 0], rel=1e-9)
    assert p["selective"]["z"] == pytest.approx(p["audit"]["residual_mean"] / p["audit"]["se"], rel=1e-12)


def test_robust_levels_are_not_selected_and_keep_their_interval(sim):
    res = evaluate(sim.frame, calibration_policies=["base"], inference="analytic", level_estimator="robust").to_dict()
    for e in res["policies"].values():
        assert e["selective"] is None and e["ci_method"] != "selective"
        if e["augmented"] is not None and e["basis_code"] == "augmented":
            assert e["ci"] == e["augmented"]["ci"]
