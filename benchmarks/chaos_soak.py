"""Chaos soak on the loopback stack: many scheduled runs, faults injected at seeded random points.

Needs the stack of ``infra/stack/start.sh`` (its env file: ``--env`` or ``CJE_STACK_ENV``, default
/tmp/cje-stack/env).  One window of simulated logs and its label store go into a fresh bucket, one
evaluation is deployed with ``cje deploy``; then ``--runs`` flow runs are scheduled one after the other
through the Prefect API (Scheduled state, as the server's scheduler makes them; an interval schedule
fires at most once a minute), each for its own slot (evaluation name).  For each run a fault is drawn
(seeded) and injected after a random delay once the run is Running:

* ``none``;
* ``flow_kill``: the flow-run process SIGKILLed (the worker reports it Crashed);
* ``ray_node``: the Ray worker node SIGKILLed (the run retries its chunks on the head);
* ``api_crash``: the Prefect server SIGKILLed and relaunched at once;
* ``pg_kill``: PostgreSQL SIGKILLed, relaunched 2 s later;
* ``double_fire``: a second run for the same slot (a scheduler firing twice);
* ``ray_head``: the Ray head SIGKILLed (the run fails; the head and node are relaunched).

Every service a fault took down is relaunched before the next run (`tests/stack/faults.py::restore`).
A slot whose run did not complete gets one more run without a fault (the next scheduled run).  At the end
the bucket is checked (`tests/stack/faults.py::check_integrity`) and the report counts runs published, runs
failed cleanly (a final state, nothing published by them), hung runs, dangling ``latest.json`` pointers,
bad artifacts, duplicated results (two published runs of one window), lost results (a slot with no
published run after its retry), lost labels (label-store rows changed), duplicated label requests and
budget-ledger mismatches.

Usage::

    bash infra/stack/start.sh
    .venv/bin/python benchmarks/chaos_soak.py --runs 30 --seed 1 --json benchmarks/_work/chaos_soak.json

Exit 0 when every invariant held, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.stack import faults as F  # noqa: E402
from tests.stack.conftest import Stack, deploy, evaluations_file, new_bucket, parse_env, write_window  # noqa: E402

log = logging.getLogger("chaos_soak")

#: Fault kinds and their weights (the Ray head costs a cluster restart, so it is drawn less often).
FAULTS = {"none": 3, "flow_kill": 2, "ray_node": 2, "api_crash": 2, "pg_kill": 2, "double_fire": 2, "ray_head": 1}
OPTIONS = {"n_bootstrap": 2000, "seed": 0, "calibration_mode": "monotone", "inference": "bootstrap"}
N_PROMPTS = 5000


def schedule_run(stack: Stack, dep_id: str, evaluation: str) -> str:
    """A Scheduled flow run of the deployment for ``evaluation``, due now (what the scheduler creates)."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import Scheduled

    with stack.client() as c:
        run = c.create_flow_run_from_deployment(uuid.UUID(dep_id), parameters={"evaluation": evaluation,
                                                                              "options": OPTIONS},
                                                state=Scheduled(), tags=["chaos-soak"])
    assert run.state.type == StateType.SCHEDULED
    return str(run.id)


def inject(stack: Stack, fault: str, run_id: str, dep_id: str, evaluation: str, delay: float) -> list[str]:
    """Wait until the run is Running, then ``delay`` s, then inject ``fault``; returns extra run ids."""
    extra = []
    if fault == "double_fire":
        extra.append(schedule_run(stack, dep_id, evaluation))
    try:
        F.wait_running(stack, run_id, timeout=180)
    except AssertionError as exc:
        log.warning("run %s: %s (fault %s not injected)", run_id, exc, fault)
        return extra
    time.sleep(delay)
    if fault == "flow_kill":
        pid = F.flow_run_pid(stack, run_id)
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    elif fault == "ray_node":
        stack.kill("ray-worker")
    elif fault == "api_crash":
        stack.kill("prefect-server")
        stack.launch("prefect-server")
    elif fault == "pg_kill":
        stack.kill("postgres")
        time.sleep(2)
        F.restart_postgres(stack)
    elif fault == "ray_head":
        stack.kill("ray-head")
    return extra


def soak(stack: Stack, runs: int, seed: int, timeout: float = 420.0) -> dict:
    """Run the soak (see the module docstring); returns the report."""
    rng = random.Random(seed)
    kinds, weights = zip(*FAULTS.items())
    t_all = time.monotonic()
    with new_bucket(stack) as bucket, tempfile.TemporaryDirectory(prefix="chaos-soak-") as tmp:
        write_window(stack, bucket, n_prompts=N_PROMPTS, seed=seed)
        labels0 = F.labels_stored(stack, bucket)
        name = f"soak-{uuid.uuid4().hex[:6]}"
        dep_id = deploy(stack, evaluations_file(Path(tmp), name, bucket))  # the tests' crash timeout (HEARTBEAT_TIMEOUT, the product default 90 s)
        rows, slots = [], []
        states = Counter()
        hung = 0
        try:
            for i in range(runs):
                ev = f"{name}-{i:03d}"
                slots.append(ev)
                fault = rng.choices(kinds, weights)[0]
                delay = round(rng.uniform(0.0, 8.0), 2)
                t0 = time.monotonic()
                run_id = schedule_run(stack, dep_id, ev)
                ids = [run_id, *inject(stack, fault, run_id, dep_id, ev, delay)]
                finals = []
                for rid in ids:
                    try:
                        finals.append(F.wait_final(stack, rid, timeout=timeout).state.type.value)
                    except AssertionError as exc:
                        log.error("%s", exc)
                        finals.append("HUNG")
                        hung += 1
                fixed = F.restore(stack)
                n_pub = F.check_integrity(stack, bucket, [ev]).published[ev]
                retry = None
                if n_pub == 0:  # the next scheduled run of the slot, without a fault
                    retry = F.wait_final(stack, schedule_run(stack, dep_id, ev), timeout=timeout).state.type.value
                for s in finals:
                    states[s] += 1
                row = {"i": i, "slot": ev, "fault": fault, "delay_s": delay, "states": finals, "retry": retry,
                       "published_before_retry": n_pub, "restored": fixed,
                       "wall_s": round(time.monotonic() - t0, 1)}
                log.info("run %d/%d %s", i + 1, runs, json.dumps(row))
                rows.append(row)
        finally:
            with stack.client() as c:
                c.delete_deployment(uuid.UUID(dep_id))
        got = F.check_integrity(stack, bucket, slots)
    first = [r["states"][0] for r in rows]
    return {
        "runs": runs, "seed": seed, "faults": dict(Counter(r["fault"] for r in rows)),
        "published": sum(1 for r in rows if r["states"][0] == "COMPLETED"),
        "failed_cleanly": sum(1 for r in rows if r["states"][0] in ("FAILED", "CRASHED", "CANCELLED")
                              and r["published_before_retry"] == 0),
        "final_states": dict(Counter(first)), "all_states": dict(states),
        "retries": sum(1 for r in rows if r["retry"]),
        "retries_completed": sum(1 for r in rows if r["retry"] == "COMPLETED"),
        "hung": hung,
        "dangling_pointers": len(got.dangling_pointers),
        "bad_artifacts": len(got.bad_artifacts),
        "duplicated_results": len(got.duplicated_results),
        "lost_results": sum(1 for ev in slots if got.published.get(ev, 0) == 0),
        "uncommitted_attempts": len(got.uncommitted_attempts),
        "lost_labels": abs(got.labels_stored - labels0),
        "label_requests": got.requests, "duplicated_requests": len(got.duplicated_requests),
        "ledger_labels": got.ledger_labels, "requested_labels": got.requested_labels,
        "problems": got.problems(), "wall_s": round(time.monotonic() - t_all, 1), "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--runs``, ``--seed``, ``--env``, ``--json``; exit 0 when every invariant held."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--env", default=os.environ.get("CJE_STACK_ENV") or "/tmp/cje-stack/env")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for name in ("httpx", "prefect", "botocore", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    stack = Stack(parse_env(Path(args.env)))
    stack.wait_api(timeout=30)
    report = soak(stack, args.runs, args.seed)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    summary = {k: v for k, v in report.items() if k != "rows"}
    print(json.dumps(summary, indent=1))
    bad = (report["hung"] or report["dangling_pointers"] or report["bad_artifacts"] or report["duplicated_results"]
           or report["lost_results"] or report["lost_labels"] or report["problems"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
