"""The audit's t reference (issue 9, small calibration sets) against slow, obvious computations:
Welch-Satterthwaite degrees of freedom by hand, t p-values and quantiles by numerical integration of
the t density, and the engine's per-policy df from an explicit loop over prompts."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.integrate import quad
from scipy.optimize import brentq
from scipy.special import gammaln

from cje_engine import evaluate, prepare
from cje_engine.audit import audit_policies, satterthwaite_df
from cje_engine.errors import CJEInputError
from cje_engine.pipeline.calibration import audit_degrees_of_freedom, audit_statistics
from cje_engine.simulate.direct import protocol_policies, simulate


def _t_density(x: float, df: float) -> float:
    c = math.exp(gammaln((df + 1) / 2) - gammaln(df / 2)) / math.sqrt(df * math.pi)
    return c * (1 + x * x / df) ** (-(df + 1) / 2)


def _slow_two_sided_p(z: float, df: float) -> float:
    """2 * integral of the t density from |z| to infinity."""
    return 2 * quad(_t_density, abs(z), np.inf, args=(df,), epsabs=1e-13, epsrel=1e-11)[0]


def test_satterthwaite_df_by_hand():
    # two parts: (v1 + v2)^2 / (v1^2 / n1 + v2^2 / n2)
    v1, n1, v2, n2 = 0.3e-4, 49.0, 0.7e-4, 11.0
    hand = (v1 + v2) ** 2 / (v1 * v1 / n1 + v2 * v2 / n2)
    assert satterthwaite_df(np.array([v1, v2]), np.array([n1, n2])) == pytest.approx(hand, rel=1e-14)
    assert 11 < hand < 60  # between the smaller df and the sum of both
    # equal parts with equal df: the sum of the df; one part alone: its own df
    assert satterthwaite_df(np.array([1.0, 1.0]), np.array([10.0, 10.0])) == pytest.approx(20.0)
    assert satterthwaite_df(np.array([2.0, 0.0]), np.array([7.0, 3.0])) == pytest.approx(7.0)
    # an exact part (df inf) adds to the variance but not to its uncertainty
    assert satterthwaite_df(np.array([1.0, 3.0]), np.array([5.0, np.inf])) == pytest.approx(16 / (1 / 5))
    assert satterthwaite_df(np.array([1.0, 3.0]), np.array([np.inf, np.inf])) == np.inf
    assert np.isnan(satterthwaite_df(np.array([0.0, 0.0]), np.array([5.0, 5.0])))
    # vectorised over leading axes: row by row the same
    rng = np.random.default_rng(0)
    v, nu = rng.uniform(0, 1, (6, 3)), rng.integers(2, 60, (6, 3)).astype(float)
    rows = [float(np.sum(v[i]) ** 2 / np.sum(v[i] ** 2 / nu[i])) for i in range(6)]
    np.testing.assert_allclose(satterthwaite_df(v, nu), rows, rtol=1e-13)


@pytest.mark.parametrize("df", [4.6, 12.0, 27.3])
def test_audit_p_values_and_intervals_use_the_t_reference(df):
    delta = np.array([-0.09, 0.02, 0.0, -0.3])
    se = np.array([0.03, 0.025, 0.004, 0.05])
    n = np.array([50, 50, 400, 50])
    dfs = np.array([df, df, np.inf, df])
    out = audit_policies(delta, se, n, n, alpha=0.05, margin=0.05, df=dfs)
    normal = audit_policies(delta, se, n, n, alpha=0.05, margin=0.05)
    for k in (0, 1, 3):
        assert out[k]["p_value"] == pytest.approx(_slow_two_sided_p(delta[k] / se[k], df), rel=1e-8, abs=1e-14)
        assert out[k]["p_value"] > normal[k]["p_value"]  # heavier tails than the normal
        assert out[k]["df"] == pytest.approx(df)
        # the CI's half-width is the t quantile found by solving the slow tail for alpha/2
        q = brentq(lambda x: _slow_two_sided_p(x, df) - 0.05, 1.0, 20.0, xtol=1e-12)
        assert out[k]["ci"][1] - delta[k] == pytest.approx(q * se[k], rel=1e-7)
    assert out[2]["df"] is None and out[2]["p_value"] == normal[2]["p_value"]  # inf: exactly the normal
    assert out[2]["ci"] == normal[2]["ci"]
    assert [o["verdict"] for o in audit_policies(delta, se, n, n, 0.05, 0.05, df=np.full(4, np.inf))] == \
        [o["verdict"] for o in normal]


def test_audit_degrees_of_freedom_match_an_explicit_loop():
    """Borrowed policies: df of (residual-term variance, SE^2 minus it) with (own labelled prompts - 1,
    calibration prompts - 1), the variances summed prompt by prompt here; the source: inf."""
    sim = simulate(250, protocol_policies(), oracle_fraction=0.08, label_design="calibration_policy",
                   calibration_policy="base", audit_labels=50, seed=3, judge_noise_sd=0.0)
    prep = prepare(sim.frame, covariates=["response_length"], calibration_policies=["base"], inference="analytic")
    design, K = prep.design, prep.design.n_policies
    d = design.data
    delta, se, is_source = audit_statistics(design, prep.stats, prep.infl)
    n_own_prompts = np.array([len({int(d.prompt[i]) for i in design.lab_rows if d.policy[i] == k}) for k in range(K)])
    df = audit_degrees_of_freedom(design, prep.infl, se, is_source, n_own_prompts)
    g_cal = len({int(d.prompt[i]) for i in design.cal_rows})
    for k in range(K):
        if is_source[k]:
            assert df[k] == np.inf
            continue
        col = prep.infl["calibration"][:, K + k]
        G = col.size
        mean = sum(col) / G
        v_res = G / (G - 1) * sum((c - mean) ** 2 for c in col)
        v_cal = max(se[k] ** 2 - v_res, 0.0)
        g_own = len({int(d.prompt[i]) for i in design.lab_rows if d.policy[i] == k})
        hand = (v_res + v_cal) ** 2 / (v_res**2 / (g_own - 1) + v_cal**2 / (g_cal - 1))
        assert df[k] == pytest.approx(hand, rel=1e-9)
        assert min(g_own, g_cal) - 1 <= df[k] + 1e-9 and df[k] <= g_own + g_cal - 2 + 1e-9


def test_no_audit_below_min_labels_calibration_labels():
    """Fewer than ``min_labels`` calibration labels: every level is refused already and the calibrator's
    error cannot be estimated, so no policy is audited (not_run, with the reason in the basis too);
    from ``min_labels`` on the verdicts are the usual ones."""
    delta, se, n = np.array([-0.3, 0.0]), np.array([0.02, 0.01]), np.array([50, 50])
    small = audit_policies(delta, se, n, n, 0.05, 0.05, n_calibration=7, min_labels=10)
    assert [o["verdict"] for o in small] == ["not_run", "not_run"]
    assert "only 7 calibration labels" in small[0]["reason"] and small[0]["family_size"] == 0
    enough = audit_policies(delta, se, n, n, 0.05, 0.05, n_calibration=10, min_labels=10)
    assert enough[0]["verdict"] == "fail" and enough == audit_policies(delta, se, n, n, 0.05, 0.05)
    sim = simulate(250, protocol_policies(), oracle_fraction=0.03, label_design="calibration_policy",
                   calibration_policy="base", audit_labels=50, seed=5, judge_noise_sd=0.0)
    res = evaluate(sim.frame, covariates=["response_length"], calibration_policies=["base"],
                   inference="analytic").to_dict()
    assert res["data"]["n_calibration_labels"] < 10
    for e in res["policies"].values():
        assert e["audit"]["verdict"] == "not_run" and e["level_claim"] == "refused"
        assert "calibration labels (at least 10 needed)" in e["audit"]["reason"]
        if e["basis_code"] == "plug_in":  # (own-label levels where the plug-in's support is limited)
            assert "unaudited: only" in e["basis"] and "calibration labels (at least 10 needed)" in e["basis"]


def test_forced_two_stage_with_too_few_labels_for_one_segment_is_a_clear_error():
    """5 calibration labels and one covariate: not even a one-segment index keeps 2 labels per parameter
    (6 needed); ``calibration_mode='two_stage'`` is refused naming the labels and the option, instead of
    fitting a six-segment index to 5 labels as before."""
    sim = simulate(250, protocol_policies(), oracle_fraction=0.05, label_design="calibration_policy",
                   calibration_policy="base", audit_labels=50, seed=11, judge_noise_sd=0.0)
    frame = sim.frame.copy()
    lab = frame.index[(frame["policy"] == "base") & frame["oracle_label"].notna()]
    frame.loc[lab[5:], "oracle_label"] = np.nan
    with pytest.raises(CJEInputError, match=r"needs at least 6 calibration labels .*5 given.*monotone") as err:
        prepare(frame, covariates=["response_length"], calibration_policies=["base"], calibration_mode="two_stage",
                inference="analytic")
    assert err.value.option == "calibration_mode" and err.value.column == "oracle_label"
