"""Audited levels, audits that carry the calibrator's error, robust pooling and mode selection,
each against a slow, obvious reference computation (issue #9)."""
from __future__ import annotations

import numpy as np
import pytest

from cje_engine import evaluate, prepare
from cje_engine.calibration.calibrators import two_stage_knots
from cje_engine.data.frame import EvalData
from cje_engine.direct.estimators import calibration_term, cross_fit_models, influence, make_design, replicate
from cje_engine.errors import CJEInputError
from cje_engine.pipeline.calibration import MODE_Z, audit_statistics, choose_mode, fit_calibration, fit_mode
from cje_engine.pipeline.policies import uses_own_labels
from cje_engine.options import EvaluationOptions
from cje_engine.simulate.direct import PolicySpec, simulate

PROTOCOL = (PolicySpec("base", 0.8), PolicySpec("clone", 0.8), PolicySpec("verbose", 0.7, verbosity=2.0),
            PolicySpec("unhelpful", -1.0, adversarial=True))


def _data(frame, **opts) -> EvalData:
    return EvalData.from_frame(frame, **opts)


@pytest.mark.parametrize("estimator,verdict,n_own,limited,expected", [
    ("audited", "pass", 50, False, False), ("audited", "inconclusive", 50, False, False),
    ("audited", "fail", 50, False, True), ("audited", "fail", 5, False, False),
    ("audited", "not_run", 0, False, False), ("audited", "pass", 50, True, True),
    ("robust", "pass", 50, False, True), ("robust", "fail", 9, False, False),
    ("augmented", "pass", 3, False, True), ("augmented", "not_run", 0, False, False),
    ("plug_in", "fail", 500, True, False),
])
def test_which_levels_use_own_labels(estimator, verdict, n_own, limited, expected):
    assert uses_own_labels(estimator, verdict, n_own, 10, limited) is expected


def test_audited_levels_report_the_plug_in_unless_the_audit_fails():
    sim = simulate(600, PROTOCOL, oracle_fraction=0.2, label_design="calibration_policy", audit_labels=60, seed=3,
                   length_bias=0.0)
    res = evaluate(sim.frame, calibration_policies=["base"], inference="analytic", level_estimator="audited").to_dict()
    robust = evaluate(sim.frame, calibration_policies=["base"], inference="analytic",
                      level_estimator="robust").to_dict()
    assert res["config"]["level_estimator"] == "audited"
    for name, p in res["policies"].items():
        r = robust["policies"][name]
        assert p["plug_in"]["estimate"] == pytest.approx(r["plug_in"]["estimate"], abs=1e-12)  # both numbers kept
        assert p["augmented"]["estimate"] == pytest.approx(r["augmented"]["estimate"], abs=1e-12)
        if p["audit"]["verdict"] == "fail":
            assert p["basis_code"] == "recalibrated" and p["estimate"] == p["augmented"]["estimate"]
        elif p["support"]["limited"]:  # the plug-in would be refused: own labels instead
            assert p["basis_code"] == "augmented" and p["estimate"] == p["augmented"]["estimate"]
        else:
            assert p["basis_code"] == "plug_in" and p["estimate"] == p["plug_in"]["estimate"]
            assert p["audit"]["verdict"] in p["basis"]
    assert res["policies"]["unhelpful"]["audit"]["verdict"] == "fail"
    assert robust["policies"]["clone"]["basis_code"] == "augmented"
    # the comparisons use the reported levels
    comp = next(c for c in res["comparisons"] if {c["a"], c["b"]} == {"base", "clone"})
    a, b = res["policies"][comp["a"]]["estimate"], res["policies"][comp["b"]]["estimate"]
    assert comp["diff"] == pytest.approx(a - b)


def test_the_old_estimator_option_is_named_in_the_error():
    with pytest.raises(CJEInputError, match="renamed level_estimator"):
        EvaluationOptions.build(estimator="auto")
    with pytest.raises(CJEInputError, match="did you mean 'audited'"):
        EvaluationOptions.build(level_estimator="audit")


def test_audit_influence_is_the_derivative_of_the_residual_mean():
    """Slow reference: perturb each prompt's weight, refit, and difference the residual mean.

    For a policy whose labels do not train the (monotone) calibrator, its mean residual is a smooth
    function of the prompt weights while the isotonic level sets stay put, and the first-order effect
    of prompt p's weight is exactly its influence term (residual term minus the calibrator's error on
    the audit slice)."""
    sim = simulate(150, PROTOCOL[:3], oracle_fraction=0.4, label_design="calibration_policy", audit_labels=40,
                   seed=11, length_bias=0.0)
    data = _data(sim.frame)
    design = make_design(data, "monotone", ("base",))
    f, full, _ = cross_fit_models(design)
    infl = influence(design, f, full)
    K = design.n_policies
    # the exact derivative has the in-sample residuals; the reported term corrects their leverage
    G = design.cells.cells.size
    share = np.zeros((K, G))
    lab = np.flatnonzero(data.labelled)
    for i in lab:
        share[data.policy[i], design.cells.row_cell[i]] += data.label_weight[i]
    share /= share.sum(axis=1, keepdims=True)
    exact = infl["calibration"][:, K:] - calibration_term(design, full, share)
    corrected = infl["calibration"][:, K:] - calibration_term(design, full, share, f[design.cal_rows])
    np.testing.assert_allclose(corrected, infl["audit"], rtol=1e-12, atol=1e-15)
    base_stats = replicate(design, np.ones(data.n_prompts))
    eps = 1e-7
    rng = np.random.default_rng(0)
    for p in rng.choice(data.n_prompts, 25, replace=False):
        w = np.ones(data.n_prompts)
        w[p] += eps
        st = replicate(design, w)
        d_delta = ((st[K:] - st[:K]) - (base_stats[K:] - base_stats[:K])) / eps
        for k in (1, 2):  # clone and verbose: borrowed calibrator
            assert d_delta[k] == pytest.approx(exact[p, k], rel=1e-4, abs=1e-9)
    # and the calibrator's error is really there: the audit SE exceeds the residual term's alone
    fit = fit_mode(data, "monotone", ("base",))
    _, se, is_source = audit_statistics(fit.design, fit.stats, fit.infl)
    resid_only = np.sqrt(np.sum((infl["calibration"][:, K:] - infl["calibration"][:, K:].mean(0)) ** 2, axis=0)
                         * data.n_prompts / (data.n_prompts - 1))
    assert is_source.tolist() == [True, False, False]
    assert se[0] == pytest.approx(resid_only[0])  # the source: residual term only (conservative)
    assert np.all(se[1:] > resid_only[1:])


def test_audit_se_agrees_with_the_bootstrap_of_the_residual_mean():
    """The bootstrap refits the calibrator in every replicate: its SD of (augmented - plug-in) is the
    other route to the same SE. B=600 gives the bootstrap SD a relative error ~ 1/sqrt(2B) = 3%;
    the influence route is first order, so 15% covers both at n=800."""
    sim = simulate(800, PROTOCOL[:3], oracle_fraction=0.05, label_design="calibration_policy", audit_labels=60,
                   seed=5, length_bias=0.0)
    prep = prepare(sim.frame, calibration_policies=["base"], calibration_mode="monotone", n_bootstrap=600,
                   level_estimator="audited")
    from cje_engine.pipeline.direct import bootstrap_chunk

    reps = bootstrap_chunk(prep, 0, 600)
    K = 3
    fit = fit_mode(prep.design.data, "monotone", ("base",))
    _, se, _ = audit_statistics(fit.design, fit.stats, fit.infl)
    boot = np.std(reps[:, K:2 * K] - reps[:, :K], axis=0, ddof=1)
    for k in (1, 2):
        assert se[k] / boot[k] == pytest.approx(1.0, abs=0.15), (k, se[k], boot[k])


def _pooled(seed: int):
    return simulate(500, PROTOCOL, oracle_fraction=0.3, seed=seed, length_bias=0.0, judge_noise_sd=0.0)


def test_robust_pooling_equals_an_evaluation_without_the_failing_source():
    sim = _pooled(1)
    res = evaluate(sim.frame, inference="analytic", level_estimator="audited").to_dict()
    excl = res["calibration"]["excluded_sources"]
    assert [e["policy"] for e in excl] == ["unhelpful"]
    assert excl[0]["residual_mean"] < 0 and excl[0]["p_adjusted"] <= 0.05 and excl[0]["round"] == 1
    assert res["calibration"]["calibration_policies"] == ["base", "clone", "verbose"]
    assert res["policies"]["unhelpful"]["audit"]["calibrator"] == "excluded"
    # slow reference: the same evaluation with the other sources named by hand
    manual = evaluate(sim.frame, inference="analytic", calibration_policies=["base", "clone", "verbose"],
                      level_estimator="audited").to_dict()
    for name in res["policies"]:
        a, b = res["policies"][name], manual["policies"][name]
        for key in ("estimate", "se"):
            assert a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-15), (name, key)
        assert a["audit"]["residual_mean"] == pytest.approx(b["audit"]["residual_mean"], abs=1e-15)
    # contaminated: with the adversary's labels in the calibrator, the others' audits fail
    plain = prepare(sim.frame, inference="analytic", calibration_policies=["base", "clone", "verbose", "unhelpful"])
    assert [e["policy"] for e in plain.excluded] == ["unhelpful"]  # named sources are pooled robustly too


def test_a_single_source_is_never_excluded():
    sim = simulate(300, PROTOCOL, oracle_fraction=0.3, label_design="calibration_policy", audit_labels=40, seed=2)
    prep = prepare(sim.frame, calibration_policies=["base"], inference="analytic")
    assert prep.excluded == []


def test_mode_selection_difference_matches_an_explicit_loop():
    sim = simulate(400, PROTOCOL[:3], oracle_fraction=0.25, label_design="calibration_policy", audit_labels=60,
                   seed=9, length_bias=0.8, judge_noise_sd=0.0)
    data = _data(sim.frame, covariates=("response_length",))
    opts = EvaluationOptions.build(covariates=["response_length"])
    selection, fits = choose_mode(data, opts, ("base",))
    # explicit loop: per policy, mean over its labelled rows of (r_mono^2 - r_two^2); then the mean
    # over policies; SE from per-prompt sums
    lab = np.flatnonzero(data.labelled)
    per_prompt = np.zeros(data.n_prompts)
    pols = sorted(set(data.policy[lab].tolist()))
    for k in pols:
        rows = lab[data.policy[lab] == k]
        w = data.label_weight[rows] / data.label_weight[rows].sum()
        for i, wi in zip(rows, w):
            rm = data.label[i] - fits["monotone"].f[i]
            rt = data.label[i] - fits["two_stage"].f[i]
            per_prompt[data.prompt[i]] += wi * (rm**2 - rt**2) / len(pols)
    diff = per_prompt.sum()
    g = data.n_prompts
    se = np.sqrt(g / (g - 1) * np.sum((per_prompt - per_prompt.mean()) ** 2))
    assert selection["paired_difference"] == pytest.approx(diff, rel=1e-10)
    assert selection["paired_se"] == pytest.approx(se, rel=1e-10)
    assert selection["chosen"] == ("monotone" if diff < -MODE_Z * se else "two_stage")
    # the judge rewards length and verbose's answers are twice as long: two-stage fits its slice better
    assert selection["chosen"] == "two_stage" and diff > 0
    assert set(selection["labelled_rmse"]) == {"monotone", "two_stage"}


def test_requested_mode_and_no_covariates_skip_the_comparison():
    sim = simulate(300, PROTOCOL[:2], oracle_fraction=0.3, seed=4)
    data = _data(sim.frame, covariates=("response_length",))
    sel, fits = choose_mode(data, EvaluationOptions.build(covariates=["response_length"],
                                                          calibration_mode="monotone"), None)
    assert sel["chosen"] == "monotone" and list(fits) == ["monotone"] and sel["reason"] == "requested by the user"
    sel, fits = choose_mode(_data(sim.frame), EvaluationOptions.build(), None)
    assert sel["chosen"] == "monotone" and "paired_difference" not in sel


def test_robust_pooling_removes_the_most_extreme_source_when_p_values_underflow():
    """At 3,000 labels a policy the adversary contaminates fails with z ~ 40 and the adversary with
    z ~ 90: both Holm-adjusted p-values are 0.0 in floating point, so the order must come from |z|."""
    sim = simulate(60_000, PROTOCOL[:2] + PROTOCOL[3:], oracle_fraction=0.05, seed=0, judge_noise_sd=0.0,
                   length_bias=0.0)
    _, _, excluded = fit_calibration(_data(sim.frame), EvaluationOptions.build(calibration_mode="monotone"))
    assert [e["policy"] for e in excluded] == ["unhelpful"]
    assert excluded[0]["p_adjusted"] == 0.0  # the underflow this guards against


def test_a_replicate_without_calibration_labels_is_left_out_and_said():
    """Six calibration labels among 300 prompts: about e^-6 of the resamples draw none of them. Such a
    replicate has no calibrator; it is NaN, dropped from the intervals, and counted in a warning."""
    sim = simulate(300, PROTOCOL[:2], oracle_fraction=0.02, label_design="calibration_policy", audit_labels=0,
                   seed=1)
    prep = prepare(sim.frame, calibration_policies=["base"], n_bootstrap=50, min_labels=2)
    from cje_engine.direct.estimators import replicate as rep
    from cje_engine.pipeline.direct import bootstrap_chunk, finalize

    cal_prompts = np.unique(prep.design.data.prompt[prep.design.cal_rows])
    w = np.ones(prep.design.data.n_prompts)
    w[cal_prompts] = 0.0
    assert np.isnan(rep(prep.design, w)).all()
    chunk = bootstrap_chunk(prep, 0, 50)
    chunk[3] = np.nan  # as if replicate 3 had drawn none
    res = finalize(prep, [chunk]).to_dict()
    assert any("1 of 50 bootstrap replicates drew no calibration label" in x for x in res["warnings"])
    assert all(np.isfinite(p["ci"]).all() for p in res["policies"].values())


def test_source_audits_from_labelled_rows_equal_the_full_influence_route():
    """Robust pooling audits sources from their labelled rows alone; the numbers must be those of the
    full influence computation the reported audits use."""
    from cje_engine.pipeline.calibration import source_audits

    sim = _pooled(3)
    fit = fit_mode(_data(sim.frame), "monotone", None)
    d_fast, se_fast, src = source_audits(fit)
    d_full, se_full, src_full = audit_statistics(fit.design, fit.stats, fit.infl)
    assert src.tolist() == src_full.tolist() == [True] * 4
    np.testing.assert_allclose(d_fast, d_full, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(se_fast, se_full, rtol=1e-10)
    np.testing.assert_allclose(fit.f_lab, fit.f[fit.design.lab_rows], rtol=0, atol=0)


def test_auto_considers_a_smaller_two_stage_index_with_few_calibration_labels():
    """About 12 calibration labels (n=250, 5% of base, the grid's smallest cell): ``auto`` compares
    monotone with a two-stage index of ``two_stage_knots(n_cal, 1)`` segments (fewer than six) and records
    the count; its paired comparison is the explicit loop's as at any label count."""
    sim = simulate(250, PROTOCOL, oracle_fraction=0.05, label_design="calibration_policy", audit_labels=50,
                   seed=12, judge_noise_sd=0.0)
    data = _data(sim.frame, covariates=("response_length",))
    n_cal = int((data.labelled & (data.policy == data.policies.index("base"))).sum())
    assert 6 <= n_cal < 16
    selection, fits = choose_mode(data, EvaluationOptions.build(covariates=["response_length"]), ("base",))
    assert set(fits) == {"monotone", "two_stage"}
    assert selection["two_stage_knots"] == fits["two_stage"].design.n_knots == two_stage_knots(n_cal, 1) < 6
    assert "paired_difference" in selection and selection["chosen"] in ("monotone", "two_stage")


def test_a_source_that_cannot_leave_keeps_the_previous_rounds_fit(monkeypatch):
    """Robust pooling does not hold a round's fits beside the next round's: when the next round cannot be fitted
    (too few labels without the failing source) the failing source is kept and the previous round's fit is made
    again, the same numbers bit for bit, and nothing is excluded."""
    from cje_engine.pipeline import calibration

    data = _data(_pooled(1).frame)
    opts = EvaluationOptions.of(None, inference="analytic")
    first = choose_mode(data, opts, None)
    want = first[1][first[0]["chosen"]]
    calls = []

    def refusing(data, opts, sources, rows=None, shared=None):
        calls.append(sources)
        if len(calls) == 2:
            raise CJEInputError("too few labelled prompts to cross-fit")
        return choose_mode(data, opts, sources, rows, shared)

    monkeypatch.setattr(calibration, "choose_mode", refusing)
    fit, selection, excluded = calibration.fit_calibration(data, opts)
    assert excluded == [] and calls[0] is None and calls[2] is None and len(calls) == 3
    assert "unhelpful" not in calls[1]
    assert selection == first[0]
    assert np.array_equal(fit.F_all, want.F_all) and np.array_equal(fit.f_cal, want.f_cal)
    assert np.array_equal(fit.design.cal_rows, want.design.cal_rows)
