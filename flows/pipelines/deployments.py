"""The Prefect deployments of an evaluations file: which flow each declaration runs.

The runtime layer knows how a declaration is scheduled and deployed (`flows.runtime.schedules`,
`flows.runtime.deploy`) but not the flows, which live here above it: each declared evaluation becomes a
deployment of `flows.pipelines.audit.evaluate_and_audit`, each drift monitor one of
`flows.pipelines.drift.drift`, each with a concurrency limit of one run at a time (the entry's ``overlap:``
queues or skips a run due while one runs). ``cje serve`` runs them in one process, ``cje deploy`` applies
them to a work pool (`flows.runtime.deploy`).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

from flows.config import pick_declared
from flows.pipelines.drift_config import load_drift_monitors
from flows.runtime.schedules import EvaluationSpec, load_evaluations

__all__ = ["evaluation_deployments", "drift_deployments", "runner_deployments"]


def evaluation_deployments(specs: Iterable[EvaluationSpec]) -> list:
    """One ``RunnerDeployment`` of `evaluate_and_audit` per declared evaluation, on its schedule.

    Parameters
    ----------
    specs : iterable of EvaluationSpec
        The declared evaluations (`flows.runtime.schedules.load_evaluations`).

    Returns
    -------
    list of RunnerDeployment
    """
    from flows.pipelines.audit import evaluate_and_audit  # imports the flows (seconds): only when deploying

    return [s.to_deployment(evaluate_and_audit) for s in specs]


def drift_deployments(path: str | os.PathLike | None = None, only: Sequence[str] | None = None) -> list:
    """Prefect deployments of the drift monitors declared in an evaluations file (for ``cje serve``).

    Parameters
    ----------
    path : str or path-like, optional
        The evaluations file (default: the repository's).
    only : sequence of str, optional
        Only these monitors (an unknown name is an error with a did-you-mean hint).

    Returns
    -------
    list of RunnerDeployment
    """
    from flows.pipelines.drift import drift

    specs = load_drift_monitors(path)
    if only:
        specs = {n: pick_declared(n, specs, what="drift monitor", source=path) for n in only}
    return [s.to_deployment(drift) for s in specs.values()]


def runner_deployments(config: str | None = None, only: Sequence[str] | None = None, drift: bool = True) -> list:
    """The ``RunnerDeployment`` objects of the declared evaluations (and drift monitors) for ``cje deploy``.

    Parameters
    ----------
    config : str, optional
        The evaluations file.
    only : sequence of str, optional
        Only these evaluations.
    drift : bool
        Also the declared drift monitors.

    Returns
    -------
    list of RunnerDeployment
        Each with a concurrency limit of one run at a time (collision strategy ``ENQUEUE``, or ``CANCEL_NEW``
        for ``overlap: skip``: `flows.config.ScheduledEntry.concurrency_kwargs`, as for `cje serve`).
    """
    specs: dict[str, Any] = load_evaluations(config)
    if only:
        specs = {n: pick_declared(n, specs, what="evaluation", source=config) for n in only}
    deployments = evaluation_deployments(specs.values())
    if drift:
        deployments += drift_deployments(config)
    return deployments
