"""Inputs of the off-policy estimators: logged responses, fresh draws and calibrated rewards.

Plain arrays, validated on construction (`cje_engine.errors.CJEInputError` names the column and row).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.offpolicy.weights import as_1d, log_importance_weights


def _ids(values: object, n: int, column: str, source: str | None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise CJEInputError(f"expected {n} prompt ids (one per row), got shape {arr.shape}", column=column,
                            source=source)
    arr = arr.astype(str)
    bad = np.isin(arr, ["", "nan", "None"])
    if bad.any():
        raise CJEInputError("prompt id is missing", column=column, row=int(np.flatnonzero(bad)[0]), source=source)
    return arr


def _finite(values: object, n: int, column: str, source: str | None) -> np.ndarray:
    arr = as_1d(values, column, source)
    if arr.shape[0] != n:
        raise CJEInputError(f"length mismatch: expected {n} values (one per row), got {arr.shape[0]}",
                            column=column, source=source)
    bad = ~np.isfinite(arr)
    if bad.any():
        raise CJEInputError("value is NaN or infinite; expected a finite number", column=column,
                            row=int(np.flatnonzero(bad)[0]), source=source)
    return arr


def _lengths(values: object | None, n: int, column: str, source: str | None) -> np.ndarray | None:
    if values is None:
        return None
    arr = _finite(values, n, column, source)
    bad = arr <= 0
    if bad.any():
        raise CJEInputError("response length must be positive (tokens, or characters as a proxy)",
                            column=column, row=int(np.flatnonzero(bad)[0]), source=source)
    return arr


@dataclass(frozen=True)
class LoggedData:
    """Logged responses of the logger, with log-probabilities under the logger and one target.

    ``lengths`` (token counts, or characters as a proxy) make TTC use per-token surprisal.
    """

    prompt_ids: np.ndarray
    scores: np.ndarray
    logger_logprob: np.ndarray
    target_logprob: np.ndarray
    lengths: np.ndarray | None = None
    source: str | None = None
    target_column: str = "target_policy_logprob"
    log_w: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lp0 = as_1d(self.logger_logprob, "base_policy_logprob", self.source)
        n = lp0.shape[0]
        log_w = log_importance_weights(lp0, self.target_logprob, source=self.source,
                                       target_column=self.target_column)
        object.__setattr__(self, "logger_logprob", np.minimum(lp0, 0.0))
        object.__setattr__(self, "target_logprob", np.minimum(np.asarray(self.target_logprob, float), 0.0))
        object.__setattr__(self, "log_w", log_w)
        object.__setattr__(self, "prompt_ids", _ids(self.prompt_ids, n, "prompt_id", self.source))
        object.__setattr__(self, "scores", _finite(self.scores, n, "judge_score", self.source))
        object.__setattr__(self, "lengths", _lengths(self.lengths, n, "response_length", self.source))

    @property
    def n(self) -> int:
        """Number of logged rows."""
        return int(self.scores.shape[0])


@dataclass(frozen=True)
class FreshData:
    """Fresh responses drawn from the target (hybrid mode), optionally with their own target
    log-probabilities (then TTC uses them as the reference for target-typical surprisal)."""

    prompt_ids: np.ndarray
    scores: np.ndarray
    target_logprob: np.ndarray | None = None
    lengths: np.ndarray | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        s = as_1d(self.scores, "judge_score", self.source)
        n = s.shape[0]
        if n == 0:
            raise CJEInputError("no fresh draws; expected at least one row", column="judge_score", source=self.source)
        object.__setattr__(self, "scores", _finite(s, n, "judge_score", self.source))
        object.__setattr__(self, "prompt_ids", _ids(self.prompt_ids, n, "prompt_id", self.source))
        if self.target_logprob is not None:
            lp = _finite(self.target_logprob, n, "target_policy_logprob", self.source)
            bad = lp > 1e-6
            if bad.any():
                raise CJEInputError("log-probability is positive; expected <= 0", column="target_policy_logprob",
                                    row=int(np.flatnonzero(bad)[0]), source=self.source)
            object.__setattr__(self, "target_logprob", np.minimum(lp, 0.0))
        object.__setattr__(self, "lengths", _lengths(self.lengths, n, "response_length", self.source))

    @property
    def n(self) -> int:
        """Number of fresh draws."""
        return int(self.scores.shape[0])


@dataclass(frozen=True)
class Rewards:
    """Calibrated rewards from the caller's calibrator.

    ``logged``: R = f(S) on logged rows; ``fresh``: f(S) on fresh draws; ``q_logged`` and
    ``q_fresh``: the DR outcome model q(x, a) on logged rows and fresh draws (default: the
    calibrated rewards themselves, i.e. q = f(S), in which case DR equals Direct exactly).
    """

    logged: np.ndarray
    fresh: np.ndarray | None = None
    q_logged: np.ndarray | None = None
    q_fresh: np.ndarray | None = None

    def checked(self, n_logged: int, n_fresh: int | None) -> "Rewards":
        """These rewards checked against the data's sizes: finite, of the right length, fresh and DR
        parts given together.

        Parameters
        ----------
        n_logged : int
            Number of logged rows.
        n_fresh : int or None
            Number of fresh draws (None: no fresh draws, so no fresh rewards may be given).

        Returns
        -------
        Rewards
            The checked rewards; a mismatch raises `CJEInputError` naming the column.
        """
        logged = _finite(self.logged, n_logged, "calibrated_reward", "<rewards>")
        if (self.q_logged is None) != (self.q_fresh is None):
            raise CJEInputError("give both q_logged and q_fresh (the DR outcome model on logged rows and on "
                                "fresh draws) or neither", column="q", source="<rewards>")
        if n_fresh is None:
            if self.fresh is not None or self.q_fresh is not None:
                raise CJEInputError("fresh rewards were given but no fresh draws", column="fresh", source="<rewards>")
            return Rewards(logged)
        if self.fresh is None:
            raise CJEInputError("fresh draws were given but no calibrated rewards for them", column="fresh",
                                source="<rewards>")
        fresh = _finite(self.fresh, n_fresh, "fresh_reward", "<rewards>")
        if self.q_logged is None:
            return Rewards(logged, fresh, logged.copy(), fresh.copy())
        return Rewards(logged, fresh, _finite(self.q_logged, n_logged, "q_logged", "<rewards>"),
                       _finite(self.q_fresh, n_fresh, "q_fresh", "<rewards>"))
