"""The labelling loop against a real Label Studio server (infra/labelstudio/start.sh), and its failures.

Refused level -> label request -> ``cje requests push`` into a project created through the REST API ->
a labeller's annotations submitted through the API -> ``cje labels --from label-studio`` -> the
re-evaluation publishes a corrected result (refused -> ok).  Real Prefect server, real Ray, local
storage; nothing mocked.  Failure cases: server down, bad token, a task deleted in the tool, an
out-of-scale answer, disagreeing duplicate annotations: each a clear message and nothing lost.
"""
from __future__ import annotations

import json

from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from cje_engine.simulate.direct import PolicySpec, simulate
from flows.cli.main import main
from flows.integrations.labelling.label_studio import LabelStudio, label_studio_config, number_result
from flows.label_requests.manifests import list_requests
from flows.storage.labels import LabelStore
from flows.storage.logs import write_logs
from flows.storage.objects import Storage
from flows.storage.publish import list_runs, read_latest

pytestmark = [pytest.mark.integration, pytest.mark.integration_labelstudio]

OPTIONS = {"covariates": ["response_length"], "calibration_policies": ["base"], "n_bootstrap": 200, "seed": 3}
POLICIES = (PolicySpec("base", quality_shift=0.8), PolicySpec("clone", quality_shift=0.8),
            PolicySpec("unhelpful", quality_shift=-1.0, adversarial=True))
FIRST_DAY = date(2025, 3, 1)
REQ = {"notify": False, "max_labels_per_request": 150, "max_labels_per_period": 1000}


def _world(tmp_path: Path) -> dict:
    """Three days of logs with prompt and response text, the initial labels, an evaluations file."""
    sim = simulate(400, POLICIES, label_design="calibration_policy", oracle_fraction=0.25, audit_labels=5, seed=1)
    frame = sim.frame.copy()
    day = frame["prompt_id"].astype("category").cat.codes.to_numpy() % 3
    start = datetime.combine(FIRST_DAY, datetime.min.time(), tzinfo=timezone.utc)
    frame["ts"] = [start + timedelta(days=int(d), hours=2) for d in day]
    frame["prompt"] = "Question " + frame["prompt_id"]
    frame["response"] = "Answer of " + frame["response_id"]
    root = tmp_path / "data"
    st = Storage.for_uri(str(root))
    write_logs(st, pa.Table.from_pandas(frame.drop(columns=["oracle_label", "label_probability"]),
                                        preserve_index=False), basename="sim")
    lab = frame.loc[frame["oracle_label"].notna(), ["response_id", "oracle_label", "label_probability"]]
    LabelStore(st).append(pa.Table.from_pandas(lab.reset_index(drop=True), preserve_index=False), "initial")
    ev = {"name": "audited", "logs_uri": str(root), "window": f"{FIRST_DAY}..{FIRST_DAY + timedelta(days=2)}",
          "options": OPTIONS, "label_requests": REQ}
    cfg = tmp_path / "evaluations.yaml"
    cfg.write_text(yaml.safe_dump({"evaluations": [ev]}))
    return {"root": str(root), "st": st, "config": str(cfg), "spec": ev,
            "oracle": dict(zip(frame["response_id"], sim.oracle_all))}


@pytest.fixture
def refused(tmp_path, ls_env, ls_prefect):
    """A published run refusing unhelpful, with its audit request pending."""
    from flows.pipelines.audit import evaluate_and_audit

    w = _world(tmp_path)
    params = {k: v for k, v in w["spec"].items() if k != "name"}
    first = evaluate_and_audit(**params, evaluation="audited")
    assert first["result"]["policies"]["unhelpful"]["level_claim"] == "refused"
    (req,) = [m for m in first["label_requests"] if m["scope"] == "unhelpful"]
    return dict(w, first=first, request=req)


def _project(ls_env, ls_token, title: str) -> tuple[LabelStudio, int]:
    client = LabelStudio(ls_env["LABEL_STUDIO_URL"])
    return client, client.create_project(title, label_studio_config((0, 1)))


def _push(w, ls_env, project: int) -> int:
    return main(["requests", "push", w["request"]["request_id"], "--to", "label-studio", "--url",
                 ls_env["LABEL_STUDIO_URL"], "--project", str(project), "--evaluation", "audited",
                 "--config", w["config"]])


def _pull(w, ls_env, project: int) -> int:
    return main(["labels", "--from", "label-studio", "--url", ls_env["LABEL_STUDIO_URL"], "--project", str(project),
                 "--evaluation", "audited", "--config", w["config"]])


def _annotate(client, project, value_of) -> dict[str, int]:
    """Submit one annotation per task, as a labeller's submit does (POST .../annotations/)."""
    ids = {}
    for t in client.tasks(project):
        rid = t["data"]["response_id"]
        v = value_of(rid)
        if v is not None:
            client.annotate(t["id"], number_result(v), lead_time=3.5)
        ids[rid] = t["id"]
    return ids


def test_push_annotate_pull_reevaluate_refused_to_ok(refused, ls_env, ls_token, capsys):
    w = refused
    client, project = _project(ls_env, ls_token, "cje audit labels")
    assert _push(w, ls_env, project) == 0
    assert f"{w['request']['n_labels']} task(s) imported" in capsys.readouterr().out
    assert _push(w, ls_env, project) == 0  # idempotent: nothing imported twice
    assert "0 task(s) imported" in capsys.readouterr().out
    tasks = client.tasks(project)
    assert len(tasks) == w["request"]["n_labels"]
    t0 = tasks[0]["data"]
    assert t0["response"] == f"Answer of {t0['response_id']}" and "judge_score" not in t0  # blind
    _annotate(client, project, lambda rid: w["oracle"][rid])
    assert _pull(w, ls_env, project) == 0
    out = capsys.readouterr().out
    assert f"ingested {w['request']['n_labels']} label(s)" in out and "(label-studio" in out
    assert f"request {w['request']['request_id']}: {w['request']['n_labels']}/{w['request']['n_labels']} " \
           "received (fulfilled)" in out
    latest = read_latest(w["st"], "audited")
    assert latest["run_key"] != w["first"]["run_key"]
    new = latest["result"]["policies"]["unhelpful"]
    assert new["level_claim"] == "ok" and new["basis_code"] == "power_tuned"  # verified by its own labels
    assert new["n_labelled"] == 5 + w["request"]["n_labels"]
    assert [r["run_key"] for r in list_runs(w["st"], "audited")][0] == w["first"]["run_key"]  # old run kept
    pulled = [i.key for i in w["st"].list("label_requests/_pulled/")]
    assert len(pulled) == 1  # the answers as pulled are kept
    # the legacy token works too (Authorization: Token ...)
    import os

    os.environ["LABEL_STUDIO_API_KEY"] = ls_env["LABEL_STUDIO_LEGACY_TOKEN"]
    assert len(LabelStudio(ls_env["LABEL_STUDIO_URL"]).tasks(project)) == len(tasks)


def test_server_down_and_bad_token_fail_clearly_and_write_nothing(refused, ls_env, ls_token, monkeypatch, capsys):
    from tests.s3server import free_port

    w = refused
    down = f"http://127.0.0.1:{free_port()}"
    r = main(["requests", "push", w["request"]["request_id"], "--to", "label-studio", "--url", down,
              "--project", "1", "--evaluation", "audited", "--config", w["config"]])
    err = capsys.readouterr().err
    assert r == 69 and f"Label Studio at {down} is not reachable" in err
    assert main(["labels", "--from", "label-studio", "--url", down, "--project", "1", "--evaluation", "audited",
                 "--config", w["config"]]) == 69
    _, project = _project(ls_env, ls_token, "cje bad token")
    for bad in ("not-a-token-0000", "aaa.bbb.ccc"):  # a legacy-looking and a JWT-looking token
        monkeypatch.setenv("LABEL_STUDIO_API_KEY", bad)
        assert _push(w, ls_env, project) == 2
        err = capsys.readouterr().err
        assert "rejected the" in err and bad not in err  # the token is never printed
    assert w["st"].list("label_requests/_pushed/") == []
    assert LabelStore(w["st"]).version() == 1


def test_deleted_task_out_of_scale_and_duplicates_lose_nothing(refused, ls_env, ls_token, capsys):
    w = refused
    client, project = _project(ls_env, ls_token, "cje failures")
    assert _push(w, ls_env, project) == 0
    tasks = {t["data"]["response_id"]: t["id"] for t in client.tasks(project)}
    ids = sorted(tasks)
    gone, wild, twice = ids[0], ids[1], ids[2]
    client.delete_task(tasks[gone])
    # an out-of-scale answer: the whole pull is refused, nothing stored, the pulled export kept
    _annotate(client, project, lambda rid: 7.0 if rid == wild else None)
    capsys.readouterr()
    assert _pull(w, ls_env, project) == 2
    err = capsys.readouterr().err
    assert "label 7.0 is outside the label scale [0, 1]" in err
    assert LabelStore(w["st"]).version() == 1
    # fix it in the tool (a second, different answer): two answers that disagree are refused too
    client.annotate(tasks[wild], number_result(w["oracle"][wild]))
    assert _pull(w, ls_env, project) == 2
    assert f"item '{wild}' has 2 submitted answers that disagree" in capsys.readouterr().err
    assert LabelStore(w["st"]).version() == 1
    assert len(w["st"].list("label_requests/_pulled/")) == 2  # both pulls kept as they came
    # resolve: delete the wild annotation; add agreeing duplicates on another task; label the rest
    export = client.export(project)
    wild_ann = next(a["id"] for t in export if t["data"]["response_id"] == wild for a in t["annotations"]
                    if a["result"][0]["value"]["number"] == 7.0)
    client.request("DELETE", f"/api/annotations/{wild_ann}/", what="deleting an annotation")
    _annotate(client, project, lambda rid: None if rid == wild else w["oracle"][rid])
    client.annotate(tasks[twice], number_result(w["oracle"][twice]))
    assert _pull(w, ls_env, project) == 0
    out = capsys.readouterr().out
    n = w["request"]["n_labels"]
    assert f"ingested {n - 1} label(s)" in out and "1 duplicate(s) counted once" in out
    assert f"1 pushed task(s) are no longer in the labelling tool (deleted there?): {gone}" in out
    (m,) = [x for x in list_requests(w["st"]) if x["request_id"] == w["request"]["request_id"]]
    assert m["status"] == "pending"  # the deleted row is still owed
    assert main(["requests", "status", "--evaluation", "audited", "--config", w["config"]]) == 0
    assert f"{n - 1}/{n}" in capsys.readouterr().out
    # issue 30: the tool's status, asked of the server: every pushed item, the answered ones, the deleted one
    assert main(["requests", "status", "--tool", "label-studio", "--url", ls_env["LABEL_STUDIO_URL"], "--project",
                 str(project), "--evaluation", "audited", "--config", w["config"], "--json"]) == 0
    tool = json.loads(capsys.readouterr().out)["tool"]
    assert (tool["pushed"], tool["answered"], tool["unanswered"], tool["deleted"]) == (n, n - 1, 0, 1), tool
    stored = set(LabelStore(w["st"]).read().column("response_id").to_pylist())
    assert gone not in stored and wild in stored and np.isclose(
        dict(zip(*[LabelStore(w["st"]).read().column(c).to_pylist() for c in ("response_id", "oracle_label")]))[wild],
        w["oracle"][wild])
