"""The per-period label budget, taken atomically with create-only ledger entries.

Layout under the requests root::

    label_requests/_budget/<period>/000001.json    {"seq", "request_ids", "labels", "per_request",
    label_requests/_budget/<period>/000002.json     "used_before", "limit", "created_at", ...}

Every entry records labels reserved for one or more requests of the period (an ISO week).  A
writer (1) reads the ledger: ``N`` entries, ``used`` labels; (2) plans its requests with
``limit - used`` labels left; (3) creates entry ``N + 1`` with `Storage.put_if_absent` (a hard link
locally, ``If-None-Match: *`` on S3, the same primitive publishing uses).  The entry key depends on
``N`` only, so of two writers that read the same ledger exactly one creates ``N + 1``; the other
gets ``False``, reads the ledger again and re-plans against what is left.  Hence the sum of the
entries never exceeds the limit, whatever the number of threads, processes or hosts.  The manifest
is written after its reservation; until it exists, the entry's copy of the request's ids keeps
other writers from requesting the same rows (for `INFLIGHT_SECONDS`).  The entry keeps the whole
manifest: a writer that dies in between is resumed by the retry of the same run, which writes the
reserved manifest (`LabelBudget.unwritten`) instead of planning again (the pending reservation would
hide the trigger), so the ledger equals the stored requests; without a retry the labels stay reserved
but never requested: the budget is under-spent, never over-spent.

Requests created before the ledger existed (no entry names them) still count, by their manifest.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

from cje_engine.errors import CJEInputError

from flows.label_requests.config import PREFIX

log = logging.getLogger(__name__)

#: A reservation without its manifest after this long belongs to a writer that died: its labels stay
#: spent, its rows become requestable again.
INFLIGHT_SECONDS = 600.0
_ENTRY_RE = re.compile(r"^(\d{6})\.json$")
_PERIOD_RE = re.compile(r"^\d{4}-W\d{2}$")


@dataclass(frozen=True)
class BudgetSnapshot:
    """What the ledger of a period held when it was read."""

    period: str
    seq: int
    used: int
    reserved: dict[str, int]
    #: requests reserved in the ledger whose manifest is not stored (yet): their rows count as pending
    inflight: tuple[dict, ...] = ()

    def left(self, limit: int) -> int:
        """Labels left under ``limit`` in this period (never negative)."""
        return max(0, int(limit) - self.used)


class LabelBudget:
    """The ledger of one budget period (see the module docstring).

    Parameters
    ----------
    st : Storage
        The requests root.
    period : str
        ISO week, e.g. ``2025-W10``.
    prefix : str
        Folder of the requests (default ``label_requests``).
    """

    def __init__(self, st: Any, period: str, prefix: str = PREFIX) -> None:
        if not _PERIOD_RE.match(str(period)):
            raise CJEInputError(f"budget period {period!r} is not an ISO week like 2025-W10")
        self.st = st
        self.period = str(period)
        self.prefix = prefix

    def _key(self, seq: int) -> str:
        return f"{self.prefix}/_budget/{self.period}/{seq:06d}.json"

    def entries(self) -> list[dict]:
        """The ledger's entries in sequence order."""
        out = []
        for info in self.st.list(f"{self.prefix}/_budget/{self.period}/"):
            m = _ENTRY_RE.match(info.key.rsplit("/", 1)[-1])
            if not m:
                continue
            try:
                out.append(json.loads(self.st.read_bytes(info.key)))
            except ValueError:
                raise CJEInputError("label budget entry is not valid JSON", source=self.st.url(info.key)) from None
        out.sort(key=lambda e: int(e["seq"]))
        return out

    def snapshot(self, existing: Sequence[Mapping] = ()) -> BudgetSnapshot:
        """Entries so far, labels used (ledger plus requests of the period it does not name)."""
        entries = self.entries()
        reserved: dict[str, int] = {}
        for e in entries:
            reserved.update({str(k): int(v) for k, v in (e.get("per_request") or {}).items()})
        used = sum(int(e.get("labels", 0)) for e in entries)
        used += sum(int(m.get("n_labels", 0)) for m in existing
                    if m.get("period") == self.period and m.get("request_id") not in reserved)
        seq = max((int(e["seq"]) for e in entries), default=0)
        stored = {m.get("request_id") for m in existing}
        now = datetime.now(timezone.utc)
        inflight = tuple(dict(r, status="pending") for e in entries for r in e.get("requests") or []
                         if r.get("request_id") not in stored
                         and (now - datetime.fromisoformat(e["created_at"])).total_seconds() < INFLIGHT_SECONDS)
        return BudgetSnapshot(self.period, seq, used, reserved, inflight)

    def unwritten(self, existing: Sequence[Mapping] = ()) -> list[dict]:
        """The manifests reserved in this ledger whose request was never written (``existing``: the stored
        requests): what a writer killed between its reservation and its manifest left undone.  Entries
        written before the ledger kept the whole manifest are left out."""
        stored = {m.get("request_id") for m in existing}
        return [dict(r["manifest"]) for e in self.entries() for r in e.get("requests") or []
                if r.get("request_id") not in stored and isinstance(r.get("manifest"), Mapping)]

    def take(self, snap: BudgetSnapshot, manifests: Sequence[Mapping], limit: int, *,
             evaluation: str | None = None) -> bool:
        """Reserve the labels of ``manifests`` as entry ``snap.seq + 1``; False when another writer got it.

        Raises `CJEInputError` when the manifests ask for more than ``snap`` left (a planning bug,
        never written).
        """
        per = {str(m["request_id"]): int(m["n_labels"]) for m in manifests}
        total = sum(per.values())
        if total > snap.left(limit):
            raise CJEInputError(f"label budget {self.period}: {total} label(s) asked, {snap.left(limit)} left of "
                                f"{limit}")
        entry = {"seq": snap.seq + 1, "period": self.period, "request_ids": sorted(per), "per_request": per,
                 "labels": total, "used_before": snap.used, "limit": int(limit), "evaluation": evaluation,
                 "created_at": datetime.now(timezone.utc).isoformat(),
                 "requests": [_summary(m) for m in manifests]}
        ok = bool(self.st.put_if_absent(self._key(snap.seq + 1), json.dumps(entry, indent=1, sort_keys=True).encode()))
        if ok:
            log.info("label budget %s: reserved %d label(s) (%d used before, limit %d) for %s", self.period, total,
                     snap.used, limit, ", ".join(sorted(per)))
        return ok


def _summary(m: Mapping) -> dict:
    """What deduplication needs of a reserved request before its manifest exists."""
    drift = m.get("drift") or {}
    return {"request_id": m["request_id"], "evaluation": m.get("evaluation"), "scope": m.get("scope"),
            "window": m.get("window"), "run_key": m.get("run_key"), "manifest": dict(m),
            "period": m.get("period"), "n_labels": int(m["n_labels"]),
            "reasons": [{"trigger": r.get("trigger")} for r in m.get("reasons") or []],
            "drift": {k: drift.get(k) for k in ("monitor", "set_name", "look")} if drift else None,
            "rows": [{"response_id": r["response_id"]} for r in m.get("rows") or []],
            "anchors": [{"anchor_id": a["anchor_id"]} for a in m.get("anchors") or []]}


__all__ = ["LabelBudget", "BudgetSnapshot"]
