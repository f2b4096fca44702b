"""Options typed once, at the edge: one option (``audit_margin``) walked from evaluations.yaml to the engine
as ONE `EvaluationOptions` object (never a dict in between, never rebuilt), and the config errors of the
validation paths that became strict pydantic models keep their file / key / did-you-mean content."""
from __future__ import annotations

import pyarrow as pa
import pytest
import yaml

from cje_engine.errors import CJEInputError
from cje_engine.options import EvaluationOptions
from cje_engine.simulate.direct import PolicySpec, simulate
from flows.config import load_config
from flows.label_requests.triggers import audit_margin
from flows.pipelines import evaluate as evaluate_module
from flows.pipelines.audit import evaluate_and_audit
from flows.runtime.schedules import load_evaluations


def _yaml(tmp_path, options: dict, **entry) -> str:
    f = tmp_path / "evaluations.yaml"
    f.write_text(yaml.safe_dump({"evaluations": [{"name": "walk", "logs_uri": "logs", "policies": ["base", "clone"],
                                                  "options": options, **entry}]}))
    return str(f)


def test_audit_margin_walks_from_yaml_to_the_engine_as_one_typed_object(tmp_path, monkeypatch):
    """docs/architecture.md, "One option, YAML to engine": load -> flow parameters -> the flow's check and plan
    -> the prepare task -> the engine, the same object at every hop; the engine's margin lands in the result and
    the label-request triggers read it there."""
    path = _yaml(tmp_path, {"audit_margin": 0.07, "n_bootstrap": 50, "inference": "analytic", "seed": 3})
    spec = load_evaluations(path)["walk"]  # hop 1: flows/config.py parses the options once
    opts = spec.options
    assert type(opts) is EvaluationOptions and opts.audit_margin == 0.07 and opts.policies == ("base", "clone")
    assert opts.declared == {"audit_margin": 0.07, "n_bootstrap": 50, "inference": "analytic", "seed": 3,
                             "policies": ["base", "clone"]}  # what names the run (its run key), as before

    def rebuilt(*args, **kwargs):
        raise AssertionError("the options were rebuilt after the file was loaded")

    monkeypatch.setattr(EvaluationOptions, "build", classmethod(rebuilt))
    params = spec.flow_parameters()  # hop 2: the flow's parameters carry the object itself
    assert params["options"] is opts
    checked = evaluate_and_audit.check_parameters(dict(params))  # the flow's guard: Prefect's validation + plan_run
    assert checked["options"] is opts
    plan = evaluate_module.plan_run(params["logs_uri"], params["window"], params["evaluation"], None, None,
                                    params["policies"], checked["options"], "2025-03-10", None, "direct")
    assert plan.opts is opts  # hop 3: the run's plan holds it
    assert evaluate_module.run_config(plan)["options"] == opts.declared  # the run key is named as before

    sim = simulate(120, (PolicySpec("base", quality_shift=0.5), PolicySpec("clone", quality_shift=0.5)),
                   label_design="calibration_policy", oracle_fraction=0.3, audit_labels=12, seed=2)
    table = pa.Table.from_pandas(sim.frame, preserve_index=False)
    prep = evaluate_module.prepare.fn(table, plan.opts)  # hop 4: the prepare task -> cje_engine prepare
    assert prep.options is opts  # the engine received exactly that object: no dict, no copy
    result = prep.finalize([]).to_dict()  # analytic: no bootstrap chunks
    assert [p["audit"]["margin"] for p in result["policies"].values()] == [pytest.approx(0.07)] * 2
    assert audit_margin(result) == pytest.approx(0.07)  # label requests read the engine's margin


def test_deployments_keep_the_declared_options(tmp_path):
    """A deployment stores JSON: its ``options`` are the file's (the flow run parses them once, at its edge)."""
    spec = load_evaluations(_yaml(tmp_path, {"audit_margin": 0.07, "label_scale": "0-10"}))["walk"]
    assert spec.deployment_parameters()["options"] == {"audit_margin": 0.07, "label_scale": "0-10"}
    assert spec.options.label_scale == (0.0, 10.0) and spec.options.audit_margin_in() == pytest.approx(0.7)


@pytest.mark.parametrize("options, needles", [
    ({"audit_margn": 0.1}, ["evaluations[0] ('walk')", "unknown option(s): audit_margn", "did you mean 'audit_margin'?"]),
    ({"audit_margin": 2}, ["evaluations[0] ('walk')", "audit_margin must be in (0, 1)"]),
    ({"audit_margin": "0.05"}, ["evaluations[0] ('walk')", "option audit_margin must be a finite number"]),
    (["audit_margin"], ["evaluations[0] ('walk')", "key options", "valid dictionary"]),
])
def test_engine_option_errors_name_file_entry_and_option(tmp_path, options, needles):
    path = _yaml(tmp_path, options)
    with pytest.raises(CJEInputError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(f"file {path}: ") and all(n in msg for n in needles), msg
    assert "\n" not in msg and "Value error" not in msg and "pydantic" not in msg


def test_a_mistyped_drift_monitor_option_is_a_one_line_error(tmp_path):
    """``monitor: {min_anchors: x}`` escaped as a bare ValueError (``invalid literal for int()``: a traceback at
    load) because only TypeError was caught; the strict model names the key and what was expected."""
    f = tmp_path / "ev.yaml"
    base = {"set_name": "anchors", "anchors_uri": "."}
    for monitor, needle in (({"min_anchors": "x"}, "key min_anchors: Input should be a valid integer, got 'x'"),
                            ({"alpah": 0.1}, "unknown key 'alpah' (did you mean 'alpha'?)"),
                            ({"alpha": 2}, "alpha must be a number in (0, 1)")):
        f.write_text(yaml.safe_dump({"drift_monitors": [{**base, "monitor": monitor}]}))
        with pytest.raises(CJEInputError) as err:
            load_config(f, require_evaluations=False)
        assert str(f) in str(err.value) and "drift_monitors[0]" in str(err.value) and needle in str(err.value)


def test_label_request_settings_are_strict_with_the_same_messages():
    from flows.label_requests.config import RequestConfig

    for bad, needle in (({"max_labels_per_period": -1}, "label request setting max_labels_per_period must be a whole "
                                                        "number >= 0, got -1"),
                        ({"budgett": 3}, "unknown label request setting(s) ['budgett']"),
                        ({"notify": "yes"}, "label request setting notify: Input should be a valid boolean"),
                        ({"triggers": ["vibes"]}, "unknown label request trigger(s) ['vibes']")):
        with pytest.raises(CJEInputError) as err:
            RequestConfig.from_dict(bad)
        assert needle in str(err.value)
    cfg = RequestConfig.from_dict({"triggers": "audit_failed", "c_Y": 2})
    assert cfg.triggers == ("audit_failed",) and cfg.c_Y == 2.0 and RequestConfig.from_dict(cfg.to_dict()) == cfg
