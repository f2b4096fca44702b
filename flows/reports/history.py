"""Run history of an evaluation, read from the published results: rows for `cje runs`, the trend page,
the index and the report's "what changed" block.

Reads only committed runs (`flows.storage.publish.list_runs`), linked drift monitors (``drift/<monitor>/looks/``
in the same storage root, linked when a look's calibration came from this evaluation) and label requests
(``label_requests/``). Everything else is pure: dicts in, dicts out.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any, Mapping, Sequence

from cje_engine.errors import CJEInputError
from cje_engine.inference.changes import PolicyChanges, changes_by_policy

from flows.label_requests.manifests import list_requests, progress
from flows.config import MonitoringConfig, check_monitoring
from flows.reports.common import alpha_of, conf_label, as_number, as_pair
from flows.reports.segments import segment_brief
from flows.storage.objects import NotFoundError, Storage, StorageError
from flows.storage.publish import RESULTS, list_runs, read_run

log = logging.getLogger(__name__)

_LOOK = re.compile(r"^drift/([^/]+)/looks/(\d+)\.json$")


def _verdict(pol: Mapping[str, Any]) -> str:
    audit = pol.get("audit") if isinstance(pol.get("audit"), Mapping) else {}
    return str(audit.get("verdict") or "not_run")


def run_summary(run: Mapping[str, Any]) -> dict[str, Any]:
    """One published run as a history row (JSON data; ``result`` is the parsed result.json)."""
    result = run.get("result") or {}
    pols = result.get("policies") if isinstance(result.get("policies"), Mapping) else {}
    policies = {}
    for name, p in pols.items():
        refused = p.get("level_claim") == "refused"
        policies[name] = {
            "estimate": None if refused else as_number(p.get("estimate")),
            "se": None if refused else as_number(p.get("se")),
            "ci": None if refused else (list(as_pair(p.get("ci"))) if as_pair(p.get("ci")) else None),
            "level_claim": p.get("level_claim"),
            "refusal_reasons": list(p.get("refusal_reasons") or []),
            "audit": _verdict(p),
            "n_labelled": p.get("n_labelled"),
            "assumed": _assumed(p),
        }
    data = result.get("data") if isinstance(result.get("data"), Mapping) else {}
    arts = run.get("artifacts") or {}
    return {
        "evaluation": run.get("evaluation"), "window": run.get("window"), "run_key": run.get("run_key"),
        "published_at": run.get("published_at"), "path": run.get("path"),
        "report": arts.get("report.html"), "result": arts.get("result.json"),
        "report_key": _artifact_key(run, "report.html"),
        "best_policy": result.get("best_policy"), "n_labels": data.get("n_labelled"),
        "confidence": conf_label(alpha_of(result)),
        "policies": policies, "monitoring": (run.get("manifest") or {}).get("monitoring"),
        "segments": segments_summary(result),
    }


def segments_summary(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """A result's segment block as a history row keeps it (None without segments): the columns, the baseline
    and per segment x policy the difference with the baseline (``diff``, ``ci``: the FCR interval when claimed,
    else the marginal one; ``claim``: verified, assumes_transport or too_few; ``better``/``worse``) and the
    level (``estimate``, ``ci``, ``claim``); ``brief``: the short summary of the index card and the trend page
    (`flows.reports.segments.segment_brief`)."""
    seg = result.get("segments") if isinstance(result, Mapping) else None
    if not isinstance(seg, Mapping):
        return None
    cells: dict[str, dict[str, Any]] = {}
    for c in seg.get("cells") or []:
        shown = c.get("claim_kind") != "too_few"
        ci = as_pair(c.get("ci")) if shown else None
        cells.setdefault(str(c.get("segment")), {})[str(c.get("policy"))] = {
            "estimate": as_number(c.get("estimate")) if shown else None, "ci": list(ci) if ci else None,
            "claim": c.get("claim_kind"), "n_labels": c.get("n_labels"), "n_rows": c.get("n_rows"),
            "audit": (c.get("audit") or {}).get("verdict") or "not_run", "reason": c.get("reason")}
    diffs: dict[str, dict[str, Any]] = {}
    for c in seg.get("comparisons") or []:
        shown = c.get("claim_kind") != "too_few"
        ci = (as_pair(c.get("ci_fcr")) or as_pair(c.get("ci"))) if shown else None
        diffs.setdefault(str(c.get("segment")), {})[str(c.get("policy"))] = {
            "diff": as_number(c.get("diff")) if shown else None, "ci": list(ci) if ci else None,
            "claim": c.get("claim_kind"), "better": bool(c.get("better")), "worse": bool(c.get("worse")),
            "p_adjusted": as_number(c.get("p_adjusted"))}
    order = [str(s.get("name")) for s in seg.get("segments") or [] if s.get("status") != "pooled"]
    return {"columns": list(seg.get("columns") or []), "baseline": seg.get("baseline"), "order": order,
            "cells": cells, "diffs": diffs, "brief": segment_brief(result)}


def _assumed(pol: Mapping[str, Any]) -> dict[str, Any] | None:
    """The assumes-transport level of a policy without a quotable one (``estimate``, ``ci``), or None."""
    a = pol.get("assumed")
    if pol.get("level_claim") != "assumes_transport" or not isinstance(a, Mapping) or a.get("level_claim") == "refused":
        return None
    ci = as_pair(a.get("ci"))
    return {"estimate": as_number(a.get("estimate")), "ci": list(ci) if ci else None}


def _artifact_key(run: Mapping[str, Any], name: str) -> str | None:
    """Key of an artifact relative to ``results/`` (for relative links between pages)."""
    art = ((run.get("manifest") or {}).get("artifacts") or {}).get(name)
    if not art:
        return None
    return f"{run['evaluation']}/{run['window']}/{run['run_key']}/{art['key']}"


def read_history(st: Storage, evaluation: str) -> list[dict[str, Any]]:
    """Every published run of ``evaluation`` as `run_summary` rows, oldest publication first.

    A run whose result cannot be read (checksum mismatch, missing object) is listed with no policies
    and an ``error``.
    """
    rows = []
    for r in list_runs(st, evaluation):
        try:
            run = read_run(st, evaluation, r["window"], r["run_key"])
        except (StorageError, ValueError) as exc:
            rows.append({**run_summary({**r, "result": None}), "error": str(exc)})
            continue
        if run is not None:
            rows.append(run_summary(run))
    return rows


def evaluations(st: Storage) -> list[str]:
    """Names of evaluations with at least one published run."""
    return sorted(published_manifests(st))


def published_manifests(st: Storage) -> dict[str, list[tuple[str, int]]]:
    """Each evaluation with a published run: its runs' manifests as (key, size), in key order, from one listing
    of the results (what says that an evaluation's runs changed, `flows.reports.trend.write_pages`)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for info in st.list(f"{RESULTS}/"):
        parts = info.key.split("/")
        if len(parts) == 5 and parts[-1] == "manifest.json":
            out.setdefault(parts[1], []).append((info.key, int(info.size)))
    return {name: sorted(runs) for name, runs in sorted(out.items())}


def latest_per_window(history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The newest publication of each window (new labels supersede), windows in time order.

    Window labels start with their first date (``YYYY-MM-DD...``), so their string order is time order.
    """
    by_window: dict[str, Mapping[str, Any]] = {}
    for row in history:
        w = str(row.get("window"))
        if w not in by_window or str(row.get("published_at")) >= str(by_window[w].get("published_at")):
            by_window[w] = row
    return [dict(by_window[w]) for w in sorted(by_window)]


def monitoring_of(history: Sequence[Mapping[str, Any]]) -> MonitoringConfig:
    """The ``monitoring:`` settings recorded by the newest publication of a history (its manifest's
    ``monitoring``), else the defaults; settings that no longer validate fall back to the defaults."""
    recorded = [r for r in history if isinstance(r.get("monitoring"), Mapping)]
    if not recorded:
        return MonitoringConfig()
    newest = max(recorded, key=lambda r: str(r.get("published_at")))
    try:
        return check_monitoring(newest["monitoring"])
    except CJEInputError as exc:
        log.warning("run %s records monitoring settings that do not validate (%s); using the defaults",
                    newest.get("run_key"), exc)
        return MonitoringConfig()


def window_changes_of(history: Sequence[Mapping[str, Any]], **options: Any) -> dict[str, PolicyChanges]:
    """Per-policy changes across windows (`cje_engine.inference.changes`) of the latest run per window.

    ``options``: keywords of `changes_by_policy` (`flows.config.MonitoringConfig.change_options`);
    default: the settings the newest publication recorded (`monitoring_of`), so the trend page,
    ``cje runs`` / ``cje diff`` and the flow's alarms agree.
    """
    seq = [(str(r["window"]), {"policies": r.get("policies") or {}}) for r in latest_per_window(history)]
    return changes_by_policy(seq, **(options or monitoring_of(history).change_options()))


def previous_run(history: Sequence[Mapping[str, Any]], window: str, run_key: str) -> dict[str, Any] | None:
    """The run a new publication is compared with: the latest run of the previous window, or else the
    previous publication of the same window."""
    windows = latest_per_window([r for r in history if not (r["window"] == window and r["run_key"] == run_key)])
    earlier = [r for r in windows if str(r["window"]) < window]
    same = [r for r in history if r["window"] == window and r["run_key"] != run_key]
    if same:
        return dict(max(same, key=lambda r: str(r.get("published_at"))))
    return earlier[-1] if earlier else None


def what_changed(prev: Mapping[str, Any] | None, cur: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per policy: previous and current value and claim, difference, and what moved (pure)."""
    if prev is None:
        return []
    out = []
    names = list(cur.get("policies") or {}) + [n for n in prev.get("policies") or {} if n not in
                                                 (cur.get("policies") or {})]
    for n in names:
        a = (prev.get("policies") or {}).get(n)
        b = (cur.get("policies") or {}).get(n)
        notes = []
        if a is None:
            notes.append("new policy")
        elif b is None:
            notes.append("no longer evaluated")
        else:
            if a.get("level_claim") != b.get("level_claim"):
                notes.append(f"level {a.get('level_claim')} \u2192 {b.get('level_claim')}")
            if a.get("audit") != b.get("audit"):
                notes.append(f"audit {a.get('audit')} \u2192 {b.get('audit')}")
        ea, eb = (a or {}).get("estimate"), (b or {}).get("estimate")
        diff = eb - ea if ea is not None and eb is not None else None
        out.append({"policy": n, "before": ea, "after": eb, "diff": diff, "notes": notes,
                    "claim_before": (a or {}).get("level_claim"), "claim_after": (b or {}).get("level_claim")})
    if prev.get("best_policy") != cur.get("best_policy"):
        out.append({"policy": None, "notes": [f"best policy {prev.get('best_policy') or 'none'} \u2192 "
                                              f"{cur.get('best_policy') or 'none'}"]})
    return out


def _read_json(st: Storage, key: str) -> Any:
    try:
        return json.loads(st.read_bytes(key))
    except (NotFoundError, ValueError, UnicodeDecodeError):
        return None


def linked_drift(st: Storage, evaluation: str) -> dict[str, list[dict[str, Any]]]:
    """Looks of the drift monitors whose calibration came from ``evaluation`` (monitor -> looks).

    Each look: ``look``, ``dt`` (day scored), ``alarm``, ``alarms`` (metrics), ``judge_id``.
    """
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        infos = st.list("drift/")
    except StorageError:
        return out
    for info in infos:
        m = _LOOK.match(info.key)
        if not m:
            continue
        doc = _read_json(st, info.key)
        if not isinstance(doc, dict):
            continue
        meta = doc.get("meta") or {}
        cal = meta.get("calibration") or {}
        if cal.get("evaluation") != evaluation:
            continue
        metrics = doc.get("metrics") or {}
        tau = metrics.get("tau_b") or {}
        res = metrics.get("residual_mean") or {}
        out.setdefault(m.group(1), []).append({
            "look": doc.get("look"), "dt": meta.get("dt"), "alarm": bool(doc.get("alarm")),
            "alarms": list(doc.get("alarms") or []), "judge_id": meta.get("judge_id"),
            "tau": as_number((tau.get("detail") or {}).get("tau", tau.get("estimate"))),
            "residual_shift": as_number(res.get("estimate")), "residual_shift_ci": as_pair(res.get("ci"))})
    for looks in out.values():
        looks.sort(key=lambda lk: int(lk.get("look") or 0))
    return out


#: Request statuses that still wait for labels (`flows.label_requests.manifests.progress`).
OPEN_STATUSES = ("pending", "partly_fulfilled")


def _labelled_ids(labels_st: Storage | None) -> set[str]:
    """Response ids the label store at ``labels_st`` holds (empty without one)."""
    from flows.storage.labels import LabelStore

    if labels_st is None:
        return set()
    store = LabelStore(labels_st)
    return set(store.read().column("response_id").to_pylist()) if store.version() else set()


def open_label_requests(st: Storage, evaluation: str, labels_st: Storage | None = None) -> list[dict[str, Any]]:
    """Open label requests of ``evaluation`` (id, scope, status, labels, deadline, reasons), as
    ``cje requests status`` counts them: `flows.label_requests.manifests.progress` with the label store at
    ``labels_st`` (default: none; a request fulfilled through `cje labels` has its marker anyway; an empty
    store counts nothing), open when ``pending`` or ``partly_fulfilled``."""
    try:
        if not st.list("label_requests/"):
            return []
        reqs = [r for r in list_requests(st) if r.get("evaluation") == evaluation]
        labelled = _labelled_ids(labels_st) if reqs else set()
    except (StorageError, ValueError) as exc:
        log.warning("could not read label requests: %s", exc)
        return []
    out = []
    for r in reqs:
        p = progress(r, labelled)
        if p["status"] not in OPEN_STATUSES:
            continue
        out.append({"request_id": r.get("request_id"), "scope": r.get("scope"), "status": p["status"],
                    "n_labels": r.get("n_labels"), "window": r.get("window"), "deadline": r.get("deadline"),
                    "reasons": [x.get("reason") for x in r.get("reasons") or [] if isinstance(x, Mapping)]})
    return out


def drift_for_report(monitor: str, looks: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Looks of one linked monitor in the drift format of `flows.reports.evaluation.render_report`."""
    looks = [lk for lk in looks if lk.get("tau") is not None or lk.get("residual_shift") is not None]
    if not looks:
        return None
    shift = [lk.get("residual_shift") for lk in looks]
    return {"periods": [f"#{lk.get('look')} {lk.get('dt') or ''}".strip() for lk in looks],
            "kendall_tau": [lk.get("tau") for lk in looks],
            "residual_shift": shift if any(v is not None for v in shift) else None,
            "residual_shift_ci": ([list(lk["residual_shift_ci"]) if lk.get("residual_shift_ci") else None
                                   for lk in looks] if any(v is not None for v in shift) else None),
            "alarms": [bool(lk.get("alarm")) for lk in looks],
            "method": f"monitor {monitor}: alarms from its anytime-valid tests"}


def report_context(st: Storage, evaluation: str, window: str, run_key: str, result: Mapping[str, Any],
                   attempt: str, generated_at: str) -> dict[str, Any]:
    """What the run's report shows beyond its result: generated-at time, links (result.json, previous run,
    trend page, index), what changed since the previous run and the drift of linked monitors."""
    history = read_history(st, evaluation)
    cur = run_summary({"evaluation": evaluation, "window": window, "run_key": run_key, "result": result})
    prev = previous_run(history, window, run_key)
    up = "../../../"  # from results/<evaluation>/<window>/<run_key>/<attempt>/ to results/<evaluation>/
    drift = {}
    for mon, looks in linked_drift(st, evaluation).items():
        d = drift_for_report(mon, looks)
        if d is not None:
            drift[mon] = d
    return {
        "generated_at": generated_at,
        "result_href": "result.json",
        "trend_href": f"{up}trend.html",
        "index_href": f"{up}../index.html",
        "previous": None if prev is None else {
            "window": prev["window"], "run_key": prev["run_key"], "published_at": prev.get("published_at"),
            "href": f"{up}{prev['report_key'].split('/', 1)[1]}" if prev.get("report_key") else None},
        "changes": what_changed(prev, cur),
        "drift": drift,
        "attempt": attempt,
    }
