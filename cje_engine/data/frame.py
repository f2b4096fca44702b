"""The evaluation data object: validated arrays, prompt clusters and folds.

`EvalData` is separate from the estimator (DoubleML style): it holds the rows of every
policy, the prompt each row belongs to (the cluster for all resampling and standard
errors), the fold of each prompt, and the declared scales.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cje_engine.errors import CJEInputError

#: Canonical column names of a validated frame (see `cje_engine.data.io.load_frame`).
PROMPT, POLICY, SCORE, LABEL, LABEL_PROB, RESPONSE_ID = (
    "prompt_id",
    "policy",
    "judge_score",
    "oracle_label",
    "label_probability",
    "response_id",
)

Scale = tuple[float, float]

_NAMED_SCALES: dict[str, Scale] = {
    "0-1": (0.0, 1.0),
    "0-10": (0.0, 10.0),
    "1-10": (1.0, 10.0),
    "1-5": (1.0, 5.0),
    "0-100": (0.0, 100.0),
}


def parse_scale(value: str | tuple[float, float] | list[float] | None, what: str) -> Scale | None:
    """Turn a declared scale ("0-100", (1, 10), ...) into ``(lo, hi)``.

    ``None`` means "no bounds" (only meaningful for judge scores).
    """
    if value is None:
        return None
    if isinstance(value, str):
        key = value.strip().replace(" ", "")
        if key.lower() in ("any", "none", "unbounded"):
            return None
        if key in _NAMED_SCALES:
            return _NAMED_SCALES[key]
        parts = key.split("-") if key.count("-") == 1 else key.split(",")
        try:
            lo, hi = (float(p) for p in parts)
        except ValueError:
            raise CJEInputError(
                f"{what} scale {value!r} is not understood; use 'LO-HI' such as '0-1', '1-10' or '0-100'"
            ) from None
    else:
        try:
            lo, hi = (float(v) for v in value)
        except (TypeError, ValueError):
            raise CJEInputError(f"{what} scale {value!r} must be a pair (lo, hi)") from None
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise CJEInputError(f"{what} scale {value!r} must have finite lo < hi")
    return (lo, hi)


def fold_of(prompt_ids: np.ndarray | list[str], n_folds: int) -> np.ndarray:
    """Stable fold of each prompt: blake2b hash of the prompt id, modulo ``n_folds``.

    The same prompt lands in the same fold on every machine, run and policy.
    """
    if len(prompt_ids) == 0:
        return np.empty(0, dtype=np.int64)
    n = len(prompt_ids)
    hashes = np.empty(n, dtype=np.uint64)
    # A chunk of ids at a time: as Python objects (``tolist``: iterating a numpy text array makes a
    # numpy scalar per id, which costs more than the hash), one C-level hash per id (a copy of an
    # empty 8-byte blake2b state: cheaper than a constructor call with its keyword), the digests
    # joined and read as big-endian uint64 (a chunk's objects only are alive at once).
    fresh = hashlib.blake2b(digest_size=8).copy
    for lo in range(0, n, _FOLD_CHUNK):
        chunk = prompt_ids[lo:lo + _FOLD_CHUNK]
        ids = chunk.tolist() if isinstance(chunk, np.ndarray) else chunk
        digests = []
        append = digests.append
        for pid in ids:
            h = fresh()
            h.update(str(pid).encode("utf-8"))
            append(h.digest())
        hashes[lo:lo + len(ids)] = np.frombuffer(b"".join(digests), dtype=">u8")
    return (hashes % np.uint64(n_folds)).astype(np.int64)


#: Prompt ids hashed per chunk by `fold_of`.
_FOLD_CHUNK = 1 << 16


@dataclass(frozen=True)
class FrameCodes:
    """Integer codes of a canonical frame's ``prompt_id`` and ``policy`` columns.

    `cje_engine.data.io.load_coded` returns them with the frame (its identity checks factorise
    both columns anyway); `EvalData.from_frame` takes them instead of factorising ten million ids a
    second time. Codes are in order of first appearance, as ``pandas.factorize`` gives them.

    Attributes
    ----------
    n_rows : int
        Rows of the frame the codes belong to.
    prompt, policy : ndarray of int, shape (n_rows,)
        Index of every row's value into ``prompt_uniques`` / ``policy_uniques``.
    prompt_uniques, policy_uniques : pandas.Index
        The distinct values, in order of first appearance.
    """

    n_rows: int
    prompt: np.ndarray
    prompt_uniques: pd.Index
    policy: np.ndarray
    policy_uniques: pd.Index

    def subset(self, keep: np.ndarray) -> "FrameCodes":
        """The codes of the rows ``keep`` (a boolean mask), numbered again in order of first
        appearance among those rows (what factorising the kept rows would give)."""
        def recode(codes: np.ndarray, uniques: pd.Index) -> tuple[np.ndarray, pd.Index]:
            new, old = pd.factorize(codes[keep])
            return new.astype(codes.dtype), uniques.take(old)

        return FrameCodes(int(np.count_nonzero(keep)), *recode(self.prompt, self.prompt_uniques),
                          *recode(self.policy, self.policy_uniques))


def _as_text(col: pd.Series) -> pd.Series:
    """A column as text; columns that already hold only ``str`` are used as they are (no copy)."""
    if col.dtype == object or pd.api.types.is_string_dtype(col.dtype):
        sample = col.iloc[:1000]
        if all(type(v) is str for v in sample) and pd.api.types.infer_dtype(col, skipna=False) == "string":
            return col
    return col.astype(str)


@dataclass(frozen=True)
class EvalData:
    """Rows of all policies as aligned numpy arrays.

    Attributes
    ----------
    prompt_ids : ndarray of str, shape (n_prompts,)
    prompt : ndarray of int, shape (n,)
        Index into ``prompt_ids`` for every row (the cluster).
    policies : tuple of str
    policy : ndarray of int, shape (n,)
        Index into ``policies`` for every row.
    score : ndarray of float, shape (n,)
        Judge score.
    label : ndarray of float, shape (n,)
        Oracle label, NaN where unlabelled.
    label_weight : ndarray of float, shape (n,)
        1 / P(labelled) for labelled rows (1 when labels are missing completely at random
        within the policy), 0 for unlabelled rows.
    X : ndarray of float, shape (n, p)
        Covariates (may have zero columns).
    covariate_names : tuple of str
    fold : ndarray of int, shape (n,)
        Fold of the row's prompt (stable hash of ``prompt_id``).
    label_scale : (lo, hi)
    score_scale : (lo, hi) or None
    """

    prompt_ids: np.ndarray
    prompt: np.ndarray
    policies: tuple[str, ...]
    policy: np.ndarray
    score: np.ndarray
    label: np.ndarray
    label_weight: np.ndarray
    X: np.ndarray
    covariate_names: tuple[str, ...]
    fold: np.ndarray
    n_folds: int
    label_scale: Scale
    score_scale: Scale | None

    @property
    def n_rows(self) -> int:
        """Number of rows (responses)."""
        return int(self.score.shape[0])

    @property
    def n_prompts(self) -> int:
        """Number of distinct prompts (the bootstrap's clusters)."""
        return int(self.prompt_ids.shape[0])

    @property
    def labelled(self) -> np.ndarray:
        """Boolean mask of the rows that carry an oracle label."""
        return ~np.isnan(self.label)

    @classmethod
    def from_frame(
        cls,
        frame: pd.DataFrame,
        *,
        covariates: list[str] | tuple[str, ...] = (),
        label_scale: Scale = (0.0, 1.0),
        score_scale: Scale | None = (0.0, 1.0),
        n_folds: int = 5,
        policies: list[str] | None = None,
        consume: bool = False,
        codes: FrameCodes | None = None,
    ) -> "EvalData":
        """Build from a validated canonical frame (see `cje_engine.data.io.load_frame`).

        Parameters
        ----------
        frame : pandas.DataFrame
            The canonical frame.
        covariates, label_scale, score_scale, n_folds, policies
            As in `cje_engine.prepare`.
        consume : bool, default False
            Let the build take the frame over: every column is removed from ``frame`` as soon
            as it has been converted (the columns the build does not read, such as
            ``response_id``, first), so the frame and the arrays are never both held in full.
            ``frame`` is left without columns. Use it when the frame is not needed afterwards
            (it lowers the peak memory at 10M rows by several hundred MB). The arrays are the
            same either way.
        codes : FrameCodes, optional
            The prompt and policy codes of ``frame`` (`cje_engine.data.io.load_coded`), used
            instead of factorising those columns again. The arrays are the same either way.
        """
        if n_folds < 2:
            raise CJEInputError(f"n_folds must be at least 2, got {n_folds}")
        for col in (PROMPT, POLICY, SCORE):
            if col not in frame.columns:
                raise CJEInputError("required column is missing", column=col, source="<frame>")
        for col in covariates:
            if col not in frame.columns:
                raise CJEInputError(
                    f"covariate '{col}' was requested but is not a column "
                    f"(columns: {', '.join(map(str, frame.columns))})",
                    column=col,
                    source="<frame>",
                )
        if codes is not None and codes.n_rows != len(frame):
            raise ValueError(f"codes are for {codes.n_rows} rows, the frame has {len(frame)}")
        source, covs = frame, set(covariates)

        def release(columns: list) -> None:  # consume: drop converted columns (covariates stay until copied)
            if consume:
                _drop(frame, [c for c in columns if c not in covs])

        needed = {PROMPT, POLICY, SCORE, LABEL, LABEL_PROB, *covariates}
        release([c for c in frame.columns if c not in needed])  # what the build never reads goes first
        policy_codes, policies = _policy_codes(frame, policies, codes)
        keep = policy_codes >= 0
        if not keep.all():
            frame = frame.loc[keep]
            policy_codes = policy_codes[keep]
            codes = None  # the prompt codes are for every row: factorise the kept ones
            if consume:
                _drop(source, list(source.columns))
        n = len(frame)
        release([POLICY])
        prompt_codes, prompt_ids = _prompt_codes(frame, codes)
        del codes
        release([PROMPT])
        prompt_ids = _compact_ids(prompt_ids)
        fold = fold_of(prompt_ids, n_folds)[prompt_codes]
        label = frame[LABEL].to_numpy(dtype=float) if LABEL in frame.columns else np.full(n, np.nan)
        label_weight = _label_weight(frame, label)
        score = frame[SCORE].to_numpy(dtype=float)
        release([LABEL, LABEL_PROB, SCORE])
        X = _covariate_matrix(frame, covariates, consume)
        if consume:
            _drop(frame, list(frame.columns))
        return cls(
            prompt_ids=prompt_ids,
            prompt=prompt_codes,
            policies=tuple(policies),
            policy=policy_codes,
            score=score,
            label=label,
            label_weight=label_weight,
            X=X,
            covariate_names=tuple(covariates),
            fold=fold,
            n_folds=n_folds,
            label_scale=label_scale,
            score_scale=score_scale,
        )


#: Longest id (characters) kept as fixed-width numpy text: 4 bytes a character, so up to 12
#: characters take at most 48 bytes an id, against ~72 for a Python ``str`` in an object array.
_FIXED_WIDTH_IDS = 12


def _compact_ids(index: pd.Index) -> np.ndarray:
    """Distinct ids as fixed-width numpy text (``<U{n}``) when they are short, else an object array.

    The same strings either way (an id ending in NUL stays an object: fixed-width text would drop
    the NUL); at 2M prompts of 8 characters 64 MB instead of ~145 MB, held through the inference.
    """
    ids = np.asarray(index, dtype=object)
    if ids.size == 0:
        return ids
    longest = int(index.str.len().max())
    if longest > _FIXED_WIDTH_IDS or bool(index.str.endswith("\x00").any()):
        return ids
    return ids.astype(f"<U{max(longest, 1)}")


def _drop(frame: pd.DataFrame, columns: list[str]) -> None:
    """Remove columns from ``frame`` in place (their memory goes once nothing else holds them)."""
    for col in columns:
        if col in frame.columns:
            del frame[col]


def _prompt_codes(frame: pd.DataFrame, codes: FrameCodes | None) -> tuple[np.ndarray, pd.Index]:
    """Every row's index into the sorted distinct prompt ids, and those ids (``pandas.factorize(...,
    sort=True)``); from ``codes`` when given: their distinct ids sorted the way ``factorize`` sorts
    them (``argsort`` of the distinct values) and the codes mapped through the permutation."""
    if codes is None:
        prompt_codes, prompt_ids = pd.factorize(_as_text(frame[PROMPT]), sort=True)
        return prompt_codes.astype(np.int64, copy=False), prompt_ids
    order = np.asarray(codes.prompt_uniques.argsort())
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    return rank[codes.prompt], codes.prompt_uniques.take(order)


def _policy_codes(frame: pd.DataFrame, policies: list[str] | None,
                  codes: FrameCodes | None = None) -> tuple[np.ndarray, list[str]]:
    """Index of every row's policy into the (sorted or requested) policy list; -1 = not requested."""
    if codes is None:
        pol_codes, pol_names = pd.factorize(_as_text(frame[POLICY]))
    else:
        pol_codes, pol_names = codes.policy, codes.policy_uniques
    seen = [str(p) for p in pol_names]
    if policies is None:
        policies = sorted(seen)
    else:
        missing = [p for p in policies if p not in seen]
        if missing:
            raise CJEInputError(
                f"policy {missing[0]!r} was requested but has no rows (policies present: {', '.join(sorted(seen))})",
                column=POLICY,
            )
    pol_lookup = {p: i for i, p in enumerate(policies)}
    remap = np.array([pol_lookup.get(p, -1) for p in seen], dtype=np.int64)
    return remap[pol_codes], list(policies)


def _label_weight(frame: pd.DataFrame, label: np.ndarray) -> np.ndarray:
    """1 / P(labelled) on labelled rows (1 where the probability is missing), 0 elsewhere.

    Only the labelled rows are touched: no row-sized temporaries beyond the result.
    """
    weight = np.zeros(label.shape[0])
    rows = np.flatnonzero(~np.isnan(label))
    if LABEL_PROB in frame.columns:
        prob = frame[LABEL_PROB].to_numpy(dtype=float)[rows]
        prob[np.isnan(prob)] = 1.0
        weight[rows] = 1.0 / prob
    else:
        weight[rows] = 1.0
    return weight


def _covariate_matrix(frame: pd.DataFrame, covariates: list[str] | tuple[str, ...], consume: bool) -> np.ndarray:
    """The covariates as an (n, p) float64 matrix; with ``consume`` each column is dropped once copied."""
    n = len(frame)
    if not covariates:
        return np.empty((n, 0), dtype=float)
    if len(covariates) == 1:
        X = frame[covariates[0]].to_numpy(dtype=float).reshape(n, 1)
    else:
        X = np.empty((n, len(covariates)), dtype=float)
        for j, col in enumerate(covariates):
            X[:, j] = frame[col].to_numpy(dtype=float)
            if consume:
                _drop(frame, [col])
    if consume:
        _drop(frame, list(covariates))
    return X
