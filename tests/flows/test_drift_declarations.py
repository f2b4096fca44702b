"""A declared drift monitor is one model: `flows.config.DriftMonitorConfig` (the keys of the file), which
`flows.pipelines.drift_config.DriftMonitorSpec` extends with what it takes from its linked evaluation; the
`drift` flow's settings are derived from the fields the two models share, so a new key is declared once."""
from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from cje_engine.errors import CJEInputError
from flows.config import DriftMonitorConfig
from flows.pipelines.deployments import drift_deployments
from flows.pipelines.drift_config import DriftMonitorSpec, DriftSettings, load_drift_monitors, settings_from


def _write(tmp_path, monitors, evaluations=()) -> str:
    p = tmp_path / "e.yaml"
    p.write_text(json.dumps({"evaluations": list(evaluations), "drift_monitors": monitors}))
    return str(p)


def test_the_spec_is_the_config_model_plus_the_linked_evaluation(tmp_path):
    assert issubclass(DriftMonitorSpec, DriftMonitorConfig)
    linked = {"evaluation_logs_uri", "evaluation_columns", "labels_uri", "label_requests"}
    assert set(DriftMonitorSpec.model_fields) - set(DriftMonitorConfig.model_fields) == linked
    path = _write(tmp_path, [{"name": "m", "set_name": "s", "anchors_uri": "a", "evaluation": "e", "replicate": "none",
                              "reference": "judge:v1", "monitor": {"alpha": 0.02}}],
                  [{"name": "e", "logs_uri": "logs", "columns": {"prompt_id": "id"},
                    "label_requests": {"max_labels_per_request": 10}}])
    spec = load_drift_monitors(path)["m"]
    settings = spec.settings_dict()
    # every field both models have, and the monitor's name
    assert set(settings) == (set(DriftSettings.model_fields) & set(DriftMonitorSpec.model_fields)) | {"monitor_name"}
    assert settings["monitor_name"] == "m" and settings["replicate"] is None and settings["reference"] == "judge:v1"
    assert settings["evaluation_logs_uri"] == str(tmp_path / "logs") == settings["labels_uri"] == settings["results_uri"]
    assert settings["evaluation_columns"] == {"prompt_id": "id"}
    assert settings["label_requests"] == {"max_labels_per_request": 10}
    assert settings_from(settings).name == "m"  # the flow takes them as they are


def test_linked_evaluation_fields_are_not_keys_of_the_file(tmp_path):
    path = _write(tmp_path, [{"set_name": "s", "anchors_uri": "a", "evaluation_logs_uri": "elsewhere"}])
    with pytest.raises(CJEInputError, match="unknown key 'evaluation_logs_uri'"):
        load_drift_monitors(path)


def test_the_deployment_uses_the_declared_schedule_with_its_anchor(tmp_path):
    path = _write(tmp_path, [{"set_name": "s", "anchors_uri": "a", "interval": 3600,
                              "anchor": "2025-01-01T06:30:00Z"}])
    (dep,) = drift_deployments(path)
    schedule = dep.schedules[0].schedule
    assert dep.name == "drift-s" and schedule.interval.total_seconds() == 3600
    assert schedule.anchor_date == datetime(2025, 1, 1, 6, 30, tzinfo=timezone.utc)
