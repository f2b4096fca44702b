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


@pytest.hookimpl(tryfirst=True)  # before the -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    """Every test of tests/stats that is not ``slow`` is marked ``stats``: the Monte Carlo property checks,
    outside the default run, run by CI's service tier beside the stack tests (.ci/services; a few Monte
    Carlo checks elsewhere carry the marker themselves)."""
    stats_dir = Path(__file__).parent / "stats"
    for item in items:
        if stats_dir in Path(str(item.fspath)).parents and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.stats)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``: the flow tests' files on one worker, the costliest files first
    (`tests.xdist_schedule.ClusterFirstScheduling`); other modes are pytest-xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.xdist_schedule import ClusterFirstScheduling

    return ClusterFirstScheduling(config, log)
