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
9. ``write_report``   ``drift/<monitor>/report.html`` (timeline of every look);
10. ``refresh_pages`` the linked evaluation's trend page and the results index (`flows.pipelines.pages`).

Reference and replicate
-----------------------
Looks are compared with a **reference** look, chosen once and frozen in the state:
``"first"`` (default: the earliest look), ``"judge:<judge_id>"`` (the earliest look of that
judge version) or an explicit look key ``"YYYY-MM-DD/<judge_id>"``. Tau-b can only alarm with a
baseline (docs/drift.md): the **replicate** is a second, independent scoring by the reference
judge, ``"next"`` (default: the look right after the reference when it has the reference's judge
id; otherwise there is none and the rank metric's baseline is the agreement within its window of
looks), an explicit look key, or ``None``. The
replicate look is not monitored itself. Every later look that is not yet processed is compared
with the reference (looks dated before the last processed look are not revisited).

State: `flows.storage.drift_state` (create-only state and look objects under ``drift/<monitor>/``,
a pointer, the report). Tasks: `flows.pipelines.drift_tasks`. Parameters: one
`flows.pipelines.drift_config.DriftSettings`. Report: `flows.reports.drift`.

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

import logging
import os
from datetime import datetime, timezone
from typing import Any

from prefect.context import FlowRunContext
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from cje_engine.errors import CJEInputError
from flows.label_requests.config import RequestConfig
from flows.pipelines.drift_config import DriftSettings, find_drift_monitor, settings_from
from flows.pipelines.drift_tasks import (commit, first_alarms_of, load_anchors, load_calibration, load_scores,
                                         load_state_task, notify_alarms, raise_label_requests, request_summary,
                                         score_anchors, update, write_report)
from flows.pipelines.pages import refresh_pages
from flows.runtime.guard import checked_flow
from flows.storage.drift_state import look_key, state_prefix
from flows.storage.objects import Storage, StorageConfig
from flows.reports.artifacts import drift_artifacts

log = logging.getLogger(__name__)

__all__ = ["drift", "run_drift", "format_summary"]


def _flow_run_id() -> str | None:
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


def _as_iso_date(value: Any) -> str:
    from flows.storage.logs import as_date

    return as_date(value, "through").isoformat()


def _dates_to_read(state: dict | None) -> tuple[str | None, list[str]]:
    """Score partitions a run reads: from the newest processed date on, plus the reference's and
    replicate's dates (None: everything, before the reference is chosen)."""
    if state is None or not state.get("reference"):
        return None, []
    since = max([k[:10] for k in state.get("processed") or []] or [state["reference"]["dt"]])
    rep_key = (state.get("replicate") or {}).get("look_key")
    return since, [state["reference"]["dt"]] + ([rep_key[:10]] if rep_key else [])


def _request_config(s: DriftSettings) -> dict:
    cfg = RequestConfig.from_dict(s.label_requests).to_dict()  # bad settings fail before any work
    cfg["labels_uri"] = cfg["labels_uri"] or s.labels_uri or s.evaluation_logs_uri
    cfg["webhook_url"] = cfg["webhook_url"] or s.webhook_url
    return cfg


def _label_requests(s: DriftSettings, cfg: Any, retry: dict, alarming: list[dict], anchor_ids: list[str],
                    req_config: dict) -> tuple[dict, str | None]:
    """Raise the label requests of first alarms; a failure is reported, never fails the run."""
    if not alarming:
        return {"requests": [], "skipped": []}, None
    try:
        return raise_label_requests.with_options(**retry)(s.uri("results"), quote(cfg), quote(alarming), anchor_ids,
                                                          s.evaluation, s.evaluation_logs_uri, req_config,
                                                          s.evaluation_columns), None
    except Exception as exc:  # noqa: BLE001 - the looks are committed; report, do not fail the monitor
        get_run_logger().error("label requests for the drift alarm of monitor %s failed: %s", s.name, exc)
        return {"requests": [], "skipped": []}, f"{type(exc).__name__}: {exc}"


def check_parameters(p: dict[str, Any]) -> None:
    """Checks before a run is created (the settings are validated already): the label-request settings."""
    _request_config(p["settings"])


@checked_flow(name="drift", log_prints=False, validate_parameters=True, check=check_parameters)
def drift(settings: DriftSettings) -> dict:
    """Judge drift on an anchor set: new looks against the reference, persisted, alarms notified.

    Parameters
    ----------
    settings : DriftSettings
        Everything the run needs (a mapping of its fields works too); see
        `flows.pipelines.drift_config.DriftSettings` and docs/drift-flow.md.

    Returns
    -------
    dict
        ``set_name``, ``monitor``, ``n_looks``, ``new_looks`` (look dicts), ``alarm`` (any new
        look alarmed), ``alarms``, ``first_alarm``, ``state_key``, ``look_keys``, ``report``,
        ``notifications``, ``scored``, ``waiting``, ``reference``, ``replicate``,
        ``label_requests`` (requests raised by this run), ``label_requests_skipped`` (with reasons)
        and ``label_requests_error`` (None unless raising them failed).
    """
    s, logger = settings, get_run_logger()
    req_config = _request_config(s)
    cfg = StorageConfig.from_env()  # the driver's environment; never a flow parameter
    retry = dict(retries=len(s.delays), retry_delay_seconds=s.delays or [0.0])
    through = datetime.now(timezone.utc).date().isoformat() if s.through in (None, "") else _as_iso_date(s.through)
    run_id = _flow_run_id()

    # 1. the anchor set; 2. optionally a fresh scoring by the judge endpoint (a new look)
    anchors = load_anchors.with_options(**retry)(s.anchors_uri, quote(cfg), s.set_name, s.anchors_version)
    scored = None
    if s.scorer is not None:
        ts = _parse_ts(s.scored_at)
        basename = f"judge-{ts.strftime('%Y%m%dT%H%M%S')}-{(run_id or os.urandom(4).hex())[:8]}"
        scored = score_anchors.with_options(**retry)(s.uri("logs"), quote(cfg), quote(anchors), s.scorer, s.judge_id,
                                                     ts, basename)
        through = max(through, ts.date().isoformat())
    # 3. the state (completing an interrupted commit); 4. the looks; 5. the calibration
    state = load_state_task.with_options(**retry)(s.uri("drift"), quote(cfg), s.name)
    repaired = state.pop("_repaired", []) if state else []
    since, extra = _dates_to_read(state)
    looks = load_scores.with_options(**retry)(s.uri("logs"), quote(cfg), s.set_name, anchors.anchor_ids, since,
                                              extra, through)
    calibration = (load_calibration.with_options(**retry)(s.uri("results"), quote(cfg), s.evaluation)
                   if s.evaluation else None)
    # 6. the monitor, look by look; 7. commit
    outcome = update(quote(state), quote(looks), quote(anchors), set_name=s.set_name, monitor_name=s.name,
                     monitor_options=dict(s.monitor), reference=s.reference, replicate=s.replicate,
                     calibration=calibration, scored=scored, flow_run_id=run_id)
    if outcome.late_looks:
        logger.warning("ignored %d look(s) dated before the last processed look: %s", len(outcome.late_looks),
                       ", ".join(outcome.late_looks[:5]))
    if outcome.waiting:
        logger.info("drift monitor %s: %s", s.name, outcome.waiting)
    committed: dict = {"state_key": (state or {}).get("_key"), "look_keys": []}
    if outcome.changed:
        committed = commit.with_options(**retry)(s.uri("drift"), quote(cfg), s.name, quote(outcome.state),
                                                 quote(outcome.new_looks))
    # 8. notifications; 9. label requests for first alarms; 10. the report
    st = Storage.for_uri(s.uri("drift"), cfg)
    to_notify = list(repaired) + list(outcome.new_looks)
    urls = {int(lk["look"]): {"look": st.url(look_key(s.name, lk["look"])),
                              "report": st.url(state_prefix(s.name) + "report.html")} for lk in to_notify}
    notifications = notify_alarms(quote(to_notify), s.name, urls, s.evaluation, s.notify_on, s.webhook_url)
    raised, request_error = _label_requests(s, cfg, retry, [lk for lk in to_notify if first_alarms_of(lk)],
                                            anchors.anchor_ids, req_config)
    report = None
    if outcome.state["monitor"]["n_looks"] > 0:
        report = write_report.with_options(**retry)(s.uri("drift"), quote(cfg), s.name, quote(outcome.state))

    if s.evaluation and (outcome.changed or raised["requests"]):  # the linked evaluation's pages show the looks
        refresh_pages(s.uri("results"), cfg, s.evaluation, requests_uri=req_config.get("requests_uri"),
                      labels_uri=req_config.get("labels_uri"), drift_uri=s.uri("drift"),
                      why=f"drift monitor {s.name}'s look(s)")

    mon = outcome.state["monitor"]
    new_alarms = [lk for lk in outcome.new_looks if lk["alarm"]]
    summary = {
        "set_name": s.set_name, "monitor": s.name, "n_looks": mon["n_looks"], "new_looks": outcome.new_looks,
        "alarm": bool(new_alarms), "alarms": sorted({m for lk in new_alarms for m in lk["alarms"]}),
        "first_alarm": mon["first_alarm"], "state_key": committed.get("state_key"),
        "look_keys": committed.get("look_keys", []), "report": report, "notifications": notifications,
        "scored": scored, "waiting": outcome.waiting, "late_looks": outcome.late_looks,
        "reference": outcome.state.get("reference"), "replicate": outcome.state.get("replicate"),
        "anchors_version": anchors.version,
        "label_requests": [request_summary(m) for m in raised["requests"]],
        "label_requests_skipped": raised["skipped"], "label_requests_error": request_error,
    }
    logger.info("drift monitor %s: %d new look(s), %d in total, alarm=%s %s", s.name, len(outcome.new_looks),
                mon["n_looks"], summary["alarm"], summary["alarms"] or "")
    return drift_artifacts(summary)  # Prefect artifacts: flows/reports/artifacts.py


def run_drift(name: str, config_path: str | os.PathLike | None = None, **overrides: Any) -> dict:
    """Run one declared drift monitor now (``cje drift NAME``); ``overrides`` replace settings.

    Needs a Prefect API (wrap in `flows.runtime.prefect_server.prefect_api`).
    """
    spec = find_drift_monitor(name, config_path)
    params = spec.settings_dict()
    params.update({k: v for k, v in overrides.items() if v is not None})
    return drift(settings_from(params, f"drift monitor {name!r}"))


def _tau_text(m: dict) -> str:
    """``tau=0.583, rank change -0.034 (0.590 across vs 0.624 within)``: tau-b of reference vs current,
    then the rank metric, i.e. its change = agreement across the reference scorings and the recent
    looks minus the agreement within them (its no-drift value); or the floor tau is tested against."""
    d = m.get("detail") or {}
    if d.get("tau") is None:
        return "tau=n/a"
    text = f"tau={d['tau']:.3f}"
    if d.get("comparison") == "rank_change" and m.get("estimate") is not None:
        text += (f", rank change {m['estimate']:+.3f} ({d.get('tau_between', float('nan')):.3f} across vs "
                 f"{d.get('tau_within', float('nan')):.3f} within)")
    elif d.get("comparison") == "tau_floor":
        text += f", floor {m.get('null_value'):.3f}"
    return text


def format_summary(summary: dict) -> str:
    """A few lines for the terminal (``cje drift``)."""
    lines = [f"drift monitor {summary['monitor']} (anchor set {summary['set_name']} "
             f"v{summary.get('anchors_version')}): {len(summary['new_looks'])} new look(s), "
             f"{summary['n_looks']} in total"]
    for lk in summary["new_looks"]:
        meta = lk.get("meta") or {}
        ests = ", ".join([_tau_text(lk["metrics"].get("tau_b") or {})] + [
            f"{m}={lk['metrics'][m]['estimate']:+.3f}" for m in ("mean_shift", "residual_mean")
            if (lk["metrics"].get(m) or {}).get("estimate") is not None])
        status = "ALARM " + ",".join(lk["alarms"]) if lk["alarm"] else "ok"
        lines.append(f"  look {lk['look']} {meta.get('look_key')}: {status} | {ests}")
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
