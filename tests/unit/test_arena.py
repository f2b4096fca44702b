"""Acceptance on the real Arena sample: base calibrates, probe slices audit the other policies."""
from __future__ import annotations

import pytest

from cje_engine import evaluate


@pytest.fixture(scope="module")
def arena_result(arena_dir):
    return evaluate(arena_dir, calibration_policies=["base"], n_bootstrap=500, seed=0).to_dict()


def test_four_policies_estimated(arena_result):
    assert set(arena_result["policies"]) == {"base", "clone", "parallel_universe_prompt", "unhelpful"}
    d = arena_result["data"]
    assert d["n_rows"] == 4000 and d["n_prompts"] == 1000
    # probes are joined onto their fresh-draw rows, never double-counted
    assert d["n_labelled"] == 480 + 3 * 50 and d["n_calibration_labels"] == 480


def test_unhelpful_audit_fails_and_borrowed_level_is_not_reported(arena_result):
    u = arena_result["policies"]["unhelpful"]
    assert u["audit"]["verdict"] == "fail"
    assert u["audit"]["calibrator"] == "borrowed"
    assert u["level_claim"] == "refused" or u["basis_code"] in ("recalibrated", "power_tuned")  # verified: own labels
    # the reported level is not the borrowed plug-in (which over-states it)
    assert u["estimate"] != u["plug_in"]["estimate"]
    assert u["estimate"] < u["plug_in"]["estimate"]
    # the recalibrated level sits near the probe's own oracle mean (0.159), far below the judge mean
    assert abs(u["estimate"] - 0.159) < 0.1 and u["raw_judge_mean"] > 0.2


@pytest.mark.parametrize("name", ["clone", "parallel_universe_prompt"])
def test_clone_and_parallel_universe_are_not_failed(arena_result, name):
    assert arena_result["policies"][name]["audit"]["verdict"] in ("pass", "inconclusive")
    assert arena_result["policies"][name]["level_claim"] == "ok"


def test_calibrated_levels_are_below_the_raw_judge(arena_result):
    for name, p in arena_result["policies"].items():
        assert p["estimate"] < p["raw_judge_mean"], name
