"""Influence terms in the Gram form: the labelled prompts' rows in full, the rest through their moments.

On the sharded row pass (`cje_engine.pipeline.sharded`) a prompt without a labelled row contributes to every
influence column only through its evaluation terms ``e`` (K numbers: ``(f - theta_k) / n_k`` summed over its
rows): the calibration, audit and own-label parts are zero there, and every column the finalize builds
(plug-in, augmented, own-label mean, power-tuned, differences) is a linear function ``e @ A[:, c]`` of them.
So the driver needs, for the unlabelled prompts, only their number, the sum of ``e``, its K x K
cross-products and its K x K x K third moments (`Moments`, merged over shards). A labelled prompt's columns
are linear too, in its *basis* vector (``e`` and its calibration, label-residual, audit and own-label parts:
5K numbers), so the labelled prompts are kept as those basis rows (`Basis`), never as the finalize's 4K-column
arrays, or only as their sums (`BasisSums`, `SummedBasis`: count, sums, cross-products, per-policy third
moments; what the sharded driver keeps, built a block of rows at a time). A `GramTerms` is a basis plus a column map ``M`` (basis dimensions x columns): column ``c`` of a
labelled prompt is ``b @ M[:, c]``, of an unlabelled one ``e @ M[:K, c]``. It behaves like the (prompts,
columns) array for the operations the finalize applies to influence terms (they change ``M`` only): column selection, linear combinations (``+``, ``-``, ``*`` by constants),
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


def third_moments(e: np.ndarray, reference: bool = False, et: np.ndarray | None = None) -> np.ndarray:
    """``T[i, j, k] = sum over rows p of e[p, i] e[p, j] e[p, k]`` of ``e`` (n, K), symmetric: the entries
    ``i <= j, k`` by K matrix products ``(e[:, i] * e[:, i:]).T @ e[:, i:]`` (BLAS; ~4x less CPU than
    ``numpy.einsum("pi,pj,pk->ijk")``, whose pairwise contraction goes through an (n, K, K) temporary without
    BLAS), every other entry the one of its sorted indices (each triple's sum computed once: 55 of 125 products'
    columns at K = 5, ~1.6x less CPU than all K products of the K columns). The sums are in another order than
    einsum's: they agree to rounding (a few ulps of the sum of absolute products; `tests/unit/test_sharded.py`).

    The products' left factors are written into one (K, n) buffer (`_third_moments_reference`: a new temporary
    each); each matrix product is the reference's, the same call on the same values: the same bits
    (`tests/unit/test_sharded.py`). A caller that holds ``e.T`` contiguous passes it as ``et`` (not copied again).
    ``reference``: the reference itself."""
    if reference:
        return _third_moments_reference(e)
    e = np.asarray(e, dtype=float)
    K = e.shape[1] if e.ndim == 2 else 0
    out = np.zeros((K, K, K))
    if K == 0:
        return out
    if et is None:
        et = np.ascontiguousarray(e.T)  # (K, n): each product's left factor is a contiguous row scaling
    buf = np.empty_like(et)
    for i in range(K):
        np.multiply(et[i:], et[i], out=buf[:K - i])
        out[i, i:, i:] = buf[:K - i] @ e[:, i:]
    return _symmetric(out)


def _third_moments_reference(e: np.ndarray) -> np.ndarray:
    """`third_moments` with a new temporary a product: the fast path's reference."""
    e = np.asarray(e, dtype=float)
    K = e.shape[1] if e.ndim == 2 else 0
    out = np.zeros((K, K, K))
    if K == 0:
        return out
    et = np.ascontiguousarray(e.T)  # (K, n): each product's left factor is a contiguous row scaling
    for i in range(K):
        out[i, i:, i:] = (et[i:] * et[i]) @ e[:, i:]
    return _symmetric(out)


def _symmetric(out: np.ndarray) -> np.ndarray:
    """A (K, K, K) array whose every entry is the one at its indices sorted (``out[i, j, k]`` with ``i <= j <= k``
    computed, the rest read from it)."""
    K = out.shape[0]
    idx = np.sort(np.indices((K, K, K)).reshape(3, -1), axis=0)
    return out[idx[0], idx[1], idx[2]].reshape(K, K, K)


@dataclass
class Moments:
    """Moments of the unlabelled prompts' evaluation terms ``e`` (K each), merged over shards."""

    n: int  # prompts
    s: np.ndarray  # (K,) sum of e
    S: np.ndarray  # (K, K) sum of e e'
    T: np.ndarray  # (K, K, K) sum of e_i e_j e_k

    @classmethod
    def of(cls, e: np.ndarray, reference: bool = False) -> "Moments":
        """The moments of the rows of ``e`` (prompts, K) (``reference``: `third_moments`' reference; the same
        bits)."""
        e = np.asarray(e, dtype=float)
        return cls(int(e.shape[0]), e.sum(0), e.T @ e, third_moments(e, reference))

    @classmethod
    def zero(cls, K: int) -> "Moments":
        """No prompts."""
        return cls(0, np.zeros(K), np.zeros((K, K)), np.zeros((K, K, K)))

    def __add__(self, other: "Moments") -> "Moments":
        return Moments(self.n + other.n, self.s + other.s, self.S + other.S, self.T + other.T)


@dataclass
class Basis:
    """The prompts of a Gram form: labelled prompts' basis rows, the unlabelled prompts' moments.

    ``rows`` (L, D): each labelled prompt's basis vector (its first K entries are its evaluation terms ``e``);
    ``moments``: of the unlabelled prompts' ``e`` (K dimensions); ``prompts`` (L,): the evaluation's prompt
    code of each row (increasing). Column sums and cross-products of the rows are computed once.
    """

    rows: np.ndarray
    moments: Moments
    prompts: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.rows = np.asarray(self.rows, dtype=float)
        step = 1 << 16  # a chunk of rows at a time: no (L, D) boolean temporary
        if not all(np.isfinite(self.rows[i:i + step]).all() for i in range(0, self.rows.shape[0], step)):
            raise ValueError("a Gram basis must be finite (NaN columns go in the column map)")
        K, D = self.moments.s.size, self.rows.shape[1]
        if K > D:
            raise ValueError(f"moments of {K} dimensions for a basis of {D}")
        self.sum = self.rows.sum(0)
        self.sum[:K] += self.moments.s
        self.cross = self.rows.T @ self.rows
        self.cross[:K, :K] += self.moments.S

    @property
    def n(self) -> int:
        """Every prompt: labelled rows plus unlabelled ones."""
        return int(self.rows.shape[0] + self.moments.n)

    @property
    def dim(self) -> int:
        """Dimensions of a basis row (D)."""
        return int(self.rows.shape[1])

    def cube(self, a: np.ndarray) -> float:
        """``sum over the basis rows of (b @ a)^3`` for the column map ``a`` (D,) (labelled prompts only)."""
        x = self.times(a)
        return float(np.sum(x * x * x))

    def times(self, a: np.ndarray) -> np.ndarray:
        """The values ``rows @ a`` of the column map ``a`` (D,) at the basis rows (labelled prompts only here),
        for sums of their powers: a subclass may leave out rows where the value is 0."""
        return self.rows @ a

    def local(self, prompt: np.ndarray) -> np.ndarray:
        """The row of each of the evaluation's prompt codes ``prompt`` (all must be labelled prompts)."""
        pos = np.searchsorted(self.prompts, prompt)
        if pos.size and (pos.max() >= self.prompts.size or not np.array_equal(self.prompts[pos], prompt)):
            raise ValueError("a prompt without a row in the Gram form")
        return pos


class SparseBasis(Basis):
    """A `Basis` whose rows are a sparse matrix (every prompt a row, no moments): the segment x policy terms
    (`cje_engine.direct.segment_terms`), where a prompt's row is non-zero only in its own segment's columns
    and in the level sets of its calibration rows. Column sums and cross-products are computed sparsely."""

    def __post_init__(self) -> None:
        from scipy import sparse  # here: the segments' driver side, not the passes' workers (~0.08 s of CPU a worker)

        rows = self.rows if sparse.issparse(self.rows) and self.rows.format == "csc" else sparse.csc_matrix(self.rows)
        rows = rows.astype(float, copy=False)
        if not np.isfinite(rows.data).all():
            raise ValueError("a Gram basis must be finite (NaN columns go in the column map)")
        self.rows = rows  # by column (CSC): a column map reads the basis columns it names
        self.sum = np.asarray(rows.sum(axis=0), dtype=float).ravel()
        self.cross = np.asarray((rows.T @ rows).toarray(), dtype=float)
        self._by_column = rows

    def times(self, a: np.ndarray) -> np.ndarray:
        """``rows @ a`` at the prompts where a basis dimension that ``a`` reads is not 0 (the others are 0; a
        segment cell's own-label column reads its own cell's dimensions only, not every prompt's)."""
        from scipy import sparse

        nz = np.flatnonzero(a)
        sub = self._by_column[:, nz]
        return (sub @ sparse.csc_matrix(a[nz].reshape(-1, 1))).data


class BasisSums:
    """What the finalize reads of the labelled prompts' basis rows, accumulated a block of rows at a time
    (`add`), so the rows themselves are never all held: their number, column sums, cross-products and, per
    group of dimensions (``groups``, (n_groups, g) indices: a policy's ``[e | c | r | audit | own]``), their third
    moments. `SummedBasis` answers `GramTerms` from them; the acceleration of a column whose map reads
    dimensions of more than one group needs every row (`TermsNotKept`)."""

    def __init__(self, dim: int, groups: np.ndarray) -> None:
        self.groups = np.asarray(groups, dtype=np.int64).reshape(len(groups), -1)
        g = self.groups.shape[1]
        self.n = 0
        self.sum = np.zeros(dim)
        self.cross = np.zeros((dim, dim))
        self.cubes = np.zeros((self.groups.shape[0], g, g, g))

    def add(self, rows: np.ndarray, reference: bool = False, rows_t: np.ndarray | None = None) -> None:
        """Add basis rows (c, D) (finite). Each group's third moments from its columns taken once and its
        products written into one reused buffer (`third_moments`; ``reference``: a copy of the group's columns
        and a new temporary a product, as first written): the same calls on the same values, the same bits.
        ``rows_t``: ``rows.T`` C-contiguous when the caller holds it (not copied again)."""
        rows = np.asarray(rows, dtype=float)
        if not np.isfinite(rows).all():
            raise ValueError("a Gram basis must be finite (NaN columns go in the column map)")
        self.n += int(rows.shape[0])
        self.sum += rows.sum(0)
        self.cross += rows.T @ rows
        if reference:
            for i, idx in enumerate(self.groups):
                # C-ordered like the fast path's columns: ``rows[:, idx]`` alone is Fortran-ordered, and BLAS may
                # sum a product of a transposed factor in another order (OpenBLAS's SkylakeX kernels do)
                b = np.ascontiguousarray(rows[:, idx])
                self.cubes[i] += _third_moments_reference(b)
            return
        if rows_t is None:
            rows_t = transposed(rows)  # (D, c): a group's left factors are rows of it
        for i, idx in enumerate(self.groups):  # its columns (c, g) C-contiguous: its left factors transposed
            et = _rows_of(rows_t, idx)
            self.cubes[i] += third_moments(transposed(et), et=et)

    def merge(self, other: "BasisSums") -> None:
        """Add another block's sums (same dimensions and groups)."""
        self.n += other.n
        self.sum += other.sum
        self.cross += other.cross
        self.cubes += other.cubes


#: Rows of a (D, n) array transposed at a time by `transposed` (a slab whose reads stay in cache).
TRANSPOSE_STEP = 4096


def transposed(a: np.ndarray) -> np.ndarray:
    """``numpy.ascontiguousarray(a.T)`` of a 2-d array, copied a slab of `TRANSPOSE_STEP` of its columns at a
    time (the same values; a whole-array strided copy misses the cache on every read).

    Parameters
    ----------
    a : numpy.ndarray
        A 2-d array (n, m), any strides.

    Returns
    -------
    numpy.ndarray
        Its transpose (m, n), C-contiguous, a new array.
    """
    out = np.empty((a.shape[1], a.shape[0]), dtype=a.dtype)
    for lo in range(0, a.shape[1], TRANSPOSE_STEP):
        out[lo:lo + TRANSPOSE_STEP] = a[:, lo:lo + TRANSPOSE_STEP].T
    return out


def _rows_of(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[idx]`` (rows of a 2-d array, only read), a view when ``idx`` steps evenly forward (a policy's
    dimensions ``k, K + k, ...``): no copy for `third_moments`' elementwise left factors."""
    if idx.size > 1:
        step = int(idx[1] - idx[0])
        if step > 0 and np.array_equal(np.diff(idx), np.full(idx.size - 1, step)):
            return a[int(idx[0]):int(idx[-1]) + 1:step]
    return a[idx]


class SummedBasis:
    """A `Basis` kept as sums (`BasisSums`): the labelled prompts' count, sums, cross-products and per-group
    third moments instead of their rows (the sharded driver's Gram form, `cje_engine.pipeline.sharded`)."""

    prompts = None

    def __init__(self, sums: BasisSums, moments: Moments) -> None:
        K, D = moments.s.size, sums.sum.size
        if K > D:
            raise ValueError(f"moments of {K} dimensions for a basis of {D}")
        self.sums, self.moments = sums, moments
        self.sum = sums.sum.copy()
        self.sum[:K] += moments.s
        self.cross = sums.cross.copy()
        self.cross[:K, :K] += moments.S

    @property
    def n(self) -> int:
        """Every prompt: labelled rows plus unlabelled ones."""
        return int(self.sums.n + self.moments.n)

    @property
    def n_rows(self) -> int:
        """The labelled prompts (rows summed)."""
        return int(self.sums.n)

    @property
    def dim(self) -> int:
        """Dimensions of a basis row (D)."""
        return int(self.sum.size)

    @property
    def rows(self) -> np.ndarray:
        """Not kept: raises `TermsNotKept`."""
        raise TermsNotKept(NOT_KEPT + " (the labelled prompts' basis rows are kept as sums)")

    def times(self, a: np.ndarray) -> np.ndarray:
        """Not kept: raises `TermsNotKept`."""
        raise TermsNotKept(NOT_KEPT + " (the labelled prompts' basis rows are kept as sums)")

    def local(self, prompt: np.ndarray) -> np.ndarray:
        """Not kept: raises `TermsNotKept`."""
        raise TermsNotKept(NOT_KEPT + " (the labelled prompts' basis rows are kept as sums)")

    def cube(self, a: np.ndarray) -> float:
        """``sum over the labelled prompts of (b @ a)^3`` from the third moments of the one group of dimensions
        that ``a`` reads (0 when it reads none); `TermsNotKept` when it reads dimensions of two groups."""
        nz = np.flatnonzero(a)
        if not nz.size:
            return 0.0
        groups = self.sums.groups
        hit = np.flatnonzero(np.isin(groups, nz).sum(1) == nz.size)
        if not hit.size:
            raise TermsNotKept(NOT_KEPT + " (the third moments are kept within a policy's dimensions only)")
        g = int(hit[0])
        ag = a[groups[g]]
        return float(np.einsum("ijk,i,j,k->", self.sums.cubes[g], ag, ag, ag))


class GramTerms:
    """A (prompts, C) matrix of influence terms: a `Basis` and a column map (module doc).

    Parameters
    ----------
    basis : Basis
    M : ndarray (D, C)
        Column ``c`` of a labelled prompt is ``b @ M[:, c]``, of an unlabelled one ``e @ M[:K, c]``; a column
        of ``M`` with a NaN: NaN on every prompt (a statistic that does not exist).
    vector : bool
        A single column taken with an integer index (numpy's 1-d column).
    """

    __array_priority__ = 100

    def __init__(self, basis: Basis, M: np.ndarray, vector: bool = False) -> None:
        self.basis = basis
        self.M = np.asarray(M, dtype=float)
        self.vector = vector
        if self.M.ndim != 2 or self.M.shape[0] != basis.dim:
            raise ValueError(f"GramTerms: basis of {basis.dim} dimensions, map {self.M.shape}")

    # ---------------------------------------------------------------- array-like surface

    @property
    def moments(self) -> Moments:
        """The unlabelled prompts' moments."""
        return self.basis.moments

    @property
    def prompts(self) -> np.ndarray | None:
        """The labelled prompts' codes (the basis rows')."""
        return self.basis.prompts

    def local(self, prompt: np.ndarray) -> np.ndarray:
        """`Basis.local`."""
        return self.basis.local(prompt)

    @property
    def rows(self) -> np.ndarray:
        """The labelled prompts' values (L, C) (computed: ``basis.rows @ M``)."""
        return self.basis.rows @ self.M

    @property
    def shape(self) -> tuple:
        """The shape of the matrix it stands for: (prompts,) or (prompts, C)."""
        g = self.basis.n
        return (g,) if self.vector else (g, self.M.shape[1])

    @property
    def ndim(self) -> int:
        """1 for a single column taken with an integer index, else 2."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Entries of the matrix it stands for."""
        return int(np.prod(self.shape))

    def _new(self, M: np.ndarray, vector: bool = False) -> "GramTerms":
        return GramTerms(self.basis, M, vector)

    def __getitem__(self, key: Any) -> "GramTerms":
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], slice) and key[0] == slice(None)):
            raise TermsNotKept(NOT_KEPT + f" (index {key!r} selects prompts)")
        if self.vector:
            raise TermsNotKept(NOT_KEPT + " (a column of a column)")
        col = key[1]
        if isinstance(col, (int, np.integer)):
            return self._new(self.M[:, [int(col)]], vector=True)
        return self._new(self.M[:, col])

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TermsNotKept(NOT_KEPT)

    def _operand(self, x: Any) -> np.ndarray | None:
        """The column map of a linear operand; None for a constant."""
        if isinstance(x, GramTerms):
            if x.basis is not self.basis:
                raise ValueError("GramTerms of different evaluations")
            return x.M
        return None

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if method != "__call__" or kwargs:
            return NotImplemented
        vector = all(x.vector for x in inputs if isinstance(x, GramTerms))
        ops = [self._operand(x) for x in inputs]
        if ufunc in (np.add, np.subtract) and len(ops) == 2 and all(o is not None for o in ops):
            return self._new(ufunc(*np.broadcast_arrays(*ops)), vector)
        if ufunc is np.multiply and len(ops) == 2 and sum(o is not None for o in ops) == 1:
            m, c = (ops[0], inputs[1]) if ops[0] is not None else (ops[1], inputs[0])
            c = np.asarray(c, dtype=float)
            if c.ndim > 1 and c.shape[0] != 1:
                return NotImplemented
            return self._new(m * c, vector)
        if ufunc is np.negative:
            return self._new(-ops[0], vector)
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
            return self._new(np.hstack(ops))
        if func is np.where and len(args) == 3:
            cond, a, b = args
            cond = np.asarray(cond)
            if cond.ndim != 2 or cond.shape[0] != 1:
                raise TermsNotKept(NOT_KEPT + " (numpy.where over prompts)")
            return self._new(np.where(cond, self._operand(a), self._operand(b)))
        if func is np.nan_to_num:
            return self._new(np.nan_to_num(self.M), self.vector)
        raise TermsNotKept(NOT_KEPT + f" (numpy.{func.__name__})")

    # ---------------------------------------------------------------- reductions

    def _sums(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(prompts, column sums, uncentred cross-products) with NaN as 0."""
        M = np.nan_to_num(self.M)
        return self.basis.n, self.basis.sum @ M, M.T @ self.basis.cross @ M

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
        if self.M.shape[1] != 1:
            raise ValueError("acceleration of a single column")
        a = np.nan_to_num(self.M[:, 0])
        m = self.moments
        g, s, P = self._sums()
        s1, s2 = float(s[0]), float(P[0, 0])
        ak = a[:m.s.size]
        s3 = self.basis.cube(a) + np.einsum("ijk,i,j,k->", m.T, ak, ak, ak)
        mu = s1 / g
        c2 = s2 - g * mu * mu
        if not c2 > 0:
            return 0.0
        c3 = s3 - 3 * mu * s2 + 3 * mu * mu * s1 - g * mu ** 3
        return float(c3 / (6.0 * c2 ** 1.5))

    def power_tuned_lambda(self, aug: "GramTerms") -> float:
        """`cje_engine.direct.verified.power_tuned_lambda` with ``self`` the own-label column (non-finite
        columns are NaN on every prompt: then 1, as there)."""
        if not (np.isfinite(self.M).all() and np.isfinite(aug.M).all()):
            return 1.0
        both = self._new(np.column_stack([self.M[:, 0], aug.M[:, 0] - self.M[:, 0]]))
        g, s, P = both._sums()
        if g < 3:
            return 1.0
        mean = s / g
        var_d = float(P[1, 1] / g - mean[1] ** 2)
        if not var_d > 0:
            return 1.0
        lam = -float(P[0, 1] / g - mean[0] * mean[1]) / var_d
        return float(np.clip(lam, 0.0, 1.0))
