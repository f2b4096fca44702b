"""The `evaluate` Prefect flow: logs in object storage to a published, gated result.

Steps (each a Prefect task, so each has its own state, logs, timing and retries):

1. ``discover``   list the ``dt=YYYY-MM-DD/*.parquet`` partitions of the window;
2. ``read``       read them on Ray, one task per group of partitions (projection and
                  policy filter pushed down), concatenate on the driver;
3. ``join_labels``left-join the append-only label store on ``response_id``;
4. ``validate``   cheap structural checks with clear errors (the engine validates fully);
5. ``prepare``    the engine's `prepare`: validation, mode selection, calibration fitted
                  ONCE, point estimates;
6. ``bootstrap``  fan the bootstrap replicates out on Ray in chunks;
7. ``finalize``   gather the chunks in order; the engine gates level claims, audits and
                  compares every pair of policies (bit-identical to `cje_engine.evaluate`);
8. ``render``     result.json, the per-policy Parquet summary and report.html;
9. ``publish``    `flows.storage.publish.publish_run`: artifacts, manifest last, then latest.json; then the
                   index and trend page (`flows.pipelines.pages.refresh_pages`).

Ray directly, not ``prefect-ray``'s ``RayTaskRunner``
---------------------------------------------------
The fan-out uses Ray directly inside the ``read`` and ``bootstrap`` tasks because:

* the prepared calibration is put into Ray's object store once and every chunk gets it by
  reference; with ``RayTaskRunner`` each chunk would be a Prefect task whose parameters
  are serialised per task (and hashed for cache keys);
* a worker killed mid-chunk is simply re-run by Ray's own task retries
  (``max_retries``); replicate ``b`` depends only on ``(seed, b)``, so the numbers are
  identical.  With ``RayTaskRunner`` the re-executed attempt belongs to a Prefect task run
  already marked Running, and its recovery depends on Prefect's orchestration rules;
* workers never need the Prefect API: no per-worker client, no ephemeral server;
* Prefect still sees every stage as a task with retries, logs and timings.

Workers do not inherit the driver's environment on a cluster, so the storage settings
travel as an explicit argument (``StorageConfig.to_dict(include_secrets=True)``) into the
Ray read tasks; they never appear in flow parameters (which Prefect stores), logs or
results.  Storage steps retry with backoff (``retry_delays``); bad data
(`CJEInputError`) is never retried.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from datetime import datetime, timezone
from typing import Any, Iterator, Literal, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task
from prefect.context import FlowRunContext
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from cje_engine import __version__ as ENGINE_VERSION
from cje_engine.errors import CJEInputError
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline import offpolicy as offpolicy_pipeline
from cje_engine.pipeline.direct import prepare as engine_prepare
from cje_engine.pipeline.offpolicy import flow_columns, flow_policies

from flows.config import (EngineOptions, EngineOptionsParameter, MonitoringConfig, Window, check_columns,
                          check_monitoring, check_publish_name, check_uri, engine_options, option_covariates,
                          parse_window, segment_columns)
from flows.pipelines import preflight
from flows.pipelines.pages import contextual_report, refresh_pages
from flows.pipelines.regressions import monitor_evaluation
from flows.pipelines.sharded_pass import (SHARDED_MIN_BYTES, SHARDED_MIN_ROWS, check_row_pass, compute_sharded,
                                          row_pass_for, single_row_pass, window_footers)
from flows.runtime import ray_fanout as ray_runtime
from flows.runtime.guard import checked_flow
from flows.runtime.retries import DEFAULT_RETRY_DELAYS, PURE_TASK, storage_task_options
from flows.storage.labels import LabelStore
from flows.storage.logs import (concat_with_sources, discover_partitions, first_duplicate, locate_row, row_sources,
                                window_days)
from flows.storage.objects import Storage, StorageConfig
from flows.storage.publish import FOLLOWUPS, run_key

log = logging.getLogger(__name__)

#: Columns the flow reads from the logs besides the covariates.
BASE_COLUMNS = ("prompt_id", "policy", "judge_score", "response_id")
LABEL_COLUMNS = ("oracle_label", "label_probability")

#: Fewest bootstrap replicates per Ray chunk (below this, scheduling dominates).
MIN_CHUNK = 50

#: Steps a published run owes after its commit (`flows.storage.publish.FOLLOWUPS`): the result's
#: notifications (`flows.pipelines.audit`) and its regression alarms (`monitor_evaluation`).
FOLLOWUP_STEPS = ("notify", "regression_alarms")

_STORAGE_TASK = storage_task_options()
_PURE_TASK = PURE_TASK


def _storage(uri: str, cfg: Any):
    return Storage.for_uri(uri, cfg)


# --------------------------------------------------------------------------------------
# tasks


@task(name="discover", **_STORAGE_TASK)
def discover(logs_uri: str, cfg: Any, window: Window) -> list[dict]:
    """Partitions of the window as ``{"key", "size", "etag_or_mtime"}`` dicts (lineage)."""
    st = _storage(logs_uri, cfg)
    files = discover_partitions(st, window.start, window.end)
    infos = [_info_dict(f) for f in files]
    if not infos:
        raise CJEInputError(f"no log partitions dt={window.start}..dt={window.end} under {logs_uri}",
                            source=logs_uri)
    get_run_logger().info("window %s: %d partition file(s), %.1f MB", window.label, len(infos),
                          sum(i["size"] or 0 for i in infos) / 1e6)
    return infos


def _info_dict(f: Any) -> dict:
    if isinstance(f, dict):
        return {"key": f["key"], "size": f.get("size"), "etag_or_mtime": f.get("etag_or_mtime")}
    if isinstance(f, str):
        return {"key": f, "size": None, "etag_or_mtime": None}
    return {"key": f.key, "size": getattr(f, "size", None), "etag_or_mtime": getattr(f, "etag_or_mtime", None)}


def _group_files(files: Sequence[dict], n_groups: int) -> list[list[dict]]:
    """Contiguous groups of files with nearly equal total size (keeps key order)."""
    if not files:
        return []
    n_groups = max(1, min(n_groups, len(files)))
    total = sum(max(f["size"] or 1, 1) for f in files)
    target = total / n_groups
    groups: list[list[dict]] = [[]]
    acc = 0.0
    for i, f in enumerate(files):
        if groups[-1] and len(groups) < n_groups and (
                acc >= target * len(groups) or len(files) - i <= n_groups - len(groups)):
            groups.append([])
        groups[-1].append(f)
        acc += max(f["size"] or 1, 1)
    return groups


@task(name="read", **_STORAGE_TASK)
def read(logs_uri: str, cfg: Any, files: list[dict], columns: list[str] | None,
         policies: list[str] | None, n_groups: int, mapping: dict[str, str] | None = None) -> pa.Table:
    """Read the window's partitions on Ray, one task per group of files (columns renamed by
    ``mapping``, the evaluation's ``columns:``)."""
    groups = _group_files(files, n_groups)
    cfg_dict = cfg.to_dict(include_secrets=True)
    t0 = time.perf_counter()
    parts = ray_runtime.map_ordered(
        ray_runtime.remote_read,
        [(logs_uri, cfg_dict, [f["key"] for f in g], columns, policies, mapping) for g in groups],
        name="cje_read",
    )
    table = concat_with_sources(parts) if parts else None
    if table is None or table.num_rows == 0:
        raise CJEInputError(f"no log rows in {len(files)} partition file(s) of {logs_uri}"
                            + (f" for policies {policies}" if policies else ""), source=logs_uri)
    get_run_logger().info("read %d rows in %d Ray task(s) in %.2f s", table.num_rows, len(groups),
                          time.perf_counter() - t0)
    return table


def read_needed(plan: "RunPlan", cfg: Any, files: list[dict]) -> pa.Table:
    """The `read` task with the run's projection pushed down.

    The label columns the logs carry inline are kept (they are combined with the store's in
    `join_labels`); when only some files have them, every column is read and the needed ones
    are kept afterwards.
    """
    inline = inline_labels.with_options(**plan.retry)(plan.logs_uri, quote(cfg), files, plan.columns)
    # Derivable covariates (response_length) missing from the logs: read their source text.
    needed = plan.needed_columns
    if any(c in preflight.DERIVED for c in plan.covariates):
        needed = preflight.read_columns(needed, plan.covariates,
                                        preflight.logs_columns(plan.logs_uri, cfg, files, mapping=plan.columns))
    columns = None if inline["mixed"] else needed + inline["columns"]
    table = read.with_options(**plan.retry)(plan.logs_uri, quote(cfg), files, columns, plan.read_policies,
                                            2 * ray_runtime.cluster_cpus(), plan.columns)
    if columns is None:
        table = table.select([c for c in needed + list(LABEL_COLUMNS) if c in table.column_names])
    return table


@task(name="load_labels", **_STORAGE_TASK)
def load_labels(labels_uri: str, cfg: Any) -> tuple[pa.Table | None, dict]:
    """The label store's labels at its current version (``None`` when empty) and lineage."""
    labels, info = LabelStore(_storage(labels_uri, cfg)).current(labels_uri)
    if labels is None:
        return None, info
    get_run_logger().info("label store version %d: %d label row(s), %d flagged", info["label_store_version"],
                          info["n_label_rows"], info["n_flagged"])
    return labels, info


@task(name="load_label_index", **_STORAGE_TASK)
def load_label_index(labels_uri: str, cfg: Any, delays: Sequence[float] = ()) -> Any:
    """The sharded path's `load_labels`: the label store is read and indexed on a Ray worker
    (`flows.runtime.label_index.submit_label_index`), concurrently with the readers' sampling of the prompt ids;
    this task reads the store's commit records only (its version and rows: the build's memory request) and
    returns a `flows.runtime.label_index.PendingLabelIndex` at once: the read tasks take the index's reference
    from the object store (Ray starts them once it is built), ``info()`` its lineage. ``delays``: the build's
    retries of a storage failure. This process never holds the labels."""
    from flows.runtime.label_index import PendingLabelIndex, submit_label_index

    version, rows = LabelStore(_storage(labels_uri, cfg)).committed_rows()
    if not version:  # an empty store: no build, no label
        return PendingLabelIndex(None, info={"labels_uri": labels_uri, "label_store_version": 0, "n_label_rows": 0,
                                             "n_flagged": 0})
    return submit_label_index(labels_uri, cfg.to_dict(include_secrets=True), label_rows=rows, delays=delays)


@task(name="inline_labels", **_STORAGE_TASK)
def inline_labels(logs_uri: str, cfg: Any, files: list[dict], mapping: dict[str, str] | None = None) -> dict:
    """Label columns the log files carry inline, under their canonical names after ``mapping``
    (Parquet footers only; `inline_label_columns`)."""
    from flows.storage.labels import inline_label_columns

    return inline_label_columns(_storage(logs_uri, cfg), [f["key"] for f in files], mapping=mapping)


@task(name="join_labels", **_PURE_TASK)
def join_labels(table: pa.Table, labels: pa.Table | None, info: dict) -> tuple[pa.Table, dict]:
    """Combine the logs' inline labels with the store's on ``response_id`` (`flows.storage.labels.join_labels`).

    The store wins where both have a label (differences counted in ``n_inline_overridden``); a
    ``response_id`` with conflicting store labels uses its first label and is counted in
    ``n_conflicting_rows``.  ``n_joined`` is the number of labelled rows after the join.
    """
    from flows.storage.labels import join_counts, join_labels as store_join

    info = dict(info)
    inline = "oracle_label" in table.column_names
    if labels is None:
        info["source"] = "logs" if inline else "none"
        info["n_inline_labels"] = int(table.num_rows - table["oracle_label"].null_count) if inline else 0
        info["n_joined"] = info["n_inline_labels"]
        return table, info
    joined = store_join(table, labels)
    info.update(join_counts(joined))
    if "label_conflict" in joined.column_names:
        joined = joined.drop_columns(["label_conflict"])
    info["n_joined"] = int(joined.num_rows - joined["oracle_label"].null_count)
    info["source"] = "logs+label_store" if info["n_inline_labels"] else "label_store"
    logger = get_run_logger()
    logger.info("labels: %d inline in the logs, %d from the label store, %d labelled row(s) in all", info[
        "n_inline_labels"], info["n_store_labels"], info["n_joined"])
    if info["n_inline_overridden"]:
        logger.warning("%d inline label(s) differ from the label store's; the store's are used",
                       info["n_inline_overridden"])
    return joined, info


@task(name="check_label_counts", **_STORAGE_TASK)
def check_label_counts(results_uri: str, cfg: Any, evaluation: str, window: Window, counts: dict) -> dict | None:
    """A drop of labelled rows against the previous published run of this window (or None)."""
    from flows.storage.labels import labelled_count_drop
    from flows.storage.publish import list_runs

    runs = list_runs(_storage(results_uri, cfg), evaluation, window.label)
    drop = labelled_count_drop(runs[-1] if runs else None, counts)
    if drop:
        get_run_logger().warning("evaluation %s window %s: %s", evaluation, window.label, drop["message"])
    return drop


@task(name="validate", **_PURE_TASK)
def validate(table: pa.Table, covariates: Sequence[str], source: str) -> dict:
    """Structural checks with clear errors; returns row and label counts per policy."""
    need = list(BASE_COLUMNS) + list(covariates)
    for col in need:
        if col not in table.column_names:
            raise CJEInputError(f"column is missing from the logs (found: {', '.join(table.column_names)})",
                                source=source, column=col)
    # Sort-based (benchmarks/bench_flow.py, 10M ids: 1.1 s and 0.5 GB of Arrow memory, where
    # the hash-based pc.count_distinct took 6.6 s and 1.0 GB).
    dup = first_duplicate(table["response_id"])
    if dup is not None:
        raise CJEInputError(f"response_id {dup!r} appears more than once in the window "
                            "(response ids must be unique)", source=source, column="response_id")
    if "oracle_label" not in table.column_names:
        raise CJEInputError("no oracle labels: neither the label store nor the logs have any", source=source,
                            column="oracle_label")
    n_lab = table.num_rows - table["oracle_label"].null_count
    if n_lab == 0:
        raise CJEInputError("no row of the window has an oracle label", source=source, column="oracle_label")
    counts = table.group_by("policy").aggregate([("policy", "count"), ("oracle_label", "count")])
    per_policy = {p: {"rows": int(r), "labelled": int(lab)} for p, r, lab in
                  zip(counts["policy"].to_pylist(), counts["policy_count"].to_pylist(),
                      counts["oracle_label_count"].to_pylist())}
    return {"n_rows": table.num_rows, "n_labelled": int(n_lab), "policies": per_policy}


@contextlib.contextmanager
def _rows_named_by_object(table: pa.Table, logs_uri: str | None, cfg: Any) -> Iterator[None]:
    """Re-raise the engine's bad-value errors about row N of the assembled table as errors
    about the log object and its row (the engine only sees one in-memory table)."""
    try:
        yield
    except CJEInputError as exc:
        where = None
        if logs_uri and exc.row is not None and str(exc.source or "").startswith("<"):
            where = locate_row(_storage(logs_uri, cfg), row_sources(table), table, int(exc.row))
        if where is None:
            raise
        raise CJEInputError(exc.detail, source=where[0], column=exc.column, row=where[1]) from None


@task(name="prepare", **_PURE_TASK)
def prepare(table: pa.Table, options: EvaluationOptions, logs_uri: str | None = None, cfg: Any = None) -> Any:
    """Engine `prepare`: validate, select the mode, fit the calibration once (``options``: the run's typed
    options, passed as they are)."""
    with _rows_named_by_object(table, logs_uri, cfg):
        return engine_prepare(table, options)


@task(name="bootstrap", **storage_task_options((1.0,)))
def bootstrap(prep: Any, n_chunks: int | None) -> list:
    """Bootstrap replicates in chunks on Ray (Ray re-runs chunks of dead workers)."""
    opts = prep.options
    if opts.inference != "bootstrap":  # as cje_engine.evaluate: the analytic route has no replicates
        return []
    prep.check_bootstrap_memory()  # before any replicate is allocated
    B = int(opts.n_bootstrap)
    if n_chunks is None:
        n_chunks = 2 * ray_runtime.cluster_cpus()
    n_chunks = max(1, min(int(n_chunks), max(1, B // MIN_CHUNK)))
    ranges = ray_runtime.chunk_ranges(B, n_chunks)
    t0 = time.perf_counter()
    chunks = ray_runtime.map_ordered(ray_runtime.remote_bootstrap, ranges, shared=prep, name="cje_bootstrap")
    get_run_logger().info("%d replicates in %d Ray chunk(s) in %.2f s", B, len(ranges), time.perf_counter() - t0)
    return chunks


@task(name="finalize", **_PURE_TASK)
def finalize(prep: Any, chunks: list) -> Any:
    """Engine `finalize` of any mode (`cje_engine.pipeline.prepared.Prepared`): intervals, audits, gates,
    comparisons, ranking."""
    return prep.finalize(chunks)


@task(name="prepare_offpolicy", **_PURE_TASK)
def prepare_offpolicy(table: pa.Table, options: Any, logs_uri: str | None = None, cfg: Any = None) -> Any:
    """Off-policy `prepare` (logs-only / hybrid): validate the logs, calibrate, weights, gates (``options``:
    the run's typed `OffPolicyOptions`)."""
    with _rows_named_by_object(table, logs_uri, cfg):
        return offpolicy_pipeline.prepare(table, options=options)


@task(name="render", **_PURE_TASK)
def render(result: Any, title: str, days: dict | None = None) -> dict[str, bytes]:
    """The run's artifacts: result.json, policies.parquet, report.html (``days``: the window's days held and
    missing, shown under the report's title)."""
    from flows.reports.evaluation import render_report

    d = result.to_dict()
    buf = io.BytesIO()
    pq.write_table(result.to_policy_table(), buf)
    return {
        "result.json": json.dumps(d, indent=2, allow_nan=False).encode("utf-8"),
        "policies.parquet": buf.getvalue(),
        "report.html": render_report(d, title=title, days=days).encode("utf-8"),
    }


@task(name="publish", **_STORAGE_TASK)
def publish(results_uri: str, cfg: Any, evaluation: str, window: Window, key: str,
            artifacts: dict[str, bytes], manifest: dict) -> dict:
    """Gated atomic publish (manifest last, then latest.json); the report rendered again with the run's context."""
    from flows.storage.publish import publish_run

    st = _storage(results_uri, cfg)
    outcome = publish_run(st, evaluation, window.label, key, artifacts=artifacts, manifest=manifest,
                          render_report=contextual_report)
    out = {"published": bool(outcome.published), "path": outcome.path, "reason": outcome.reason,
           "artifacts": dict(outcome.artifacts)}
    get_run_logger().info("publish: %s", out)
    return out


# --------------------------------------------------------------------------------------
# the run's plan (parameters resolved and checked before anything starts)


@dataclass
class RunPlan:
    """One flow run's resolved parameters: where to read and publish, the window, the options."""

    evaluation: str
    window_spec: str
    window: Window
    logs_uri: str
    results_uri: str
    labels_uri: str
    policies: list[str] | None
    mode: str
    opts: EngineOptions  # the typed options (`flows.config.engine_options`), passed as they are to the engine
    extra_columns: list[str]
    read_policies: list[str] | None
    retry: dict
    columns: dict[str, str] | None = None
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def covariates(self) -> list[str]:
        """The covariate columns the engine options name."""
        return list(self.opts.covariates)

    @property
    def needed_columns(self) -> list[str]:
        """Log columns the run reads: the base columns, the covariates and any extra columns, once each."""
        return list(dict.fromkeys(list(BASE_COLUMNS) + self.covariates + self.extra_columns))

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Context manager adding the block's wall time to ``timings[stage]``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - t0


def plan_run(logs_uri: str, window: Any, evaluation: str, results_uri: str | None, labels_uri: str | None,
             policies: list[str] | None, options: dict | None, as_of: str | None, retry_delays: list[float] | None,
             mode: str, columns: dict[str, str] | None = None, monitoring: dict[str, Any] | None = None) -> RunPlan:
    """Resolve defaults and check every parameter (names, URIs, window, options, column mapping,
    monitoring settings); no I/O."""
    check_publish_name(evaluation, "evaluation name")
    for what, uri in (("logs_uri", logs_uri), ("results_uri", results_uri), ("labels_uri", labels_uri)):
        if uri:
            check_uri(uri, what)
    opts = engine_options(options, policies, mode)  # the object itself when it was parsed already
    if mode == "direct":
        extra_columns, read_policies = segment_columns(opts), policies
    else:
        extra_columns, read_policies = flow_columns(opts), flow_policies(opts)
    columns = check_columns(columns, "columns", option_covariates(options)) or None
    delays = list(retry_delays) if retry_delays is not None else list(DEFAULT_RETRY_DELAYS)
    return RunPlan(evaluation=evaluation, window_spec=str(window), window=parse_window(window, as_of),
                   logs_uri=logs_uri, results_uri=results_uri or logs_uri, labels_uri=labels_uri or logs_uri,
                   policies=policies, mode=mode, opts=opts, extra_columns=extra_columns,
                   read_policies=read_policies, retry=dict(retries=len(delays), retry_delay_seconds=delays or [0.0]),
                   columns=columns, monitoring=check_monitoring(monitoring))


def config_hash(config: dict) -> str:
    """Stable short hash of a JSON-ready configuration."""
    blob = json.dumps(config, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def _code_version() -> str:
    try:
        return f"cje-service {version('cje-service')}, engine {ENGINE_VERSION}"
    except Exception:  # noqa: BLE001 - not installed: source tree
        return f"engine {ENGINE_VERSION} (source tree)"


def run_config(plan: RunPlan) -> dict:
    """The configuration that, with the inputs' fingerprint, names the run (its run key)."""
    config = {"evaluation": plan.evaluation, "window": plan.window.label,
              "policies": sorted(plan.policies) if plan.policies else None, "options": plan.opts.declared,
              "logs_uri": plan.logs_uri, "labels_uri": plan.labels_uri}
    if plan.mode != "direct":
        config["mode"] = plan.mode
    if plan.columns:  # the same rows under other names: a different input, so a different run key
        config["columns"] = dict(sorted(plan.columns.items()))
    return config


def build_manifest(plan: RunPlan, files: list[dict], counts: dict, label_info: dict, ray_kind: str) -> dict:
    """The run's manifest: window, configuration, input lineage, row counts, versions, timings."""
    config = run_config(plan)
    return {
        "window_spec": {"start": plan.window.start.isoformat(), "end": plan.window.end.isoformat(),
                        "spec": plan.window_spec, **plan_days(plan, files)},
        "config": config,
        "config_hash": config_hash(config),
        "inputs": {"logs_uri": plan.logs_uri, "files": files, "n_files": len(files),
                   "bytes": sum(f["size"] or 0 for f in files)},
        "rows": counts,
        "labels": label_info,
        "monitoring": plan.monitoring.model_dump(mode="json"),  # the settings of its regression alarms
        "code_version": _code_version(),
        "engine_version": ENGINE_VERSION,
        "seed": int(plan.opts.seed),
        "ray": ray_kind,
        "flow_run_id": _flow_run_id(),
        "created_at": datetime.now(timezone.utc).isoformat(),
        "timings_s": {k: round(v, 3) for k, v in plan.timings.items()},
        # the steps owed after the commit, each recorded once done (a killed run's retry finishes them)
        FOLLOWUPS: list(FOLLOWUP_STEPS),
    }


def plan_days(plan: RunPlan, files: Sequence[dict]) -> dict[str, list[str]]:
    """The window's days the run holds (``days``, a log partition each) and those without logs
    (``missing_days``): `flows.storage.logs.window_days` of the partitions read."""
    return window_days([f["key"] for f in files], plan.window.start, plan.window.end)


def run_key_of(plan: RunPlan, files: list[dict], label_info: dict) -> str:
    """Deterministic run key from the configuration and the inputs' fingerprint."""
    fingerprint = {"files": sorted(files, key=lambda f: f["key"]),
                   "label_store_version": label_info["label_store_version"]}
    return _run_key(run_config(plan), fingerprint)


def check_parameters(p: dict[str, Any]) -> None:
    """The `evaluate` flow's checks before a run is created: `plan_run` of its (validated) parameters and its
    ``row_pass`` for its mode (`flows.pipelines.sharded_pass.check_row_pass`)."""
    plan_run(p["logs_uri"], p["window"], p["evaluation"], p["results_uri"], p["labels_uri"], p["policies"],
             p["options"], p["as_of"], p["retry_delays"], p["mode"], p["columns"], p["monitoring"])
    check_row_pass(p.get("row_pass", "auto"), p["mode"])


# --------------------------------------------------------------------------------------
# the flow's stages (each a few tasks)


@dataclass
class WindowRows:
    """The window's rows with their labels (``table``), the partitions read and the label information."""

    files: list[dict]
    label_info: dict
    table: pa.Table | None

    def take_table(self) -> pa.Table:
        """The table, dropping this object's reference (so the caller's ``del`` frees its memory)."""
        table, self.table = self.table, None
        if table is None:
            raise RuntimeError("the window's table was taken already")  # pragma: no cover - a programming error
        return table


def read_labelled_window(plan: RunPlan, cfg: Any, files: list[dict] | None = None) -> WindowRows:
    """``discover`` (unless ``files`` are given), ``load_labels``, ``read`` and ``join_labels``: the window's rows
    with their labels."""
    with plan.timed("read"):
        if files is None:
            files = discover.with_options(**plan.retry)(plan.logs_uri, quote(cfg), plan.window)
        labels, label_info = load_labels.with_options(**plan.retry)(plan.labels_uri, quote(cfg))
        table = read_needed(plan, cfg, files)
        table, label_info = join_labels(quote(table), quote(labels), label_info)
    return WindowRows(files=files, label_info=label_info, table=table)


def compute(plan: RunPlan, cfg: Any, rows: WindowRows, n_chunks: int | None) -> tuple[dict, Any]:
    """``validate``, ``prepare``, ``bootstrap`` and ``finalize``: row counts and the engine's result.

    The table is released after ``prepare`` (the bootstrap needs only the prepared state).
    """
    with plan.timed("statistics"):
        table = rows.take_table()
        table = preflight.derive_covariates(table, plan.covariates, plan.logs_uri)  # as `cje evaluate` does
        counts = validate(quote(table), plan.covariates, plan.logs_uri)
        prep = (prepare if plan.mode == "direct" else prepare_offpolicy)(quote(table), plan.opts, plan.logs_uri,
                                                                          quote(cfg))
        del table
        chunks = bootstrap(quote(prep), n_chunks)
        return counts, finalize(quote(prep), quote(chunks))


def sharded_window(plan: RunPlan, cfg: Any, files: list[dict], reason: str,
                   footers: tuple[int, list | None] | None = None) -> tuple[WindowRows, dict, Any]:
    """``load_label_index`` then the sharded row pass (`flows.pipelines.sharded_pass.compute_sharded`): the label
    store is read and indexed on a Ray worker while the readers sample the prompt ids; the rows are read, joined
    with its labels and reduced on Ray workers; the driver holds neither the labels nor the rows."""
    from flows.runtime.label_index import BUILD_KEYS

    with plan.timed("statistics"):
        pending = load_label_index.with_options(**plan.retry)(plan.labels_uri, quote(cfg),
                                                              plan.retry["retry_delay_seconds"][:plan.retry["retries"]])
        counts, join, result = compute_sharded(plan, cfg, files, pending, reason, get_run_logger(), footers=footers)
    label_info = pending.info()  # done: the readers had the index (its error was raised by `compute_sharded`)
    build = {k: label_info.pop(k, 0) for k in BUILD_KEYS}
    if label_info["label_store_version"]:
        get_run_logger().info("label store version %d: %d label row(s), %d flagged; indexed on a Ray worker (%.1f MiB "
                              "in the object store) in %.2f s (%.2f s of CPU)", label_info["label_store_version"],
                              label_info["n_label_rows"], label_info["n_flagged"], build["index_bytes"] / 2**20,
                              build["build_s"], build["build_cpu_s"])
    label_info = {**label_info, **join, "n_joined": counts["n_labelled"],
                  "source": ("logs+label_store" if join["n_inline_labels"] else "label_store")
                  if label_info["label_store_version"] else ("logs" if counts["n_labelled"] else "none")}
    return WindowRows(files=files, label_info=label_info, table=None), counts, result


def render_and_publish(plan: RunPlan, cfg: Any, files: list[dict], counts: dict, label_info: dict, result: Any,
                       ray_kind: str) -> tuple[str, dict]:
    """``check_label_counts``, ``render`` and ``publish``: the run key and the publish outcome.

    A drop of labelled rows against the previous run of the window is recorded in ``label_info``
    (``labelled_count_drop``), so also in the manifest.
    """
    win = plan.window
    key = run_key_of(plan, files, label_info)
    drop = check_label_counts.with_options(**plan.retry)(plan.results_uri, quote(cfg), plan.evaluation, win, counts)
    if drop:
        label_info["labelled_count_drop"] = drop
    with plan.timed("render"):
        artifacts = render(quote(result), f"CJE evaluation {plan.evaluation} - {win.start} to {win.end}",
                           plan_days(plan, files))
    manifest = build_manifest(plan, files, counts, label_info, ray_kind)
    with plan.timed("publish"):
        outcome = publish.with_options(**plan.retry)(plan.results_uri, quote(cfg), plan.evaluation, win, key,
                                                     quote(artifacts), manifest)
    if outcome["published"]:
        refresh_pages(plan.results_uri, cfg, plan.evaluation, why=f"publishing {key}")
    get_run_logger().info("timings (s): %s", {k: round(v, 2) for k, v in plan.timings.items()})
    return key, outcome


# --------------------------------------------------------------------------------------
# the flow


@checked_flow(name="evaluate", log_prints=False, validate_parameters=True, check=check_parameters)
def evaluate(
    logs_uri: str,
    window: str = "last 7 days",
    evaluation: str = "default",
    results_uri: str | None = None,
    labels_uri: str | None = None,
    policies: list[str] | None = None,
    options: EngineOptionsParameter = None,
    as_of: str | None = None,
    n_chunks: int | None = None,
    retry_delays: list[float] | None = None,
    mode: str = "direct",
    columns: dict[str, str] | None = None,
    monitoring: dict[str, Any] | None = None,
    row_pass: Literal["auto", "single", "sharded"] = "auto",
) -> dict:
    """Evaluate a window of logs and publish the result.

    Parameters
    ----------
    logs_uri : str
        Root of the hive-partitioned logs (``s3://bucket/prefix`` or a local folder).
    window : str
        ``"last N days"`` (full days before ``as_of``), ``"YYYY-MM-DD..YYYY-MM-DD"`` or a
        single date.
    evaluation : str
        Name of the evaluation (results go to ``results/<evaluation>/<window>/<run_key>/``).
    results_uri, labels_uri : str, optional
        Where results are published and where the label store lives (default: ``logs_uri``).
    policies : list of str, optional
        Only these policies (pushed down into the read).
    options : EvaluationOptions, OffPolicyOptions or dict, optional
        Engine options: the typed object of a declared evaluation (``EvaluationSpec.flow_parameters()``),
        used as it is, or a mapping (``covariates``, ``n_bootstrap``, ``seed``, ...; a deployment's JSON),
        parsed once by `flows.config.engine_options`.
    as_of : str, optional
        Reference date of a relative window (default: today, UTC).
    n_chunks : int, optional
        Bootstrap chunks on Ray (default: twice the cluster's CPUs).
    retry_delays : list of float, optional
        Backoff between retries of storage steps (default 2, 10, 30 s).
    mode : {"direct", "logs-only", "hybrid"}
        ``direct`` (default): fresh responses of every policy. ``logs-only`` / ``hybrid``: the
        logger's logged responses with ``base_logprob`` and ``logprob__<candidate>`` columns (read
        by projection), plus the candidates' fresh draws in hybrid mode
        (`cje_engine.pipeline.offpolicy`; candidates from ``options["targets"]`` or ``policies``).
    columns : dict, optional
        Canonical column -> the column name in the logs (the evaluation's ``columns:``); the
        files' columns are renamed as they are read (`flows.storage.logs.read_window`).
    monitoring : dict, optional
        The evaluation's ``monitoring:`` (`flows.config.MonitoringConfig`: alpha, baseline,
        baseline_windows, horizon, decision_margin, pools, label_requests) for the regression alarms
        across windows (docs/monitoring.md); default: its defaults.
    row_pass : {"auto", "single", "sharded"}
        Where the rows are reduced (the evaluation's ``row_pass:``): ``sharded`` on Ray workers, shards by
        prompt (`flows.pipelines.sharded_pass`, Direct mode), ``single`` in this process, ``auto`` sharded from
        `flows.pipelines.sharded_pass.SHARDED_MIN_BYTES` of logs (logs-only and hybrid: always single, they have
        no sharded path; ``sharded`` with them is refused before the run). The numbers are the same; the log says
        which path ran and the result's ``inference.row_pass`` records it with the reason.

    Returns
    -------
    dict
        ``evaluation``, ``window``, ``run_key``, ``published``, ``path``, ``reason``,
        ``report`` (location of report.html), ``timings`` (seconds per stage) and
        ``result`` (the result dict).
    """
    plan = plan_run(logs_uri, window, evaluation, results_uri, labels_uri, policies, options, as_of,
                    retry_delays, mode, columns, monitoring)
    cfg = StorageConfig.from_env()  # from the driver's environment, never a flow parameter
    get_run_logger().info("evaluation %r over %s (%s) from %s", evaluation, plan.window.label, window, logs_uri)
    with ray_runtime.ray_session() as ray_kind:
        files = discover.with_options(**plan.retry)(plan.logs_uri, quote(cfg), plan.window)
        size = sum(int(f.get("size") or 0) for f in files)
        # The footers' rows, when they can decide (`auto`, Direct, under the bytes' threshold, and at least a byte a
        # row of `SHARDED_MIN_ROWS`): a small window reads no footer, and its reads stay those of the single path.
        footers = (window_footers(plan.logs_uri, cfg, files, plan.columns) if row_pass == "auto" and
                   plan.mode == "direct" and SHARDED_MIN_ROWS <= size < SHARDED_MIN_BYTES else None)
        path, why = row_pass_for(row_pass, plan.mode, files, None if footers is None else footers[0])
        get_run_logger().info("row pass: %s (%s)", path, why)
        if path == "sharded":
            rows, counts, result = sharded_window(plan, cfg, files, why, footers)  # label index, shards on Ray, finalize
        else:
            rows = read_labelled_window(plan, cfg, files)  # load_labels, read, join_labels
            counts, result = compute(plan, cfg, rows, n_chunks)  # validate, prepare, bootstrap, finalize
            result.model.inference.row_pass = single_row_pass(why)  # the path taken and why (off-policy: always)
    files, label_info = rows.files, rows.label_info
    key, outcome = render_and_publish(plan, cfg, files, counts, label_info, result, ray_kind)
    alarms = monitor_evaluation(plan.results_uri, cfg, evaluation, plan.window.label, key, outcome,
                                result.to_dict(), plan.monitoring)
    drop = label_info.get("labelled_count_drop")
    return {"evaluation": evaluation, "window": plan.window.label, "run_key": key, **outcome,
            "report": outcome.get("artifacts", {}).get("report.html"), "timings": plan.timings,
            "labels": label_info, "warnings": [drop["message"]] if drop else [],
            "monitoring": {k: alarms.get(k) for k in ("alarms", "undecided", "error")},
            "result": result.to_dict()}


def _run_key(config: dict, fingerprint: dict) -> str:
    return run_key(config, fingerprint)


def _flow_run_id() -> str | None:
    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else None


__all__ = ["evaluate", "plan_run", "RunPlan", "check_parameters"]
