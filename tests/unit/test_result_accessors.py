"""`EvaluationResult.confint / compare / p_adjust / summary` against slow, obvious reference computations.

Each accessor is checked against a hand computation from the replicates (sorted-order percentiles, max-T by
a loop, Holm by its definition) and against the result's own reported numbers (the interval of every
policy at the result's level, every reported comparison), and after a round trip through the result.json
and terms.npz that `cje evaluate` writes (on the Arena sample).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cje_engine import evaluate
from cje_engine.errors import CJEInputError
from cje_engine.result import EvaluationResult
from cje_engine.simulate.direct import PolicySpec, simulate

REPO = Path(__file__).resolve().parents[2]
POLS = (PolicySpec("base", 0.8), PolicySpec("clone", 0.8), PolicySpec("better", 0.9),
        PolicySpec("worse", 0.6), PolicySpec("cand", 0.7, verbosity=3.0))


def _frame():
    sim = simulate(600, POLS, oracle_fraction=0.3, label_design="calibration_policy", audit_labels=40, seed=3)
    frame = sim.frame.copy()
    frame.loc[frame["policy"] == "cand", ["oracle_label", "label_probability"]] = np.nan  # no own labels
    return frame


@pytest.fixture(scope="module")
def verified():
    """Default (verified) levels, bootstrap route: power-tuned levels (bca_expanded) and one assumes-transport
    policy without an estimate (cand)."""
    return evaluate(_frame(), n_bootstrap=300, seed=0)


@pytest.fixture(scope="module")
def plug_in():
    """The paper's protocol (audited): calibrated plug-ins with percentile intervals; cand trusted."""
    return evaluate(_frame(), n_bootstrap=300, seed=0, level_estimator="audited")


@pytest.fixture(scope="module")
def analytic():
    """Analytic route, the protocol's plug-ins: normal intervals from the influence terms."""
    return evaluate(_frame(), seed=0, inference="analytic", level_estimator="audited")


@pytest.fixture(scope="module")
def analytic_verified():
    """Analytic route, verified levels (skew_t)."""
    return evaluate(_frame(), seed=0, inference="analytic")


# ------------------------------------------------------------------------------ references


def hand_quantile(values, q: float) -> float:
    """numpy's default (linear) quantile, by sorting: position q (n - 1) between two order statistics."""
    v = sorted(x for x in values if math.isfinite(x))
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (pos - lo) * (v[hi] - v[lo])


def hand_sd(values) -> float:
    v = [x for x in values if math.isfinite(x)]
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))


def reps_of(res: EvaluationResult, name: str) -> np.ndarray:
    k = list(res.model.policies).index(name)
    return res.replicates[:, res.columns[k]]


def clip(x: float, res: EvaluationResult) -> float:
    lo, hi = res.model.config["label_scale"]
    return min(max(x, lo), hi)


# ------------------------------------------------------------------------------ confint


def test_confint_at_the_results_level_is_the_reported_interval(verified, plug_in, analytic, analytic_verified):
    for res in (verified, plug_in, analytic, analytic_verified):
        ci = res.confint(level=1 - res.model.inference.alpha)
        for name, p in res.model.policies.items():
            if p.estimate is None or p.level_claim == "refused":
                continue
            assert ci.loc[name, "ci_low"] == pytest.approx(p.ci[0], abs=1e-12), (name, ci.loc[name, "method"])
            assert ci.loc[name, "ci_high"] == pytest.approx(p.ci[1], abs=1e-12), (name, ci.loc[name, "method"])


@pytest.mark.parametrize("level", [0.95, 0.8])
def test_confint_percentile_by_hand(plug_in, level):
    ci = plug_in.confint(level=level)
    checked = 0
    for name, p in plug_in.model.policies.items():
        if p.estimate is None or p.level_claim == "refused" or p.ci_method != "percentile":
            continue
        r = reps_of(plug_in, name).tolist()
        a = 1 - level
        assert ci.loc[name, "method"] == "percentile"
        assert ci.loc[name, "ci_low"] == pytest.approx(clip(hand_quantile(r, a / 2), plug_in), abs=1e-12)
        assert ci.loc[name, "ci_high"] == pytest.approx(clip(hand_quantile(r, 1 - a / 2), plug_in), abs=1e-12)
        checked += 1
    assert checked >= 3


def test_confint_normal_by_hand_on_the_analytic_route(analytic):
    from scipy.stats import norm

    ci = analytic.confint(level=0.9)
    checked = 0
    for k, (name, p) in enumerate(analytic.model.policies.items()):
        if p.estimate is None or p.ci_method != "normal":
            continue
        psi = analytic.influence[:, analytic.columns[k]].tolist()
        g = len(psi)
        m = sum(psi) / g
        se = math.sqrt(sum((x - m) ** 2 for x in psi) * g / (g - 1))
        z = norm.ppf(0.95)
        assert ci.loc[name, "ci_low"] == pytest.approx(clip(p.estimate - z * se, analytic), abs=1e-12)
        assert ci.loc[name, "ci_high"] == pytest.approx(clip(p.estimate + z * se, analytic), abs=1e-12)
        checked += 1
    assert checked >= 1


def test_confint_joint_is_max_t_by_a_loop(verified, plug_in):
    for res in (verified, plug_in):
        names = [n for n, p in res.model.policies.items() if p.estimate is not None and p.level_claim != "refused"]
        est = {n: res.model.policies[n].estimate for n in names}
        R = {n: reps_of(res, n) for n in names}
        rows = [b for b in range(res.replicates.shape[0]) if all(math.isfinite(R[n][b]) for n in names)]
        se = {n: hand_sd([R[n][b] for b in rows]) for n in names}
        tmax = []
        for b in rows:
            tmax.append(max(abs(R[n][b] - est[n]) / se[n] for n in names))
        c = hand_quantile(tmax, 0.95)
        ci = res.confint(level=0.95, joint=True)
        for n in names:
            assert ci.loc[n, "ci_low"] == pytest.approx(clip(est[n] - c * se[n], res), abs=1e-10)
            assert ci.loc[n, "ci_high"] == pytest.approx(clip(est[n] + c * se[n], res), abs=1e-10)
            assert ci.loc[n, "method"] == "max-t (bootstrap)"
        marginal = res.confint(level=0.95)
        wider = [(ci.loc[n, "ci_high"] - ci.loc[n, "ci_low"]) >= (marginal.loc[n, "ci_high"] - marginal.loc[n, "ci_low"])
                 - 1e-9 for n in names if marginal.loc[n, "method"] == "percentile"]
        assert all(wider)


def test_confint_never_passes_an_assumed_level_as_verified(verified, plug_in):
    """cand has no own labels: no verified level. Verified results: no interval at all (NaN, out of the joint
    family); under the protocol its plug-in gets one, flagged ``verified`` False."""
    assert verified.model.policies["cand"].level_claim == "assumes_transport"
    for joint in (False, True):
        ci = verified.confint(joint=joint)
        assert math.isnan(ci.loc["cand", "ci_low"]) and math.isnan(ci.loc["cand", "ci_high"])
        assert not ci.loc["cand", "verified"] and ci.loc["cand", "method"].startswith("none")
        assert ci.loc["base", "verified"] and math.isfinite(ci.loc["base", "ci_low"])
    # the joint family leaves cand out: the same intervals as the family without it
    others = [n for n in verified.model.policies if n != "cand"]
    a, b = verified.confint(joint=True), verified.confint(others, joint=True)
    assert np.allclose(a.loc[others, ["ci_low", "ci_high"]], b.loc[others, ["ci_low", "ci_high"]])
    p = plug_in.model.policies["cand"]
    ci = plug_in.confint()
    if p.estimate is not None and p.level_claim != "refused":
        assert ci.loc["cand", "level_claim"] == p.level_claim
        assert not ci.loc["cand", "verified"] or p.level_claim == "ok"


def test_confint_rejects_unknown_policies_and_levels(verified):
    with pytest.raises(ValueError, match="'nope' is not in the result"):
        verified.confint(["nope"])
    with pytest.raises(ValueError, match="level must be in"):
        verified.confint(level=95)


# ------------------------------------------------------------------------------ compare


def test_compare_equals_the_results_comparisons(verified, plug_in, analytic, analytic_verified):
    for res in (verified, plug_in, analytic, analytic_verified):
        n_equal = 0
        for c in res.model.comparisons:
            got = res.compare(c.a, c.b, level=1 - res.model.inference.alpha)
            assert got.reported == c.reported
            if not c.reported:
                assert got.diff is None and got.not_estimable == c.not_estimable
                continue
            assert got.diff == c.diff and got.se == pytest.approx(c.se, abs=1e-15)
            assert got.ci == pytest.approx(c.ci, abs=1e-12) and got.p_value == pytest.approx(c.p_value, abs=1e-15)
            assert got.claim_kind == c.claim_kind
            back = res.compare(c.b, c.a, level=1 - res.model.inference.alpha)
            assert back.diff == pytest.approx(-c.diff) and back.p_value == pytest.approx(c.p_value)
            n_equal += 1
        assert n_equal >= 3


def test_compare_by_hand_from_paired_replicates(plug_in):
    a, b = "better", "worse"
    got = plug_in.compare(a, b, level=0.9)
    ra, rb = reps_of(plug_in, a), reps_of(plug_in, b)
    D = [x - y for x, y in zip(ra, rb) if math.isfinite(x - y)]
    est = plug_in.model.policies
    assert got.diff == pytest.approx(est[a].estimate - est[b].estimate)
    assert got.se == pytest.approx(hand_sd(D), rel=1e-12)
    assert got.ci == pytest.approx([hand_quantile(D, 0.05), hand_quantile(D, 0.95)], abs=1e-12)
    below = sum(1 for x in D if x <= 0)
    above = sum(1 for x in D if x >= 0)
    assert got.p_value == pytest.approx(min(1.0, 2 * min(1 + below, 1 + above) / (len(D) + 1)))


def test_compare_with_an_unverified_policy_is_not_estimable(verified):
    got = verified.compare("cand", "base")
    assert got.reported is False and got.diff is None and got.ci is None and "cand" in got.not_estimable


# ------------------------------------------------------------------------------ p_adjust


def test_p_adjust_holm_bonferroni_and_max_t_by_hand(plug_in):
    holm = plug_in.p_adjust("holm")
    p = holm["p_value"].tolist()
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    ref, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, (m - rank) * p[i])
        ref[i] = min(running, 1.0)
    assert holm["p_adjusted"].tolist() == pytest.approx(ref)
    assert plug_in.p_adjust("bonferroni")["p_adjusted"].tolist() == pytest.approx([min(1.0, m * x) for x in p])
    # the result's own adjustment (its multiplicity method) agrees when it is Holm
    if plug_in.model.multiplicity.method == "holm":
        shown = [c.p_adjusted for c in plug_in.model.comparisons if c.reported]
        assert holm["p_adjusted"].tolist() == pytest.approx(shown)
    # single-step max-T by a loop over the replicates
    mt = plug_in.p_adjust("max-t")
    pairs = list(zip(mt["a"], mt["b"], mt["diff"], mt["se"]))
    R = {n: reps_of(plug_in, n) for n in plug_in.model.policies}
    rows = [b for b in range(plug_in.replicates.shape[0])
            if all(math.isfinite(R[a][b] - R[c][b]) for a, c, _, _ in pairs)]
    sds = [hand_sd([R[a][b] - R[c][b] for b in rows]) for a, c, _, _ in pairs]
    tmax = [max(abs(R[a][b] - R[c][b] - d) / s for (a, c, d, _), s in zip(pairs, sds)) for b in rows]
    for (a, c, d, se), raw, got in zip(pairs, mt["p_value"], mt["p_adjusted"]):
        t = abs(d) / se
        assert got == pytest.approx(max(raw, (1 + sum(1 for x in tmax if x >= t)) / (len(tmax) + 1)))
    assert (mt["p_adjusted"] >= mt["p_value"]).all()
    with pytest.raises(ValueError, match="method must be"):
        plug_in.p_adjust("bh-ish")


# ------------------------------------------------------------------------------ summary


def test_summary_is_the_reported_figures(verified):
    s = verified.summary()
    assert list(s.index) == list(verified.model.policies)
    for name, p in verified.model.policies.items():
        assert s.loc[name, "level_claim"] == p.level_claim and s.loc[name, "basis_code"] == p.basis_code
        if p.estimate is None:
            assert math.isnan(s.loc[name, "estimate"]) and math.isnan(s.loc[name, "ci_low"])
        elif p.level_claim != "refused":
            assert (s.loc[name, "estimate"], s.loc[name, "ci_low"], s.loc[name, "ci_high"]) == (p.estimate, *p.ci)
    assert {"estimate", "se", "ci_low", "ci_high", "level_claim", "verified"} <= set(s.columns)


# ------------------------------------------------------------------------------ round trip


def test_result_without_terms_says_how_to_get_them(verified):
    bare = EvaluationResult.from_dict(verified.to_dict())
    assert bare.summary().shape[0] == len(verified.model.policies)
    with pytest.raises(ValueError, match="terms.npz"):
        bare.confint()


def test_terms_of_another_result_are_refused(tmp_path, verified):
    (tmp_path / "result.json").write_text(json.dumps(verified.to_dict()))
    verified.save_terms(tmp_path / "terms.npz")
    loaded = EvaluationResult.load(tmp_path / "result.json")
    assert loaded.confint().equals(verified.confint())
    edited = verified.to_dict()
    edited["policies"]["base"]["estimate"] += 0.01
    (tmp_path / "result.json").write_text(json.dumps(edited))
    with pytest.raises(CJEInputError, match="terms belong to another result"):
        EvaluationResult.load(tmp_path / "result.json")


def test_round_trip_of_cje_evaluate_on_the_arena_sample(tmp_path, arena_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "RAY_"))}
    env["PYTHONPATH"] = str(REPO)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "flows.cli.main", "evaluate", str(arena_dir), "--out", str(out),
                        "--n-bootstrap", "200", "--exit-zero"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (out / "terms.npz").is_file()
    res = EvaluationResult.load(out / "result.json")
    alpha = res.model.inference.alpha
    ci = res.confint(level=1 - alpha)
    n = 0
    for name, p in res.model.policies.items():
        if p.estimate is not None and p.level_claim != "refused":
            assert [ci.loc[name, "ci_low"], ci.loc[name, "ci_high"]] == pytest.approx(p.ci, abs=1e-12)
            n += 1
    assert n >= 1
    for c in res.model.comparisons:
        got = res.compare(c.a, c.b, level=1 - alpha)
        assert got.reported == c.reported
        if c.reported:
            assert (got.diff, got.ci, got.p_value) == (pytest.approx(c.diff), pytest.approx(c.ci), pytest.approx(c.p_value))
    assert res.summary().shape[0] == len(res.model.policies)
    assert res.confint(joint=True)["method"].isin(["max-t (bootstrap)", "none: no quotable level"]).all()


# ------------------------------------------------------------------------------ typed readers


def test_reports_and_gate_read_the_typed_result_as_they_read_its_json(verified):
    """The table, the report and the gate take the `EvaluationResult` (or its model) and read it through the
    typed model: the same text as from the result's JSON."""
    from flows.cli.commands.gate import judge
    from flows.reports.evaluation import render_report
    from flows.reports.table import format_table

    d = verified.to_dict()
    assert format_table(verified) == format_table(verified.model) == format_table(d)
    assert render_report(verified, title="t") == render_report(d, title="t")
    a = judge(verified, "base", fail_if=["worse", "refused"], candidates=["cand", "worse"])
    b = judge(d, "base", fail_if=["worse", "refused"], candidates=["cand", "worse"])
    assert [(c.candidate, c.failed, c.reason) for c in a] == [(c.candidate, c.failed, c.reason) for c in b]
    assert any("not estimable" in c.reason for c in a if c.candidate == "cand")
