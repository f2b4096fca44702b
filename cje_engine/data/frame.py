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
    blake = hashlib.blake2b
    # One C-level hash per id, the digests joined and read as big-endian uint64 in one go.
    digests = b"".join([blake(str(pid).encode("utf-8"), digest_size=8).digest() for pid in prompt_ids])
    return (np.frombuffer(digests, dtype=">u8") % np.uint64(n_folds)).astype(np.int64)


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
        return int(self.score.shape[0])

    @property
    def n_prompts(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def labelled(self) -> np.ndarray:
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
    ) -> "EvalData":
        """Build from a validated canonical frame (see `cje_engine.data.io.load_frame`)."""
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
        pol_codes, pol_names = pd.factorize(_as_text(frame[POLICY]))
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
        policy_codes = remap[pol_codes]
        keep = policy_codes >= 0
        if not keep.all():
            frame = frame.loc[keep]
            policy_codes = policy_codes[keep]
        prompt_codes, prompt_ids = pd.factorize(_as_text(frame[PROMPT]), sort=True)
        label = (
            frame[LABEL].to_numpy(dtype=float) if LABEL in frame.columns else np.full(len(frame), np.nan)
        )
        if LABEL_PROB in frame.columns:
            prob = frame[LABEL_PROB].to_numpy(dtype=float)
            prob = np.where(np.isnan(prob), 1.0, prob)
        else:
            prob = np.ones(len(frame))
        lab = ~np.isnan(label)
        label_weight = np.where(lab, 1.0 / prob, 0.0)
        X = (
            frame[list(covariates)].to_numpy(dtype=float)
            if covariates
            else np.empty((len(frame), 0), dtype=float)
        )
        prompt_ids = np.asarray(prompt_ids, dtype=object)
        folds_by_prompt = fold_of(prompt_ids, n_folds)
        return cls(
            prompt_ids=prompt_ids,
            prompt=prompt_codes.astype(np.int64),
            policies=tuple(policies),
            policy=policy_codes,
            score=frame[SCORE].to_numpy(dtype=float),
            label=label,
            label_weight=label_weight,
            X=X,
            covariate_names=tuple(covariates),
            fold=folds_by_prompt[prompt_codes],
            n_folds=n_folds,
            label_scale=label_scale,
            score_scale=score_scale,
        )
