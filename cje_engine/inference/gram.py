"""Influence terms in the Gram form: the labelled prompts' rows in full, the rest through their moments.

On the sharded row pass (`cje_engine.pipeline.sharded`) a prompt without a labelled row contributes to every
influence column only through its evaluation terms ``e`` (K numbers: ``(f - theta_k) / n_k`` summed over its
rows): the calibration, audit and own-label parts are zero there, and every column the finalize builds
(plug-in, augmented, own-label mean, power-tuned, differences) is a linear function ``e @ A[:, c]`` of them.
So the driver needs, for the unlabelled prompts, only their number, the sum of ``e``, its K x K
cross-products and its K x K x K third moments (`Moments`, merged over shards), plus every labelled prompt's
row. `GramTerms` holds that and behaves like the (prompts, columns) array for the operations the finalize
applies to influence terms: column selection, linear combinations (``+``, ``-``, ``*`` by constants),
`numpy.hstack`, `numpy.column_stack`, `numpy.where` over columns, `numpy.nan_to_num`; and answers the
reductions (`cluster_cov`, `column_var`, `acceleration`, `power_tuned_lambda`) from the moments. Anything that
would need every prompt's value (``numpy.asarray``, saving the terms) raises `TermsNotKept`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: The message of `TermsNotKept`.
NOT_KEPT = ("the per-prompt influence terms were not kept: this evaluation ran the sharded row pass in the Gram form "
            "(result inference.row_pass.influence = 'gram'; only the labelled prompts' terms and the moments of the "
            "rest are on the driver). Variances, intervals and comparisons are available; per-prompt terms are not "
            "(rerun with row_pass: single, or the sharded path with keep_terms=True)")


class TermsNotKept(ValueError):
    """An operation needs every prompt's influence terms, and only their Gram form was kept."""


@dataclass
class Moments:
    """Moments of the unlabelled prompts' evaluation terms ``e`` (K each), merged over shards."""

    n: int  # prompts
    s: np.ndarray  # (K,) sum of e
    S: np.ndarray  # (K, K) sum of e e'
    T: np.ndarray  # (K, K, K) sum of e_i e_j e_k

    @classmethod
    def of(cls, e: np.ndarray) -> "Moments":
        """The moments of the rows of ``e`` (prompts, K)."""
        e = np.asarray(e, dtype=float)
        return cls(int(e.shape[0]), e.sum(0), e.T @ e, np.einsum("pi,pj,pk->ijk", e, e, e, optimize=True))

    @classmethod
    def zero(cls, K: int) -> "Moments":
        """No prompts."""
        return cls(0, np.zeros(K), np.zeros((K, K)), np.zeros((K, K, K)))

    def __add__(self, other: "Moments") -> "Moments":
        return Moments(self.n + other.n, self.s + other.s, self.S + other.S, self.T + other.T)


def _linear(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Broadcast two column sets (1 column against many, as numpy does)."""
    return np.broadcast_arrays(a, b)


class GramTerms:
    """A (prompts, C) matrix of influence terms held as labelled rows plus unlabelled moments (module doc).

    Parameters
    ----------
    rows : ndarray (L, C)
        The labelled prompts' terms.
    A : ndarray (K, C)
        Column ``c`` of an unlabelled prompt is ``e @ A[:, c]``; an all-NaN column of ``A``: NaN on every
        unlabelled prompt.
    moments : Moments
        Of the unlabelled prompts' ``e``.
    vector : bool
        A single column taken with an integer index (numpy's 1-d column).
    prompts : ndarray (L,), optional
        The evaluation's prompt code of each row (increasing).
    """

    __array_priority__ = 100

    def __init__(self, rows: np.ndarray, A: np.ndarray, moments: Moments, vector: bool = False,
                 prompts: np.ndarray | None = None) -> None:
        self.rows = np.asarray(rows, dtype=float)
        self.A = np.asarray(A, dtype=float)
        self.moments = moments
        self.vector = vector
        self.prompts = prompts  # (L,) the labelled rows' prompt codes in the evaluation (sorted)
        if self.rows.ndim != 2 or self.A.ndim != 2 or self.rows.shape[1] != self.A.shape[1]:
            raise ValueError(f"GramTerms: rows {self.rows.shape} and map {self.A.shape} do not agree")

    # ---------------------------------------------------------------- array-like surface

    @property
    def shape(self) -> tuple:
        """The shape of the matrix it stands for: (prompts,) or (prompts, C)."""
        g = self.rows.shape[0] + self.moments.n
        return (g,) if self.vector else (g, self.rows.shape[1])

    @property
    def ndim(self) -> int:
        """1 for a single column taken with an integer index, else 2."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Entries of the matrix it stands for."""
        return int(np.prod(self.shape))

    def _new(self, rows: np.ndarray, A: np.ndarray, vector: bool = False) -> "GramTerms":
        return GramTerms(rows, A, self.moments, vector, self.prompts)

    def __getitem__(self, key: Any) -> "GramTerms":
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], slice) and key[0] == slice(None)):
            raise TermsNotKept(NOT_KEPT + f" (index {key!r} selects prompts)")
        if self.vector:
            raise TermsNotKept(NOT_KEPT + " (a column of a column)")
        col = key[1]
        if isinstance(col, (int, np.integer)):
            return self._new(self.rows[:, [int(col)]], self.A[:, [int(col)]], vector=True)
        return self._new(self.rows[:, col], self.A[:, col])

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TermsNotKept(NOT_KEPT)

    def _operand(self, x: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, A) of a linear operand; None for a constant."""
        if isinstance(x, GramTerms):
            if x.moments is not self.moments:
                raise ValueError("GramTerms of different evaluations")
            return x.rows, x.A
        return None

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if method != "__call__" or kwargs:
            return NotImplemented
        vector = all(x.vector for x in inputs if isinstance(x, GramTerms))
        ops = [self._operand(x) for x in inputs]
        if ufunc in (np.add, np.subtract) and all(o is not None for o in ops):
            (r1, a1), (r2, a2) = ops
            r1, r2 = _linear(r1, r2)
            a1, a2 = _linear(a1, a2)
            return self._new(ufunc(r1, r2), ufunc(a1, a2), vector)
        if ufunc is np.multiply and sum(o is not None for o in ops) == 1:
            g, c = (ops[0], inputs[1]) if ops[0] is not None else (ops[1], inputs[0])
            c = np.asarray(c, dtype=float)
            if c.ndim > 1 and c.shape[0] != 1:
                return NotImplemented
            return self._new(g[0] * c, g[1] * c, vector)
        if ufunc is np.negative:
            return self._new(-ops[0][0], -ops[0][1], vector)
        raise TermsNotKept(NOT_KEPT + f" ({ufunc.__name__} is not linear in the terms)")

    def __add__(self, o: Any) -> Any:
        return np.add(self, o)

    def __radd__(self, o: Any) -> Any:
        return np.add(o, self)

    def __sub__(self, o: Any) -> Any:
        return np.subtract(self, o)

    def __rsub__(self, o: Any) -> Any:
        return np.subtract(o, self)

    def __mul__(self, o: Any) -> Any:
        return np.multiply(self, o)

    def __rmul__(self, o: Any) -> Any:
        return np.multiply(o, self)

    def __neg__(self) -> "GramTerms":
        return np.negative(self)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func in (np.hstack, np.column_stack, np.concatenate):
            parts = args[0]
            if func is np.concatenate and kwargs.get("axis", args[1] if len(args) > 1 else 0) not in (1, -1):
                raise TermsNotKept(NOT_KEPT + " (concatenating prompts)")
            ops = [self._operand(p) for p in parts]
            if any(o is None for o in ops):
                raise TermsNotKept(NOT_KEPT + " (stacking with a per-prompt array)")
            return self._new(np.hstack([o[0] for o in ops]), np.hstack([o[1] for o in ops]))
        if func is np.where and len(args) == 3:
            cond, a, b = args
            cond = np.asarray(cond)
            if cond.ndim != 2 or cond.shape[0] != 1:
                raise TermsNotKept(NOT_KEPT + " (numpy.where over prompts)")
            (ra, aa), (rb, ab) = self._operand(a), self._operand(b)
            return self._new(np.where(cond, ra, rb), np.where(cond, aa, ab))
        if func is np.nan_to_num:
            return self._new(np.nan_to_num(self.rows), np.nan_to_num(self.A), self.vector)
        raise TermsNotKept(NOT_KEPT + f" (numpy.{func.__name__})")

    # ---------------------------------------------------------------- reductions

    def local(self, prompt: np.ndarray) -> np.ndarray:
        """The row of each of the evaluation's prompt codes ``prompt`` (all must be labelled prompts)."""
        pos = np.searchsorted(self.prompts, prompt)
        if pos.size and (pos.max() >= self.prompts.size or not np.array_equal(self.prompts[pos], prompt)):
            raise ValueError("a prompt without a row in the Gram form")
        return pos

    def _sums(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(prompts, column sums, uncentred cross-products) with NaN as 0."""
        R, A, m = np.nan_to_num(self.rows), np.nan_to_num(self.A), self.moments
        return R.shape[0] + m.n, R.sum(0) + m.s @ A, R.T @ R + A.T @ m.S @ A

    def cluster_cov(self, center: bool = True) -> np.ndarray:
        """`cje_engine.inference.variance.cluster_cov` of the matrix: ``G/(G-1) sum_c psi_c psi_c'``, centred."""
        g, s, P = self._sums()
        if center:
            P = P - np.outer(s, s) / max(g, 1)
        return P * g / max(g - 1, 1)

    def column_var(self) -> np.ndarray:
        """Each column's centred sum of squares times ``G/(G-1)`` (`pipeline.calibration._column_var`)."""
        return np.diag(self.cluster_cov()).copy()

    def acceleration(self) -> float:
        """`cje_engine.inference.intervals.acceleration` of a single column: ``sum U^3 / (6 (sum U^2)^1.5)``."""
        if self.rows.shape[1] != 1:
            raise ValueError("acceleration of a single column")
        x, a, m = np.nan_to_num(self.rows[:, 0]), np.nan_to_num(self.A[:, 0]), self.moments
        g = x.size + m.n
        s1 = x.sum() + m.s @ a
        s2 = x @ x + a @ m.S @ a
        s3 = np.sum(x * x * x) + np.einsum("ijk,i,j,k->", m.T, a, a, a)
        mu = s1 / g
        c2 = s2 - g * mu * mu
        if not c2 > 0:
            return 0.0
        c3 = s3 - 3 * mu * s2 + 3 * mu * mu * s1 - g * mu ** 3
        return float(c3 / (6.0 * c2 ** 1.5))

    def power_tuned_lambda(self, aug: "GramTerms") -> float:
        """`cje_engine.direct.verified.power_tuned_lambda` with ``self`` the own-label column."""
        o_rows, a_rows = self.rows[:, 0], aug.rows[:, 0]
        ok = np.isfinite(o_rows) & np.isfinite(a_rows)
        u_ok = bool(np.isfinite(self.A).all() and np.isfinite(aug.A).all())
        m = self.moments if u_ok else Moments.zero(self.A.shape[0])
        both = GramTerms(np.column_stack([o_rows[ok], a_rows[ok] - o_rows[ok]]),
                         np.column_stack([self.A[:, 0], aug.A[:, 0] - self.A[:, 0]]) if u_ok
                         else np.zeros((self.A.shape[0], 2)), m)
        g, s, P = both._sums()
        if g < 3:
            return 1.0
        mean = s / g
        var_d = float(P[1, 1] / g - mean[1] ** 2)
        if not var_d > 0:
            return 1.0
        lam = -float(P[0, 1] / g - mean[0] * mean[1]) / var_d
        return float(np.clip(lam, 0.0, 1.0))
