"""`cje deploy`: the declared evaluations and drift monitors as Prefect deployments on a work pool.

`cje serve` runs every deployment inside one process (Prefect ``serve``: one replica only).
At scale the deployments live in the Prefect API instead and **workers** run them
(``prefect worker start --pool cje-process``, any number, on any host that has this package
installed):

* each evaluation in ``evaluations.yaml`` becomes a deployment of `evaluate_and_audit`, each
  drift monitor one of `drift`, with the declared schedule and flow parameters;
* entrypoints are module paths (``flows.pipelines.audit.evaluate_and_audit``): a
  process worker imports the installed package, nothing is pulled; a Kubernetes pool runs
  the same image (``--image``), whose package is installed the same way;
* **one run per evaluation window**: a deployment's window is relative (``last 7 days``), so
  two runs of the same deployment at once would evaluate the same window.  Every deployment
  gets a Prefect deployment concurrency limit of 1 (collision strategy ``ENQUEUE``: a second
  run waits in ``AwaitingConcurrencySlot`` and then finds the window already published; the
  publisher's create-only manifest is the second line of defence);
* **crashed runs**: a flow run whose worker (or node) dies stops sending heartbeats
  (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` on the worker); the automation that `deploy` creates
  marks such a run ``Crashed``, which also releases its concurrency slot.  This is Prefect's
  documented way to detect "zombie" runs; without it a dead worker's run stays ``Running``;
* **runs stuck in Pending**: a run whose engine died before it set the run ``Running`` (a Prefect API
  or PostgreSQL restart while it started) sends no heartbeat, so the first automation never sees it,
  and it holds its deployment's concurrency slot for good; a second automation marks a run that stays
  ``Pending`` for ``pending_timeout`` seconds (default 600: a container's image pull included)
  ``Crashed``, which releases the slot.

Everything here talks to ``PREFECT_API_URL``; an embedded, temporary server makes no sense
for deployments that must outlive the command, so `deploy` refuses to run without one.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

from cje_engine.errors import CJEInputError

log = logging.getLogger(__name__)

#: Default work pool (a process pool).
DEFAULT_POOL = "cje-process"

#: Name of the automation that marks flow runs without heartbeats as crashed.
ZOMBIE_AUTOMATION = "cje: crash flow runs whose heartbeats stopped"

#: Name of the automation that marks flow runs stuck in ``Pending`` as crashed.
PENDING_AUTOMATION = "cje: crash flow runs stuck in Pending"

#: Flow-run state events that end a run (no heartbeat is expected after them).
_TERMINAL_EVENTS = ("prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                    "prefect.flow-run.Crashed")


@dataclass(frozen=True)
class Deployed:
    """One deployment `deploy` created or updated."""

    name: str
    flow: str
    deployment_id: str
    schedule: str
    pool: str


def _schedule_text(dep: Any) -> str:
    parts = []
    for s in getattr(dep, "schedules", None) or []:
        sch = getattr(s, "schedule", s)
        if getattr(sch, "cron", None):
            parts.append(f"cron {sch.cron} ({sch.timezone or 'UTC'})")
        elif getattr(sch, "interval", None):
            parts.append(f"every {sch.interval.total_seconds():g} s")
    return ", ".join(parts) or "no schedule (run on demand)"


def ensure_pool(client: Any, pool: str, pool_type: str, base_job_template: dict | None = None) -> bool:
    """Create the work pool if it does not exist; returns True when it was created.

    ``base_job_template`` (e.g. ``infra/k8s/base-job-template.json``) is used only when the pool
    is created; an existing pool keeps its own.  An existing pool of another type is an error
    (its workers could not run these deployments the way the pool's name promises).
    """
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    try:
        existing = client.read_work_pool(pool)
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=pool, type=pool_type, base_job_template=base_job_template or {}))
        log.info("created work pool %s (type %s)", pool, pool_type)
        return True
    if existing.type != pool_type:
        raise CJEInputError(f"work pool {pool!r} exists with type {existing.type!r}, not {pool_type!r}")
    return False


#: Flow-run state events that leave ``Pending`` (the run's engine started, or something ended or rescheduled it).
_LEFT_PENDING = ("prefect.flow-run.Running", "prefect.flow-run.Cancelling", "prefect.flow-run.Scheduled",
                 "prefect.flow-run.AwaitingConcurrencySlot", "prefect.flow-run.AwaitingRetry",
                 "prefect.flow-run.Late", "prefect.flow-run.Paused", "prefect.flow-run.Suspended")


def _ensure_proactive_automation(client: Any, name: str, description: str, after: set, expect: set,
                                 within_seconds: float, message: str) -> str:
    """Create (or replace) the automation ``name`` that marks a flow run ``Crashed`` when, after one of the
    ``after`` events, none of the ``expect`` events follows within ``within_seconds``; returns its id."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    automation = AutomationCore(
        name=name,
        description=description,
        trigger=EventTrigger(
            after=after,
            expect=expect,
            match={"prefect.resource.id": ["prefect.flow-run.*"]},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_seconds),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=message)],
    )
    for old in client.read_automations_by_name(name):
        client.delete_automation(old.id)
    return str(client.create_automation(automation))


def ensure_zombie_automation(client: Any, within_seconds: float) -> str:
    """Create (or replace) the automation that crashes runs without heartbeats; returns its id."""
    return _ensure_proactive_automation(
        client, ZOMBIE_AUTOMATION,
        "A flow run that stopped sending heartbeats lost its worker: mark it Crashed "
        "(releases its deployment concurrency slot). Created by `cje deploy`.",
        after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.heartbeat", *_TERMINAL_EVENTS},
        within_seconds=within_seconds,
        message=f"no heartbeat for {within_seconds:g} s: the worker running it died")


def ensure_pending_automation(client: Any, within_seconds: float) -> str:
    """Create (or replace) the automation that crashes runs left ``Pending`` for ``within_seconds`` (their engine
    died before the run was ``Running``: no heartbeat ever); returns its id."""
    return _ensure_proactive_automation(
        client, PENDING_AUTOMATION,
        "A flow run still Pending long after its worker submitted it lost its engine before it ran: mark it "
        "Crashed (releases its deployment concurrency slot). Created by `cje deploy`.",
        after={"prefect.flow-run.Pending"}, expect={*_LEFT_PENDING, *_TERMINAL_EVENTS},
        within_seconds=within_seconds,
        message=f"still Pending after {within_seconds:g} s: its engine died before the run started")


def check_timeouts(heartbeat_timeout: float, pending_timeout: float) -> None:
    """`CJEInputError` naming the option unless both automations' timeouts are finite and positive (a timeout of 0
    would mark every run ``Crashed`` as soon as it starts)."""
    for name, value in (("--heartbeat-timeout", heartbeat_timeout), ("--pending-timeout", pending_timeout)):
        if not math.isfinite(float(value)) or float(value) <= 0:
            raise CJEInputError(f"{name} {value!r}: expected a positive number of seconds")


def deploy(
    deployments: Sequence[Any],
    pool: str = DEFAULT_POOL,
    pool_type: str = "process",
    image: str | None = None,
    heartbeat_timeout: float = 90.0,
    base_job_template: dict | None = None,
    pending_timeout: float = 600.0,
) -> list[Deployed]:
    """Create or update deployments on a work pool.

    Parameters
    ----------
    deployments : sequence of RunnerDeployment
        What to deploy: `flows.pipelines.deployments.runner_deployments` of an evaluations file (the
        declared evaluations and drift monitors, each with a concurrency limit of one).
    pool : str
        Work pool; created with ``pool_type`` when missing.
    pool_type : str
        ``process`` (default) or ``kubernetes`` (needs ``prefect-kubernetes`` on the worker).
    image : str, optional
        Container image of the flow runs (Kubernetes pools).
    heartbeat_timeout : float
        Seconds without a heartbeat after which a running flow run is marked ``Crashed``;
        must exceed the workers' ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` (at least 30 s).
    base_job_template : dict, optional
        Base job template of a pool that does not exist yet (Kubernetes: image, env, secrets).
    pending_timeout : float
        Seconds a flow run may stay ``Pending`` (submitted, its engine not yet running it) before it is
        marked ``Crashed``; must exceed the time a worker takes to start a run (a container's image pull).

    Returns
    -------
    list of Deployed
    """
    from prefect.client.orchestration import get_client

    check_timeouts(heartbeat_timeout, pending_timeout)
    with get_client(sync_client=True) as client:
        ensure_pool(client, pool, pool_type, base_job_template)
        ensure_zombie_automation(client, heartbeat_timeout)
        ensure_pending_automation(client, pending_timeout)
    out = []
    for dep in deployments:
        dep_id = dep.apply(work_pool_name=pool, image=image)
        out.append(Deployed(name=f"{dep.flow_name}/{dep.name}", flow=dep.flow_name, deployment_id=str(dep_id),
                            schedule=_schedule_text(dep), pool=pool))
        log.info("deployed %s on pool %s (%s)", out[-1].name, pool, out[-1].schedule)
    return out


__all__ = ["deploy", "check_timeouts", "ensure_pool", "ensure_zombie_automation", "ensure_pending_automation", "Deployed",
           "DEFAULT_POOL", "ZOMBIE_AUTOMATION", "PENDING_AUTOMATION"]
