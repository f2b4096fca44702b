"""Load and validate evaluation data into the canonical frame.

`load_frame` reads Parquet (a file, or a folder of files with optional hive partitions),
JSON Lines, CSV, a `pyarrow.Table`, a pandas DataFrame, a list of any of these, or a folder
in the *arena layout*::

    folder/
      fresh_draws/<policy>_responses.jsonl   one file per policy (policy taken from the name)
      probe_slice/<policy>_probe.jsonl       optional oracle-labelled audit rows (joined, see below)
      logged_data.jsonl                      ignored here (logs-only evaluation reads it)

and returns one validated frame with the canonical columns

=====================  =========  ==========================================================
column                 dtype      meaning
=====================  =========  ==========================================================
``prompt_id``          str        the prompt (the cluster for every resampling)
``policy``             str        the system that produced the response
``judge_score``        float64    cheap judge score S, finite, inside ``score_scale``
``oracle_label``       float64    oracle label Y inside ``label_scale``; NaN = unlabelled
``label_probability``  float64    P(row labelled) in (0, 1] on labelled rows, NaN elsewhere
``response_id``        str        unique row id; synthesised as ``"{policy}:{prompt_id}:{k}"``
<covariates>           float64    requested covariates, finite
``response``           str        response text, only if the input has it
<keep_columns>         as given   extra columns asked for with ``keep_columns``
=====================  =========  ==========================================================

Rules (each violation raises `CJEInputError` naming the file, column and zero-based row):

* Required columns: ``prompt_id``, ``policy`` (except in the arena layout, where the file name
  gives it) and ``judge_score``. Optional: ``oracle_label``, ``label_probability``,
  ``response_id``, ``response``, ``draw_idx``.
* Numbers given as numeric strings are accepted; anything else that is not a number is an
  error naming the first bad row. Judge scores must be present and finite on every row.
* Scales are declared, never guessed: a score or label outside the declared scale is an error
  whose message suggests the declaration to use (e.g. ``score_scale='0-100'``).
* ``label_probability``: when an input has this column, every labelled row of that input needs a
  value in (0, 1]. When an input lacks it, its labelled rows get 1.0 (labels missing completely
  at random within the policy; only relative probabilities within a policy matter).
* Row identity: ``response_id`` if given, else ``"{policy}:{prompt_id}:{k}"`` where ``k`` is
  ``draw_idx`` when present, else the occurrence number of the (policy, prompt) pair among rows
  that carry a ``response`` text (in input order), else 0. Response ids must be unique across
  all inputs, and so must (prompt_id, policy, response, draw_idx) where response text exists.
  A row supplied twice (within one input or across inputs) is an error, never double-counted; if
  it carries a label the message says so. Rows with neither ``response``, ``draw_idx`` nor
  ``response_id`` are identified by (prompt_id, policy) alone.
* Identifiers (``prompt_id``, ``response_id``, ``policy``) are normalised to Unicode NFC, so NFC
  and NFD spellings of one id pair; an identifier holding a control (Cc), invisible format (Cf,
  e.g. U+200B) or line-separator character is an error (`canonical_identifiers`).
* Probe slices (arena layout) carry oracle labels for rows that also appear in the fresh draws
  of the same policy. They are joined onto the matching fresh-draw row on
  (prompt_id, response, draw_idx) (the columns both sides have), not appended. A probe row with
  no match, with several matches, with a different judge score than its match, or labelling a
  row that is already labelled, is an error.
* Covariates must be finite numbers. ``response_length``, if requested and not a column, is
  derived from the ``response`` text as the number of whitespace-separated tokens
  (``len(text.split())``). Any other missing covariate is an error.
* Whole-data checks (after the ``policies`` filter): every requested policy has rows; at least
  one labelled row; at least two distinct label values; at least two distinct judge scores.

Every check is vectorised (pandas / numpy / pyarrow.compute), so ten million rows validate in
seconds.
"""
from __future__ import annotations

import logging
import os
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from cje_engine.data.frame import (LABEL, LABEL_PROB, POLICY, PROMPT, RESPONSE_ID, SCORE, FrameCodes, Scale,
                                   parse_scale)
from cje_engine.data.identity import (  # noqa: F401 (repeated_values: re-exported for tests)
    ROW_KEY, SOURCE_KEY, DRAW_IDX, RESPONSE, concat_tables, first_value, identify_rows, join_probe, null_str, repeated_values,
)
from cje_engine.data.readers import ID_COLUMNS, Part, collect, read_jsonl_records  # noqa: F401 (re-exported)
from cje_engine.errors import CJEInputError, did_you_mean

logger = logging.getLogger(__name__)

RESPONSE_LENGTH = "response_length"

SourceLike = Union[str, os.PathLike, pa.Table, pd.DataFrame]

#: Canonical column names an input may carry (``columns=`` maps input names onto these).
CANONICAL = (PROMPT, POLICY, SCORE, LABEL, LABEL_PROB, RESPONSE_ID, RESPONSE, DRAW_IDX)



# --------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------
def load_frame(
    source: SourceLike | Sequence[SourceLike],
    *,
    label_scale: str | Scale = (0.0, 1.0),
    score_scale: str | Scale | None = (0.0, 1.0),
    covariates: Sequence[str] = (),
    policies: Sequence[str] | None = None,
    keep_columns: Sequence[str] = (),
    columns: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Read, join and validate evaluation data into the canonical frame.

    Parameters
    ----------
    source : path, pyarrow.Table, pandas.DataFrame, or a list of these
        Parquet file or folder (recursive, hive partitions allowed), ``.jsonl``/``.ndjson``,
        ``.csv``, an arena-layout folder, or in-memory tables. A list is concatenated; each
        element keeps its own name in error messages.
    label_scale : "LO-HI" or (lo, hi)
        Declared oracle label scale, e.g. ``"0-1"`` (default), ``"0-100"``, ``"1-10"``.
    score_scale : "LO-HI", (lo, hi) or None
        Declared judge score scale; ``None`` (or ``"any"``) accepts any finite score.
    covariates : sequence of str
        Covariate columns to carry (as float64). ``response_length`` is derived from the
        ``response`` text (whitespace token count) when it is not a column.
    policies : sequence of str, optional
        Keep only these policies (each must have rows). Default: all.
    keep_columns : sequence of str
        Extra columns to carry unchanged (e.g. a timestamp); each must exist in every input.
    columns : mapping of str to str, optional
        Canonical name -> column name in the input, for inputs whose columns are named
        differently, e.g. ``{"prompt_id": "id", "policy": "model", "oracle_label": "human_rating"}``.
        Applies to every input; identifier columns named here are read as text.

    Returns
    -------
    pandas.DataFrame
        The canonical frame (see the module docstring), index 0..n-1, rows in input order.
        ``frame.attrs["sources"]`` lists the input names.

    Raises
    ------
    CJEInputError
        On any problem with the data or the options, naming file, column and row.
    """
    return load_coded(source, label_scale=label_scale, score_scale=score_scale, covariates=covariates,
                      policies=policies, keep_columns=keep_columns, columns=columns)[0]


def load_coded(
    source: SourceLike | Sequence[SourceLike],
    *,
    label_scale: str | Scale = (0.0, 1.0),
    score_scale: str | Scale | None = (0.0, 1.0),
    covariates: Sequence[str] = (),
    policies: Sequence[str] | None = None,
    keep_columns: Sequence[str] = (),
    columns: Mapping[str, str] | None = None,
) -> tuple[pd.DataFrame, FrameCodes]:
    """`load_frame`, also returning the prompt and policy codes its identity checks computed.

    For ``EvalData.from_frame(frame, codes=codes)``, which then does not factorise the ten million
    ids again (what `cje_engine.prepare` does with a source that is not yet an `EvalData`).
    Parameters, errors and the frame: as in `load_frame`.
    """
    lscale = parse_scale(label_scale, "label")
    if lscale is None:
        raise CJEInputError(
            "label_scale must be declared as a finite range such as '0-1', '1-10' or '0-100'",
            option="label_scale",
        )
    sscale = parse_scale(score_scale, "judge score")
    covariates = _as_names(covariates, "covariates")
    keep_columns = _as_names(keep_columns, "keep_columns")
    clash = [c for c in list(covariates) + list(keep_columns) if c in CANONICAL]
    if clash:
        raise CJEInputError(
            f"'{clash[0]}' is a canonical column and cannot be a covariate or keep_column",
            column=clash[0],
        )

    mapping = check_mapping(columns, covariates, keep_columns)
    ids = set(ID_COLUMNS) | {src for canon, src in mapping.items() if canon in ID_COLUMNS}
    parts = list(collect(source, ids))
    if not parts:
        raise CJEInputError("no input was given (empty list of sources)")
    rows = [p for p in parts if not p.probe]  # never empty: an arena folder needs fresh draws
    probes = [p for p in parts if p.probe]

    for i, part in enumerate(parts):
        part.frame = _normalise(part, i, lscale, sscale, covariates, keep_columns, mapping)

    frame = concat_tables([p.frame for p in rows])
    names = [p.name for p in parts]
    codes = identify_rows(frame, names)
    for part in probes:
        join_probe(frame, part, names)

    sources = [p.name for p in rows] + [p.name for p in probes]
    n_inputs = len(parts)
    del parts, rows, probes
    return _finish(frame, codes, policies, covariates, keep_columns, sources, n_inputs)


def _finish(frame: pd.DataFrame, codes: FrameCodes, policies: Sequence[str] | None, covariates: Sequence[str],
            keep_columns: Sequence[str], sources: list[str], n_inputs: int) -> tuple[pd.DataFrame, FrameCodes]:
    """Label probabilities, the policy filter, whole-data checks and the output columns (and the
    codes of the rows kept)."""
    labelled = frame[LABEL].notna().to_numpy()
    prob = frame[LABEL_PROB].to_numpy(dtype=np.float64, copy=True)
    prob[labelled & np.isnan(prob)] = 1.0
    prob[~labelled] = np.nan
    _put(frame, LABEL_PROB, prob, True)  # a copy made above

    if policies is not None:
        frame, keep = _filter_policies(frame, _as_names(policies, "policies"))
        codes = codes.subset(keep)

    _check_whole(frame)

    out_cols = [PROMPT, POLICY, SCORE, LABEL, LABEL_PROB, RESPONSE_ID, *covariates]
    if RESPONSE in frame.columns and frame[RESPONSE].notna().any():
        out_cols.append(RESPONSE)
    out_cols.extend(keep_columns)
    out = frame[out_cols].reset_index(drop=True)
    out.attrs["sources"] = sources
    del frame
    pa.default_memory_pool().release_unused()  # hand the readers' Arrow buffers back to the system
    logger.info("loaded %d rows (%d labelled, %d policies) from %d input(s)", len(out),
                int(out[LABEL].notna().sum()), len(codes.policy_uniques), n_inputs)
    return out, codes


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------
def check_mapping(columns: Mapping[str, str] | None, covariates: Sequence[str] = (),
                  keep_columns: Sequence[str] = ()) -> dict[str, str]:
    """Validate a ``columns=`` mapping (canonical name -> input column); every problem at once.

    Keys must be canonical names (`CANONICAL`), ``covariates`` or ``keep_columns`` (with a
    did-you-mean hint otherwise); values non-empty column names, no two keys mapping one column.
    Raises `CJEInputError` (``option="columns"``).
    """
    if columns is None:
        return {}
    if not isinstance(columns, Mapping):
        raise CJEInputError(f"columns must be a mapping of canonical name to input column, got {columns!r}",
                            option="columns")
    known = list(CANONICAL) + list(covariates) + list(keep_columns)
    problems = []
    for canon, src in columns.items():
        if canon not in known:
            problems.append(CJEInputError(
                f"columns maps {canon!r}, which is not a canonical column{did_you_mean(canon, known, n=2)} "
                f"(canonical columns: {', '.join(list(CANONICAL) + list(keep_columns))})", option="columns"))
        elif not isinstance(src, str) or not src:
            problems.append(CJEInputError(f"columns[{canon!r}] must be a column name, got {src!r}", option="columns"))
    sources = [s for s in columns.values() if isinstance(s, str)]
    dup = sorted({s for s in sources if sources.count(s) > 1})
    if dup:
        keys = " and ".join(repr(k) for k, s in columns.items() if s == dup[0])
        problems.append(CJEInputError(f"columns maps several canonical names ({keys}) to the same input column "
                                      f"{dup[0]!r}", option="columns"))
    _raise_all(problems)
    return dict(columns)


def _raise_all(problems: list[CJEInputError]) -> None:
    """Raise nothing, the one problem, or one error listing every problem (first one's location)."""
    if not problems:
        return
    if len(problems) == 1:
        raise problems[0]
    first = problems[0]
    text = "; ".join(f"({i + 1}) {p}" for i, p in enumerate(problems))
    raise CJEInputError(f"{len(problems)} problems: {text}", option=first.option, problems=problems)


def _as_names(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(str(v) for v in value)
    except TypeError:
        raise CJEInputError(f"{what} must be a list of column names, got {value!r}") from None


# --------------------------------------------------------------------------------------
# Per-input normalisation
# --------------------------------------------------------------------------------------
def _numeric(s: pd.Series, name: str, col: str, what: str = "a number") -> np.ndarray:
    """Column as float64 (NaN for missing); non-numbers are an error naming the first bad row."""
    if pd.api.types.is_bool_dtype(s.dtype):
        raise CJEInputError(f"expected {what}, got booleans", source=name, column=col, row=0)
    if pd.api.types.is_numeric_dtype(s.dtype):
        return s.to_numpy(dtype=np.float64, na_value=np.nan)
    missing = s.isna().to_numpy()
    as_num = pd.to_numeric(s, errors="coerce")
    values = np.asarray(as_num, dtype=np.float64)
    bad = np.isnan(values) & ~missing
    # pd.to_numeric turns True/False inside object columns into 1/0: refuse them too.
    if s.dtype == object:
        cand = np.flatnonzero((values == 0) | (values == 1))
        if cand.size:
            vals = s.to_numpy()[cand]
            is_bool = np.fromiter((isinstance(v, (bool, np.bool_)) for v in vals), dtype=bool, count=cand.size)
            bad[cand[is_bool]] = True
    if bad.any():
        row = first_value(bad)
        raise CJEInputError(
            f"expected {what}, got {s.iloc[row]!r}", source=name, column=col, row=row
        )
    return values


def _strings(s: pd.Series, name: str, col: str, *, required: bool) -> pd.Series:
    missing = s.isna().to_numpy()
    if required and missing.any():
        raise CJEInputError("missing value; every row needs one", source=name, column=col, row=first_value(missing))
    if pd.api.types.is_float_dtype(s.dtype):
        # 17.0 -> "17" so numeric ids read from CSV/Parquet stay stable.
        v = s.to_numpy()
        whole = np.isfinite(v) & (np.mod(v, 1) == 0) & (np.abs(v) < 2**53)
        if whole[~missing].all():
            s = s.astype("Int64")
    out = s.astype("str")
    if missing.any():
        out = out.where(~missing, None)
    if required:
        empty = (out.str.len() == 0).to_numpy(dtype=bool, na_value=False)
        if empty.any():
            raise CJEInputError("empty string; every row needs a value", source=name, column=col, row=first_value(empty))
    return out


#: Characters an identifier may not hold: controls (Cc), invisible format characters (Cf: U+200B,
#: U+200D, U+FEFF, U+202E ...) and line/paragraph separators; RE2 syntax (pyarrow.compute).
_INVISIBLE_RE = r"[\p{Cc}\p{Cf}\p{Zl}\p{Zp}]"


def _invisible_error(value: str, name: str, col: str, row: int) -> CJEInputError:
    bad = next(ch for ch in value if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"))
    what = unicodedata.name(bad, "a control character")
    return CJEInputError(
        f"{value!r} contains the invisible or control character U+{ord(bad):04X} ({what}); prompt ids, "
        "response ids and policy names must be visible text (two spellings that print alike would not pair)",
        source=name, column=col, row=row)


def canonical_identifiers(s: pd.Series, name: str, col: str) -> pd.Series:
    """Identifier text in its canonical form: Unicode NFC, no invisible or control characters.

    ``"caf\u00e9"`` (NFC) and ``"cafe\u0301"`` (NFD) are the same id after this, so comparisons
    stay paired; an id holding a control, format (category Cf, e.g. U+200B, U+200D, U+FEFF) or
    line-separator character is refused, because ``"clo\u200bne"`` prints like ``"clone"``.
    Vectorised (pyarrow.compute); ASCII columns are not copied.

    Parameters
    ----------
    s : pandas.Series
        Text (or missing) values, e.g. the output of ``_strings``.
    name, col : str
        The input and column, for the error message.

    Returns
    -------
    pandas.Series
        ``s`` itself when nothing changes, else the NFC-normalised values.

    Raises
    ------
    CJEInputError
        Naming the input, the column and the first bad row.
    """
    arr = pa.array(s, type=pa.large_string(), from_pandas=True)
    nfc = canonical_id_array(arr, name, col)
    if nfc is arr:
        return s
    return pd.Series(nfc.to_pandas(), index=s.index, name=s.name)


def canonical_id_array(arr: pa.Array | pa.ChunkedArray, name: str, col: str) -> pa.Array | pa.ChunkedArray:
    """`canonical_identifiers` on an Arrow string array: ``arr`` itself when nothing changes (the
    common all-ASCII case costs 0.15 s per 2M ids), else its NFC form; `CJEInputError` naming
    ``name``, ``col`` and the row for a control or invisible format character."""
    ascii_only = pc.all(pc.string_is_ascii(arr)).as_py() is not False
    if ascii_only and pc.all(pc.ascii_is_printable(arr)).as_py() is not False:
        return arr  # 5x faster than the regular expression
    bad = pc.match_substring_regex(arr, _INVISIBLE_RE)
    if pc.any(bad).as_py():
        row = pc.index(bad, True).as_py()
        raise _invisible_error(arr[row].as_py(), name, col, row)
    if ascii_only:
        return arr
    nfc = pc.utf8_normalize(arr, form="NFC")
    return arr if not pc.any(pc.not_equal(nfc, arr)).as_py() else nfc


def canonical_identifier(value: str, name: str, col: str) -> str:
    """`canonical_identifiers` for one value (a policy from a file name, a requested policy)."""
    return str(canonical_identifiers(pd.Series([value], dtype=object), name, col).iloc[0])


def _put(out: pd.DataFrame, col: str, values: Any, share: bool) -> None:
    """``out[col] = values``; a numpy array is taken over instead of copied when ``share`` (an array
    made here, or one of an input frame that was read here and is dropped after normalisation)."""
    if share and isinstance(values, np.ndarray):
        out[col] = pd.Series(values, index=out.index, copy=False)
    else:
        out[col] = values


def _scale_hint(values: np.ndarray, arg: str) -> str:
    """Common scales that contain the observed values, as ``arg='LO-HI'`` suggestions."""
    lo, hi = float(np.nanmin(values)), float(np.nanmax(values))
    common = (("0-1", 0, 1), ("1-5", 1, 5), ("0-10", 0, 10), ("1-10", 1, 10), ("0-100", 0, 100))
    fits = [f"{arg}='{name}'" for name, a, b in common if a <= lo and hi <= b]
    if not fits:
        fits = [f"{arg}='{lo:g}-{hi:g}'"]
    return " or ".join(fits[:2])


def _check_range(values: np.ndarray, scale: Scale, name: str, col: str, arg: str) -> None:
    lo, hi = scale
    bad = (values < lo) | (values > hi)  # NaN compares False: only present values are checked
    if bad.any():
        row = first_value(bad)
        present = values[~np.isnan(values)]
        raise CJEInputError(
            f"value {values[row]:g} is outside the declared {arg} [{lo:g}, {hi:g}]; "
            f"if your data use another scale, declare it explicitly, e.g. {_scale_hint(present, arg)} "
            "(scales are never guessed)",
            source=name,
            column=col,
            option=arg,
            row=row,
        )


def check_scale_range(values: np.ndarray, scale: Scale, source: str, column: str, option: str) -> None:
    """Raise the loader's one-line `CJEInputError` when a present value of ``column`` is outside the
    declared ``scale`` (``option``: ``"label_scale"`` or ``"score_scale"``); for checks of the same
    rule outside `load_frame` (the service's pre-flight of its logs)."""
    _check_range(np.asarray(values, dtype=float), scale, source, column, option)


def _normalise(
    part: Part,
    index: int,
    lscale: Scale,
    sscale: Scale | None,
    covariates: Sequence[str],
    keep_columns: Sequence[str],
    mapping: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Check one input and return it with canonical, typed columns plus bookkeeping."""
    df, name = part.frame, part.name
    if not isinstance(df, pd.DataFrame):  # pragma: no cover - readers always return frames
        raise CJEInputError("could not read a table", source=name)
    df = df.reset_index(drop=True)
    df.columns = [str(c) for c in df.columns]
    if df.columns.duplicated().any():
        col = df.columns[df.columns.duplicated()][0]
        raise CJEInputError("column appears more than once", source=name, column=col)
    n = len(df)
    if n == 0:
        raise CJEInputError("input has no rows (0 rows)", source=name)

    df = _apply_mapping(df, name, mapping or {})
    _check_columns(df, part, covariates, keep_columns)

    out = pd.DataFrame(index=pd.RangeIndex(n))
    _ids_and_policy(df, part, out)
    labelled = _score_and_label(df, part, out, lscale, sscale)
    _optional_columns(df, part, out, labelled, covariates, keep_columns)
    out[SOURCE_KEY] = np.int32(index)
    _put(out, ROW_KEY, np.arange(n, dtype=np.int32 if n < 2**31 else np.int64), True)
    return out




def _ids_and_policy(df: pd.DataFrame, part: Part, out: pd.DataFrame) -> None:
    """``prompt_id`` and ``policy`` (from the column, or from the file name in the arena layout)."""
    name, n = part.name, len(df)
    out[PROMPT] = canonical_identifiers(_strings(df[PROMPT], name, PROMPT, required=True), name, PROMPT)
    if part.policy is not None:
        part.policy = canonical_identifier(part.policy, name, POLICY)
        if POLICY in df.columns:
            given = canonical_identifiers(_strings(df[POLICY], name, POLICY, required=True), name, POLICY)
            bad = (given != part.policy).to_numpy()
            if bad.any():
                row = first_value(bad)
                raise CJEInputError(
                    f"policy {given.iloc[row]!r} disagrees with the file name (policy '{part.policy}')",
                    source=name,
                    column=POLICY,
                    row=row,
                )
        out[POLICY] = pa.repeat(pa.scalar(part.policy, pa.large_string()), n).to_pandas()
    else:
        out[POLICY] = canonical_identifiers(_strings(df[POLICY], name, POLICY, required=True), name, POLICY)


def _score_and_label(df: pd.DataFrame, part: Part, out: pd.DataFrame, lscale: Scale,
                     sscale: Scale | None) -> np.ndarray:
    """Judge score, oracle label and label probability; returns the labelled-row mask."""
    name, n = part.name, len(df)
    if SCORE in df.columns:
        score = _numeric(df[SCORE], name, SCORE)
        if not part.probe:
            miss = np.isnan(score)
            if miss.any():
                raise CJEInputError(
                    "judge score is missing (NaN/null); every row needs a finite score",
                    source=name,
                    column=SCORE,
                    row=first_value(miss),
                )
        inf = np.isinf(score)
        if inf.any():
            raise CJEInputError(
                f"judge score is {score[first_value(inf)]}; expected a finite number", source=name, column=SCORE, row=first_value(inf)
            )
        if sscale is not None:
            _check_range(score, sscale, name, SCORE, "score_scale")
        _put(out, SCORE, score, part.owned)
    else:
        out[SCORE] = np.nan

    if LABEL in df.columns:
        label = _numeric(df[LABEL], name, LABEL)
        inf = np.isinf(label)
        if inf.any():
            raise CJEInputError(
                f"oracle label is {label[first_value(inf)]}; expected a finite number (or null for unlabelled)",
                source=name,
                column=LABEL,
                row=first_value(inf),
            )
        _check_range(label, lscale, name, LABEL, "label_scale")
        if part.probe and np.isnan(label).any():
            raise CJEInputError(
                "probe row has no oracle label; every probe row must be labelled",
                source=name,
                column=LABEL,
                row=first_value(np.isnan(label)),
            )
    else:
        label = np.full(n, np.nan)
    _put(out, LABEL, label, part.owned or LABEL not in df.columns)
    labelled = ~np.isnan(label)

    if LABEL_PROB in df.columns:
        prob = _numeric(df[LABEL_PROB], name, LABEL_PROB)
        bad = labelled & ~((prob > 0) & (prob <= 1))  # NaN fails the test
        if bad.any():
            row = first_value(bad)
            raise CJEInputError(
                f"label probability {prob[row]!r} on a labelled row; expected a probability in (0, 1]",
                source=name,
                column=LABEL_PROB,
                row=row,
            )
        prob = np.where(labelled, prob, np.nan)
    else:
        prob = np.full(n, np.nan)
    _put(out, LABEL_PROB, prob, True)  # np.where or np.full: a new array
    return labelled


def _optional_columns(df: pd.DataFrame, part: Part, out: pd.DataFrame, labelled: np.ndarray,
                      covariates: Sequence[str], keep_columns: Sequence[str]) -> None:
    """``response_id``, ``draw_idx``, ``response``, covariates and kept columns."""
    name, n = part.name, len(df)
    if RESPONSE_ID in df.columns:
        out[RESPONSE_ID] = canonical_identifiers(_strings(df[RESPONSE_ID], name, RESPONSE_ID, required=False),
                                                 name, RESPONSE_ID)
    else:
        out[RESPONSE_ID] = null_str(n)

    if DRAW_IDX in df.columns:
        draw = _numeric(df[DRAW_IDX], name, DRAW_IDX, "a non-negative whole number")
        ok = np.isnan(draw) | ((draw >= 0) & np.isfinite(draw) & (np.mod(draw, 1) == 0))
        if not ok.all():
            row = first_value(~ok)
            raise CJEInputError(
                f"expected a non-negative whole number, got {df[DRAW_IDX].iloc[row]!r}",
                source=name,
                column=DRAW_IDX,
                row=row,
            )
        _put(out, DRAW_IDX, draw, part.owned)
    else:
        out[DRAW_IDX] = np.nan

    if RESPONSE in df.columns:
        out[RESPONSE] = _strings(df[RESPONSE], name, RESPONSE, required=False)

    if not part.probe:
        for col in covariates:
            if col in df.columns:
                x = _numeric(df[col], name, col)
                bad = ~np.isfinite(x)
                if bad.any():
                    row = first_value(bad)
                    raise CJEInputError(
                        f"covariate value {df[col].iloc[row]!r}; covariates must be finite numbers",
                        source=name,
                        column=col,
                        row=row,
                    )
                _put(out, col, x, part.owned)
            elif col == RESPONSE_LENGTH and RESPONSE in df.columns:
                out[col] = _token_count(out[RESPONSE], name)
            else:
                hint = " (it can be derived only from a 'response' text column)" if col == RESPONSE_LENGTH else ""
                raise CJEInputError(
                    f"covariate '{col}' was requested but is not a column{hint} "
                    f"(columns present: {', '.join(df.columns)})",
                    source=name,
                    column=col,
                )
        for col in keep_columns:
            if col not in df.columns:
                raise CJEInputError(
                    f"keep_columns asks for '{col}', which is not a column (columns present: {', '.join(df.columns)})",
                    source=name,
                    column=col,
                )
            out[col] = df[col]


def _apply_mapping(df: pd.DataFrame, name: str, mapping: Mapping[str, str]) -> pd.DataFrame:
    """Rename the input's columns to canonical names (``columns=``); all problems at once."""
    return df.rename(columns=column_renames(df.columns, mapping, name)) if mapping else df


def column_renames(names: Sequence[str], mapping: Mapping[str, str] | None, source: str,
                   optional: Sequence[str] = ()) -> dict[str, str]:
    """The renames (input column -> canonical name) a ``columns=`` mapping makes of one input.

    The one rename rule of every reader: `load_frame` (``cje evaluate``) and the service's log
    reads (`flows.storage.logs.read_window`, the pre-flight check of ``cje run``).

    Parameters
    ----------
    names : sequence of str
        The input's column names.
    mapping : mapping of str to str or None
        Canonical name -> input column (validated with `check_mapping`).
    source : str
        The input's name (file or object URL) for error messages.
    optional : sequence of str
        Canonical names whose mapped column may be absent from this input (the service's inline
        label columns, which only some partitions carry).  Others must be present, unless the
        input already has the canonical name.

    Returns
    -------
    dict
        ``{input column: canonical name}`` for the mapped columns present.

    Raises
    ------
    CJEInputError
        A mapped column missing from the input (with a did-you-mean hint), or an input having both
        the mapped column and the canonical one; every problem at once, naming ``source``.
    """
    present = [str(c) for c in names]
    have = set(present)
    problems, rename = [], {}
    for canon, src in (mapping or {}).items():
        if src in have:
            if canon in have and canon != src:
                problems.append(CJEInputError(
                    f"columns maps {canon!r} to {src!r}, but the input also has a column {canon!r}; "
                    "drop or rename one of them", source=source, column=src, option="columns"))
            else:
                rename[src] = canon
        elif canon not in have and canon not in optional:  # already canonical: nothing to rename
            problems.append(CJEInputError(
                f"columns maps {canon!r} to {src!r}, which is not a column{did_you_mean(src, present, n=2)} "
                f"(columns present: {', '.join(present)})", source=source, column=src, option="columns"))
    _raise_all(problems)
    return rename


def _check_columns(df: pd.DataFrame, part: Part, covariates: Sequence[str], keep_columns: Sequence[str]) -> None:
    """Required, covariate and keep columns present; every missing one reported at once."""
    name = part.name
    required = [PROMPT] if part.probe else [PROMPT, SCORE]
    if part.probe:
        required.append(LABEL)
    if part.policy is None:
        required.append(POLICY)
    present = ", ".join(df.columns)
    problems = []
    for col in required:
        if col not in df.columns:
            problems.append(CJEInputError(
                f"required column is missing{did_you_mean(col, df.columns, n=2)} (columns present: {present}); "
                "if the input names it differently, map it with columns={" + repr(col) + ": '<name>'}",
                source=name, column=col, option="columns"))
    if not part.probe:
        for col in covariates:
            if col not in df.columns and not (col == RESPONSE_LENGTH and RESPONSE in df.columns):
                hint = " (it can be derived only from a 'response' text column)" if col == RESPONSE_LENGTH else ""
                problems.append(CJEInputError(
                    f"covariate '{col}' was requested but is not a column{hint}{did_you_mean(col, df.columns, n=2)} "
                    f"(columns present: {present})", source=name, column=col, option="covariates"))
        for col in keep_columns:
            if col not in df.columns:
                problems.append(CJEInputError(
                    f"keep_columns asks for '{col}', which is not a column{did_you_mean(col, df.columns, n=2)} "
                    f"(columns present: {present})", source=name, column=col, option="keep_columns"))
    _raise_all(problems)


def _token_count(text: pd.Series, name: str) -> np.ndarray:
    """Number of whitespace-separated tokens of each response (``len(t.split())``)."""
    missing = text.isna().to_numpy()
    if missing.any():
        raise CJEInputError(
            "response text is missing, so response_length cannot be derived for this row",
            source=name,
            column=RESPONSE,
            row=first_value(missing),
        )
    arr = pa.array(text.to_numpy(dtype=object), type=pa.large_string())
    counts = pc.count_substring_regex(arr, r"\S+")
    return counts.to_numpy(zero_copy_only=False).astype(np.float64)


def _filter_policies(frame: pd.DataFrame, wanted: tuple[str, ...]) -> tuple[pd.DataFrame, np.ndarray]:
    wanted = tuple(canonical_identifier(p, "policies", POLICY) for p in wanted)
    present = set(pd.unique(frame[POLICY]))
    for pol in wanted:
        if pol not in present:
            raise CJEInputError(
                f"policy {pol!r} was requested but has no rows (policies present: {', '.join(sorted(present))})",
                column=POLICY,
            )
    keep = frame[POLICY].isin(list(wanted)).to_numpy()
    return frame.loc[keep].reset_index(drop=True), keep


def _check_whole(frame: pd.DataFrame) -> None:
    label = frame[LABEL].to_numpy()
    labelled = ~np.isnan(label)
    if not labelled.any():
        raise CJEInputError(
            "no row has an oracle label; calibration needs labelled rows with at least two distinct label values",
            column=LABEL,
        )
    values = label[labelled]
    if values.min() == values.max():
        raise CJEInputError(
            f"all {int(labelled.sum())} labelled rows have the same oracle label {values[0]:g}; "
            "calibration needs at least two distinct label values",
            column=LABEL,
        )
    scores = frame[SCORE].to_numpy()
    if scores.min() == scores.max():
        raise CJEInputError(
            f"every judge score is {scores[0]:g}; the judge scores carry no information (need at least two distinct values)",
            column=SCORE,
        )
