"""`cje deploy`: register the declared evaluations and drift monitors on a Prefect work pool.

Workers then run them: ``prefect worker start --pool cje-process`` (see docs/stack.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cje_engine.errors import CJEInputError

from flows.cli.common import CONFIG_HELP
from flows.cli.exits import EXIT_OK, EXIT_UNAVAILABLE


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``cje deploy`` to the ``cje`` sub-commands."""
    p = sub.add_parser("deploy", help="create the declared evaluations and drift monitors as deployments on a "
                                      "Prefect work pool (run them with `prefect worker start --pool ...`)")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--pool", default="cje-process", help="work pool (default cje-process; created if missing)")
    p.add_argument("--pool-type", default="process", choices=["process", "kubernetes"],
                   help="type of a pool that does not exist yet (default process)")
    p.add_argument("--only", type=_csv, help="deploy only these evaluations")
    p.add_argument("--no-drift", action="store_true", help="do not deploy the declared drift monitors")
    p.add_argument("--image", help="container image of the flow runs (Kubernetes pools)")
    p.add_argument("--base-job-template", help="JSON base job template for a pool that does not exist yet "
                                               "(e.g. infra/k8s/base-job-template.json)")
    p.add_argument("--heartbeat-timeout", type=float, default=90.0,
                   help="seconds without a flow-run heartbeat before the run is marked Crashed (default 90)")
    p.add_argument("--pending-timeout", type=float, default=600.0,
                   help="seconds a flow run may stay Pending (its engine not yet running it) before it is marked "
                        "Crashed, which releases its deployment's concurrency slot (default 600)")
    p.set_defaults(handler=cmd_deploy)


def cmd_deploy(ns: argparse.Namespace) -> int:
    """Apply the deployments of the evaluations file in use (``--config``, ``$CJE_CONFIG``,
    ``./evaluations.yaml``) to ``PREFECT_API_URL``; exit 69 when no API is configured."""
    from flows.cli.common import declared_evaluations
    from flows.runtime.deploy import check_timeouts

    config, _ = declared_evaluations(ns.config, ns.only)  # never the repository's file; unknown --only names
    check_timeouts(ns.heartbeat_timeout, ns.pending_timeout)  # before any server: exit 2
    if not os.environ.get("PREFECT_API_URL"):
        sys.stderr.write("cje deploy: error: PREFECT_API_URL is not set; deployments need a running Prefect "
                         "server (e.g. http://prefect-server:4200/api). `cje serve` runs them in one process "
                         "without one.\n")
        return EXIT_UNAVAILABLE
    from flows.pipelines.deployments import runner_deployments
    from flows.runtime.deploy import deploy

    template = None
    if ns.base_job_template:
        try:
            template = json.loads(Path(ns.base_job_template).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CJEInputError(f"not a JSON base job template: {exc}", source=ns.base_job_template) from None
    deployments = runner_deployments(str(config), only=ns.only, drift=not ns.no_drift)
    out = deploy(deployments, pool=ns.pool, pool_type=ns.pool_type, image=ns.image,
                 heartbeat_timeout=ns.heartbeat_timeout, base_job_template=template,
                 pending_timeout=ns.pending_timeout)
    for d in out:
        sys.stdout.write(f"deployed {d.name} on pool {d.pool}: {d.schedule}\n")
    sys.stdout.write(f"{len(out)} deployment(s); start a worker with: prefect worker start --pool {ns.pool}\n")
    return EXIT_OK
