"""A new team's journey through the service, command by command, as the README and docs/ tell it (issue 26).

A team has a CSV export (conversations x models, a 1-10 grader, 1-5 human scores on about 9% of the rows,
its own column names, question and answer texts). It

1. evaluates the CSV with ``cje evaluate --columns ...`` (no rewrite of its file);
2. turns it into daily Parquet logs (opaque response ids made with ``opaque_response_ids``), declares a
   scheduled evaluation and a drift monitor in its own ``evaluations.yaml`` (``columns:`` maps its names),
   and runs it with ``cje run``: a published run, label requests raised;
3. adds anchors and daily judge scores (``cje anchors create`` / ``add-scores``); the judge is updated on
   the last days and ``cje drift`` alarms (exit 1) and raises a drift request;
4. exports the audit request in Label Studio format (``cje requests export --format label-studio``),
   labellers answer it (the tool's own export format), ``cje labels`` imports it on the 1-5 scale and
   re-evaluates the window: a corrected run is published;
5. reads ``cje runs`` and ``cje diff``; and the index and trend pages must say what the terminal said
   (runs, windows, open requests, drift alarms, each policy's value, interval and claim), read in headless
   Chromium at 1280 and 420 px without clipped or unreadable elements, template text or dead links.

Small data (3 policies x 150 conversations, 3 days): the whole journey runs in the default tier on the
session's Prefect server and Ray cluster.
"""
from __future__ import annotations

import json
import os
from datetime import date, datetime, timedelta, timezone
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from cje_engine.simulate.direct import PolicySpec, simulate
from flows.cli.main import main as cje_main
from flows.integrations import labelling
from flows.reports.common import fmt, fmt_ci
from flows.storage.logs import opaque_response_ids

from .test_drift_flow import World
from .test_monitoring import _chromium, _measure

POLICIES = (PolicySpec("gpt-small", quality_shift=0.6), PolicySpec("gpt-large", quality_shift=0.8),
            PolicySpec("terse-bot", quality_shift=-0.8, adversarial=True))
FIRST_DAY = date(2025, 3, 1)
DAYS = 3
WINDOW = f"{FIRST_DAY}..{FIRST_DAY + timedelta(days=DAYS - 1)}"
N_ANCHORS = 120


def team_csv(path: Path) -> tuple[pd.DataFrame, dict]:
    """The team's export: its own column names and scales; returns it and the true 1-5 label of every row."""
    sim = simulate(150, POLICIES, label_design="calibration_policy", calibration_policy="gpt-large",
                   oracle_fraction=0.2, audit_labels=4, seed=26)
    f = sim.frame
    df = pd.DataFrame({
        "conversation_id": "conv-" + f["prompt_id"].str[1:],
        "model": f["policy"],
        "question": "How do I " + f["prompt_id"] + "?",
        "answer": "=Sure: " + f["response_length"].astype(str) + " words",  # a formula-looking text, too
        "grader": (1 + 9 * f["judge_score"]).round(2),
        "human": (1 + 4 * f["oracle_label"]).round(0),
        "response_length": f["response_length"],
    })
    truth = (1 + 4 * np.asarray(sim.oracle_all)).round(0)
    df.to_csv(path, index=False)
    return df, {(c, m): float(t) for c, m, t in zip(df["conversation_id"], df["model"], truth)}


def daily_logs(df: pd.DataFrame, logs: Path) -> pd.DataFrame:
    """The same rows as daily Parquet logs, the way the docs say: ``dt=YYYY-MM-DD/`` folders, a ``ts`` and an
    opaque, stable ``response_id`` (docs/logs-layout.md, "Response ids"); the team's names kept."""
    out = df.copy()
    out["response_id"] = opaque_response_ids([out["conversation_id"], out["model"]])
    day = out["conversation_id"].str[-1].astype(int) % DAYS
    out["ts"] = [datetime.combine(FIRST_DAY + timedelta(days=int(d)), datetime.min.time(), tzinfo=timezone.utc)
                 + timedelta(hours=9) for d in day]
    for d in range(DAYS):
        folder = logs / f"dt={FIRST_DAY + timedelta(days=d)}"
        folder.mkdir(parents=True)
        out[day == d].to_parquet(folder / "part-0.parquet", index=False)
    return out


def write_config(path: Path, data: Path) -> None:
    """The team's evaluations.yaml: its column names, a daily schedule, a drift monitor linked to it."""
    path.write_text(yaml.safe_dump({
        "columns": {"prompt_id": "conversation_id", "policy": "model", "judge_score": "grader",
                    "oracle_label": "human"},
        "evaluations": [{
            "name": "team-daily", "logs_uri": str(data / "logs"), "results_uri": str(data),
            "labels_uri": str(data / "labels"), "window": WINDOW, "cron": "0 6 * * *",
            "options": {"score_scale": "1-10", "label_scale": "1-5", "calibration_policies": ["gpt-large"],
                        "covariates": ["response_length"], "n_bootstrap": 100, "seed": 0},
            "label_requests": {"notify": False, "max_labels_per_request": 60, "max_labels_per_period": 500}}],
        "drift_monitors": [{
            "name": "team-judge", "set_name": "team-anchors", "anchors_uri": str(data), "evaluation": "team-daily",
            "results_uri": str(data), "cron": "30 6 * * *", "monitor": {"alpha": 0.05}}],
    }, sort_keys=False))


class Page(HTMLParser):
    """What a results page says: index rows and policy rows, trend KPIs, request and run rows, links."""

    def __init__(self) -> None:
        super().__init__()
        self.index: dict[str, dict] = {}
        self.policies: dict[str, dict] = {}
        self.kpis: dict[str, str] = {}
        self.requests: dict[str, str] = {}
        self.runs: set[tuple[str, str]] = set()
        self.links: list[str] = []
        self.cells: dict[tuple[str, str], dict] = {}  # trend grid: (policy, window) -> verdict, labels
        self._kpi: str | None = None
        self._cell: dict | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-evaluation" in a:
            self.index[a["data-evaluation"]] = a
        if tag == "tr" and "data-policy" in a and "data-claim" in a:
            self.policies[a["data-policy"]] = a
        if "data-kpi" in a:
            self._kpi = a["data-kpi"]
        if tag == "b" and self._kpi:
            self.kpis[self._kpi] = ""
        if tag == "tr" and "data-request-id" in a:
            self.requests[a["data-request-id"]] = a["data-status"]
        if tag == "tr" and "data-run-key" in a:
            self.runs.add((a["data-window"], a["data-run-key"]))
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag == "td" and "data-policy" in a and "data-window" in a:
            self._cell = self.cells.setdefault((a["data-policy"], a["data-window"]), {"verdict": None, "labels": ""})
        if self._cell is not None and tag == "span":
            verdict = [c[2:] for c in (a.get("class") or "").split() if c.startswith("v-")]
            if verdict:
                self._cell["verdict"] = verdict[0]

    def handle_data(self, data):
        if self._kpi and self._kpi in self.kpis:
            self.kpis[self._kpi] += data
        if self._cell is not None:
            self._cell["labels"] += data

    def handle_endtag(self, tag):
        if tag == "b":
            self._kpi = None
        if tag == "td":
            self._cell = None


def page(path: Path) -> Page:
    """`Page` of ``path``."""
    p = Page()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def cje(capsys, *argv: str, code: int = 0) -> tuple[str, str]:
    """``cje ARGV`` in this process: (stdout, stderr), asserting the exit code."""
    capsys.readouterr()
    got = cje_main(list(argv))
    out, err = capsys.readouterr()
    assert (got in (0, 1) if code is None else got == code), (argv, got, err[-3000:])
    return out, err


def cje_json(capsys, *argv: str, code: int = 0) -> dict:
    """``cje ARGV --json``: the envelope's data."""
    out, _ = cje(capsys, *argv, "--json", code=code)
    doc = json.loads(out)
    return doc.get("data", doc) if isinstance(doc, dict) else doc


def test_a_new_team_from_a_csv_to_pages_that_agree_with_the_terminal(prefect_server, ray_cluster, tmp_path,
                                                                     capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CJE_CONFIG", raising=False)
    data = tmp_path / "cje-data"
    df, truth = team_csv(tmp_path / "team.csv")
    assert 0.05 < df["human"].notna().mean() < 0.15  # humans scored about 9% of the rows

    # 1. the CSV as it is, mapped with --columns
    first = cje_json(capsys, "evaluate", "team.csv", "--out", "first", "--columns",
                     "prompt_id=conversation_id,policy=model,judge_score=grader,oracle_label=human",
                     "--score-scale", "1-10", "--label-scale", "1-5", "--calibration-policies", "gpt-large",
                     "--covariates", "response_length", "--n-bootstrap", "100", code=None)
    saved = json.loads((tmp_path / "first" / "result.json").read_text())
    assert set(first["result"]["policies"]) == set(saved["policies"]) == {p.name for p in POLICIES}
    for name, pol in saved["policies"].items():  # the terminal's JSON and the file say the same
        assert first["result"]["policies"][name]["level_claim"] == pol["level_claim"]
        assert first["result"]["policies"][name].get("estimate") == pol.get("estimate")

    # 2. daily logs, the team's evaluations.yaml (columns:, a schedule, a drift monitor), cje run
    logs = daily_logs(df, data / "logs")
    write_config(tmp_path / "evaluations.yaml", data)
    run = cje_json(capsys, "run", "team-daily", code=None)
    assert run["published"] and run["window"] == WINDOW.replace("..", "_")
    requests = cje_json(capsys, "requests", "status", "--evaluation", "team-daily")
    assert requests["requests"] >= 1, "the run raised label requests"

    # 3. anchors and daily judge scores; the judge is updated (reorders its scores) on the last days
    world = World("reorder", 5, n_anchors=200)
    anchors = world.frame()
    anchors["oracle_label"] = (1 + 4 * anchors["oracle_label"]).round(0)
    anchors.to_csv(tmp_path / "anchors.csv", index=False)
    cje(capsys, "anchors", "create", "team-anchors", "anchors.csv", "--store", str(data))
    for d in range(6):
        scores = world.score(drifted=d >= 3)
        pd.DataFrame({"anchor_id": scores.index, "judge_score": (1 + 9 * scores.to_numpy()).round(3)}).to_csv(
            tmp_path / f"scores-{d}.csv", index=False)
        cje(capsys, "anchors", "add-scores", "team-anchors", f"scores-{d}.csv", "--store", str(data), "--judge-id",
            "judge-v2" if d >= 3 else "judge-v1", "--ts", f"{FIRST_DAY + timedelta(days=d)}T12:00:00")
    drift = cje_json(capsys, "drift", "team-judge", code=1)  # exit 1: the monitor is in alarm
    assert drift["summary"]["alarm"]

    # 4. the run's own request to Label Studio format, answered there, imported back on 1-5
    status = cje_json(capsys, "requests", "status", "--evaluation", "team-daily")
    (req,) = [p for p in status["items"] if p["rows"] and not p["anchors"] and p["window"] == run["window"]][:1]
    cje(capsys, "requests", "export", req["request_id"], "--evaluation", "team-daily", "--format", "label-studio",
        "--out", "tasks.json")
    tool = labelling.get("label-studio")
    files = {p: p.read_bytes() for p in tool.outputs(tmp_path / "tasks.json")}
    shown = b"".join(files.values()).decode()
    assert not any(p.name in shown for p in POLICIES)  # labellers are blind to the policy: no name, no id leaks it
    tasks = json.loads(files[tmp_path / "tasks.json"])
    assert {t["data"]["answer"][:6] for t in tasks} == {"=Sure:"} and "question" in tasks[0]["data"]  # default texts
    key = dict(zip(logs["response_id"], zip(logs["conversation_id"], logs["model"])))
    answers = {t["data"]["response_id"]: truth[key[t["data"]["response_id"]]] for t in tasks}
    (tmp_path / "answered.json").write_bytes(tool.answered(files, answers))
    said = cje_json(capsys, "requests", "status", "--tool", "label-studio", "--file", "answered.json")["tool"]
    assert (said["pushed"], said["answered"], said["unanswered"]) == (len(tasks), len(tasks), 0)
    out, _ = cje(capsys, "labels", "answered.json", "--evaluation", "team-daily", "--label-scale", "1-5", code=None)
    assert f"ingested {len(tasks)} label(s)" in out

    # 5. the history in the terminal, and the pages
    runs = cje_json(capsys, "runs", "team-daily")["runs"]
    assert len(runs) == 2 and runs[0]["superseded"] and not runs[1]["superseded"]  # corrected beside the first
    diff = cje_json(capsys, "diff", "team-daily")
    assert {diff["a"]["run_key"], diff["b"]["run_key"]} == {r["run_key"] for r in runs}
    text, _ = cje(capsys, "runs", "team-daily")
    status = cje_json(capsys, "requests", "status", "--evaluation", "team-daily")
    open_ids = {p["request_id"]: p["status"] for p in status["items"] if p["status"] in ("pending", "partly_fulfilled")}
    assert req["request_id"] not in open_ids  # answered: no longer open
    st_looks = sorted((data / "drift" / "team-judge" / "looks").rglob("*.json"))
    alarms = sum(1 for f in st_looks if json.loads(f.read_text()).get("alarm"))
    assert alarms >= 1

    index_path, trend_path = data / "results" / "index.html", data / "results" / "team-daily" / "trend.html"
    index, trend = page(index_path), page(trend_path)
    row = index.index["team-daily"]
    assert int(row["data-runs"]) == len(runs) and int(row["data-windows"]) == 1
    assert int(row["data-open-requests"]) == len(open_ids) and int(row["data-drift-alarms"]) == alarms
    assert trend.kpis["open label requests"] == str(len(open_ids))
    assert trend.kpis["drift alarms (all looks)"] == str(alarms)
    assert trend.requests == open_ids and trend.runs == {(r["window"], r["run_key"]) for r in runs}
    latest = runs[-1]
    lines = text.splitlines()
    for name, pol in latest["policies"].items():  # same value, interval and claim on the index and the terminal
        claim, prow = pol["level_claim"], index.policies[name]
        assert prow["data-claim"] == claim
        value = "refused" if claim == "refused" else fmt(pol["estimate"])
        if pol.get("estimate") is not None:
            assert prow["data-value"] == fmt(pol["estimate"]) and prow["data-ci"] == fmt_ci(pol["ci"])
        assert any(name in ln and value in ln and claim in ln and (claim == "refused" or fmt_ci(pol["ci"]) in ln)
                   for ln in lines), (name, value, text)
    (report_path,) = (data / "results" / "team-daily" / latest["window"] / latest["run_key"]).rglob("report.html")
    report = report_path.read_text(encoding="utf-8")
    for name, pol in latest["policies"].items():  # the trend grid and the report say the same as `cje runs`
        cell = trend.cells[(name, latest["window"])]
        assert cell["verdict"] == pol["audit"] and cell["labels"].split()[-1] == str(pol.get("n_labelled") or "-")
        if pol.get("estimate") is not None:
            assert fmt(pol["estimate"]) in report and fmt_ci(pol["ci"]) in report, name
    for path in (index_path, trend_path, report_path):
        html = path.read_text(encoding="utf-8")
        assert "{_" not in html and "{esc" not in html, path  # no template text
        for url in page(path).links:
            if not url.startswith(("#", "http://", "https://", "mailto:")):
                assert (path.parent / url.split("#")[0]).resolve().is_file(), (path, url)  # links resolve

    # 6. laid out in headless Chromium at a desktop and a phone width
    if _chromium() is None:
        if os.environ.get("CJE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium not installed but CJE_REQUIRE_CHROMIUM=1 (apt-get install -y chromium)")
        pytest.skip("chromium not installed (apt-get install -y chromium); every other step passed")
    for path in (index_path, trend_path, report_path):
        for width in (1280, 420):
            m = _measure(path, tmp_path, width)
            assert m["scrollWidth"] <= width and m["wide"] == [] and m["clipped"] == [], (path.name, width, m)
            assert not [f for f in m["fonts"] if f[0] < 10], (path.name, width, m["fonts"][:5])
            assert "{_" not in m["text"] and "team-daily" in m["text"]
            if path == report_path:
                assert len(m["fonts"]) > 20, "the report's charts have labels"  # all >= 10 CSS px, as checked
