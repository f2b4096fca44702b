"""Drift monitor state in storage: create-only state objects, look objects and a pointer.

Layout under ``drift/<monitor>/`` (nothing is ever overwritten but the pointer and the report)::

    states/00000001.json   full state after commit 1 (monitor.to_dict() + bookkeeping + new looks)
    states/00000002.json   ...                      (create-only: a concurrent run loses cleanly)
    state.json             pointer {"seq", "key", "n_looks", ...} (replaced atomically)
    looks/000001.json      DriftLook.to_dict() of look 1 (create-only)
    report.html            timeline of all looks

Loading takes the highest ``states/`` object (the pointer is a hint), so a run that died between
its commit and the pointer is completed by the next one (`repair`).
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any

from cje_engine.drift.monitor import DriftMonitor
from cje_engine.errors import CJEInputError
from flows.storage.anchors import check_name
from flows.storage.objects import NotFoundError, Storage

log = logging.getLogger(__name__)

DRIFT = "drift"
STATE_FORMAT = 1
_STATE_RE = re.compile(r"^(\d{8})\.json$")
_LOOK_RE = re.compile(r"^(\d{6})\.json$")

__all__ = ["DRIFT", "STATE_FORMAT", "DriftStateConflict", "state_prefix", "load_state", "read_looks",
           "latest_look", "commit_state", "repair", "look_key"]


class DriftStateConflict(RuntimeError):
    """Another run committed the monitor's next state first; rerun to continue from it."""

    #: Final for this run (`flows.runtime.retries`): a retry would conflict the same way.
    retryable = False


def state_prefix(monitor: str) -> str:
    """``drift/<monitor>/``."""
    return f"{DRIFT}/{check_name(monitor, 'monitor name')}/"


def look_key(monitor: str, look: int) -> str:
    """Object key of a stored look."""
    return f"{state_prefix(monitor)}looks/{int(look):06d}.json"


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
        k = look_key(monitor, lk["look"])
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


def repair(st: Storage, monitor: str, state: dict) -> list[dict]:
    """Finish a commit whose looks or pointer were not written; returns the looks rewritten."""
    missing = [lk for lk in state.get("new_looks") or []
               if not st.exists(look_key(monitor, lk["look"]))]
    if missing:
        _write_looks(st, monitor, missing)
    ptr = _read_json(st, state_prefix(monitor) + "state.json")
    if ptr is None or int(ptr.get("seq", -1)) != int(state["seq"]):
        _write_pointer(st, monitor, state, state["_key"])
    if missing:
        log.warning("drift monitor %s: completed an interrupted commit (%d look(s) rewritten)", monitor, len(missing))
    return missing
