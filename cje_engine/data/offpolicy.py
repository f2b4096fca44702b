"""Loading and validation of logged data for logs-only and hybrid (off-policy) evaluation.

Accepted shapes of the **logged** responses (the logger policy's own responses, each with its
teacher-forced sequence log-probability under the logger and under every candidate):

- **wide**: one row per logged response with ``prompt_id``, ``judge_score``, optional
  ``oracle_label`` / ``label_probability`` / ``response_id`` / ``response`` / covariates, the
  logger's log-probability in ``base_logprob`` (aliases ``logger_logprob``,
  ``base_policy_logprob``) and one ``logprob__<policy>`` column per candidate;
- **long**: one row per (logged response, policy) with ``response_id``, ``policy`` and
  ``logprob`` (the log-probability of that response under that policy), the logger's own row
  included; response attributes (``prompt_id``, ``judge_score``, labels, covariates) are taken
  from the logger's row. Needs ``logger=`` to say which policy wrote the responses;
- **arena**: the shape of ``arena_sample/logged_data.jsonl``: ``base_policy_logprob``,
  ``target_policy_logprobs`` (an object ``{policy: logprob}``), ``metadata.prompt_id``,
  ``judge_score``, ``oracle_label`` (a folder holding ``logged_data.jsonl`` is read too);
- **combined**: a wide table that also holds **fresh draws** (rows whose ``policy`` is a
  candidate, logprob columns empty): this is what the evaluate flow reads from the logs. The
  logger is the policy whose rows carry the logger log-probability.

Fresh draws may also be given separately (``fresh=``: anything `cje_engine.data.io.load_frame`
reads, e.g. the arena folder, whose ``probe_slice/`` labels are joined). Fresh rows of the
logger or of policies that are not candidates are dropped.

Every row goes through `cje_engine.data.io.load_frame` (ids, scores, labels, scales, covariates,
duplicates), so logged rows and fresh draws are validated exactly as Direct's inputs. On top,
the log-probabilities of logged rows are checked: a NaN, missing, ``+inf`` or positive value
(beyond 1e-6 rounding), a logger value of ``-inf``, a missing candidate column, a long table in
which some response lacks a candidate's log-probability (length mismatch), and a candidate
giving probability 0 to every logged response (all weights zero) each raise `CJEInputError`
naming the file, the column and (where there is one) the row of the input.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from cje_engine.data.frame import LABEL, POLICY, PROMPT, RESPONSE_ID, SCORE, Scale
from cje_engine.errors import CJEInputError, did_you_mean
from cje_engine.data.io import load_frame, read_jsonl_records
from cje_engine.offpolicy.inputs import FreshData, LoggedData
from cje_engine.offpolicy.weights import LOG_PROB_ATOL

logger = logging.getLogger(__name__)

#: Accepted names of the logger's log-probability column, in order of preference.
LOGGER_COLUMNS = ("base_logprob", "logger_logprob", "base_policy_logprob")
#: Prefix of a candidate's log-probability column (``logprob__<policy>``).
TARGET_PREFIX = "logprob__"
#: Column of a long-format log-probability table.
LONG_LOGPROB = "logprob"
#: Token-count column used for per-token TTC when present (``length_column`` overrides).
DEFAULT_LENGTH_COLUMN = "n_tokens"
#: Arena file inside an arena folder.
ARENA_LOGGED = "logged_data.jsonl"
#: Policy name given to the logged rows when the input has no ``policy`` column and no ``logger=``.
DEFAULT_LOGGER = "logger"

_PLACEHOLDER = "__cje_logger__"
_ROW = "__cje_offpolicy_row"


def target_column(policy: str) -> str:
    """Name of the column holding log-probabilities under ``policy``."""
    return f"{TARGET_PREFIX}{policy}"


@dataclass(frozen=True)
class OffPolicyData:
    """Validated logged responses and fresh draws, ready for calibration and estimation.

    Attributes
    ----------
    frame : pandas.DataFrame
        Canonical frame (`cje_engine.data.io.load_frame` columns): the ``n_logged`` logged rows first
        (``policy`` = ``logger``), then the kept fresh draws (``policy`` = a candidate).
    logger, targets : the logging policy and the candidates, in order
    logger_logprob : shape (n_logged,), the logger's log-probability of each logged response
    target_logprob : candidate -> shape (n_logged,)
    lengths : shape (n_logged,) token counts, or None (then TTC uses total surprisal)
    fresh_logprob : candidate -> shape (n_frame,) its own log-probability of its fresh draws
        (NaN elsewhere) where the input carried them (TTC then uses the fresh reference)
    fresh_lengths : shape (n_frame,) or None
    source, fresh_source : names used in messages
    logger_column : the column the logger's log-probabilities came from
    notes : plain-language notes for the result's warnings (dropped rows, ...)
    """

    frame: pd.DataFrame
    logger: str
    targets: tuple[str, ...]
    n_logged: int
    logger_logprob: np.ndarray
    target_logprob: dict[str, np.ndarray]
    lengths: np.ndarray | None
    fresh_logprob: dict[str, np.ndarray]
    fresh_lengths: np.ndarray | None
    source: str
    fresh_source: str | None
    logger_column: str
    notes: tuple[str, ...] = ()
    segment_values: np.ndarray | None = None  # (n_frame,) each row's prompt segment (``segment_by``), or None

    def subset(self, rows: np.ndarray) -> "OffPolicyData":
        """The same data restricted to frame rows ``rows`` (sorted; the logged ones stay first): a segment's data."""
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        logged = rows[rows < self.n_logged]
        take = lambda v: None if v is None else v[rows]  # noqa: E731
        return replace(self, frame=self.frame.iloc[rows].reset_index(drop=True), n_logged=int(logged.size),
                       logger_logprob=self.logger_logprob[logged],
                       target_logprob={t: v[logged] for t, v in self.target_logprob.items()},
                       lengths=None if self.lengths is None else self.lengths[logged],
                       fresh_logprob={t: v[rows] for t, v in self.fresh_logprob.items()},
                       fresh_lengths=take(self.fresh_lengths), segment_values=take(self.segment_values))

    def logged_rows(self) -> np.ndarray:
        """Row indices of the logged rows (the first ``n_logged`` rows of the frame)."""
        return np.arange(self.n_logged)

    def fresh_rows(self, target: str) -> np.ndarray:
        """Row indices of ``target``'s fresh draws (rows after the logged ones)."""
        pol = self.frame[POLICY].to_numpy()
        idx = np.flatnonzero(pol == target)
        return idx[idx >= self.n_logged]

    def has_fresh(self, target: str) -> bool:
        """Whether ``target`` has fresh draws of its own."""
        return self.fresh_rows(target).size > 0

    def logged_data(self, target: str) -> LoggedData:
        """The `LoggedData` of one candidate (validated log-weights)."""
        f = self.frame.iloc[: self.n_logged]
        return LoggedData(f[PROMPT].to_numpy(), f[SCORE].to_numpy(dtype=float), self.logger_logprob,
                          self.target_logprob[target], lengths=self.lengths, source=self.source,
                          target_column=target_column(target))

    def fresh_data(self, target: str) -> FreshData | None:
        """The candidate's fresh draws, or None without any."""
        idx = self.fresh_rows(target)
        if idx.size == 0:
            return None
        f = self.frame.iloc[idx]
        lp = self.fresh_logprob.get(target)
        lp = None if lp is None or np.isnan(lp[idx]).any() else lp[idx]
        lengths = None
        if lp is not None and self.lengths is not None:
            if self.fresh_lengths is None or np.isnan(self.fresh_lengths[idx]).any():
                lp = None  # per-token TTC needs the fresh draws' lengths too: fall back to the logs
            else:
                lengths = self.fresh_lengths[idx]
        return FreshData(f[PROMPT].to_numpy(), f[SCORE].to_numpy(dtype=float), lp, lengths,
                         source=self.fresh_source or self.source)


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


def _read_jsonl_records(path: Path) -> pd.DataFrame:
    if path.stat().st_size == 0:
        raise CJEInputError("file is empty (0 rows)", source=str(path))
    return pd.json_normalize(read_jsonl_records(path), max_level=1)


def _read_logged(logged: Any) -> tuple[pd.DataFrame, str, Path | None]:
    """The logged input as a DataFrame, its name for messages, and the arena folder if any."""
    if isinstance(logged, pd.DataFrame):
        return logged.reset_index(drop=True).copy(), "<DataFrame>", None
    if isinstance(logged, pa.Table):
        return logged.to_pandas(), "<pyarrow.Table>", None
    if not isinstance(logged, (str, os.PathLike)):
        raise CJEInputError(f"unsupported logged input of type {type(logged).__name__}: expected a path, a pandas "
                            "DataFrame or a pyarrow Table")
    path = Path(logged)
    if not path.exists():
        raise CJEInputError("path does not exist", source=str(path))
    arena = None
    if path.is_dir():
        if (path / ARENA_LOGGED).is_file():
            arena, path = path, path / ARENA_LOGGED
        else:
            try:
                return pq.read_table(path).to_pandas(), str(path), None
            except (pa.ArrowException, OSError) as exc:
                raise CJEInputError(f"not a readable folder of Parquet files ({exc})", source=str(path)) from None
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl_records(path), str(path), arena
    if suffix in (".parquet", ".pq", ".parq"):
        try:
            return pq.read_table(path).to_pandas(), str(path), arena
        except (pa.ArrowException, OSError) as exc:
            raise CJEInputError(f"not a readable Parquet file ({exc})", source=str(path)) from None
    if suffix == ".csv":
        try:
            return pd.read_csv(path), str(path), arena
        except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as exc:
            raise CJEInputError(f"not a readable CSV file ({exc})", source=str(path)) from None
    raise CJEInputError(f"unsupported file type '{suffix or '(no extension)'}' for logged data; expected .jsonl, "
                        ".parquet, .csv or a folder", source=str(path))


def _flatten(df: pd.DataFrame) -> pd.DataFrame:
    """Arena shape to wide: ``target_policy_logprobs.<t>`` -> ``logprob__<t>``,
    ``metadata.prompt_id`` -> ``prompt_id``; dict-valued columns are expanded first."""
    for col in ("target_policy_logprobs", "metadata"):
        if col in df.columns and df[col].map(lambda v: isinstance(v, dict)).any():
            expanded = pd.json_normalize([v if isinstance(v, dict) else {} for v in df[col]])
            expanded.columns = [f"{col}.{c}" for c in expanded.columns]
            expanded.index = df.index
            df = pd.concat([df.drop(columns=[col]), expanded], axis=1)
    ren = {c: target_column(c.split(".", 1)[1]) for c in df.columns if c.startswith("target_policy_logprobs.")}
    if PROMPT not in df.columns and "metadata.prompt_id" in df.columns:
        ren["metadata.prompt_id"] = PROMPT
    return df.rename(columns=ren)


def _pivot_long(df: pd.DataFrame, name: str, logger_name: str | None) -> pd.DataFrame:
    """Long (response_id, policy, logprob) rows to one wide row per logged response."""
    for col in (RESPONSE_ID, POLICY):
        if col not in df.columns:
            raise CJEInputError(f"a long log-probability table needs '{RESPONSE_ID}', '{POLICY}' and "
                                f"'{LONG_LOGPROB}' columns (found: {', '.join(map(str, df.columns))})",
                                source=name, column=col)
    pol = df[POLICY].astype(str)
    policies = list(dict.fromkeys(pol))
    if logger_name is None:
        raise CJEInputError(f"a long log-probability table needs logger=<policy> to say which of "
                            f"{', '.join(policies)} wrote the logged responses", source=name, column=POLICY)
    if logger_name not in policies:
        raise CJEInputError(f"logger '{logger_name}' has no rows (policies present: {', '.join(policies)})",
                            source=name, column=POLICY)
    rid = df[RESPONSE_ID].astype(str)
    dup = (rid + "\x00" + pol).duplicated().to_numpy()
    if dup.any():
        r = int(np.flatnonzero(dup)[0])
        raise CJEInputError(f"response {rid.iloc[r]!r} has two log-probabilities under policy {pol.iloc[r]!r}",
                            source=name, column=LONG_LOGPROB, row=r)
    is_logger = (pol == logger_name).to_numpy()
    wide = df.loc[is_logger].drop(columns=[LONG_LOGPROB]).copy()
    wide[_ROW] = np.flatnonzero(is_logger)
    wide["base_logprob"] = df.loc[is_logger, LONG_LOGPROB].to_numpy()
    wide_rid = rid[is_logger].to_numpy()
    pos = pd.Index(wide_rid)
    for p in policies:
        if p == logger_name:
            continue
        sel = (pol == p).to_numpy()
        other = rid[sel].to_numpy()
        unknown = ~pd.Index(other).isin(pos)
        if unknown.any():
            r = int(np.flatnonzero(sel)[np.flatnonzero(unknown)[0]])
            raise CJEInputError(f"response {other[unknown][0]!r} has a log-probability under {p!r} but no row of the "
                                f"logger '{logger_name}'", source=name, column=RESPONSE_ID, row=r)
        if other.size != wide_rid.size:
            have = pd.Index(wide_rid).isin(other)
            r = int(wide[_ROW].to_numpy()[np.flatnonzero(~have)[0]])
            raise CJEInputError(f"length mismatch: {other.size} log-probabilities under '{p}' for {wide_rid.size} "
                                f"logged responses; response {wide_rid[~have][0]!r} has none",
                                source=name, column=LONG_LOGPROB, row=r)
        vals = pd.Series(df.loc[sel, LONG_LOGPROB].to_numpy(), index=other)
        wide[target_column(p)] = vals.reindex(wide_rid).to_numpy()
    return wide.reset_index(drop=True)


# --------------------------------------------------------------------------------------------
# validation of log-probabilities
# --------------------------------------------------------------------------------------------


def _numbers(s: pd.Series, name: str, col: str, rows: np.ndarray) -> np.ndarray:
    """Column as float64; a non-number is an error naming the input row."""
    if pd.api.types.is_bool_dtype(s.dtype):
        raise CJEInputError("expected log-probabilities (numbers), got booleans", source=name, column=col,
                            row=int(rows[0]))
    if pd.api.types.is_numeric_dtype(s.dtype):
        return s.to_numpy(dtype=np.float64, na_value=np.nan)
    missing = s.isna().to_numpy()
    values = np.asarray(pd.to_numeric(s, errors="coerce"), dtype=np.float64)
    bad = np.isnan(values) & ~missing
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CJEInputError(f"{s.iloc[i]!r} is not a number; expected a log-probability <= 0", source=name,
                            column=col, row=int(rows[i]))
    return values


def check_logprobs(values: np.ndarray, *, source: str, column: str, rows: np.ndarray, logger_side: bool
                   ) -> np.ndarray:
    """Validated sequence log-probabilities of logged responses (``rows`` maps to input rows).

    NaN/missing, ``+inf`` and values above ``LOG_PROB_ATOL`` are errors; ``-inf`` is an error for
    the logger (it wrote the response) and means "weight 0" for a candidate. Rounding noise in
    (0, 1e-6] is set to 0.
    """
    v = np.asarray(values, dtype=float)
    checks = [
        (np.isnan(v), "log-probability is missing or NaN; expected a finite sequence log-probability <= 0 for "
                      "every logged response"),
        (np.isposinf(v), "log-probability is +inf; expected a finite value <= 0"),
        (v > LOG_PROB_ATOL, None),
    ]
    if logger_side:
        checks.insert(2, (np.isneginf(v), "the logger's log-probability is -inf, but the logger wrote this "
                                          "response so its probability must be positive; expected a finite "
                                          "value <= 0"))
    for mask, msg in checks:
        if mask.any():
            i = int(np.flatnonzero(mask)[0])
            if msg is None:
                msg = (f"log-probability {v[i]:.6g} is positive; a sequence log-probability must be <= 0 (was a "
                       "probability, a negated value or a per-token average given instead?)")
            raise CJEInputError(msg, source=source, column=column, row=int(rows[i]))
    return np.minimum(v, 0.0)


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------


def _reraise(exc: CJEInputError, names: dict[str, tuple[str, np.ndarray | None]]) -> CJEInputError:
    """Rename load_frame's ``<DataFrame #i>`` sources to the real input and map its rows back."""
    if exc.source not in names:
        return exc
    src, rows = names[exc.source]
    row = exc.row
    if row is not None and rows is not None and 0 <= row < rows.size:
        row = int(rows[row])
    return CJEInputError(exc.detail, source=src, column=exc.column, row=row)


def _logger_column(raw: pd.DataFrame, logger_column: str | None, name: str) -> str:
    """The column holding the logger's log-probabilities."""
    if logger_column is not None:
        if logger_column not in raw.columns:
            raise CJEInputError(f"logger log-probability column '{logger_column}' is missing (columns: "
                                f"{', '.join(c for c in raw.columns if c != _ROW)})", source=name, column=logger_column)
        return logger_column
    else:
        found = [c for c in LOGGER_COLUMNS if c in raw.columns]
        if not found:
            raise CJEInputError(
                "no logger log-probability column: expected one of " + ", ".join(LOGGER_COLUMNS)
                + f" (columns: {', '.join(c for c in raw.columns if c != _ROW)})", source=name, column=LOGGER_COLUMNS[0])
    return found[0]


def _logged_rows(raw: pd.DataFrame, lcol: str, logger_policy: str | None, name: str) -> tuple[str, np.ndarray]:
    """The logger's name and which rows are its logged responses (the rest are fresh draws)."""
    lp_raw = raw[lcol]
    carries = lp_raw.notna().to_numpy()
    if POLICY in raw.columns:
        pol = raw[POLICY].astype(str).where(raw[POLICY].notna(), None)
        if logger_policy is None:
            owners = sorted({p for p in pol[carries] if p is not None})
            if len(owners) != 1:
                raise CJEInputError(
                    "cannot tell the logger: rows carrying the logger log-probability belong to "
                    + (f"several policies ({', '.join(owners)}); pass logger=<policy>" if owners else
                       "no policy (every value is empty)"), source=name, column=lcol)
            logger_policy = owners[0]
        is_logged = (pol == logger_policy).to_numpy()
        if not is_logged.any():
            raise CJEInputError(f"logger '{logger_policy}' has no rows", source=name, column=POLICY)
    else:
        logger_policy = logger_policy or DEFAULT_LOGGER
        is_logged = np.ones(raw.shape[0], dtype=bool)
    if logger_policy == _PLACEHOLDER:
        raise CJEInputError(f"'{_PLACEHOLDER}' is reserved; rename the logger")
    return logger_policy, is_logged


def _candidates(raw: pd.DataFrame, targets: Sequence[str] | None, logger_policy: str, name: str) -> list[str]:
    """The candidate policies (every ``logprob__<policy>`` column by default)."""
    available = [c[len(TARGET_PREFIX):] for c in raw.columns if c.startswith(TARGET_PREFIX)]
    if targets is None:
        tlist = [t for t in available if t != logger_policy]
    else:
        tlist = [str(t) for t in ([targets] if isinstance(targets, str) else targets)]
        for t in tlist:
            if t == logger_policy:
                raise CJEInputError(f"'{t}' is the logger; candidates must be other policies", column=POLICY)
            if target_column(t) not in raw.columns:
                raise CJEInputError(
                    f"no log-probabilities for candidate '{t}': expected a column '{target_column(t)}' "
                    f"(candidate columns present: {', '.join(map(target_column, available)) or 'none'})",
                    source=name, column=target_column(t))
    tlist = list(dict.fromkeys(tlist))
    if not tlist:
        raise CJEInputError(f"no candidate policies: expected at least one '{TARGET_PREFIX}<policy>' column",
                            source=name, column=f"{TARGET_PREFIX}<policy>")
    return tlist


def _sources(raw: pd.DataFrame, is_logged: np.ndarray, rows_l: np.ndarray, name: str, mode: str, tlist: list[str],
             fresh: Any, arena: Path | None, notes: list[str]):
    """Sources for load_frame: logged rows under a placeholder policy (so they can never clash with
    fresh draws of the same policy), then fresh draws in the same table, then ``fresh``.

    Returns (sources, source names for error messages, fresh parts (rows, frame or None), fresh name).
    """
    logged_df = raw.loc[is_logged]
    lf = logged_df.drop(columns=[_ROW]).copy()
    lf[POLICY] = _PLACEHOLDER
    sources: list[Any] = [lf]
    names = {"<DataFrame #0>": (name, rows_l)}
    in_table = raw.loc[~is_logged]
    fresh_parts: list[tuple[int, pd.DataFrame | None]] = []  # (rows, frame with self-logprobs or None)
    fresh_name = None
    if mode == "hybrid":
        if in_table.shape[0]:
            keep = in_table[POLICY].astype(str).isin(tlist).to_numpy()
            dropped = int((~keep).sum())
            if dropped:
                notes.append(f"{dropped} row(s) of policies that are neither the logger nor a candidate were ignored")
            in_table = in_table.loc[keep]
        if in_table.shape[0]:
            names[f"<DataFrame #{len(sources)}>"] = (name, in_table[_ROW].to_numpy())
            sources.append(in_table.drop(columns=[_ROW]))
            fresh_parts.append((in_table.shape[0], in_table))
            fresh_name = name
        if fresh is None and arena is not None:
            fresh = arena
        if fresh is not None:
            if isinstance(fresh, (list, tuple)):
                items = list(fresh)
            else:
                items = [fresh]
            for item in items:
                if isinstance(item, (pd.DataFrame, pa.Table)):
                    df = item.to_pandas() if isinstance(item, pa.Table) else item.reset_index(drop=True)
                    names[f"<DataFrame #{len(sources)}>"] = ("<fresh DataFrame>", None)
                    names[f"<pyarrow.Table #{len(sources)}>"] = ("<fresh pyarrow.Table>", None)
                    sources.append(df)
                    fresh_parts.append((df.shape[0], df))
                else:
                    sources.append(item)
                    fresh_parts.append((-1, None))
            fresh_name = str(fresh) if not isinstance(fresh, (pd.DataFrame, pa.Table, list, tuple)) else "<fresh>"
    else:
        n_fresh = int(in_table.shape[0]) + (0 if fresh is None else 1)
        if n_fresh:
            notes.append("logs-only mode: fresh draws in the input were ignored (use mode='hybrid' to use them)")
    return sources, names, fresh_parts, fresh_name


def _fresh_selfprobs(fresh_parts: list, tlist: list[str], n_all: int, n_logged: int, with_lengths: bool,
                     lcol_len: str | None) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Self log-probabilities and lengths of fresh draws, where the in-memory inputs carry them."""
    fresh_lp = {t: np.full(n_all, np.nan) for t in tlist}
    fresh_len = np.full(n_all, np.nan) if with_lengths else None
    pos = n_logged
    for n_rows, df in fresh_parts:
        if n_rows < 0:
            break  # a path of unknown row count: nothing after it can be aligned
        if df is not None:
            pol_f = df[POLICY].astype(str).to_numpy() if POLICY in df.columns else None
            for t in tlist:
                col = target_column(t)
                if col in df.columns and pol_f is not None:
                    v = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)
                    own = pol_f == t
                    fresh_lp[t][pos:pos + n_rows][own] = v[own]
            if fresh_len is not None and lcol_len in df.columns:
                fresh_len[pos:pos + n_rows] = pd.to_numeric(df[lcol_len], errors="coerce").to_numpy(dtype=float)
        pos += n_rows
    return fresh_lp, fresh_len


def _finish_frame(frame: pd.DataFrame, fresh_lp: dict[str, np.ndarray], fresh_len: np.ndarray | None, n_logged: int,
                  tlist: list[str], logger_policy: str, mode: str, fresh_name: str, notes: list[str]):
    """Drop fresh draws of non-candidates, restore the logger's name, check ids and hybrid coverage."""
    n_all = frame.shape[0]
    pol_all = frame[POLICY].astype(str).to_numpy()
    keep = np.ones(n_all, dtype=bool)
    keep[n_logged:] = np.isin(pol_all[n_logged:], tlist)
    dropped = int((~keep).sum())
    if dropped:
        other = sorted(set(pol_all[n_logged:][~keep[n_logged:]]))
        notes.append(f"{dropped} fresh draw(s) of {', '.join(other)} (not candidates) were ignored")
    frame = frame.loc[keep].reset_index(drop=True)
    fresh_lp = {t: v[keep] for t, v in fresh_lp.items()}
    fresh_len = fresh_len[keep] if fresh_len is not None else None
    frame[POLICY] = np.where(frame[POLICY].to_numpy() == _PLACEHOLDER, logger_policy, frame[POLICY].to_numpy())
    rid = frame[RESPONSE_ID].astype(str)
    frame[RESPONSE_ID] = np.where(rid.str.startswith(_PLACEHOLDER + ":"),
                                  logger_policy + ":" + rid.str[len(_PLACEHOLDER) + 1:], rid)
    if frame[RESPONSE_ID].duplicated().any():
        r = int(np.flatnonzero(frame[RESPONSE_ID].duplicated().to_numpy())[0])
        raise CJEInputError(f"response_id {frame[RESPONSE_ID].iloc[r]!r} is used by a logged response and a fresh "
                            "draw; response ids must be unique", source=fresh_name, column=RESPONSE_ID)
    if mode == "hybrid":
        with_fresh = [t for t in tlist if np.any(frame[POLICY].to_numpy()[n_logged:] == t)]
        if not with_fresh:
            raise CJEInputError("hybrid mode needs fresh draws of at least one candidate (rows whose policy is one "
                                f"of {', '.join(tlist)}); none were found. Use mode='logs-only' or give fresh=",
                                source=fresh_name, column=POLICY)
        missing = [t for t in tlist if t not in with_fresh]
        if missing:
            notes.append(f"no fresh draws of {', '.join(missing)}: logs-only estimates for them")
    return frame, fresh_lp, fresh_len


def _one_row_per_response(raw: pd.DataFrame, name: str, logger_policy: str | None,
                          logger_column: str | None) -> pd.DataFrame:
    """The logged table with string column names, flattened, the long format pivoted to one row per
    response, and each row's original number in ``_ROW``."""
    if raw.shape[0] == 0:
        raise CJEInputError("input has no rows (0 rows)", source=name)
    raw.columns = [str(c) for c in raw.columns]
    raw = _flatten(raw)
    has_wide = any(c.startswith(TARGET_PREFIX) for c in raw.columns)
    has_logger_col = any(c in raw.columns for c in LOGGER_COLUMNS) or (logger_column in raw.columns)
    if LONG_LOGPROB in raw.columns and not has_wide and not has_logger_col:
        raw = _pivot_long(raw, name, logger_policy)
    if _ROW not in raw.columns:
        raw[_ROW] = np.arange(raw.shape[0])
    return raw


def _logged_logprobs(logged_df: pd.DataFrame, lcol: str, tlist: Sequence[str], name: str,
                     rows_l: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The logger's and every candidate's checked log-probabilities of the logged responses."""
    lp0 = check_logprobs(_numbers(logged_df[lcol], name, lcol, rows_l), source=name, column=lcol, rows=rows_l,
                         logger_side=True)
    lp_t: dict[str, np.ndarray] = {}
    for t in tlist:
        col = target_column(t)
        v = check_logprobs(_numbers(logged_df[col], name, col, rows_l), source=name, column=col, rows=rows_l,
                           logger_side=False)
        if np.all(np.isneginf(v)):
            raise CJEInputError(
                f"all importance weights are zero: '{t}' gives probability 0 to every one of the {v.size} logged "
                "responses, so the logs say nothing about it; collect fresh draws from it (Direct)",
                source=name, column=col)
        lp_t[t] = v
    return lp0, lp_t


def _logged_lengths(raw: pd.DataFrame, logged_df: pd.DataFrame, length_column: str | None, name: str,
                    rows_l: np.ndarray) -> tuple[str | None, np.ndarray | None]:
    """The token-count column (``length_column``, else ``n_tokens`` when present) and its checked values."""
    lcol_len = length_column if length_column is not None else (
        DEFAULT_LENGTH_COLUMN if DEFAULT_LENGTH_COLUMN in raw.columns else None)
    if lcol_len is None:
        return None, None
    if lcol_len not in raw.columns:
        raise CJEInputError(f"length column '{lcol_len}' is missing", source=name, column=lcol_len)
    lengths = _numbers(logged_df[lcol_len], name, lcol_len, rows_l)
    bad = ~np.isfinite(lengths) | (lengths <= 0)
    if bad.any():
        raise CJEInputError("token count must be a positive number on every logged row", source=name,
                            column=lcol_len, row=int(rows_l[np.flatnonzero(bad)[0]]))
    return lcol_len, lengths


def _load_sources(sources: list, names: dict, name: str, rows_l: np.ndarray, *, label_scale: Scale,
                  score_scale: Scale | None, covariates: Sequence[str]) -> pd.DataFrame:
    """`load_frame` of the logged rows (first) and the fresh draws; errors name the original file and row."""
    try:
        return load_frame(sources if len(sources) > 1 else sources[0], label_scale=label_scale,
                          score_scale=score_scale, covariates=list(covariates))
    except CJEInputError as exc:
        if len(sources) == 1 and exc.source == "<DataFrame>":
            raise _reraise(exc, {"<DataFrame>": (name, rows_l)}) from None
        raise _reraise(exc, names) from None


def load_offpolicy(
    logged: Any,
    fresh: Any = None,
    *,
    mode: str = "logs-only",
    targets: Sequence[str] | None = None,
    logger_policy: str | None = None,
    covariates: Sequence[str] = (),
    label_scale: Scale = (0.0, 1.0),
    score_scale: Scale | None = (0.0, 1.0),
    logger_column: str | None = None,
    length_column: str | None = None,
    segment_by: Sequence[str] = (),
) -> OffPolicyData:
    """Read and validate logged responses (and, in hybrid mode, fresh draws).

    Parameters
    ----------
    logged : path, pandas.DataFrame or pyarrow.Table
        Wide, long, arena or combined shape (see the module docstring). A folder holding
        ``logged_data.jsonl`` (the arena layout) is read as the arena file; in hybrid mode its
        ``fresh_draws/`` (and probe labels) are the fresh draws unless ``fresh`` is given.
    fresh : anything `cje_engine.data.io.load_frame` reads, optional
        Fresh draws of the candidates (hybrid). Ignored in logs-only mode (with a note).
    mode : {"logs-only", "hybrid"}
    targets : candidates to evaluate (default: every ``logprob__<policy>`` column)
    logger_policy : name of the logging policy (default: the ``policy`` of the rows carrying the
        logger log-probability, else ``"logger"``); required for the long format
    covariates, label_scale, score_scale : as in `cje_engine.data.io.load_frame`
    logger_column : column of the logger's log-probabilities (default: the first of
        ``LOGGER_COLUMNS`` present)
    length_column : token counts for per-token TTC (default ``n_tokens`` if present)
    segment_by : columns of the logged rows that segment the prompts (`prompt_segments`): each row's segment,
        its prompt's, is ``segment_values``

    Raises
    ------
    CJEInputError
        Naming the file, column and row of the problem.
    """
    if mode not in ("logs-only", "hybrid"):
        raise CJEInputError(f"mode must be 'logs-only' or 'hybrid' for off-policy loading; got {mode!r}")
    raw, name, arena = _read_logged(logged)
    raw = _one_row_per_response(raw, name, logger_policy, logger_column)
    notes: list[str] = []

    lcol = _logger_column(raw, logger_column, name)
    logger_policy, is_logged = _logged_rows(raw, lcol, logger_policy, name)

    tlist = _candidates(raw, targets, logger_policy, name)

    rows_l = raw[_ROW].to_numpy()[is_logged]
    logged_df = raw.loc[is_logged]
    lp0, lp_t = _logged_logprobs(logged_df, lcol, tlist, name, rows_l)
    lcol_len, lengths = _logged_lengths(raw, logged_df, length_column, name, rows_l)

    sources, names, fresh_parts, fresh_name = _sources(raw, is_logged, rows_l, name, mode, tlist, fresh, arena, notes)
    frame = _load_sources(sources, names, name, rows_l, label_scale=label_scale, score_scale=score_scale,
                          covariates=covariates)
    n_logged = int(rows_l.size)
    pol_all = frame[POLICY].astype(str).to_numpy()
    if not np.all(pol_all[:n_logged] == _PLACEHOLDER) or np.any(pol_all[n_logged:] == _PLACEHOLDER):
        raise AssertionError("load_frame did not keep the logged rows first")  # pragma: no cover

    n_all = frame.shape[0]
    fresh_lp, fresh_len = _fresh_selfprobs(fresh_parts, tlist, n_all, n_logged, lengths is not None, lcol_len)

    frame, fresh_lp, fresh_len = _finish_frame(frame, fresh_lp, fresh_len, n_logged, tlist, logger_policy, mode,
                                               fresh_name or name, notes)
    seg = prompt_segments(logged_df, frame, segment_by, name, rows_l) if segment_by else None
    n_lab = int(frame[LABEL].iloc[:n_logged].notna().sum())
    logger.info("off-policy data: %d logged responses of '%s' (%d labelled), %d fresh draws, candidates %s",
                n_logged, logger_policy, n_lab, frame.shape[0] - n_logged, ", ".join(tlist))
    return OffPolicyData(frame=frame, logger=logger_policy, targets=tuple(tlist), n_logged=n_logged,
                         logger_logprob=lp0, target_logprob=lp_t, lengths=lengths, fresh_logprob=fresh_lp,
                         fresh_lengths=fresh_len, source=name, fresh_source=fresh_name, logger_column=lcol,
                         notes=tuple(notes), segment_values=seg)


#: Separator of several segment columns' values, and the value of a missing one (as Direct's segments).
SEGMENT_JOIN, SEGMENT_MISSING = " / ", "(missing)"


def prompt_segments(logged_df: pd.DataFrame, frame: pd.DataFrame, columns: Sequence[str], name: str,
                    rows_l: np.ndarray) -> np.ndarray:
    """Each frame row's segment: the ``columns`` of its prompt's logged responses (joined by `SEGMENT_JOIN`).

    Off-policy segments are prompt attributes: a candidate's responses are never seen, so a column of the
    logger's responses segments the candidate's only when it is constant within a prompt. Fresh draws take
    their prompt's segment (`SEGMENT_MISSING` for a prompt without logged responses).

    Raises
    ------
    CJEInputError
        A column is missing, or varies within a prompt (naming the prompt and the row).
    """
    missing = [c for c in columns if c not in logged_df.columns]
    if missing:
        cols = [c for c in logged_df.columns if c != _ROW]
        raise CJEInputError(f"segment_by names {missing[0]!r}, which is not a column of the logged responses"
                            f"{did_you_mean(missing[0], cols)}", source=name, column=missing[0])
    parts = [logged_df[c].astype("string").fillna(SEGMENT_MISSING).astype(str).to_numpy() for c in columns]
    text = parts[0] if len(parts) == 1 else np.array([SEGMENT_JOIN.join(v) for v in zip(*parts)], dtype=object)
    prompts = frame[PROMPT].astype(str).to_numpy()[: len(text)]  # the logged rows come first, in order
    by_prompt = pd.Series(text).groupby(pd.Series(prompts))
    varies = by_prompt.nunique()
    if (varies > 1).any():
        p = str(varies.index[np.flatnonzero(varies.to_numpy() > 1)[0]])
        r = int(rows_l[np.flatnonzero(prompts == p)[1]])
        raise CJEInputError(f"segment_by {', '.join(columns)} varies within prompt {p!r}: off-policy segments must be "
                            "prompt attributes (a candidate's responses are not seen, so a response's column cannot "
                            "segment them)", source=name, column=columns[0], row=r)
    first = by_prompt.first()
    return frame[PROMPT].astype(str).map(first).fillna(SEGMENT_MISSING).to_numpy(dtype=object)


def projection_columns(targets: Sequence[str], *, logger_column: str = LOGGER_COLUMNS[0],
                       length_column: str | None = None) -> list[str]:
    """Log columns an off-policy run needs beyond the Direct ones (for projection push-down)."""
    cols = [logger_column] + [target_column(t) for t in targets]
    if length_column:
        cols.append(length_column)
    return cols


__all__ = ["OffPolicyData", "load_offpolicy", "check_logprobs", "projection_columns", "target_column",
           "LOGGER_COLUMNS", "TARGET_PREFIX"]
