"""Evaluations declared in ``evaluations.yaml`` and their Prefect deployments.

File format (all keys but ``name`` and ``logs_uri`` optional)::

    evaluations:
      - name: arena-daily                 # unique; names the deployment and the results folder
        logs_uri: s3://logs/cje           # or a local folder (relative paths: to the YAML file)
        results_uri: s3://results/cje     # default: logs_uri
        labels_uri: s3://labels/cje       # default: logs_uri
        window: last 7 days               # or "2025-01-01..2025-01-07"
        cron: "0 6 * * *"                 # a cron schedule (UTC unless `timezone`), or
        interval: 3600                    # seconds between runs, >= 60 (one of cron / interval)
        anchor: 2025-01-01T06:00:00Z      # start of the interval grid (default: when deployed)
        timezone: UTC
        overlap: queue                    # a run due while the previous one runs: queue (default) or skip
        policies: [base, clone]           # default: every policy in the logs
        options: {covariates: [response_length], n_bootstrap: 2000, seed: 0}
        columns: {prompt_id: id, policy: model}  # your log column names (default: the top-level columns:)
        row_pass: auto                    # where rows are reduced: sharded on Ray workers / single / auto by size

`cje serve` deploys every declared evaluation with ``flow.to_deployment`` (the flow chosen by
`flows.pipelines.deployments`) and runs them with Prefect's ``serve``; `cje run NAME` runs one now.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Sequence

from flows.config import EvaluationConfig, load_config

log = logging.getLogger(__name__)


class EvaluationSpec(EvaluationConfig):
    """One declared evaluation: the validated `flows.config.EvaluationConfig` plus its Prefect
    deployment."""

    def flow_parameters(self) -> dict[str, Any]:
        """Parameters of the `evaluate` flow for this evaluation (URIs only: no credentials); ``options`` is
        the typed object parsed when the file was loaded, passed on as it is to the engine."""
        return {
            "logs_uri": self.logs_uri,
            "window": self.window,
            "evaluation": self.name,
            "results_uri": self.results_uri,
            "labels_uri": self.labels_uri,
            "policies": list(self.policies) if self.policies else None,
            "options": self.options,
            "label_requests": dict(self.label_requests) if self.label_requests else None,
            "mode": self.mode,
            "columns": dict(self.columns) or None,
            "monitoring": dict(self.monitoring) or None,
            "row_pass": self.row_pass,
        }

    def deployment_parameters(self) -> dict[str, Any]:
        """`flow_parameters` as JSON for a deployment (Prefect stores them): ``options`` as declared in the
        file (the flow run parses them once, at its edge)."""
        declared = self.options.declared
        if self.policies:  # passed as the flow's own ``policies``
            declared.pop("policies", None)
        return {**self.flow_parameters(), "options": declared}

    def to_deployment(self, flow: Any):
        """A Prefect ``RunnerDeployment`` of ``flow`` (`flows.pipelines.deployments` gives `evaluate_and_audit`:
        the evaluate flow, then notifications and automatic oracle label requests) on this schedule."""
        # Deferred: Prefect's deployment machinery costs seconds and is only needed by `cje serve`/`cje deploy`,
        # not by loading or checking the file.
        from prefect.types.entrypoint import EntrypointType

        return flow.to_deployment(
            name=self.name,
            # Flow runs import `flows.pipelines.evaluate` as a module (not the file as a script),
            # so Ray workers can unpickle its functions by module name.
            entrypoint_type=EntrypointType.MODULE_PATH,
            parameters=self.deployment_parameters(),
            description=self.description or f"CJE evaluation {self.name} over {self.window}",
            tags=["cje"],
            **self.schedule_kwargs(), **self.concurrency_kwargs(),
        )


def load_evaluations(path: str | os.PathLike | None = None) -> dict[str, EvaluationSpec]:
    """Read and check the declared evaluations (`flows.config.load_config`); errors name the
    file, the entry and the key.  Relative local paths resolve against the file's folder."""
    return load_config(path, evaluation_cls=EvaluationSpec).evaluations  # type: ignore[return-value]


def serve(deployments: Sequence[Any], limit: int | None = None) -> None:
    """Run the given deployments (`flows.pipelines.deployments`) on their schedules until interrupted."""
    from prefect import serve as prefect_serve

    log.info("serving %d deployment(s): %s", len(deployments), ", ".join(d.name for d in deployments))
    prefect_serve(*deployments, limit=limit, print_starting_message=False)
