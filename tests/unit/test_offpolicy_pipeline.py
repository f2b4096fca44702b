"""The off-policy mode's entry point (cje_engine.pipeline.offpolicy): shared machinery with Direct,
replicates against a slow reference, determinism, result schema, gates, and the flow helpers."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cje_engine.pipeline import direct as pipeline
from cje_engine.calibration.calibrators import IsotonicCalibrator
from cje_engine.errors import CJEInputError
from cje_engine.direct.estimators import bootstrap_weights
from cje_engine.offpolicy.inputs import FreshData, LoggedData, Rewards
from cje_engine.offpolicy.target import evaluate_target
from cje_engine.pipeline.offpolicy import (_replicate, bootstrap_chunk, evaluate_offpolicy, finalize, flow_columns,
                                           flow_options, flow_policies, prepare, rewards_and_outcome)
from cje_engine.pipeline.offpolicy_options import OffPolicyOptions
from cje_engine.simulate.logs import simulate_logs


@pytest.fixture(scope="module")
def sim_frames():
    sim = simulate_logs(n_prompts=150, length=8, targets={"near": 0.05, "far": 1.0}, seed=4, label_fraction=0.5)
    logged, fresh = sim.to_frames("base")
    return sim, logged, fresh


@pytest.fixture(scope="module")
def hybrid_prep(sim_frames):
    _, logged, fresh = sim_frames
    return prepare(logged, fresh, mode="hybrid", n_bootstrap=60, seed=3)


def test_rewards_are_directs_calibration(hybrid_prep):
    prep = hybrid_prep
    design = prep.direct.design
    d = design.data
    R, q = rewards_and_outcome(design)
    np.testing.assert_array_equal(R, prep.direct.f)  # Direct's cross-fitted values, row for row
    # q is out of fold for every row: a reference fit without the row's fold
    cr = design.cal_rows
    for k in range(d.n_folds):
        keep = d.fold[cr] != k
        ref = IsotonicCalibrator(clip=d.label_scale).fit(d.score[cr][keep], d.label[cr][keep])
        rows = d.fold == k
        np.testing.assert_allclose(q[rows], ref.predict(d.score[rows]), atol=1e-12)
    # the Direct candidate equals Direct's plug-in for the candidate's fresh draws
    k = d.policies.index("near")
    assert prep.reports["near"].estimates["direct"].value == pytest.approx(prep.direct.stats[k], abs=1e-12)


def test_replicate_matches_a_slow_resampling_reference(hybrid_prep, sim_frames):
    """One replicate = refit the calibrator on the resampled prompts (rows repeated) and recompute every
    estimator on the repeated rows; checked against that computed the slow way."""
    prep = hybrid_prep
    design = prep.direct.design
    d = design.data
    mult = bootstrap_weights(3, 7, d.n_prompts)
    got = dict(zip(prep.layout, _replicate(prep, mult)))
    reps = mult[d.prompt].astype(int)
    rows = np.repeat(np.arange(d.n_rows), reps)
    cal = np.isin(rows, design.cal_rows)
    full = IsotonicCalibrator(clip=d.label_scale).fit(d.score[rows][cal], d.label[rows][cal])
    R_full = full.predict(d.score)
    q = np.empty(d.n_rows)
    for k in range(d.n_folds):
        sel = cal & (d.fold[rows] != k)
        q[d.fold == k] = IsotonicCalibrator(clip=d.label_scale).fit(d.score[rows][sel], d.label[rows][sel]).predict(
            d.score[d.fold == k])
    R = np.where(np.isin(np.arange(d.n_rows), design.cal_rows), q, R_full)
    for t in ("near", "far"):
        L = np.repeat(prep.logged_rows, reps[prep.logged_rows])
        F = np.repeat(prep.fresh_rows[t], reps[prep.fresh_rows[t]])
        ld0 = prep.logged[t]
        pos = np.repeat(np.arange(ld0.n), reps[prep.logged_rows])
        ld = LoggedData(ld0.prompt_ids[pos], ld0.scores[pos], ld0.logger_logprob[pos], ld0.target_logprob[pos])
        fd = FreshData(d.prompt_ids[d.prompt[F]], d.score[F])
        ref = evaluate_target(ld, Rewards(R[L], R[F], q[L], q[F]), fd, target=t, config=prep.options.config())
        for k in ("ips", "snips", "calibrated_ips", "dr", "direct"):  # the stack depends on cluster labels
            assert got[(t, k)] == pytest.approx(ref.estimates[k].value, rel=1e-9, abs=1e-12), (t, k)


def test_same_seed_same_numbers_and_any_chunking(hybrid_prep, sim_frames):
    prep = hybrid_prep
    whole = finalize(prep, [bootstrap_chunk(prep, 0, 60)]).to_dict()
    parts = finalize(prep, [bootstrap_chunk(prep, 0, 25), bootstrap_chunk(prep, 25, 41),
                            bootstrap_chunk(prep, 41, 60)]).to_dict()
    assert whole == parts
    _, logged, fresh = sim_frames
    again = evaluate_offpolicy(logged, fresh, mode="hybrid", n_bootstrap=60, seed=3).to_dict()
    assert again == whole
    other = evaluate_offpolicy(logged, fresh, mode="hybrid", n_bootstrap=60, seed=4).to_dict()
    assert other["policies"]["near"]["ci"] != whole["policies"]["near"]["ci"]
    assert other["policies"]["near"]["estimate"] == whole["policies"]["near"]["estimate"]  # point: no RNG
    with pytest.raises(ValueError, match="expected 60"):
        finalize(prep, [bootstrap_chunk(prep, 0, 10)])


def test_direct_part_is_the_engines_direct(hybrid_prep):
    """The logger's entry and the Direct summaries are cje_engine.pipeline.direct's, from the same replicates."""
    prep = hybrid_prep
    chunks = bootstrap_chunk(prep, 0, 60)
    res = finalize(prep, [chunks])
    direct = pipeline.finalize(prep.direct, [pipeline.bootstrap_chunk(prep.direct, 0, 60)]).to_dict()
    d = res.to_dict()
    base = dict(d["policies"]["base"])
    assert base.pop("offpolicy")["role"] == "logger" and base.pop("claim") == "level"
    assert base == direct["policies"]["base"]
    assert d["policies"]["near"]["direct"]["estimate"] == direct["policies"]["near"]["estimate"]
    assert d["calibration"] == direct["calibration"]


def test_result_schema_gate_and_report(hybrid_prep, sim_frames):
    from flows.storage.publish import check_result_gate
    from flows.reports.evaluation import render_report

    res = finalize(hybrid_prep, [bootstrap_chunk(hybrid_prep, 0, 60)])
    d = res.to_dict()
    json.dumps(d, allow_nan=False)
    for key in ("schema_version", "config", "data", "calibration", "inference", "policies", "comparisons",
                "multiplicity", "ranking", "win_matrix", "best_policy", "best_policy_reason", "rank_agreement",
                "warnings", "offpolicy"):
        assert key in d, key
    assert d["mode"] == "hybrid" and d["config"]["mode"] == "hybrid" and d["config"]["gates"]["min_ttc"] == 0.7
    assert list(d["policies"]) == ["base", "near", "far"]
    for name, p in d["policies"].items():
        for key in ("estimate", "se", "ci", "level_claim", "refusal_reasons", "basis", "basis_code", "audit",
                    "support", "raw_judge_mean", "n_rows", "n_labelled"):
            assert key in p, (name, key)
        assert p["level_claim"] in ("ok", "refused")
    near = d["policies"]["near"]["offpolicy"]
    diag = near["diagnostics"]
    for key in ("ess_raw", "ess_stabilised", "max_share_raw", "q995_raw", "hill_index", "ttc", "affinity",
                "cle_floor_se", "dr_orthogonality"):
        assert key in diag, key
    assert set(near["estimates"]) == {"ips", "snips", "calibrated_ips", "dr", "direct", "stacked"}
    assert {g["gate"] for g in near["gate_checks"]} == {"ttc", "ess_raw", "ess_stabilised", "tail_index"}
    assert len(d["comparisons"]) == 3 and all("p_adjusted" in c for c in d["comparisons"])
    far = d["policies"]["far"]
    assert far["offpolicy"]["verdicts"]["calibrated_ips"]["claim"] == "refused"
    check_result_gate(d)
    table = res.to_policy_table()
    assert table.column("policy").to_pylist() == ["base", "near", "far"]
    html = render_report(d, title="off-policy")
    assert "near" in html and "far" in html


def test_logs_only_equals_hybrid_on_the_logs(sim_frames):
    """Logs-only numbers depend only on the logs: the calibrated-IPS entry (estimate, bootstrap CI)
    is the same whether or not fresh draws are given (they share the prompts, so the draws match)."""
    _, logged, fresh = sim_frames
    lo = evaluate_offpolicy(logged, mode="logs-only", n_bootstrap=50, seed=1).to_dict()
    hy = evaluate_offpolicy(logged, fresh, mode="hybrid", n_bootstrap=50, seed=1).to_dict()
    for t in ("near", "far"):
        assert lo["policies"][t]["offpolicy"]["estimates"]["calibrated_ips"] == \
            hy["policies"][t]["offpolicy"]["estimates"]["calibrated_ips"]
    near = lo["policies"]["near"]
    assert near["basis_code"] == "logs-only/calibrated_ips"
    # the near clone passes the overlap gates; with 75 labels its (weighted) judge scores are thinly
    # supported, so the support rule refuses its level and keeps it rank-only
    assert near["support"]["limited"] and "weighted" in near["support"]["rule"]
    # (the protocol's claim; without a verified level the rank-only level leaves the verified claims and is
    # ranked among the assumes-transport ones, as in Direct)
    assert near["level_claim"] == "refused" and near["relative_claim"] == "not_estimable"
    assert near["assumed"]["level_claim"] == "refused"
    assert any("limited calibration support" in r for r in near["refusal_reasons"])
    assert "near" not in {e["policy"] for e in lo["ranking"]}
    assert "near" in {e["policy"] for e in lo["assumes_transport"]["ranking"]}
    assert lo["policies"]["far"]["level_claim"] == "refused"
    assert "collect fresh draws" in lo["policies"]["far"]["refusal_reasons"][-1]
    assert lo["policies"]["far"]["transport"] == "unaudited"
    assert lo["best_policy"] != "far"


def test_downgraded_claims():
    """DR is downgraded (not refused) by the TTC gate: it keeps its level with a warning by default, and
    is refused with downgraded='refused'. A near clone with a strict TTC threshold (0.99 > its ~0.9)
    makes the case; every row is labelled so Direct's calibration support is not the issue."""
    sim = simulate_logs(n_prompts=300, length=8, targets={"near": 0.05}, seed=8, label_fraction=1.0)
    logged, fresh = sim.to_frames("base")
    # the fresh draws have no own labels: the DR level assumes transport, reported because the team trusts it
    kw = dict(mode="hybrid", estimator="dr", gates={"min_ttc": 0.99}, n_bootstrap=50, seed=0, trust_transport=["near"])
    ok = evaluate_offpolicy(logged, fresh, **kw).to_dict()
    near = ok["policies"]["near"]
    assert near["direct"]["level_claim"] == "assumes_transport" and near["assumed"]["level_claim"] == "ok"
    assert near["claim"] == "downgraded" and near["basis_code"] == "hybrid/dr"
    assert near["level_claim"] == "assumes_transport" and near["estimate"] == near["assumed"]["estimate"]
    assert near["recommendation"] is not None
    assert any(w.startswith("near: the dr estimate's claim is downgraded") for w in ok["warnings"])
    strict = evaluate_offpolicy(logged, fresh, downgraded="refused", **kw).to_dict()
    assert strict["policies"]["near"]["level_claim"] == "refused"
    assert any("TTC" in r for r in strict["policies"]["near"]["refusal_reasons"])
    assert strict["policies"]["near"]["estimate"] == near["estimate"]


def test_custom_gates_are_honoured(sim_frames):
    _, logged, _ = sim_frames
    strict = evaluate_offpolicy(logged, mode="logs-only", gates={"min_ttc": 0.99}, n_bootstrap=50).to_dict()
    assert strict["policies"]["near"]["level_claim"] == "refused"
    assert strict["config"]["gates"]["min_ttc"] == 0.99


def test_arena_modes(arena_dir):
    """The Arena's logs: the clone alone passes logs-only; in hybrid mode the adversarial policy's own
    probe labels fail the transport audit, so its level is Direct's recalibrated one (as in Direct)."""
    lo = evaluate_offpolicy(arena_dir, mode="logs-only", logger="base", calibration_policies=["base"],
                            n_bootstrap=50).to_dict()
    claims = {t: lo["policies"][t]["level_claim"] for t in ("clone", "parallel_universe_prompt", "unhelpful")}
    # logs-only levels assume transport (no label of the candidates' responses): the clone's passes its gates
    assert claims == {"clone": "assumes_transport", "parallel_universe_prompt": "refused", "unhelpful": "refused"}
    assert lo["policies"]["clone"]["estimate"] is None and lo["policies"]["clone"]["assumed"]["level_claim"] == "ok"
    hy = evaluate_offpolicy(arena_dir, mode="hybrid", logger="base", calibration_policies=["base"],
                            n_bootstrap=50).to_dict()
    un = hy["policies"]["unhelpful"]
    # hybrid gives it Direct's level path: its 50 own labels fail the audit, the protocol recalibrates it and its
    # reported level is Direct's verified one
    assert un["audit"]["verdict"] == "fail" and un["level_claim"] == "ok" and un["basis_code"] == "power_tuned"
    assert un["assumed"]["basis_code"] == "recalibrated"
    assert un["estimate"] == pytest.approx(un["direct"]["estimate"]) and un["ci"] == un["direct"]["ci"]
    assert un["estimate"] < 0.2 < un["offpolicy"]["estimates"]["calibrated_ips"]["value"]
    assert un["relative_claim"] == "ok" and "unhelpful" in {e["policy"] for e in hy["ranking"]}
    assert hy["best_policy"] != "unhelpful"
    assert all(c["reported"] for c in hy["comparisons"] if "unhelpful" in (c["a"], c["b"]))


def test_options_validation(sim_frames):
    _, logged, _ = sim_frames
    for kw, msg in ((dict(mode="direct"), "mode must be one of"), (dict(estimator="magic"), "estimator must be"),
                    (dict(gates={"min_foo": 1}), "unknown gate"), (dict(inference="jackknife"), "inference must be"),
                    (dict(nonsense=1), "unknown option"), (dict(downgraded="maybe"), "downgraded"),
                    (dict(stack=("nope",)), "stacking candidate"), (dict(rho=-1.0), "rho")):
        with pytest.raises(CJEInputError, match=msg):
            OffPolicyOptions.build(**kw)
    opts = OffPolicyOptions.build(mode="hybrid", targets="near", covariates=["response_length"], seed=2)
    assert opts.targets == ("near",) and opts.engine.covariates == ("response_length",) and opts.seed == 2
    d = opts.to_dict()
    assert d["mode"] == "hybrid" and d["targets"] == ["near"] and d["n_bootstrap"] == 2000
    json.dumps(d)


def test_flow_helpers():
    opts = flow_options({"logger": "base", "n_bootstrap": 100}, ["base", "near", "far"], "hybrid")
    assert opts.targets == ("near", "far") and opts.mode == "hybrid" and opts.engine.n_bootstrap == 100
    assert opts.declared["targets"] == ["near", "far"]  # what names the run (its run key)
    assert flow_options(opts, ["x"], "hybrid") is opts  # typed options are never rebuilt
    assert flow_columns(opts) == ["base_logprob", "logprob__near", "logprob__far"]
    assert flow_policies(opts) == ["base", "near", "far"]
    assert flow_policies(flow_options({**opts.declared}, None, "logs-only")) == ["base"]
    assert flow_policies(flow_options({"targets": ["near"]}, None, "hybrid")) is None
    with pytest.raises(CJEInputError, match="needs its candidates"):
        flow_columns(flow_options({}, None, "logs-only"))
    with pytest.raises(CJEInputError, match="mode must be one of"):
        flow_options({}, None, "offline")
