"""The `drift` Prefect flow: judge drift on an anchor set, look by look, with persisted state.

One flow run:

1. ``load_anchors``   the anchor set (a pinned version or the latest) from ``anchors/<set>/``;
2. ``score_anchors``  optional: ask the judge endpoint (`flows.integrations.scorer`) to re-score every anchor
                      and write the scores as a new look under ``anchor_scores/<set>/dt=.../``;
3. ``load_state``     the monitor's state from ``drift/<monitor>/`` (None on the first run);
4. ``load_scores``    score partitions, grouped into looks (one judge id on one UTC day);
5. ``load_calibration`` score -> oracle curve of the latest published evaluation result;
6. ``update``         `cje_engine.drift.monitor.DriftMonitor.update` once per new look, in time order;
7. ``commit``         new state object, the looks, then the ``state.json`` pointer;
8. ``notify_alarms``  `flows.integrations.notify.notify("drift_alarm", ...)` for looks with new alarms;
9. ``write_report``   ``drift/<monitor>/report.html`` (timeline of every look).

Reference and replicate
-----------------------
Looks are compared with a **reference** look, chosen once and frozen in the state:
``"first"`` (default: the earliest look), ``"judge:<judge_id>"`` (the earliest look of that
judge version) or an explicit look key ``"YYYY-MM-DD/<judge_id>"``. Tau-b can only alarm with a
baseline (docs/drift.md): the **replicate** is a second, independent scoring by the reference
judge, ``"next"`` (default: the look right after the reference when it has the reference's judge
id; otherwise there is none and tau-b is descriptive), an explicit look key, or ``None``. The
replicate look is not monitored itself. Every later look that is not yet processed is compared
with the reference (looks dated before the last processed look are not revisited).

State layout (``drift/<monitor>/``; nothing is ever overwritten but the pointer and the report)::

    states/00000001.json   full state after commit 1 (monitor.to_dict() + bookkeeping + new looks)
    states/00000002.json   ...                      (create-only: a concurrent run loses cleanly)
    state.json             pointer {"seq", "key", "n_looks", ...} (replaced atomically)
    looks/000001.json      DriftLook.to_dict() of look 1 (create-only); meta holds the look key,
                           judge id, anchor set version and calibration source
    report.html            timeline of all looks

Loading takes the highest ``states/`` object (the pointer is a hint), so a run that died between
its commit and the pointer is completed by the next run (missing look objects are rewritten
from the committed state and their alarms notified).

Calibration
-----------
The residual metrics need ``f(score) -> oracle scale``. With ``evaluation`` given, the flow reads
the latest published result of that evaluation (``results_uri``) and interpolates its
``calibration.curve`` (``score`` grid -> ``fitted``) linearly, flat outside the grid
(``numpy.interp``): for a monotone calibration this is the fitted isotonic step function joined
linearly (the grid has 101 points), for a two-stage calibration it is the curve at the median
covariates. The anchors' judge scores must be on the evaluation's score scale. Without a
published result (or without labelled anchors) the residual metrics are skipped and their share
of alpha stays unused.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from cje_engine.drift.monitor import METRICS, DriftMonitor
from cje_engine.errors import CJEInputError

from flows.reports.artifacts import drift_artifacts
from flows.storage.anchors import (AnchorSet, Look, check_name, read_anchor_scores, read_anchor_set, score_files,
                      split_looks, write_anchor_scores)
from flows.storage.objects import NotFoundError, Storage, StorageConfig

log = logging.getLogger(__name__)

DRIFT = "drift"
STATE_FORMAT = 1
DEFAULT_RETRY_DELAYS: tuple[float, ...] = (2.0, 10.0, 30.0)
_STATE_RE = re.compile(r"^(\d{8})\.json$")
_LOOK_RE = re.compile(r"^(\d{6})\.json$")
_LOOK_KEY_RE = re.compile(r"^\d{4}-\d{2}-\d{2}/.+$")


class DriftStateConflict(RuntimeError):
    """Another run committed the monitor's next state first; rerun to continue from it."""


# --------------------------------------------------------------------------------------
# state in storage


def state_prefix(monitor: str) -> str:
    return f"{DRIFT}/{check_name(monitor, 'monitor name')}/"


def _read_json(st: Storage, key: str) -> dict | None:
    try:
        raw = st.read_bytes(key)
    except NotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise CJEInputError(f"not valid JSON: {exc}", source=st.url(key)) from None
    if not isinstance(doc, dict):
        raise CJEInputError("expected a JSON object", source=st.url(key))
    return doc


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False, default=str).encode("utf-8")


def load_state(st: Storage, monitor: str) -> dict | None:
    """The newest committed state of a monitor, or None before its first commit."""
    prefix = state_prefix(monitor) + "states/"
    seqs = [int(m.group(1)) for info in st.list(prefix) if (m := _STATE_RE.match(info.key[len(prefix):]))]
    if not seqs:
        return None
    key = f"{prefix}{max(seqs):08d}.json"
    doc = _read_json(st, key)
    if doc is None or doc.get("format") != STATE_FORMAT or "monitor" not in doc:
        raise CJEInputError(f"drift state has an unknown format (expected format {STATE_FORMAT})", source=st.url(key))
    DriftMonitor.from_dict(doc["monitor"], source=st.url(key))  # validates
    doc["_key"] = key
    return doc


def read_looks(st: Storage, monitor: str) -> list[dict]:
    """Every stored look of a monitor (``DriftLook.to_dict()``), in look order.

    For the label-request triggers: a look with ``alarm`` true asks for fresh labels on the
    anchors (``meta.set_name``, ``meta.anchors_version``) and on recent traffic.
    """
    prefix = state_prefix(monitor) + "looks/"
    out = []
    for info in st.list(prefix):
        if _LOOK_RE.match(info.key[len(prefix):]):
            doc = _read_json(st, info.key)
            if doc is not None:
                out.append(doc)
    out.sort(key=lambda d: int(d.get("look", 0)))
    return out


def latest_look(st: Storage, monitor: str) -> dict | None:
    """The newest stored look of a monitor (its ``alarm``/``alarms``/``first_alarm``), or None."""
    ptr = _read_json(st, state_prefix(monitor) + "state.json")
    n = int(ptr.get("n_looks", 0)) if ptr else 0
    if n:
        doc = _read_json(st, f"{state_prefix(monitor)}looks/{n:06d}.json")
        if doc is not None:
            return doc
    looks = read_looks(st, monitor)
    return looks[-1] if looks else None


def commit_state(st: Storage, monitor: str, doc: dict, new_looks: list[dict]) -> tuple[str, list[str]]:
    """Write state ``doc`` (with ``seq``) create-only, then its looks, then the pointer.

    Raises `DriftStateConflict` when state ``seq`` already exists (a concurrent run won).
    Returns the state key and the look keys.
    """
    prefix = state_prefix(monitor)
    key = f"{prefix}states/{int(doc['seq']):08d}.json"
    body = {k: v for k, v in doc.items() if not k.startswith("_")}
    body["new_looks"] = new_looks
    if not st.put_if_absent(key, _dumps(body)):
        raise DriftStateConflict(f"{st.url(key)} exists: another drift run of monitor {monitor!r} committed "
                                 "first; rerun to continue from its state")
    look_keys = _write_looks(st, monitor, new_looks)
    _write_pointer(st, monitor, body, key)
    return key, look_keys


def _write_looks(st: Storage, monitor: str, looks: list[dict]) -> list[str]:
    keys = []
    for lk in looks:
        k = f"{state_prefix(monitor)}looks/{int(lk['look']):06d}.json"
        st.put_if_absent(k, _dumps(lk))
        keys.append(k)
    return keys


def _write_pointer(st: Storage, monitor: str, body: dict, key: str) -> None:
    mon = body["monitor"]
    st.write_bytes(state_prefix(monitor) + "state.json", _dumps({
        "seq": body["seq"], "key": key, "n_looks": mon["n_looks"], "first_alarm": mon["first_alarm"],
        "alarmed": any(v is not None for v in mon["first_alarm"].values()), "updated_at": body["updated_at"],
        "set_name": body.get("set_name"), "reference": body.get("reference"), "replicate": body.get("replicate"),
    }))


def _repair(st: Storage, monitor: str, state: dict) -> list[dict]:
    """Finish a commit whose looks or pointer were not written; returns the looks rewritten."""
    missing = [lk for lk in state.get("new_looks") or []
               if not st.exists(f"{state_prefix(monitor)}looks/{int(lk['look']):06d}.json")]
    if missing:
        _write_looks(st, monitor, missing)
    ptr = _read_json(st, state_prefix(monitor) + "state.json")
    if ptr is None or int(ptr.get("seq", -1)) != int(state["seq"]):
        _write_pointer(st, monitor, state, state["_key"])
    if missing:
        log.warning("drift monitor %s: completed an interrupted commit (%d look(s) rewritten)", monitor, len(missing))
    return missing


# --------------------------------------------------------------------------------------
# calibration


def calibration_from_result(result: dict, source: str = "result.json") -> Callable[[np.ndarray], np.ndarray]:
    """``f(score)`` interpolating ``result["calibration"]["curve"]`` (flat outside the grid)."""
    cal = result.get("calibration") if isinstance(result, dict) else None
    curve = cal.get("curve") if isinstance(cal, dict) else None
    if not isinstance(curve, dict):
        raise CJEInputError("result has no calibration.curve", source=source, column="calibration")
    try:
        x = np.asarray(curve["score"], dtype=float)
        y = np.asarray(curve["fitted"], dtype=float)
    except (KeyError, TypeError, ValueError):
        raise CJEInputError("calibration.curve needs numeric 'score' and 'fitted' lists", source=source,
                            column="calibration.curve") from None
    if x.ndim != 1 or x.shape != y.shape or x.size == 0 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise CJEInputError("calibration.curve 'score' and 'fitted' must be equally long lists of finite numbers",
                            source=source, column="calibration.curve")
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    ux, inv = np.unique(x, return_inverse=True)
    uy = np.bincount(inv, weights=y) / np.bincount(inv)  # repeated grid points (constant scores): average

    def calibrate(s: np.ndarray) -> np.ndarray:
        return np.interp(np.asarray(s, dtype=float), ux, uy)

    return calibrate


# --------------------------------------------------------------------------------------
# tasks


def _retry_unless_bad_input(task_: Any, task_run: Any, state: Any) -> bool:
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - cannot tell: retry
        return True
    return not isinstance(exc, (CJEInputError, DriftStateConflict))


_STORAGE_TASK = dict(retries=len(DEFAULT_RETRY_DELAYS), retry_delay_seconds=list(DEFAULT_RETRY_DELAYS),
                     retry_condition_fn=_retry_unless_bad_input, cache_policy=NO_CACHE)
_PURE_TASK = dict(cache_policy=NO_CACHE)


@task(name="load_anchors", **_STORAGE_TASK)
def load_anchors(anchors_uri: str, cfg: Any, set_name: str, version: int | None) -> AnchorSet:
    anchors = read_anchor_set(Storage.for_uri(anchors_uri, cfg), set_name, version)
    get_run_logger().info("anchor set %s v%d: %d anchors, %d labelled", set_name, anchors.version,
                          anchors.manifest["n_anchors"], anchors.manifest["n_labelled"])
    return anchors


@task(name="score_anchors", **_STORAGE_TASK)
def score_anchors(logs_uri: str, cfg: Any, anchors: AnchorSet, scorer_config: dict, judge_id: str,
                  scored_at: datetime, basename: str) -> dict:
    """Re-score every anchor with the judge endpoint and write the scores as a new look."""
    from flows.integrations.scorer import OpenAIChatScorer, ScorerError

    scorer = OpenAIChatScorer.from_config(dict(scorer_config))
    items = anchors.items()
    scores = np.asarray(scorer.score(items), dtype=float)
    ok = np.isfinite(scores)
    if not ok.any():
        raise ScorerError(f"the judge returned no usable score for any of the {len(items)} anchors")
    ids = [it["anchor_id"] for it in items]
    table = pa.table({"anchor_id": pa.array([a for a, k in zip(ids, ok) if k], pa.string()),
                      "judge_id": pa.array([judge_id] * int(ok.sum()), pa.string()),
                      "ts": pa.array([scored_at] * int(ok.sum()), pa.timestamp("us", tz="UTC")),
                      "judge_score": pa.array(scores[ok], pa.float64())})
    keys = write_anchor_scores(Storage.for_uri(logs_uri, cfg), anchors.name, table, basename=basename)
    out = {"look_key": f"{scored_at.date().isoformat()}/{judge_id}", "n_scored": int(ok.sum()),
           "n_unscored": int((~ok).sum()), "keys": keys, "scorer": repr(scorer), "stats": dict(scorer.stats_)}
    get_run_logger().info("judge %s scored %d anchor(s) (%d without a usable score)", judge_id, out["n_scored"],
                          out["n_unscored"])
    return out


@task(name="load_state", **_STORAGE_TASK)
def load_state_task(drift_uri: str, cfg: Any, monitor: str) -> dict | None:
    st = Storage.for_uri(drift_uri, cfg)
    state = load_state(st, monitor)
    if state is not None:
        state["_repaired"] = _repair(st, monitor, state)
    return state


@task(name="load_scores", **_STORAGE_TASK)
def load_scores(logs_uri: str, cfg: Any, set_name: str, anchor_ids: list[str], since: str | None,
                extra_dates: list[str], through: str) -> list[Look]:
    """Looks of the partitions dated ``since..through`` (all when None) plus ``extra_dates``."""
    st = Storage.for_uri(logs_uri, cfg)
    files = [f for f in score_files(st, set_name, None, through)
             if since is None or f.key.split("dt=", 1)[1][:10] >= since
             or f.key.split("dt=", 1)[1][:10] in extra_dates]
    table = read_anchor_scores(st, files, known_ids=anchor_ids)
    looks = split_looks(table)
    get_run_logger().info("%d score file(s), %d row(s), %d look(s) of set %s", len(files), table.num_rows,
                          len(looks), set_name)
    return looks


@task(name="load_calibration", **_STORAGE_TASK)
def load_calibration(results_uri: str, cfg: Any, evaluation: str) -> dict | None:
    from flows.storage.publish import read_latest

    latest = read_latest(Storage.for_uri(results_uri, cfg), evaluation)
    if latest is None or latest.get("result") is None:
        get_run_logger().warning("no published result of evaluation %r under %s: residual metrics skipped",
                                 evaluation, results_uri)
        return None
    result = latest["result"]
    calibration_from_result(result, f"{latest['path']}/result.json")  # validates the curve now
    cal = result["calibration"]
    return {"curve": {"score": list(cal["curve"]["score"]), "fitted": list(cal["curve"]["fitted"])},
            "info": {"evaluation": evaluation, "window": latest.get("window"), "run_key": latest.get("run_key"),
                     "published_at": latest.get("published_at"), "mode": cal.get("mode"),
                     "n_train": cal.get("n_train"), "path": latest.get("path")}}


def _select(selector: str, looks: list[Look], what: str) -> Look | None:
    if selector == "first":
        return looks[0] if looks else None
    if selector.startswith("judge:"):
        judge = selector[len("judge:"):]
        return next((lk for lk in looks if lk.judge_id == judge), None)
    if _LOOK_KEY_RE.match(selector):
        return next((lk for lk in looks if lk.key == selector), None)
    raise CJEInputError(f"{what} {selector!r} must be 'first', 'judge:<judge_id>' or a look key "
                        "'YYYY-MM-DD/<judge_id>'", column=what)


@dataclass
class UpdateOutcome:
    state: dict
    new_looks: list[dict] = field(default_factory=list)
    changed: bool = False
    waiting: str | None = None
    late_looks: list[str] = field(default_factory=list)


@task(name="update", **_PURE_TASK)
def update(state: dict | None, looks: list[Look], anchors: AnchorSet, *, set_name: str, monitor_name: str,
           monitor_options: dict, reference: str, replicate: str | None, calibration: dict | None,
           scored: dict | None, flow_run_id: str | None) -> UpdateOutcome:
    """Choose the reference (first time), then run `DriftMonitor.update` for every new look."""
    now = datetime.now(timezone.utc).isoformat()
    fresh = DriftMonitor(**monitor_options)
    if state is None:
        state = {"format": STATE_FORMAT, "seq": 0, "set_name": set_name, "monitor_name": monitor_name,
                 "monitor": fresh.to_dict(), "reference": None, "replicate": None, "processed": [],
                 "created_at": now, "updated_at": now}
    else:
        state = {k: v for k, v in state.items() if not k.startswith("_") and k != "new_looks"}
        if state.get("set_name") != set_name:
            raise CJEInputError(f"monitor {monitor_name!r} watches anchor set {state.get('set_name')!r}, not "
                                f"{set_name!r}; use another monitor name", column="set_name")
        if state["monitor"]["config"] != fresh.to_dict()["config"]:
            raise CJEInputError(f"monitor options {fresh.get_config()} differ from the stored ones "
                                f"{state['monitor']['config']}: the error budget is fixed when a monitor starts; "
                                "use another monitor name for new options", column="monitor")
    out = UpdateOutcome(state=state)
    by_key = {lk.key: lk for lk in looks}

    ref_info = state.get("reference")
    if ref_info is None:
        ref = _select(reference, looks, "reference")
        if ref is None:
            out.waiting = f"no look matches reference {reference!r} yet"
            return out
        ref_info = {"selector": reference, "look_key": ref.key, "judge_id": ref.judge_id, "dt": ref.dt,
                    "fingerprint": ref.fingerprint(), "n_anchors": int(ref.scores.shape[0])}
        state["reference"] = ref_info
        state["replicate"] = None if replicate in (None, "none") else {"selector": replicate, "look_key": None}
        out.changed = True
    elif ref_info["selector"] != reference:
        raise CJEInputError(f"monitor {monitor_name!r} uses reference {ref_info['selector']!r} "
                            f"({ref_info['look_key']}), not {reference!r}; use another monitor name",
                            column="reference")
    ref = by_key.get(ref_info["look_key"])
    if ref is None:
        raise CJEInputError(f"the reference look {ref_info['look_key']} has no score rows any more",
                            source=f"anchor_scores/{set_name}/dt={ref_info['dt']}/")
    if ref.fingerprint() != ref_info["fingerprint"]:
        raise CJEInputError(f"the reference look {ref.key} changed since the monitor started (score rows were "
                            "added or rewritten); the monitor cannot continue against different reference scores",
                            source=f"anchor_scores/{set_name}/dt={ref.dt}/")
    order = [lk.key for lk in looks]
    after = looks[order.index(ref.key) + 1:]

    rep_info = state.get("replicate")
    rep = None
    if rep_info is not None:
        if rep_info.get("look_key") is None:  # not resolved yet
            sel = rep_info["selector"]
            if sel == "next":
                cand = after[0] if after else None
                if cand is None:
                    out.waiting = "waiting for the look after the reference (replicate 'next')"
                    return out
                if cand.judge_id != ref.judge_id:
                    log.warning("the look after the reference is by judge %s, not %s: no replicate, tau-b will "
                                "not alarm", cand.judge_id, ref.judge_id)
                    state["replicate"] = None
                    rep_info = None
                else:
                    rep_info = {**rep_info, "look_key": cand.key, "fingerprint": cand.fingerprint()}
            else:
                cand = _select(sel, after, "replicate")
                if cand is None:
                    out.waiting = f"waiting for the replicate look {sel!r}"
                    return out
                rep_info = {**rep_info, "look_key": cand.key, "fingerprint": cand.fingerprint()}
            if rep_info is not None:
                state["replicate"] = rep_info
            out.changed = True
        if rep_info is not None:
            rep = by_key.get(rep_info["look_key"])
            if rep is None or rep.fingerprint() != rep_info["fingerprint"]:
                raise CJEInputError(f"the replicate look {rep_info['look_key']} is missing or was rewritten",
                                    source=f"anchor_scores/{set_name}/dt={rep_info['look_key'][:10]}/")

    processed = set(state["processed"])
    skip = {ref.key} | ({rep.key} if rep is not None else set())
    last_dt = max([k[:10] for k in state["processed"]] or [""])
    todo = []
    for lk in after:
        if lk.key in skip or lk.key in processed:
            continue
        if lk.dt < last_dt:
            out.late_looks.append(lk.key)
            continue
        todo.append(lk)
    if not todo:
        return out

    mon = DriftMonitor.from_dict(state["monitor"])
    labels = anchors.labels()
    calibrate = None
    if calibration is not None and labels.notna().any():
        calibrate = calibration_from_result({"calibration": {"curve": calibration["curve"]}})
    clusters = anchors.clusters()
    for lk in todo:
        meta = {"set_name": set_name, "monitor": monitor_name, "look_key": lk.key, "dt": lk.dt,
                "judge_id": lk.judge_id, "ts_min": lk.ts_min, "ts_max": lk.ts_max, "n_rows": lk.n_rows,
                "anchors_version": anchors.version, "anchors_sha256": anchors.content_sha256,
                "reference_look": ref.key, "replicate_look": rep.key if rep is not None else None,
                "calibration": calibration["info"] if calibrate is not None else None,
                "flow_run_id": flow_run_id}
        if scored is not None and scored["look_key"] == lk.key:
            meta.update(scored_by_flow=True, n_unscored=scored["n_unscored"])
        look = mon.update(ref.scores, lk.scores, labels if calibrate is not None else None, calibrate,
                          reference_replicate=rep.scores if rep is not None else None, clusters=clusters, meta=meta)
        out.new_looks.append(look.to_dict())
        state["processed"].append(lk.key)
    state["monitor"] = mon.to_dict()
    out.changed = True
    return out


@task(name="commit", **_STORAGE_TASK)
def commit(drift_uri: str, cfg: Any, monitor: str, state: dict, new_looks: list[dict]) -> dict:
    st = Storage.for_uri(drift_uri, cfg)
    state = dict(state)
    state["seq"] = int(state["seq"]) + 1
    state["updated_at"] = datetime.now(timezone.utc).isoformat()
    key, look_keys = commit_state(st, monitor, state, new_looks)
    get_run_logger().info("committed drift state %s with %d new look(s)", st.url(key), len(new_looks))
    return {"state_key": key, "look_keys": look_keys, "seq": state["seq"]}


def _alarm_payload(look: dict, monitor: str, urls: dict, evaluation: str | None) -> dict:
    meta = look.get("meta") or {}
    new = [m for m in look.get("alarms") or [] if (look.get("first_alarm") or {}).get(m) == look.get("look")]
    payload = {
        "set_name": meta.get("set_name"), "monitor": monitor, "look": look.get("look"),
        "look_key": meta.get("look_key"), "judge_id": meta.get("judge_id"),
        "reference_look": meta.get("reference_look"), "anchors_version": meta.get("anchors_version"),
        "alarms": look.get("alarms"), "new_alarms": new, "first_alarm": look.get("first_alarm"),
        "metrics": {m: {k: (look["metrics"][m] or {}).get(k) for k in
                        ("estimate", "ci_anytime", "p_value", "alpha_spent", "n")}
                    for m in look.get("alarms") or []},
        "look_object": urls.get("look"), "report": urls.get("report"),
    }
    if evaluation:
        payload["evaluation"] = evaluation
    return payload


@task(name="notify_alarms", **_PURE_TASK)
def notify_alarms(looks: list[dict], monitor: str, urls: dict[int, dict], evaluation: str | None,
                  notify_on: str, webhook_url: str | None) -> list[dict]:
    """`flows.integrations.notify.notify("drift_alarm", ...)` per alarming look (``notify_on``: new / every)."""
    try:
        from flows.integrations.notify import notify
    except ImportError:  # pragma: no cover - the module ships with the service
        notify = None
    sent = []
    for lk in looks:
        if not lk.get("alarm"):
            continue
        new = [m for m in lk.get("alarms") or [] if (lk.get("first_alarm") or {}).get(m) == lk.get("look")]
        if notify_on == "new" and not new:
            continue
        payload = _alarm_payload(lk, monitor, urls.get(int(lk["look"]), {}), evaluation)
        if notify is None:
            get_run_logger().error("drift alarm at look %s (%s) but flows.integrations.notify is not available",
                                   lk.get("look"), ", ".join(lk["alarms"]))
            sent.append({"kind": "drift_alarm", "ok": False, "error": "flows.integrations.notify not available",
                         "payload": payload})
            continue
        res = notify("drift_alarm", payload, webhook_url=webhook_url)
        sent.append({**res, "payload": payload})
        get_run_logger().warning("drift alarm at look %s (%s): notified ok=%s", lk.get("look"),
                                 ", ".join(lk["alarms"]), res.get("ok"))
    return sent


def first_alarms_of(look: dict) -> list[str]:
    """Metrics of a look that alarm there for the first time."""
    first = look.get("first_alarm") or {}
    return [m for m in look.get("alarms") or [] if first.get(m) == look.get("look")]


@task(name="raise_label_requests", **_STORAGE_TASK)
def raise_label_requests(results_uri: str, cfg: Any, looks: list[dict], anchor_ids: list[str],
                         evaluation: str | None, evaluation_logs_uri: str | None, config: dict) -> dict:
    """`flows.label_requests.requests.raise_drift_requests` for every look with a first alarm of a metric.

    Traffic rows come from the linked evaluation's latest published run (its window and
    logs); without one the request holds anchors only and records why.
    """
    from flows.label_requests.requests import raise_drift_requests
    from flows.storage.publish import read_latest

    logger = get_run_logger()
    latest = read_latest(Storage.for_uri(results_uri, cfg), evaluation) if evaluation else None
    reason = None
    if evaluation is None:
        reason = "the drift monitor has no linked evaluation"
    elif latest is None or latest.get("result") is None:
        reason = f"evaluation {evaluation!r} has no published result under {results_uri} yet"
    elif not evaluation_logs_uri:
        reason = (f"the logs of evaluation {evaluation!r} are unknown: declare it in the same evaluations file "
                  "as the monitor, or pass evaluation_logs_uri")
    out: dict[str, list] = {"requests": [], "skipped": []}
    for lk in looks:
        got = raise_drift_requests(cfg, results_uri, lk, anchor_ids, evaluation=evaluation,
                                   latest=latest if reason is None else None,
                                   logs_uri=evaluation_logs_uri if reason is None else None, config=config,
                                   no_traffic_reason=reason)
        out["requests"] += got["requests"]
        out["skipped"] += [dict(s, look=lk.get("look")) for s in got["skipped"]]
        for m in got["requests"]:
            logger.warning("drift look %s: label request %s for %d traffic row(s) and %d anchor(s) (%s)",
                           lk.get("look"), m["request_id"], len(m["rows"]), len(m["anchors"]),
                           m["drift"]["traffic"])
    return out


def _request_summary(m: dict) -> dict:
    """The label request fields the drift summary lists (the manifest itself is in storage)."""
    return {"request_id": m["request_id"], "uri": m.get("uri"), "scope": m["scope"], "evaluation": m["evaluation"],
            "window": m["window"], "n_labels": m["n_labels"], "n_rows": len(m["rows"]),
            "n_anchors": len(m["anchors"]), "look": (m.get("drift") or {}).get("look"),
            "judge_id": (m.get("drift") or {}).get("judge_id"), "alarms": (m.get("drift") or {}).get("alarms"),
            "traffic": (m.get("drift") or {}).get("traffic"), "deadline": m["deadline"],
            "reasons": [{"trigger": r["trigger"], "reason": r["reason"]} for r in m["reasons"]]}


@task(name="write_report", **_STORAGE_TASK)
def write_report(drift_uri: str, cfg: Any, monitor: str, state: dict) -> str:
    st = Storage.for_uri(drift_uri, cfg)
    history = read_looks(st, monitor)
    key = state_prefix(monitor) + "report.html"
    st.write_bytes(key, render_drift_report(history, state=state).encode("utf-8"))
    return st.url(key)


# --------------------------------------------------------------------------------------
# the flow


def _flow_run_id() -> str | None:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else None


def _parse_ts(value: str | None) -> datetime:
    if value in (None, ""):
        return datetime.now(timezone.utc)
    try:
        ts = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise CJEInputError(f"scored_at {value!r} is not an ISO timestamp", column="scored_at") from None
    return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)


@flow(name="drift", log_prints=False, validate_parameters=True)
def drift(
    set_name: str,
    anchors_uri: str,
    logs_uri: str | None = None,
    drift_uri: str | None = None,
    judge_id: str | None = None,
    scorer: dict[str, Any] | None = None,
    reference: str = "first",
    replicate: str | None = "next",
    anchors_version: int | None = None,
    evaluation: str | None = None,
    results_uri: str | None = None,
    monitor: dict[str, Any] | None = None,
    monitor_name: str | None = None,
    through: str | None = None,
    scored_at: str | None = None,
    notify_on: str = "new",
    webhook_url: str | None = None,
    retry_delays: list[float] | None = None,
    evaluation_logs_uri: str | None = None,
    labels_uri: str | None = None,
    label_requests: dict[str, Any] | None = None,
) -> dict:
    """Judge drift on an anchor set: new looks against the reference, persisted, alarms notified.

    Parameters
    ----------
    set_name : str
        Anchor set (``anchors/<set_name>/``, scores under ``anchor_scores/<set_name>/``).
    anchors_uri : str
        Storage root holding ``anchors/`` (``s3://bucket/prefix`` or a local folder).
    logs_uri : str, optional
        Root holding ``anchor_scores/`` (default ``anchors_uri``).
    drift_uri : str, optional
        Root for ``drift/<monitor>/`` (default ``anchors_uri``).
    judge_id : str, optional
        Judge (version) id written with the scores the flow produces itself; needed with ``scorer``.
    scorer : dict, optional
        `flows.integrations.scorer.OpenAIChatScorer.from_config` settings (``base_url``, ``model``,
        ``api_key_env``, ...). Given: the flow first re-scores every anchor (a new look dated
        ``scored_at``). The key itself is read from the environment variable, never passed.
    reference : str
        ``"first"``, ``"judge:<judge_id>"`` or ``"YYYY-MM-DD/<judge_id>"`` (frozen at the first run).
    replicate : str or None
        ``"next"``, a look key, or None (tau-b then reports without alarming).
    anchors_version : int, optional
        Anchor set version (default: the latest).
    evaluation : str, optional
        Evaluation whose latest published result supplies the calibration (residual metrics).
    results_uri : str, optional
        Root of ``results/`` (default ``anchors_uri``).
    monitor : dict, optional
        `cje_engine.drift.monitor.DriftMonitor` options (``alpha``, ``horizon``, ``weights``, ...);
        fixed when the monitor starts.
    monitor_name : str, optional
        Name of the monitor's folder (default ``set_name``).
    through : str, optional
        Last date (``YYYY-MM-DD``) of score partitions considered (default: today, UTC).
    scored_at : str, optional
        Timestamp of the flow's own scoring (default now).
    notify_on : {"new", "every"}
        Notify looks whose alarm includes a metric alarming for the first time, or every alarming look.
    webhook_url : str, optional
        Passed to `flows.integrations.notify.notify` (default ``$CJE_WEBHOOK_URL``).
    retry_delays : list of float, optional
        Backoff between retries of storage and scoring steps (default 2, 10, 30 s).
    evaluation_logs_uri : str, optional
        Logs of ``evaluation`` (its ``logs_uri``): a drift alarm requests fresh labels on their
        recent traffic. Without it (or without a published result) the request holds anchors only.
    labels_uri : str, optional
        The evaluation's label store (default ``evaluation_logs_uri``): rows labelled already are
        not requested.
    label_requests : dict, optional
        The evaluation's `flows.label_requests.requests.RequestConfig` settings (sizes, budget per
        period, ``requests_uri``; default: requests under ``results_uri``).

    Returns
    -------
    dict
        ``set_name``, ``monitor``, ``n_looks``, ``new_looks`` (look dicts), ``alarm`` (any new
        look alarmed), ``alarms``, ``first_alarm``, ``state_key``, ``look_keys``, ``report``,
        ``notifications``, ``scored``, ``waiting``, ``reference``, ``replicate``,
        ``label_requests`` (requests raised by this run), ``label_requests_skipped`` (with reasons)
        and ``label_requests_error`` (None unless raising them failed).
    """
    logger = get_run_logger()
    check_name(set_name)
    name = check_name(monitor_name or set_name, "monitor name")
    if notify_on not in ("new", "every"):
        raise CJEInputError(f"notify_on must be 'new' or 'every', got {notify_on!r}", column="notify_on")
    if scorer is not None and not judge_id:
        raise CJEInputError("judge_id is required with a scorer: it labels the scores the flow writes",
                            column="judge_id")
    options = dict(monitor or {})
    DriftMonitor(**options)  # early, clear error on bad options
    from flows.label_requests.requests import RequestConfig

    req_config = RequestConfig.from_dict(label_requests).to_dict()  # bad settings fail before any work
    req_config["labels_uri"] = req_config["labels_uri"] or labels_uri or evaluation_logs_uri
    req_config["webhook_url"] = req_config["webhook_url"] or webhook_url
    logs_uri = logs_uri or anchors_uri
    drift_uri = drift_uri or anchors_uri
    results_uri = results_uri or anchors_uri
    cfg = StorageConfig.from_env()  # the driver's environment; never a flow parameter
    delays = list(retry_delays) if retry_delays is not None else list(DEFAULT_RETRY_DELAYS)
    retry = dict(retries=len(delays), retry_delay_seconds=delays or [0.0])
    through_date = (datetime.now(timezone.utc).date().isoformat() if through in (None, "")
                    else _as_iso_date(through))
    run_id = _flow_run_id()

    anchors = load_anchors.with_options(**retry)(anchors_uri, quote(cfg), set_name, anchors_version)
    scored = None
    if scorer is not None:
        ts = _parse_ts(scored_at)
        basename = f"judge-{ts.strftime('%Y%m%dT%H%M%S')}-{(run_id or os.urandom(4).hex())[:8]}"
        scored = score_anchors.with_options(**retry)(logs_uri, quote(cfg), quote(anchors), scorer, judge_id, ts,
                                                     basename)
        through_date = max(through_date, ts.date().isoformat())
    state = load_state_task.with_options(**retry)(drift_uri, quote(cfg), name)
    repaired = (state or {}).pop("_repaired", []) if state else []
    since, extra = None, []
    if state is not None and state.get("reference"):
        processed = state.get("processed") or []
        since = max([k[:10] for k in processed] or [state["reference"]["dt"]])
        extra = [state["reference"]["dt"]] + ([state["replicate"]["look_key"][:10]]
                                              if (state.get("replicate") or {}).get("look_key") else [])
    looks = load_scores.with_options(**retry)(logs_uri, quote(cfg), set_name, anchors.anchor_ids, since, extra,
                                              through_date)
    calibration = (load_calibration.with_options(**retry)(results_uri, quote(cfg), evaluation)
                   if evaluation else None)
    outcome = update(quote(state), quote(looks), quote(anchors), set_name=set_name, monitor_name=name,
                     monitor_options=options, reference=reference, replicate=replicate,
                     calibration=calibration, scored=scored, flow_run_id=run_id)
    if outcome.late_looks:
        logger.warning("ignored %d look(s) dated before the last processed look: %s", len(outcome.late_looks),
                       ", ".join(outcome.late_looks[:5]))
    if outcome.waiting:
        logger.info("drift monitor %s: %s", name, outcome.waiting)
    committed: dict = {"state_key": (state or {}).get("_key"), "look_keys": []}
    if outcome.changed:
        committed = commit.with_options(**retry)(drift_uri, quote(cfg), name, quote(outcome.state),
                                                 quote(outcome.new_looks))
    st = Storage.for_uri(drift_uri, cfg)
    to_notify = list(repaired) + list(outcome.new_looks)
    urls = {int(lk["look"]): {"look": st.url(f"{state_prefix(name)}looks/{int(lk['look']):06d}.json"),
                              "report": st.url(state_prefix(name) + "report.html")} for lk in to_notify}
    notifications = notify_alarms(quote(to_notify), name, urls, evaluation, notify_on, webhook_url)
    # a first alarm of a metric raises a label request (anchors + recent traffic), deduplicated per look
    alarming = [lk for lk in to_notify if first_alarms_of(lk)]
    raised: dict = {"requests": [], "skipped": []}
    request_error = None
    if alarming:
        try:
            raised = raise_label_requests.with_options(**retry)(results_uri, quote(cfg), quote(alarming),
                                                                anchors.anchor_ids, evaluation,
                                                                evaluation_logs_uri, req_config)
        except Exception as exc:  # noqa: BLE001 - the looks are committed; report, do not fail the monitor
            logger.error("label requests for the drift alarm of monitor %s failed: %s", name, exc)
            request_error = f"{type(exc).__name__}: {exc}"
    report = None
    if outcome.state["monitor"]["n_looks"] > 0:
        report = write_report.with_options(**retry)(drift_uri, quote(cfg), name, quote(outcome.state))
    mon = outcome.state["monitor"]
    new_alarms = [lk for lk in outcome.new_looks if lk["alarm"]]
    summary = {
        "set_name": set_name, "monitor": name, "n_looks": mon["n_looks"], "new_looks": outcome.new_looks,
        "alarm": bool(new_alarms), "alarms": sorted({m for lk in new_alarms for m in lk["alarms"]}),
        "first_alarm": mon["first_alarm"], "state_key": committed.get("state_key"),
        "look_keys": committed.get("look_keys", []), "report": report, "notifications": notifications,
        "scored": scored, "waiting": outcome.waiting, "late_looks": outcome.late_looks,
        "reference": outcome.state.get("reference"), "replicate": outcome.state.get("replicate"),
        "anchors_version": anchors.version,
        "label_requests": [_request_summary(m) for m in raised["requests"]],
        "label_requests_skipped": raised["skipped"], "label_requests_error": request_error,
    }
    logger.info("drift monitor %s: %d new look(s), %d in total, alarm=%s %s", name, len(outcome.new_looks),
                mon["n_looks"], summary["alarm"], summary["alarms"] or "")
    return drift_artifacts(summary)  # Prefect artifacts: flows/reports/artifacts.py


def _as_iso_date(value: Any) -> str:
    from flows.storage.logs import as_date

    return as_date(value, "through").isoformat()


# --------------------------------------------------------------------------------------
# the report


def _threshold(m: dict) -> tuple[float | None, float | None]:
    """Alarm thresholds of a CI metric at its look: ``null -/+ half-width of ci_anytime``."""
    ci = m.get("ci_anytime")
    null = m.get("null_value")
    if not ci or ci[0] is None or ci[1] is None or null is None:
        return None, None
    half = (ci[1] - ci[0]) / 2.0
    return null - half, null + half


def _panel(rep: Any, xs: list[int], labels: list[str], series: dict, title: str, ylab: str, note: str,
           judge_changes: list[tuple[int, str]], width: int = 1040) -> str:
    """One timeline panel: estimate (line+dots), fixed-sample CIs, per-look alarm thresholds."""
    est, lo_ci, hi_ci = series["estimate"], series["ci_lo"], series["ci_hi"]
    thr_lo, thr_hi, alarm, base = series["thr_lo"], series["thr_hi"], series["alarm"], series.get("baseline")
    n = len(xs)
    L, W, T, H = 80, width - 80 - 40, 34, 190
    rotate = n > 12
    xlab_h = 62 if rotate else 34
    height = T + H + xlab_h + 8
    vals = [v for arr in (est, lo_ci, hi_ci, thr_lo, thr_hi, base or []) for v in arr if v is not None]
    if not vals:
        return ""
    vlo, vhi = min(vals), max(vals)
    pad = 0.06 * (vhi - vlo or 1.0)
    ylo, yhi, yt, yd = rep._ticks(vlo - pad, vhi + pad, 5)
    sx = rep._Lin(-0.5, n - 0.5, L, L + W)
    sy = rep._Lin(ylo, yhi, T + H, T)
    b: list[str] = [rep._text(L, T - 14, title, fill=rep.INK, font_size="13", font_weight="600")]
    if note:
        b.append(rep._text(L + W, T - 14, note, fill=rep.MUTED, font_size="11", text_anchor="end"))
    # no-alarm band between the thresholds of each look
    for i in range(n):
        if thr_lo[i] is not None and thr_hi[i] is not None:
            x0, x1 = sx(i - 0.5), sx(i + 0.5)
            b.append(rep._el("rect", x=x0, y=sy(min(thr_hi[i], yhi)), width=x1 - x0,
                             height=max(0.0, sy(max(thr_lo[i], ylo)) - sy(min(thr_hi[i], yhi))),
                             fill=rep.GREEN, fill_opacity="0.09"))
    b += rep._y_axis(sy, yt, yd, L, L + W, ylab)
    for i, j in judge_changes:
        x = sx(i - 0.5)
        b.append(rep._line(x, T, x, T + H, stroke=rep.PURPLE, stroke_width="1.2", stroke_dasharray="2 3"))
        b.append(rep._text(x + 4, T + 11, f"judge {j}", fill=rep.PURPLE, font_size="10.5"))
    if base is not None:
        pts = [(i, v) for i, v in enumerate(base) if v is not None]
        if pts:
            b.append(rep._el("polyline", points=" ".join(f"{rep._r(sx(i))},{rep._r(sy(v))}" for i, v in pts),
                             fill="none", stroke=rep.GREY, stroke_width="1.5", stroke_dasharray="4 3"))
    for arr in (thr_lo, thr_hi):  # stepped threshold lines (they widen as the budget per look shrinks)
        for i, v in enumerate(arr):
            if v is not None and ylo <= v <= yhi:
                b.append(rep._line(sx(i - 0.45), sy(v), sx(i + 0.45), sy(v), stroke=rep.VERMILLION,
                                   stroke_width="1.6", stroke_dasharray="5 3"))
    for i in range(n):
        if lo_ci[i] is not None and hi_ci[i] is not None:
            b.append(rep._line(sx(i), sy(lo_ci[i]), sx(i), sy(hi_ci[i]), stroke=rep.SKY, stroke_width="2"))
    segs: list[list[str]] = [[]]
    for i, v in enumerate(est):
        if v is None:
            segs.append([])
        else:
            segs[-1].append(f"{rep._r(sx(i))},{rep._r(sy(v))}")
    for seg in segs:
        if len(seg) > 1:
            b.append(rep._el("polyline", points=" ".join(seg), fill="none", stroke=rep.BLUE, stroke_width="2"))
    for i, v in enumerate(est):
        if v is None:
            continue
        if alarm[i]:
            b.append(rep._diamond(sx(i), sy(v), 7, fill=rep.VERMILLION, stroke="#fff"))
        else:
            b.append(rep._el("circle", cx=sx(i), cy=sy(v), r="4", fill=rep.BLUE, stroke="#fff"))
    b.append(rep._line(L, T + H, L + W, T + H, stroke=rep.MUTED, stroke_width="1"))
    step = max(1, math.ceil(n / 40))
    for i, lab in enumerate(labels):
        if i % step and i != n - 1:
            continue
        x, ty = sx(i), T + H + 16
        b.append(rep._line(x, T + H, x, T + H + 4, stroke=rep.MUTED))
        if rotate:
            b.append(rep._el("text", rep._esc(lab), x=float(x), y=float(ty), text_anchor="end", fill=rep.MUTED,
                             font_size="10.5", transform=f"rotate(-40 {rep._r(x)} {rep._r(ty)})"))
        else:
            b.append(rep._text(x, ty, lab, text_anchor="middle", fill=rep.MUTED, font_size="10.5"))
    return rep._svg(width, height, b, title)


def _series(history: list[dict], metric: str) -> dict:
    out: dict[str, list] = {k: [] for k in ("estimate", "ci_lo", "ci_hi", "thr_lo", "thr_hi", "alarm")}
    for lk in history:
        m = (lk.get("metrics") or {}).get(metric) or {}
        ci = m.get("ci") or [None, None]
        lo, hi = _threshold(m)
        out["estimate"].append(m.get("estimate"))
        out["ci_lo"].append(ci[0])
        out["ci_hi"].append(ci[1])
        out["thr_lo"].append(lo)
        out["thr_hi"].append(hi)
        out["alarm"].append(bool(m.get("alarm")))
    return out


def _tau_series(history: list[dict]) -> dict:
    """tau(reference, current) with thresholds moved onto the tau scale around the baseline."""
    out: dict[str, list] = {k: [] for k in ("estimate", "ci_lo", "ci_hi", "thr_lo", "thr_hi", "alarm", "baseline")}
    for lk in history:
        m = (lk.get("metrics") or {}).get("tau_b") or {}
        d = m.get("detail") or {}
        tau = d.get("tau")
        ci = d.get("tau_ci") or [None, None]
        base = d.get("tau_baseline") if d.get("comparison") == "reference_replicate" else (
            m.get("null_value") if d.get("comparison") == "tau_floor" else None)
        lo, hi = _threshold(m)
        if d.get("comparison") == "reference_replicate" and lo is not None and base is not None:
            lo, hi = base + lo, base + hi  # metric = tau - baseline; null 0
        out["estimate"].append(tau)
        out["ci_lo"].append(ci[0])
        out["ci_hi"].append(ci[1])
        out["thr_lo"].append(lo)
        out["thr_hi"].append(hi)
        out["alarm"].append(bool(m.get("alarm")))
        out["baseline"].append(base)
    return out


def render_drift_report(history: Sequence[dict], *, state: dict | None = None, title: str | None = None) -> str:
    """A self-contained HTML page (inline CSS and SVG) with the drift timeline of a monitor.

    Parameters
    ----------
    history : list of dict
        ``DriftLook.to_dict()`` of every look, in look order (`read_looks`).
    state : dict, optional
        The monitor's state (reference, replicate, monitor configuration) for the header.
    title : str, optional

    Panels: Kendall tau-b of reference vs current scores (with the reference's test-retest
    baseline), the mean residual shift on labelled anchors, the calibration-loss change and the
    paired mean score shift; each with the fixed-sample interval of the look (light bars) and the
    look's alarm thresholds (dashed: ``null -/+ t quantile(alpha spent) x SE``; they widen over
    looks as the per-look budget shrinks). Alarms are diamonds.
    """
    from flows.reports import evaluation as rep

    history = [h for h in history if isinstance(h, dict)]
    if not history:
        raise CJEInputError("no looks to report", source="drift history")
    for i, h in enumerate(history):
        if not isinstance(h.get("metrics"), dict) or "look" not in h:
            raise CJEInputError("each look needs 'look' and 'metrics' (DriftLook.to_dict())",
                                source="drift history", row=i)
    state = state or {}
    meta0 = history[0].get("meta") or {}
    set_name = meta0.get("set_name") or state.get("set_name") or "?"
    monitor = meta0.get("monitor") or state.get("monitor_name") or set_name
    page_title = title or f"Judge drift: anchor set {set_name}"
    labels = [f"#{h['look']} {(h.get('meta') or {}).get('dt', '')}".strip() for h in history]
    judges = [(h.get("meta") or {}).get("judge_id") for h in history]
    ref_judge = (state.get("reference") or {}).get("judge_id") or meta0.get("reference_look", "/").split("/", 1)[-1]
    changes = [(i, j) for i, j in enumerate(judges) if j is not None and j != (judges[i - 1] if i else ref_judge)]
    cfg = (state.get("monitor") or {}).get("config") or {}
    alpha = history[-1].get("alpha", cfg.get("alpha", 0.05))
    horizon = cfg.get("horizon")
    spending = ("alpha/(t(t+1)) per look (unbounded)" if horizon is None else f"alpha/{horizon} per look "
                f"(horizon {horizon} looks)")
    last = history[-1]
    first_alarm = last.get("first_alarm") or {}
    alarmed = {m: v for m, v in first_alarm.items() if v is not None}
    xs = list(range(len(history)))

    panels = []
    tau = _tau_series(history)
    tau_note = ("baseline: tau(reference, replicate), grey" if any(v is not None for v in tau["baseline"])
                else "no replicate or floor: tau-b cannot alarm")
    panels.append(_panel(rep, xs, labels, tau, "Kendall \u03c4-b, reference vs current judge scores", "\u03c4-b",
                         tau_note, changes))
    for metric, title_, ylab, note in (
            ("residual_mean", "Mean residual shift on labelled anchors (oracle scale)", "shift",
             "below 0: the judge now scores higher; levels calibrated before would be biased up"),
            ("calibration_loss", "Calibration loss change, MSE current \u2212 reference", "\u0394 MSE",
             "above 0: the old calibration fits the judge's scores worse"),
            ("mean_shift", "Paired mean shift of judge scores", "shift", "current \u2212 reference, per anchor")):
        s = _series(history, metric)
        if any(v is not None for v in s["estimate"]):
            panels.append(_panel(rep, xs, labels, s, title_, ylab, note, changes))
        else:
            why = ((history[-1]["metrics"].get(metric) or {}).get("note") or "not computed")
            panels.append(f"<p class='note'><b>{rep._esc(title_)}</b>: not computed ({rep._esc(why)}).</p>")
    legend = rep._svg(1040, 26, rep._legend([
        (rep._el("circle", cx=0.0, cy=0.0, r="4", fill=rep.BLUE), "estimate"),
        (rep._line(0, -7, 0, 7, stroke=rep.SKY, stroke_width="2"), f"{100 * (1 - alpha):g}% interval (this look)"),
        (rep._line(-9, 0, 9, 0, stroke=rep.VERMILLION, stroke_dasharray="5 3"), "alarm threshold (anytime)"),
        (rep._el("rect", x=-8.0, y=-6.0, width="16", height="12", fill=rep.GREEN, fill_opacity="0.2"), "no alarm"),
        (rep._diamond(0, 0, 6, fill=rep.VERMILLION), "alarm"),
        (rep._line(0, -7, 0, 7, stroke=rep.PURPLE, stroke_dasharray="2 3"), "judge changed"),
    ], 84, 14, gap=22), "Legend")

    sep = " \u00b7 "
    look_label = {h["look"]: lab for h, lab in zip(history, labels)}
    if alarmed:
        first = min(alarmed.values())
        status = (f"<div class='item bad'><p><b>Drift alarm</b> since look "
                  f"{rep._esc(look_label.get(first, first))}: "
                  + ", ".join(f"{rep._esc(m)} (first at look {v})" for m, v in sorted(alarmed.items(), key=lambda t: t[1]))
                  + ". Fresh oracle labels on the anchors and on recent traffic are needed before levels "
                  "calibrated with the old judge are trusted.</p></div>")
    else:
        status = (f"<div class='item ok'><p>No drift alarm in {len(history)} look(s). Family-wise false-alarm "
                  f"rate over all looks and metrics \u2264 {rep._fmt(alpha, 2)}.</p></div>")
    ref = state.get("reference") or {}
    repl = state.get("replicate") or {}
    cal = meta0.get("calibration") or (last.get("meta") or {}).get("calibration")
    facts = [
        f"reference look <b>{rep._esc(ref.get('look_key') or meta0.get('reference_look'))}</b>",
        f"replicate <b>{rep._esc(repl.get('look_key') or meta0.get('replicate_look') or 'none')}</b>",
        f"{rep._esc(last.get('n_anchors'))} paired anchors, {rep._esc(last.get('n_labelled'))} labelled",
        f"anchor set v{rep._esc((last.get('meta') or {}).get('anchors_version'))}",
        f"alpha {rep._fmt(alpha, 2)}, spent {rep._esc(spending)}, split equally over "
        f"{len(METRICS)} metrics" if not cfg.get("weights") or len(set(cfg["weights"].values())) == 1
        else f"alpha {rep._fmt(alpha, 2)}, spent {rep._esc(spending)}, weights {rep._esc(cfg['weights'])}",
        ("calibration: " + rep._esc(f"{cal.get('evaluation')} {cal.get('window')} ({cal.get('mode')})")) if cal
        else ("calibration supplied by the caller" if (last["metrics"].get("residual_mean") or {}).get("estimate")
              is not None else "no calibration: residual metrics skipped"),
    ]
    rows = []
    for h in history:
        ms = h["metrics"]
        meta = h.get("meta") or {}

        def cell(m: str, digits: int = 3) -> str:
            d = ms.get(m) or {}
            v = d.get("estimate")
            if v is None:
                return "<td class='num r muted'>\u2013</td>"
            cls = " sig" if d.get("alarm") else ""
            return (f"<td class='num r{cls}' title='p={rep._fmt_p(d.get('p_value'))}, alpha spent="
                    f"{d.get('alpha_spent', 0):.2g}'>{rep._signed(v, digits)}</td>")

        tdet = (ms.get("tau_b") or {}).get("detail") or {}
        rows.append(
            f"<tr class='{'alarm' if h.get('alarm') else ''}'><td class='num'>{rep._esc(h['look'])}</td>"
            f"<td>{rep._esc(meta.get('dt', ''))}</td><td>{rep._name_cell(meta.get('judge_id', ''))}</td>"
            f"<td class='num r'>{rep._esc(h.get('n_anchors'))}</td>"
            f"<td class='num r'>{rep._fmt(tdet.get('tau'))}</td>{cell('tau_b')}{cell('residual_mean')}"
            f"{cell('calibration_loss', 4)}{cell('mean_shift')}"
            f"<td class='num r'>{rep._fmt((ms.get('distribution') or {}).get('estimate'))}</td>"
            f"<td>{rep._esc(', '.join(h.get('alarms') or []) or 'none')}</td></tr>")
    table = ("<div class='scroll'><table class='data'><thead><tr><th>look</th><th>date</th><th>judge</th>"
             "<th class='r'>anchors</th><th class='r'>\u03c4-b</th><th class='r'>\u03c4 \u2212 baseline</th>"
             "<th class='r'>residual shift</th><th class='r'>\u0394 loss</th><th class='r'>mean shift</th>"
             "<th class='r'>KS</th><th>alarms</th></tr></thead><tbody>" + "".join(rows)
             + "</tbody></table></div><p class='note'>Bold purple values alarmed at that look; hover a value for "
             "its p-value and the alpha it was allowed to spend.</p>")
    css = rep.CSS + "\n.facts b{font-weight:600}\n.summary .item p{margin:4px 0}\n"
    parts = [
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{rep._esc(page_title)}</title><style>{css}</style></head><body><main>",
        f"<header class='top'><h1>{rep._esc(page_title)}</h1><div class='meta'>monitor "
        f"{rep._esc(monitor)} \u00b7 {len(history)} look(s) \u00b7 latest "
        f"{rep._esc((last.get('meta') or {}).get('dt', ''))} by judge {rep._esc((last.get('meta') or {}).get('judge_id', ''))}"
        "</div></header>",
        f"<section class='summary' id='status'><h2>Status</h2>{status}"
        f"<p class='facts'>{sep.join(facts)}</p></section>",
        "<section id='timeline'><h2>Timeline</h2><p class='lead'>Each look compares the judge's current scores "
        "of the anchors with the reference scores, anchor by anchor. Alarms keep a family-wise error rate "
        f"\u2264 {rep._fmt(alpha, 2)} over all looks and metrics: every look spends a fixed share of alpha "
        "(union bound), so its alarm thresholds (dashed) lie further out than a single test's and widen as "
        "looks accumulate. A value outside the green band alarms.</p>"
        f"<div class='figure'>{legend}</div>" + "".join(f"<div class='figure'>{p}</div>" for p in panels)
        + "</section>",
        f"<section id='looks'><h2>Looks</h2>{table}</section>",
        "<footer><p class='stamp'>Statistics: cje_engine.drift.monitor (docs/drift.md) \u00b7 report generated "
        f"{rep._esc(datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))} \u00b7 self-contained "
        "(no external resources)</p></footer>",
        "</main></body></html>",
    ]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------
# declarations (evaluations.yaml: drift_monitors) and schedules

_SPEC_KEYS = {"name", "set_name", "anchors_uri", "logs_uri", "drift_uri", "results_uri", "evaluation", "judge_id",
              "scorer", "reference", "replicate", "anchors_version", "monitor", "cron", "interval", "timezone",
              "notify_on", "description"}


@dataclass(frozen=True)
class DriftMonitorSpec:
    """One drift monitor declared under ``drift_monitors:`` in evaluations.yaml."""

    name: str
    set_name: str
    anchors_uri: str
    logs_uri: str | None = None
    drift_uri: str | None = None
    results_uri: str | None = None
    evaluation: str | None = None
    judge_id: str | None = None
    scorer: dict | None = None
    reference: str = "first"
    replicate: str | None = "next"
    anchors_version: int | None = None
    monitor: dict = field(default_factory=dict)
    cron: str | None = None
    interval: float | None = None
    timezone: str = "UTC"
    notify_on: str = "new"
    description: str = ""
    #: from the linked evaluation declared in the same file (`flows.runtime.schedules.EvaluationSpec`)
    evaluation_logs_uri: str | None = None
    labels_uri: str | None = None
    label_requests: dict | None = None

    def flow_parameters(self) -> dict[str, Any]:
        """Parameters of the `drift` flow for this monitor."""
        return {"set_name": self.set_name, "anchors_uri": self.anchors_uri, "logs_uri": self.logs_uri,
                "drift_uri": self.drift_uri, "results_uri": self.results_uri, "evaluation": self.evaluation,
                "judge_id": self.judge_id, "scorer": dict(self.scorer) if self.scorer else None,
                "reference": self.reference, "replicate": self.replicate, "anchors_version": self.anchors_version,
                "monitor": dict(self.monitor), "monitor_name": self.name, "notify_on": self.notify_on,
                "evaluation_logs_uri": self.evaluation_logs_uri, "labels_uri": self.labels_uri,
                "label_requests": dict(self.label_requests) if self.label_requests else None}

    def to_deployment(self):
        """A Prefect ``RunnerDeployment`` of the `drift` flow on this monitor's schedule."""
        from datetime import timedelta

        from prefect.types.entrypoint import EntrypointType

        kwargs: dict[str, Any] = {}
        if self.cron:
            from prefect.schedules import Cron

            kwargs["schedule"] = Cron(self.cron, timezone=self.timezone)
        elif self.interval:
            kwargs["interval"] = timedelta(seconds=float(self.interval))
        return drift.to_deployment(
            name=f"drift-{self.name}", entrypoint_type=EntrypointType.MODULE_PATH,
            parameters=self.flow_parameters(),
            description=self.description or f"Judge drift on anchor set {self.set_name}", tags=["cje", "drift"],
            **kwargs)


def _resolve(uri: Any, base: Path, where: str, src: str) -> str | None:
    if uri is None:
        return None
    if not isinstance(uri, str) or not uri.strip():
        raise CJEInputError(f"{where} must be a non-empty string, got {uri!r}", source=src)
    uri = os.path.expanduser(uri.strip())
    if "://" in uri:
        return uri
    p = Path(uri)
    return str(p if p.is_absolute() else (base / p).resolve())


def load_drift_monitors(path: str | os.PathLike | None = None) -> dict[str, DriftMonitorSpec]:
    """Read ``drift_monitors:`` of an evaluations file (default: the repository's).

    Relative local paths are resolved against the file's folder. A file without the key has no
    monitors (empty dict). Errors name the file, the entry and the key. A monitor whose
    ``evaluation`` is declared under ``evaluations:`` of the same file takes that evaluation's
    ``logs_uri``, ``labels_uri`` and ``label_requests`` (drift alarms request labels on its recent
    traffic) and, when it gives no ``results_uri``, the evaluation's results root.
    """
    import yaml

    from flows.runtime.schedules import DEFAULT_FILE, check_schedule

    path = Path(path) if path is not None else DEFAULT_FILE
    src = str(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise CJEInputError("evaluations file not found", source=src) from None
    except yaml.YAMLError as exc:
        raise CJEInputError(f"not valid YAML: {exc}", source=src) from None
    entries = (doc or {}).get("drift_monitors") if isinstance(doc, dict) else None
    if entries is None:
        return {}
    if not isinstance(entries, list):
        raise CJEInputError("'drift_monitors:' must be a list of monitors", source=src, column="drift_monitors")
    base = path.resolve().parent
    evaluations: dict = {}
    if isinstance(doc, dict) and doc.get("evaluations") and any(
            isinstance(e, dict) and e.get("evaluation") for e in entries):
        from flows.runtime.schedules import load_evaluations

        evaluations = load_evaluations(path)
    out: dict[str, DriftMonitorSpec] = {}
    for i, e in enumerate(entries):
        where = f"drift_monitors[{i}]"
        if not isinstance(e, dict):
            raise CJEInputError(f"{where} must be a mapping", source=src)
        unknown = sorted(set(e) - _SPEC_KEYS)
        if unknown:
            raise CJEInputError(f"{where} has unknown key(s) {unknown}; expected some of {sorted(_SPEC_KEYS)}",
                                source=src)
        set_name = e.get("set_name")
        try:
            check_name(set_name)
            name = check_name(e.get("name", set_name), "monitor name")
        except CJEInputError as exc:
            raise CJEInputError(f"{where}: {exc}", source=src) from None
        where = f"drift monitor {name!r}"
        if name in out:
            raise CJEInputError(f"{where} is declared twice", source=src)
        if not e.get("anchors_uri"):
            raise CJEInputError(f"{where} needs anchors_uri", source=src)
        check_schedule(e, where, src)
        interval = e.get("interval")
        monitor = e.get("monitor") or {}
        scorer = e.get("scorer")
        try:
            if not isinstance(monitor, dict):
                raise CJEInputError("monitor must be a mapping of DriftMonitor options")
            DriftMonitor(**monitor)
            if scorer is not None:
                from flows.integrations.scorer import OpenAIChatScorer

                OpenAIChatScorer.from_config(scorer)
                if not e.get("judge_id"):
                    raise CJEInputError("judge_id is required with a scorer")
            if e.get("notify_on", "new") not in ("new", "every"):
                raise CJEInputError("notify_on must be 'new' or 'every'")
            ref = str(e.get("reference", "first"))
            if ref != "first" and not ref.startswith("judge:") and not _LOOK_KEY_RE.match(ref):
                raise CJEInputError(f"reference {ref!r} must be 'first', 'judge:<id>' or 'YYYY-MM-DD/<judge_id>'")
        except TypeError as exc:
            raise CJEInputError(f"{where}: bad monitor option ({exc})", source=src) from None
        except CJEInputError as exc:
            raise CJEInputError(f"{where}: {exc}", source=src) from None
        version = e.get("anchors_version")
        if version is not None and (not isinstance(version, int) or version < 1):
            raise CJEInputError(f"{where}: anchors_version must be a positive integer", source=src)
        linked = evaluations.get(e.get("evaluation")) if e.get("evaluation") else None
        if e.get("evaluation") and linked is None:
            log.warning("%s: evaluation %r is not declared in %s; a drift alarm will request anchor labels only",
                        where, e.get("evaluation"), src)
        results_uri = _resolve(e.get("results_uri"), base, f"{where}.results_uri", src)
        if results_uri is None and linked is not None:
            results_uri = linked.results_uri or linked.logs_uri
        out[name] = DriftMonitorSpec(
            name=name, set_name=set_name,
            anchors_uri=_resolve(e["anchors_uri"], base, f"{where}.anchors_uri", src),
            logs_uri=_resolve(e.get("logs_uri"), base, f"{where}.logs_uri", src),
            drift_uri=_resolve(e.get("drift_uri"), base, f"{where}.drift_uri", src),
            results_uri=results_uri,
            evaluation_logs_uri=linked.logs_uri if linked else None,
            labels_uri=(linked.labels_uri or linked.logs_uri) if linked else None,
            label_requests=dict(linked.label_requests) if linked and linked.label_requests else None,
            evaluation=e.get("evaluation"), judge_id=e.get("judge_id"), scorer=dict(scorer) if scorer else None,
            reference=str(e.get("reference", "first")),
            replicate=None if e.get("replicate", "next") in (None, "none") else str(e.get("replicate", "next")),
            anchors_version=version, monitor=dict(monitor), cron=str(e["cron"]) if e.get("cron") else None,
            interval=float(interval) if interval is not None else None, timezone=str(e.get("timezone", "UTC")),
            notify_on=str(e.get("notify_on", "new")), description=str(e.get("description", "")))
    return out


def drift_deployments(path: str | os.PathLike | None = None, only: Sequence[str] | None = None) -> list:
    """Prefect deployments of the drift monitors declared in an evaluations file (for ``cje serve``)."""
    specs = load_drift_monitors(path)
    if only:
        unknown = [n for n in only if n not in specs]
        if unknown:
            raise CJEInputError(f"no drift monitor named {unknown[0]!r}; declared: {', '.join(sorted(specs))}")
        specs = {n: specs[n] for n in only}
    return [s.to_deployment() for s in specs.values()]


def run_drift(name: str, config_path: str | os.PathLike | None = None, **overrides: Any) -> dict:
    """Run one declared drift monitor now (``cje drift NAME``); ``overrides`` replace flow parameters.

    Needs a Prefect API (wrap in `flows.runtime.prefect_server.prefect_api`).
    """
    specs = load_drift_monitors(config_path)
    if name not in specs:
        raise CJEInputError(f"no drift monitor named {name!r}; declared: {', '.join(sorted(specs)) or 'none'}",
                            source=str(config_path or "evaluations.yaml"))
    params = specs[name].flow_parameters()
    params.update({k: v for k, v in overrides.items() if v is not None})
    return drift(**params)


def format_summary(summary: dict) -> str:
    """A few lines for the terminal (``cje drift``)."""
    lines = [f"drift monitor {summary['monitor']} (anchor set {summary['set_name']} "
             f"v{summary.get('anchors_version')}): {len(summary['new_looks'])} new look(s), "
             f"{summary['n_looks']} in total"]
    for lk in summary["new_looks"]:
        meta = lk.get("meta") or {}
        ests = ", ".join(f"{m}={lk['metrics'][m]['estimate']:+.3f}" for m in ("tau_b", "mean_shift", "residual_mean")
                         if (lk["metrics"].get(m) or {}).get("estimate") is not None)
        lines.append(f"  look {lk['look']} {meta.get('look_key')}: {'ALARM ' + ','.join(lk['alarms']) if lk['alarm'] else 'ok'}"
                     f" ({ests})")
    if summary.get("waiting"):
        lines.append(f"  {summary['waiting']}")
    for req in summary.get("label_requests") or []:
        lines.append(f"  label request {req['request_id']} (drift alarm at look {req.get('look')}, judge "
                     f"{req.get('judge_id')}: {', '.join(req.get('alarms') or [])}): {req['n_labels']} label(s) = "
                     f"{req['n_rows']} recent traffic row(s) + {req['n_anchors']} anchor(s)")
        if req.get("n_rows") == 0 and req.get("traffic"):
            lines.append(f"    traffic {req['traffic']}")
        if req.get("uri"):
            lines.append(f"    {req['uri']}")
    for s in summary.get("label_requests_skipped") or []:
        lines.append(f"  no label request for look {s.get('look')}: {s.get('reason')}")
    if summary.get("label_requests_error"):
        lines.append(f"  label requests FAILED: {summary['label_requests_error']}")
    first = {m: v for m, v in (summary.get("first_alarm") or {}).items() if v is not None}
    lines.append("  alarmed: " + (", ".join(f"{m} since look {v}" for m, v in first.items()) if first else "never"))
    if summary.get("report"):
        lines.append(f"report: {summary['report']}")
    return "\n".join(lines)


__all__ = ["drift", "render_drift_report", "load_drift_monitors", "drift_deployments", "run_drift",
           "DriftMonitorSpec", "load_state", "read_looks", "latest_look", "commit_state",
           "calibration_from_result", "DriftStateConflict", "format_summary"]
