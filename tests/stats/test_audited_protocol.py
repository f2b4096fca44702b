"""Statistical properties of the audited protocol (issue #9) on simulated data with known truth.

Designs: labels on ``base`` plus 50-label audit slices on the other policies (the paper's protocol),
or every policy labelled at random (pooled); clones of ``base`` whose calibration transports exactly
(``judge_noise_sd=0``, no length bias, so E[Y | S] is the same for them) and one adversarial policy
that fools the judge.

Tolerances are binomial. A rate estimated from R datasets has SE sqrt(p (1 - p) / R); intervals and
audits of several policies in one dataset share the calibrator, so they are not independent and the
bands below count datasets, not intervals (conservative); 3 SE leaves a ~0.1% chance of a false
failure per check. Seeds are fixed; the bounds were derived from R, never tuned.
"""
from __future__ import annotations

import math

import pytest

from cje_engine import evaluate
from cje_engine.errors import CJEInputError
from cje_engine.simulate.direct import PROTOCOL_TRANSPORTED, PolicySpec, protocol_policies, simulate

ALPHA = 0.05
CLONES = ("clone", "clone2", "clone3")
POLICIES = (PolicySpec("base", 0.8), *(PolicySpec(c, 0.8) for c in CLONES),
            PolicySpec("unhelpful", -1.0, adversarial=True))
EXACT = {"length_bias": 0.0, "judge_noise_sd": 0.0}


def _band(R: int, p: float) -> float:
    return 3 * math.sqrt(p * (1 - p) / R)


def _protocol(n: int, frac: float, seed: int):
    return simulate(n, POLICIES, oracle_fraction=frac, label_design="calibration_policy", audit_labels=50,
                    seed=seed, **EXACT)


def _run_protocol(R: int, n: int, frac: float, seed0: int, **opts) -> dict:
    cover = fails = safe = 0
    for r in range(R):
        sim = _protocol(n, frac, seed0 + r)
        res = evaluate(sim.frame, level_estimator="audited", calibration_policies=["base"], calibration_mode="monotone", alpha=ALPHA,
                       seed=r, **opts).to_dict()
        pols = res["policies"]
        cover += sum(pols[p]["ci"][0] <= sim.true_values[p] <= pols[p]["ci"][1] for p in ("base", *CLONES))
        fails += sum(pols[c]["audit"]["verdict"] == "fail" for c in CLONES)
        adv = pols["unhelpful"]
        safe += adv["level_claim"] == "refused" or (adv["audit"]["verdict"] == "fail"
                                                   and adv["basis_code"] == "recalibrated")
    return {"coverage": cover / (4 * R), "false_fail": fails / (3 * R), "safe": safe / R}


def test_audited_levels_cover_and_audits_rarely_fail_falsely():
    """n=400, 10% of base labelled (40 calibration labels), analytic route: the clones' plug-in
    intervals cover at 0.95 (band +/- 3 SE over R datasets), a clone's audit fails at most at rate
    alpha (Holm-adjusted; + 3 SE over R datasets) although the calibrator it borrows has only 40
    labels, and the adversary is never reported at its borrowed level."""
    R = 150
    out = _run_protocol(R, 400, 0.10, 81_000, inference="analytic")
    assert abs(out["coverage"] - 0.95) <= _band(R, 0.95), out
    assert out["false_fail"] <= ALPHA + _band(R, ALPHA), out
    assert out["safe"] >= 0.97, out


def test_audits_with_25_calibration_labels_hold_their_level():
    """25 calibration labels (n=250, 10%) against 50-label audit slices: before the audit carried the
    calibrator's error, 17.5% of transported policies failed. Bound: alpha + 3 SE over R datasets."""
    R = 200
    fails = 0
    for r in range(R):
        sim = _protocol(250, 0.10, 91_000 + r)
        res = evaluate(sim.frame, level_estimator="audited", calibration_policies=["base"], calibration_mode="monotone",
                       inference="analytic").to_dict()
        fails += sum(res["policies"][c]["audit"]["verdict"] == "fail" for c in CLONES)
    assert fails / (3 * R) <= ALPHA + _band(R, ALPHA), fails


def test_pooled_design_excludes_the_adversary_and_keeps_the_others():
    """Every policy 30% labelled, the adversary's labels among them: robust pooling removes the
    adversary from the calibrator first in >= 97% of datasets (its residual z is ~-15); a further
    (false) exclusion of a clone happens at most at the family-wise rate alpha of the Holm-adjusted
    source audits (+ 3 SE over R datasets); the clones' audits then fail at most at rate alpha."""
    R = 60
    first = extra = fails = 0
    for r in range(R):
        sim = simulate(300, POLICIES, oracle_fraction=0.3, seed=95_000 + r, **EXACT)
        res = evaluate(sim.frame, level_estimator="audited", calibration_mode="monotone", inference="analytic").to_dict()
        out = [e["policy"] for e in res["calibration"]["excluded_sources"]]
        first += out[:1] == ["unhelpful"]
        extra += len(out) > 1
        fails += sum(res["policies"][c]["audit"]["verdict"] == "fail" for c in ("base", *CLONES))
    assert first / R >= 0.97, first
    assert extra / R <= ALPHA + _band(R, ALPHA), extra
    assert fails / (4 * R) <= ALPHA + _band(R, ALPHA), fails


@pytest.mark.slow
@pytest.mark.parametrize("n,frac", [(250, 0.10), (1000, 0.05), (1000, 0.25)])
def test_audited_bootstrap_intervals_cover_slow(n, frac):
    """The reported route (bootstrap, B=400): coverage within 3 SE of 0.95 over R=200 datasets."""
    R = 200
    out = _run_protocol(R, n, frac, 99_000, n_bootstrap=400)
    assert abs(out["coverage"] - 0.95) <= _band(R, 0.95), out
    assert out["false_fail"] <= ALPHA + _band(R, ALPHA), out
    assert out["safe"] >= 0.97, out


def test_audited_levels_are_more_precise_than_own_label_levels():
    """Why the protocol reuses the calibration: on the clones the audited (plug-in) level's SE is
    well below the own-label level's (50 labels), here by a factor > 1.5 on every dataset."""
    checked = 0
    for r in range(5):
        sim = _protocol(1000, 0.25, 97_000 + r)
        res = evaluate(sim.frame, level_estimator="audited", calibration_policies=["base"], calibration_mode="monotone",
                       inference="analytic").to_dict()
        for c in CLONES:
            p = res["policies"][c]
            if p["basis_code"] == "plug_in":
                checked += 1
                assert p["augmented"]["se"] > 1.5 * p["plug_in"]["se"], (c, p["augmented"]["se"], p["plug_in"]["se"])
    assert checked >= 12  # of 15: a clone's audit fails at most at rate alpha, so nearly all are plug-ins


@pytest.mark.slow
def test_audits_with_about_12_calibration_labels_hold_their_level_slow():
    """The grid's smallest cell (benchmarks/bench_protocol.py at n=250, 5% of base labelled: about 12
    calibration labels; the protocol's seven policies, a judge that rewards length, ``auto`` mode with
    the length covariate, bootstrap). Before the two-stage index could be fitted below 16 labels and the
    audit used a t reference, the monotone calibration left the length bias in and 8.4% of the
    transported policies' audits failed (verbose 19%; 1.0% after, audits run only from 10 calibration
    labels, `min_labels`). Bound: alpha + 3 SE of a rate over the 5 R audits, the SE inflated by a design effect
    of 2.5 (audits of one dataset share its calibrator; the measured variance ratio of per-dataset fail
    counts to the binomial's was 2.2-2.3 at this cell, benchmarks/RESULTS.md): 0.05 + 3 x 0.011 = 0.083."""
    R, deff = 200, 2.5
    audited = [p for p in PROTOCOL_TRANSPORTED if p != "base"]
    fails = n_audits = adversary_fails = adversary_safe = n_sets = n_audited_sets = 0
    for r in range(R):
        sim = simulate(250, protocol_policies(), oracle_fraction=0.05, label_design="calibration_policy",
                       calibration_policy="base", audit_labels=50, seed=123_000 + r, judge_noise_sd=0.0)
        try:
            res = evaluate(sim.frame, level_estimator="audited", covariates=["response_length"], calibration_policies=["base"],
                           n_bootstrap=200, seed=r).to_dict()
        except CJEInputError:  # 5-6 calibration labels cannot be cross-fitted: nothing is audited
            continue
        pols = res["policies"]
        n_sets += 1
        fails += sum(pols[p]["audit"]["verdict"] == "fail" for p in audited)
        n_audits += sum(pols[p]["audit"]["verdict"] != "not_run" for p in audited)
        adv = pols["unhelpful"]
        if adv["audit"]["verdict"] != "not_run":  # not run below min_labels calibration labels
            n_audited_sets += 1
            adversary_fails += adv["audit"]["verdict"] == "fail"
        adversary_safe += adv["level_claim"] == "refused" or adv["basis_code"] == "recalibrated"
    bound = ALPHA + 3 * math.sqrt(deff * ALPHA * (1 - ALPHA) / n_audits)
    assert fails / n_audits <= bound, (fails, n_audits, bound)
    # the audit keeps its power where it runs (t with >= ~9 df at 10 calibration labels), and the
    # adversary is never reported at its borrowed level
    assert adversary_fails / n_audited_sets >= 0.97, (adversary_fails, n_audited_sets)
    assert adversary_safe == n_sets, (adversary_safe, n_sets)


def test_protocol_data_without_named_calibration_policies_pools_the_audit_slices():
    """The protocol's data (labels on base, 50-label slices elsewhere) evaluated at the defaults, no
    ``calibration_policies``: every labelled row may calibrate, so the clones' slices join base's labels
    and robust pooling removes the adversary's (its slice's residual z is about -15) first in >= 97% of
    datasets, leaving exactly the labels of base and the clones in the calibrator; a clone is then
    audited out of fold and fails at most at rate alpha (+ 3 SE over the 3 R audits, as above), the
    intervals of base and the clones cover within 3 SE of 0.95 (counted over datasets), and every
    plug-in is more precise than with base's ~40 labels alone (measured SE ratio 0.38-0.88 here), which
    is why the benchmark grid's rankings beat the reference's (benchmarks/RESULTS.md, "Audit slices
    that pass calibrate")."""
    R = 80
    first = fails = cover = 0
    for r in range(R):
        sim = _protocol(400, 0.10, 131_000 + r)
        pooled = evaluate(sim.frame, level_estimator="audited", calibration_mode="monotone", alpha=ALPHA, inference="analytic").to_dict()
        named = evaluate(sim.frame, level_estimator="audited", calibration_policies=["base"], calibration_mode="monotone", alpha=ALPHA,
                         inference="analytic").to_dict()
        excluded = [e["policy"] for e in pooled["calibration"]["excluded_sources"]]
        first += excluded[:1] == ["unhelpful"]
        if excluded == ["unhelpful"]:
            labelled = sim.frame[sim.frame["policy"] != "unhelpful"]["oracle_label"].notna().sum()
            assert pooled["calibration"]["n_train"] == labelled, (r, pooled["calibration"]["n_train"], labelled)
        pols = pooled["policies"]
        fails += sum(pols[c]["audit"]["verdict"] == "fail" for c in CLONES)
        cover += sum(pols[p]["ci"][0] <= sim.true_values[p] <= pols[p]["ci"][1] for p in ("base", *CLONES))
        for p in ("base", *CLONES):
            assert pols[p]["plug_in"]["se"] < named["policies"][p]["plug_in"]["se"], (r, p)
        assert pols["unhelpful"]["basis_code"] != "plug_in", (r, pols["unhelpful"]["basis"])
    assert first / R >= 0.97, first
    assert fails / (3 * R) <= ALPHA + _band(R, ALPHA), fails
    assert abs(cover / (4 * R) - 0.95) <= _band(R, 0.95), cover
