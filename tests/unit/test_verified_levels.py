"""Verified levels (issue 24): the power-tuned correction, its replicates, the claims built on it, each
against a slow, obvious reference computation."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cje_engine import evaluate, finalize, prepare
from cje_engine.direct.estimators import bootstrap_weights, replicate
from cje_engine.direct.verified import power_tuned_lambda
from cje_engine.pipeline.direct import bootstrap_chunk
from cje_engine.result import validate_result
from cje_engine.simulate.direct import PolicySpec, simulate

POLICIES = (PolicySpec("base", 0.8), PolicySpec("clone", 0.8), PolicySpec("verbose", 0.7, verbosity=2.0),
            PolicySpec("unhelpful", -1.0, adversarial=True))


@pytest.fixture(scope="module")
def sim():
    return simulate(400, POLICIES, oracle_fraction=0.15, label_design="calibration_policy", audit_labels=40, seed=7)


def test_power_tuned_lambda_is_the_variance_minimiser():
    rng = np.random.default_rng(0)
    o = rng.normal(size=4000)
    a = 0.6 * o + rng.normal(scale=0.5, size=4000)
    lam = power_tuned_lambda(o, a)
    grid = np.linspace(0, 1, 1001)
    var = [np.var(o + g * (a - o)) for g in grid]  # slow, obvious: scan the weight
    assert lam == pytest.approx(grid[int(np.argmin(var))], abs=1e-3)
    assert power_tuned_lambda(o, o + 1e-300 * 0) == 1.0  # A - O constant: nothing to tune, the augmented level
    assert 0.0 <= power_tuned_lambda(o, -3 * o) <= 1.0  # clipped


def test_verified_level_and_replicates_against_a_row_level_reference(sim):
    prep = prepare(sim.frame, covariates=["response_length"], n_bootstrap=60, seed=3)
    reps = bootstrap_chunk(prep, 0, 60)
    res = finalize(prep, [reps]).to_dict()
    validate_result(res)
    d = prep.design.data
    K = len(d.policies)
    n_p = d.n_prompts
    lab = prep.design.lab_rows
    for k, name in enumerate(d.policies):
        p = res["policies"][name]
        rows = lab[d.policy[lab] == k]
        w, y, f = d.label_weight[rows], d.label[rows], prep.f[rows]
        own = np.sum(w * y) / np.sum(w)
        plug = prep.f[d.policy == k].mean()
        aug = plug + np.sum(w * (y - f)) / np.sum(w)
        # replicates by hand: refit in each resample, own-label mean from the resample's weights
        o_b, a_b = [], []
        for b in range(60):
            pw = bootstrap_weights(3, b, n_p)
            a_b.append(replicate(prep.design, pw)[K + k])
            ww = pw[d.prompt[rows]] * w
            o_b.append(np.sum(ww * y) / np.sum(ww))
        o_b, a_b = np.array(o_b), np.array(a_b)
        np.testing.assert_allclose(reps[:, 2 * K + k], o_b, rtol=1e-12)
        d_b = a_b - o_b
        lam = float(np.clip(-np.cov(o_b, d_b, ddof=0)[0, 1] / np.var(d_b), 0, 1))
        assert p["verified"]["lambda"] == pytest.approx(lam, abs=1e-9)
        ref = lam * plug + np.sum(w * (y - lam * f)) / np.sum(w)  # PPI++ written out on the rows
        assert p["estimate"] == pytest.approx(ref, abs=1e-12) and ref == pytest.approx(own + lam * (aug - own))
        assert p["level_claim"] == "ok" and p["basis_code"] == "power_tuned"
        assert p["se"] == pytest.approx(np.std(o_b + lam * d_b, ddof=1), rel=1e-9)
        assert p["assumed"]["estimate"] is not None  # the protocol's level kept beside


def test_analytic_lambda_from_the_influence_terms(sim):
    prep = prepare(sim.frame, covariates=["response_length"], inference="analytic")
    res = finalize(prep, []).to_dict()
    d = prep.design.data
    K = len(d.policies)
    lab = prep.design.lab_rows
    for k, name in enumerate(d.policies):
        rows = lab[d.policy[lab] == k]
        w, y = d.label_weight[rows], d.label[rows]
        own = np.sum(w * y) / np.sum(w)
        psi_o = np.zeros(d.n_prompts)
        np.add.at(psi_o, d.prompt[rows], w * (y - own) / np.sum(w))
        psi_a = prep.infl["total"][:, K + k]
        lam = float(np.clip(-np.mean((psi_o - psi_o.mean()) * ((psi_a - psi_o) - (psi_a - psi_o).mean()))
                            / np.var(psi_a - psi_o), 0, 1))
        assert res["policies"][name]["verified"]["lambda"] == pytest.approx(lam, abs=1e-9)


def test_a_policy_without_own_labels_has_no_verified_level_and_leaves_the_verified_claims():
    sim = simulate(300, POLICIES[:3], oracle_fraction=0.3, label_design="calibration_policy", audit_labels=40, seed=2)
    frame = sim.frame.copy()
    frame.loc[frame["policy"] == "verbose", "oracle_label"] = np.nan
    frame.loc[frame["policy"] == "verbose", "label_probability"] = np.nan
    d = evaluate(frame, n_bootstrap=100, seed=0).to_dict()
    v = d["policies"]["verbose"]
    assert v["level_claim"] == "assumes_transport" and v["estimate"] is None and v["ci"] is None
    assert v["verified"] is None and v["assumed"]["estimate"] is not None
    assert v["labels_to_verify"]["n_labels"] >= 10 and v["labels_to_verify"]["closest"]["policy"] in ("base", "clone")
    assert v["relative_claim"] == "not_estimable" and "no verified level" in v["relative_reason"]
    pair = [c for c in d["comparisons"] if "verbose" in (c["a"], c["b"])]
    assert pair and all(c["reported"] is False for c in pair)
    assert d["best_policy"] is None and "not every policy has a level" in d["best_policy_reason"]
    # the assumes-transport claims keep verbose, named as such
    at = [c for c in d["assumes_transport"]["comparisons"] if "verbose" in (c["a"], c["b"])]
    assert at and all(c["reported"] and c["claim_kind"] == "assumes_transport" for c in at)
    # trusting transport makes the assumed level the reported one, still named assumes_transport
    t = evaluate(frame, n_bootstrap=100, seed=0, trust_transport=["verbose"]).to_dict()
    tv = t["policies"]["verbose"]
    assert tv["level_claim"] == "assumes_transport" and tv["estimate"] == pytest.approx(v["assumed"]["estimate"])
    tc = [c for c in t["comparisons"] if "verbose" in (c["a"], c["b"])]
    assert all(c["reported"] and c["claim_kind"] == "assumes_transport" for c in tc)
    assert all(c["claim_kind"] == "verified" for c in t["comparisons"] if "verbose" not in (c["a"], c["b"]))


def test_a_one_row_policy_gets_no_level_and_no_comparison():
    sim = simulate(200, POLICIES[:2], oracle_fraction=0.3, seed=4)
    one = pd.DataFrame([{"prompt_id": sim.frame["prompt_id"].iloc[0], "policy": "tiny", "judge_score": 0.9,
                         "oracle_label": np.nan, "label_probability": np.nan, "response_length": 200}])
    frame = pd.concat([sim.frame, one], ignore_index=True)
    d = evaluate(frame, n_bootstrap=100, seed=0).to_dict()
    t = d["policies"]["tiny"]
    assert t["level_claim"] == "refused" and any("prompt(s) of its own" in r for r in t["refusal_reasons"])
    assert t["relative_claim"] == "not_estimable"
    assert all(c["reported"] is False for c in d["comparisons"] if "tiny" in (c["a"], c["b"]))
    assert d["best_policy"] != "tiny"


def test_baseline_comparisons_are_simultaneous_max_t(sim):
    res = evaluate(sim.frame, covariates=["response_length"], n_bootstrap=400, seed=1, baseline="base",
                   noninferiority_margin=0.02)
    d = res.to_dict()
    names = list(d["policies"])
    cols = res.columns
    R = res.replicates[:, cols]
    b = names.index("base")
    others = [j for j in range(len(names)) if j != b]
    diffs = np.array([d["policies"][names[j]]["estimate"] - d["policies"]["base"]["estimate"] for j in others])
    D = R[:, others] - R[:, [b]]
    se = D.std(axis=0, ddof=1)
    tmax = [max(abs(D[i, m] - diffs[m]) / se[m] for m in range(len(others))) for i in range(D.shape[0])]  # slow
    c = float(np.quantile(tmax, 0.95))
    rows = {r["policy"]: r for r in d["baseline_comparisons"]}
    assert set(rows) == {names[j] for j in others}
    for m, j in enumerate(others):
        r = rows[names[j]]
        assert r["critical_value"] == pytest.approx(c, rel=1e-12)
        assert r["ci"] == pytest.approx([diffs[m] - c * se[m], diffs[m] + c * se[m]], abs=1e-12)
        assert r["better"] == (r["ci"][0] > 0) and r["worse"] == (r["ci"][1] < 0)
        assert r["non_inferior"] == (r["ci"][0] > -0.02)
        t = abs(diffs[m]) / se[m]
        assert r["p_adjusted"] == pytest.approx((1 + sum(x >= t for x in tmax)) / (len(tmax) + 1))
    assert c > 1.96  # simultaneous over three contrasts: wider than one pointwise interval
    assert rows["unhelpful"]["worse"] is True
    # analytic route: the same family from the influence terms' correlation
    a = evaluate(sim.frame, covariates=["response_length"], inference="analytic", baseline="base").to_dict()
    ca = a["baseline_comparisons"][0]["critical_value"]
    assert 1.96 < ca < 2.5


def test_best_policy_is_an_intersection_union_test():
    from cje_engine.inference.comparisons import rank_policies

    names = ["a", "b", "c"]
    est = np.array([0.8, 0.7, 0.6])
    comps = [{"a": "a", "b": "b", "diff": 0.1, "se": 0.02, "p_value": 0.04, "significant": False},
             {"a": "a", "b": "c", "diff": 0.2, "se": 0.02, "p_value": 0.001, "significant": True},
             {"a": "b", "b": "c", "diff": 0.1, "se": 0.02, "p_value": 0.2, "significant": False}]
    refused = np.zeros(3, dtype=bool)
    _, _, best, reason = rank_policies(names, est, comps, refused, ["ok"] * 3, alpha_iut=0.05)
    assert best == "a" and "intersection-union" in reason  # each pairwise p <= alpha, no adjustment needed
    comps[0]["p_value"] = 0.06
    _, _, best, _ = rank_policies(names, est, comps, refused, ["ok"] * 3, alpha_iut=0.05)
    assert best is None
    comps[0]["p_value"] = 0.01
    for c in comps[1:]:
        c["reported"] = False  # as compare_pairs leaves a pair with a dropped policy
    _, _, best, reason = rank_policies(names, est, comps, refused, ["ok"] * 3, {"c": "no verified level"}, 0.05)
    assert best is None and "not every policy" in reason  # a policy without a level may be the best


def test_two_stage_extrapolation_in_a_covariate_is_flagged():
    """Support is checked in the covariates too: a policy whose lengths lie outside the calibration labels'
    range is flagged (share computed by hand from the rows), and its assumes-transport basis says so."""
    pols = (PolicySpec("base", 0.8), PolicySpec("long", 0.8, verbosity=4.0))
    sim = simulate(600, pols, oracle_fraction=0.2, label_design="calibration_policy", audit_labels=30, seed=5)
    d = evaluate(sim.frame, covariates=["response_length"], calibration_mode="two_stage", n_bootstrap=100,
                 calibration_policies=["base"], level_estimator="audited").to_dict()
    f = sim.frame
    cal = f[(f["policy"] == "base") & f["oracle_label"].notna()]["response_length"]
    long = f[f["policy"] == "long"]["response_length"]
    share = float(((long < cal.min()) | (long > cal.max())).mean())
    s = d["policies"]["long"]["support"]
    assert s["share_covariate_outside"] == pytest.approx(share) and share > 0.1
    assert s["covariate_extrapolation"] is True
    assert d["policies"]["base"]["support"]["covariate_extrapolation"] is False
    if d["policies"]["long"]["basis_code"] == "plug_in":
        assert "extrapolates in a covariate" in d["policies"]["long"]["basis"]


def test_rank_only_comparisons_carry_the_bias_bound():
    """A rank-only level (limited support, plug-in trusted): its comparisons' interval is widened by share_thin x
    span on top of the conservative interval, and the p-value tests the difference shrunk by that bound."""
    from cje_engine.inference.comparisons import PolicyColumns, compare_pairs

    rng = np.random.default_rng(1)
    reps = rng.normal([0.7, 0.6], 0.01, size=(2000, 2))
    infl = rng.normal(0, 0.01 / np.sqrt(500), size=(500, 2))
    base = dict(names=["a", "b"], estimate=np.array([0.7, 0.6]), replicates=reps, influence=infl,
                dfs=np.array([np.inf, np.inf]), refused=np.zeros(2, bool), claims=["ok", "ok"], raw=np.zeros(2),
                relative=["ok", "rank_only"], relative_reason=[None, "limited"])
    plain = compare_pairs(PolicyColumns(**base), alpha=0.05, method="holm", span=1.0, warnings=[])[0]
    wide = compare_pairs(PolicyColumns(**base, bias_bound=np.array([0.0, 0.09])), alpha=0.05, method="holm",
                         span=1.0, warnings=[])[0]
    assert wide["bias_bound"] == pytest.approx(0.09)
    assert wide["ci"] == pytest.approx([plain["ci"][0] - 0.09, plain["ci"][1] + 0.09])
    from scipy.stats import t as student_t
    assert wide["p_value"] >= 2 * student_t.sf((0.1 - 0.09) / wide["se"], np.inf) - 1e-12
    assert plain["significant"] and not wide["significant"] or wide["p_value"] > plain["p_value"]


# ------------------------------------------------------------------ off-policy modes (hybrid, logs-only)


def _hybrid_frames(own: dict[str, int], seed: int = 4, n_prompts: int = 200):
    """Simulated logs (logger 'base', 30% labelled) and fresh draws of 'near' (eta 0.05) and 'mid' (eta 0.4,
    the best policy), ``own[t]`` of each candidate's fresh draws labelled by the simulator's oracle."""
    from cje_engine.simulate.logs import simulate_logs

    sim = simulate_logs(n_prompts=n_prompts, length=8, targets={"near": 0.05, "mid": 0.4}, seed=seed,
                        label_fraction=0.3)
    logged, fresh = sim.to_frames("base")
    rng = np.random.default_rng(seed)
    for t, n in own.items():
        rows = np.flatnonzero(fresh["policy"].to_numpy() == t)
        pick = rng.choice(rows.size, n, replace=False)
        fresh.loc[rows[pick], "oracle_label"] = sim.fresh[t].oracle[pick]
    return sim, logged, fresh


@pytest.fixture(scope="module")
def hybrid_few():
    """Hybrid, 'mid' with 5 own labels (under min_labels), 'near' with 40: bootstrap, and Direct on the same design."""
    from cje_engine.pipeline import offpolicy

    _, logged, fresh = _hybrid_frames({"near": 40, "mid": 5})
    prep = offpolicy.prepare(logged, fresh, mode="hybrid", n_bootstrap=50, seed=3)
    obj = offpolicy.finalize(prep, [offpolicy.bootstrap_chunk(prep, 0, 50)])
    direct = finalize(prep.direct, [bootstrap_chunk(prep.direct, 0, 50)]).to_dict()
    return obj.to_dict(), direct, obj


def test_hybrid_fresh_draws_with_too_few_own_labels_have_no_verified_level(hybrid_few):
    """Hybrid, Direct's rule: a fresh-draw policy with 5 own labels gets no quotable level (estimate null), its
    protocol level (the IF-stacked hybrid estimate) is kept in ``assumed``, and labels_to_verify says how many
    own labels would verify it. (Before: the stacked estimate was reported as an ``ok`` level.)"""
    res, direct, _ = hybrid_few
    validate_result(res)
    mid = res["policies"]["mid"]
    assert mid["level_claim"] == "assumes_transport" and mid["estimate"] is None and mid["ci"] is None
    assert mid["assumed"]["basis_code"] == "hybrid/stacked" and mid["assumed"]["level_claim"] == "ok"
    assert mid["assumed"]["estimate"] == pytest.approx(mid["offpolicy"]["estimates"]["stacked"]["value"])
    assert mid["labels_to_verify"] == direct["policies"]["mid"]["labels_to_verify"]
    assert mid["labels_to_verify"]["n_labels"] >= 5 and mid["relative_claim"] == "not_estimable"
    assert mid["direct"]["level_claim"] == "assumes_transport"  # what mode='direct' says of its fresh draws
    # the policies with enough own labels: Direct's verified level, the protocol's kept beside
    for n in ("base", "near"):
        p, q = res["policies"][n], direct["policies"][n]
        assert p["level_claim"] == "ok" and p["basis_code"] == "power_tuned"
        assert (p["estimate"], p["ci"], p["verified"]) == (q["estimate"], q["ci"], q["verified"])
    assert res["policies"]["near"]["assumed"]["basis_code"] == "hybrid/stacked"
    assert res["policies"]["base"]["assumed"] == direct["policies"]["base"]["assumed"]


def test_hybrid_verified_comparisons_ranking_and_best_are_directs(hybrid_few):
    """The verified claims of a hybrid evaluation are Direct's on the same design: the same reported pairs,
    differences, intervals, adjusted p-values, ranking and best policy; the unverified policy (here the
    true best, 'mid') is in none of them but in the ``assumes_transport`` block, named as such."""
    res, direct, obj = hybrid_few

    def pairs(d):  # a - b as (a, b) in sorted order (the modes list the policies in different orders)
        out = {}
        for c in d["comparisons"]:
            flip = c["a"] > c["b"]
            diff = None if c["diff"] is None else (-c["diff"] if flip else c["diff"])
            ci = None if c["ci"] is None else ([-c["ci"][1], -c["ci"][0]] if flip else c["ci"])
            out[tuple(sorted((c["a"], c["b"])))] = (c["reported"], diff, ci, c["p_value"], c["p_adjusted"],
                                                    c["significant"], c["claim_kind"])
        return out

    got, ref = pairs(res), pairs(direct)
    assert got.keys() == ref.keys()
    for k in ref:
        for g, r in zip(got[k], ref[k]):
            assert g == (r if r is None or isinstance(r, (bool, str)) else pytest.approx(r, rel=1e-12, abs=1e-15)), k
    assert all(c["reported"] is False for c in res["comparisons"] if "mid" in (c["a"], c["b"]))
    assert [e["policy"] for e in res["ranking"]] == [e["policy"] for e in direct["ranking"]]
    assert "mid" not in {e["policy"] for e in res["ranking"]}
    # the result's accessors recompute the reported pair (same replicates, dfs and claim kinds)
    c = next(c for c in res["comparisons"] if {c["a"], c["b"]} == {"base", "near"})
    acc = obj.compare(c["a"], c["b"])
    assert (acc.diff, acc.ci, acc.p_value, acc.claim_kind) == (pytest.approx(c["diff"]), pytest.approx(c["ci"]),
                                                               pytest.approx(c["p_value"]), c["claim_kind"])
    assert obj.compare("base", "mid").reported is False
    assert res["best_policy"] is None and res["best_policy_reason"] == direct["best_policy_reason"]
    at = res["assumes_transport"]
    assert "mid" in {e["policy"] for e in at["ranking"]}
    mids = [c for c in at["comparisons"] if "mid" in (c["a"], c["b"])]
    assert mids and all(c["reported"] and c["claim_kind"] == "assumes_transport" for c in mids)


def test_hybrid_trust_transport_reports_the_assumed_level():
    """``trust_transport`` in hybrid mode: the trusted policy's protocol level is its reported level, named
    assumes_transport, and its comparisons enter the main family as assumes_transport claims."""
    from cje_engine.pipeline.offpolicy import evaluate_offpolicy

    _, logged, fresh = _hybrid_frames({"near": 40, "mid": 5})
    kw = dict(mode="hybrid", inference="analytic", seed=3)
    plain = evaluate_offpolicy(logged, fresh, **kw).to_dict()
    res = evaluate_offpolicy(logged, fresh, trust_transport=["mid"], **kw).to_dict()
    validate_result(res)
    mid = res["policies"]["mid"]
    assert mid["level_claim"] == "assumes_transport" and "trust_transport" in mid["basis"]
    assert mid["estimate"] == pytest.approx(plain["policies"]["mid"]["assumed"]["estimate"]) is not None
    assert mid["ci"] is not None and mid["relative_claim"] == "ok"
    cmp = [c for c in res["comparisons"] if "mid" in (c["a"], c["b"])]
    assert cmp and all(c["reported"] and c["claim_kind"] == "assumes_transport" for c in cmp)
    assert all(c["claim_kind"] == "verified" for c in res["comparisons"] if "mid" not in (c["a"], c["b"]))
    assert "mid" in {e["policy"] for e in res["ranking"]}


def test_logs_only_levels_assume_transport():
    """Logs-only: the importance-weighted level of a candidate assumes that the calibration transports to its
    reweighted responses (no label of its own can exist) and overlap: estimate null, the gated level in
    ``assumed``, no labels_to_verify (its fresh draws are needed); the logger's level is Direct's verified one.
    Trusted, it is reported and compared as an assumes-transport claim."""
    from cje_engine.pipeline.offpolicy import evaluate_offpolicy

    _, logged, _ = _hybrid_frames({}, n_prompts=300)  # 300: the candidates' levels pass the support rule
    kw = dict(mode="logs-only", inference="analytic", seed=3)
    d = evaluate_offpolicy(logged, **kw).to_dict()
    validate_result(d)
    assert d["policies"]["base"]["basis_code"] == "power_tuned" and d["policies"]["base"]["level_claim"] == "ok"
    for t in ("near", "mid"):
        p = d["policies"][t]
        assert p["level_claim"] == "assumes_transport" and p["estimate"] is None and p["labels_to_verify"] is None
        assert p["assumed"]["basis_code"] == "logs-only/calibrated_ips" and p["assumed"]["estimate"] is not None
        assert "fresh draws" in p["relative_reason"] and "fresh draws" in p["recommendation"]
    assert d["best_policy"] is None and not any(c["reported"] for c in d["comparisons"])
    assert d["assumes_transport"]["comparisons"] and all(
        c["claim_kind"] == "assumes_transport" for c in d["assumes_transport"]["comparisons"] if c["reported"])
    t = evaluate_offpolicy(logged, trust_transport=["*"], **kw).to_dict()
    assert t["policies"]["mid"]["estimate"] == pytest.approx(d["policies"]["mid"]["assumed"]["estimate"])
    assert all(c["claim_kind"] == "assumes_transport" for c in t["comparisons"] if c["reported"])
