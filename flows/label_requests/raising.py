"""Raising requests for a published run or a drift alarm: plan, take the budget, write, notify."""
from __future__ import annotations

import logging
from datetime import date, datetime
from typing import Any, Callable, Mapping, Sequence

import pyarrow as pa

from cje_engine.errors import CJEInputError

from flows.integrations.notify import notify
from flows.label_requests.budget import LabelBudget
from flows.label_requests.config import RequestConfig, current_time, iso_period
from flows.label_requests.manifests import list_requests, request_key, storage_for, write_request
from flows.label_requests.planning import plan_requests
from flows.label_requests.triggers import as_arrow_table, segment_columns_of, unwrap_result
from flows.storage.labels import LABEL_COLUMNS, LabelStore, inline_label_columns, join_labels
from flows.storage.logs import discover_partitions, read_window
from flows.storage.objects import StorageError

log = logging.getLogger(__name__)

_MAX_RACES = 50


def _window_dates(window: str) -> tuple[date, date]:
    if "_" in window:
        a, b = window.split("_", 1)
    elif ".." in window:
        a, b = window.split("..", 1)
    else:
        a = b = window
    try:
        return date.fromisoformat(a), date.fromisoformat(b)
    except ValueError:
        raise CJEInputError(f"window {window!r} is not 'YYYY-MM-DD_YYYY-MM-DD'") from None


def read_evaluated_logs(logs_uri: str, window: str, labels_uri: str | None, storage_cfg: Any,
                        columns: Mapping[str, str] | None = None, extra: Sequence[str] = ()) -> pa.Table:
    """The window's rows (ids, policy, prompt, score, dt, and the ``extra`` columns, e.g. the result's segment
    columns) with their labels: inline ones of the logs combined with the label store's (the store wins), as
    the evaluate flow joins them (``columns``: the evaluation's column mapping, applied as the evaluate flow
    reads)."""
    st = storage_for(logs_uri, storage_cfg)
    start, end = _window_dates(window)
    files = discover_partitions(st, start, end)
    base = list(dict.fromkeys(["response_id", "policy", "prompt_id", "judge_score", "dt", *extra]))
    inline = inline_label_columns(st, [f.key for f in files], mapping=columns)
    table = read_window(st, files, columns=None if inline["mixed"] else base + inline["columns"], check_unique=False,
                        mapping=columns)
    table = table.select([c for c in base + list(LABEL_COLUMNS) if c in table.column_names])
    store = LabelStore(storage_for(labels_uri or logs_uri, storage_cfg))
    if store.version() > 0:
        table = join_labels(table, store.read())
        if "label_conflict" in table.column_names:
            table = table.drop_columns(["label_conflict"])
    return table


def raise_requests_for_run(storage_cfg: Any, results_uri: str, evaluation: str, window: str,
                           published_result: Mapping, logs_table_or_uri: Any,
                           config: Mapping | RequestConfig | None = None, *, drift_look: Mapping | None = None,
                           anchor_ids: Sequence[str] | None = None, now: datetime | str | None = None,
                           columns: Mapping[str, str] | None = None) -> list[dict]:
    """Raise (write and notify) the label requests a published run calls for.

    Parameters
    ----------
    storage_cfg : StorageConfig, dict or None
        Storage settings (None: from the environment).
    results_uri : str
        Root where ``label_requests/`` lives (unless ``config.requests_uri``).
    evaluation, window : str
        The run (window as in result paths, ``YYYY-MM-DD_YYYY-MM-DD``).
    published_result : dict
        The result dict, or the evaluate flow's return value (adds run key and path).
    logs_table_or_uri : pyarrow.Table, DataFrame or str
        Evaluated rows, or the logs URI (the window is read, labels joined from
        ``config.labels_uri`` or the logs URI).
    config : dict or RequestConfig
    columns : mapping of str to str, optional
        The evaluation's column mapping (canonical -> column in the logs) when the logs are read.

    Returns
    -------
    list of dict
        The manifests created by this call (with ``uri``); existing or skipped ones are not listed.
    """
    cfg = RequestConfig.from_dict(config)
    logs_uri = logs_table_or_uri if isinstance(logs_table_or_uri, str) else None
    if logs_uri is not None:
        result, _ = unwrap_result(published_result)
        table = read_evaluated_logs(logs_uri, window, cfg.labels_uri, storage_cfg, columns, segment_columns_of(result))
    else:
        table = as_arrow_table(logs_table_or_uri)
    st = storage_for(cfg.requests_uri or results_uri, storage_cfg)
    resumed = _write_and_notify(st, reserved_unwritten(st, evaluation, window, unwrap_result(published_result)[1]
                                                       .get("run_key"), now), cfg, evaluation, window)

    def plan(existing: list[dict], used: int) -> dict:
        return plan_requests(published_result, table, cfg, evaluation=evaluation, window=window, logs_uri=logs_uri,
                             existing=existing, drift_look=drift_look, anchor_ids=anchor_ids, now=now,
                             budget_used=used)

    planned = plan_within_budget(st, cfg, plan, evaluation=evaluation, now=now)
    for s in planned["skipped"]:
        log.info("label request not raised for %s/%s: %s", evaluation, s.get("scope"), s.get("reason"))
    return resumed + _write_and_notify(st, planned["requests"], cfg, evaluation, window)


def reserved_unwritten(st: Any, evaluation: str, window: str, run_key: str | None,
                       now: datetime | str | None = None) -> list[dict]:
    """Requests of this run that an earlier attempt reserved in the period's budget ledger and died before
    writing (`flows.label_requests.budget.LabelBudget.unwritten`); the retry writes them as reserved.

    Parameters
    ----------
    st : Storage
        The requests root.
    evaluation, window : str
        The run's evaluation and window.
    run_key : str or None
        The run (None: nothing is resumed).
    now : datetime or str, optional
        The time deciding the budget period (default: now, UTC).

    Returns
    -------
    list of dict
        The reserved manifests, oldest reservation first.
    """
    if not run_key:
        return []
    ledger = LabelBudget(st, iso_period(current_time(now)))
    found = [m for m in ledger.unwritten(list_requests(st, now=now))
             if (m.get("evaluation"), m.get("window"), m.get("run_key")) == (evaluation, window, run_key)]
    for m in found:
        log.warning("label request %s of %s/%s was reserved by an earlier attempt that did not write it: "
                    "writing it now", m["request_id"], evaluation, window)
    return found


def plan_within_budget(st: Any, cfg: RequestConfig, plan: Callable[[list[dict], int], dict], *,
                       evaluation: str | None, now: datetime | str | None) -> dict:
    """Plan against the period's budget ledger and reserve the plan's labels atomically.

    ``plan(existing, used)`` returns `plan_requests` output for the stored requests and the labels
    used so far.  When another writer reserves first (the create-only ledger entry exists), the
    stored requests and the ledger are read again and the plan is redone against what is left
    (`flows.label_requests.budget`).  Returns the plan whose requests are reserved (or were
    reserved by an earlier attempt of the same run whose manifest was never written).
    """
    period = iso_period(current_time(now))
    ledger = LabelBudget(st, period)
    for _ in range(_MAX_RACES):
        existing = list_requests(st, now=now)
        snap = ledger.snapshot(existing)
        out = plan(existing + list(snap.inflight), snap.used)
        stored = {m["request_id"] for m in existing}
        todo = [m for m in out["requests"] if m["request_id"] not in stored]
        fresh = [m for m in todo if m["request_id"] not in snap.reserved]
        if not fresh or ledger.take(snap, fresh, cfg.max_labels_per_period, evaluation=evaluation):
            return dict(out, requests=todo)
        log.info("label budget %s: another run reserved first; planning again", period)
    raise StorageError(f"label budget {period}: lost {_MAX_RACES} reservation races in a row",
                       key=f"label_requests/_budget/{period}", operation="reserve")


def _write_and_notify(st: Any, manifests: Sequence[dict], cfg: RequestConfig, evaluation: str | None,
                      window: str | None) -> list[dict]:
    """Create each manifest (create-only) and notify it; returns the ones this call created."""
    created = []
    for m in manifests:
        if not write_request(st, m):
            log.info("label request %s exists already; not written again", m["request_id"])
            continue
        m = dict(m, uri=st.url(request_key(m["request_id"])))
        log.info("label request %s: %d label(s) for %s/%s (%s)", m["request_id"], m["n_labels"], evaluation,
                 m["scope"], ", ".join(r["trigger"] for r in m["reasons"]))
        if cfg.notify:
            payload = {
                "evaluation": evaluation, "window": window, "request_id": m["request_id"], "uri": m["uri"],
                "scope": m["scope"], "n_labels": m["n_labels"], "design": m["design"],
                "triggers": [r["trigger"] for r in m["reasons"]], "reasons": [r["reason"] for r in m["reasons"]],
                "deadline": m["deadline"]}
            if m.get("drift"):
                payload["drift"] = m["drift"]
                payload["n_anchors"] = len(m.get("anchors") or [])
            m["notification"] = notify("label_request", payload, webhook_url=cfg.webhook_url)
        created.append(m)
    return created


def _empty_logs() -> pa.Table:
    return pa.table({"response_id": pa.array([], pa.string()), "policy": pa.array([], pa.string()),
                     "judge_score": pa.array([], pa.float64())})


def raise_drift_requests(storage_cfg: Any, requests_uri: str, drift_look: Mapping, anchor_ids: Sequence[str], *,
                         evaluation: str | None = None, latest: Mapping | None = None, logs_uri: str | None = None,
                         config: Mapping | RequestConfig | None = None, no_traffic_reason: str | None = None,
                         now: datetime | str | None = None, columns: Mapping[str, str] | None = None) -> dict:
    """Raise the label request of a drift alarm: fresh labels on anchors and on recent traffic.

    Only the ``drift_alarm`` trigger is evaluated here (the audit triggers belong to the
    evaluation's own runs, `evaluate_and_audit`).

    Parameters
    ----------
    storage_cfg : StorageConfig, dict or None
    requests_uri : str
        Root of ``label_requests/`` (``config.requests_uri`` takes precedence).
    drift_look : dict
        The alarming look (`DriftLook.to_dict()` with ``meta``: monitor, set_name, judge_id, ...).
    anchor_ids : list of str
        The anchor set's ids (anchor labels are drawn from them).
    evaluation : str, optional
        The monitor's linked evaluation.
    latest : dict, optional
        Its latest published run (`flows.storage.publish.read_latest`): window and result.
    logs_uri : str, optional
        The evaluation's logs; the recent traffic is read from the latest run's window and
        joined with the label store at ``config.labels_uri`` (default the logs URI).
    config : dict or RequestConfig
        The evaluation's ``label_requests`` settings (budget, sizes, deduplication scope).
    no_traffic_reason : str, optional
        Why recent traffic cannot be requested (recorded in the manifest); without ``latest``
        and ``logs_uri`` the request holds anchors only.
    columns : mapping of str to str, optional
        The evaluation's column mapping (``columns:``), applied when its logs are read.

    Returns
    -------
    dict
        ``requests`` (manifests created by this call, with ``uri``), ``skipped`` (with reasons)
        and ``traffic`` (what "recent traffic" meant, or why there was none).
    """
    cfg = RequestConfig.from_dict(config)
    if "drift_alarm" not in cfg.triggers:
        return {"requests": [], "traffic": None, "skipped": [{
            "scope": "drift", "trigger": "drift_alarm",
            "reason": f"the drift_alarm trigger is disabled in the label_requests settings of evaluation "
                      f"{evaluation!r}"}]}
    cfg_drift = cfg.model_copy(update={"triggers": ("drift_alarm",)})
    has_result = isinstance(latest, Mapping) and isinstance(latest.get("result"), Mapping)
    table = None
    if has_result and logs_uri:
        window = str(latest["window"])
        try:
            table = read_evaluated_logs(logs_uri, window, cfg.labels_uri, storage_cfg, columns)
        except CJEInputError as exc:  # the alarm still asks for anchor labels; the manifest says why
            log.warning("drift label request: recent traffic of %r not readable (%s); anchors only", evaluation, exc)
            no_traffic_reason = f"the logs of window {window} of evaluation {evaluation!r} are not readable ({exc})"
    if table is not None:
        published: Mapping = latest
        traffic = (f"the last {cfg.recent_days} log date(s) of window {window} of evaluation {evaluation!r} "
                   f"(latest published run {latest.get('run_key')}), unlabelled rows only, from {logs_uri}")
    else:
        window = None
        table = _empty_logs()
        published = {"policies": {}, "config": {}}
        traffic = "none requested: " + (no_traffic_reason or (
            "the drift monitor has no linked evaluation" if not evaluation else
            f"evaluation {evaluation!r} has no published result yet" if not has_result else
            f"the logs of evaluation {evaluation!r} are unknown to the drift flow"))
    st = storage_for(cfg.requests_uri or requests_uri, storage_cfg)

    def planner(existing: list[dict], used: int) -> dict:
        return plan_requests(published, table, cfg_drift, evaluation=evaluation, window=window, logs_uri=logs_uri,
                             existing=existing, drift_look=drift_look,
                             anchor_ids=[] if anchor_ids is None else list(anchor_ids), now=now, budget_used=used)

    plan = plan_within_budget(st, cfg, planner, evaluation=evaluation, now=now)
    for m in plan["requests"]:
        m.setdefault("drift", {})["traffic"] = traffic
    for s in plan["skipped"]:
        log.info("drift label request not raised for look %s: %s", drift_look.get("look"), s.get("reason"))
    created = _write_and_notify(st, plan["requests"], cfg, evaluation, window)
    return {"requests": created, "skipped": plan["skipped"], "traffic": traffic}
