"""The `drift` flow on real parts: the session's Prefect API server, local folders and moto S3.

The simulated scenarios of `cje_engine.simulate.drift` (uniform shift, reorder, score-to-oracle
remap, and no drift) arrive as daily anchor-score partitions; the flow runs once per day (one
scheduled look), persists its state between runs, and must (a) compute exactly what a
`DriftMonitor` fed the same looks directly computes, (b) alarm after the judge update and not
before, (c) never alarm under no drift. Nothing is mocked: alarms go through `flows.integrations.notify` to a
webhook receiver started here, the judge endpoint of the scorer test is a local HTTP server.
"""
from __future__ import annotations

import json
from pathlib import Path
import os
import subprocess
import sys
import threading
from datetime import date, datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pandas as pd
import pytest

from cje_engine.drift.monitor import METRICS, DriftMonitor
from cje_engine.errors import CJEInputError
from cje_engine.simulate.drift import Judge, drifted_judge, fit_calibration, make_anchor_set
from flows.storage.anchors import score_files, write_anchor_scores, write_anchor_set
from flows.pipelines.drift import drift, run_drift, format_summary
from flows.pipelines.deployments import drift_deployments
from flows.pipelines.drift_config import DriftSettings, load_drift_monitors
from flows.pipelines.drift_tasks import calibration_from_result
from flows.reports.drift import render_drift_report
from flows.storage.drift_state import DriftStateConflict, commit_state, latest_look, load_state, read_looks
from flows.pipelines.drift_config import settings_from
from flows.storage.publish import publish_run
from flows.storage.objects import Storage

from .conftest import REPO
from .test_scorer import KEY, FakeJudge

DAY0 = date(2025, 3, 1)
N_ANCHORS = 200
FAST = [0.1]


# ------------------------------------------------------------------------------ helpers


class Receiver:
    """A webhook receiver on 127.0.0.1 collecting the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(204)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook?token=secret"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


class World:
    """One simulated anchor set, a reference judge, its update, and the calibration curve."""

    def __init__(self, scenario: str, seed: int, n_anchors: int = N_ANCHORS) -> None:
        self.rng = np.random.default_rng(seed)
        self.anchors = make_anchor_set(n_anchors, 0.5, rng=self.rng)
        self.ref_judge = Judge()
        self.new_judge = drifted_judge(scenario, self.ref_judge, n_anchors, None, self.rng)
        cal = fit_calibration(self.ref_judge, rng=self.rng)
        # the isotonic fit's knots: np.interp over them reproduces cal.predict exactly
        self.curve = {"score": cal.scores.tolist(), "fitted": cal.fitted.tolist()}

    def frame(self) -> pd.DataFrame:
        ids = list(self.anchors.anchor_ids)
        return pd.DataFrame({"anchor_id": ids, "prompt": [f"prompt of {a}" for a in ids],
                             "response": [f"response of {a}" for a in ids],
                             "oracle_label": self.anchors.labels().to_numpy()})

    def score(self, drifted: bool) -> pd.Series:
        return (self.new_judge if drifted else self.ref_judge).score(self.anchors, self.rng)


RESULT_EXAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "result_example.json"


def example_result(curve: dict) -> dict:
    """A complete, valid result (the publisher validates what it publishes) carrying ``curve``,
    the calibration curve the drift flow reads (on the 0-1 label scale)."""
    result = json.loads(RESULT_EXAMPLE.read_text())
    result["calibration"]["curve"] = curve
    result["config"]["label_scale"] = [0.0, 1.0]
    return result


def publish_calibration(st: Storage, curve: dict, evaluation: str = "main") -> None:
    """A published evaluation result carrying the calibration curve (the fields the flow reads)."""
    result = example_result(curve)
    out = publish_run(st, evaluation, "2025-02-01_2025-02-28", "calib", {"result.json": json.dumps(result).encode()},
                      {"note": "test calibration"})
    assert out.published


def setup_world(st: Storage, world: World, set_name: str) -> None:
    write_anchor_set(st, set_name, world.frame())
    publish_calibration(st, world.curve)


def write_look(st: Storage, set_name: str, scores: pd.Series, judge: str, day: int, hour: int = 3) -> None:
    ts = datetime.combine(DAY0 + timedelta(days=day), datetime.min.time(), tzinfo=timezone.utc) + timedelta(hours=hour)
    write_anchor_scores(st, set_name, pd.DataFrame({"anchor_id": scores.index, "judge_id": judge, "ts": ts,
                                                    "judge_score": scores.to_numpy()}))


def day(i: int) -> str:
    return (DAY0 + timedelta(days=i)).isoformat()


def run(uri: str, set_name: str, through: int, **kw) -> dict:
    params = dict(set_name=set_name, anchors_uri=uri, evaluation="main", through=day(through), retry_delays=FAST)
    params.update(kw)
    return drift(settings_from(params))


def strip_meta(look: dict) -> dict:
    return {k: v for k, v in look.items() if k != "meta"}


def direct_looks(ref, rep, looks, labels, curve) -> list[dict]:
    """What DriftMonitor computes when fed the same looks directly (JSON round trip like storage)."""
    mon = DriftMonitor()
    f = calibration_from_result({"calibration": {"curve": curve}})
    return [json.loads(json.dumps(strip_meta(mon.update(ref, cur, labels, f, reference_replicate=rep).to_dict())))
            for cur in looks]


# ------------------------------------------------------------------------------ scenarios

# Each scenario: reference (day 0) and replicate (day 1) by judge v1, then four daily looks, one
# flow run each; the updated judge v2 takes over at look 3 (days 4-5). Derivation of what must hold, from the
# monitor's guarantees and the measured figures in docs/drift.md (200 anchors, half labelled,
# default monitor):
# - no drift: P(any alarm within 4 looks) <= alpha = 0.05 (union bound; measured 0.031 over 50);
# - at the stated effects a drifted look alarms with probability about 0.97 at look 10
#   (delay 0 in >= 97% of runs); at look 3 each metric's budget alpha/5/12 is larger than at
#   look 10 (alpha/5/110), so detection at look 3 or 4 has probability >= 0.97;
# - the metric that sees the change: shift -> mean_shift (first-alarm share 0.97), reorder ->
#   tau_b (0.97), remap -> calibration_loss (0.97) or tau_b (0.92).
SCENARIOS = [("none", set(), "local", 11), ("shift", {"mean_shift"}, "s3", 12),
             ("reorder", {"tau_b"}, "local", 13), ("remap", {"calibration_loss", "tau_b"}, "local", 14)]


@pytest.mark.parametrize("scenario, expected, where, seed", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_scenario_over_scheduled_looks(prefect_server, tmp_path, request, receiver, scenario, expected, where,
                                       seed):
    if where == "s3":
        request.getfixturevalue("s3_env")
        uri = f"s3://{request.getfixturevalue('bucket')}/cje"
        st = request.getfixturevalue("direct_storage")(uri)
    else:
        uri = str(tmp_path / "cje")
        st = Storage.for_uri(uri)
    world = World(scenario, seed)
    set_name = f"anchors-{scenario}"
    setup_world(st, world, set_name)
    ref, rep = world.score(False), world.score(False)
    write_look(st, set_name, ref, "v1", 0)
    write_look(st, set_name, rep, "v1", 1)
    first = run(uri, set_name, 1, webhook_url=receiver.url)
    assert first["n_looks"] == 0 and first["new_looks"] == [] and first["report"] is None
    assert first["reference"]["look_key"] == f"{day(0)}/v1" and first["replicate"]["look_key"] == f"{day(1)}/v1"

    drifted_from = 3 if scenario != "none" else 99
    currents, outs = [], []
    for t in range(1, 5):
        drifted = t >= drifted_from
        cur = world.score(drifted)
        currents.append(cur)
        write_look(st, set_name, cur, "v2" if drifted else "v1", t + 1)
        out = run(uri, set_name, t + 1, webhook_url=receiver.url)
        assert [lk["look"] for lk in out["new_looks"]] == [t]
        assert out["new_looks"][0]["meta"]["look_key"] == f"{day(t + 1)}/{'v2' if drifted else 'v1'}"
        outs.append(out)

    # (a) the flow computes exactly what the monitor computes on the same looks
    want = direct_looks(ref, rep, currents, world.anchors.labels(), world.curve)
    got = [strip_meta(o["new_looks"][0]) for o in outs]
    assert got == want
    stored = read_looks(st, set_name)
    assert [strip_meta(lk) for lk in stored] == want
    assert stored[0]["n_labelled"] == N_ANCHORS // 2 and stored[0]["meta"]["calibration"]["evaluation"] == "main"
    assert all(lk["metrics"][m]["estimate"] is not None for lk in stored for m in METRICS)
    state = load_state(st, set_name)
    assert state["monitor"]["n_looks"] == 4 and len(state["processed"]) == 4 and state["seq"] == 5
    assert latest_look(st, set_name)["look"] == 4

    alarms = [set(o["new_looks"][0]["alarms"]) for o in outs]
    if scenario == "none":
        # (c) no alarm under no drift, nothing notified
        assert alarms == [set()] * 4 and all(v is None for v in state["monitor"]["first_alarm"].values())
        assert receiver.bodies == [] and all(o["notifications"] == [] for o in outs)
        return
    # (b) no alarm before the update, an alarm by the expected metric after it
    assert alarms[0] == alarms[1] == set()
    after = set().union(*alarms[2:])
    assert after & expected, (scenario, alarms)
    first_look = min(t + 1 for t in range(2, 4) if alarms[t])
    # the first alarming look was notified through flows.integrations.notify (webhook + Prefect event)
    hooks = [b for b in receiver.bodies if b["kind"] == "drift_alarm"]
    assert hooks and hooks[0]["payload"]["look"] == first_look
    payload = hooks[0]["payload"]
    assert payload["set_name"] == set_name and payload["judge_id"] == "v2" and payload["new_alarms"]
    assert payload["look_object"].endswith(f"drift/{set_name}/looks/{first_look:06d}.json")
    assert set(payload["metrics"]) == set(payload["alarms"])
    sent = outs[first_look - 1]["notifications"]
    assert len(sent) == 1 and sent[0]["webhook"]["delivered"] and sent[0]["event"]["emitted"]
    assert "token=secret" not in json.dumps(sent)
    html = st.read_bytes(f"drift/{set_name}/report.html").decode()
    assert "Drift alarm" in html and html.count("<svg") == 5  # legend + four panels


def test_state_survives_a_process_restart_and_an_interrupted_commit(prefect_server, tmp_path, receiver):
    uri = str(tmp_path / "cje")
    st = Storage.for_uri(uri)
    world = World("shift", 21)
    setup_world(st, world, "restart")
    ref, rep, cur1, cur2, cur3 = (world.score(i >= 4) for i in range(5))
    for i, s in enumerate((ref, rep, cur1)):
        write_look(st, "restart", s, "v1", i)
    config = tmp_path / "evaluations.yaml"
    config.write_text(json.dumps({
        "evaluations": [{"name": "main", "logs_uri": "cje"}],
        "drift_monitors": [{"name": "restart", "set_name": "restart", "anchors_uri": "cje", "evaluation": "main",
                            "interval": 86400}]}))
    # look 1 in another process (a fresh interpreter: nothing in memory survives)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_API_URL=prefect_server.url, PYTHONPATH=str(REPO))
    code = ("import json, sys; from flows.pipelines.drift import run_drift; "
            f"out = run_drift('restart', {str(config)!r}, through={day(2)!r}); "
            "print(json.dumps({'n': out['n_looks'], 'key': out['state_key']}))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"n": 1, "key": "drift/restart/states/00000001.json"}
    # look 2 here, from the persisted state
    write_look(st, "restart", cur2, "v1", 3)
    out2 = run_drift("restart", config, through=day(3))
    assert out2["n_looks"] == 2 and [lk["look"] for lk in out2["new_looks"]] == [2]
    want = direct_looks(ref, rep, [cur1, cur2], world.anchors.labels(), world.curve)
    assert [strip_meta(lk) for lk in read_looks(st, "restart")] == want

    # look 3 (drifted: alarms), then simulate a crash after its commit: look object and pointer lost
    write_look(st, "restart", cur3, "v2", 4)
    out3 = run_drift("restart", config, through=day(4), webhook_url=receiver.url)
    assert out3["alarm"] and out3["new_looks"][0]["look"] == 3
    look3 = st.read_bytes("drift/restart/looks/000003.json")
    pointer_before = st.read_bytes("drift/restart/state.json")
    st.delete("drift/restart/looks/000003.json")
    st.write_bytes("drift/restart/state.json", json.dumps({"seq": 2, "key": "drift/restart/states/00000002.json",
                                                          "n_looks": 2}).encode())
    n_hooks = len(receiver.bodies)
    out4 = run_drift("restart", config, through=day(4), webhook_url=receiver.url)
    assert out4["new_looks"] == [] and out4["n_looks"] == 3
    assert st.read_bytes("drift/restart/looks/000003.json") == look3  # rewritten from the committed state
    assert json.loads(st.read_bytes("drift/restart/state.json"))["seq"] == json.loads(pointer_before)["seq"]
    assert len(receiver.bodies) == n_hooks + 1 and receiver.bodies[-1]["payload"]["look"] == 3
    # every committed state is kept (history is never lost)
    assert [i.key.rsplit("/", 1)[1] for i in st.list("drift/restart/states/")] == [
        "00000001.json", "00000002.json", "00000003.json"]
    # a second writer of the same state number loses cleanly
    state = load_state(st, "restart")
    with pytest.raises(DriftStateConflict, match="committed first"):
        commit_state(st, "restart", state, [])


def test_flow_scores_anchors_through_the_judge_endpoint(prefect_server, tmp_path, monkeypatch):
    monkeypatch.setenv("CJE_TEST_JUDGE_KEY", KEY)
    uri = str(tmp_path / "cje")
    st = Storage.for_uri(uri)
    world = World("none", 31, n_anchors=40)
    write_anchor_set(st, "scored", world.frame())
    scorings = [world.score(False) for _ in range(3)]
    server = FakeJudge(scripts={"response of a00007": ["words"]})  # one anchor never gets a usable score
    scorer = {"base_url": server.base_url, "model": "judge-1", "api_key_env": "CJE_TEST_JUDGE_KEY",
              "score_range": [0, 1], "max_retries": 1, "backoff": 0.01, "timeout": 5, "concurrency": 4}
    outs = []
    try:
        for i, scores in enumerate(scorings):
            server.scores = {f"response of {a}": float(v) for a, v in scores.items()}
            settings = dict(set_name="scored", anchors_uri=uri, judge_id="judge-1@2025-03", scorer=scorer,
                            scored_at=f"{day(i)}T05:00:00Z", retry_delays=FAST)
            # a plain mapping (what a deployment passes) is validated into DriftSettings by Prefect
            outs.append(drift(settings if i == 0 else DriftSettings(**settings)))
    finally:
        server.close()
    assert [o["n_looks"] for o in outs] == [0, 0, 1]
    assert all(o["scored"]["n_scored"] == 39 and o["scored"]["n_unscored"] == 1 for o in outs)
    assert {r["auth"] for r in server.requests} == {f"Bearer {KEY}"}
    assert {r["body"]["model"] for r in server.requests} == {"judge-1"}
    # the scores written are the judge's answers
    from flows.storage.anchors import read_anchor_scores, split_looks

    looks = split_looks(read_anchor_scores(st, score_files(st, "scored")))
    assert [lk.key for lk in looks] == [f"{day(i)}/judge-1@2025-03" for i in range(3)]
    for lk, scores in zip(looks, scorings):
        assert lk.scores.to_dict() == scores.drop("a00007").to_dict()
    look = outs[2]["new_looks"][0]
    assert look["n_anchors"] == 39 and look["n_missing"] == 0  # a00007 is absent from the reference too
    assert look["meta"]["scored_by_flow"] is True and look["meta"]["n_unscored"] == 1
    assert look["meta"]["calibration"] is None and look["metrics"]["residual_mean"]["estimate"] is None
    # the key is in no stored object and in no flow result
    for info in st.list(""):
        assert KEY.encode() not in st.read_bytes(info.key)
    assert KEY not in json.dumps(outs, default=str)


def test_bad_input_names_the_object(prefect_server, tmp_path):
    uri = str(tmp_path / "cje")
    st = Storage.for_uri(uri)
    with pytest.raises(CJEInputError) as err:
        run(uri, "missing", 0)
    assert "anchors/missing" in str(err.value)

    world = World("none", 41, n_anchors=30)
    setup_world(st, world, "bad")
    ids = list(world.anchors.anchor_ids)
    write_look(st, "bad", world.score(False), "v1", 0)
    key = "anchor_scores/bad/dt=2025-03-02/part-x.parquet"

    def put(frame):
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), buf)
        st.write_bytes(key, buf.getvalue())

    ts = datetime(2025, 3, 2, 3, tzinfo=timezone.utc)
    put(pd.DataFrame({"anchor_id": ids[:5] + ["ghost"], "judge_id": "v1", "ts": ts, "judge_score": 0.5}))
    with pytest.raises(CJEInputError) as err:
        run(uri, "bad", 1)
    assert err.value.source == st.url(key) and err.value.row == 5 and "'ghost' is not in the anchor set" in str(
        err.value)
    put(pd.DataFrame({"anchor_id": ids[:3], "judge_id": "v1", "ts": ts, "judge_score": ["0.5", "0.6", "7 of 10"]}))
    with pytest.raises(CJEInputError) as err:
        run(uri, "bad", 1)
    assert (err.value.source, err.value.column, err.value.row) == (st.url(key), "judge_score", 2)
    assert load_state(st, "bad") is None  # nothing committed by failed runs

    st.delete(key)
    write_look(st, "bad", world.score(False), "v1", 1)
    write_look(st, "bad", world.score(False), "v1", 2)
    assert run(uri, "bad", 2)["n_looks"] == 1
    with pytest.raises(CJEInputError, match="differ from the stored ones"):
        run(uri, "bad", 2, monitor={"alpha": 0.1})
    with pytest.raises(CJEInputError, match="uses reference 'first'"):
        run(uri, "bad", 2, reference="judge:v1")
    with pytest.raises(CJEInputError, match="judge_id is required"):
        run(uri, "bad", 2, scorer={"base_url": "http://127.0.0.1:9", "model": "m"})
    # reference rows rewritten after the monitor started
    write_look(st, "bad", world.score(False).iloc[:5] + 0.05, "v1", 0, hour=5)
    with pytest.raises(CJEInputError) as err:
        run(uri, "bad", 2)
    assert "reference look 2025-03-01/v1 changed" in str(err.value) and "dt=2025-03-01" in err.value.source
    # a corrupt state object
    st.write_bytes("drift/bad/states/00000099.json", b"{broken")
    with pytest.raises(CJEInputError) as err:
        run(uri, "bad", 2)
    assert err.value.source.endswith("drift/bad/states/00000099.json")


def test_calibration_curve_of_a_real_engine_result():
    from cje_engine import evaluate
    from cje_engine.simulate.direct import simulate

    sim = simulate(300, label_design="calibration_policy", oracle_fraction=0.3, audit_labels=60, seed=5)
    result = evaluate(sim.frame, inference="analytic", seed=0).to_dict()
    f = calibration_from_result(result)
    grid = np.asarray(result["calibration"]["curve"]["score"])
    assert np.allclose(f(grid), result["calibration"]["curve"]["fitted"], atol=1e-12)
    assert f(np.array([grid[0] - 1.0, grid[-1] + 1.0])).tolist() == [result["calibration"]["curve"]["fitted"][0],
                                                                     result["calibration"]["curve"]["fitted"][-1]]
    mid = (grid[10] + grid[11]) / 2
    fit = result["calibration"]["curve"]["fitted"]
    assert f(np.array([mid]))[0] == pytest.approx((fit[10] + fit[11]) / 2)
    with pytest.raises(CJEInputError, match="calibration.curve"):
        calibration_from_result({"calibration": {"curve": {"score": [0, 1], "fitted": [0.1]}}})
    with pytest.raises(CJEInputError, match="no calibration.curve"):
        calibration_from_result({"policies": {}})


def _many_looks(n: int, change_at: int) -> tuple[list[dict], dict]:
    world = World("shift", 51)
    mon = DriftMonitor()
    f = calibration_from_result({"calibration": {"curve": world.curve}})
    ref, rep = world.score(False), world.score(False)
    looks = []
    for t in range(1, n + 1):
        drifted = t >= change_at
        meta = {"set_name": "many", "monitor": "many", "dt": day(t + 1), "judge_id": "v2" if drifted else "v1",
                "look_key": f"{day(t + 1)}/v1", "anchors_version": 1, "reference_look": f"{day(0)}/v1"}
        looks.append(mon.update(ref, world.score(drifted), world.anchors.labels(), f, reference_replicate=rep,
                                meta=meta).to_dict())
    return json.loads(json.dumps(looks)), mon.to_dict()


def test_report_is_self_contained_and_shows_thresholds(tmp_path):
    looks, state = _many_looks(30, 20)
    html = render_drift_report(looks, state={"monitor": state, "set_name": "many",
                                             "reference": {"look_key": f"{day(0)}/v1", "judge_id": "v1"}})
    (tmp_path / "d.html").write_text(html)
    assert "<script" not in html and "src=" not in html and "@import" not in html
    assert html.replace('xmlns="http://www.w3.org/2000/svg"', "").count("http") == 0
    assert html.count("<svg") == 5 and "Drift alarm" in html and "judge v2" in html
    n_alarm_looks = sum(lk["alarm"] for lk in looks)
    assert html.count("<tr class='alarm'>") == n_alarm_looks >= 1
    # thresholds are drawn per look for each CI metric (two dashed segments per look and panel)
    assert html.count('stroke-dasharray="5 3"') >= 2 * 30 * 3
    calm = render_drift_report(looks[:5], state={"monitor": state})
    assert "No drift alarm in 5 look(s)" in calm
    with pytest.raises(CJEInputError, match="no looks"):
        render_drift_report([])
    with pytest.raises(CJEInputError) as err:
        render_drift_report([looks[0], {"look": 2}])
    assert err.value.row == 1


def test_declared_monitors_and_deployments(tmp_path):
    from flows.runtime.schedules import load_evaluations

    # the repository's file: evaluations unchanged, drift monitors parsed
    assert "demo-weekly" in load_evaluations()
    repo_monitors = load_drift_monitors()
    assert repo_monitors and all(m.anchors_uri for m in repo_monitors.values())
    config = tmp_path / "e.yaml"
    config.write_text(json.dumps({"evaluations": [{"name": "e", "logs_uri": "logs"}], "drift_monitors": [
        {"name": "m1", "set_name": "s1", "anchors_uri": "data", "logs_uri": "s3://b/scores", "cron": "15 6 * * *",
         "evaluation": "e", "monitor": {"alpha": 0.01, "horizon": 365}, "replicate": None},
        {"set_name": "s2", "anchors_uri": "/abs", "interval": 3600, "judge_id": "j",
         "scorer": {"base_url": "http://127.0.0.1:8000/v1", "model": "m", "api_key_env": "JUDGE_KEY"}}]}))
    specs = load_drift_monitors(config)
    assert set(specs) == {"m1", "s2"}
    assert set(specs["m1"].flow_parameters()) == {"settings"}
    m1 = specs["m1"].flow_parameters()["settings"]
    assert m1["anchors_uri"] == str(tmp_path / "data") and m1["logs_uri"] == "s3://b/scores"
    assert m1["replicate"] is None and m1["monitor"] == {"alpha": 0.01, "horizon": 365} and m1["monitor_name"] == "m1"
    assert specs["s2"].settings_dict()["scorer"]["api_key_env"] == "JUDGE_KEY"
    deps = drift_deployments(config)
    assert [d.name for d in deps] == ["drift-m1", "drift-s2"]
    assert deps[0].parameters["settings"]["set_name"] == "s1" and deps[0].schedules[0].schedule.cron == "15 6 * * *"
    assert deps[1].schedules[0].schedule.interval == timedelta(hours=1)
    assert [d.name for d in drift_deployments(config, only=["s2"])] == ["drift-s2"]
    with pytest.raises(CJEInputError, match="no drift monitor named 'x'"):
        run_drift("x", config)
    for bad, text in (({"set_name": "s", "anchors_uri": "a", "colour": 1}, "unknown key"),
                      ({"set_name": "s/x", "anchors_uri": "a"}, "anchor set name"),
                      ({"set_name": "s"}, "needs anchors_uri"),
                      ({"set_name": "s", "anchors_uri": "a", "monitor": {"alpha": 2}}, "alpha"),
                      ({"set_name": "s", "anchors_uri": "a", "monitor": {"colour": 1}}, "bad monitor option"),
                      ({"set_name": "s", "anchors_uri": "a", "scorer": {"base_url": "http://h", "model": "m"}},
                       "judge_id is required"),
                      ({"set_name": "s", "anchors_uri": "a", "reference": "latest"}, "reference"),
                      ({"set_name": "s", "anchors_uri": "a", "cron": "61 * * * *"}, "cron")):
        config.write_text(json.dumps({"drift_monitors": [bad]}))
        with pytest.raises(CJEInputError) as err:
            load_drift_monitors(config)
        assert text in str(err.value) and str(config) in str(err.value)


# ------------------------------------------------------------------------------ label requests on alarms


def test_drift_alarm_raises_one_label_request_for_anchors_and_recent_traffic(prefect_server, tmp_path, receiver):
    """The shift scenario of test_scenario_over_scheduled_looks (same seed, same draws, so the same
    looks: no alarm at looks 1-2, an alarm at look 3 or 4), now with a linked evaluation whose
    logs cover 2025-03-01..02: the first alarm writes one manifest under label_requests/ with the
    reason, the anchors and recent-traffic rows; later looks and reruns raise nothing new."""
    from flows.label_requests.manifests import list_requests, mark_fulfilled
    from flows.label_requests.raising import raise_drift_requests
    from flows.storage.publish import read_latest

    from .conftest import write_simulated_logs

    uri = str(tmp_path / "cje")
    st = Storage.for_uri(uri)
    st_logs, st_labels = Storage.for_uri(str(tmp_path / "logs")), Storage.for_uri(str(tmp_path / "labels"))
    frame, _ = write_simulated_logs(st_logs, st_labels, n_prompts=150, days=2, seed=3)
    world = World("shift", 12)
    set_name = "anchors-shift"
    write_anchor_set(st, set_name, world.frame())
    window = "2025-03-01_2025-03-02"
    result = example_result(world.curve)
    assert publish_run(st, "main", window, "run1", {"result.json": json.dumps(result).encode()}, {}).published
    ref, rep = world.score(False), world.score(False)
    write_look(st, set_name, ref, "v1", 0)
    write_look(st, set_name, rep, "v1", 1)
    req_cfg = {"drift_traffic_labels": 30, "drift_anchor_labels": 10}
    kw = dict(webhook_url=receiver.url, evaluation_logs_uri=str(tmp_path / "logs"),
              labels_uri=str(tmp_path / "labels"), label_requests=req_cfg)
    run(uri, set_name, 1, **kw)
    outs = []
    for t in range(1, 5):
        drifted = t >= 3
        write_look(st, set_name, world.score(drifted), "v2" if drifted else "v1", t + 1)
        outs.append(run(uri, set_name, t + 1, **kw))
    assert [o["alarm"] for o in outs[:2]] == [False, False]
    assert all(o["label_requests"] == [] for o in outs[:2])
    first = next(i for i, o in enumerate(outs) if o["alarm"])
    look = outs[first]["new_looks"][0]
    (req,) = outs[first]["label_requests"]
    assert req["look"] == look["look"] == first + 1 and req["judge_id"] == "v2" and req["alarms"] == look["alarms"]
    assert req["n_rows"] == 30 and req["n_anchors"] == 10 and req["n_labels"] == 40

    stored = list_requests(Storage.for_uri(uri))
    assert [m["request_id"] for m in stored] == [req["request_id"]]
    m = json.loads((tmp_path / "cje" / "label_requests" / f"{req['request_id']}.json").read_text())
    assert m["scope"] == "drift" and m["evaluation"] == "main" and m["window"] == window
    (reason,) = m["reasons"]
    assert reason["trigger"] == "drift_alarm"
    assert f"look {look['look']}" in reason["reason"] and "judge v2" in reason["reason"]
    for a in look["alarms"]:
        assert a in reason["reason"]
    assert reason["detail"]["look"] == look["look"] and reason["detail"]["judge_id"] == "v2"
    assert m["drift"]["monitor"] == set_name and m["drift"]["look"] == look["look"]
    assert m["drift"]["look_key"] == look["meta"]["look_key"]
    assert "2025-03-01_2025-03-02" in m["drift"]["traffic"]
    # anchors: 10 distinct ids of the anchor set, each drawn with probability 10/200
    ids = {a["anchor_id"] for a in m["anchors"]}
    assert len(ids) == 10 and ids <= set(world.anchors.anchor_ids)
    assert all(a["selection_probability"] == 10 / N_ANCHORS for a in m["anchors"])
    # recent traffic: unlabelled rows of the last log date of the window, with inclusion probabilities
    unlabelled = set(frame.loc[frame["oracle_label"].isna(), "response_id"])
    assert len({r["response_id"] for r in m["rows"]}) == 30
    assert {r["dt"] for r in m["rows"]} == {"2025-03-02"}
    assert all(r["response_id"] in unlabelled for r in m["rows"])
    assert all(0 < r["inclusion_probability"] <= 1 and r["selection_probability"] > 0 for r in m["rows"])
    hooks = [b for b in receiver.bodies if b["kind"] == "label_request"]
    assert len(hooks) == 1 and hooks[0]["payload"]["request_id"] == req["request_id"]
    assert hooks[0]["payload"]["drift"]["look"] == look["look"]
    text = format_summary(outs[first])
    assert f"label request {req['request_id']}" in text and "30 recent traffic row(s) + 10 anchor(s)" in text

    # later looks raise nothing new while it is pending (a new first alarm of another metric is skipped)
    for o in outs[first + 1:]:
        assert o["label_requests"] == []
        if any(lk["alarm"] for lk in o["new_looks"]) and o["label_requests_skipped"]:
            assert all("pending" in s["reason"] for s in o["label_requests_skipped"])
    # a second run of the same look: nothing new
    again = run(uri, set_name, 5, **kw)
    assert again["new_looks"] == [] and again["label_requests"] == []
    # the same look raised once more (a repair, a retry), even after the request was fulfilled: nothing new
    mark_fulfilled(st, req["request_id"], {"labels": 40})
    latest = read_latest(st, "main")
    redo = raise_drift_requests(None, uri, look, world.anchors.anchor_ids, evaluation="main", latest=latest,
                                logs_uri=str(tmp_path / "logs"), config=req_cfg)
    assert redo["requests"] == [] and "already raised request" in redo["skipped"][0]["reason"]
    assert len(list_requests(st)) == 1


def test_drift_alarm_without_linked_evaluation_requests_anchors_only(prefect_server, tmp_path):
    """No evaluation: the residual metrics are skipped, the mean shift still alarms, and the request
    holds anchor labels only with the reason recorded."""
    uri = str(tmp_path / "cje")
    st = Storage.for_uri(uri)
    world = World("shift", 12)
    write_anchor_set(st, "solo", world.frame())
    for i, drifted in enumerate((False, False, True)):
        write_look(st, "solo", world.score(drifted), "v2" if drifted else "v1", i)
    out = run(uri, "solo", 2, evaluation=None, label_requests={"drift_anchor_labels": 20})
    assert out["alarm"] and "mean_shift" in out["alarms"]  # a 0.1 shift on 200 anchors (docs/drift.md)
    (req,) = out["label_requests"]
    assert req["n_rows"] == 0 and req["n_anchors"] == 20 and req["evaluation"] is None
    assert req["traffic"] == "none requested: the drift monitor has no linked evaluation"
    assert "traffic none requested" in format_summary(out)


def test_bad_label_request_settings_fail_before_any_work(prefect_server, tmp_path):
    with pytest.raises(CJEInputError, match="unknown label request setting"):
        run(str(tmp_path / "nothing"), "s", 1, label_requests={"colour": 1})


def test_declared_monitor_takes_its_evaluations_logs_and_request_settings(tmp_path):
    config = tmp_path / "e.yaml"
    config.write_text(json.dumps({
        "evaluations": [{"name": "e", "logs_uri": "logs", "labels_uri": "labels", "results_uri": "res",
                         "label_requests": {"drift_traffic_labels": 7}}],
        "drift_monitors": [{"name": "m", "set_name": "s", "anchors_uri": "data", "evaluation": "e"},
                           {"name": "other", "set_name": "s", "anchors_uri": "data", "evaluation": "elsewhere",
                            "results_uri": "r2"}]}))
    specs = load_drift_monitors(config)
    p = specs["m"].settings_dict()
    assert p["evaluation_logs_uri"] == str(tmp_path / "logs") and p["labels_uri"] == str(tmp_path / "labels")
    assert p["results_uri"] == str(tmp_path / "res") and p["label_requests"] == {"drift_traffic_labels": 7}
    q = specs["other"].settings_dict()  # not declared here: anchors only on alarm
    assert q["evaluation_logs_uri"] is None and q["label_requests"] is None and q["results_uri"] == str(tmp_path / "r2")


def test_clusters_come_from_prompt_id_or_repeated_prompts(tmp_path):
    from flows.pipelines.drift_tasks import _clusters

    st = Storage.for_uri(str(tmp_path))
    ids = [f"a{i}" for i in range(8)]
    base = {"anchor_id": ids, "response": [f"r{i}" for i in range(8)], "oracle_label": [None] * 8}
    # no prompt_id, every prompt different: no clusters (the monitor warns that it assumes independence)
    a = write_anchor_set(st, "solo", pd.DataFrame({**base, "prompt": [f"p{i}" for i in range(8)]}))
    assert _clusters(a) == (None, None)
    # repeated prompt texts: the prompt is the cluster
    b = write_anchor_set(st, "shared", pd.DataFrame({**base, "prompt": [f"p{i // 4}" for i in range(8)]}))
    cl, source = _clusters(b)
    assert source == "prompt" and cl.nunique() == 2 and list(cl.index) == ids
    # an explicit prompt_id wins
    c = write_anchor_set(st, "ids", pd.DataFrame({**base, "prompt": [f"p{i}" for i in range(8)],
                                                  "prompt_id": [f"q{i // 2}" for i in range(8)]}))
    cl, source = _clusters(c)
    assert source == "prompt_id" and cl.nunique() == 4


def test_summary_line_names_tau_and_its_change():
    # issue 13: the line printed "tau_b=+0.040", which was the change, not tau
    rng, n = np.random.default_rng(9), 60
    ids = [f"a{i}" for i in range(n)]
    q = rng.normal(size=n)
    score = lambda: pd.Series(np.round(q + rng.normal(0, 0.6, n), 1), index=ids)  # noqa: E731
    mon = DriftMonitor()
    look = mon.update(score(), score(), reference_replicate=score()).to_dict()
    look["meta"] = {"look_key": "2025-03-02/v1"}
    text = format_summary({"monitor": "m", "set_name": "s", "anchors_version": 1, "new_looks": [look], "n_looks": 1,
                           "first_alarm": look["first_alarm"]})
    d = look["metrics"]["tau_b"]["detail"]
    assert f"tau={d['tau']:.3f}, rank change {look['metrics']['tau_b']['estimate']:+.3f}" in text
    assert f"({d['tau_between']:.3f} across vs {d['tau_within']:.3f} within)" in text
    assert "tau_b=" not in text
