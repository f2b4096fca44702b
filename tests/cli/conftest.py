"""CLI tests: the `cje` parser, commands and outputs, in-process (`flows.cli.main.main`) where that
shows the behaviour and as a subprocess where the process boundary matters (exit codes, no
traceback, terminal detection). No Prefect server is started here: the service-mode checks
under test run before Prefect and Ray would start."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from cje_engine.simulate.direct import simulate

REPO = Path(__file__).resolve().parents[2]


def cje_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "RAY_", "CJE_CONFIG"))}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


def run_cje(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 120):
    """`cje ARGS` as a subprocess (``python -m flows.cli.main``)."""
    return subprocess.run([sys.executable, "-m", "flows.cli.main", *args], cwd=cwd, env=env or cje_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in an empty folder (no ./evaluations.yaml) without CJE_CONFIG."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CJE_CONFIG", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def team_csv(tmp_path_factory) -> Path:
    """A CSV in the shape teams have: id, model, judge_score on 1-10, human_rating on 1-5."""
    f = simulate(240, seed=11).frame
    out = pd.DataFrame({
        "id": f["prompt_id"], "model": f["policy"],
        "judge_score": (1 + 9 * f["judge_score"]).round(3),
        "human_rating": (1 + 4 * f["oracle_label"]).round(3),
        "response_length": f["response_length"],
    })
    path = tmp_path_factory.mktemp("team") / "scores.csv"
    out.to_csv(path, index=False)
    return path


@pytest.fixture(scope="session")
def canonical_parquet(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("canon") / "scored.parquet"
    simulate(240, seed=2).frame.to_parquet(path)
    return path


@pytest.fixture(autouse=True)
def _restore_logging():
    """`main()` reconfigures the root logger (as the `cje` process does); undo it after each test."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
