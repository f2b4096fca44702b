"""The service's configuration: ONE validated model of ``evaluations.yaml``.

``load_config(path)`` reads the file once (`read_yaml`, the one YAML loader) and validates
every entry with pydantic before anything starts (no Prefect server, no Ray, no storage
call):

* ``evaluations:`` - `EvaluationConfig` (engine options parsed ONCE, by `engine_options`, into
  `cje_engine.options.EvaluationOptions` or the off-policy options: the object the engine receives,
  docs/architecture.md "One option, YAML to engine");
* ``drift_monitors:`` - `DriftMonitorConfig` (``monitor:`` typed by `DriftMonitorOptions`, then checked
  by `cje_engine.drift.monitor.DriftMonitor`).

Every model is pydantic v2, strict, ``extra="forbid"`` (also `flows.label_requests.config.RequestConfig`
and `flows.pipelines.drift_config.DriftSettings`, which share their keys with these models).

The file is read with `StrictLoader` (a safe loader): a key repeated in a mapping at any level is an
error naming the key and both lines, and an alias bomb (more than `MAX_YAML_VALUES` values once aliases
are expanded, more than `MAX_YAML_ALIASES` aliases, a recursive alias) is refused before any value is
built.  Webhook URLs (``label_requests.webhook_url``) pass `check_webhook_url`: ``http``/``https`` only,
never a link-local or cloud-metadata address.

Checks: unknown keys are errors with a did-you-mean hint; types are strict (``interval: true``,
``n_bootstrap: "abc"`` and ``alpha: "0.05"`` are refused, not coerced); ranges (seed >= 0,
``n_bootstrap`` <= `cje_engine.options.MAX_N_BOOTSTRAP`, windows of 1 to `MAX_WINDOW_DAYS`
days, ``interval`` >= `MIN_INTERVAL_SECONDS`); names are valid result-path segments by the
publisher's own rule (`flows.storage.publish`), so a run never computes for an hour and then
fails to publish; URIs carry no credentials (`check_uri`: credentials come from the
environment - ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, a profile or an instance role -
and never travel as flow parameters, which Prefect stores).

``columns:`` (top level, and on each evaluation): canonical log column -> the column name in your
logs, e.g. ``{prompt_id: id, policy: model, judge_score: judge, oracle_label: human_rating}``.
The top-level mapping is every evaluation's default (and `cje evaluate`'s); an evaluation's own
mapping overrides it key by key (``key: null`` drops a default key).  Keys are the engine's
canonical columns (`cje_engine.data.io.CANONICAL`), ``ts``, or (per evaluation) a declared
covariate; no column may be mapped twice (`check_columns`, did-you-mean hints).

Every error is a one-line `CJEInputError` naming the file, the entry and the key.

Windows (`parse_window`, `Window`, `as_date`) live here too: they are configuration, and the
flows, the label ingestion and the checks above share them.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, WithJsonSchema, field_validator
from pydantic_core import PydanticCustomError

from cje_engine.data.io import check_mapping
from cje_engine.errors import CJEInputError, did_you_mean
from cje_engine.options import EvaluationOptions
from flows.storage.logs import SERVICE_COLUMNS, as_date
from flows.uris import check_uri, check_webhook_url

#: Default location of the declarations: the repository root.
DEFAULT_FILE = Path(__file__).resolve().parents[1] / "evaluations.yaml"
#: Shortest schedule interval (seconds): shorter ones pile up flow runs faster than they finish.
MIN_INTERVAL_SECONDS = 60.0
#: Longest schedule interval (seconds): one year.
MAX_INTERVAL_SECONDS = 366 * 86400.0
#: Longest evaluation window (days): ten years of daily partitions.
MAX_WINDOW_DAYS = 3660
#: Most windows in a baseline period or a pooled test (``monitoring:``).
MAX_BASELINE_WINDOWS = 366


# --------------------------------------------------------------------------------------
# dates and windows


@dataclass(frozen=True)
class Window:
    """An inclusive range of log dates."""

    start: date
    end: date

    @property
    def label(self) -> str:
        """Path-safe name used in result paths: ``YYYY-MM-DD_YYYY-MM-DD``."""
        return f"{self.start.isoformat()}_{self.end.isoformat()}"

    @property
    def days(self) -> int:
        """Number of days in the window, both ends included."""
        return (self.end - self.start).days + 1


# "last N days" with optional _ or - separators; the sign is captured so "last -3 days" is refused.
_LAST_RE = re.compile(r"^\s*last(?:[\s_]+|-)([+-]?\d+)[\s_-]*days?\s*$|^\s*([+-]?\d+)\s*d\s*$", re.I)


def parse_window(window: Any = "last 7 days", as_of: Any = None) -> Window:
    """Turn a window specification into dates.

    Accepted: ``"last N days"`` / ``"Nd"`` (the N full days before ``as_of``, which
    defaults to today in UTC, so a daily schedule never reads a half-written day),
    ``"YYYY-MM-DD..YYYY-MM-DD"``, a single ``"YYYY-MM-DD"``, or a mapping with
    ``start``/``end`` or ``last_days``.  A window covers 1 to `MAX_WINDOW_DAYS` days.
    """
    ref = as_date(as_of, "as_of") if as_of not in (None, "") else datetime.now(timezone.utc).date()
    if isinstance(window, Window):
        return window
    if isinstance(window, dict):
        if "last_days" in window:
            window = f"last {window['last_days']} days"
        elif "start" in window and "end" in window:
            window = f"{window['start']}..{window['end']}"
        else:
            raise CJEInputError(f"window {window!r} needs 'start' and 'end' or 'last_days'")
    text = str(window).strip()
    m = _LAST_RE.match(text)
    if m:
        n = int(m.group(1) or m.group(2))
        if n < 1:
            raise CJEInputError(f"window {window!r} must cover at least one day")
        if n > MAX_WINDOW_DAYS:
            raise CJEInputError(f"window {window!r} is longer than {MAX_WINDOW_DAYS} days")
        try:
            return Window(ref - timedelta(days=n), ref - timedelta(days=1))
        except OverflowError:
            raise CJEInputError(f"window {window!r} starts before year 1") from None
    if ".." in text:
        a, b = text.split("..", 1)
        start, end = as_date(a, "window start"), as_date(b, "window end")
    else:
        start = end = as_date(text, "window")
    if end < start:
        raise CJEInputError(f"window {window!r} ends before it starts")
    if (end - start).days + 1 > MAX_WINDOW_DAYS:
        raise CJEInputError(f"window {window!r} is longer than {MAX_WINDOW_DAYS} days")
    return Window(start, end)


# --------------------------------------------------------------------------------------
# shared checks


def check_publish_name(name: str, what: str) -> str:
    """A name the publisher accepts as one result-path segment (`flows.storage.publish`'s rule)."""
    from flows.storage.publish import check_segment  # the publisher's own rule, not a copy of it

    return check_segment(name, what)


def resolve_uri(uri: str, base: Path | None) -> str:
    """Local paths relative to ``base`` (the YAML file's folder); URIs unchanged."""
    uri = os.path.expanduser(uri.strip())
    if "://" in uri or base is None:
        return uri
    p = Path(uri)
    return str(p if p.is_absolute() else (base / p).resolve())


def check_columns(columns: Any, where: str = "columns", covariates: Any = ()) -> dict[str, str]:
    """A ``columns:`` mapping (canonical log column -> your column), validated; `CJEInputError`.

    The engine's rule (`cje_engine.data.io.check_mapping`: canonical keys with a did-you-mean
    hint, no column mapped twice) with the service's ``ts`` and the ``covariates`` allowed as
    keys.  Messages start with ``where``.  ``covariates``: the evaluation's ``options.covariates``
    (a name or a list; anything else is left to the engine options' own check).
    """
    if columns is None:
        return {}
    if isinstance(covariates, str):
        covariates = (covariates,)
    covariates = tuple(c for c in covariates if isinstance(c, str)) if isinstance(covariates, (list, tuple)) else ()
    if not isinstance(columns, Mapping):
        raise CJEInputError(f"{where}: expected a mapping of canonical column -> your column name, e.g. "
                            "{prompt_id: id, policy: model}, got " + repr(columns))
    try:
        return check_mapping(columns, covariates, SERVICE_COLUMNS)
    except CJEInputError as exc:
        raise CJEInputError(f"{where}: {exc.detail}", option="columns") from None


def merge_columns(default: Mapping[str, str] | None, own: Any) -> Any:
    """An evaluation's mapping: the top-level ``default`` overridden key by key by its ``own``
    (a ``null`` value drops a default key).  Anything but a mapping is returned for the check
    to refuse."""
    if own is not None and not isinstance(own, Mapping):
        return own
    merged = {**dict(default or {}), **dict(own or {})}
    return {k: v for k, v in merged.items() if v is not None}


class MonitoringConfig(BaseModel):
    """``monitoring:`` of an evaluation: its changes across windows and regression alarms.

    The keywords of `cje_engine.inference.changes.changes_by_policy` (docs/monitoring.md explains each),
    plus ``label_requests``: whether a drop that more labels could decide ("undecided") raises a label
    request (the ``regression_undecided`` trigger; it must also be among the evaluation's
    ``label_requests.triggers``, as by default).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    alpha: float = Field(default=0.05, gt=0.0, lt=0.5,
                         description="family-wise false-alarm rate over all windows, per policy")
    baseline: str | None = Field(default=None, description="the pinned baseline window (default: the first)")
    baseline_windows: int = Field(default=1, ge=1, le=MAX_BASELINE_WINDOWS,
                                  description="the baseline is the mean of this many windows")
    horizon: int | None = Field(default=None, ge=1, description="windows the budget is spread over evenly")
    decision_margin: float = Field(default=0.02, ge=0.0, description="a drop this large is at least undecided")
    pools: tuple[int, ...] = Field(default=(2, 4, 8), description="pooled tests of the mean of the last k windows")
    label_requests: bool = Field(default=True, description="an undecided drop raises a label request")

    @field_validator("pools", mode="before")
    @classmethod
    def _pools(cls, v: Any) -> Any:
        if not isinstance(v, (list, tuple)) or not all(isinstance(k, int) and not isinstance(k, bool) and 2 <= k
                                                       <= MAX_BASELINE_WINDOWS for k in v):
            raise ValueError(f"must be a list of window counts from 2 to {MAX_BASELINE_WINDOWS}, got {v!r}")
        return tuple(v)

    def change_options(self) -> dict[str, Any]:
        """Keywords of `cje_engine.inference.changes.changes_by_policy`."""
        return self.model_dump(exclude={"label_requests"})


def check_monitoring(monitoring: Any, where: str = "monitoring") -> MonitoringConfig:
    """A ``monitoring:`` mapping validated as `MonitoringConfig` (None: the defaults); `CJEInputError`
    naming the key, with a did-you-mean hint for an unknown one."""
    if monitoring is None:
        return MonitoringConfig()
    if not isinstance(monitoring, Mapping):
        raise CJEInputError(f"{where}: expected a mapping such as {{alpha: 0.05, baseline_windows: 2}}, got "
                            f"{monitoring!r}", option="monitoring")
    try:
        return MonitoringConfig.model_validate(dict(monitoring))
    except ValidationError as exc:
        raise CJEInputError(f"{where}: {_one_line(exc, MonitoringConfig)}", option="monitoring") from None


#: ``segments:`` key -> the engine option it becomes (`cje_engine.options.EvaluationOptions`); declared once here.
SEGMENT_OPTIONS = {"by": "segment_by", "min_rows": "segment_min_rows", "min_labels": "segment_min_labels",
                   "error_control": "segment_claims", "recalibrate": "segment_recalibrate",
                   "pooling": "segment_pooling"}


class SegmentsConfig(BaseModel):
    """``segments:`` of an evaluation: the columns its results are broken down by (docs/segments.md).

    ``segments: [category, language]`` is short for ``segments: {by: [category, language]}``. Every key but
    ``by`` is optional (unset: the engine's default). The block becomes engine options (`SEGMENT_OPTIONS`)
    inside the evaluation's ONE typed `EvaluationOptions` (`engine_options`), so the evaluate flow passes it
    as it passes every other option.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    by: tuple[str, ...] = Field(description="segment columns of the logs (one or more)")
    min_rows: int | None = Field(default=None, ge=2, description="fewest rows of each policy for a segment to be "
                                 "shown on its own (smaller ones are pooled into 'other')")
    min_labels: int | None = Field(default=None, ge=0, description="fewest labels for a segment to be shown on its own")
    error_control: Literal["bh", "holm"] | None = Field(
        default=None, description="the claims over the segment x policy family: bh (false discovery rate) or holm "
                                  "(family-wise); shown intervals always control the false coverage rate")
    recalibrate: Literal["auto", "never"] | None = Field(
        default=None, description="auto: recalibrate with the segment as a covariate when the omnibus test fails")
    pooling: Literal["none", "eb"] | None = Field(
        default=None, description="eb: also each verified level partially pooled across the policy's segments "
                                  "(empirical Bayes, robust intervals)")

    @field_validator("by", mode="before")
    @classmethod
    def _by(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)) or not v or not all(isinstance(c, str) and c.strip() for c in v):
            raise ValueError(f"must be a column name or a non-empty list of column names, got {v!r}")
        if len(set(v)) != len(v):
            raise ValueError(f"names a column twice: {sorted({c for c in v if list(v).count(c) > 1})}")
        return tuple(v)

    def engine_options(self) -> dict[str, Any]:
        """The declared keys as engine options (`SEGMENT_OPTIONS`; unset keys left to the engine's defaults)."""
        given = self.model_dump(exclude_unset=True, exclude_none=True)
        return {SEGMENT_OPTIONS[k]: (list(v) if isinstance(v, tuple) else v) for k, v in given.items()}


def check_segments(segments: Any) -> SegmentsConfig | None:
    """A ``segments:`` value validated as `SegmentsConfig` (None: no segments); `CJEInputError` whose one line
    starts with the key (``key segments.min_rows: ...``), with a did-you-mean hint for an unknown key."""
    if segments is None or isinstance(segments, SegmentsConfig):
        return segments
    if isinstance(segments, (str, list, tuple)):
        segments = {"by": segments}
    if not isinstance(segments, Mapping):
        raise CJEInputError(f"key segments: expected a list of columns or a mapping such as {{by: [category], "
                            f"min_rows: 200}}, got {segments!r}", option="segments")
    unknown = sorted(str(k) for k in segments if k not in SegmentsConfig.model_fields)
    if unknown:
        raise CJEInputError(f"key segments: unknown key {unknown[0]!r}{did_you_mean(unknown[0], SEGMENT_OPTIONS)}; "
                            f"expected some of {', '.join(SEGMENT_OPTIONS)}", option="segments")
    try:
        return SegmentsConfig.model_validate(dict(segments))
    except ValidationError as exc:
        detail = _one_line(exc, SegmentsConfig)
        detail = f"key segments.{detail[4:]}" if detail.startswith("key ") else f"key segments: {detail}"
        raise CJEInputError(detail, option="segments") from None


def segment_columns(options: Any) -> list[str]:
    """The segment columns (``segment_by``) of typed engine options (Direct's or an off-policy mode's); ``[]``
    without segments."""
    eng = getattr(options, "engine", options)  # OffPolicyOptions keeps the engine's options in ``engine``
    return list(getattr(eng, SEGMENT_OPTIONS["by"], None) or ())


def with_segments(options: Any, segments: SegmentsConfig | None, mode: str = "direct") -> Any:
    """``options`` (a mapping or typed options) with the ``segments:`` block merged in as engine options (every
    mode takes segments; ``mode`` is kept for the callers).

    Raises
    ------
    CJEInputError
        A segment option given both in ``segments:`` and in ``options:``.
    """
    if segments is None:
        return options
    declared = options.declared if hasattr(options, "declared") else dict(options or {})
    seg = segments.engine_options()
    twice = sorted(k for k in seg if k in declared and declared[k] != seg[k])
    if twice:
        raise CJEInputError(f"key segments: option {twice[0]} is given in options: too; declare segments once, in "
                            "segments:", option="segments")
    return {**declared, **seg}


def check_cron(cron: str, tz: str) -> None:
    """Raise `CJEInputError` when ``cron`` in time zone ``tz`` is not a schedule Prefect accepts."""
    from prefect.client.schemas.schedules import CronSchedule  # a schema only: starts nothing

    try:
        CronSchedule(cron=str(cron), timezone=str(tz))
    except ValueError as exc:
        detail = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)
        raise CJEInputError(f"cron {cron!r} or timezone {tz!r} is not valid ({detail})") from None


# --------------------------------------------------------------------------------------
# engine options: parsed once, at the edge


#: The typed engine options of an evaluation: `EvaluationOptions` (direct) or
#: `cje_engine.pipeline.offpolicy_options.OffPolicyOptions` (logs-only, hybrid).
EngineOptions = Any
#: The ``options`` parameter of a flow: the typed object (passed as it is) or a mapping (a deployment's
#: JSON), parsed by the flow's check with `engine_options` (Prefect does not coerce it).
EngineOptionsParameter = Annotated[Any, WithJsonSchema({"type": "object", "title": "Options",
                                                        "description": "engine options (EvaluationOptions)"})]


def engine_options(options: Any, policies: Sequence[str] | None = None, mode: str = "direct") -> EngineOptions:
    """The evaluation's engine options as ONE typed object, parsed once where they enter (the evaluations
    file, a flow parameter, the command line) and passed as it is to the engine.

    Parameters
    ----------
    options : mapping, EvaluationOptions, OffPolicyOptions or None
        The declared options; a typed object is returned as it is (never rebuilt) unless ``policies``
        differs from its own.
    policies : list of str, optional
        The evaluation's ``policies:`` (its read filter), merged into the options.
    mode : {"direct", "logs-only", "hybrid"}

    Returns
    -------
    EvaluationOptions or OffPolicyOptions
        ``.declared`` holds the options as given (with ``policies``): what names a run.

    Raises
    ------
    CJEInputError
        An unknown option (did-you-mean) or a bad value, one line.
    """
    if mode != "direct":
        from cje_engine.pipeline.offpolicy import flow_options

        return flow_options(options, policies, mode)
    if isinstance(options, EvaluationOptions):
        if not policies or tuple(policies) == options.policies:
            return options
        options = options.declared
    opts = dict(options or {}) if isinstance(options, Mapping) or options is None else options
    if not isinstance(opts, dict):
        raise CJEInputError(f"options must be a mapping of engine option -> value, got {type(options).__name__}")
    if policies:
        opts["policies"] = list(policies)
    return EvaluationOptions.build(**opts)


def option_covariates(options: Any) -> Any:
    """The covariates of typed options (a tuple), or of a mapping (as given, for `check_columns`)."""
    if isinstance(options, Mapping):
        return options.get("covariates")
    return getattr(options, "covariates", ())


# --------------------------------------------------------------------------------------
# models


class ScheduledEntry(BaseModel):
    """Shared keys and checks of a scheduled entry (an evaluation or a drift monitor)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    description: str = ""
    cron: str | None = None
    interval: float | None = None
    anchor: datetime | None = Field(default=None, description="start of the interval grid (default: now)")
    timezone: str = "UTC"
    overlap: Literal["queue", "skip"] = Field(
        default="queue", description="a run due while the entry's previous run still runs: queued until it ends "
                                     "(queue) or cancelled with the reason in its state (skip); never two at once")

    @field_validator("interval", mode="before")
    @classmethod
    def _interval(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"must be a number of seconds, got {v!r}")
        if not (MIN_INTERVAL_SECONDS <= v <= MAX_INTERVAL_SECONDS):
            raise ValueError(f"must be from {MIN_INTERVAL_SECONDS:.0f} s to one year, got {v!r}")
        return float(v)

    @field_validator("anchor", mode="before")
    @classmethod
    def _anchor(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                v = datetime.fromisoformat(v.replace("Z", "+00:00"))
            except ValueError:
                raise ValueError(f"must be an ISO 8601 time such as 2025-01-01T06:00:00Z, got {v!r}") from None
        if isinstance(v, datetime) and v.tzinfo is None:
            v = v.replace(tzinfo=timezone.utc)
        return v

    def _check_schedule(self) -> None:
        if self.cron and self.interval:
            raise CJEInputError("give either cron or interval, not both")
        if self.cron is not None:
            check_cron(self.cron, self.timezone)

    def schedule_kwargs(self) -> dict[str, Any]:
        """``schedule=`` keyword of ``flow.to_deployment`` (empty: no schedule)."""
        if self.cron:
            from prefect.schedules import Cron

            return {"schedule": Cron(self.cron, timezone=self.timezone)}
        if self.interval:
            from prefect.schedules import Interval

            return {"schedule": Interval(timedelta(seconds=self.interval), anchor_date=self.anchor,
                                         timezone=self.timezone)}
        return {}

    def concurrency_kwargs(self) -> dict[str, Any]:
        """``concurrency_limit=`` keyword of ``flow.to_deployment``: one run of the entry at a time, enforced by
        the Prefect server for `cje serve` and `cje deploy` alike; a run due while one runs waits in
        ``AwaitingConcurrencySlot`` (``overlap: queue``) or is cancelled, the limit named in its state
        (``overlap: skip``)."""
        from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

        strategy = ConcurrencyLimitStrategy.ENQUEUE if self.overlap == "queue" else ConcurrencyLimitStrategy.CANCEL_NEW
        return {"concurrency_limit": ConcurrencyLimitConfig(limit=1, collision_strategy=strategy)}


def _uri_validator(*names: str):
    """A before-validator for URI fields: non-empty string, no credentials, resolved."""

    def check(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return v
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"must be a non-empty string, got {v!r}")
        try:
            check_uri(v.strip(), info.field_name)
        except CJEInputError as exc:
            raise ValueError(str(exc)) from None
        return resolve_uri(v, (info.context or {}).get("base"))

    return field_validator(*names, mode="before")(classmethod(check))


class EvaluationConfig(ScheduledEntry):
    """One entry of ``evaluations:`` (see `flows.runtime.schedules` for the file format)."""

    name: str
    logs_uri: str
    results_uri: str | None = None
    labels_uri: str | None = None
    window: str = "last 7 days"
    policies: tuple[str, ...] | None = None
    mode: Literal["direct", "logs-only", "hybrid"] = "direct"
    segments: SegmentsConfig | None = Field(default=None, description="columns the results are broken down by "
                                            "(`SegmentsConfig`; merged into the engine options)")
    options: Any = Field(default_factory=dict, validate_default=True,
                         description="engine options, parsed once into `EvaluationOptions` / `OffPolicyOptions`")
    label_requests: dict[str, Any] | None = None
    columns: dict[str, str] = Field(default_factory=dict, validate_default=True,
                                    description="canonical log column -> your column (top-level columns: merged)")
    monitoring: dict[str, Any] = Field(default_factory=dict, validate_default=True,
                                       description="regression alarms across windows (top-level monitoring: merged)")
    row_pass: Literal["auto", "single", "sharded"] = Field(
        "auto", description="where the rows are reduced: sharded on Ray workers (Direct, segments included), single "
                            "in the flow's process, auto by the window's size (flows.pipelines.sharded_pass); "
                            "logs-only and hybrid: single only")

    _uris = _uri_validator("logs_uri", "results_uri", "labels_uri")

    @field_validator("segments", mode="before")
    @classmethod
    def _segments(cls, v: Any) -> Any:
        """``segments:`` as a list of columns (short form) or a mapping -> `SegmentsConfig`."""
        return check_segments(v)  # a CJEInputError is kept as it is (`raised_input_error`)

    @field_validator("options", mode="before")
    @classmethod
    def _options(cls, v: Any, info: ValidationInfo) -> Any:
        """The mapping of engine options -> the one typed object (`engine_options`, with ``policies`` and the
        ``segments:`` block's options, `with_segments`)."""
        if "mode" not in info.data or "policies" not in info.data or "segments" not in info.data:
            return v  # the entry is refused for its mode, policies or segments already
        if not isinstance(v, Mapping) and not hasattr(v, "declared"):  # a mapping or typed options
            raise PydanticCustomError("dict_type", "Input should be a valid dictionary")
        v = with_segments(v, info.data["segments"], info.data["mode"])
        return engine_options(v, info.data["policies"], info.data["mode"])

    @field_validator("columns", mode="before")
    @classmethod
    def _columns(cls, v: Any, info: ValidationInfo) -> Any:
        """The top-level ``columns:`` (validation context) overridden key by key by the entry's."""
        return merge_columns((info.context or {}).get("columns"), v)

    @field_validator("monitoring", mode="before")
    @classmethod
    def _monitoring(cls, v: Any, info: ValidationInfo) -> Any:
        """The top-level ``monitoring:`` (validation context) overridden key by key by the entry's."""
        return merge_columns((info.context or {}).get("monitoring"), v)

    @field_validator("window", mode="before")
    @classmethod
    def _window(cls, v: Any) -> Any:
        if isinstance(v, (date, datetime)):  # YAML reads an unquoted 2025-01-01 as a date
            return as_date(v).isoformat()
        if isinstance(v, dict):
            w = parse_window(v, "2000-01-01")
            return v and (f"last {v['last_days']} days" if "last_days" in v else f"{w.start}..{w.end}")
        return v

    @field_validator("policies", mode="before")
    @classmethod
    def _policies(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) for p in v):
            raise ValueError(f"must be a list of policy names, got {v!r}")
        return tuple(v) or None

    def check(self) -> None:
        """Semantic checks (names, window, schedule, columns, monitoring; the engine options were parsed by
        the ``options`` validator); raise `CJEInputError`."""
        check_publish_name(self.name, "name")
        parse_window(self.window)
        self._check_schedule()
        check_columns(self.columns, "key columns", option_covariates(self.options))
        check_monitoring(self.monitoring, "key monitoring")
        if self.row_pass == "sharded":  # logs-only and hybrid have no sharded row pass: refused at load (exit 2)
            from cje_engine.pipeline.sharded import check_sharded_mode
            check_sharded_mode(self.mode, "key row_pass")
        if isinstance(self.label_requests, Mapping) and self.label_requests.get("webhook_url") is not None:
            check_webhook_url(self.label_requests["webhook_url"], "key label_requests.webhook_url")


#: A reference look named by its key: ``YYYY-MM-DD/<judge_id>``.
LOOK_KEY_RE = re.compile(r"^\d{4}-\d{2}-\d{2}/.+$")


class DriftMonitorOptions(BaseModel):
    """The ``monitor:`` keywords of a drift monitor (`cje_engine.drift.monitor.DriftMonitor`'s), typed
    strictly; an unset key keeps the engine's default (none is repeated here: `model_dump` leaves them out)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    alpha: float = Field(default=None, description="family-wise error budget over metrics and looks")
    horizon: int | None = Field(default=None, description="scheduled looks (None: any number)")
    weights: dict[str, float] | None = Field(default=None, description="share of alpha per metric")
    min_anchors: int = Field(default=None, description="fewest paired anchors in a look")
    min_labels: int = Field(default=None, description="fewest labelled paired anchors (residual metrics)")
    tau_floor: float | None = Field(default=None, description="floor of tau-b without a rank baseline")
    se_method: str = Field(default=None, description="jackknife or influence")
    max_thresholds: int = Field(default=None, description="most thresholds of the distribution test")
    rank_window: int = Field(default=None, description="looks compared by the rank metric")


def check_drift_comparison(reference: str, monitor: Mapping[str, Any]) -> None:
    """A drift monitor's ``reference`` and ``monitor`` options (`DriftMonitorOptions`: strict types, unknown
    keys with a did-you-mean hint; then `DriftMonitor`'s own range checks); `CJEInputError`.

    Shared by the declarations here and the drift flow's own settings
    (`flows.pipelines.drift_config.DriftSettings`).
    """
    from cje_engine.drift.monitor import DriftMonitor  # the drift engine is only needed to check monitors

    if reference != "first" and not reference.startswith("judge:") and not LOOK_KEY_RE.match(reference):
        raise CJEInputError(f"reference {reference!r} must be 'first', 'judge:<judge_id>' or 'YYYY-MM-DD/<judge_id>'")
    if not isinstance(monitor, Mapping):
        raise CJEInputError(f"monitor: expected a mapping of DriftMonitor options, got {monitor!r}")
    try:
        opts = DriftMonitorOptions.model_validate(dict(monitor))
    except ValidationError as exc:
        raise CJEInputError(f"monitor: bad monitor option ({_one_line(exc, DriftMonitorOptions)})") from None
    DriftMonitor(**opts.model_dump(exclude_unset=True))


class DriftComparisonKeys(BaseModel):
    """The keys a declared drift monitor (`DriftMonitorConfig`) and the drift flow's settings
    (`flows.pipelines.drift_config.DriftSettings`) share, declared once: what to compare, where, and how."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    set_name: str
    anchors_uri: str
    anchors_version: int | None = Field(default=None, ge=1)
    logs_uri: str | None = None
    drift_uri: str | None = None
    results_uri: str | None = None
    evaluation: str | None = None
    judge_id: str | None = None
    scorer: dict[str, Any] | None = None
    reference: str = "first"
    replicate: str | None = "next"
    monitor: dict[str, Any] = Field(default_factory=dict)
    notify_on: Literal["new", "every"] = "new"


class DriftMonitorConfig(ScheduledEntry, DriftComparisonKeys):
    """One entry of ``drift_monitors:`` (see docs/drift-flow.md for the keys)."""

    name: str | None = None

    _uris = _uri_validator("anchors_uri", "logs_uri", "drift_uri", "results_uri")

    @property
    def monitor_name(self) -> str:
        """The monitor's name: ``name``, else its anchor set's name."""
        return self.name or self.set_name

    def check(self) -> None:
        """Semantic checks (names, schedule, drift options, scorer); raise `CJEInputError`."""
        from flows.storage.anchors import check_name

        check_name(self.set_name)
        check_name(self.monitor_name, "monitor name")
        check_publish_name(self.monitor_name, "monitor name")
        self._check_schedule()
        check_drift_comparison(self.reference, self.monitor)
        if self.scorer is not None:
            if "api_key" in self.scorer:
                raise CJEInputError("scorer: api_key is a credential; name the environment variable holding "
                                    "it with api_key_env instead")
            check_uri(str(self.scorer.get("base_url", "")), "scorer base_url")
            from flows.integrations.scorer import OpenAIChatScorer

            OpenAIChatScorer.from_config(dict(self.scorer))
            if not self.judge_id:
                raise CJEInputError("judge_id is required with a scorer")


@dataclass(frozen=True)
class Config:
    """The validated file: evaluations and drift monitors by name."""

    path: Path
    evaluations: dict[str, EvaluationConfig]
    drift_monitors: dict[str, DriftMonitorConfig]


# --------------------------------------------------------------------------------------
# loading


#: Top-level keys of ``evaluations.yaml`` (``columns``: the default column mapping of every evaluation and of
#: `cje evaluate` / `cje plan`; ``monitoring``: the default monitoring settings of every evaluation).
TOP_LEVEL_KEYS = ("evaluations", "drift_monitors", "columns", "monitoring")


#: Most values a YAML document may hold once its aliases are expanded (an alias bomb, "billion laughs",
#: holds 10^9 from a few hundred bytes); a real evaluations file holds a few hundred.
MAX_YAML_VALUES = 100_000
#: Most alias uses (``*name``) in one document.
MAX_YAML_ALIASES = 1_000


class YAMLLimitError(yaml.YAMLError):
    """A YAML document refused by `StrictLoader` (a duplicate key, too many or recursive aliases).

    Its message is ours, one line, and never renders a value of the document."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys at any level (naming the key and both lines) and
    alias bombs: at most `MAX_YAML_ALIASES` alias uses, at most `MAX_YAML_VALUES` values once every alias
    is expanded, no recursive alias.  The check runs on the composed node graph, before any value is built."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        """Compose a node, refusing more aliases than `MAX_YAML_ALIASES`."""
        if self.check_event(yaml.AliasEvent):
            self._aliases = getattr(self, "_aliases", 0) + 1
            if self._aliases > MAX_YAML_ALIASES:
                mark = self.peek_event().start_mark
                raise YAMLLimitError(f"more than {MAX_YAML_ALIASES} aliases (line {mark.line + 1}); an alias bomb? "
                                     "refused")
        return super().compose_node(parent, index)

    def compose_document(self) -> Any:
        """Compose the document, refusing one whose aliases expand past the size limit."""
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """Construct a mapping, refusing a key given twice (naming its line)."""
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # merge keys (<<) may be overridden: that is what they are for
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                    seen.setdefault(key, line)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first is not None:
                    shown = key if isinstance(key, (str, int, float, bool)) or key is None else type(key).__name__
                    raise YAMLLimitError(f"duplicate key {shown!r} at lines {first} and {line} (the second would "
                                         "silently replace the first)")
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], active: set[int]) -> int:
    """Values under ``node`` with every alias expanded (memoised per node, so it costs the document's size);
    `YAMLLimitError` past `MAX_YAML_VALUES` or on a recursive alias."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in active:
        raise YAMLLimitError(f"recursive alias (line {node.start_mark.line + 1}); refused")
    active.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_expanded_size(child, sizes, active) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_expanded_size(k, sizes, active) + _expanded_size(v, sizes, active) for k, v in node.value)
    active.discard(key)
    if total > MAX_YAML_VALUES:
        raise YAMLLimitError(f"aliases expand to more than {MAX_YAML_VALUES} values (line {node.start_mark.line + 1});"
                             " an alias bomb? refused")
    sizes[key] = total
    return total


def read_yaml(path: str | os.PathLike | None = None) -> tuple[Path, dict]:
    """The one YAML loader of the service: ``(path, top-level mapping)`` or `CJEInputError`.

    Loaded with `StrictLoader`: a duplicate key (at any level) and an alias bomb are errors naming the
    file, the key and its lines; the message never renders a value of the document."""
    p = Path(path) if path is not None else DEFAULT_FILE
    try:
        doc = yaml.load(p.read_text(encoding="utf-8"), Loader=StrictLoader)  # noqa: S506 - a safe loader
    except FileNotFoundError:
        raise CJEInputError("evaluations file not found", source=str(p)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CJEInputError(f"cannot read the evaluations file ({type(exc).__name__})", source=str(p)) from None
    except YAMLLimitError as exc:
        raise CJEInputError(f"not accepted YAML: {exc}", source=str(p)) from None
    except RecursionError:
        raise CJEInputError("not accepted YAML: nested too deeply", source=str(p)) from None
    except yaml.YAMLError as exc:
        raise CJEInputError(f"not valid YAML: {' '.join(str(exc).split())[:300]}", source=str(p)) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise CJEInputError("expected a mapping with 'evaluations:' and/or 'drift_monitors:'", source=str(p))
    unknown = sorted(set(map(str, doc)) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise CJEInputError(f"unknown top-level key {unknown[0]!r}"
                            + did_you_mean(unknown[0], TOP_LEVEL_KEYS)
                            + f"; expected {', '.join(TOP_LEVEL_KEYS)}", source=str(p))
    try:
        check_columns(doc.get("columns"), "top-level key columns")
    except CJEInputError as exc:
        raise CJEInputError(exc.detail, source=str(p), option="columns") from None
    try:
        check_monitoring(doc.get("monitoring"), "top-level key monitoring")
    except CJEInputError as exc:
        raise CJEInputError(exc.detail, source=str(p), option="monitoring") from None
    return p, doc


def raised_input_error(exc: ValidationError, keys: Sequence[str] = ("options",)) -> CJEInputError | None:
    """The `CJEInputError` the validator of one of ``keys`` raised (the first error's), or None.

    The engine options' errors are one line naming the option already (with a did-you-mean hint and
    the ``option`` the command line translates to its flag): they are kept as they are."""
    errors = exc.errors(include_url=False)
    if not errors or not errors[0]["loc"] or str(errors[0]["loc"][0]) not in keys:
        return None
    inner = (errors[0].get("ctx") or {}).get("error")
    return inner if isinstance(inner, CJEInputError) else None


def _one_line(exc: ValidationError, model: type[BaseModel]) -> str:
    """The first pydantic error as ``key K: message``."""
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(x) for x in err["loc"]) or "entry"
    top = str(err["loc"][0]) if err["loc"] else ""
    if err["type"] == "extra_forbidden":
        fields = sorted(model.model_fields)
        return f"unknown key {top!r}{did_you_mean(top, fields)}; expected some of {', '.join(fields)}"
    if err["type"] == "missing":
        return f"needs {loc}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] != "value_error":
        msg = f"{msg}, got {err.get('input')!r}"
    return f"key {loc}: {msg}"


def _entry_error(exc: CJEInputError, where: str, src: str | None, columns: Mapping[str, str] | None) -> CJEInputError:
    """``exc`` about one entry, prefixed with the entry (``where``) and the file."""
    hint = ""
    if columns and str(exc).startswith("key columns"):
        hint = ("; the top-level columns: is merged into every evaluation's: override its keys here, or drop "
                "one with KEY: null")
    return CJEInputError(f"{where}: {exc}{hint}", source=src, option=exc.option)


def validate_entry(model: type[ScheduledEntry], entry: Any, where: str, src: str | None = None,
                   base: Path | None = None, columns: Mapping[str, str] | None = None,
                   monitoring: Mapping[str, Any] | None = None) -> ScheduledEntry:
    """Validate one entry (a mapping from the file or a flow parameter) as ``model``
    (``columns`` / ``monitoring``: the file's top-level keys, the defaults of an evaluation's)."""
    if not isinstance(entry, dict):
        raise CJEInputError(f"{where} must be a mapping", source=src)
    label = entry.get("name", entry.get("set_name"))
    if isinstance(label, str):
        where = f"{where} ({label!r})"
    context: dict[str, Any] = {"base": base}
    if columns:
        context["columns"] = dict(columns)
    if monitoring:
        context["monitoring"] = dict(monitoring)
    try:
        obj = model.model_validate(entry, context=context)
    except ValidationError as exc:
        inner = raised_input_error(exc, ("options", "segments"))
        if inner is None:
            raise CJEInputError(f"{where}: {_one_line(exc, model)}", source=src) from None
        raise _entry_error(inner, where, src, columns) from None
    try:
        obj.check()
    except CJEInputError as exc:
        raise _entry_error(exc, where, src, columns) from None
    return obj


def _entries(doc: Mapping, key: str, src: str, required: bool) -> list:
    entries = doc.get(key)
    if entries is None and not required:
        return []
    if not isinstance(entries, list) or (required and not entries):
        raise CJEInputError(f"expected a top-level '{key}:' list" + (" with at least one entry" if required else ""),
                            source=src)
    return entries


def load_config(path: str | os.PathLike | None = None, *, evaluation_cls: type[EvaluationConfig] = EvaluationConfig,
                monitor_cls: type[DriftMonitorConfig] = DriftMonitorConfig,
                require_evaluations: bool = True) -> Config:
    """Read and validate ``evaluations.yaml`` (default: the repository's) in one pass.

    ``evaluation_cls`` / ``monitor_cls`` are the classes built (subclasses adding runtime
    methods, e.g. `flows.runtime.schedules.EvaluationSpec`).  Relative local paths resolve
    against the file's folder.  Raises `CJEInputError` (one line: file, entry, key).
    """
    p, doc = read_yaml(path)
    src, base = str(p), p.resolve().parent
    evaluations: dict[str, EvaluationConfig] = {}
    for i, e in enumerate(_entries(doc, "evaluations", src, require_evaluations)):
        spec = validate_entry(evaluation_cls, e, f"evaluations[{i}]", src, base, doc.get("columns"),
                              doc.get("monitoring"))
        if spec.name in evaluations:
            raise CJEInputError(f"evaluation {spec.name!r} is declared twice", source=src)
        evaluations[spec.name] = spec
    monitors: dict[str, DriftMonitorConfig] = {}
    for i, e in enumerate(_entries(doc, "drift_monitors", src, False)):
        mon = validate_entry(monitor_cls, e, f"drift_monitors[{i}]", src, base)
        if mon.monitor_name in monitors:
            raise CJEInputError(f"drift monitor {mon.monitor_name!r} is declared twice", source=src)
        monitors[mon.monitor_name] = mon
    return Config(path=p, evaluations=evaluations, drift_monitors=monitors)



def pick_declared(name: str, declared: Mapping[str, Any], *, what: str = "evaluation",
                  source: str | os.PathLike | None = None) -> Any:
    """``declared[name]``, or the one `CJEInputError` of every lookup by name: it names the
    evaluations file, the closest declared name (did you mean) and the declared ones.

    Parameters
    ----------
    name : str
        The name asked for (command line, flow parameter).
    declared : mapping
        Name -> entry of the evaluations file (evaluations or drift monitors).
    what : str
        ``"evaluation"`` or ``"drift monitor"`` (for the message).
    source : path, optional
        The evaluations file the entries were read from (default: the repository's).

    Returns
    -------
    The entry of ``name``.
    """
    if name in declared:
        return declared[name]
    raise CJEInputError(f"no {what} named {name!r}{did_you_mean(name, declared)}; declared: "
                        f"{', '.join(sorted(declared)) or 'none'}", source=str(source or DEFAULT_FILE))

__all__ = ["did_you_mean", "engine_options", "option_covariates", "EngineOptions", "EngineOptionsParameter",
           "pick_declared", "raised_input_error", "Config", "EvaluationConfig", "DriftMonitorConfig", "Window", "parse_window", "load_config",
           "read_yaml", "validate_entry", "check_uri", "check_webhook_url", "check_columns", "merge_columns", "check_publish_name",
           "MonitoringConfig", "check_monitoring", "SegmentsConfig", "check_segments", "with_segments", "segment_columns", "SEGMENT_OPTIONS",
           "MIN_INTERVAL_SECONDS", "MAX_WINDOW_DAYS", "DEFAULT_FILE"]
