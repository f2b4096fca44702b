"""Drift monitor configuration: the flow's settings and the ``drift_monitors:`` declarations.

`DriftSettings` groups the parameters of the `flows.pipelines.drift.drift` flow (one validated
pydantic object instead of loose parameters). `load_drift_monitors` reads ``drift_monitors:`` of
an evaluations file into `DriftMonitorSpec` objects; `flows.pipelines.deployments.drift_deployments`
makes one Prefect deployment per monitor. The declarations are validated by the project's one config model
(`flows.config`).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cje_engine.errors import CJEInputError
from flows.config import DriftComparisonKeys, DriftMonitorConfig, check_drift_comparison, load_config, pick_declared
from flows.runtime.retries import DEFAULT_RETRY_DELAYS
from flows.storage.anchors import check_name
from flows.uris import check_webhook_url

log = logging.getLogger(__name__)


class LinkedEvaluationKeys(BaseModel):
    """What a drift monitor takes from its linked evaluation (`load_drift_monitors`): keys of the drift
    flow's settings, declared once for `DriftSettings` and `DriftMonitorSpec`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    evaluation_logs_uri: str | None = None
    evaluation_columns: dict[str, str] | None = None
    labels_uri: str | None = None
    label_requests: dict[str, Any] | None = None


class DriftSettings(DriftComparisonKeys, LinkedEvaluationKeys):
    """Everything one run of the `drift` flow needs, validated before any work.

    Groups: *what* (``set_name``, ``anchors_version``, ``monitor_name``); *where*
    (``anchors_uri``; ``logs_uri``, ``drift_uri``, ``results_uri`` default to it); *judge*
    (``judge_id``, ``scorer``, ``scored_at``: the flow re-scores the anchors itself when a scorer
    is given); *comparison* (``reference``, ``replicate``, ``monitor`` = `DriftMonitor` options,
    ``through``); *linked evaluation* (``evaluation``, ``evaluation_logs_uri``, ``evaluation_columns``
    = its ``columns:`` mapping, ``labels_uri``, ``label_requests``); *alerts and retries* (``notify_on``, ``webhook_url``, ``retry_delays``).
    docs/drift-flow.md explains each.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    monitor_name: str | None = None
    scored_at: str | None = None
    through: str | None = None
    webhook_url: str | None = None
    retry_delays: list[float] | None = None

    @model_validator(mode="after")
    def _check(self) -> "DriftSettings":
        check_name(self.set_name)
        check_name(self.name, "monitor name")
        if self.scorer is not None and not self.judge_id:
            raise ValueError("judge_id is required with a scorer: it labels the scores the flow writes")
        try:
            check_drift_comparison(self.reference, self.monitor)
            if self.webhook_url is not None:
                check_webhook_url(self.webhook_url, "webhook_url")
        except CJEInputError as exc:
            raise ValueError(exc.detail) from None
        return self

    @property
    def name(self) -> str:
        """The monitor's name (its folder under ``drift/``): ``monitor_name`` or ``set_name``."""
        return self.monitor_name or self.set_name

    @property
    def delays(self) -> list[float]:
        """Retry delays of the flow's storage tasks (declared, else the default)."""
        return list(self.retry_delays) if self.retry_delays is not None else list(DEFAULT_RETRY_DELAYS)

    def uri(self, which: Literal["logs", "drift", "results"]) -> str:
        """A storage root, defaulting to ``anchors_uri``."""
        return getattr(self, f"{which}_uri") or self.anchors_uri


def settings_from(params: dict[str, Any], source: str = "drift flow parameters") -> DriftSettings:
    """`DriftSettings` from a mapping; a bad value raises `CJEInputError` naming the key."""
    from pydantic import ValidationError

    try:
        return DriftSettings(**params)
    except CJEInputError:
        raise
    except ValidationError as exc:
        err = exc.errors()[0]
        col = ".".join(str(p) for p in err.get("loc", ())) or None
        raise CJEInputError(str(err.get("msg", exc)).removeprefix("Value error, "), source=source,
                            column=col) from None


class DriftMonitorSpec(DriftMonitorConfig, LinkedEvaluationKeys):
    """One drift monitor declared under ``drift_monitors:``: the validated `flows.config.DriftMonitorConfig`
    (the one place its keys are declared) plus what it takes from its linked evaluation
    (`LinkedEvaluationKeys`, set by `load_drift_monitors`, not keys of the file), its flow parameters and
    its Prefect deployment."""

    def flow_parameters(self) -> dict[str, Any]:
        """Parameters of the `drift` flow for this monitor: ``{"settings": {...}}``."""
        return {"settings": self.settings_dict()}

    def settings_dict(self) -> dict[str, Any]:
        """`DriftSettings` fields of this monitor: every field the two models share, and its monitor name."""
        shared = set(DriftSettings.model_fields) & set(type(self).model_fields)
        out = self.model_dump(include=shared)
        out["monitor_name"] = self.monitor_name
        if out.get("replicate") == "none":
            out["replicate"] = None
        return out

    def to_deployment(self, flow: Any):
        """A Prefect ``RunnerDeployment`` of ``flow`` (the `drift` flow: `flows.pipelines.deployments`) on this
        monitor's schedule."""
        from prefect.types.entrypoint import EntrypointType

        return flow.to_deployment(
            name=f"drift-{self.monitor_name}", entrypoint_type=EntrypointType.MODULE_PATH,
            parameters=self.flow_parameters(),
            description=self.description or f"Judge drift on anchor set {self.set_name}", tags=["cje", "drift"],
            **self.schedule_kwargs(), **self.concurrency_kwargs())


def load_drift_monitors(path: str | os.PathLike | None = None) -> dict[str, DriftMonitorSpec]:
    """The ``drift_monitors:`` of an evaluations file (default: the repository's), validated by the
    service's one configuration model (`flows.config.load_config`; errors name file, entry and key).

    A file without the key has no monitors (empty dict). A monitor whose ``evaluation`` is declared
    under ``evaluations:`` of the same file takes that evaluation's ``logs_uri``, ``columns``,
    ``labels_uri`` and ``label_requests`` (drift alarms request labels on its recent traffic) and, when
    it gives no ``results_uri``, the evaluation's results root.
    """
    cfg = load_config(path, require_evaluations=False)
    out: dict[str, DriftMonitorSpec] = {}
    for name, m in cfg.drift_monitors.items():
        linked = cfg.evaluations.get(m.evaluation) if m.evaluation else None
        if m.evaluation and linked is None:
            log.warning("drift monitor %r: evaluation %r is not declared in %s; a drift alarm will request anchor "
                        "labels only", name, m.evaluation, cfg.path)
        extra: dict[str, Any] = {}
        if linked is not None:
            extra = {"evaluation_logs_uri": linked.logs_uri, "evaluation_columns": dict(linked.columns) or None,
                     "labels_uri": linked.labels_uri or linked.logs_uri,
                     "label_requests": dict(linked.label_requests) if linked.label_requests else None,
                     "results_uri": m.results_uri or linked.results_uri or linked.logs_uri}
        out[name] = DriftMonitorSpec.model_validate({**m.model_dump(), **extra})
    return out


def find_drift_monitor(name: str, path: str | os.PathLike | None = None) -> DriftMonitorSpec:
    """The drift monitor ``name`` declared in an evaluations file (default: the repository's); an unknown
    name is the one `CJEInputError` of every lookup (`flows.config.pick_declared`: file, did you mean,
    the declared names)."""
    return pick_declared(name, load_drift_monitors(path), what="drift monitor", source=path)
