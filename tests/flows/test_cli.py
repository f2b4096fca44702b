"""`cje` commands as a user runs them: subprocesses, exit codes, output."""
from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cje_engine.simulate.direct import simulate

from .conftest import REPO


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "RAY_"))}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


def _cje(*args, env=None, cwd=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "flows.cli.main", *args], env=env or _env(), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_cje_evaluate_writes_result_and_prints_table(tmp_path):
    data = tmp_path / "scored.parquet"
    simulate(300, seed=2).frame.to_parquet(data)
    r = _cje("evaluate", str(data), "--out", str(tmp_path / "out"), "--n-bootstrap", "60", "--seed", "4",
             "--covariates", "response_length", "--calibration-mode", "monotone", "--multiplicity", "holm",
             "--exit-zero")
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "out" / "result.json").read_text())
    assert set(d["policies"]) == {"base", "clone", "verbose", "concise", "unhelpful"}
    assert d["config"]["n_bootstrap"] == 60 and d["config"]["seed"] == 4
    assert d["config"]["multiplicity"] == "holm" and d["calibration"]["mode"] == "monotone"
    for name in d["policies"]:
        assert re.search(rf"^\S+\s+{name}\s", r.stdout, re.M), r.stdout  # one table row per policy (after its rank)
    assert "Traceback" not in r.stderr


def test_cje_evaluate_bad_input_exits_2_with_message_and_no_traceback(tmp_path):
    frame = simulate(100, seed=0).frame
    frame.loc[7, "judge_score"] = float("nan")
    bad = tmp_path / "bad.csv"
    frame.to_csv(bad, index=False)
    r = _cje("evaluate", str(bad), "--out", str(tmp_path / "out"), "--n-bootstrap", "60")
    assert r.returncode == 2
    assert "judge_score" in r.stderr and "bad.csv" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "result.json").exists()


def test_cje_run_unknown_evaluation_exits_2(tmp_path):
    cfg = tmp_path / "e.yaml"
    cfg.write_text("evaluations:\n  - name: a\n    logs_uri: ./logs\n")
    r = _cje("run", "nope", "--config", str(cfg))
    assert r.returncode == 2 and "no evaluation named 'nope'" in r.stderr and "Traceback" not in r.stderr


def test_cje_demo_on_embedded_defaults_publishes_report_and_cleans_up(tmp_path):
    """No PREFECT_API_URL, no RAY_ADDRESS, no storage settings: the README's main job."""
    from datetime import datetime

    home = tmp_path / "home"
    home.mkdir()
    r = _cje("demo", "--data", str(tmp_path / "cje-data"), "--days", "3", "--prompts-per-day", "150",
             "--n-bootstrap", "100", env=_env(HOME=str(home)), cwd=tmp_path, timeout=300)
    ended = datetime.now()
    assert r.returncode == 0, r.stderr[-3000:]
    report = Path(re.search(r"^report: (.+)$", r.stdout, re.M).group(1))
    assert report.is_file() and report.stat().st_size > 10_000
    assert report.is_relative_to(tmp_path / "cje-data" / "results" / "demo")
    assert (report.parent / "result.json").is_file() and (report.parent.parent / "manifest.json").is_file()
    # The anchor set was seeded and the drift monitor looked at every day after its reference.
    assert "drift monitor demo-anchors" in r.stdout
    assert (tmp_path / "cje-data" / "drift" / "demo-anchors" / "report.html").is_file()
    # The embedded server was ours and is gone.
    m = re.search(r"starting a local Prefect API server at (\S+) \(pid (\d+)\)", r.stderr)
    assert m, r.stderr[-2000:]
    assert not os.path.exists(f"/proc/{m.group(2)}")
    # Nothing hung at exit: Prefect's log/event workers were drained before the server
    # stopped (the other order leaves the process hanging ~70 s after this line).
    stopped = re.search(r"^(\S+ \S+) INFO flows.runtime.prefect_server: local Prefect API server stopped", r.stderr, re.M)
    assert stopped, r.stderr[-2000:]
    lag = (ended - datetime.strptime(stopped.group(1), "%Y-%m-%d %H:%M:%S,%f")).total_seconds()
    assert lag < 30, f"process exited {lag:.0f} s after the server stopped"
    # Ray's per-run token lived in the environment only: nothing written to ~/.ray.
    assert not (home / ".ray" / "auth_token").exists()


def test_cje_evaluate_also_writes_a_report(tmp_path):
    data = tmp_path / "scored.parquet"
    simulate(200, seed=3).frame.to_parquet(data)
    r = _cje("evaluate", str(data), "--out", str(tmp_path / "out"), "--inference", "analytic", "--exit-zero")
    assert r.returncode == 0, r.stderr
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<svg" in html and "unhelpful" in html


def test_cje_plan_from_data_and_from_result(tmp_path):
    data = tmp_path / "pilot.parquet"
    simulate(400, seed=5, label_design="calibration_policy", audit_labels=40).frame.to_parquet(data)
    r = _cje("plan", str(data), "--calibration-policies", "base", "--out", str(tmp_path / "plan"),
             "--target", "base - clone", "--c-y", "10")
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["costs"]["c_Y"] == 10
    assert (tmp_path / "plan" / "plan.svg").read_text().startswith("<svg")
    assert "variance-optimal oracle fraction" in r.stdout
    # from a pilot's result.json
    r = _cje("evaluate", str(data), "--out", str(tmp_path / "ev"), "--inference", "analytic",
             "--calibration-policies", "base", "--exit-zero")
    assert r.returncode == 0, r.stderr
    r = _cje("plan", str(tmp_path / "ev" / "result.json"), "--budget", "20000")
    assert r.returncode == 0, r.stderr
    assert "best design for budget 20000" in r.stdout


def test_cje_plan_bad_input_exits_2(tmp_path):
    bad = tmp_path / "result.json"
    bad.write_text("{not json")
    r = _cje("plan", str(bad))
    assert r.returncode == 2 and "result.json" in r.stderr and "Traceback" not in r.stderr
    r = _cje("plan", str(tmp_path / "missing.parquet"))
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_cje_drift_and_labels_unknown_names_exit_2(tmp_path):
    cfg = tmp_path / "e.yaml"
    cfg.write_text("evaluations:\n  - name: a\n    logs_uri: ./logs\n")
    r = _cje("drift", "nope", "--config", str(cfg))
    assert r.returncode == 2 and "nope" in r.stderr and "Traceback" not in r.stderr
    labels = tmp_path / "labels.csv"
    labels.write_text("response_id,oracle_label\nx,0.5\n")
    r = _cje("labels", str(labels), "--evaluation", "nope", "--config", str(cfg))
    assert r.returncode == 2 and "no evaluation named 'nope'" in r.stderr and "Traceback" not in r.stderr


def test_cje_evaluate_logs_only_mode_on_arena_refuses_low_overlap_targets(tmp_path, arena_dir):
    r = _cje("evaluate", str(arena_dir), "--mode", "logs-only", "--out", str(tmp_path / "lo"), "--n-bootstrap", "60")
    assert r.returncode == 1, r.stderr[-2000:]  # a level refused: exit 1 (the result is written)
    assert "level of 'unhelpful' refused" in r.stderr
    d = json.loads((tmp_path / "lo" / "result.json").read_text())
    assert d["policies"]["unhelpful"]["level_claim"] == "refused"
    assert any("fresh draws" in x or "Direct" in x for x in d["policies"]["unhelpful"]["refusal_reasons"])
    assert d["best_policy"] not in ("unhelpful", "parallel_universe_prompt")


def test_cje_run_does_not_read_spark_work_folders_inside_a_day(tmp_path, prefect_server, ray_cluster, monkeypatch,
                                                                capsys):
    """`dt=.../_temporary/0/.../part-0.parquet` is not data: the published run counts the committed rows only.

    On the session's Prefect server and Ray cluster (was in tests/cli on an embedded server and a local
    Ray, started for this one run: 55 s, and under load the embedded server's 120 s health wait failed)."""
    import importlib

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from tests.cli.test_anchors_and_service import _config, _logs

    table = _logs(tmp_path / "logs")  # 3 days x 60 prompts x 2 policies = 360 rows
    day = sorted((tmp_path / "logs").glob("dt=*"))[1]
    [only] = list(day.glob("*.parquet"))
    committed = pq.read_table(only)
    for i, work in enumerate(("_temporary/0/task_0001", ".staging")):
        attempt = committed.set_column(committed.schema.get_field_index("response_id"), "response_id",
                                       pc.binary_join_element_wise(f"tmp{i}-", committed.column("response_id"), ""))
        (day / work).mkdir(parents=True)
        pq.write_table(attempt, day / work / "part-0.parquet")  # an uncommitted task attempt's output
    cfg = _config(tmp_path, tmp_path / "logs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CJE_CONFIG", raising=False)
    cli = importlib.import_module("flows.cli.main")
    assert cli.main(["run", "ev", "--config", str(cfg)]) == 0, capsys.readouterr().err[-3000:]
    [result] = list(tmp_path.rglob("result.json"))
    assert json.loads(result.read_text())["data"]["n_rows"] == table.num_rows == 360  # was: 600 (or a duplicate-id error)


def test_cje_run_derives_response_length_like_cje_evaluate(tmp_path, prefect_server, ray_cluster, monkeypatch, capsys):
    """`covariates: [response_length]` with logs that only carry the response text: `cje run`
    derives it (as `cje evaluate` does) instead of failing on a missing column."""
    import importlib

    import pyarrow as pa

    from flows.storage.logs import write_logs
    from flows.storage.objects import Storage

    frame = simulate(200, seed=7).frame
    rng = np.random.default_rng(0)
    frame["response"] = [" ".join(["w"] * int(k)) for k in rng.integers(1, 60, len(frame))]
    frame = frame.drop(columns=["response_length", "label_probability"])
    yesterday = datetime.now(timezone.utc).date() - timedelta(days=1)
    frame["ts"] = pd.Timestamp(yesterday, tz="UTC") + pd.Timedelta(hours=12)
    write_logs(Storage.for_uri(str(tmp_path / "logs")), pa.Table.from_pandas(frame, preserve_index=False))
    cfg = tmp_path / "evaluations.yaml"
    cfg.write_text("evaluations:\n  - name: ev\n    logs_uri: ./logs\n    window: last 3 days\n"
                   "    options: {covariates: [response_length], calibration_mode: two_stage, n_bootstrap: 60}\n")
    cli = importlib.import_module("flows.cli.main")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["run", "ev", "--json", "--exit-zero"])
    cap = capsys.readouterr()
    assert code == 0, cap.err[-3000:]
    doc = json.loads(cap.out)
    assert doc["published"] and doc["result"]["config"]["covariates"] == ["response_length"]
    assert doc["result"]["calibration"]["mode"] == "two_stage"
    # the same numbers as cje evaluate on the same rows (derived the same way)
    from cje_engine import evaluate

    ref = evaluate(frame.drop(columns=["ts"]), covariates=["response_length"], calibration_mode="two_stage",
                   n_bootstrap=60).to_dict()
    for name, p in ref["policies"].items():
        assert doc["result"]["policies"][name]["plug_in"]["estimate"] == pytest.approx(p["plug_in"]["estimate"],
                                                                                       abs=1e-9)


def test_cje_run_quiet_reports_bad_data_found_inside_the_flow_as_one_line(tmp_path, prefect_server, ray_cluster):
    """Issue 25: with ``-q``, bad data found inside the flow (a response id twice in the window: the flow's
    ``validate`` step, after Prefect and Ray started) printed Prefect's task- and flow-run errors with three
    tracebacks (129 lines) before the command's own line.  Now: exit 2 and one error line.

    A `cje run` process on the session's Prefect server and Ray cluster, as at scale (was in tests/cli on an
    embedded server and a local Ray started for this one run: 19 CPU s; the flow's errors are logged by the
    `cje run` process either way)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.cli.test_anchors_and_service import _config, _logs

    _logs(tmp_path / "logs")
    first, second = sorted((tmp_path / "logs").rglob("*.parquet"))[:2]
    table = pq.read_table(second)
    ids = table.column("response_id").to_pylist()
    ids[3] = pq.read_table(first).column("response_id")[0].as_py()  # the same response on two days
    pq.write_table(table.set_column(table.schema.get_field_index("response_id"), "response_id", pa.array(ids)),
                   second)
    cfg = _config(tmp_path, tmp_path / "logs")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_ADDRESS", "CJE_CONFIG"))}
    env.update(PREFECT_API_URL=prefect_server.url, RAY_ADDRESS=ray_cluster.address, PYTHONPATH=str(REPO))
    r = _cje("run", "ev", "--config", str(cfg), "-q", env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "prefect" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("cje run: error:") and "appears more than once" in errors[0]
    assert not list(tmp_path.rglob("manifest.json"))
