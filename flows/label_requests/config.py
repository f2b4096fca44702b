"""Settings of automatic label requests and the small helpers every module shares."""
from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import datetime, timezone
from typing import Any, Mapping

import numpy as np

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from cje_engine.errors import CJEInputError
from flows.config import did_you_mean, raised_input_error
from flows.uris import check_webhook_url

PREFIX = "label_requests"
MANIFEST_VERSION = 1
TRIGGERS = ("audit_failed", "no_own_labels", "audit_inconclusive", "drift_alarm", "thin_support", "under_labelled",
            "regression_undecided", "segment_audit_inconclusive", "segment_undecided")
#: Design chosen for each trigger; a merged request uses the most specific (targeted > stratified > random).
DESIGN_OF = {"audit_failed": "stratified", "no_own_labels": "stratified", "audit_inconclusive": "stratified",
             "drift_alarm": "stratified", "thin_support": "targeted", "under_labelled": "stratified",
             "regression_undecided": "stratified", "segment_audit_inconclusive": "stratified",
             "segment_undecided": "stratified"}
DESIGNS = ("random", "stratified", "targeted")
#: Sampling designs from the simplest up: merged requests keep the highest.
DESIGN_RANK = {"random": 0, "stratified": 1, "targeted": 2}
#: A label request id: ``lr-<YYYYMMDD>-<12 hex digits>``.
REQUEST_ID_RE = re.compile(r"^lr-\d{8}-[0-9a-f]{12}$")


# --------------------------------------------------------------------------------------
# configuration


def _whole(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise CJEInputError(f"label request setting {name} must be a whole number >= {lo}, got {v!r}")
    return int(v)


def _positive(name: str, v: Any, allow_zero: bool = False) -> float:
    ok = isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and math.isfinite(float(v))
    if not ok or float(v) < 0 or (float(v) == 0 and not allow_zero):
        raise CJEInputError(f"label request setting {name} must be a number {'>=' if allow_zero else '>'} 0, "
                            f"got {v!r}")
    return float(v)


class RequestConfig(BaseModel):
    """Settings of automatic label requests (all optional; JSON-ready via `to_dict`).

    Parameters
    ----------
    max_labels_per_period : int
        Budget: labels requested per ISO week (all requests created that week count).
    max_labels_per_request : int
        Cap of one request.
    deadline_days : float
        A request not fulfilled this many days after creation is ``expired``.
    c_S, c_Y : float
        Cost of one judged response and of one oracle label (square-root law).
    target_se : float, optional
        SE a recalibrated level should reach; default ``audit_margin / z_{1-alpha/2}``
        (95% CI half-width equal to the audit margin).
    share_margin : float
        ``under_labelled`` fires when calibration share > oracle budget share + this.
    new_policy_labels : int, optional
        Labels for a policy without own labels; default sized so that a pass is reachable
        (module docs).
    drift_traffic_labels, drift_anchor_labels : int
        Sizes of a drift request (recent traffic rows; anchors when anchor ids are given).
    recent_days : int
        "Recent traffic" = the last ``recent_days`` log dates present.
    background_share : float
        Share of a targeted request drawn from outside the targeted score regions (keeps
        every unlabelled row's probability positive, hence the estimates unbiased).
    n_strata : int
        Score strata of a stratified design.
    seed : int
    triggers : list of str
        Enabled trigger rules.
    labels_uri : str, optional
        Label store to join when the logs are given as a URI (default: the logs URI).
    requests_uri : str, optional
        Where requests live (default: the results URI).
    webhook_url : str, optional
        Notification receiver (default ``$CJE_WEBHOOK_URL``).
    notify : bool
        Send ``label_request`` notifications.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_labels_per_period: int = 2000
    max_labels_per_request: int = 500
    deadline_days: float = 7.0
    c_S: float = 1.0
    c_Y: float = 16.0
    target_se: float | None = None
    share_margin: float = 0.05
    new_policy_labels: int | None = None
    drift_traffic_labels: int = 100
    drift_anchor_labels: int = 50
    recent_days: int = 1
    background_share: float = 0.2
    n_strata: int = 5
    seed: int = 0
    triggers: tuple[str, ...] = TRIGGERS
    labels_uri: str | None = None
    requests_uri: str | None = None
    webhook_url: str | None = None
    notify: bool = True

    @field_validator("max_labels_per_period", "max_labels_per_request", "drift_traffic_labels",
                     "drift_anchor_labels", "seed", mode="before")
    @classmethod
    def _whole_from_0(cls, v: Any, info: ValidationInfo) -> int:
        return _whole(info.field_name, v, 0)

    @field_validator("recent_days", "n_strata", mode="before")
    @classmethod
    def _whole_from_1(cls, v: Any, info: ValidationInfo) -> int:
        return _whole(info.field_name, v, 1)

    @field_validator("new_policy_labels", mode="before")
    @classmethod
    def _new_policy_labels(cls, v: Any, info: ValidationInfo) -> int | None:
        return None if v is None else _whole(info.field_name, v, 1)

    @field_validator("deadline_days", "c_S", "c_Y", mode="before")
    @classmethod
    def _positive(cls, v: Any, info: ValidationInfo) -> float:
        return _positive(info.field_name, v)

    @field_validator("target_se", mode="before")
    @classmethod
    def _target_se(cls, v: Any, info: ValidationInfo) -> float | None:
        return None if v is None else _positive(info.field_name, v)

    @field_validator("share_margin", mode="before")
    @classmethod
    def _share_margin(cls, v: Any, info: ValidationInfo) -> float:
        return _positive(info.field_name, v, allow_zero=True)

    @field_validator("background_share", mode="before")
    @classmethod
    def _background_share(cls, v: Any) -> float:
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and 0 <= v < 1):
            raise CJEInputError(f"label request setting background_share must be in [0, 1), got {v!r}")
        return float(v)

    @field_validator("webhook_url", mode="before")
    @classmethod
    def _webhook_url(cls, v: Any) -> Any:
        return None if v is None else check_webhook_url(v, "label request setting webhook_url")

    @field_validator("triggers", mode="before")
    @classmethod
    def _triggers(cls, v: Any) -> tuple[str, ...]:
        trig = (v,) if isinstance(v, str) else tuple(v) if isinstance(v, (list, tuple)) else v
        if not isinstance(trig, tuple):
            raise CJEInputError(f"label request setting triggers must be a list of trigger names, got {v!r}")
        bad = [t for t in trig if t not in TRIGGERS]
        if bad:
            raise CJEInputError(f"unknown label request trigger(s) {bad}; expected some of {list(TRIGGERS)}")
        return trig

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | "RequestConfig" | None) -> "RequestConfig":
        """From a mapping (e.g. the ``label_requests`` entry of an evaluation); errors name the key.

        Raises
        ------
        CJEInputError
            One line naming the setting (an unknown one with a did-you-mean hint) and what was expected.
        """
        if d is None:
            return cls()
        if isinstance(d, RequestConfig):
            return d
        if not isinstance(d, Mapping):
            raise CJEInputError(f"label request settings must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(map(str, d)) - set(cls.model_fields))
        if unknown:
            raise CJEInputError(f"unknown label request setting(s) {unknown}{did_you_mean(unknown[0], cls.model_fields)}; "
                                f"expected some of {sorted(cls.model_fields)}")
        try:
            return cls.model_validate(dict(d))
        except ValidationError as exc:
            inner = raised_input_error(exc, tuple(cls.model_fields))
            if inner is not None:
                raise inner from None
            err = exc.errors(include_url=False)[0]
            raise CJEInputError(f"label request setting {'.'.join(map(str, err['loc']))}: {err['msg']}, got "
                                f"{err.get('input')!r}") from None

    def to_dict(self) -> dict:
        """The settings, JSON-ready."""
        out = self.model_dump()
        out["triggers"] = list(self.triggers)
        return out


# --------------------------------------------------------------------------------------
# small helpers


def iso_period(when: datetime) -> str:
    """ISO week of a UTC time, e.g. ``2025-W09`` (the budget period)."""
    y, w, _ = when.astimezone(timezone.utc).isocalendar()
    return f"{y}-W{w:02d}"


def current_time(now: datetime | str | None) -> datetime:
    """``now`` as an aware UTC datetime (an ISO string parsed, a naive time read as UTC); the clock when None."""
    if now is None:
        return datetime.now(timezone.utc)
    if isinstance(now, str):
        now = datetime.fromisoformat(now)
    return now if now.tzinfo else now.replace(tzinfo=timezone.utc)


def stable_hash(*parts: Any) -> str:
    """sha256 hex digest of ``parts`` as canonical JSON (sorted keys): the same on every host and run."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def request_seed(seed: int, request_id: str) -> int:
    """The sampling seed of one request: a 64-bit integer derived from the configured seed and its id."""
    return int(stable_hash(seed, request_id)[:16], 16)


PRIORITY = {t: i for i, t in enumerate(TRIGGERS)}
