"""Shared test settings: no telemetry, no network, paths to shared data."""
from __future__ import annotations

import os
from pathlib import Path

# Turn off every phone-home before Prefect or Ray is imported anywhere.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_PROMPT_ENABLED", "0")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARENA = Path(os.environ.get("CJE_ARENA_DIR", REPO.parent / "shared" / "data" / "arena_sample"))


@pytest.fixture(scope="session")
def arena_dir() -> Path:
    """The real Chatbot Arena sample shipped beside the repo (../shared/data/arena_sample)."""
    if not (ARENA / "fresh_draws").is_dir():
        pytest.fail(f"arena sample not found at {ARENA}; set CJE_ARENA_DIR")
    return ARENA


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """The service tier's two workers (``-n 2 --dist loadgroup``, .ci/run): every test under tests/stack in
    one worker, in order (they kill and restart the shared Prefect server, worker, PostgreSQL and Ray
    nodes, and mostly wait on heartbeats); every other test of that tier (radosgw, Label Studio, the
    lifecycle tests of `cje run`/`cje ui` under real signals, the statistical property checks of
    tests/stats: none uses the stack's Prefect or Ray) in the other, on the CPU the stack tests leave idle.
    Without ``--dist loadgroup`` (the default tier's ``loadfile``) the groups change nothing.

    Every test of tests/stats that is not ``slow`` is marked ``stats`` here (a few Monte Carlo checks
    elsewhere carry the marker themselves)."""
    here = Path(__file__).parent
    for item in items:
        parents = Path(str(item.fspath)).parents
        if here / "stats" in parents and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.stats)  # Monte Carlo property checks: CI's service tier (see pyproject)
        item.add_marker(pytest.mark.xdist_group("stack" if here / "stack" in parents else "beside-stack"))
