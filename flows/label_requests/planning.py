"""Turning triggers into request manifests (pure: nothing is written)."""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Mapping, Sequence

import numpy as np

from flows.label_requests.config import (DESIGN_RANK, MANIFEST_VERSION, PRIORITY, RequestConfig, current_time,
                                         iso_period, request_seed, stable_hash)
from flows.label_requests.sampling import sample
from flows.label_requests.triggers import (TriggerRows, as_arrow_table, label_prior_probability, segment_columns_of,
                                           triggers_of_rows, unwrap_result)


def _merge(triggers: Sequence[dict]) -> dict[str, dict]:
    """Merge triggers by scope: size = the largest, design = the most specific, all reasons kept."""
    merged: dict[str, dict] = {}
    for t in triggers:
        m = merged.setdefault(t["scope"], {"scope": t["scope"], "labels": 0, "design": "random", "reasons": [],
                                           "regions": None, "rule": None, "segment": None})
        if "segment" in t["detail"]:  # a segment x policy cell: its rows only
            m["segment"] = {k: t["detail"][k] for k in ("policy", "segment", "segments")}
        m["labels"] = max(m["labels"], t["labels"])
        if DESIGN_RANK[t["design"]] > DESIGN_RANK[m["design"]]:
            m["design"] = t["design"]
        if t["trigger"] == "thin_support":
            m["regions"], m["rule"] = t["detail"]["regions"], t["detail"]["rule"]
        m["reasons"].append({k: t[k] for k in ("trigger", "labels", "design", "reason", "detail")})
    return merged


def _pool(rows: TriggerRows, scope: str, result: Mapping, cfg: RequestConfig, exclude: set[str],
          segment: Mapping | None = None) -> np.ndarray:
    """Row indices a request of this scope may draw from: unlabelled, not pending elsewhere (``segment``: the
    policy's rows in the segment, or in the pooled segments of ``other``)."""
    ok = ~rows.labelled
    if exclude:
        ok &= ~rows.rid_in(exclude)
    if segment is not None:
        ok &= rows.policy_in(segment["policy"]) & rows.segment_in(segment["segments"])
    elif scope == "calibration":
        cal = (result.get("calibration") or {}).get("calibration_policies") or \
              (result.get("config") or {}).get("calibration_policies")
        if cal:
            ok &= rows.policy_in(list(cal))
    elif scope == "drift":
        ok &= rows.recent_dt(cfg.recent_days)
    else:
        ok &= rows.policy_in(scope)
    return np.flatnonzero(ok)


def _deduplicate(triggers: Sequence[dict], existing: Sequence[Mapping], evaluation: str | None
                 ) -> tuple[list[dict], list[dict], set[str], set[tuple[str, str]]]:
    """Triggers not already pending (or, for a drift look, not already raised), the skipped ones with
    reasons, and the response ids and (anchor set, anchor id) pairs pending in other requests."""
    pending = [e for e in existing if e.get("status") == "pending"]
    pending_ids = {r["response_id"] for e in pending for r in e.get("rows", [])}
    # drift requests are deduplicated per drift monitor (one anchor set each), others per scope
    pending_codes = {(e.get("evaluation"), e.get("scope"), r["trigger"],
                      (e.get("drift") or {}).get("monitor") if e.get("scope") == "drift" else None)
                     for e in pending for r in e.get("reasons", [])}
    pending_anchors = {(str((e.get("drift") or {}).get("set_name")), str(a.get("anchor_id"))) for e in pending
                       for a in e.get("anchors") or []}
    # a drift look raises at most one request, whatever became of it (reruns and repairs of a look)
    done_looks = {((e.get("drift") or {}).get("monitor"), (e.get("drift") or {}).get("look")): e
                  for e in existing if e.get("scope") == "drift" and (e.get("drift") or {}).get("monitor")}

    skipped = []
    fresh = []
    for t in triggers:
        mon = t["detail"].get("monitor") if t["scope"] == "drift" else None
        prior = done_looks.get((mon, t["detail"].get("look"))) if mon else None
        if prior is not None:
            skipped.append({"scope": t["scope"], "trigger": t["trigger"],
                            "reason": f"drift look {t['detail'].get('look')} of monitor {mon!r} already raised "
                                      f"request {prior.get('request_id')} ({prior.get('status')})"})
        elif (evaluation, t["scope"], t["trigger"], mon) in pending_codes:
            skipped.append({"scope": t["scope"], "trigger": t["trigger"],
                            "reason": "a request for this trigger and scope is still pending"
                                      + (f" (drift monitor {mon!r})" if mon else "")})
        else:
            fresh.append(t)
    return fresh, skipped, pending_ids, pending_anchors


def plan_requests(result: Mapping, logs: Any, config: Mapping | RequestConfig | None = None, *,
                  evaluation: str, window: str, run_key: str | None = None, logs_uri: str | None = None,
                  existing: Sequence[Mapping] = (), drift_look: Mapping | None = None,
                  anchor_ids: Sequence[str] | None = None, now: datetime | str | None = None,
                  budget_used: int | None = None) -> dict:
    """Turn a published result into label request manifests (pure: nothing is written).

    ``existing`` are the stored requests with their current status (`list_requests`): their
    pending rows are excluded from every pool, a trigger already pending for the same
    (evaluation, scope) is not raised again, and requests created in the current period count
    against ``max_labels_per_period`` (or ``budget_used`` labels, as read from the period's
    budget ledger, `flows.label_requests.budget`).

    Returns ``{"requests": [manifest, ...], "skipped": [{"scope", "reason", ...}], "triggers": [...]}``.
    """
    cfg = RequestConfig.from_dict(config)
    result, info = unwrap_result(result)
    anchor_ids = None if anchor_ids is None else [str(a) for a in anchor_ids]
    run_key = run_key or info.get("run_key")
    now_ = current_time(now)
    period = iso_period(now_)
    rows = TriggerRows.from_table(as_arrow_table(logs), segment_columns_of(result))
    triggers = triggers_of_rows(result, rows, cfg, drift_look, anchor_ids, info.get("undecided"))

    fresh, skipped, pending_ids, pending_anchors = _deduplicate(triggers, existing, evaluation)
    used = budget_used if budget_used is not None else sum(
        int(e.get("n_labels", 0)) for e in existing if e.get("period") == period)
    left = max(0, cfg.max_labels_per_period - used)
    merged = _merge(fresh)
    order = sorted(merged.values(), key=lambda m: min(PRIORITY[r["trigger"]] for r in m["reasons"]))
    conf = result.get("config") or {}
    requests = []
    taken: set[str] = set()
    for m in order:
        codes = sorted(r["trigger"] for r in m["reasons"])
        id_parts: list[Any] = [evaluation, window, run_key, m["scope"], codes]
        n_anchor = 0
        anchor_pool: list[str] = []
        drift_detail: dict = {}
        if m["scope"] == "drift":
            drift_detail = next((r["detail"] for r in m["reasons"] if r["trigger"] == "drift_alarm"), {})
            n_anchor = max(r["detail"].get("n_anchor_labels", 0) for r in m["reasons"])
            set_key = str(drift_detail.get("set_name"))
            anchor_pool = sorted({str(a) for a in anchor_ids or []} - {a for s, a in pending_anchors if s == set_key})
            if drift_detail.get("monitor"):
                id_parts += [drift_detail["monitor"], drift_detail.get("look")]  # one request per drift look
        request_id = f"lr-{now_:%Y%m%d}-{stable_hash(*id_parts)[:12]}"
        want = min(m["labels"], cfg.max_labels_per_request)
        n_target = min(want, left)
        if n_target <= 0 and not (n_anchor and anchor_pool and left > 0):
            skipped.append({"scope": m["scope"], "trigger": ",".join(codes), "labels": m["labels"],
                            "reason": f"label budget of period {period} exhausted ({used} of "
                                      f"{cfg.max_labels_per_period} already requested)"})
            continue
        pool = _pool(rows, m["scope"], result, cfg, pending_ids | taken, m["segment"])
        if pool.size == 0 and not (n_anchor and anchor_pool):
            skipped.append({"scope": m["scope"], "trigger": ",".join(codes),
                            "reason": "no unlabelled row left to request"
                                      + (" (and no anchor that is not pending already)" if n_anchor else "")})
            continue
        rule = m["rule"] or {}
        idx, p, strata = sample(rows.rid_rank[pool], rows.score[pool], n_target, m["design"],
                                request_seed(cfg.seed, request_id), n_strata=cfg.n_strata, regions=m["regions"],
                                bandwidth=float(rule.get("bandwidth", 0.0)), background_share=cfg.background_share)
        chosen = pool[idx]
        req_rows = _request_rows(rows, chosen, p, strata)
        # anchors take what the traffic rows leave of the request cap and of the period budget
        anchors = _sample_anchors(anchor_pool, min(n_anchor, max(0, cfg.max_labels_per_request - len(req_rows)),
                                                   max(0, left - len(req_rows))),
                                  request_seed(cfg.seed + 1, request_id))
        taken |= {r["response_id"] for r in req_rows}
        n_labels = len(req_rows) + len(anchors)
        note = _cap_note(cfg, m["labels"], want, left, n_target, len(req_rows), pool.size, len(anchors), n_anchor,
                         len(anchor_pool))
        left -= n_labels
        manifest = {
            "manifest_version": MANIFEST_VERSION, "request_id": request_id, "status": "pending",
            "evaluation": evaluation, "window": window, "run_key": run_key, "result_path": info.get("path"),
            "logs_uri": logs_uri, "scope": m["scope"], "design": m["design"],
            "design_detail": _design_text(m["design"], cfg, m["regions"], rule),
            "reasons": m["reasons"],
            "n_labels": n_labels, "labels_wanted": m["labels"], "note": note,
            "budget": {"period": period, "max_labels_per_period": cfg.max_labels_per_period,
                       "used_before": used, "this_request": n_labels,
                       "max_labels_per_request": cfg.max_labels_per_request,
                       "cost": n_labels * cfg.c_Y, "c_Y": cfg.c_Y},
            "label_scale": list(conf.get("label_scale") or [0.0, 1.0]),
            "seed": request_seed(cfg.seed, request_id), "pool_size": int(pool.size), "created_at": now_.isoformat(),
            "deadline": (now_ + timedelta(days=cfg.deadline_days)).isoformat(), "period": period,
            "rows": req_rows, "anchors": anchors,
        }
        if m["segment"] is not None:
            manifest["segment"] = dict(m["segment"], columns=segment_columns_of(result))
        if m["scope"] == "drift" and drift_detail:
            manifest["drift"] = {k: drift_detail.get(k) for k in (
                "monitor", "set_name", "anchors_version", "look", "look_key", "judge_id", "alarms", "new_alarms")}
            manifest["drift"]["n_anchors_in_set"] = len({str(a) for a in anchor_ids or []})
        used += n_labels
        requests.append(manifest)
    return {"requests": requests, "skipped": skipped, "triggers": triggers}


def _request_rows(rows: TriggerRows, chosen: np.ndarray, p: np.ndarray, strata: np.ndarray) -> list[dict]:
    """Manifest rows of the chosen pool rows, with selection and inclusion probabilities."""
    vals = rows.take(chosen)
    prior = {pol: label_prior_probability(rows, pol) for pol in set(vals["policy"])}
    out = []
    for j, (i, pi, s) in enumerate(zip(chosen, p, strata)):
        pol = str(vals["policy"][j])
        dt = None if vals["dt"] is None else vals["dt"][j]
        out.append({
            "response_id": str(vals["response_id"][j]), "policy": pol,
            "prompt_id": None if vals["prompt_id"] is None else str(vals["prompt_id"][j]),
            "judge_score": float(rows.score[i]),
            "dt": None if dt is None else str(dt),
            "stratum": int(s), "selection_probability": float(pi),
            "prior_probability": prior[pol], "inclusion_probability": float(pi * prior[pol]),
        })
    return out


def _sample_anchors(pool: Sequence[str], k: int, seed: int) -> list[dict]:
    """A simple random sample of ``k`` anchors of the pool (``selection_probability = k / N``)."""
    k = min(int(k), len(pool))
    if k <= 0:
        return []
    ids = np.array(pool, dtype=object)
    pick = np.random.default_rng(seed).choice(ids.size, size=k, replace=False)
    return [{"anchor_id": str(ids[j]), "selection_probability": k / ids.size} for j in np.sort(pick)]


def _cap_note(cfg: RequestConfig, labels: int, want: int, left: int, n_target: int, n_rows: int, pool_size: int,
              n_anchors: int, n_anchor_wanted: int, anchor_pool: int) -> str | None:
    """What limited a request (None when nothing did)."""
    caps = []
    if n_anchors < n_anchor_wanted:
        caps.append(f"anchors: {n_anchors} of {n_anchor_wanted} ({anchor_pool} anchor(s) not pending "
                    f"elsewhere, request cap and period budget)")
    if labels > cfg.max_labels_per_request:
        caps.append(f"max_labels_per_request={cfg.max_labels_per_request}")
    if left < want:
        caps.append(f"the period budget ({left} label(s) left of {cfg.max_labels_per_period})")
    if n_rows < n_target:
        caps.append(f"the pool ({pool_size} unlabelled row(s) not pending elsewhere)")
    return f"requested {n_rows} of {labels} label(s); limited by " + ", ".join(caps) if caps else None


def _design_text(design: str, cfg: RequestConfig, regions: Any, rule: Mapping) -> str:
    if design == "random":
        return "simple random sample of the pool; selection_probability = n / N"
    if design == "stratified":
        return (f"stratified by judge score: {cfg.n_strata} quantile strata of the pool, proportional allocation "
                f"(at least one per stratum), simple random sample within; selection_probability = n_h / N_h")
    return (f"targeted: for each thin score value, its label deficit drawn from pool rows within "
            f"+/-{float(rule.get('bandwidth', 0)):g} of it (stratum = region index); {cfg.background_share:.0%} "
            f"drawn from the rest of the pool (stratum -1); selection_probability = n_h / N_h")
