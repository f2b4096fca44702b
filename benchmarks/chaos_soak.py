"""Chaos soak on the loopback stack: many scheduled runs, faults injected at seeded random points.

Needs the stack of ``infra/stack/start.sh`` (its env file: ``--env`` or ``CJE_STACK_ENV``, default
/tmp/cje-stack/env).  One window of simulated logs and its label store go into a fresh bucket; ``--lanes``
evaluations are deployed with one ``cje deploy`` (each deployment keeps the product's concurrency limit of
one run at a time).  The soak then goes in rounds: each round schedules one flow run per lane through the
Prefect API (Scheduled state, as the server's scheduler makes them), each for a slot of its own (its
evaluation name), so ``--lanes`` runs are in flight at once.  For each slot a fault is drawn (seeded, with
`FAULTS`' weights) and injected a random delay (seeded, ``0..MAX_DELAY`` s) after its run is Running, so the
fault lands in any phase of the run (reading, bootstrap, publishing, label requests, pages):

* ``none``;
* ``flow_kill``: the slot's flow-run process SIGKILLed (the worker reports it Crashed);
* ``ray_node``: the Ray worker node SIGKILLed (runs retry their chunks on the head; the node is supervised);
* ``api_crash``: the Prefect server SIGKILLed and relaunched at once;
* ``pg_kill``: PostgreSQL SIGKILLed, relaunched 2 s later;
* ``double_fire``: a second run for the same slot (a scheduler firing twice);
* ``ray_head``: the Ray head SIGKILLed (runs fail; the head is relaunched, the node rejoins by itself).

A fault of a shared service hits every run in flight, not only its slot's (faults of one round are
injected one at a time, in the order their delays come due).  After a round every run is waited for until a
final state (a run that does not get there within ``--timeout`` s is *hung*), every service a fault took
down is relaunched (`tests/stack/faults.py::restore`) and the round's slots are checked: a slot with no
published run gets a retry, its next scheduled run, in the next round on its lane, in place of that lane's
new slot; a retry has no fault of its own, but a shared-service fault of its round may still hit it, so a slot is
retried until one of its retries ran in a round without an injected shared-service fault (a *clean* retry: that one
must publish), at most `MAX_TRIES` runs in all (seen: a slot's own flow-run kill, then the next round's Ray head,
then an API crash while its subflow was created, three runs and no fault-free one).  At the end the whole bucket is checked (`tests/stack/faults.py::check_integrity`)
and the report counts runs published (the slot's first run completed), runs failed cleanly (it ended
failed/crashed/cancelled and nothing of the slot was published before its retry), runs failed after
publishing (a fault after the manifest's commit: the result stays published, no retry), hung runs,
dangling ``latest.json`` pointers, bad artifacts, duplicated results (two published runs of one window), lost
results (a slot with no published run after its retries), lost labels (label-store rows changed),
duplicated label requests and budget-ledger mismatches, and each round's wall time by phase.

Usage::

    bash infra/stack/start.sh
    .venv/bin/python benchmarks/chaos_soak.py --runs 30 --lanes 5 --seed 33 --json benchmarks/_work/chaos_soak.json

Exit 0 when every invariant held, 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.stack import faults as F  # noqa: E402
from tests.stack.conftest import (  # noqa: E402
    _DEPLOYED,
    HEARTBEAT_TIMEOUT,
    Stack,
    evaluations_file,
    new_bucket,
    parse_env,
    write_window,
)

log = logging.getLogger("chaos_soak")

#: Fault kinds and their weights (the Ray head costs a cluster restart, so it is drawn less often).
FAULTS = F.SOAK_FAULTS
#: Faults of a shared service (they hit every run in flight).
SHARED = {"ray_node", "api_crash", "pg_kill", "ray_head"}
#: 1,000 prompts x 5 policies and 500 replicates: a run spends ~20 s Running (read ~5 s, bootstrap ~3 s,
#: publish, label requests, pages ~2 s each; measured 16:13 UTC, load 5), almost all of it the flow's own
#: steps and their Ray and S3 round trips rather than arithmetic, so a larger window only lengthens the soak.
OPTIONS = {"n_bootstrap": 500, "seed": 0, "calibration_mode": "monotone", "inference": "bootstrap"}
N_PROMPTS = 1000
#: Faults land 0 to MAX_DELAY s after the run is Running: any of its phases (it is Running ~20 s).
MAX_DELAY = 20.0
#: Runs per slot at most (the first and up to four retries; retries stop at the first clean one).
MAX_TRIES = 5


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


def deploy_lanes(stack: Stack, tmp: Path, name: str, bucket: str, lanes: int) -> list[str]:
    """One ``cje deploy`` of ``lanes`` evaluations over the bucket; their deployment ids, lane order."""
    import yaml

    entry = yaml.safe_load(evaluations_file(tmp, name, bucket).read_text())["evaluations"][0]
    names = [f"{name}-l{k}" for k in range(lanes)]
    cfg = tmp / "lanes.yaml"
    cfg.write_text(yaml.safe_dump({"evaluations": [dict(entry, name=n) for n in names]}))
    out = stack.cje("deploy", "--config", str(cfg), "--pool", stack.pool, "--no-drift",
                    "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with stack.client() as c:
        ids = [str(c.read_deployment_by_name(f"evaluate_and_audit/{n}").id) for n in names]
    _DEPLOYED.extend(ids)
    return ids


def _wait_running(stack: Stack, run_id: str, timeout: float) -> None:
    """Until the run is Running with its process known (polled every second; the API may be down meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            run = F.read_run(stack, run_id)
            state = run.state.type.value if run.state else None
        except Exception:  # noqa: BLE001 - another fault of the round took the API down
            run, state = None, None
        if state == "RUNNING" and run.infrastructure_pid:
            return
        assert state not in F.FINAL, f"run {run_id} ended {state} before running"
        assert time.monotonic() < deadline, f"run {run_id} not running after {timeout:.0f} s (state {state})"
        time.sleep(1.0)


class Injector:
    """Injects the faults of one round, one at a time (a lock), each once its run is Running plus its delay."""

    def __init__(self, stack: Stack):
        self.stack, self.lock = stack, threading.Lock()
        self.threads: list[threading.Thread] = []
        self.injected: dict[int, str] = {}

    def start(self, i: int, fault: str, run_id: str, delay: float) -> None:
        t = threading.Thread(target=self._inject, args=(i, fault, run_id, delay), daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def _inject(self, i: int, fault: str, run_id: str, delay: float) -> None:
        stack = self.stack
        try:
            _wait_running(stack, run_id, timeout=240)
        except Exception as exc:  # noqa: BLE001 - ended or never started (another fault): nothing to hit
            self.injected[i] = f"not injected: {exc}"
            return
        time.sleep(delay)
        try:
            with self.lock:
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
            self.injected[i] = "injected"
        except Exception as exc:  # noqa: BLE001 - reported; restore() brings the stack back
            self.injected[i] = f"injection failed: {type(exc).__name__}: {exc}"


def wait_all(stack: Stack, run_ids: list[str], timeout: float, pause: float = 2.0) -> dict[str, str]:
    """The final state type of every run (``HUNG``: none within ``timeout`` s), polled together with one client
    per poll (a client per run and poll cost the soak ~2 CPU s a run)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    out: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(run_ids) and time.monotonic() < deadline:
        todo = [uuid.UUID(r) for r in run_ids if r not in out]
        try:
            with stack.client() as c:
                runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=todo)))
        except Exception:  # noqa: BLE001 - the API or its database may be down (a fault)
            runs = []
        for run in runs:
            state = run.state.type.value if run.state else None
            if state in F.FINAL:
                out[str(run.id)] = state
        if len(out) < len(run_ids):
            time.sleep(pause)
    for r in run_ids:
        if r not in out:
            log.error("flow run %s not in a final state after %.0f s: hung", r, timeout)
            out[r] = "HUNG"
    return out


def soak(stack: Stack, runs: int, seed: int, lanes: int = 5, timeout: float = 420.0,
         progress: Path | None = None) -> dict:
    """Run the soak (see the module docstring); returns the report.

    ``progress``: after each round, the rounds and slots so far are written there (``"complete": false``), so a
    soak stopped from outside (its test's time limit) still shows where its time went.
    """
    rng = random.Random(seed)
    kinds, weights = zip(*FAULTS.items())
    plan = [(rng.choices(kinds, weights)[0], round(rng.uniform(0.0, MAX_DELAY), 2)) for _ in range(runs)]
    t_all = time.monotonic()
    with new_bucket(stack) as bucket, tempfile.TemporaryDirectory(prefix="chaos-soak-") as tmp:
        t0 = time.monotonic()
        write_window(stack, bucket, n_prompts=N_PROMPTS, seed=seed)
        labels0 = F.labels_stored(stack, bucket)
        name = f"soak-{uuid.uuid4().hex[:6]}"
        deps = deploy_lanes(stack, Path(tmp), name, bucket, lanes)
        setup_s = round(time.monotonic() - t0, 1)
        rows: list[dict] = []
        rounds: list[dict] = []
        retry_of: dict[int, int] = {}  # lane -> slot index waiting for its retry
        restore_failed: list[str] = []
        nxt = 0
        try:
            while nxt < runs or retry_of:
                r0, cpu0 = time.monotonic(), F.stack_cpu_seconds(stack) + time.process_time()
                injector = Injector(stack)
                waits: list[tuple[int, str, str]] = []  # (slot, kind, run id)
                for lane in range(lanes):
                    if lane in retry_of:  # the slot's next scheduled run takes its lane's turn this round
                        i = retry_of.pop(lane)
                        waits.append((i, "retry", schedule_run(stack, deps[lane], rows[i]["slot"])))
                    elif nxt < runs:
                        i, nxt = nxt, nxt + 1
                        fault, delay = plan[i]
                        ev = f"{name}-{i:03d}"
                        rows.append({"i": i, "lane": lane, "round": len(rounds), "slot": ev, "fault": fault,
                                     "delay_s": delay, "states": [], "retries": []})
                        run_id = schedule_run(stack, deps[lane], ev)
                        waits.append((i, "first", run_id))
                        if fault == "double_fire":
                            waits.append((i, "double", schedule_run(stack, deps[lane], ev)))
                        injector.start(i, fault, run_id, delay)
                injector.join()
                t_injected = time.monotonic()
                # a shared-service fault injected this round hits every run in flight, the retries included
                shared_hit = any(rows[i]["fault"] in SHARED and injector.injected.get(i) == "injected"
                                 for i, k, _ in waits if k == "first")
                finals = wait_all(stack, [run_id for _, _, run_id in waits], timeout)
                for i, kind, run_id in waits:
                    (rows[i]["retries"] if kind == "retry" else rows[i]["states"]).append(finals[run_id])
                    if kind == "retry":
                        rows[i]["clean_retries"] = rows[i].get("clean_retries", 0) + (not shared_hit)
                t_final = time.monotonic()
                try:
                    fixed = F.restore(stack)
                except AssertionError as exc:  # a service that does not come back: reported, the soak stops
                    log.error("restore failed: %s", exc)
                    restore_failed.append(f"round {len(rounds)}: {exc}")
                    break
                t_restored = time.monotonic()
                slots = sorted({i for i, _, _ in waits})
                got = F.check_integrity(stack, bucket, [rows[i]["slot"] for i in slots])
                for i in slots:
                    row = rows[i]
                    n_pub = got.published[row["slot"]]
                    if not row["retries"]:
                        row["published_before_retry"] = n_pub
                        row["injected"] = injector.injected.get(i, "-")
                    if n_pub == 0 and not row.get("clean_retries") and 1 + len(row["retries"]) < MAX_TRIES:
                        retry_of[row["lane"]] = i
                rounds.append({"round": len(rounds), "slots": slots, "runs": len(waits), "restored": fixed,
                               "shared_fault": shared_hit,
                               "faults": [rows[i]["fault"] for i, k, _ in waits if k == "first"],
                               "to_last_fault_s": round(t_injected - r0, 1), "to_final_s": round(t_final - r0, 1),
                               "restore_s": round(t_restored - t_final, 1),
                               "check_s": round(time.monotonic() - t_restored, 1),
                               "wall_s": round(time.monotonic() - r0, 1),
                               "cpu_s": round(F.stack_cpu_seconds(stack) + time.process_time() - cpu0, 1)})
                log.info("round %s", json.dumps(rounds[-1]))
                if progress is not None:
                    progress.parent.mkdir(parents=True, exist_ok=True)
                    progress.write_text(json.dumps({"complete": False, "runs": runs, "seed": seed,
                                                    "elapsed_s": round(time.monotonic() - t_all, 1),
                                                    "round_walls": rounds, "rows": rows}, indent=1))
        finally:
            for dep in deps:
                with contextlib.suppress(Exception), stack.client() as c:
                    c.delete_deployment(uuid.UUID(dep))
                _DEPLOYED.remove(dep)
        got = F.check_integrity(stack, bucket, [r["slot"] for r in rows])
    first = [r["states"][0] for r in rows]
    failed = ("FAILED", "CRASHED", "CANCELLED")
    return {
        "complete": True, "runs": runs, "seed": seed, "lanes": lanes, "rounds": len(rounds),
        "faults": dict(Counter(r["fault"] for r in rows)),
        "runs_scheduled": sum(len(r["states"]) + len(r["retries"]) for r in rows),
        "published": sum(1 for s in first if s == "COMPLETED"),
        "failed_cleanly": sum(1 for r in rows if r["states"][0] in failed and r.get("published_before_retry", 0) == 0),
        "failed_after_publishing": sum(1 for r in rows if r["states"][0] in failed and r.get("published_before_retry", 0) > 0),
        "final_states": dict(Counter(first)),
        "all_states": dict(Counter(s for r in rows for s in r["states"] + r["retries"])),
        "retries": sum(len(r["retries"]) for r in rows),
        "retries_completed": sum(1 for r in rows for s in r["retries"] if s == "COMPLETED"),
        "clean_retries": sum(r.get("clean_retries", 0) for r in rows),
        "hung": sum(1 for r in rows for s in r["states"] + r["retries"] if s == "HUNG"),
        "dangling_pointers": len(got.dangling_pointers),
        "bad_artifacts": len(got.bad_artifacts),
        "duplicated_results": len(got.duplicated_results),
        "lost_results": sum(1 for r in rows if got.published.get(r["slot"], 0) == 0),
        "uncommitted_attempts": len(got.uncommitted_attempts),
        "lost_labels": abs(got.labels_stored - labels0),
        "label_requests": got.requests, "duplicated_requests": len(got.duplicated_requests),
        "ledger_labels": got.ledger_labels, "requested_labels": got.requested_labels,
        "problems": got.problems() + restore_failed, "setup_s": setup_s, "wall_s": round(time.monotonic() - t_all, 1),
        "rounds_cpu_s": round(sum(r["cpu_s"] for r in rounds), 1),
        "round_walls": rounds, "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--runs``, ``--lanes``, ``--seed``, ``--env``, ``--json``; exit 0 when every invariant held."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--lanes", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--env", default=os.environ.get("CJE_STACK_ENV") or "/tmp/cje-stack/env")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for name in ("httpx", "prefect", "botocore", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    stack = Stack(parse_env(Path(args.env)))
    stack.wait_api(timeout=30)
    report = soak(stack, args.runs, args.seed, lanes=args.lanes, progress=Path(args.json) if args.json else None)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    summary = {k: v for k, v in report.items() if k not in ("rows", "round_walls")}
    print(json.dumps(summary, indent=1))
    bad = (report["hung"] or report["dangling_pointers"] or report["bad_artifacts"] or report["duplicated_results"]
           or report["lost_results"] or report["lost_labels"] or report["problems"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
