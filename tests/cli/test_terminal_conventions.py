"""The terminal conventions of issue 26: ``-q`` quiets Prefect too, every ``--json`` error is one JSON
document on stdout, `cje drift` exits 1 on an alarm, no abbreviated options, and `cje evaluate` writes
its files with the mode of published ones."""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import stat
import subprocess
import sys

import pytest

from flows.cli.exits import EXIT_BAD_INPUT, EXIT_GATE_FAILED, EXIT_OK, EXIT_USAGE

from .conftest import REPO, cje_env

cli = importlib.import_module("flows.cli.main")

#: A `cje` process whose `demo` command only logs through Prefect's loggers (imported after main()
#: set logging up, as every Prefect command does), at INFO and at WARNING.
PREFECT_LOGGING_PROBE = """
import sys
import flows.cli.main as m

def probe(ns):
    from prefect.logging import get_logger
    get_logger("prefect.flow_runs").info("PREFECT-INFO-LINE")
    get_logger("prefect.task_runs").info("PREFECT-TASK-INFO-LINE")
    get_logger("prefect.flow_runs").warning("PREFECT-WARNING-LINE")
    import os
    print("child env:", os.environ.get("PREFECT_LOGGING_LEVEL"))
    return 0

m.cmd_demo = probe
sys.exit(m.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("quiet", [False, True])
def test_quiet_silences_prefects_info_lines(quiet, tmp_path):
    env = cje_env()
    env.pop("PREFECT_LOGGING_LEVEL", None)
    args = ["-q", "demo"] if quiet else ["demo"]
    r = subprocess.run([sys.executable, "-c", PREFECT_LOGGING_PROBE, *args], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "PREFECT-WARNING-LINE" in r.stderr  # warnings always reach the terminal
    if quiet:
        assert "PREFECT-INFO-LINE" not in r.stderr and "PREFECT-TASK-INFO-LINE" not in r.stderr
        assert "child env: WARNING" in r.stdout  # flow-run and server processes inherit it
    else:
        assert "PREFECT-INFO-LINE" in r.stderr and "PREFECT-TASK-INFO-LINE" in r.stderr


def test_quiet_quiets_prefect_already_imported(capsys):
    """In a process that imported Prefect before `main` (tests, notebooks) the loggers are set too."""
    import logging

    import prefect  # noqa: F401
    from prefect.logging import get_logger

    levels = {n: logging.getLogger(n).level for n in cli.PREFECT_LOGGERS}
    old_env = os.environ.get("PREFECT_LOGGING_LEVEL")
    try:
        cli._setup_logging(False, True)
        assert not get_logger("prefect.flow_runs").isEnabledFor(logging.INFO)
        assert get_logger("prefect.flow_runs").isEnabledFor(logging.WARNING)
    finally:
        for n, lvl in levels.items():
            logging.getLogger(n).setLevel(lvl)
        if old_env is None:
            os.environ.pop("PREFECT_LOGGING_LEVEL", None)
        else:
            os.environ["PREFECT_LOGGING_LEVEL"] = old_env


def _cfg(tmp_path):
    cfg = tmp_path / "evaluations.yaml"
    cfg.write_text("evaluations:\n  - name: ev\n    logs_uri: ./logs\n"
                   "drift_monitors:\n  - name: mon\n    set_name: s\n    anchors_uri: ./anchors\n")
    return cfg


@pytest.mark.parametrize("argv,code,kind", [
    (["runs", "nope", "--json"], EXIT_BAD_INPUT, "bad input"),
    (["diff", "nope", "--json"], EXIT_BAD_INPUT, "bad input"),
    (["run", "nope", "--json"], EXIT_BAD_INPUT, "bad input"),
    (["requests", "status", "--evaluation", "nope", "--json"], EXIT_BAD_INPUT, "bad input"),
    (["evaluate", "missing.csv", "--out", "o", "--json"], EXIT_BAD_INPUT, "bad input"),
    (["evaluate", "--json"], EXIT_USAGE, "usage error"),
])
def test_json_errors_are_one_json_document_on_stdout(argv, code, kind, tmp_path, monkeypatch, capsys, in_tmp):
    _cfg(in_tmp)
    assert cli.main(argv) == code
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout is one JSON document, not empty
    assert doc["cje_json"] == 1 and doc["command"] == argv[0] + (" status" if argv[0] == "requests" else "")
    assert doc["error"]["exit_code"] == code and doc["error"]["kind"] == kind
    assert doc["error"]["message"] and doc["error"]["problems"][0] == doc["error"]["message"]
    if code == EXIT_BAD_INPUT:
        assert doc["error"]["message"] in captured.err  # the same words as the one-line error


def test_runs_and_diff_json_use_the_envelope(tmp_path, capsys, in_tmp):
    import json as _json

    from flows.storage.objects import Storage
    from flows.storage.publish import publish_run

    result = _json.loads((REPO / "tests" / "fixtures" / "result_example.json").read_text())
    (in_tmp / "evaluations.yaml").write_text(f"evaluations:\n  - name: ev\n    logs_uri: {in_tmp}\n")
    for d in (1, 2):
        publish_run(Storage.for_uri(in_tmp), "ev", f"2025-01-0{d}_2025-01-0{d}", f"k{d}",
                    {"result.json": _json.dumps(result).encode()}, {})
    assert cli.main(["runs", "ev", "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert (doc["cje_json"], doc["command"], doc["evaluation"]) == (1, "runs", "ev")
    assert [r["run_key"] for r in doc["runs"]] == ["k1", "k2"]
    assert cli.main(["diff", "ev", "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert (doc["cje_json"], doc["command"]) == (1, "diff") and doc["b"]["run_key"] == "k2" and "changes" in doc


def _drift_summary(alarm: bool, first: int | None) -> dict:
    look = {"look": 3, "meta": {"look_key": "2025-01-03"}, "metrics": {"tau_b": {}}, "alarm": alarm,
            "alarms": ["residual_mean"] if alarm else []}
    return {"monitor": "mon", "set_name": "s", "anchors_version": 1, "new_looks": [look], "n_looks": 3,
            "alarm": alarm, "alarms": look["alarms"], "first_alarm": {"residual_mean": first, "tau_b": None}}


@pytest.mark.parametrize("alarm,first,argv_extra,code", [
    (True, 3, [], EXIT_GATE_FAILED),            # a look of this run alarmed
    (False, 2, [], EXIT_GATE_FAILED),           # an earlier look did: the monitor stays in alarm
    (False, None, [], EXIT_OK),                 # never alarmed
    (True, 3, ["--exit-zero"], EXIT_OK),
    (True, 3, ["--json"], EXIT_GATE_FAILED),
])
def test_drift_exits_1_when_the_monitor_is_in_alarm(alarm, first, argv_extra, code, monkeypatch, capsys, in_tmp):
    """`cje drift` exited 0 on an alarm; a cron job or CI step could not see it. The flow itself is
    replaced here (its alarms are tested in tests/flows/test_drift_flow.py): this is the exit code."""
    import flows.pipelines.drift as drift

    _cfg(in_tmp)
    monkeypatch.setattr(drift, "run_drift", lambda name, path, **kw: _drift_summary(alarm, first))
    monkeypatch.setattr(cli, "_services", lambda *a, **k: contextlib.nullcontext())
    assert cli.main(["drift", "mon", *argv_extra]) == code
    captured = capsys.readouterr()
    if code == EXIT_GATE_FAILED:
        assert "drift monitor 'mon' is in alarm (residual_mean since look" in captured.err
    if "--json" in argv_extra:
        assert json.loads(captured.out)["summary"]["monitor"] == "mon"


@pytest.mark.parametrize("argv", [
    ["evaluate", "x.csv", "--out", "o", "--n-boot", "50"],
    ["evaluate", "x.csv", "--out", "o", "--over"],
    ["plan", "x.json", "--target-m", "0.1"],
    ["requests", "status", "--eval", "ev"],
    ["anchors", "list", "--sto", "."],
    ["runs", "ev", "--conf", "e.yaml"],
])
def test_abbreviated_options_are_usage_errors(argv, capsys):
    assert cli.main(argv) == EXIT_USAGE
    assert "unrecognized arguments" in capsys.readouterr().err


def test_evaluate_writes_files_with_the_mode_of_published_ones(canonical_parquet, tmp_path, capsys, in_tmp):
    """`cje evaluate` wrote 0600 files (a temporary file's mode) while published ones are 0644."""
    from flows.storage.objects import Storage

    old = os.umask(0o022)
    try:
        assert cli.main(["evaluate", str(canonical_parquet), "--out", str(tmp_path / "o"), "--n-bootstrap", "50",
                         "--exit-zero"]) == EXIT_OK
        Storage.for_uri(tmp_path / "published").write_bytes("results/ev/report.html", b"x")
    finally:
        os.umask(old)
    published = stat.S_IMODE((tmp_path / "published" / "results" / "ev" / "report.html").stat().st_mode)
    assert published == 0o644
    for name in ("result.json", "report.html", "terms.npz"):
        assert stat.S_IMODE((tmp_path / "o" / name).stat().st_mode) == published, name


def test_quiet_is_undone_when_main_returns(monkeypatch, capsys, in_tmp):
    """`main` called in-process (tests, notebooks) gives Prefect's logging settings back afterwards."""
    import logging

    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "INFO")
    before = logging.getLogger("prefect").level
    assert cli.main(["-q", "runs", "ev"]) == 2  # no evaluations file here
    assert os.environ["PREFECT_LOGGING_LEVEL"] == "INFO" and logging.getLogger("prefect").level == before
