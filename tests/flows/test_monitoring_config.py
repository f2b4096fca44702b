"""``monitoring:`` of evaluations.yaml (`flows.config.MonitoringConfig`): validated at load (top-level
default merged into each evaluation key by key, unknown keys refused with a did-you-mean hint), carried
into the evaluate flow's parameters, and used by the regression step (`monitor_evaluation`)."""
from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import yaml

from cje_engine.errors import CJEInputError
from flows.config import MonitoringConfig, check_monitoring
from flows.pipelines import regressions
from flows.pipelines.evaluate import plan_run
from flows.runtime.schedules import load_evaluations


def _write(tmp_path, doc) -> str:
    p = tmp_path / "evaluations.yaml"
    p.write_text(yaml.safe_dump(doc))
    return str(p)


def _evaluation(name: str, **extra) -> dict:
    return {"name": name, "logs_uri": "s3://bucket/logs", "window": "last 7 days", **extra}


def test_top_level_monitoring_is_the_default_overridden_key_by_key(tmp_path):
    path = _write(tmp_path, {"monitoring": {"alpha": 0.1, "baseline_windows": 3},
                             "evaluations": [_evaluation("plain"), _evaluation("own", monitoring={"alpha": 0.01}),
                                             _evaluation("drop", monitoring={"baseline_windows": None})]})
    specs = load_evaluations(path)
    assert specs["plain"].flow_parameters()["monitoring"] == {"alpha": 0.1, "baseline_windows": 3}
    assert specs["own"].flow_parameters()["monitoring"] == {"alpha": 0.01, "baseline_windows": 3}
    assert specs["drop"].flow_parameters()["monitoring"] == {"alpha": 0.1}  # null drops a default key
    assert check_monitoring(specs["own"].monitoring) == MonitoringConfig(alpha=0.01, baseline_windows=3)
    # without any monitoring: key the flow gets None, i.e. the defaults of docs/monitoring.md
    plain = load_evaluations(_write(tmp_path, {"evaluations": [_evaluation("x")]}))["x"]
    assert plain.flow_parameters()["monitoring"] is None
    assert check_monitoring(None) == MonitoringConfig(alpha=0.05, baseline_windows=1, label_requests=True)


@pytest.mark.parametrize("doc, needle", [
    ({"monitoring": {"alpah": 0.1}, "evaluations": [_evaluation("e")]}, "unknown key 'alpah' (did you mean 'alpha'?)"),
    ({"evaluations": [_evaluation("e", monitoring={"baseline_window": 2})]}, "did you mean 'baseline_windows'?"),
    ({"evaluations": [_evaluation("e", monitoring={"alpha": "0.05"})]}, "key alpha"),
    ({"evaluations": [_evaluation("e", monitoring={"alpha": 0.5})]}, "less than 0.5"),
    ({"evaluations": [_evaluation("e", monitoring={"baseline_windows": 0})]}, "greater than or equal to 1"),
    ({"evaluations": [_evaluation("e", monitoring={"pools": [1, 4]})]}, "key pools"),
    ({"evaluations": [_evaluation("e", monitoring={"label_requests": "yes"})]}, "key label_requests"),
    ({"evaluations": [_evaluation("e", monitoring=[0.05])]}, "valid dictionary"),
])
def test_bad_monitoring_is_refused_at_load_naming_file_and_key(tmp_path, doc, needle):
    path = _write(tmp_path, doc)
    with pytest.raises(CJEInputError) as err:
        load_evaluations(path)
    assert needle in str(err.value) and "evaluations.yaml" in str(err.value) and "monitoring" in str(err.value)


def test_the_flow_checks_monitoring_in_its_plan():
    plan = plan_run("/tmp/logs", "2025-01-01", "e", None, None, None, None, None, None, "direct",
                    monitoring={"alpha": 0.2, "pools": [2]})
    assert plan.monitoring == MonitoringConfig(alpha=0.2, pools=(2,))
    with pytest.raises(CJEInputError, match="did you mean 'horizon'"):
        plan_run("/tmp/logs", "2025-01-01", "e", None, None, None, None, None, None, "direct",
                 monitoring={"horizn": 5})


# A drop between two windows whose z statistic lies between the alarm thresholds of alpha = 0.05 and 0.2.
# Window 1 is the first look after the baseline: it spends alpha * g(1) = alpha / 2 (g(t) = 1/(t(t+1))),
# split over its two tests (consecutive and baseline, no pooled test yet), so each test alarms at
# p <= alpha / 4: |z| >= 2.498 for alpha 0.05, >= 1.960 for alpha 0.2. SE of the difference =
# sqrt(2) * 0.01; a drop of 0.031 gives z = 2.19, so it alarms at alpha 0.2 and is "undecided" at 0.05
# (a drop >= decision_margin 0.02 that is not significant).
SE, DROP = 0.01, 0.031


def _history() -> list[dict]:
    def run(window: str, value: float) -> dict:
        return {"window": window, "run_key": f"k-{window}", "published_at": f"{window[:10]}T06:00:00Z",
                "policies": {"cand": {"estimate": value, "se": SE, "level_claim": "ok", "n_labelled": 120}}}

    return [run("2025-06-01_2025-06-01", 0.70), run("2025-06-02_2025-06-02", 0.70 - DROP)]


@pytest.fixture
def monitored(monkeypatch, tmp_path):
    sent: list[tuple[str, dict]] = []
    monkeypatch.setattr(regressions, "read_history", lambda st, evaluation: _history())
    monkeypatch.setattr(regressions, "evaluate_artifacts", lambda *a, **k: [])
    monkeypatch.setattr("flows.integrations.notify.notify", lambda kind, payload, **k: sent.append((kind, payload))
                        or {"kind": kind})

    def run(monitoring):
        return regressions.monitor_evaluation(str(tmp_path), None, "e", "2025-06-02_2025-06-02", "k", {}, {},
                                              monitoring), sent

    return run


def test_the_threshold_derivation_holds():
    z = DROP / (math.sqrt(2) * SE)
    assert NormalDist().inv_cdf(1 - 0.2 / 8) < z < NormalDist().inv_cdf(1 - 0.05 / 8)


def test_a_changed_alpha_changes_the_alarm_decision(monitored):
    out, sent = monitored(None)  # the defaults: alpha 0.05
    assert out["alarms"] == [] and out["error"] is None and not sent
    assert out["undecided"]["cand"] > 0  # more labels could decide it: a label request would be raised
    out, sent = monitored(MonitoringConfig(alpha=0.2))
    assert out["alarms"] == ["cand"] and [k for k, _ in sent] == ["regression_alarm"]
    assert sent[0][1]["policy"] == "cand" and sent[0][1]["tests"]


def test_undecided_drops_raise_no_label_request_when_switched_off(monitored):
    out, _ = monitored(MonitoringConfig(label_requests=False))
    assert out["alarms"] == [] and out["undecided"] == {}


def test_a_longer_baseline_period_moves_the_first_tested_window(monitored):
    out, _ = monitored(MonitoringConfig(alpha=0.2, baseline_windows=2))  # both windows are the baseline
    assert out["alarms"] == [] and out["undecided"] == {}


def test_pages_and_commands_use_the_settings_the_newest_run_recorded():
    from flows.reports.history import monitoring_of, window_changes_of

    history = _history()
    assert monitoring_of(history) == MonitoringConfig()
    assert window_changes_of(history)["cand"].alarms == []  # alpha 0.05: undecided
    history[-1]["monitoring"] = MonitoringConfig(alpha=0.2).model_dump(mode="json")  # as the manifest holds it
    assert monitoring_of(history).alpha == 0.2
    assert window_changes_of(history)["cand"].alarms == ["2025-06-02_2025-06-02"]
    history[-1]["monitoring"] = {"alpha": "bad"}  # a record that no longer validates: the defaults
    assert monitoring_of(history) == MonitoringConfig()
