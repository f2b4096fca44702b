"""Tasks of the `drift` flow (`flows.pipelines.drift`): storage reads, the monitor update, commit,
notifications, label requests and the report.

Storage tasks retry (unless the input is bad or a concurrent commit won); the pure tasks do not.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from cje_engine.drift.monitor import DriftMonitor
from cje_engine.errors import CJEInputError
from flows.config import LOOK_KEY_RE
from flows.label_requests.raising import raise_drift_requests
from flows.runtime.retries import DEFAULT_RETRY_DELAYS, PURE_TASK, storage_task_options
from flows.reports.drift import render_drift_report
from flows.storage.anchors import (AnchorSet, Look, read_anchor_scores, read_anchor_set, score_files, split_looks,
                                   write_anchor_scores)
from flows.storage.drift_state import (commit_state, load_state, read_looks, repair,
                                       state_prefix, STATE_FORMAT)
from flows.storage.objects import Storage

log = logging.getLogger(__name__)


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
# storage tasks


_STORAGE_TASK = storage_task_options(DEFAULT_RETRY_DELAYS)
_PURE_TASK = dict(PURE_TASK)


@task(name="load_anchors", **_STORAGE_TASK)
def load_anchors(anchors_uri: str, cfg: Any, set_name: str, version: int | None) -> AnchorSet:
    """Task: read the anchor set ``set_name`` (latest version when ``version`` is None) and log its size."""
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
    """Task: the monitor's stored state (None for a new monitor), with leftovers of an interrupted commit repaired."""
    st = Storage.for_uri(drift_uri, cfg)
    state = load_state(st, monitor)
    if state is not None:
        state["_repaired"] = repair(st, monitor, state)
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
    """Task: the calibration curve and its provenance from the latest published result of ``evaluation`` (None when there is none)."""
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


# --------------------------------------------------------------------------------------
# the monitor update


def _select(selector: str, looks: list[Look], what: str) -> Look | None:
    if selector == "first":
        return looks[0] if looks else None
    if selector.startswith("judge:"):
        judge = selector[len("judge:"):]
        return next((lk for lk in looks if lk.judge_id == judge), None)
    if LOOK_KEY_RE.match(selector):
        return next((lk for lk in looks if lk.key == selector), None)
    raise CJEInputError(f"{what} {selector!r} must be 'first', 'judge:<judge_id>' or a look key "
                        "'YYYY-MM-DD/<judge_id>'", column=what)


@dataclass
class UpdateOutcome:
    """What `update` did: the new state, its new looks, whether it changed, why it waits, and looks that arrived late."""
    state: dict
    new_looks: list[dict] = field(default_factory=list)
    changed: bool = False
    waiting: str | None = None
    late_looks: list[str] = field(default_factory=list)


def _start_state(state: dict | None, set_name: str, monitor_name: str, fresh: DriftMonitor) -> dict:
    """A new state, or the stored one checked against the anchor set and the monitor options."""
    now = datetime.now(timezone.utc).isoformat()
    if state is None:
        return {"format": STATE_FORMAT, "seq": 0, "set_name": set_name, "monitor_name": monitor_name,
                "monitor": fresh.to_dict(), "reference": None, "replicate": None, "processed": [],
                "created_at": now, "updated_at": now}
    state = {k: v for k, v in state.items() if not k.startswith("_") and k != "new_looks"}
    if state.get("set_name") != set_name:
        raise CJEInputError(f"monitor {monitor_name!r} watches anchor set {state.get('set_name')!r}, not "
                            f"{set_name!r}; use another monitor name", column="set_name")
    stored = DriftMonitor.from_dict(state["monitor"]).get_config()  # an old state reads with its own options
    if stored != fresh.get_config():
        raise CJEInputError(f"monitor options {fresh.get_config()} differ from the stored ones {stored}: the "
                            "error budget is fixed when a monitor starts; use another monitor name for new options",
                            column="monitor")
    return state


def _reference(out: UpdateOutcome, looks: list[Look], set_name: str, monitor_name: str, reference: str,
               replicate: str | None) -> Look | None:
    """The frozen reference look (chosen at the first run), checked against its fingerprint."""
    state = out.state
    ref_info = state.get("reference")
    if ref_info is None:
        ref = _select(reference, looks, "reference")
        if ref is None:
            out.waiting = f"no look matches reference {reference!r} yet"
            return None
        ref_info = {"selector": reference, "look_key": ref.key, "judge_id": ref.judge_id, "dt": ref.dt,
                    "fingerprint": ref.fingerprint(), "n_anchors": int(ref.scores.shape[0])}
        state["reference"] = ref_info
        state["replicate"] = None if replicate in (None, "none") else {"selector": replicate, "look_key": None}
        out.changed = True
    elif ref_info["selector"] != reference:
        raise CJEInputError(f"monitor {monitor_name!r} uses reference {ref_info['selector']!r} "
                            f"({ref_info['look_key']}), not {reference!r}; use another monitor name",
                            column="reference")
    ref = next((lk for lk in looks if lk.key == ref_info["look_key"]), None)
    if ref is None:
        raise CJEInputError(f"the reference look {ref_info['look_key']} has no score rows any more",
                            source=f"anchor_scores/{set_name}/dt={ref_info['dt']}/")
    if ref.fingerprint() != ref_info["fingerprint"]:
        raise CJEInputError(f"the reference look {ref.key} changed since the monitor started (score rows were "
                            "added or rewritten); the monitor cannot continue against different reference scores",
                            source=f"anchor_scores/{set_name}/dt={ref.dt}/")
    return ref


def _replicate(out: UpdateOutcome, after: list[Look], ref: Look, set_name: str) -> tuple[Look | None, bool]:
    """The replicate look (resolved once, then frozen); ``(look, wait)``."""
    rep_info = out.state.get("replicate")
    if rep_info is None:
        return None, False
    if rep_info.get("look_key") is None:  # not resolved yet
        sel = rep_info["selector"]
        cand = (after[0] if after else None) if sel == "next" else _select(sel, after, "replicate")
        if cand is None:
            out.waiting = ("waiting for the look after the reference (replicate 'next')" if sel == "next"
                           else f"waiting for the replicate look {sel!r}")
            return None, True
        out.changed = True
        if sel == "next" and cand.judge_id != ref.judge_id:
            log.warning("the look after the reference is by judge %s, not %s: no replicate, the rank metric "
                        "uses the look window as its baseline", cand.judge_id, ref.judge_id)
            out.state["replicate"] = None
            return None, False
        rep_info = {**rep_info, "look_key": cand.key, "fingerprint": cand.fingerprint()}
        out.state["replicate"] = rep_info
    rep = next((lk for lk in after if lk.key == rep_info["look_key"]), None)
    if rep is None or rep.fingerprint() != rep_info["fingerprint"]:
        raise CJEInputError(f"the replicate look {rep_info['look_key']} is missing or was rewritten",
                            source=f"anchor_scores/{set_name}/dt={rep_info['look_key'][:10]}/")
    return rep, False


def _todo(out: UpdateOutcome, after: list[Look], skip: set[str]) -> list[Look]:
    """Unprocessed looks in time order; looks dated before the newest processed one are late."""
    processed = set(out.state["processed"])
    last_dt = max([k[:10] for k in out.state["processed"]] or [""])
    todo = []
    for lk in after:
        if lk.key in skip or lk.key in processed:
            continue
        if lk.dt < last_dt:
            out.late_looks.append(lk.key)
            continue
        todo.append(lk)
    return todo


def _clusters(anchors: AnchorSet) -> tuple[Any, str | None]:
    """Prompt clusters of the anchors: ``prompt_id``, else identical prompt texts, else none."""
    cl = anchors.clusters()
    if cl is not None:
        return cl, "prompt_id"
    items = anchors.items()
    prompts = [it["prompt"] for it in items]
    if len(set(prompts)) < len(prompts):
        import pandas as pd

        return pd.Series(prompts, index=[it["anchor_id"] for it in items], dtype=object), "prompt"
    return None, None


@task(name="update", **_PURE_TASK)
def update(state: dict | None, looks: list[Look], anchors: AnchorSet, *, set_name: str, monitor_name: str,
           monitor_options: dict, reference: str, replicate: str | None, calibration: dict | None,
           scored: dict | None, flow_run_id: str | None) -> UpdateOutcome:
    """Choose the reference (first time), then run `DriftMonitor.update` for every new look."""
    out = UpdateOutcome(state=_start_state(state, set_name, monitor_name, DriftMonitor(**monitor_options)))
    ref = _reference(out, looks, set_name, monitor_name, reference, replicate)
    if ref is None:
        return out
    after = looks[[lk.key for lk in looks].index(ref.key) + 1:]
    rep, wait = _replicate(out, after, ref, set_name)
    if wait:
        return out
    todo = _todo(out, after, {ref.key} | ({rep.key} if rep is not None else set()))
    if not todo:
        return out
    mon = DriftMonitor.from_dict(out.state["monitor"])
    labels = anchors.labels()
    calibrate = None
    if calibration is not None and labels.notna().any():
        calibrate = calibration_from_result({"calibration": {"curve": calibration["curve"]}})
    clusters, cluster_source = _clusters(anchors)
    for lk in todo:
        meta = {"set_name": set_name, "monitor": monitor_name, "look_key": lk.key, "dt": lk.dt,
                "judge_id": lk.judge_id, "ts_min": lk.ts_min, "ts_max": lk.ts_max, "n_rows": lk.n_rows,
                "anchors_version": anchors.version, "anchors_sha256": anchors.content_sha256,
                "reference_look": ref.key, "replicate_look": rep.key if rep is not None else None,
                "calibration": calibration["info"] if calibrate is not None else None,
                "clusters": cluster_source, "flow_run_id": flow_run_id}
        if scored is not None and scored["look_key"] == lk.key:
            meta.update(scored_by_flow=True, n_unscored=scored["n_unscored"])
        look = mon.update(ref.scores, lk.scores, labels if calibrate is not None else None, calibrate,
                          reference_replicate=rep.scores if rep is not None else None, clusters=clusters, meta=meta)
        out.new_looks.append(look.to_dict())
        out.state["processed"].append(lk.key)
    out.state["monitor"] = mon.to_dict()
    out.changed = True
    return out


# --------------------------------------------------------------------------------------
# commit, notifications, label requests, report


@task(name="commit", **_STORAGE_TASK)
def commit(drift_uri: str, cfg: Any, monitor: str, state: dict, new_looks: list[dict]) -> dict:
    """Task: store the state with its new looks (sequence number and time stamp advanced); returns the keys written."""
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
                         evaluation: str | None, evaluation_logs_uri: str | None, config: dict,
                         evaluation_columns: dict[str, str] | None = None) -> dict:
    """`flows.label_requests.raising.raise_drift_requests` for every look with a first alarm of a metric.

    Traffic rows come from the linked evaluation's latest published run (its window and
    logs); without one the request holds anchors only and records why.
    """
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
                                   columns=evaluation_columns,
                                   no_traffic_reason=reason)
        out["requests"] += got["requests"]
        out["skipped"] += [dict(s, look=lk.get("look")) for s in got["skipped"]]
        for m in got["requests"]:
            logger.warning("drift look %s: label request %s for %d traffic row(s) and %d anchor(s) (%s)",
                           lk.get("look"), m["request_id"], len(m["rows"]), len(m["anchors"]),
                           m["drift"]["traffic"])
    return out


def request_summary(m: dict) -> dict:
    """The label request fields the drift summary lists (the manifest itself is in storage)."""
    return {"request_id": m["request_id"], "uri": m.get("uri"), "scope": m["scope"], "evaluation": m["evaluation"],
            "window": m["window"], "n_labels": m["n_labels"], "n_rows": len(m["rows"]),
            "n_anchors": len(m["anchors"]), "look": (m.get("drift") or {}).get("look"),
            "judge_id": (m.get("drift") or {}).get("judge_id"), "alarms": (m.get("drift") or {}).get("alarms"),
            "traffic": (m.get("drift") or {}).get("traffic"), "deadline": m["deadline"],
            "reasons": [{"trigger": r["trigger"], "reason": r["reason"]} for r in m["reasons"]]}


@task(name="write_report", **_STORAGE_TASK)
def write_report(drift_uri: str, cfg: Any, monitor: str, state: dict) -> str:
    """Task: render the monitor's HTML report from its stored looks; returns its URL."""
    st = Storage.for_uri(drift_uri, cfg)
    history = read_looks(st, monitor)
    key = state_prefix(monitor) + "report.html"
    st.write_bytes(key, render_drift_report(history, state=state).encode("utf-8"))
    return st.url(key)
