"""Checks of a declared evaluation's inputs before Prefect and Ray start, and the covariates
the service derives from the logs (as `cje evaluate` does).

`check_evaluation` looks at the logs (layout, the first partition's columns, the covariates, the declared
label and score scales against every partition's values) with
the driver's own storage settings and raises `CJEInputError` with one line naming what is wrong
(exit code 2), or lets `flows.storage.objects.StorageError` through (exit code 69), so that
`cje run` / `cje serve` fail in a second instead of after starting the services.

Derived covariates: ``response_length`` is the number of whitespace-separated tokens of the
``response`` text, the rule of `cje_engine.data.io.load_frame` (regex ``\\S+`` on the text). When
the logs have no ``response_length`` column but have ``response``, the flow reads ``response``
instead (`read_columns`) and adds the covariate after the read (`derive_covariates`).

Column mapping: with an evaluation's ``columns:`` (canonical -> the logs' own names) every name
here is canonical, after the files' columns are renamed by the reader's own rule
(`flows.storage.logs.log_renames`).  The check reads every partition's footer then, so that a
mapped column missing from any file is one line naming that object and the column.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

# `did_you_mean` from the engine, where `flows.config` has it too: a Ray worker of the sharded readers imports this
# module (`FileRows`) and not `flows.config` (pydantic's models: ~0.1 s of CPU a fresh worker)
from cje_engine.errors import CJEInputError, did_you_mean

from flows.storage.logs import log_renames

log = logging.getLogger(__name__)

#: Derivable covariate -> the log column it is derived from.
DERIVED = {"response_length": "response"}
_TOKEN = r"\S+"  # the engine's rule (cje_engine.data.io._token_count)
_OTHER_FORMATS = (".csv", ".jsonl", ".ndjson", ".json")


def read_columns(columns: Sequence[str], covariates: Sequence[str], available: Sequence[str]) -> list[str]:
    """``columns`` to read, with each derivable covariate missing from ``available`` replaced by its source."""
    have = set(available)
    out = []
    for c in columns:
        if c in covariates and c in DERIVED and c not in have and DERIVED[c] in have:
            out.append(DERIVED[c])
        else:
            out.append(c)
    return list(dict.fromkeys(out))


def derive_covariates(table: pa.Table, covariates: Sequence[str], source: str = "<logs>") -> pa.Table:
    """Add the derivable covariates the table lacks (and drop their source text column if it was
    read only for them)."""
    for cov in covariates:
        src = DERIVED.get(cov)
        if src is None or cov in table.column_names or src not in table.column_names:
            continue
        text = table[src]
        if text.null_count:
            row = int(pc.index(pc.is_null(text), True).as_py())
            raise CJEInputError(f"response text is missing, so {cov} cannot be derived for this row", source=source,
                                column=src, row=row)
        counts = pc.count_substring_regex(text, _TOKEN)
        table = table.append_column(cov, pc.cast(counts, pa.float64()))
        if src not in covariates:
            table = table.drop_columns([src])
    return table


def logs_columns(logs_uri: str, cfg: Any, files: Sequence[dict], *, strict: bool = False,
                 mapping: Mapping[str, str] | None = None) -> list[str]:
    """Column names of the first partition file of the window (its Parquet footer only), renamed
    by ``mapping`` (`flows.storage.logs.log_renames`: a mapped column the file lacks is `CJEInputError`).

    ``strict`` (the pre-flight check): an unreadable footer is `CJEInputError` naming the object, a
    failure of the storage service or the network (`flows.storage.objects.is_storage_service_error`)
    `StorageError` (exit 69, never "bad input").
    Otherwise (inside the flow) it gives ``[]``: the read that follows retries storage errors and
    names a malformed object itself, so an outage is never reported as bad input here.
    """
    import pyarrow.dataset as ds

    from flows.storage.objects import Storage, StorageError, short_error, is_storage_service_error

    if not files:
        return []
    st = Storage.for_uri(logs_uri, cfg)
    fs, _ = st.arrow_fs
    key = files[0]["key"]
    try:
        names = list(ds.dataset(st.arrow_path(key), filesystem=fs, format="parquet").schema.names)
    except (pa.ArrowInvalid, OSError) as exc:
        if strict and is_storage_service_error(exc):  # 503, a timeout, access denied: not the file's fault
            raise StorageError(f"read {st.url(key)} failed: {short_error(exc, cfg)}", key=key,
                               operation="read") from None
        if strict:
            raise CJEInputError(f"is not a readable Parquet log file: {' '.join(str(exc).split())[:200]}",
                                source=st.url(key)) from None
        log.debug("footer of %s not readable (%s); no covariate is derived from it", st.url(key), exc)
        return []
    renames = log_renames(names, mapping, st.url(key))
    return [renames.get(n, n) for n in names]


def check_mapped_files(st: Any, files: Sequence[dict], mapping: Mapping[str, str],
                       first_names: Sequence[str] = ()) -> None:
    """Every file of the window has the mapped columns (footers only, `inline_label_columns`,
    which renames each file's columns by `log_renames`), and a mapped label column is in at
    least one file (else the labels the mapping names would silently be none)."""
    from flows.storage.labels import LABEL_COLUMNS, inline_label_columns

    keys = [f["key"] for f in files]
    inline = inline_label_columns(st, keys, mapping=mapping)
    for canon in LABEL_COLUMNS:
        if canon in mapping and canon not in inline["columns"]:
            raise CJEInputError(f"columns maps {canon!r} to {mapping[canon]!r}, which is in none of the {len(keys)} "
                                f"log file(s) of the window{did_you_mean(mapping[canon], first_names)}; fix the "
                                "name, or drop the key", source=st.url(keys[0]),
                                column=mapping[canon], option="columns")


def _layout_error(st: Any, win: Any) -> CJEInputError:
    """What the logs root holds instead of the window's ``dt=YYYY-MM-DD/*.parquet`` partitions."""
    from flows.storage.logs import partition_of

    infos = st.list("")
    dates = sorted({d for i in infos if (d := partition_of(i.key))})
    other = [i.key for i in infos if i.key.lower().endswith(_OTHER_FORMATS)]
    layout = "see docs/logs-layout.md"
    if not infos:
        return CJEInputError(f"the logs root is empty: expected Parquet files under dt=YYYY-MM-DD/ folders ({layout})",
                             source=st.url())
    if not dates and other:
        return CJEInputError(f"the logs must be Parquet files under dt=YYYY-MM-DD/ folders, but this root holds "
                             f"{len(other)} CSV/JSON file(s) (e.g. {other[0]}); for a file or folder of CSV/JSONL use "
                             f"`cje evaluate`, or write the logs with flows.storage.logs.write_logs ({layout})",
                             source=st.url())
    if not dates:
        return CJEInputError(f"no dt=YYYY-MM-DD/ partition folders under the logs root ({len(infos)} object(s), "
                             f"e.g. {infos[0].key}; {layout})", source=st.url())
    return CJEInputError(f"no log partitions in the window {win.start}..{win.end}: the logs have dt={dates[0]} to "
                         f"dt={dates[-1]} ({len(dates)} day(s)); change window, or give --as-of / --window",
                         source=st.url())


def _declared_scales(options: Any) -> list[tuple[str, str, tuple[float, float]]]:
    """(canonical column, option, (lo, hi)) of the declared label and score scales of a run's typed options
    (`flows.config.engine_options`; an unbounded score scale is not checked)."""
    eng = getattr(options, "engine", options)  # OffPolicyOptions keeps the engine's options in ``engine``
    out = [("oracle_label", "label_scale", eng.label_scale), ("judge_score", "score_scale", eng.score_scale)]
    return [(c, o, sc) for c, o, sc in out if sc is not None]


def check_scales(st: Any, files: Sequence[dict], options: Any,
                 mapping: Mapping[str, str] | None = None) -> None:
    """Every log file's ``judge_score`` and inline ``oracle_label`` values lie in the declared scales:
    the rule and the one-line message of `cje evaluate` (`cje_engine.data.io.check_scale_range`), naming
    the object and its row, before Prefect and Ray start (it used to fail inside the flow: tracebacks,
    the same error eight times, 21 s). Only those two columns are read; a non-numeric column is left to
    the flow's reader, which names it."""
    import pyarrow.dataset as ds

    from cje_engine.data.io import check_scale_range

    scales = _declared_scales(options)
    fs, _ = st.arrow_fs
    for f in files:
        url = st.url(f["key"])
        try:
            data = ds.dataset(st.arrow_path(f["key"]), filesystem=fs, format="parquet")
        except (pa.ArrowInvalid, OSError) as exc:
            raise CJEInputError(f"is not a readable Parquet log file: {' '.join(str(exc).split())[:200]}",
                                source=url) from None
        source_of = {canon: name for name, canon in log_renames(data.schema.names, mapping, url).items()}
        source_of.update({n: n for n in data.schema.names if n not in source_of.values() and n not in source_of})
        wanted = [(source_of[c], c, o, sc) for c, o, sc in scales if c in source_of]
        if not wanted:
            continue
        table = data.to_table(columns=list(dict.fromkeys(w[0] for w in wanted)))
        for name, canon, option, scale in wanted:
            try:
                values = pc.cast(table[name], pa.float64()).to_numpy(zero_copy_only=False)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue
            check_scale_range(values, scale, url, canon, option)


def check_segment_columns(opts: Any, names: Sequence[str], evaluation: str | None, log_file: str,
                          config_file: str | None = None) -> None:
    """Every segment column of the options (``segments.by``) is a column of the logs (``names``: the first
    partition file's, renamed by the evaluation's mapping).

    Raises
    ------
    CJEInputError
        One line naming the evaluations file (else the log file), the evaluation, the column, the closest log
        column (did you mean) and the log file read.
    """
    from flows.config import segment_columns

    for col in segment_columns(opts):
        if col in names:
            continue
        raise CJEInputError(f"evaluation {evaluation!r}: segments.by names column {col!r}, which is not a log column"
                            f"{did_you_mean(col, names)} (the first log file of the window, {log_file}, has: "
                            f"{', '.join(names)})", source=config_file or log_file, column=col, option="segments")


def check_evaluation(params: dict, config_file: str | None = None) -> dict:
    """Check the inputs of an evaluate-flow run (``EvaluationSpec.flow_parameters()`` plus overrides).

    Parameters
    ----------
    params : dict
        The flow's parameters.
    config_file : str, optional
        The evaluations file the evaluation was declared in (named by the errors about its declarations).

    Returns
    -------
    dict
        ``{"n_files", "columns", "derived"}``.

    Raises
    ------
    CJEInputError
        One line, on a bad window, options, layout, missing columns or segment columns, or underivable
        covariates.
    """
    from pathlib import Path

    from flows.config import check_columns, engine_options, option_covariates, parse_window
    from flows.storage.logs import REQUIRED, discover_partitions
    from flows.storage.objects import Storage, StorageConfig

    logs_uri = params["logs_uri"]
    win = parse_window(params.get("window") or "last 7 days", params.get("as_of"))
    mode = params.get("mode") or "direct"
    opts = engine_options(params.get("options"), params.get("policies"), mode)  # as it is when already typed
    covariates: list[str] = list(opts.covariates) if mode == "direct" else []
    mapping = check_columns(params.get("columns"), "columns", option_covariates(params.get("options"))) or None
    if "://" not in str(logs_uri) and not Path(logs_uri).is_dir():
        raise CJEInputError("the logs folder does not exist (logs_uri)", source=str(logs_uri))
    cfg = StorageConfig.from_env()
    st = Storage.for_uri(logs_uri, cfg)
    files = [{"key": f.key} for f in discover_partitions(st, win.start, win.end)]
    if not files:
        raise _layout_error(st, win)
    names = logs_columns(logs_uri, cfg, files, strict=True, mapping=mapping)
    source = st.url(files[0]["key"])
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        how = "add it to" if mapping else "map your names with"
        raise CJEInputError(f"required log column(s) {missing} missing (found: {', '.join(names)}; "
                            f"{how} the evaluation's columns:, e.g. {{{missing[0]}: <your column>}}; "
                            f"see docs/logs-layout.md)", source=source, column=missing[0])
    if mapping:
        check_mapped_files(st, files, mapping, names)
    check_scales(st, files, opts, mapping)
    derived = []
    for cov in covariates:
        if cov in names:
            continue
        if cov in DERIVED and DERIVED[cov] in names:
            derived.append(cov)
            continue
        how = f" and there is no {DERIVED[cov]!r} column to derive it from" if cov in DERIVED else ""
        raise CJEInputError(f"covariate {cov!r} is not a log column{how} (found: {', '.join(names)})",
                            source=source, column=cov)
    check_segment_columns(opts, names, params.get("evaluation"), source, config_file)
    log.info("inputs checked: %d partition file(s) in %s..%s%s", len(files), win.start, win.end,
             f"; derived from the response text: {', '.join(derived)}" if derived else "")
    return {"n_files": len(files), "columns": names, "derived": derived}
