"""The saved state of a `cje_engine.drift.monitor.DriftMonitor`: plain JSON, checked on load."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cje_engine.drift.inputs import jsonable
from cje_engine.errors import CJEInputError

#: 2 added ``recent`` (scores of the last looks for the rank metric) and ``config.rank_window``.
STATE_VERSION = 2
_READABLE = (1, 2)


def state_dict(config: dict[str, Any], n_looks: int, first_alarm: dict[str, int | None],
               history: list[dict[str, Any]], recent: list[dict[str, float]]) -> dict[str, Any]:
    """The state as plain JSON data."""
    return jsonable({
        "state_version": STATE_VERSION,
        "config": config,
        "n_looks": n_looks,
        "first_alarm": dict(first_alarm),
        "history": list(history),
        "recent": list(recent),
    })


def check_state(state: Any, metrics: Sequence[str], source: str) -> tuple[dict, int, dict, list, list]:
    """Validate a saved state; returns ``(config, n_looks, first_alarm, history, recent)``.

    A version-1 state (before the rank window) reads as a monitor with ``rank_window=1`` and the
    version-1 weights, so that a running monitor keeps its error budget.
    """
    if not isinstance(state, Mapping):
        raise CJEInputError(f"monitor state must be a mapping, got {type(state).__name__}", source=source)
    for key in ("state_version", "config", "n_looks", "first_alarm", "history"):
        if key not in state:
            raise CJEInputError(f"monitor state lacks key '{key}'", source=source, column=key)
    version = state["state_version"]
    if version not in _READABLE:
        raise CJEInputError(f"monitor state version {version!r} is not supported (expected one of {_READABLE})",
                            source=source, column="state_version")
    cfg = dict(state["config"])
    if version == 1:
        cfg.setdefault("rank_window", 1)
    n_looks = state["n_looks"]
    if not isinstance(n_looks, int) or n_looks < 0:
        raise CJEInputError(f"n_looks must be a non-negative integer, got {n_looks!r}", source=source,
                            column="n_looks")
    first = dict(state["first_alarm"])
    if set(first) != set(metrics):
        raise CJEInputError(f"first_alarm must have keys {list(metrics)}, got {sorted(first)}", source=source,
                            column="first_alarm")
    recent = state.get("recent", [])
    if not isinstance(recent, list) or not all(isinstance(r, Mapping) for r in recent):
        raise CJEInputError("recent must be a list of anchor_id -> score mappings", source=source, column="recent")
    first_alarm = {m: (None if first[m] is None else int(first[m])) for m in metrics}
    return cfg, n_looks, first_alarm, list(state["history"]), [dict(r) for r in recent]
