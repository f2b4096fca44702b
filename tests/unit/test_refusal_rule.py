"""Refused means refused: not-estimable policies leave comparisons, ranking and the multiplicity family;
limited-support policies keep rank-only comparisons with conservative intervals."""
from __future__ import annotations

import numpy as np
import pytest

from cje_engine.inference.comparisons import PolicyColumns, compare_pairs, relative_claims
from cje_engine.pipeline.offpolicy import evaluate_offpolicy
from cje_engine.simulate.logs import simulate_logs


def _check_contract(d: dict) -> None:
    ranked = {e["policy"] for e in d["ranking"]}
    dropped = {n for n, p in d["policies"].items() if p["relative_claim"] == "not_estimable"}
    assert not ranked & dropped
    assert d["best_policy"] not in dropped
    for c in d["comparisons"]:
        assert set(c) >= {"a", "b", "reported", "not_estimable"}
        if {c["a"], c["b"]} & dropped:
            assert c["reported"] is False and c["not_estimable"]
            assert all(c[k] is None for k in ("diff", "ci", "p_value", "p_adjusted", "significant"))
        else:
            assert c["reported"] is True and c["not_estimable"] is None and c["p_adjusted"] is not None
    assert d["multiplicity"]["n_comparisons"] == sum(c["reported"] for c in d["comparisons"])


def test_arena_logs_only_drops_overlap_refusals(arena_dir):
    d = evaluate_offpolicy(arena_dir / "logged_data.jsonl", mode="logs-only", n_bootstrap=50, seed=0).to_dict()
    assert d["policies"]["unhelpful"]["relative_claim"] == "not_estimable"
    assert "overlap" in d["policies"]["unhelpful"]["relative_reason"]
    assert "unhelpful" not in {e["policy"] for e in d["ranking"]}
    _check_contract(d)


@pytest.mark.parametrize("seed", [0, 1])
def test_simulated_far_target_never_ranked(seed):
    sim = simulate_logs(n_prompts=120, length=8, targets={"near": 0.05, "far": 1.5}, seed=seed, label_fraction=0.3)
    logged, _ = sim.to_frames("base")
    d = evaluate_offpolicy(logged, mode="logs-only", n_bootstrap=50, seed=seed).to_dict()
    _check_contract(d)
    if d["policies"]["far"]["level_claim"] == "refused":
        assert "far" not in {e["policy"] for e in d["ranking"]}


def _cols(relative):
    rng = np.random.default_rng(0)
    reps = rng.normal([0.5, 0.45, 0.3], 0.02, size=(400, 3))
    infl = rng.normal(0, 0.02, size=(300, 3)) / np.sqrt(300) * 3
    return PolicyColumns(names=["a", "b", "c"], estimate=np.array([0.5, 0.45, 0.3]), replicates=reps,
                         influence=infl, dfs=np.full(3, np.inf), refused=np.array([False, r"rank" in relative[1], False]),
                         claims=["ok", "ok", "ok"], raw=np.array([0.6, 0.5, 0.4]), relative=relative,
                         relative_reason=[None if s == "ok" else s for s in relative])


def test_rank_only_intervals_are_the_union_of_both_routes():
    plain = compare_pairs(_cols(["ok", "ok", "ok"]), alpha=0.05, method="bh", span=1.0, warnings=[])
    cons = compare_pairs(_cols(["ok", "rank_only", "ok"]), alpha=0.05, method="bh", span=1.0, warnings=[])
    for p, c in zip(plain, cons):
        assert c["reported"]
        if "b" in (c["a"], c["b"]):
            assert c["ci"][0] <= p["ci"][0] and c["ci"][1] >= p["ci"][1]
            assert c["p_value"] >= p["p_value"]
        else:
            assert c["ci"] == p["ci"]


def test_not_estimable_leaves_the_multiplicity_family():
    rel = relative_claims(_cols(["ok", "ok", "not_estimable"]), alpha=0.05, method="holm", span=1.0, warnings=[])
    assert rel["multiplicity"]["n_comparisons"] == 1
    assert [e["policy"] for e in rel["ranking"]] == ["a", "b"]
    full = relative_claims(_cols(["ok", "ok", "ok"]), alpha=0.05, method="holm", span=1.0, warnings=[])
    ab = [c for c in rel["comparisons"] if c["reported"]][0]
    ab_full = [c for c in full["comparisons"] if (c["a"], c["b"]) == ("a", "b")][0]
    assert ab["p_adjusted"] == pytest.approx(ab["p_value"])  # a family of one
    assert ab_full["p_adjusted"] >= ab["p_adjusted"]
