"""Fixtures for the stack tier: the production topology on loopback.

``bash infra/stack/start.sh`` (``.ci/run`` does it) starts PostgreSQL, a Prefect server on it, a
process work pool with one worker, a two-node Ray cluster and radosgw, and writes an env file
(``CJE_STACK_ENV``, default /tmp/cje-stack/env).  These fixtures only read that file; the fault
tests stop and relaunch single services by the PIDs and launch scripts it names.

* env file missing or the Prefect API not answering and ``CJE_REQUIRE_STACK=1`` (CI): FAIL;
* otherwise: skipped, with the command that starts the stack.

This process never initialises Ray and never changes its own environment: Prefect client calls
go through ``temporary_settings`` and every command runs as a subprocess with the stack's
environment (other tiers of the same pytest session run their own Prefect server and Ray).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STACK_ENV_DEFAULT = "/tmp/cje-stack/env"
START_HINT = "start it with `bash infra/stack/start.sh` (stop: `bash infra/stack/stop.sh`)"

#: Environment of the pytest process that must not leak into the stack's commands.
_DROP = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "PREFECT_API_URL",
         "AWS_ENDPOINT_URL", "CJE_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "PREFECT_HOME")


def parse_env(path: Path) -> dict[str, str]:
    out = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _unavailable(reason: str) -> None:
    if os.environ.get("CJE_REQUIRE_STACK") == "1":
        pytest.fail(f"the stack is required (CJE_REQUIRE_STACK=1) but {reason}; {START_HINT}", pytrace=False)
    pytest.skip(f"stack not available: {reason}; {START_HINT}")


def _healthy(api: str) -> bool:
    try:
        with urllib.request.urlopen(api.rstrip("/") + "/health", timeout=3) as r:
            return r.status == 200
    except OSError:
        return False


def session_pids(sid: int) -> list[int]:
    """Processes whose session id is ``sid`` (a service started with setsid by start.sh), and their
    descendants in sessions of their own (PostgreSQL's backends and the process worker's flow runs call
    setsid; a SIGKILL of the session alone left PostgreSQL's checkpointer running)."""
    sids, parents = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                pid = int(d.name)
                sids[pid] = os.getsid(pid)
                parents[pid] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out = []
    for pid in sids:
        q, n = pid, 0
        while q > 1 and n < 64:
            if sids.get(q) == sid:
                out.append(pid)
                break
            q, n = parents.get(q, 0), n + 1
    return out


@dataclass
class Stack:
    env: dict[str, str]

    @property
    def api(self) -> str:
        return self.env["PREFECT_API_URL"]

    @property
    def pool(self) -> str:
        return self.env["CJE_STACK_POOL"]

    # -- processes ------------------------------------------------------------------------
    def pids(self) -> dict[str, int]:
        out = {}
        for line in Path(self.env["CJE_STACK_PIDS"]).read_text().splitlines():
            name, _, pid = line.partition(" ")
            if pid.strip():
                out[name] = int(pid)
        return out

    def kill(self, name: str, sig: int = signal.SIGKILL, wait: float = 20.0) -> None:
        """Signal every process of the service's session (what a dead host/pod looks like)."""
        sid = self.pids()[name]
        for pid in session_pids(sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in session_pids(sid):  # whatever ignored the signal
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def launch(self, name: str, script: str | None = None, extra_env: dict[str, str] | None = None) -> int:
        """Start a service from its launch script (start.sh wrote it) and record its PID."""
        run = Path(self.env["CJE_STACK_RUN"]) / f"{script or name}.sh"
        log = open(Path(self.env["CJE_STACK_LOGS"]) / f"{name}.log", "ab")
        # The caller's cluster and API settings stay out (the soak runs with the stack's command environment,
        # RAY_ADDRESS=ray://... among it): a relaunched service gets what its launch script sets, as at start.
        env = {k: v for k, v in os.environ.items() if k not in _DROP}
        env.update(extra_env or {})
        proc = subprocess.Popen(["bash", str(run)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        log.close()
        with open(self.env["CJE_STACK_PIDS"], "a") as f:
            f.write(f"{name} {proc.pid}\n")
        return proc.pid

    def wait_api(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not _healthy(self.api):
            if time.monotonic() > deadline:
                raise AssertionError(f"Prefect API {self.api} not healthy after {timeout:.0f} s")
            time.sleep(0.5)

    # -- commands and the API ---------------------------------------------------------------
    def command_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROP}
        env.update({k: v for k, v in self.env.items() if not k.startswith("CJE_STACK_")})
        env.update({"DO_NOT_TRACK": "1", "RAY_USAGE_STATS_ENABLED": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
        return env

    def cje(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "cje"), *args], env=self.command_env(), capture_output=True, text=True,
                              timeout=timeout, cwd=REPO)

    @contextlib.contextmanager
    def client(self) -> Iterator[Any]:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.api}):
            with get_client(sync_client=True) as c:
                yield c

    def storage_config(self):
        from flows.storage.objects import StorageConfig

        return StorageConfig.from_env(environ=self.command_env())


@pytest.fixture(scope="session")
def stack() -> Stack:
    path = Path(os.environ.get("CJE_STACK_ENV") or STACK_ENV_DEFAULT)
    if not path.is_file():
        _unavailable(f"env file {path} does not exist")
    env = parse_env(path)
    if not _healthy(env.get("PREFECT_API_URL", "")):
        _unavailable(f"the Prefect API {env.get('PREFECT_API_URL')} named in {path} does not answer")
    return Stack(env)


@pytest.fixture
def bucket(stack: Stack) -> Iterator[str]:
    """A fresh bucket on the stack's radosgw (emptied and removed afterwards)."""
    with new_bucket(stack) as name:
        yield name


@contextlib.contextmanager
def new_bucket(stack: Stack) -> Iterator[str]:
    """A fresh bucket on the stack's radosgw for the block (emptied and removed afterwards)."""
    import boto3
    from botocore.config import Config

    s3 = boto3.session.Session().client(
        "s3", endpoint_url=stack.env["CJE_RGW_ENDPOINT"], region_name=stack.env["AWS_REGION"],
        aws_access_key_id=stack.env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=stack.env["AWS_SECRET_ACCESS_KEY"],
        config=Config(request_checksum_calculation="when_required", response_checksum_validation="when_required",
                      s3={"addressing_style": "path"}))
    name = f"cje-stack-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=name)
    yield name
    with contextlib.suppress(Exception):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", []) or []]
            if keys:
                s3.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        s3.delete_bucket(Bucket=name)


# ------------------------------------------------------------------------------ data and deployments

WINDOW_DAYS = 3


def write_window(stack: Stack, bucket: str, n_prompts: int = 240, seed: int = 0) -> None:
    """Simulated logs of the last `WINDOW_DAYS` full UTC days in s3://bucket/logs, labels in
    s3://bucket/labels (the label store)."""
    import numpy as np
    import pyarrow as pa

    from cje_engine.simulate.direct import simulate
    from flows.storage.labels import LabelStore
    from flows.storage.logs import write_logs
    from flows.storage.objects import Storage

    cfg = stack.storage_config()
    sim = simulate(n_prompts, label_design="calibration_policy", oracle_fraction=0.25, audit_labels=120, seed=seed)
    frame = sim.frame.copy()
    day = frame["prompt_id"].astype("category").cat.codes.to_numpy() % WINDOW_DAYS
    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    rng = np.random.default_rng(seed)
    frame["ts"] = [today - timedelta(days=WINDOW_DAYS - int(d), seconds=-float(s))
                   for d, s in zip(day, rng.uniform(0, 86399, len(frame)))]
    labels = frame.loc[frame["oracle_label"].notna(), ["response_id", "oracle_label", "label_probability"]]
    write_logs(Storage.for_uri(f"s3://{bucket}/logs", cfg),
               pa.Table.from_pandas(frame.drop(columns=["oracle_label", "label_probability"]), preserve_index=False),
               basename="sim")
    LabelStore(Storage.for_uri(f"s3://{bucket}", cfg)).append(
        pa.Table.from_pandas(labels.reset_index(drop=True), preserve_index=False), "oracle")


#: The evaluations' options but their replicates (`evaluations_file`).
RUN_OPTIONS = {"seed": 0, "calibration_mode": "monotone", "inference": "bootstrap"}
#: The window of the runs a fault hits mid-bootstrap (20,000 prompts x 5 policies) and their replicates: about
#: 2.3 ms of CPU per replicate at this size, in 4 chunks (two per one-CPU Ray node), so each chunk runs ~4.6 s of
#: CPU (longer under CI's load) and a fault sent as a chunk is seen running (polls every 0.2 s) lands inside it;
#: the whole bootstrap ~18 CPU s. (Until 6 December test_stack.py used 20,000 replicates, ~46 CPU s a run.)
SLOW_PROMPTS = 20000
SLOW_B = 8000
#: Replicates of a run no fault interrupts.
FAST_B = 200


def evaluations_file(tmp_path: Path, name: str, bucket: str, *, interval: float | None = None,
                     n_bootstrap: int = 400) -> Path:
    """An evaluations.yaml with one evaluation over the bucket (no drift monitors)."""
    import yaml

    entry: dict[str, Any] = {
        "name": name, "logs_uri": f"s3://{bucket}/logs", "labels_uri": f"s3://{bucket}", "results_uri": f"s3://{bucket}",
        "window": f"last {WINDOW_DAYS} days",
        "options": dict(RUN_OPTIONS, n_bootstrap=n_bootstrap),
    }
    if interval:
        entry["interval"] = interval
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"evaluations": [entry]}))
    return path


_DEPLOYED: list[str] = []


@pytest.fixture(autouse=True)
def _remove_deployments(stack: Stack) -> Iterator[None]:
    """Delete the deployments a test created (their schedules stop; runs already started go on)."""
    yield
    while _DEPLOYED:
        dep_id = _DEPLOYED.pop()
        with contextlib.suppress(Exception), stack.client() as c:
            c.delete_deployment(uuid.UUID(dep_id))


#: The crash automation's timeout the stack tests deploy with: the product's default (`cje deploy`, three
#: heartbeats of 30 s).  At 40 s a healthy run was marked Crashed in CI ("no heartbeat for 40 s") when one
#: heartbeat arrived 10 s late on the loaded 2-core machine.
HEARTBEAT_TIMEOUT = 90.0


def deploy(stack: Stack, config: Path, heartbeat_timeout: float = HEARTBEAT_TIMEOUT) -> str:
    """`cje deploy` on the stack's pool; returns the deployment id."""
    out = stack.cje("deploy", "--config", str(config), "--pool", stack.pool, "--no-drift",
                    "--heartbeat-timeout", str(heartbeat_timeout))
    assert out.returncode == 0, out.stderr[-3000:]
    import yaml

    name = yaml.safe_load(config.read_text())["evaluations"][0]["name"]
    with stack.client() as c:
        dep_id = str(c.read_deployment_by_name(f"evaluate_and_audit/{name}").id)
    _DEPLOYED.append(dep_id)
    return dep_id


def runs_of(stack: Stack, deployment_id: str) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with stack.client() as c:
        return c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[uuid.UUID(deployment_id)])))


def start_run(stack: Stack, deployment_id: str, parameters: dict | None = None) -> str:
    """A flow run of the deployment (``parameters`` override the deployment's); returns its id."""
    with stack.client() as c:
        return str(c.create_flow_run_from_deployment(uuid.UUID(deployment_id), parameters=parameters or {}).id)


def read_run(stack: Stack, run_id: str):
    with stack.client() as c:
        return c.read_flow_run(uuid.UUID(run_id))


def wait_state(stack: Stack, run_id: str, states: set[str], timeout: float = 300.0):
    """Poll until the run is in one of ``states`` (type names); fail on another final state."""
    deadline = time.monotonic() + timeout
    final = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
    last = None
    while time.monotonic() < deadline:
        try:
            run = read_run(stack, run_id)
        except Exception:  # noqa: BLE001 - the API may be restarting
            time.sleep(1.0)
            continue
        last = run.state.type.value if run.state else None
        if last in states:
            return run
        if last in final:
            raise AssertionError(f"flow run {run_id} ended {last}: {run.state.message}")
        time.sleep(1.0)
    raise AssertionError(f"flow run {run_id} not in {sorted(states)} after {timeout:.0f} s (last: {last})")


def published(stack: Stack, bucket: str, evaluation: str) -> list[dict]:
    """Manifests under results/<evaluation>/ (one per published run)."""
    from flows.storage.objects import Storage

    st = Storage.for_uri(f"s3://{bucket}", stack.storage_config())
    out = []
    for o in st.list(f"results/{evaluation}/"):
        if o.key.endswith("/manifest.json"):
            m = json.loads(st.read_bytes(o.key))
            m["_key"] = o.key
            out.append(m)
    return out


def result_of(stack: Stack, bucket: str, manifest: dict) -> dict:
    from flows.storage.objects import Storage

    st = Storage.for_uri(f"s3://{bucket}", stack.storage_config())
    run = manifest["_key"].rsplit("/", 1)[0]
    return json.loads(st.read_bytes(f"{run}/{manifest['artifacts']['result.json']['key']}"))
