"""Trigger rules, sampling, manifests, deduplication and the period budget (flows.label_requests)."""
from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pytest

from cje_engine import evaluate
from cje_engine.errors import CJEInputError
from cje_engine.simulate.direct import PolicySpec, simulate
from flows.label_requests.config import RequestConfig, iso_period
from flows.label_requests.manifests import list_requests, mark_fulfilled, status_of
from flows.label_requests.planning import plan_requests
from flows.label_requests.raising import raise_requests_for_run
from flows.label_requests.sampling import sample
from flows.label_requests.triggers import find_triggers, support_regions, TriggerRows
from flows.storage.objects import Storage

from .test_notify import Receiver

POLICIES = (PolicySpec("base", quality_shift=0.8), PolicySpec("clone", quality_shift=0.8),
            PolicySpec("unhelpful", quality_shift=-1.0, adversarial=True))
NOW = datetime(2025, 3, 5, 12, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def case():
    """A simulated window (400 prompts x 3 policies, 5 audit labels per non-calibration policy)
    and its engine result: unhelpful fails its audit and is refused; clone's audit is inconclusive."""
    sim = simulate(400, POLICIES, label_design="calibration_policy", oracle_fraction=0.25, audit_labels=5, seed=1)
    frame = sim.frame.copy()
    frame["dt"] = np.where(frame["prompt_id"].str[-1].astype(int) % 2 == 0, "2025-03-02", "2025-03-01")
    result = evaluate(frame.drop(columns=["dt"]), covariates=["response_length"], calibration_policies=["base"],
                      inference="analytic", seed=0).to_dict()
    return sim, pa.Table.from_pandas(frame, preserve_index=False), result


def _codes(triggers):
    return {(t["trigger"], t["scope"]) for t in triggers}


def test_case_is_what_the_tests_assume(case):
    _, _, r = case
    assert r["policies"]["unhelpful"]["audit"]["verdict"] == "fail"
    assert r["policies"]["unhelpful"]["level_claim"] == "refused"
    assert r["policies"]["clone"]["audit"]["verdict"] == "inconclusive"


def test_audit_triggers_fire_with_their_sizes(case):
    _, table, r = case
    trig = find_triggers(r, table, {"triggers": ["audit_failed", "audit_inconclusive", "no_own_labels"]})
    assert _codes(trig) == {("audit_failed", "unhelpful"), ("audit_inconclusive", "clone")}
    by = {t["trigger"]: t for t in trig}
    assert by["audit_inconclusive"]["labels"] == r["policies"]["clone"]["audit"]["extra_labels_needed"]
    # failed with 5 own labels: at least min_labels - 5 to recalibrate
    assert by["audit_failed"]["labels"] >= r["config"]["min_labels"] - 5
    assert "min_labels" in by["audit_failed"]["detail"]["sizing"]


def test_failed_audit_sized_for_target_se(case):
    """The planner's target-SE sizing: m >= sigma2_res / (target^2 - sigma2_eval / n)."""
    _, table, r = case
    p = r["policies"]["unhelpful"]
    a = p["audit"]
    s2_res = a["se"] ** 2 * a["n_labels"]
    s2_eval = p["variance_components"]["sigma2_eval"]
    n = p["variance_components"]["n_prompts"]
    target = math.sqrt(s2_eval / n + s2_res / 27.5)  # reachable with 28 labels
    m_need = math.ceil(s2_res / (target**2 - s2_eval / n))
    assert m_need == 28
    trig = find_triggers(r, table, {"triggers": ["audit_failed"], "target_se": target,
                                    "max_labels_per_request": 10_000})
    assert trig[0]["labels"] == m_need - a["n_labels"]
    assert trig[0]["detail"]["planner"]["reachable"] is True
    # a target below the evaluation SE alone cannot be reached with labels: the planner balances instead
    tiny = 0.5 * math.sqrt(s2_eval / n)
    trig = find_triggers(r, table, {"triggers": ["audit_failed"], "target_se": tiny,
                                    "max_labels_per_request": 10_000})
    assert trig[0]["detail"]["planner"]["reachable"] is False and trig[0]["labels"] >= r["config"]["min_labels"] - 5


def test_no_own_labels_trigger(case):
    sim, table, r = case
    # drop clone's labels: its audit cannot run
    keep = ~((np.asarray(table.column("policy").to_pylist()) == "clone")
             & ~np.isnan(table.column("oracle_label").to_numpy(zero_copy_only=False)))
    t2 = table.filter(pa.array(keep))
    r2 = evaluate(t2.drop_columns(["dt"]), covariates=["response_length"], calibration_policies=["base"],
                  inference="analytic").to_dict()
    assert r2["policies"]["clone"]["audit"]["verdict"] == "not_run"
    trig = [t for t in find_triggers(r2, t2, {}) if t["trigger"] == "no_own_labels"]
    assert [t["scope"] for t in trig] == ["clone"]
    # size: ceil((z sd / margin)^2) (audits are not adjusted over policies), at least min_labels, and at least
    # what the result's labels_to_verify asks for (clone has no verified level)
    from scipy.stats import norm

    sds = [a["se"] ** 2 * a["n_labels"] for a in (p["audit"] for p in r2["policies"].values()) if a.get("se")]
    z = norm.ppf(1 - 0.05 / 2)
    ltv = r2["policies"]["clone"]["labels_to_verify"]["n_labels"]
    assert trig[0]["labels"] == max(r2["config"]["min_labels"], math.ceil((z * math.sqrt(np.median(sds)) / 0.05) ** 2),
                                    ltv)
    assert find_triggers(r2, t2, {"new_policy_labels": 33, "triggers": ["no_own_labels"]})[0]["labels"] == 33


def test_thin_support_regions_follow_the_engine_rule(case):
    _, table, r = case
    rows = TriggerRows.from_table(table)
    regions, rule = support_regions(rows, r, "clone")
    assert regions and rule["support_min_labels"] == r["config"]["support_min_labels"]
    cal = np.sort(rows.score[rows.labelled & (rows.policy == "base")])
    h = rule["bandwidth"]
    for reg in regions[:1]:  # the first region's count is the engine's count (nothing placed before it)
        s = reg["score"]
        assert reg["have"] == int(np.sum(np.abs(cal - s) <= h + 1e-9))
        assert reg["have"] < rule["support_min_labels"] or s < cal[0] or s > cal[-1]
    # only policies whose support the engine calls limited
    limited = {p for p, v in r["policies"].items() if v["support"]["limited"]}
    trig = find_triggers(r, table, {"triggers": ["thin_support"]})
    assert {t["scope"] for t in trig} == limited


def test_under_labelled_uses_the_square_root_law(case):
    from cje_engine.planning.allocation import is_under_labelled
    from cje_engine.planning.components import policy_components

    _, table, r = case
    trig = find_triggers(r, table, {"triggers": ["under_labelled"], "share_margin": 0.0})
    fired = {t["detail"]["policy"] for t in trig}
    for name in r["policies"]:
        comps = policy_components(r, name)
        expect = comps.m_pilot <= comps.n_pilot and is_under_labelled(comps, comps.n_pilot, comps.m_pilot, 1.0, 16.0)
        assert (name in fired) == expect
    for t in trig:
        d = t["detail"]
        assert d["calibration_share"] > d["oracle_budget_share"]
    # a cheap oracle makes labels the better buy: fires for more (or the same) policies
    cheap = {t["detail"]["policy"] for t in find_triggers(r, table, {"triggers": ["under_labelled"], "c_Y": 1.0,
                                                                     "share_margin": 0.0})}
    assert fired <= cheap


def test_drift_trigger_requests_recent_traffic_and_anchors(case):
    _, table, r = case
    look = {"look": 4, "alarm": True, "alarms": ["residual_shift"], "first_alarm": {"residual_shift": 4}}
    plan = plan_requests(r, table, {"triggers": ["drift_alarm"], "drift_traffic_labels": 30,
                                    "drift_anchor_labels": 5}, evaluation="e", window="w", drift_look=look,
                         anchor_ids=[f"a{i}" for i in range(20)], now=NOW)
    (m,) = plan["requests"]
    assert m["scope"] == "drift" and len(m["rows"]) == 30 and len(m["anchors"]) == 5
    assert {row["dt"] for row in m["rows"]} == {"2025-03-02"}  # the most recent day only
    assert all(a["selection_probability"] == 5 / 20 for a in m["anchors"])
    quiet = dict(look, alarm=False, alarms=[])
    assert plan_requests(r, table, {"triggers": ["drift_alarm"]}, evaluation="e", window="w", drift_look=quiet,
                         now=NOW)["requests"] == []


def test_an_undecided_drop_across_windows_requests_the_labels_that_would_decide_it(case):
    """Monitoring (cje_engine.inference.changes) finds a drop of clone that is not yet significant;
    the evaluate flow's return value carries it and the request asks for labels_needed of clone."""
    from cje_engine.inference.changes import WindowValue, window_changes
    from flows.pipelines.regressions import undecided_at

    _, table, r = case
    pc = window_changes([WindowValue("w0", 0.70, 0.005, n_labelled=100), WindowValue("w1", 0.675, 0.02, n_labelled=100)],
                        alpha=0.05, decision_margin=0.02)
    undecided = undecided_at({"clone": pc}, "w1")
    needed = pc.consecutive[1].labels_needed
    assert needed and undecided == {"clone": needed}
    assert undecided_at({"clone": pc}, "w0") == {}  # the baseline window is not tested
    published = {"result": r, "run_key": "k1", "window": "w1", "monitoring": {"undecided": undecided}}
    trig = find_triggers(published, table, {"triggers": ["regression_undecided"]})
    assert _codes(trig) == {("regression_undecided", "clone")}
    assert trig[0]["labels"] == min(needed, RequestConfig().max_labels_per_request)
    assert trig[0]["detail"]["labels_needed"] == needed
    plan = plan_requests(published, table, {"triggers": ["regression_undecided"]}, evaluation="e", window="w1",
                         now=NOW)
    (m,) = plan["requests"]
    pool = sum(1 for pol, y in zip(table["policy"].to_pylist(), table["oracle_label"].to_pylist())
               if pol == "clone" and (y is None or y != y))  # clone's unlabelled rows
    assert m["scope"] == "clone" and len(m["rows"]) == min(trig[0]["labels"], pool)
    # nothing undecided, or the trigger switched off: no request
    assert find_triggers({**published, "monitoring": {"undecided": {}}}, table,
                         {"triggers": ["regression_undecided"]}) == []
    assert find_triggers(published, table, {"triggers": ["audit_failed"]}) == [t for t in find_triggers(
        r, table, {"triggers": ["audit_failed"]})]


# ----------------------------------------------------------------------------- sampling


def test_sampling_is_deterministic_and_order_free():
    ids = np.array([f"r{i:04d}" for i in range(500)], dtype=object)
    scores = np.round(np.random.default_rng(0).uniform(size=500), 2)
    a = sample(ids, scores, 40, "stratified", 7)
    perm = np.random.default_rng(1).permutation(500)
    b = sample(ids[perm], scores[perm], 40, "stratified", 7)
    assert sorted(ids[a[0]]) == sorted(ids[perm][b[0]])
    c = sample(ids, scores, 40, "stratified", 8)
    assert sorted(ids[a[0]]) != sorted(ids[c[0]])


@pytest.mark.parametrize("design", ["random", "stratified"])
def test_selection_probabilities_sum_to_the_pool(design):
    ids = np.array([f"r{i}" for i in range(300)], dtype=object)
    scores = np.random.default_rng(2).integers(0, 20, 300) / 20
    idx, p, strata = sample(ids, scores, 37, design, 3)
    assert idx.size == 37 and len(set(idx)) == 37
    assert np.sum(1 / p) == pytest.approx(300)  # Horvitz-Thompson count of the pool is exact
    for s in np.unique(strata):
        assert np.all(p[strata == s] == p[strata == s][0])


def test_targeted_design_keeps_every_row_reachable_and_unbiased():
    """Seeded property: with the stored probabilities (prior harmonic mean x selection probability)
    the Hajek mean of earlier + requested labels is unbiased for the policy mean, while the
    unweighted mean of a targeted request is not.

    Population: N = 600 residuals depending on the score (low scores have residual +0.4); 30
    earlier labels by SRS (pi = 30/600); each replicate draws a targeted request of 60 with 48
    slots on scores < 0.2 (which hold 1/10 of the rows). Over R = 400 replicates the mean of
    the estimates has Monte-Carlo SE sd/sqrt(R) (sd measured); we allow 4 SE plus the O(1/n)
    ratio bias of a Hajek mean (bounded by 0.005 here: var(weights)/n with n = 90).
    """
    rng = np.random.default_rng(11)
    N = 600
    score = rng.integers(0, 20, N) / 20
    resid = np.where(score < 0.2, 0.4, 0.0) + rng.normal(0, 0.1, N)
    truth = resid.mean()
    ids = np.array([f"r{i:03d}" for i in range(N)], dtype=object)
    earlier = rng.choice(N, 30, replace=False)
    prior = 30 / N
    pool = np.setdiff1d(np.arange(N), earlier)
    regions = [{"score": s, "labels": 16} for s in (0.0, 0.05, 0.1, 0.15)][:3]
    est, naive = [], []
    for rep in range(400):
        idx, p, strata = sample(ids[pool], score[pool], 60, "targeted", rep, regions=regions, bandwidth=0.05,
                                background_share=0.2)
        assert np.any(strata == -1)  # background always drawn
        rows = pool[idx]
        w = np.concatenate([np.full(30, 1 / prior), 1 / (prior * p)])
        y = np.concatenate([resid[earlier], resid[rows]])
        est.append(np.sum(w * y) / np.sum(w))
        naive.append(y.mean())
    est, naive = np.array(est), np.array(naive)
    tol = 4 * est.std(ddof=1) / np.sqrt(est.size) + 0.005
    assert abs(est.mean() - truth) < tol
    assert abs(naive.mean() - truth) > 10 * tol  # the targeted rows are not representative on their own


def test_allocation_respects_caps_and_pool():
    ids = np.array([f"r{i}" for i in range(10)], dtype=object)
    idx, p, _ = sample(ids, np.zeros(10), 50, "random", 0)
    assert idx.size == 10 and np.all(p == 1.0)
    assert sample(ids, np.zeros(10), 0, "random", 0)[0].size == 0
    with pytest.raises(CJEInputError, match="sampling design"):
        sample(ids, np.zeros(10), 3, "clever", 0)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("bad, match", [
    ({"max_labels_per_period": -1}, "max_labels_per_period"),
    ({"c_Y": 0}, "c_Y"),
    ({"triggers": ["audit_failed", "vibes"]}, "vibes"),
    ({"background_share": 1.0}, "background_share"),
    ({"budget": 3}, "unknown label request setting"),
    ({"target_se": float("nan")}, "target_se"),
])
def test_bad_config_is_a_clear_error(bad, match):
    with pytest.raises(CJEInputError, match=match):
        RequestConfig.from_dict(bad)


def test_missing_columns_and_bad_result_are_clear_errors(case):
    _, table, r = case
    with pytest.raises(CJEInputError, match="judge_score"):
        find_triggers(r, table.drop_columns(["judge_score"]), {})
    with pytest.raises(CJEInputError, match="policies"):
        find_triggers({"config": {}}, table, {})


def test_iso_period():
    assert iso_period(datetime(2025, 3, 5, tzinfo=timezone.utc)) == "2025-W10"
    assert iso_period(datetime(2024, 12, 30, tzinfo=timezone.utc)) == "2025-W01"


# ----------------------------------------------------------------------------- storage


def test_requests_written_once_deduplicated_and_budgeted(case, tmp_path):
    _, table, r = case
    st = Storage.for_uri(str(tmp_path))
    cfg = {"max_labels_per_request": 40, "max_labels_per_period": 60, "notify": False}
    made = raise_requests_for_run(None, str(tmp_path), "ev", "2025-03-01_2025-03-02",
                                  {"result": r, "run_key": "k1"}, table, cfg, now=NOW)
    assert made and sum(m["n_labels"] for m in made) <= 60
    assert all(m["n_labels"] <= 40 for m in made)
    # highest priority first: the failed audit is served before the budget runs out
    assert made[0]["scope"] == "unhelpful" and made[0]["reasons"][0]["trigger"] == "audit_failed"
    stored = list_requests(st, now=NOW)
    assert {m["request_id"] for m in stored} == {m["request_id"] for m in made}
    on_disk = json.loads((tmp_path / f"label_requests/{made[0]['request_id']}.json").read_text())
    assert on_disk["status"] == "pending" and on_disk["rows"] == made[0]["rows"]
    assert on_disk["deadline"] == (NOW + timedelta(days=7)).isoformat()

    # same run again: nothing new (pending triggers are not raised twice, budget is spent anyway)
    again = raise_requests_for_run(None, str(tmp_path), "ev", "2025-03-01_2025-03-02",
                                   {"result": r, "run_key": "k1"}, table, cfg, now=NOW)
    assert again == []
    # a later run in the same week with a fresh budget: pending rows are never requested twice
    more = raise_requests_for_run(None, str(tmp_path), "ev", "2025-03-01_2025-03-02",
                                  {"result": r, "run_key": "k2"}, table,
                                  dict(cfg, max_labels_per_period=1000), now=NOW + timedelta(hours=1))
    assert more == []  # every trigger of this result already has a pending request
    # another evaluation over the same logs: its triggers fire, but no pending row is requested again
    other = raise_requests_for_run(None, str(tmp_path), "ev2", "2025-03-01_2025-03-02",
                                   {"result": r, "run_key": "k9"}, table,
                                   dict(cfg, max_labels_per_period=1000), now=NOW + timedelta(hours=1))
    assert other
    first_ids = {row["response_id"] for m in made for row in m["rows"]}
    assert first_ids.isdisjoint({row["response_id"] for m in other for row in m["rows"]})
    ids = [row["response_id"] for m in list_requests(st, now=NOW) for row in m["rows"]]
    assert len(ids) == len(set(ids))


def test_budget_exhausted_skips_with_reason(case):
    _, table, r = case
    existing = [{"status": "fulfilled", "period": iso_period(NOW), "n_labels": 100, "rows": [], "reasons": []}]
    plan = plan_requests(r, table, {"max_labels_per_period": 100}, evaluation="e", window="w", existing=existing,
                         now=NOW)
    assert plan["requests"] == [] and plan["skipped"]
    assert all("budget" in s["reason"] for s in plan["skipped"])
    # next ISO week: budget is back
    plan = plan_requests(r, table, {"max_labels_per_period": 100}, evaluation="e", window="w", existing=existing,
                         now=NOW + timedelta(days=7))
    assert plan["requests"]


def test_status_pending_fulfilled_expired(case, tmp_path):
    _, table, r = case
    st = Storage.for_uri(str(tmp_path))
    (m, *_) = raise_requests_for_run(None, str(tmp_path), "ev", "2025-03-01_2025-03-02",
                                     r, table, {"notify": False, "triggers": ["audit_failed"]}, now=NOW)
    assert status_of(m, None, NOW) == "pending"
    assert status_of(m, None, NOW + timedelta(days=8)) == "expired"
    assert list_requests(st, now=NOW + timedelta(days=8))[0]["status"] == "expired"
    assert mark_fulfilled(st, m["request_id"], {"received": 5}) is True
    assert mark_fulfilled(st, m["request_id"], {"received": 5}) is False  # create-only
    assert list_requests(st, now=NOW + timedelta(days=8))[0]["status"] == "fulfilled"


def test_new_request_notifies_the_webhook(case, tmp_path):
    _, table, r = case
    rec = Receiver()
    try:
        made = raise_requests_for_run(None, str(tmp_path), "ev", "2025-03-01_2025-03-02", r, table,
                                      {"webhook_url": rec.url, "triggers": ["audit_failed"]}, now=NOW)
        assert len(made) == 1 and rec.kinds() == ["label_request"]
        body = rec.messages[0]["body"]["payload"]
        assert body["request_id"] == made[0]["request_id"] and body["n_labels"] == made[0]["n_labels"]
        assert body["triggers"] == ["audit_failed"]
    finally:
        rec.close()


def test_inclusion_probability_scales_with_prior_labels(case):
    _, table, r = case
    plan = plan_requests(r, table, {"triggers": ["audit_failed"]}, evaluation="e", window="w", now=NOW)
    (m,) = plan["requests"]
    for row in m["rows"]:
        # unhelpful's 5 earlier labels had probability 5/400 (simulator SRS)
        assert row["prior_probability"] == pytest.approx(5 / 400)
        assert row["inclusion_probability"] == pytest.approx(row["selection_probability"] * 5 / 400)


# ----------------------------------------------------------------------------- drift alarms


def _drift_look(look: int = 3, monitor: str = "m", alarms=("mean_shift",)) -> dict:
    return {"look": look, "alarm": True, "alarms": list(alarms), "first_alarm": {a: look for a in alarms},
            "meta": {"monitor": monitor, "set_name": "anchors", "judge_id": "v2", "look_key": "2025-03-05/v2",
                     "anchors_version": 1}}


def test_drift_request_without_traffic_holds_anchors_only_and_says_why(tmp_path):
    from flows.label_requests.raising import raise_drift_requests

    anchors = [f"a{i:03d}" for i in range(40)]
    cfg = {"drift_anchor_labels": 8, "notify": False}
    out = raise_drift_requests(None, str(tmp_path), _drift_look(), anchors, config=cfg, now=NOW)
    (m,) = out["requests"]
    assert m["rows"] == [] and len(m["anchors"]) == 8 and m["n_labels"] == 8 and m["evaluation"] is None
    assert m["drift"]["traffic"] == "none requested: the drift monitor has no linked evaluation"
    assert all(a["selection_probability"] == 8 / 40 for a in m["anchors"])
    assert m["reasons"][0]["trigger"] == "drift_alarm" and "look 3 (judge v2" in m["reasons"][0]["reason"]
    # the same look again (any status): nothing; another monitor of the same set: other anchors only
    mark_fulfilled(Storage.for_uri(str(tmp_path)), m["request_id"], {})
    again = raise_drift_requests(None, str(tmp_path), _drift_look(), anchors, config=cfg, now=NOW)
    assert again["requests"] == [] and "already raised" in again["skipped"][0]["reason"]
    other = raise_drift_requests(None, str(tmp_path), _drift_look(monitor="m2"), anchors, config=cfg, now=NOW)
    (m2,) = other["requests"]
    # m's request is fulfilled, so its anchors are free again: 8 of 40, drawn independently
    assert len(m2["anchors"]) == 8 and m2["request_id"] != m["request_id"]
    third = raise_drift_requests(None, str(tmp_path), _drift_look(monitor="m3"), anchors, config=cfg, now=NOW)
    pending = {a["anchor_id"] for a in m2["anchors"]}
    (m3,) = third["requests"]
    assert pending.isdisjoint(a["anchor_id"] for a in m3["anchors"])  # pending anchors never twice
    assert all(a["selection_probability"] == 8 / 32 for a in m3["anchors"])
    # evaluation given but nothing published yet
    e = raise_drift_requests(None, str(tmp_path / "x"), _drift_look(), anchors, evaluation="ev", config=cfg, now=NOW)
    assert e["requests"][0]["drift"]["traffic"] == "none requested: evaluation 'ev' has no published result yet"


def test_drift_request_with_traffic_respects_pending_rows_budget_and_switch(case, tmp_path):
    from flows.label_requests.raising import raise_drift_requests
    from flows.storage.logs import write_logs

    sim, table, r = case
    logs = tmp_path / "logs"
    frame = table.to_pandas()
    frame["ts"] = pd_ts(frame["dt"])
    labelled = frame["oracle_label"].notna()
    write_logs(Storage.for_uri(str(logs)), pa.Table.from_pandas(
        frame.drop(columns=["dt", "oracle_label", "label_probability"]), preserve_index=False), basename="t")
    from flows.storage.labels import LabelStore

    LabelStore(Storage.for_uri(str(logs))).append(pa.Table.from_pandas(
        frame.loc[labelled, ["response_id", "oracle_label", "label_probability"]].reset_index(drop=True),
        preserve_index=False), "oracle")
    latest = {"result": r, "window": "2025-03-01_2025-03-02", "run_key": "k1", "evaluation": "ev"}
    anchors = [f"a{i}" for i in range(10)]
    cfg = {"drift_traffic_labels": 20, "drift_anchor_labels": 5, "notify": False, "max_labels_per_period": 22}
    # an audit request of the same run holds some rows of the recent day
    audit = raise_requests_for_run(None, str(tmp_path), "ev", "2025-03-01_2025-03-02", {"result": r, "run_key": "k1"},
                                   table, {"notify": False, "max_labels_per_period": 10 ** 6}, now=NOW)
    held = {row["response_id"] for m in audit for row in m["rows"]}
    out = raise_drift_requests(None, str(tmp_path), _drift_look(), anchors, evaluation="ev", latest=latest,
                               logs_uri=str(logs), config=cfg, now=NOW + timedelta(days=7))  # next ISO week
    (m,) = out["requests"]
    assert len(m["rows"]) == 20 and {row["dt"] for row in m["rows"]} == {"2025-03-02"}
    assert not labelled[frame["response_id"].isin([row["response_id"] for row in m["rows"]])].any()
    assert held.isdisjoint(row["response_id"] for row in m["rows"])
    assert len(m["anchors"]) == 2 and "anchors: 2 of 5" in m["note"]  # the budget of 22 leaves 2 anchors
    assert m["drift"]["traffic"].startswith("the last 1 log date(s) of window 2025-03-01_2025-03-02")
    off = raise_drift_requests(None, str(tmp_path), _drift_look(look=9), anchors, evaluation="ev", latest=latest,
                               logs_uri=str(logs), config=dict(cfg, triggers=["audit_failed"]), now=NOW)
    assert off["requests"] == [] and "disabled" in off["skipped"][0]["reason"]


def pd_ts(dt):
    import pandas as pd

    return pd.to_datetime(dt).dt.tz_localize("UTC") + pd.Timedelta(hours=1)


def test_triggers_read_the_audit_margin_from_the_result(case, monkeypatch):
    """The margin in label units is the engine's (`EvaluationOptions.audit_margin_in`, stored in every policy's
    ``audit.margin``): change it in the engine and the triggers' sizing follows, with no copy of its formula or
    default in flows/label_requests (the old copy used ``config.audit_margin`` x the label span, 0.05 here)."""
    from cje_engine.options import EvaluationOptions
    from flows.label_requests.triggers import audit_margin

    _, table, r = case
    assert audit_margin(r) == r["policies"]["clone"]["audit"]["margin"] == pytest.approx(0.05)
    keep = ~((np.asarray(table.column("policy").to_pylist()) == "clone")
             & ~np.isnan(table.column("oracle_label").to_numpy(zero_copy_only=False)))
    t2 = table.filter(pa.array(keep))
    monkeypatch.setattr(EvaluationOptions, "audit_margin_in", lambda self, label_scale=None: 0.123)
    r2 = evaluate(t2.drop_columns(["dt"]), covariates=["response_length"], calibration_policies=["base"],
                  inference="analytic").to_dict()
    assert r2["config"]["audit_margin"] == 0.05  # the option as declared; the engine's margin is 0.123
    assert {p["audit"]["margin"] for p in r2["policies"].values()} == {0.123}
    trig = [t for t in find_triggers(r2, t2, {"triggers": ["no_own_labels"]}) if t["scope"] == "clone"]
    assert "margin=0.123" in trig[0]["detail"]["sizing"]
    with pytest.raises(CJEInputError, match="no audit margin"):
        audit_margin({"config": {"audit_margin": 0.05}, "policies": {"a": {"audit": {"verdict": "not_run"}}}})
