"""Fixtures of the labelling tests: a simulated case with a failed audit, and the moto S3 server."""
from __future__ import annotations

import secrets

import numpy as np
import pyarrow as pa
import pytest

MOTO_KEYS = {"AWS_ACCESS_KEY_ID": "cjetestaccesskey", "AWS_SECRET_ACCESS_KEY": "cje-test-secret-never-printed",
             "AWS_REGION": "us-east-1"}


def simulate_audit_case():
    """400 prompts x (base, clone, unhelpful), 5 audit labels per non-calibration policy, two log
    dates: ``(sim, table, result)``, where the engine fails unhelpful's audit and clone's is
    inconclusive (also the pinned sampler cases' input, tests/labelling/test_sampler_pinned.py)."""
    from cje_engine import evaluate
    from cje_engine.simulate.direct import PolicySpec, simulate

    policies = (PolicySpec("base", quality_shift=0.8), PolicySpec("clone", quality_shift=0.8),
                PolicySpec("unhelpful", quality_shift=-1.0, adversarial=True))
    sim = simulate(400, policies, label_design="calibration_policy", oracle_fraction=0.25, audit_labels=5, seed=1)
    frame = sim.frame.copy()
    frame["dt"] = np.where(frame["prompt_id"].str[-1].astype(int) % 2 == 0, "2025-03-02", "2025-03-01")
    result = evaluate(frame.drop(columns=["dt"]), covariates=["response_length"], calibration_policies=["base"],
                      inference="analytic", seed=0).to_dict()
    return sim, pa.Table.from_pandas(frame, preserve_index=False), result


@pytest.fixture(scope="session")
def audit_case():
    """`simulate_audit_case`, once per session."""
    return simulate_audit_case()


@pytest.fixture(scope="session")
def moto():
    from tests.s3server import start_s3_server

    server = start_s3_server()
    yield server
    server.stop()


@pytest.fixture
def moto_bucket(moto, monkeypatch):
    """A fresh bucket; this process's storage settings point at the moto server."""
    import boto3

    for k, v in MOTO_KEYS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CJE_S3_ENDPOINT", moto.endpoint)
    name = "cje-labelling-" + secrets.token_hex(4)
    boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1", aws_access_key_id=MOTO_KEYS[
        "AWS_ACCESS_KEY_ID"], aws_secret_access_key=MOTO_KEYS["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=name)
    return name


# ------------------------------------------------------------------------------ Label Studio tier

LS_ENV_DEFAULT = "/tmp/cje-labelstudio/env"
LS_HINT = "start it with `bash infra/labelstudio/start.sh` (stop: `bash infra/labelstudio/stop.sh`)"


def pytest_configure(config):
    config.addinivalue_line("markers", "integration_labelstudio: needs the Label Studio server of "
                                       "infra/labelstudio/start.sh (skipped when it is not up, unless "
                                       "CJE_REQUIRE_LABEL_STUDIO=1)")


def _ls_unavailable(reason: str) -> None:
    """Fail under CJE_REQUIRE_LABEL_STUDIO=1 (CI), skip otherwise; never returns."""
    import os

    if os.environ.get("CJE_REQUIRE_LABEL_STUDIO") == "1":
        pytest.fail(f"Label Studio required (CJE_REQUIRE_LABEL_STUDIO=1) but {reason}; {LS_HINT}", pytrace=False)
    pytest.skip(f"Label Studio not available: {reason}; {LS_HINT}")


@pytest.fixture(scope="session")
def ls_env() -> dict:
    """URL and tokens of the running Label Studio (from the env file of infra/labelstudio/start.sh)."""
    import os
    import urllib.request
    from pathlib import Path

    path = Path(os.environ.get("CJE_LS_ENV") or LS_ENV_DEFAULT)
    if not path.is_file():
        _ls_unavailable(f"env file {path} does not exist")
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            env[k.strip()] = v.strip()
    for key in ("LABEL_STUDIO_URL", "LABEL_STUDIO_API_KEY", "LABEL_STUDIO_LEGACY_TOKEN"):
        if not env.get(key):
            _ls_unavailable(f"env file {path} lacks {key}")
    try:
        with urllib.request.urlopen(env["LABEL_STUDIO_URL"] + "/health", timeout=5) as r:
            r.read(1)
    except OSError as exc:
        _ls_unavailable(f"{env['LABEL_STUDIO_URL']} does not answer ({type(exc).__name__}: {exc})")
    return env


@pytest.fixture(scope="session")
def ls_prefect(ls_env):
    """A Prefect API server for the Label Studio tier (only started when Label Studio is up)."""
    from flows.runtime.prefect_server import launch_server, stop_server, use_api, wait_healthy

    server = launch_server()
    try:
        with use_api(wait_healthy(server).url):
            yield server
    finally:
        stop_server(server)


@pytest.fixture
def ls_token(ls_env, monkeypatch):
    """This process's LABEL_STUDIO_API_KEY: the server's personal access token."""
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", ls_env["LABEL_STUDIO_API_KEY"])
    return ls_env["LABEL_STUDIO_API_KEY"]
