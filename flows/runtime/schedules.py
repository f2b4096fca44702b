"""Evaluations declared in ``evaluations.yaml`` and their Prefect deployments.

File format (all keys but ``name`` and ``logs_uri`` optional)::

    evaluations:
      - name: arena-daily                 # unique; names the deployment and the results folder
        logs_uri: s3://logs/cje           # or a local folder (relative paths: to the YAML file)
        results_uri: s3://results/cje     # default: logs_uri
        labels_uri: s3://labels/cje       # default: logs_uri
        window: last 7 days               # or "2025-01-01..2025-01-07"
        cron: "0 6 * * *"                 # a cron schedule (UTC unless `timezone`), or
        interval: 3600                    # seconds between runs (one of cron / interval)
        timezone: UTC
        policies: [base, clone]           # default: every policy in the logs
        options: {covariates: [response_length], n_bootstrap: 2000, seed: 0}

`cje serve` deploys every declared evaluation with ``flow.to_deployment`` and runs them
with Prefect's ``serve``; `cje run NAME` runs one now.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cje_engine.errors import CJEInputError

log = logging.getLogger(__name__)

#: Default location of the declarations: the repository root.
DEFAULT_FILE = Path(__file__).resolve().parents[2] / "evaluations.yaml"

_KEYS = {"name", "logs_uri", "results_uri", "labels_uri", "window", "cron", "interval", "timezone",
         "policies", "options", "description", "label_requests", "mode"}


@dataclass(frozen=True)
class EvaluationSpec:
    """One declared evaluation."""

    name: str
    logs_uri: str
    window: str = "last 7 days"
    results_uri: str | None = None
    labels_uri: str | None = None
    cron: str | None = None
    interval: float | None = None
    timezone: str = "UTC"
    policies: tuple[str, ...] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    label_requests: dict[str, Any] | None = None  # `flows.label_requests.requests.RequestConfig` settings
    mode: str = "direct"  # direct | logs-only | hybrid

    def flow_parameters(self) -> dict[str, Any]:
        """Parameters of the `evaluate` flow for this evaluation."""
        return {
            "logs_uri": self.logs_uri,
            "window": self.window,
            "evaluation": self.name,
            "results_uri": self.results_uri,
            "labels_uri": self.labels_uri,
            "policies": list(self.policies) if self.policies else None,
            "options": dict(self.options),
            "label_requests": dict(self.label_requests) if self.label_requests else None,
            "mode": self.mode,
        }

    def to_deployment(self):
        """A Prefect ``RunnerDeployment`` on this schedule of `evaluate_and_audit`: the evaluate
        flow, then notifications and automatic oracle label requests."""
        from datetime import timedelta

        from flows.pipelines.audit import evaluate_and_audit

        kwargs: dict[str, Any] = {}
        if self.cron:
            from prefect.schedules import Cron

            kwargs["schedule"] = Cron(self.cron, timezone=self.timezone)
        elif self.interval:
            kwargs["interval"] = timedelta(seconds=float(self.interval))
        from prefect.types.entrypoint import EntrypointType

        return evaluate_and_audit.to_deployment(
            name=self.name,
            # Flow runs import `flows.pipelines.evaluate` as a module (not the file as a script),
            # so Ray workers can unpickle its functions by module name.
            entrypoint_type=EntrypointType.MODULE_PATH,
            parameters=self.flow_parameters(),
            description=self.description or f"CJE evaluation {self.name} over {self.window}",
            tags=["cje"],
            **kwargs,
        )


def _resolve(uri: Any, base: Path, where: str) -> str | None:
    if uri is None:
        return None
    if not isinstance(uri, str) or not uri.strip():
        raise CJEInputError(f"{where} must be a non-empty string, got {uri!r}")
    uri = os.path.expanduser(uri.strip())
    if "://" in uri:
        return uri
    p = Path(uri)
    return str(p if p.is_absolute() else (base / p).resolve())


def check_schedule(e: dict, where: str, src: str) -> None:
    """Validate an entry's ``cron``/``timezone``/``interval`` keys (one of cron or interval at most)."""
    if e.get("cron") and e.get("interval"):
        raise CJEInputError(f"{where}: give either cron or interval, not both", source=src)
    if e.get("cron") is not None:
        from prefect.client.schemas.schedules import CronSchedule

        try:
            CronSchedule(cron=str(e["cron"]), timezone=str(e.get("timezone", "UTC")))
        except ValueError as exc:
            detail = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)
            raise CJEInputError(f"{where}: cron {e['cron']!r} or timezone is not valid ({detail})",
                                source=src) from None
    interval = e.get("interval")
    if interval is not None and (not isinstance(interval, (int, float)) or interval <= 0):
        raise CJEInputError(f"{where}: interval must be a positive number of seconds", source=src)


def load_evaluations(path: str | os.PathLike | None = None) -> dict[str, EvaluationSpec]:
    """Read and check the declarations; errors name the file, the entry and the key.

    Relative local paths are resolved against the folder holding the file.
    """
    path = Path(path) if path is not None else DEFAULT_FILE
    src = str(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise CJEInputError("evaluations file not found", source=src) from None
    except yaml.YAMLError as exc:
        raise CJEInputError(f"not valid YAML: {exc}", source=src) from None
    entries = (doc or {}).get("evaluations") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise CJEInputError("expected a top-level 'evaluations:' list with at least one entry", source=src)
    base = path.resolve().parent
    out: dict[str, EvaluationSpec] = {}
    for i, e in enumerate(entries):
        where = f"evaluations[{i}]"
        if not isinstance(e, dict):
            raise CJEInputError(f"{where} must be a mapping", source=src)
        unknown = sorted(set(e) - _KEYS)
        if unknown:
            raise CJEInputError(f"{where} has unknown key(s) {unknown}; expected some of {sorted(_KEYS)}",
                                source=src)
        name = e.get("name")
        if not isinstance(name, str) or not name.strip() or "/" in name:
            raise CJEInputError(f"{where}.name must be a non-empty name without '/', got {name!r}", source=src)
        where = f"evaluation {name!r}"
        if name in out:
            raise CJEInputError(f"{where} is declared twice", source=src)
        if not e.get("logs_uri"):
            raise CJEInputError(f"{where} needs logs_uri", source=src)
        check_schedule(e, where, src)
        interval = e.get("interval")
        options = e.get("options") or {}
        if not isinstance(options, dict):
            raise CJEInputError(f"{where}: options must be a mapping of engine options", source=src)
        policies = e.get("policies")
        if policies is not None and (not isinstance(policies, list) or not all(isinstance(p, str) for p in policies)):
            raise CJEInputError(f"{where}: policies must be a list of names", source=src)
        try:
            from flows.pipelines.evaluate import engine_options, parse_window

            parse_window(e.get("window", "last 7 days"))
            engine_options(options, policies)
            mode = str(e.get("mode", "direct"))
            if mode not in ("direct", "logs-only", "hybrid"):
                raise CJEInputError(f"mode must be direct, logs-only or hybrid, got {mode!r}")
            if e.get("label_requests") is not None and not isinstance(e["label_requests"], dict):
                raise CJEInputError("label_requests must be a mapping of request settings")
        except CJEInputError as exc:
            raise CJEInputError(f"{where}: {exc}", source=src) from None
        out[name] = EvaluationSpec(
            name=name,
            logs_uri=_resolve(e["logs_uri"], base, f"{where}.logs_uri"),
            results_uri=_resolve(e.get("results_uri"), base, f"{where}.results_uri"),
            labels_uri=_resolve(e.get("labels_uri"), base, f"{where}.labels_uri"),
            window=str(e.get("window", "last 7 days")),
            cron=str(e["cron"]) if e.get("cron") is not None else None,
            interval=float(interval) if interval is not None else None,
            timezone=str(e.get("timezone", "UTC")),
            policies=tuple(policies) if policies else None,
            options=dict(options),
            description=str(e.get("description", "")),
            label_requests=dict(e["label_requests"]) if e.get("label_requests") else None,
            mode=mode,
        )
    return out


def serve(specs: dict[str, EvaluationSpec] | list[EvaluationSpec], limit: int | None = None,
          extra_deployments: list | tuple = ()) -> None:
    """Deploy the evaluations (and e.g. drift monitors) and run their schedules until interrupted."""
    from prefect import serve as prefect_serve

    items = list(specs.values()) if isinstance(specs, dict) else list(specs)
    deployments = [s.to_deployment() for s in items] + list(extra_deployments)
    log.info("serving %d deployment(s): %s", len(deployments), ", ".join(d.name for d in deployments))
    prefect_serve(*deployments, limit=limit, print_starting_message=False)
