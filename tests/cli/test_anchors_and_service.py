"""`cje anchors create | add-scores | list`, and service mode's checks before Prefect and Ray
(logs layout, columns, derivable covariates) with `response_length` derived as `cje evaluate` does."""
from __future__ import annotations

import importlib
import json
from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from cje_engine.data.io import load_frame
from cje_engine.errors import CJEInputError
from flows.pipelines.preflight import check_evaluation, derive_covariates, read_columns
from flows.storage.anchors import read_anchor_scores, read_anchor_set, score_files
from flows.storage.logs import write_logs
from flows.storage.objects import Storage

from .conftest import run_cje

cli = importlib.import_module("flows.cli.main")


def _anchors_csv(path, n=30):
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"anchor_id": [f"{i:05d}" for i in range(n)], "prompt": [f"q{i}" for i in range(n)],
                       "response": [f"answer {i}" for i in range(n)],
                       "oracle_label": np.where(np.arange(n) < 12, rng.uniform(0, 1, n).round(3), np.nan)})
    df.to_csv(path, index=False)
    return df


def test_anchors_create_add_scores_list(tmp_path, capsys, in_tmp):
    store = tmp_path / "store"
    _anchors_csv(tmp_path / "anchors.csv")
    assert cli.main(["anchors", "create", "demo-set", str(tmp_path / "anchors.csv"), "--store", str(store),
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == 1 and doc["new"] and doc["n_anchors"] == 30 and doc["n_labelled"] == 12
    aset = read_anchor_set(Storage.for_uri(str(store)), "demo-set")
    assert aset.anchor_ids[0] == "00000"  # identifiers read as strings: leading zeros kept
    # identical content: no new version
    assert cli.main(["anchors", "create", "demo-set", str(tmp_path / "anchors.csv"), "--store", str(store)]) == 0
    assert "identical to the latest version" in capsys.readouterr().out
    scores = pd.DataFrame({"anchor_id": [f"{i:05d}" for i in range(30)], "judge_score": np.linspace(0, 1, 30)})
    scores.to_csv(tmp_path / "scores.csv", index=False)
    assert cli.main(["anchors", "add-scores", "demo-set", str(tmp_path / "scores.csv"), "--store", str(store),
                     "--judge-id", "judge-v1", "--ts", "2026-11-30T12:00:00"]) == 0
    assert "30 score row(s) written in 1 partition(s)" in capsys.readouterr().out
    st = Storage.for_uri(str(store))
    table = read_anchor_scores(st, score_files(st, "demo-set"))
    assert table.num_rows == 30 and set(table["judge_id"].to_pylist()) == {"judge-v1"}
    assert cli.main(["anchors", "list", "--store", str(store), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["sets"]
    assert listed == [{"set": "demo-set", "versions": [1], "latest": 1, "n_anchors": 30, "n_labelled": 12,
                       "created_at": listed[0]["created_at"], "score_days": 1, "first_score_day": "2026-11-30",
                       "last_score_day": "2026-11-30"}]
    assert cli.main(["anchors", "list", "--store", str(store)]) == 0
    assert "demo-set" in capsys.readouterr().out


def test_anchors_bad_input_exit_2(tmp_path, capsys, in_tmp):
    store = tmp_path / "store"
    pd.DataFrame({"anchor_id": ["a"], "prompt": ["p"]}).to_csv(tmp_path / "bad.csv", index=False)
    assert cli.main(["anchors", "create", "s", str(tmp_path / "bad.csv"), "--store", str(store)]) == 2
    assert "response" in capsys.readouterr().err
    _anchors_csv(tmp_path / "a.csv", 5)
    assert cli.main(["anchors", "create", "s", str(tmp_path / "a.csv"), "--store", str(store)]) == 0
    pd.DataFrame({"anchor_id": ["00000", "zzz"], "judge_score": [0.1, 0.2]}).to_csv(tmp_path / "sc.csv", index=False)
    assert cli.main(["anchors", "add-scores", "s", str(tmp_path / "sc.csv"), "--store", str(store),
                     "--judge-id", "j"]) == 2
    err = capsys.readouterr().err
    assert "'zzz'" in err and "row 1" in err
    assert cli.main(["anchors", "add-scores", "s", str(tmp_path / "sc.csv"), "--store", str(store)]) == 2
    assert "--judge-id" in capsys.readouterr().err
    assert cli.main(["anchors", "list", "nope", "--store", str(store)]) == 2
    assert cli.main(["anchors", "list"]) == 2  # neither --store nor --monitor


# ------------------------------------------------------------------------------ service mode


def _logs(root, days=3, with_length=False, n=60):
    rng = np.random.default_rng(1)
    today = datetime.now(timezone.utc).date()
    rows = []
    for d in range(days):
        day = today - timedelta(days=d + 1)
        for i in range(n):
            for pol in ("base", "clone"):
                words = int(rng.integers(1, 40))
                rows.append({"prompt_id": f"{d}-{i}", "policy": pol, "judge_score": float(rng.uniform()),
                             "response_id": f"{pol}:{d}-{i}", "response": " ".join(["w"] * words) + "  \tend",
                             "ts": datetime(day.year, day.month, day.day, 12, tzinfo=timezone.utc),
                             "oracle_label": float(rng.uniform()) if i % 3 == 0 else None})
    table = pa.Table.from_pylist(rows)
    if with_length:
        table = table.append_column("response_length", pa.array([float(len(r["response"].split())) for r in rows]))
    write_logs(Storage.for_uri(str(root)), table)
    return table


def _config(tmp_path, logs, covariates="[response_length]"):
    cfg = tmp_path / "evaluations.yaml"
    cfg.write_text(f"evaluations:\n  - name: ev\n    logs_uri: {logs}\n    window: last 7 days\n"
                   f"    options: {{covariates: {covariates}, n_bootstrap: 100}}\n")
    return cfg


def test_derived_response_length_matches_cje_evaluate(tmp_path):
    table = _logs(tmp_path / "logs", days=1, n=20)
    derived = derive_covariates(table.select(["prompt_id", "policy", "judge_score", "response_id", "response",
                                              "oracle_label"]), ["response_length"])
    assert "response" not in derived.column_names  # read only for the covariate
    frame = load_frame(table.drop_columns(["ts"]).to_pandas(), covariates=["response_length"])
    assert derived["response_length"].to_pylist() == frame["response_length"].tolist()
    assert read_columns(["prompt_id", "response_length"], ["response_length"], ["prompt_id", "response"]) == \
        ["prompt_id", "response"]
    assert read_columns(["prompt_id", "response_length"], ["response_length"],
                        ["prompt_id", "response", "response_length"]) == ["prompt_id", "response_length"]


def test_preflight_accepts_derivable_covariates_and_names_what_is_missing(tmp_path):
    _logs(tmp_path / "logs")
    base = {"logs_uri": str(tmp_path / "logs"), "window": "last 7 days", "options": {"covariates": ["response_length"]}}
    info = check_evaluation(base)
    assert info["derived"] == ["response_length"] and info["n_files"] == 3
    with pytest.raises(CJEInputError, match="covariate 'difficulty' is not a log column"):
        check_evaluation({**base, "options": {"covariates": ["difficulty"]}})
    with pytest.raises(CJEInputError, match="no log partitions in the window"):
        check_evaluation({**base, "window": "2020-01-01..2020-01-07"})


def test_cje_run_checks_inputs_before_starting_prefect_and_ray(tmp_path):
    """A folder of CSV files: one line, exit 2, in seconds, no Prefect server, no traceback."""
    logs = tmp_path / "csvlogs"
    logs.mkdir()
    pd.DataFrame({"prompt_id": ["1"], "policy": ["a"], "judge_score": [0.5]}).to_csv(logs / "day1.csv", index=False)
    cfg = _config(tmp_path, logs)
    r = run_cje("run", "ev", "--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "CSV/JSON file(s)" in errors[0] and "docs/logs-layout.md" in errors[0]
    assert "Traceback" not in r.stderr and "Prefect API server" not in r.stderr and "Ray" not in r.stderr


def test_cje_run_refuses_a_day_whose_only_file_is_a_dangling_symlink(tmp_path, capsys, in_tmp):
    """Not dropped as "deleted while listing" (720 of 1,080 rows evaluated): exit 2 naming it, nothing published."""
    import os

    _logs(tmp_path / "logs")
    day = sorted((tmp_path / "logs").glob("dt=*"))[1]
    [only] = list(day.glob("*.parquet"))
    only.unlink()
    os.symlink(tmp_path / "moved-away.parquet", only)
    cfg = _config(tmp_path, tmp_path / "logs")
    assert cli.main(["run", "ev", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert str(only) in err and "symbolic link whose target does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "results").exists() and not list(tmp_path.rglob("manifest.json"))


def test_cje_run_refuses_a_dangling_symlinked_day_folder(tmp_path, capsys, in_tmp):
    """A day folder that is a symbolic link to a folder moved away: exit 2 naming it (was: an empty day,
    2 of 3 days evaluated and published)."""
    import os

    _logs(tmp_path / "logs")
    day = sorted((tmp_path / "logs").glob("dt=*"))[1]
    day.rename(tmp_path / "moved")
    os.symlink(tmp_path / "gone", day)
    cfg = _config(tmp_path, tmp_path / "logs")
    assert cli.main(["run", "ev", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert str(day) in err and "symbolic link whose target does not exist" in err and "Traceback" not in err
    assert not list(tmp_path.rglob("manifest.json"))


def test_cje_run_names_an_underivable_covariate(tmp_path, capsys, in_tmp):
    _logs(tmp_path / "logs")
    cfg = _config(tmp_path, tmp_path / "logs", "[difficulty]")
    assert cli.main(["run", "ev", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "covariate 'difficulty' is not a log column" in err and "Traceback" not in err


def test_cje_run_config_discovery(tmp_path, monkeypatch, capsys):
    """./evaluations.yaml of the current folder, else $CJE_CONFIG, else --config; the path is printed."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    (here / "evaluations.yaml").write_text("evaluations:\n  - name: local\n    logs_uri: ./missing-logs\n")
    (elsewhere / "env.yaml").write_text("evaluations:\n  - name: fromenv\n    logs_uri: ./missing-logs\n")
    monkeypatch.delenv("CJE_CONFIG", raising=False)
    monkeypatch.chdir(here)
    assert cli.main(["run", "local"]) == 2
    err = capsys.readouterr().err
    assert f"config: {here / 'evaluations.yaml'} (from ./evaluations.yaml)" in err
    assert "logs folder does not exist" in err
    monkeypatch.setenv("CJE_CONFIG", str(elsewhere / "env.yaml"))
    assert cli.main(["run", "local"]) == 2
    err = capsys.readouterr().err
    assert "(from $CJE_CONFIG)" in err and "no evaluation named 'local'" in err
    assert cli.main(["run", "fromenv", "--config", str(here / "evaluations.yaml")]) == 2
    err = capsys.readouterr().err
    assert "(from --config)" in err and "no evaluation named 'fromenv'" in err
    monkeypatch.delenv("CJE_CONFIG")
    monkeypatch.chdir(tmp_path)  # no ./evaluations.yaml, no CJE_CONFIG
    assert cli.main(["run", "fromenv"]) == 2
    err = capsys.readouterr().err
    assert "evaluations file not found" in err and "--config" in err and "CJE_CONFIG" in err


def test_unreachable_prefect_api_exit_69_before_any_work(tmp_path, capsys, in_tmp, monkeypatch):
    from tests.ports import refused_port

    _logs(tmp_path / "logs")
    cfg = _config(tmp_path, tmp_path / "logs", "[]")
    with refused_port() as port:  # nothing listens there, and no other process can start to meanwhile
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{port}/api")
        assert cli.main(["run", "ev", "--config", str(cfg)]) == 69
    err = capsys.readouterr().err
    assert "service unavailable" in err and "PREFECT_API_URL" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("options,column,hint", [
    ("{label_scale: 1-5}", "judge_score", "options.score_scale: 1-10"),
    ("{score_scale: 1-10}", "oracle_label", "options.label_scale: 1-5"),
])
def test_service_preflight_checks_the_declared_scales_before_prefect(command, options, column, hint, tmp_path,
                                                                       capsys, monkeypatch):
    """Service mode did not check label_scale/score_scale before starting: 21 s, 164 lines of stderr, 3
    tracebacks, the error 8 times. Now: exit 2 with the one line of `cje evaluate` (in the evaluations
    file's words), naming the object and row, and neither Prefect nor Ray is started."""
    rng = np.random.default_rng(3)
    day = datetime.now(timezone.utc).date() - timedelta(days=1)
    rows = [{"prompt_id": f"p{i}", "policy": pol, "judge_score": float(rng.uniform(1, 10)),
             "response_id": f"r{i}-{pol}", "ts": datetime(day.year, day.month, day.day, 12, tzinfo=timezone.utc),
             "oracle_label": float(rng.integers(1, 6)) if i % 3 == 0 else None}
            for i in range(30) for pol in ("base", "clone")]
    write_logs(Storage.for_uri(str(tmp_path / "logs")), pa.Table.from_pylist(rows))
    cfg = tmp_path / "evaluations.yaml"
    cfg.write_text(f"evaluations:\n  - name: ev\n    logs_uri: {tmp_path / 'logs'}\n    window: last 7 days\n"
                   f"    options: {options}\n")

    def no_services(*a, **k):
        raise AssertionError("Prefect was started before the inputs were checked")

    monkeypatch.setattr(cli, "_services", no_services)
    argv = ["run", "ev"] if command == "run" else ["serve"]
    assert cli.main([*argv, "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if f"cje {command}: error:" in ln]
    assert len(lines) == 1 and err.count("is outside the declared") == 1 and "Traceback" not in err
    assert f"logs/dt={day}/" in lines[0] and f"column '{column}', row " in lines[0] and hint in lines[0]
