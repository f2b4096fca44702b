"""Audit verdicts, level-claim gates, multiplicity adjustments and ranking rules."""
from __future__ import annotations


import numpy as np
import pandas as pd
import pytest

from cje_engine import evaluate
from cje_engine.audit import audit_policies
from cje_engine.inference.multiplicity import benjamini_hochberg, holm


def slow_holm(p):
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    adj = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adj[i] = running
    return adj


def slow_bh(p):
    """BH adjusted p of the r-th smallest: min over j >= r of m p_(j) / j."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    adj = [0.0] * m
    for r, i in enumerate(order):
        adj[i] = min(1.0, min(m * p[order[j]] / (j + 1) for j in range(r, m)))
    return adj


@pytest.mark.parametrize("seed", range(10))
def test_adjustments_match_slow_definitions(seed):
    rng = np.random.default_rng(seed)
    p = rng.uniform(0, 0.2, 7).tolist()
    np.testing.assert_allclose(holm(np.array(p)), slow_holm(p), atol=1e-12)
    np.testing.assert_allclose(benjamini_hochberg(np.array(p)), slow_bh(p), atol=1e-12)


def test_audit_verdicts():
    delta = np.array([0.0, -0.2, 0.01, 0.03, np.nan])
    se = np.array([0.005, 0.02, 0.04, 0.01, np.nan])
    n = np.array([400, 50, 50, 60, 0])
    out = audit_policies(delta, se, n, n, alpha=0.05, margin=0.05)
    verdicts = [o["verdict"] for o in out]
    assert verdicts[0] == "pass"
    assert verdicts[1] == "fail"
    assert verdicts[2] == "inconclusive" and out[2]["extra_labels_needed"] > 0
    assert verdicts[4] == "not_run" and "no oracle labels" in out[4]["reason"]
    # family = the 4 audited policies: Holm-adjusted p-values are at least the raw ones
    assert out[1]["family_size"] == 4 and out[1]["p_adjusted"] >= out[1]["p_value"]


def test_inconclusive_extra_labels_would_decide():
    """With the suggested extra labels (same mean and spread), the CI fits the margin (audits are not
    adjusted over policies: the 1 - alpha/2 quantile)."""
    from scipy.stats import norm

    d, s, n = 0.01, 0.03, 50
    out = audit_policies(np.array([d, 0.0]), np.array([s, 0.001]), np.array([n, 500]), np.array([n, 500]), 0.05, 0.05)
    extra = out[0]["extra_labels_needed"]
    z = norm.ppf(1 - 0.05 / 2)
    se_new = s * np.sqrt(n / (n + extra))
    assert abs(d) + z * se_new <= 0.05 + 1e-12
    se_less = s * np.sqrt(n / (n + extra - 1))
    assert abs(d) + z * se_less > 0.05


def _frame_with_unlabelled_outlier(seed=0, n=300):
    """'good' and 'base' are labelled; 'far' scores entirely outside the labelled score range."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n):
        q = rng.uniform(0.2, 0.8)
        for name, s, lab in [("base", q, True), ("good", q + 0.05, True), ("far", 0.95 + 0.05 * rng.uniform(), False)]:
            s = float(np.clip(np.round(s * 20) / 20, 0, 1))
            y = float(np.clip(q + rng.normal(0, 0.1), 0, 1))
            rows.append({"prompt_id": f"p{p}", "policy": name, "judge_score": s if name != "far" else min(s, 1.0),
                         "oracle_label": y if (lab and rng.uniform() < 0.5) else np.nan})
    return pd.DataFrame(rows)


def test_limited_support_refuses_an_unlabelled_policy_and_it_is_never_best():
    frame = _frame_with_unlabelled_outlier()
    d = evaluate(frame, n_bootstrap=100, seed=0).to_dict()
    far = d["policies"]["far"]
    assert far["transport"] == "unaudited" and far["audit"]["verdict"] == "not_run"
    assert far["level_claim"] == "refused"
    assert any("support" in r for r in far["refusal_reasons"])
    assert far["support"]["limited"] and far["support"]["share_outside_range"] > 0.9
    assert d["best_policy"] != "far"
    assert d["ranking"][0]["policy"] != "far" or d["ranking"][0]["level_claim"] == "refused"


def test_failed_audit_with_too_few_labels_is_refused():
    """An adversarial policy with 6 own labels: the audit fails, too few labels to recalibrate."""
    rng = np.random.default_rng(3)
    rows = []
    for p in range(400):
        q = rng.uniform(0, 1)
        s = float(np.round(q * 10) / 10)
        rows.append({"prompt_id": f"p{p}", "policy": "base", "judge_score": s,
                     "oracle_label": float(np.clip(q + rng.normal(0, 0.05), 0, 1)) if p % 2 == 0 else np.nan})
        rows.append({"prompt_id": f"p{p}", "policy": "adv", "judge_score": s,
                     "oracle_label": 0.0 if p < 6 else np.nan})
    frame = pd.DataFrame(rows)
    d = evaluate(frame, n_bootstrap=100, seed=0, calibration_policies=["base"], level_estimator="audited").to_dict()
    adv = d["policies"]["adv"]
    assert adv["audit"]["verdict"] == "fail"
    assert adv["basis_code"] == "plug_in" and adv["level_claim"] == "refused"
    assert any("audit failed" in r for r in adv["refusal_reasons"])
    # with enough own labels the same failure leads to a stated recalibration instead
    frame.loc[(frame.policy == "adv") & frame.prompt_id.isin([f"p{i}" for i in range(60)]), "oracle_label"] = 0.0
    d2 = evaluate(frame, n_bootstrap=100, seed=0, calibration_policies=["base"], level_estimator="audited").to_dict()
    adv2 = d2["policies"]["adv"]
    assert adv2["audit"]["verdict"] == "fail" and adv2["level_claim"] == "ok"
    assert adv2["basis_code"] == "recalibrated" and "recalibrated" in adv2["basis"]
    assert adv2["estimate"] == pytest.approx(0.0, abs=0.05)


def test_ranking_ties_when_not_significant_and_win_matrix_is_antisymmetric():
    from tests.unit.test_estimators import make_frame

    d = evaluate(make_frame(1, n_prompts=200), n_bootstrap=200, seed=0).to_dict()
    sig = np.array(d["win_matrix"]["significant"])
    assert np.array_equal(sig, -sig.T)
    ranks = {r["policy"]: r["rank"] for r in d["ranking"]}
    for c in d["comparisons"]:
        if not c["significant"]:
            continue
        better, worse = (c["a"], c["b"]) if c["diff"] > 0 else (c["b"], c["a"])
        assert ranks[better] < ranks[worse]
    if d["best_policy"] is not None:
        best = d["best_policy"]
        assert all(c["significant"] for c in d["comparisons"] if best in (c["a"], c["b"]))


def test_options_are_validated():
    from cje_engine.errors import CJEInputError
    from tests.unit.test_estimators import make_frame

    frame = make_frame(0)
    for bad in [dict(calibration_mode="magic"), dict(alpha=0.7), dict(n_bootstrap=3), dict(multiplicity="fdr"),
                dict(calibration_mode="two_stage"), dict(audit_margin=0), dict(bogus=1),
                dict(calibration_policies=["nope"]), dict(label_scale="weird")]:
        with pytest.raises(CJEInputError):
            evaluate(frame, **bad)
