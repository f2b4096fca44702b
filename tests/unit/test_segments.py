"""Segments: each estimator pinned against a slow, obvious reference computation.

- segment x policy levels = a loop over segments running the plain evaluation on the data where only that
  segment's rows keep their policy (the rest calibrate but are another policy): same estimate, SE, interval;
- the Benjamini-Yekutieli level and the BH / Holm adjustment by hand;
- the clustered Wald omnibus test by hand (explicit per-prompt sums, explicit matrix inverse on a basis);
- pooling of small segments, error messages, and unchanged results without ``segment_by``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy.stats import chi2
from scipy.stats import t as student_t

from cje_engine import CJEInputError, evaluate
from cje_engine.inference.multiplicity import benjamini_hochberg, holm
from cje_engine.inference.segments import (by_interval_level, group_mean_residuals, paired_difference,
                                           reliability_bins, wald_test)
from cje_engine.pipeline.segments import plan_segments
from cje_engine.simulate.segments import segment_scenario, simulate_segments


@pytest.fixture(scope="module")
def loser():
    """A 'loser' dataset (new better overall, worse in segment d)."""
    return simulate_segments(segment_scenario("loser", seed=3, n_prompts=1200, oracle_fraction=0.15))


def _reference_cell(frame: pd.DataFrame, segment: str, **opts) -> dict:
    """The plain evaluation of one segment: rows outside it become policy '__rest__' (they still calibrate)."""
    f = frame.copy()
    f["response_id"] = f["policy"] + "-" + f["prompt_id"]  # the relabelled rows stay distinct
    f.loc[f["segment"] != segment, "policy"] = "__rest__"
    res = evaluate(f.drop(columns=["segment"]), **opts)
    return res.to_dict()["policies"]


@pytest.mark.parametrize("inference", ["analytic", "bootstrap"])
def test_segment_levels_equal_the_plain_estimator_run_segment_by_segment(loser, inference):
    opts = dict(calibration_mode="monotone", inference=inference, n_bootstrap=200, seed=5)
    seg = evaluate(loser.frame, segment_by=["segment"], **opts).segments
    assert seg.error_control.n_shown == 8
    for s in ("a", "b", "c", "d"):
        ref = _reference_cell(loser.frame, s, **opts)
        for pol in ("base", "new"):
            cell = next(c for c in seg.cells if c.segment == s and c.policy == pol)
            r = ref[pol]
            assert cell.claim_kind == "verified" and r["level_claim"] == "ok"
            assert cell.estimate == pytest.approx(r["estimate"], rel=1e-10, abs=1e-12)
            assert cell.se == pytest.approx(r["se"], rel=1e-10, abs=1e-12)
            assert cell.ci_marginal == pytest.approx(r["ci"], rel=1e-10, abs=1e-12)
            assert cell.ci == pytest.approx(r["ci"], rel=1e-10, abs=1e-12)  # every cell shown: level 1 - alpha
            assert cell.audit.residual_mean == pytest.approx(r["audit"]["residual_mean"], rel=1e-10, abs=1e-12)
            assert cell.n_labels == r["n_labelled"] and cell.n_rows == r["n_rows"]


def test_segment_comparisons_are_paired_differences_adjusted_over_the_family(loser):
    opts = dict(calibration_mode="monotone", inference="analytic", seed=5)
    res = evaluate(loser.frame, segment_by=["segment"], **opts)
    seg = res.segments
    p = np.array([c.p_value for c in seg.comparisons])
    assert [c.p_adjusted for c in seg.comparisons] == pytest.approx(benjamini_hochberg(p))
    holm_seg = evaluate(loser.frame, segment_by=["segment"], segment_claims="holm", **opts).segments
    assert [c.p_adjusted for c in holm_seg.comparisons] == pytest.approx(holm(p))
    assert holm_seg.error_control.claims_method == "holm"
    for c in seg.comparisons:
        a = next(x for x in seg.cells if x.segment == c.segment and x.policy == c.policy)
        b = next(x for x in seg.cells if x.segment == c.segment and x.policy == c.baseline)
        assert c.diff == pytest.approx(a.estimate - b.estimate, abs=1e-12)
        # the comparison's SE is at least as small as the unpaired one would be when levels share prompts
        # t reference with the smaller of the two levels' degrees of freedom (own labels)
        assert c.se > 0 and c.df is not None and 20 < c.df < 200
        assert c.p_value == pytest.approx(2 * student_t.sf(abs(c.diff / c.se), c.df))
    R = sum(c.significant for c in seg.comparisons)
    m = len(seg.comparisons)
    assert seg.error_control.n_selected == R and seg.error_control.n_comparisons == m
    assert seg.error_control.comparison_interval_level == pytest.approx(1 - R * 0.05 / m)
    for c in seg.comparisons:
        z = student_t.ppf(1 - R * 0.05 / m / 2, c.df)
        if c.significant:
            assert c.ci_fcr == pytest.approx([c.diff - z * c.se, c.diff + z * c.se])
            assert c.ci_fcr[0] > 0 or c.ci_fcr[1] < 0  # BY intervals of BH-selected comparisons exclude 0
        else:
            assert c.ci_fcr is None
    worse = [c.segment for c in seg.comparisons if c.worse]
    assert worse == ["d"]


def test_by_interval_level_by_hand():
    assert by_interval_level(3, 40, 0.05) == pytest.approx(1 - 3 * 0.05 / 40)
    assert by_interval_level(40, 40, 0.05) == pytest.approx(0.95)
    assert by_interval_level(0, 40, 0.05) is None


def _wald_by_hand(prompt, groups, resid, weight, n_prompts):
    """Per-prompt sums of every group's influence by explicit loops, covariance, inverse on a basis."""
    cols = []
    for g in groups:
        w = np.where(g, weight, 0.0)
        mean = np.sum(w * resid) / np.sum(w)
        psi = np.zeros(n_prompts)
        for i in range(resid.size):
            if g[i]:
                psi[prompt[i]] += w[i] * (resid[i] - mean) / np.sum(w)
        cols.append((mean, psi))
    d = np.array([c[0] for c in cols])
    P = np.stack([c[1] for c in cols], axis=1)
    P = P - P.mean(axis=0)
    V = P.T @ P * n_prompts / (n_prompts - 1)
    U, s, _ = np.linalg.svd(V)
    r = int(np.sum(s > 1e-9 * s[0]))
    B = U[:, :r]
    stat = float(d @ B @ np.linalg.inv(B.T @ V @ B) @ B.T @ d)
    return stat, r, float(chi2.sf(stat, r))


def test_omnibus_wald_equals_the_clustered_wald_by_hand():
    rng = np.random.default_rng(0)
    n_p, m = 150, 600
    prompt = rng.integers(0, n_p, m)
    seg = rng.integers(0, 3, m)
    score = rng.random(m)
    dec = np.minimum((score * 4).astype(int), 3)
    resid = rng.normal(0, 0.2, m) + 0.05 * (seg == 1) + rng.normal(0, 0.1, n_p)[prompt]
    weight = rng.uniform(1, 2, m)
    ms, ps, _ = group_mean_residuals(prompt, seg, resid, weight, 3, n_p)
    md, pd_, _ = group_mean_residuals(prompt, dec, resid, weight, 4, n_p)
    stat, df, p = wald_test(np.concatenate([ms, md[:3]]), np.hstack([ps, pd_[:, :3]]))
    groups = [seg == j for j in range(3)] + [dec == j for j in range(3)]  # the 4th decile follows from the rest
    ref = _wald_by_hand(prompt, groups, resid, weight, n_p)
    assert df == ref[1] == 6
    assert stat == pytest.approx(ref[0], rel=1e-8)
    assert p == pytest.approx(ref[2], rel=1e-6)


def test_omnibus_catches_errors_that_cancel_in_the_pooled_mean():
    d = simulate_segments(segment_scenario("opposite", seed=1, n_prompts=1500))
    seg = evaluate(d.frame, segment_by=["segment"], inference="analytic").segments
    star = seg.omnibus[0]
    assert star.policy == "*" and star.reject and star.p_value < 1e-6
    assert star.pooled_p_value > 0.05  # the pooled audit sees nothing
    means = {c.name: c.mean_residual for c in star.components if c.kind == "segment"}
    assert means["a"] < -0.03 and means["b"] > 0.03
    assert seg.recalibration.applied and seg.recalibration.covariates[-1].startswith("segment=")
    never = evaluate(d.frame, segment_by=["segment"], inference="analytic", segment_recalibrate="never").segments
    assert not never.recalibration.applied


def test_recalibration_with_the_segment_covariate_removes_the_plug_in_bias():
    d = simulate_segments(segment_scenario("opposite", seed=2, n_prompts=1500))
    fixed = evaluate(d.frame, segment_by=["segment"], inference="analytic").segments
    never = evaluate(d.frame, segment_by=["segment"], segment_recalibrate="never", inference="analytic").segments

    def plug_error(seg, s):
        return max(abs(c.plug_in - d.truth[(s, c.policy)]) for c in seg.cells if c.segment == s)

    assert fixed.recalibration.applied and fixed.recalibration.mode != never.recalibration.mode
    for s in ("a", "b"):  # measured: 0.12 / 0.105 with the pooled calibration, 0.019 / 0.040 with the covariate
        assert plug_error(never, s) > 0.08
        assert plug_error(fixed, s) < plug_error(never, s) / 2


def test_reliability_bins_by_hand():
    rng = np.random.default_rng(1)
    pred = rng.random(200)
    y = np.clip(pred + rng.normal(0, 0.1, 200), 0, 1)
    w = np.ones(200)
    prompt = np.arange(200)
    bins = reliability_bins(pred, y, w, prompt, 4)
    assert sum(b["n"] for b in bins) == 200 and len(bins) == 4
    edges = np.quantile(pred, [0, 0.25, 0.5, 0.75, 1])
    sel = (pred >= edges[1]) & (pred < edges[2])
    assert bins[1]["mean_label"] == pytest.approx(y[sel].mean())
    assert bins[1]["mean_predicted"] == pytest.approx(pred[sel].mean())
    r = (y - pred)[sel]
    assert bins[1]["se"] == pytest.approx(np.sqrt(np.sum((r - r.mean()) ** 2) / sel.sum() ** 2 * 200 / 199), rel=1e-9)


def test_paired_difference_by_hand():
    rng = np.random.default_rng(2)
    ra, rb = rng.normal(0.6, 0.02, 500), rng.normal(0.5, 0.02, 500)
    r = paired_difference(0.6, 0.5, ra, rb, np.zeros(10), np.zeros(10), 0.05)
    assert r["se"] == pytest.approx(np.std(ra - rb, ddof=1))
    assert r["ci"] == pytest.approx([0.1 - 1.959963985 * r["se"], 0.1 + 1.959963985 * r["se"]])


def test_small_segments_are_pooled_into_other_and_never_printed_alone():
    policy = np.tile([0, 1], 300)
    code = np.repeat([0, 0, 0, 1, 2], 120)
    labelled = np.ones(600, bool)
    group, names, info = plan_segments(policy, code, labelled, 2, ["big", "s1", "s2"], min_rows=100, min_labels=20)
    assert names == ["big", "other"]
    assert [i["status"] for i in info] == ["shown", "pooled", "pooled", "shown"]
    assert info[-1]["members"] == ["s1", "s2"]
    _, names2, info2 = plan_segments(policy, code, labelled, 2, ["big", "s1", "s2"], min_rows=200, min_labels=20)
    assert names2 == ["other"] or info2[-1]["status"] in ("shown", "too_few")


def test_too_small_other_has_no_level(loser):
    f = loser.frame.copy()
    rare = f["prompt_id"].isin(f["prompt_id"].drop_duplicates().iloc[:15])
    f.loc[rare, "segment"] = "rare"
    seg = evaluate(f, segment_by=["segment"], inference="analytic").segments
    other = [c for c in seg.cells if c.segment == "other"]
    assert other and all(c.claim_kind == "too_few" and c.estimate is None and c.ci is None for c in other)
    assert next(s for s in seg.segments if s.name == "other").members == ["rare"]
    assert all(c.claim_kind == "too_few" and c.p_value is None for c in seg.comparisons if c.segment == "other")
    assert seg.error_control.n_shown == 8 and seg.error_control.n_cells == 10
    assert seg.error_control.level_interval_level == pytest.approx(1 - 8 * 0.05 / 10)


def test_segments_of_two_columns_join_their_values(loser):
    f = loser.frame.copy()
    f["lang"] = np.where(f["prompt_id"].str[-1].isin(list("01234")), "en", "de")
    seg = evaluate(f, segment_by=["segment", "lang"], inference="analytic", segment_min_labels=10,
                   segment_min_rows=20).segments
    assert seg.columns == ["segment", "lang"]
    assert {s.name for s in seg.segments if s.status == "shown"} >= {"a / de", "a / en"}


def test_a_missing_segment_column_is_a_clear_input_error(loser):
    with pytest.raises(CJEInputError, match="column 'topic': segment_by names 'topic', which is not a column"):
        evaluate(loser.frame, segment_by=["topic"], inference="analytic")


def test_without_segment_by_the_result_has_no_segments_and_no_new_config_keys(loser):
    res = evaluate(loser.frame.drop(columns=["segment"]), inference="analytic")
    d = res.to_dict()
    assert "segments" not in d and res.segments is None
    assert not any(k.startswith("segment") for k in d["config"])


def test_segment_options_are_checked_before_any_data_is_read():
    from cje_engine.options import EvaluationOptions

    with pytest.raises(CJEInputError, match="segment_claims must be bh or holm"):
        EvaluationOptions.build(segment_by=["topic"], segment_claims="fdr")
    with pytest.raises(CJEInputError, match="segment_by column 'response_length' is also a covariate"):
        EvaluationOptions.build(segment_by="response_length", covariates=["response_length"])
    with pytest.raises(CJEInputError, match="segment_min_rows must be an integer"):
        EvaluationOptions.build(segment_by=["topic"], segment_min_rows="50")
    assert EvaluationOptions.build(segment_by="topic").segment_by == ("topic",)


def test_cli_segment_by_prints_the_segment_table(loser, tmp_path, capsys):
    from flows.cli.main import main

    src = tmp_path / "loser.parquet"
    loser.frame.to_parquet(src, index=False)
    code = main(["evaluate", str(src), "--out", str(tmp_path / "out"), "--segment-by", "segment",
                 "--inference", "analytic", "--exit-zero"])
    text = capsys.readouterr().out
    assert code == 0
    assert "segments by segment (baseline base" in text
    assert "WORSE" in text and "calibration by segment and score decile: passes" in text
    table = text[text.index("segments by segment"):]
    rows = [line for line in table.splitlines() if line.startswith(("a ", "b ", "c ", "d "))]
    assert len(rows) == 8
    code = main(["evaluate", str(src), "--out", str(tmp_path / "out2"), "--segment-by", "topic",
                 "--inference", "analytic"])
    assert code == 2
    assert "segment_by names 'topic', which is not a column" in capsys.readouterr().err


def test_robust_critical_value_against_a_brute_force_maximum_over_two_point_distributions():
    """The worst average non-coverage with E b^2 = m2 is attained by a mass at 0 and one at sqrt(t), t >= m2:
    a grid over t gives it by brute force; the critical value is where it equals alpha."""
    from scipy.stats import norm

    from cje_engine.inference.segments import max_noncoverage, robust_critical_value

    def r(b, chi):
        return norm.cdf(-chi - b) + norm.cdf(-chi + b)

    for m2 in (0.05, 0.5, 2.0, 10.0):
        for chi in (1.96, 2.5, 4.0, 8.0):
            t = m2 * np.exp(np.linspace(0, np.log(2000 / m2 + 2), 20000))
            brute = float(np.max((1 - m2 / t) * r(0, chi) + m2 / t * r(np.sqrt(t), chi)))
            assert max_noncoverage(m2, chi) == pytest.approx(brute, rel=1e-4, abs=1e-7)
        chi = robust_critical_value(m2, 0.05)
        t = m2 * np.exp(np.linspace(0, np.log(2000 / m2 + 2), 20000))
        assert float(np.max((1 - m2 / t) * r(0, chi) + m2 / t * r(np.sqrt(t), chi))) == pytest.approx(0.05, rel=1e-3)
    assert robust_critical_value(0.0, 0.05) == pytest.approx(1.959964, rel=1e-6)


def test_eb_pool_shrinks_by_hand():
    from scipy.stats import norm

    from cje_engine.inference.segments import eb_pool, robust_critical_value

    y, se = np.array([0.50, 0.55, 0.40, 0.62]), np.array([0.02, 0.03, 0.025, 0.04])
    r = eb_pool(y, se, 0.05)
    w0 = 1 / se ** 2
    m = np.sum(w0 * y) / np.sum(w0)
    mu2 = max(np.mean((y - m) ** 2 - se ** 2), 2 * np.sum(se ** 4) / (4 * np.sum(se ** 2)))
    w = mu2 / (mu2 + se ** 2)
    assert r["mean"] == pytest.approx(m) and r["mu2"] == pytest.approx(mu2)
    assert r["estimate"] == pytest.approx(m + w * (y - m))
    half = [robust_critical_value(se[j] ** 2 / mu2, 0.05) * w[j] * se[j]
            + norm.ppf(0.975) * (1 - w[j]) * np.sqrt(1 / np.sum(w0)) for j in range(4)]
    assert r["ci"][:, 1] - r["estimate"] == pytest.approx(half)
