"""Stored requests: create-only manifests, fulfilment markers, live status."""
from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any, Mapping

from cje_engine.errors import CJEInputError

from flows.label_requests.config import _ID_RE, PREFIX, _now
from flows.storage.objects import Storage, StorageConfig

log = logging.getLogger(__name__)


def _storage(uri: str, cfg: Any):
    if isinstance(cfg, Mapping):
        cfg = StorageConfig.from_dict(cfg)
    elif cfg is None:
        cfg = StorageConfig.from_env()
    return Storage.for_uri(uri, cfg)


def request_key(request_id: str, prefix: str = PREFIX) -> str:
    return f"{prefix}/{request_id}.json"


def status_key(request_id: str, prefix: str = PREFIX) -> str:
    return f"{prefix}/_status/{request_id}.json"


def status_of(manifest: Mapping, marker: Mapping | None, now: datetime | str | None = None) -> str:
    """``fulfilled`` (a marker exists), ``expired`` (deadline passed) or ``pending``."""
    if marker is not None:
        return str(marker.get("status", "fulfilled"))
    if _now(now) > datetime.fromisoformat(str(manifest["deadline"])):
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
    if not _ID_RE.match(str(manifest.get("request_id", ""))):
        raise CJEInputError(f"bad request id {manifest.get('request_id')!r}")
    body = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode()
    return bool(st.put_if_absent(request_key(manifest["request_id"], prefix), body))


def mark_fulfilled(st: Any, request_id: str, detail: Mapping, prefix: str = PREFIX) -> bool:
    """Create the fulfilment marker (idempotent: False when it exists already)."""
    body = json.dumps({"status": "fulfilled", **dict(detail)}, indent=1, sort_keys=True, default=str).encode()
    return bool(st.put_if_absent(status_key(request_id, prefix), body))
