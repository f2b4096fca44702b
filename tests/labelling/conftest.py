"""Fixtures of the labelling tests: a simulated case with a failed audit, and the moto S3 server."""
from __future__ import annotations

import secrets

import numpy as np
import pyarrow as pa
import pytest

MOTO_KEYS = {"AWS_ACCESS_KEY_ID": "cjetestaccesskey", "AWS_SECRET_ACCESS_KEY": "cje-test-secret-never-printed",
             "AWS_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def audit_case():
    """400 prompts x (base, clone, unhelpful), 5 audit labels per non-calibration policy: the engine
    refuses unhelpful (failed audit) and clone's audit is inconclusive."""
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
