"""Inputs of the drift monitor: scores by anchor id, calibrators, and small shared helpers.

Anchor ids are normalised to strings everywhere (``1`` and ``"1"`` are the same anchor, so a
mapping holding both is a duplicate).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from cje_engine.errors import CJEInputError
from cje_engine.inference import distributions as dist
from cje_engine.result.jsonable import jsonable as _jsonable

ANCHOR, SCORE, LABEL = "anchor_id", "judge_score", "oracle_label"


def t_lower_p(z: float, df: int) -> float:
    """One-sided (lower tail) Student-t p-value ``P(T <= z)``."""
    return float(dist.t_cdf(z, df))


def check_alpha(alpha: float) -> None:
    """Raise `CJEInputError` unless ``alpha`` is a number in (0, 1)."""
    if not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
        raise CJEInputError(f"alpha must be a number in (0, 1), got {alpha!r}")


def jsonable(obj: Any) -> Any:
    """Plain JSON data (the engine's one cleaner); other objects, e.g. timestamps in ``meta``, to str."""
    return _jsonable(obj, default=str)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def scores_from_frame(
    frame: pd.DataFrame,
    *,
    value_column: str = SCORE,
    source: str = "<DataFrame>",
    allow_missing: bool = False,
) -> pd.Series:
    """Scores of one look from rows ``anchor_id, <value_column>`` as a Series by anchor id.

    Other columns (``judge_id``, ``judge_version``, ``ts``, ...) are ignored; select the look's
    rows before calling. Raises `CJEInputError` naming the row of a duplicate anchor or a
    non-finite value (NaN is allowed when ``allow_missing``, e.g. unlabelled anchors).
    """
    for col in (ANCHOR, value_column):
        if col not in frame.columns:
            raise CJEInputError(
                f"missing column '{col}' (have {list(frame.columns)})", source=source, column=col
            )
    ids = frame[ANCHOR].astype(str).to_numpy()
    raw = frame[value_column]
    conv = pd.to_numeric(raw, errors="coerce")
    bad = np.flatnonzero(conv.isna().to_numpy() & raw.notna().to_numpy())
    if bad.size:
        raise CJEInputError(
            f"expected a number, got {raw.iloc[bad[0]]!r}", source=source, column=value_column, row=int(bad[0])
        )
    vals = conv.to_numpy(dtype=float)
    return _finish_series(pd.Series(vals, index=pd.Index(ids, name=ANCHOR)), value_column, source, allow_missing)


def _finish_series(s: pd.Series, column: str, source: str, allow_missing: bool) -> pd.Series:
    if not s.index.is_unique:
        dup = np.flatnonzero(s.index.duplicated())
        raise CJEInputError(
            f"anchor_id {s.index[dup[0]]!r} appears more than once", source=source, column=ANCHOR, row=int(dup[0])
        )
    vals = s.to_numpy(dtype=float)
    bad = ~np.isfinite(vals)
    if allow_missing:
        bad &= ~np.isnan(vals)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CJEInputError(
            f"expected a finite number for anchor {s.index[i]!r}, got {vals[i]!r}",
            source=source,
            column=column,
            row=i,
        )
    return s


def as_scores(
    values: pd.Series | pd.DataFrame | Mapping[Any, float],
    what: str,
    *,
    value_column: str = SCORE,
    allow_missing: bool = False,
) -> pd.Series:
    """Coerce scores (Series by anchor id, mapping, or frame with ``anchor_id``) to a float Series.

    ``what`` names the input in error messages (e.g. ``"current_scores"``).
    """
    if isinstance(values, pd.DataFrame):
        return scores_from_frame(values, value_column=value_column, source=what, allow_missing=allow_missing)
    if isinstance(values, pd.Series):
        s = values
    elif isinstance(values, Mapping):
        s = pd.Series(dict(values), dtype=object)
    else:
        raise CJEInputError(
            f"expected a pandas Series indexed by anchor_id, a mapping anchor_id -> value, or a "
            f"frame with columns '{ANCHOR}' and '{value_column}'; got {type(values).__name__}",
            source=what,
        )
    if pd.api.types.is_float_dtype(s.dtype) and s.index.inferred_type == "string":
        # fast path (scheduled looks reuse one float Series layout): only the checks remain
        return _finish_series(s, value_column, what, allow_missing)
    try:
        vals = pd.to_numeric(s, errors="raise").to_numpy(dtype=float)
    except (TypeError, ValueError):
        conv = pd.to_numeric(s, errors="coerce")
        i = int(np.flatnonzero(conv.isna() & s.notna())[0])
        raise CJEInputError(
            f"expected a number for anchor {s.index[i]!r}, got {s.iloc[i]!r}",
            source=what,
            column=value_column,
            row=i,
        ) from None
    return _finish_series(pd.Series(vals, index=normalise_ids(s.index)), value_column, what, allow_missing)


def normalise_ids(index: pd.Index) -> pd.Index:
    """Anchor ids as strings (``str(id)``), so that ``1`` and ``"1"`` name the same anchor."""
    if index.inferred_type == "string":
        return index.rename(ANCHOR)
    return pd.Index([str(x) for x in index], name=ANCHOR, dtype=object)


def as_clusters(clusters: pd.Series | Mapping[Any, Any], common: pd.Index) -> np.ndarray:
    """Integer cluster codes of the anchors ``common`` (ids normalised to strings).

    Raises `CJEInputError` for an anchor listed twice or an anchor without a cluster.
    """
    cl = clusters if isinstance(clusters, pd.Series) else pd.Series(dict(clusters), dtype=object)
    cl = pd.Series(cl.to_numpy(dtype=object), index=normalise_ids(cl.index), dtype=object)
    if not cl.index.is_unique:
        dup = np.flatnonzero(cl.index.duplicated())[0]
        raise CJEInputError(f"anchor_id {cl.index[dup]!r} appears more than once", source="clusters",
                            column=ANCHOR, row=int(dup))
    cl = cl.reindex(common)
    missing = cl.isna().to_numpy()
    if missing.any():
        miss = common[np.flatnonzero(missing)[0]]
        raise CJEInputError(f"no cluster given for anchor {miss!r}", source="clusters", column=ANCHOR)
    _, codes = np.unique(cl.astype(str).to_numpy(), return_inverse=True)
    return codes.astype(np.int64)


def call_calibrate(calibrate: Any, scores: np.ndarray) -> np.ndarray:
    """Calibrated values of ``scores`` by a callable or an object with ``.predict``.

    Parameters
    ----------
    calibrate : callable or object with ``predict``
        The calibration map ``f(scores) -> values``.
    scores : numpy.ndarray
        Judge scores, one per anchor.

    Returns
    -------
    numpy.ndarray
        One finite float per score; a wrong shape, a non-finite value or a missing map raises
        `CJEInputError` naming ``calibrate``.
    """
    fn = calibrate if callable(calibrate) else getattr(calibrate, "predict", None)
    if fn is None:
        raise CJEInputError(
            f"calibrate must be a callable f(scores) -> calibrated values (or have .predict), "
            f"got {type(calibrate).__name__}",
            column="calibrate",
        )
    out = np.asarray(fn(scores), dtype=float).reshape(-1)
    if out.shape != scores.shape:
        raise CJEInputError(
            f"calibrate returned {out.shape[0]} values for {scores.shape[0]} scores", column="calibrate"
        )
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        raise CJEInputError(
            f"calibrate returned a non-finite value {out[bad[0]]!r} for score {scores[bad[0]]!r}",
            column="calibrate",
            row=int(bad[0]),
        )
    return out


