"""The typed result: committed schema and doc regenerate identically, every mode's result validates
against the JSON Schema and round-trips, validate_result names the bad field, planning works for all modes."""
from __future__ import annotations

import copy
import json

import jsonschema
import numpy as np
import pytest

from cje_engine import evaluate
from cje_engine.errors import CJEInputError
from cje_engine.pipeline.offpolicy import evaluate_offpolicy
from cje_engine.planning.planner import plan_from_result
from cje_engine.result import EvaluationResult, jsonable, validate_result
from cje_engine.result.schema import DOC_PATH, SCHEMA_PATH, doc_text, schema_text
from cje_engine.simulate import simulate
from cje_engine.simulate.logs import simulate_logs


@pytest.fixture(scope="module")
def results():
    """One result of every mode (small, seeded)."""
    frame = simulate(n_prompts=300, oracle_fraction=0.2, seed=5).frame
    sim = simulate_logs(n_prompts=150, length=8, targets={"near": 0.05, "far": 1.0}, seed=4, label_fraction=0.5)
    logged, fresh = sim.to_frames("base")
    return {
        "direct": evaluate(frame, n_bootstrap=60, seed=1),
        "direct_analytic": evaluate(frame, inference="analytic"),
        "logs-only": evaluate_offpolicy(logged, mode="logs-only", n_bootstrap=60, seed=2),
        "hybrid": evaluate_offpolicy(logged, fresh, mode="hybrid", n_bootstrap=60, seed=3),
    }


def test_committed_schema_is_generated_from_the_model():
    assert SCHEMA_PATH.read_text() == schema_text(), "run: python -m cje_engine.result.schema"
    assert json.loads(SCHEMA_PATH.read_text())["schema_version"] == 1


def test_schema_doc_tables_are_generated_from_the_schema():
    current = DOC_PATH.read_text()
    assert current == doc_text(current), "run: python -m cje_engine.result.schema"
    assert "`level` / `downgraded` / `refused`" in current  # the claim values the code writes


@pytest.mark.parametrize("mode", ["direct", "direct_analytic", "logs-only", "hybrid"])
def test_every_mode_validates_and_round_trips(results, mode):
    res = results[mode]
    d = res.to_dict()
    jsonschema.validate(d, json.loads(SCHEMA_PATH.read_text()))
    json.dumps(d, allow_nan=False)
    again = EvaluationResult.from_dict(d)
    assert again.to_dict() == d
    assert d["mode"] == mode.split("_")[0]
    for name, p in d["policies"].items():
        vc = p["variance_components"]  # every mode: the planner's input
        assert vc["sigma2_eval"] >= 0 and vc["sigma2_cal"] >= 0 and vc["n_prompts"] > 0, name
    assert res.influence.shape[0] == d["data"]["n_prompts"]
    assert len(res.columns) == len(d["policies"])


@pytest.mark.parametrize("mode", ["logs-only", "hybrid"])
def test_planner_works_on_offpolicy_results(results, mode):
    plan = plan_from_result(results[mode].to_dict(), target_mde=0.05)
    assert plan  # no "no variance_components" error


def test_validate_result_names_the_field(results):
    d = results["hybrid"].to_dict()
    for mutate, column in [
        (lambda r: r["policies"]["near"].update(level_claim="maybe"), "policies.near.level_claim"),
        (lambda r: r["policies"]["near"]["audit"].update(verdict="great"), "policies.near.audit.verdict"),
        (lambda r: r["comparisons"][0].pop("p_value"), "comparisons.0.p_value"),
        (lambda r: r.update(unexpected=1), "unexpected"),
        (lambda r: r.update(best_policy="nobody"), "best_policy"),
    ]:
        bad = copy.deepcopy(d)
        mutate(bad)
        with pytest.raises(CJEInputError) as err:
            validate_result(bad)
        assert err.value.column == column
    refused = copy.deepcopy(d)
    refused["policies"]["near"].update(level_claim="refused", refusal_reasons=[])
    with pytest.raises(CJEInputError, match="no refusal reasons"):
        validate_result(refused)
    validate_result(refused, partial=True)  # the report renders hand-made partial results


def test_jsonable_cleans_numpy_and_nonfinite():
    out = jsonable({1: np.float64("nan"), "a": (np.int64(3), np.bool_(True)), "b": np.arange(2.0),
                    "c": object}, default=lambda o: "obj")
    assert out == {"1": None, "a": [3, True], "b": [0.0, 1.0], "c": "obj"}
    assert jsonable({"x": np.inf})["x"] is None
