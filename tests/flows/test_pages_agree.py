"""The results pages agree with the terminal at every step (issue 26), on real parts (Prefect API server, Ray,
local storage; nothing mocked).

An evaluation publishes and raises audit label requests; a drift monitor linked to it alarms (and raises a
drift request); labels come back for the audit request. After each step the index (``results/index.html``) and
the trend page (``results/<evaluation>/trend.html``), parsed as HTML, must say what ``cje requests status
--json``, ``cje runs --json`` and the drift state (``drift/<monitor>/looks/``) say. Before, the pages said
"0 open label requests" (requests are raised after the publish that rebuilt them, and their status was never
"open") and "drift alarms 0" until the next evaluation published.
"""
from __future__ import annotations

import json
from datetime import timedelta
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd

from flows.cli.main import main as cje_main
from flows.pipelines.audit import evaluate_and_audit
from flows.pipelines.labels import labels
from flows.storage.anchors import write_anchor_set
from flows.storage.objects import Storage

from .test_audit_loop_e2e import DAYS, FIRST_DAY, OPTIONS, _arrive
from .test_drift_flow import World, run, write_look

OPEN = ("pending", "partly_fulfilled")


class _Page(HTMLParser):
    """Index rows, trend KPIs, request rows and run rows of a results page."""

    def __init__(self) -> None:
        super().__init__()
        self.index: dict[str, dict] = {}
        self.kpis: dict[str, str] = {}
        self.requests: dict[str, str] = {}
        self.runs: set[tuple[str, str]] = set()
        self._kpi: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-evaluation" in a:
            self.index[a["data-evaluation"]] = a
        if "data-kpi" in a:
            self._kpi = a["data-kpi"]
        if tag == "b" and self._kpi:
            self.kpis[self._kpi] = ""
        if tag == "tr" and "data-request-id" in a:
            self.requests[a["data-request-id"]] = a["data-status"]
        if tag == "tr" and "data-run-key" in a:
            self.runs.add((a["data-window"], a["data-run-key"]))

    def handle_data(self, data):
        if self._kpi and self._kpi in self.kpis:
            self.kpis[self._kpi] += data

    def handle_endtag(self, tag):
        if tag == "b":
            self._kpi = None


def _page(path: Path) -> _Page:
    p = _Page()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def _cli(capsys, *argv: str):
    capsys.readouterr()
    assert cje_main(list(argv)) == 0
    out = json.loads(capsys.readouterr().out)
    return out.get("data", out) if isinstance(out, dict) and "data" in out else out


def _agree(root: Path, config: Path, capsys, monitor: str | None = None) -> dict:
    """Assert that the pages say what the CLI and the drift state say; returns what they said."""
    status = _cli(capsys, "requests", "status", "--evaluation", "audited", "--config", str(config), "--json")
    runs = _cli(capsys, "runs", "audited", "--config", str(config), "--json")
    runs = runs if isinstance(runs, list) else runs["runs"]
    assert {p["evaluation"] for p in status["items"]} <= {"audited"}
    open_ids = {p["request_id"]: p["status"] for p in status["items"] if p["status"] in OPEN}
    alarms = 0
    if monitor:
        st = Storage.for_uri(root)
        looks = [json.loads(st.read_bytes(i.key)) for i in st.list(f"drift/{monitor}/looks/")]
        alarms = sum(1 for lk in looks if lk.get("alarm"))
    index, trend = _page(root / "results" / "index.html"), _page(root / "results" / "audited" / "trend.html")
    row = index.index["audited"]
    assert int(row["data-open-requests"]) == len(open_ids)
    assert int(row["data-runs"]) == len(runs) and int(row["data-windows"]) == len({r["window"] for r in runs})
    assert int(row["data-drift-alarms"]) == alarms
    assert trend.kpis["open label requests"] == str(len(open_ids))
    assert trend.kpis["drift alarms (all looks)"] == str(alarms)
    assert trend.requests == open_ids
    assert trend.runs == {(r["window"], r["run_key"]) for r in runs}
    return {"open": open_ids, "runs": runs, "alarms": alarms, "status": status}


def test_pages_agree_with_requests_status_runs_and_the_drift_state(prefect_server, ray_cluster, tmp_path, capsys):
    root = tmp_path / "cje"
    logs_uri, labels_uri = str(root / "logs"), str(root / "labels")
    _, oracle = _arrive(Storage.for_uri, logs_uri, labels_uri)
    window = f"{FIRST_DAY}..{FIRST_DAY + timedelta(days=DAYS - 1)}"
    req_cfg = {"notify": False, "max_labels_per_request": 150, "max_labels_per_period": 1000}
    config = tmp_path / "evaluations.yaml"
    config.write_text(json.dumps({"evaluations": [{
        "name": "audited", "logs_uri": logs_uri, "labels_uri": labels_uri, "results_uri": str(root),
        "window": window, "options": {**OPTIONS, "n_bootstrap": 100}, "label_requests": req_cfg}]}))

    # 1. the evaluation publishes and raises its audit requests
    first = evaluate_and_audit(logs_uri=logs_uri, labels_uri=labels_uri, results_uri=str(root), window=window,
                               evaluation="audited", options={**OPTIONS, "n_bootstrap": 100},
                               label_requests=req_cfg, retry_delays=[0.2])
    assert first["published"] and first["label_requests"]
    said = _agree(root, config, capsys)
    assert len(said["open"]) == len(first["label_requests"]) >= 1 and len(said["runs"]) == 1

    # 2. a drift monitor linked to the evaluation (its calibration) alarms after the judge update
    world = World("shift", 12)
    write_anchor_set(Storage.for_uri(root), "anchors", world.frame())
    write_look(Storage.for_uri(root), "anchors", world.score(False), "v1", 0)
    write_look(Storage.for_uri(root), "anchors", world.score(False), "v1", 1)
    kw = dict(evaluation="audited", evaluation_logs_uri=logs_uri, labels_uri=labels_uri,
              label_requests={"notify": False, "drift_traffic_labels": 30, "drift_anchor_labels": 10})
    run(str(root), "anchors", 1, **kw)
    outs = []
    for t in range(1, 5):
        drifted = t >= 3
        write_look(Storage.for_uri(root), "anchors", world.score(drifted), "v2" if drifted else "v1", t + 1)
        outs.append(run(str(root), "anchors", t + 1, **kw))
    assert any(o["alarm"] for o in outs)
    said = _agree(root, config, capsys, monitor="anchors")
    assert said["alarms"] >= 1 and len(said["runs"]) == 1
    assert len(said["open"]) == len(first["label_requests"]) + sum(len(o["label_requests"]) for o in outs)

    # 3. labels come back for the audit requests (no re-evaluation: no publish rebuilds the pages)
    audit_ids = {m["request_id"] for m in first["label_requests"]}
    rows = [r["response_id"] for m in first["label_requests"] for r in m["rows"]]
    path = tmp_path / "answers.csv"
    pd.DataFrame({"response_id": rows, "oracle_label": [oracle[i] for i in rows]}).to_csv(path, index=False)
    got = labels(path=str(path), labels_uri=labels_uri, results_uri=str(root), requests_uri=str(root),
                 evaluations_file=str(config), reevaluate=False)
    assert {r["request_id"] for r in got["requests"] if r["status"] == "fulfilled"} == audit_ids
    said = _agree(root, config, capsys, monitor="anchors")
    assert not set(said["open"]) & audit_ids and len(said["runs"]) == 1
