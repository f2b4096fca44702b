"""Stored requests: create-only manifests, fulfilment markers, live status."""
from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any, Mapping

from cje_engine.errors import CJEInputError

from flows.label_requests.config import PREFIX, REQUEST_ID_RE, current_time
from flows.storage.objects import Storage, StorageConfig

log = logging.getLogger(__name__)


def storage_for(uri: str, cfg: Any):
    """`Storage.for_uri` with ``cfg`` a `StorageConfig`, its dict form (a flow parameter) or None (the environment)."""
    if isinstance(cfg, Mapping):
        cfg = StorageConfig.from_dict(cfg)
    elif cfg is None:
        cfg = StorageConfig.from_env()
    return Storage.for_uri(uri, cfg)


def request_key(request_id: str, prefix: str = PREFIX) -> str:
    """Storage key of the manifest of request ``request_id``."""
    return f"{prefix}/{request_id}.json"


def status_key(request_id: str, prefix: str = PREFIX) -> str:
    """Storage key of the status marker of request ``request_id``."""
    return f"{prefix}/_status/{request_id}.json"


def status_of(manifest: Mapping, marker: Mapping | None, now: datetime | str | None = None) -> str:
    """``fulfilled`` (a marker exists), ``expired`` (deadline passed) or ``pending``."""
    if marker is not None:
        return str(marker.get("status", "fulfilled"))
    if current_time(now) > datetime.fromisoformat(str(manifest["deadline"])):
        return "expired"
    return "pending"


def list_requests(st: Any, *, status: str | None = None, now: datetime | str | None = None,
                  prefix: str = PREFIX) -> list[dict]:
    """Stored requests with their current ``status`` (and ``fulfilment`` marker), oldest first."""
    markers = {}
    for info in st.list(f"{prefix}/_status/"):
        rid = info.key.rsplit("/", 1)[-1][:-5]
        markers[rid] = json.loads(st.read_bytes(info.key))
    out = []
    for info in st.list(f"{prefix}/"):
        name = info.key[len(prefix) + 1:]
        if "/" in name or not name.endswith(".json"):
            continue
        try:
            m = json.loads(st.read_bytes(info.key))
        except ValueError:
            log.warning("label request %s is not valid JSON; ignored", st.url(info.key))
            continue
        m["status"] = status_of(m, markers.get(m.get("request_id")), now)
        if m.get("request_id") in markers:
            m["fulfilment"] = markers[m["request_id"]]
        out.append(m)
    if status is not None:
        out = [m for m in out if m["status"] == status]
    out.sort(key=lambda m: (str(m.get("created_at")), str(m.get("request_id"))))
    return out


def write_request(st: Any, manifest: Mapping, prefix: str = PREFIX) -> bool:
    """Create the manifest (create-only); False when a request with this id exists already."""
    if not REQUEST_ID_RE.match(str(manifest.get("request_id", ""))):
        raise CJEInputError(f"bad request id {manifest.get('request_id')!r}")
    body = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode()
    return bool(st.put_if_absent(request_key(manifest["request_id"], prefix), body))


def mark_fulfilled(st: Any, request_id: str, detail: Mapping, prefix: str = PREFIX) -> bool:
    """Create the fulfilment marker (idempotent: False when it exists already)."""
    body = json.dumps({"status": "fulfilled", **dict(detail)}, indent=1, sort_keys=True, default=str).encode()
    return bool(st.put_if_absent(status_key(request_id, prefix), body))


def progress(manifest: Mapping, labelled: set[str], anchors_done: set[tuple[str, str]] | None = None) -> dict:
    """How far a request is: requested vs received rows and anchors, and its live status.

    ``labelled`` are the response ids the label store has; ``anchors_done`` the ``(set_name,
    anchor_id)`` pairs labelled since requests were raised (None: the anchor set is unknown, anchors
    count as not received).  Status: ``fulfilled`` (marker, or everything received), ``expired``,
    ``partly_fulfilled`` (something received, deadline not passed) or ``pending``.
    """
    rows = [str(r["response_id"]) for r in manifest.get("rows") or []]
    set_name = str((manifest.get("drift") or {}).get("set_name"))
    anchors = [str(a["anchor_id"]) for a in manifest.get("anchors") or []]
    got_rows = sum(1 for r in rows if r in labelled)
    got_anchors = sum(1 for a in anchors if anchors_done and (set_name, a) in anchors_done)
    requested, received = len(rows) + len(anchors), got_rows + got_anchors
    status = str(manifest.get("status", "pending"))
    if status == "pending" and requested and received == requested:
        status = "fulfilled"
    elif status == "pending" and received:
        status = "partly_fulfilled"
    return {"request_id": manifest.get("request_id"), "evaluation": manifest.get("evaluation"),
            "window": manifest.get("window"), "scope": manifest.get("scope"), "status": status,
            "triggers": [r.get("trigger") for r in manifest.get("reasons") or []],
            "requested": requested, "received": received, "rows": len(rows), "rows_received": got_rows,
            "anchors": len(anchors), "anchors_received": got_anchors if anchors_done is not None else None,
            "created_at": manifest.get("created_at"), "deadline": manifest.get("deadline")}


def summarize(items: list[dict]) -> dict:
    """Counts per status and per reason (trigger) over `progress` items.

    A request merged from several reasons holds its labels once: ``by_reasons`` groups requests by
    their set of triggers (``"audit_failed+thin_support"``), each request once, so its counts add up
    to the totals; ``by_reason`` lists each trigger with the requests that carry it (a request counts
    once under each of its distinct triggers, never once per reason entry).
    """
    by_status: dict[str, int] = {}
    by_reason: dict[str, dict] = {}
    by_reasons: dict[str, dict] = {}

    def count(into: dict, key: str, p: dict) -> None:
        r = into.setdefault(key, {"requests": 0, "requested": 0, "received": 0})
        r["requests"] += 1
        r["requested"] += p["requested"]
        r["received"] += p["received"]

    for p in items:
        by_status[p["status"]] = by_status.get(p["status"], 0) + 1
        triggers = sorted({str(t) for t in p["triggers"]})
        for t in triggers:
            count(by_reason, t, p)
        count(by_reasons, "+".join(triggers) or "none", p)
    return {"requests": len(items), "by_status": by_status, "by_reason": by_reason, "by_reasons": by_reasons,
            "requested": sum(p["requested"] for p in items), "received": sum(p["received"] for p in items)}
