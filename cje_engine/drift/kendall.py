"""Kendall's tau-b with ties: exact pair counts, jackknife and influence-function standard errors.

``tau_b = (C - D) / sqrt((n0 - n1) (n0 - n2))`` (equals ``scipy.stats.kendalltau``), computed
from exact per-observation integer pair counts in O(n + kx*ky) for few distinct values. The
delete-one(-cluster) jackknife replicates are exact in O(n); see ``docs/drift.md``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from cje_engine.drift.inputs import check_alpha, jsonable
from cje_engine.errors import CJEInputError
from cje_engine.inference.reference_t import t_isf

# Above this many cells (distinct x values times distinct y values) the pair counts are computed
# by blocked pairwise comparison instead of a contingency table.
_MAX_TABLE_CELLS = 4_000_000
_BLOCK = 512

@dataclass(frozen=True)
class PairCounts:
    """Per-observation pair counts behind tau-b.

    ``s[i] = sum_j sign(x_i - x_j) * sign(y_i - y_j)`` (concordant minus discordant partners),
    ``tx[i] = #{j : x_j != x_i}``, ``ty[i] = #{j : y_j != y_i}``. Then ``S = sum(s) / 2`` is
    concordant minus discordant pairs, ``Tx = sum(tx) / 2`` the pairs not tied in x.
    """

    s: np.ndarray
    tx: np.ndarray
    ty: np.ndarray

    @property
    def S(self) -> int:
        """Concordant minus discordant pairs."""
        return int(self.s.sum()) // 2

    @property
    def Tx(self) -> int:
        """Pairs not tied in x."""
        return int(self.tx.sum()) // 2

    @property
    def Ty(self) -> int:
        """Pairs not tied in y."""
        return int(self.ty.sum()) // 2


def pair_counts(x: np.ndarray, y: np.ndarray) -> PairCounts:
    """Exact integer pair counts in O(n + kx*ky) (few distinct values) or O(n^2) blocked."""
    n = x.shape[0]
    ux, cx = np.unique(x, return_inverse=True)
    uy, cy = np.unique(y, return_inverse=True)
    kx, ky = ux.shape[0], uy.shape[0]
    nx = np.bincount(cx, minlength=kx)
    ny = np.bincount(cy, minlength=ky)
    tx = (n - nx[cx]).astype(np.int64)
    ty = (n - ny[cy]).astype(np.int64)
    if kx * ky <= _MAX_TABLE_CELLS:
        table = np.bincount(cx * ky + cy, minlength=kx * ky).astype(np.int64).reshape(kx, ky)
        cum = np.zeros((kx + 1, ky + 1), dtype=np.int64)
        cum[1:, 1:] = table.cumsum(axis=0).cumsum(axis=1)
        a, b = cx, cy
        lt_lt = cum[a, b]  # x < a, y < b
        lt_gt = cum[a, ky] - cum[a, b + 1]  # x < a, y > b
        gt_lt = cum[kx, b] - cum[a + 1, b]  # x > a, y < b
        gt_gt = n - cum[a + 1, ky] - cum[kx, b + 1] + cum[a + 1, b + 1]  # x > a, y > b
        s = (lt_lt + gt_gt - lt_gt - gt_lt).astype(np.int64)
    else:
        s = np.empty(n, dtype=np.int64)
        for start in range(0, n, _BLOCK):
            stop = min(start + _BLOCK, n)
            sx = np.sign(cx[start:stop, None] - cx[None, :])
            sy = np.sign(cy[start:stop, None] - cy[None, :])
            s[start:stop] = (sx * sy).sum(axis=1)
    return PairCounts(s=s, tx=tx, ty=ty)


def _as_float_array(values: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise CJEInputError(f"{name} must be numbers", column=name) from None
    if arr.ndim != 1:
        raise CJEInputError(f"{name} must be one-dimensional, got shape {arr.shape}", column=name)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise CJEInputError(
            f"{name} must be finite; found {arr[bad[0]]!r}", column=name, row=int(bad[0])
        )
    return arr


def cluster_codes(clusters: Any, n: int) -> np.ndarray | None:
    """Integer codes 0..G-1 of the clusters (None passes through)."""
    if clusters is None:
        return None
    arr = np.asarray(clusters)
    if arr.shape == (n,) and np.issubdtype(arr.dtype, np.integer):
        if arr.dtype == np.intp and arr.min() >= 0 and np.bincount(arr).all():
            return arr  # already the codes 0..G-1 (every code used): what np.unique would return
        return np.unique(arr, return_inverse=True)[1]
    if arr.shape != (n,):
        raise CJEInputError(
            f"clusters must have one entry per observation ({n}), got shape {arr.shape}",
            column="clusters",
        )
    _, codes = np.unique(arr.astype(str), return_inverse=True)
    return codes


def _check_pair(x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    xa = _as_float_array(x, "x")
    ya = _as_float_array(y, "y")
    if xa.shape != ya.shape:
        raise CJEInputError(f"x and y must have the same length, got {xa.shape[0]} and {ya.shape[0]}")
    if xa.shape[0] < 3:
        raise CJEInputError(f"tau-b needs at least 3 pairs, got {xa.shape[0]}")
    return xa, ya


def _tau_from(S: float, Tx: float, Ty: float) -> float:
    if Tx <= 0 or Ty <= 0:
        return float("nan")
    return float(S / math.sqrt(float(Tx) * float(Ty)))


def _constant_error(x: np.ndarray, y: np.ndarray) -> None:
    for name, arr in (("x", x), ("y", y)):
        if np.all(arr == arr[0]):
            raise CJEInputError(
                f"all {name} values equal {float(arr[0])!r}: tau-b is undefined for a constant variable",
                column=name,
            )


_MAX_WITHIN_CELLS = 4_000_000


@functools.lru_cache(maxsize=32)
def _within_pairs(codes_bytes: bytes, G: int, max_cells: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """All within-cluster pairs ``(i, j, cluster)`` of the codes (cached: looks reuse the clusters).

    None when no cluster has two members or the padded layout exceeds `_MAX_WITHIN_CELLS`.
    """
    codes = np.frombuffer(codes_bytes, dtype=np.int64)
    sizes = np.bincount(codes, minlength=G)
    m = int(sizes.max())
    if m < 2 or G * m * m > max_cells:
        return None
    order = np.argsort(codes, kind="stable")
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    pos = np.arange(codes.shape[0]) - starts[codes[order]]
    member = np.full((G, m), -1, dtype=np.int64)
    member[codes[order], pos] = order
    a, b = np.triu_indices(m, k=1)
    i, j = member[:, a], member[:, b]
    ok = (i >= 0) & (j >= 0)
    i, j = i[ok], j[ok]
    g = codes[i]
    for arr in (i, j, g):
        arr.flags.writeable = False
    return i, j, g


def _within_cluster_counts(x: np.ndarray, y: np.ndarray, codes: np.ndarray, G: int
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per cluster: concordant minus discordant pairs, pairs untied in x, pairs untied in y.

    Vectorised over all within-cluster pairs (`_within_pairs`, clusters padded to the largest
    size) when that fits in `_MAX_WITHIN_CELLS`; otherwise one `pair_counts` per cluster.
    """
    codes = np.ascontiguousarray(codes, dtype=np.int64)
    sizes = np.bincount(codes, minlength=G)
    w_s, w_x, w_y = np.zeros(G), np.zeros(G), np.zeros(G)
    if int(sizes.max()) < 2:
        return w_s, w_x, w_y
    pairs = _within_pairs(codes.tobytes(), G, _MAX_WITHIN_CELLS)
    if pairs is not None:
        i, j, g = pairs
        dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
        w_s = np.bincount(g, weights=dx * dy, minlength=G)
        w_x = np.bincount(g, weights=(dx != 0).astype(float), minlength=G)
        w_y = np.bincount(g, weights=(dy != 0).astype(float), minlength=G)
        return w_s, w_x, w_y
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    for idx in np.split(order, bounds):
        if idx.shape[0] >= 2:
            inner = pair_counts(x[idx], y[idx])
            g = codes[idx[0]]
            w_s[g], w_x[g], w_y[g] = inner.S, inner.Tx, inner.Ty
    return w_s, w_x, w_y


def tau_b_leave_one_out(
    x: Any, y: Any, clusters: Any = None
) -> tuple[float, np.ndarray]:
    """Tau-b and its delete-one (or delete-one-cluster) jackknife replicates.

    Exact in O(n) after the pair counts: deleting observation i gives
    ``tau_(-i) = (S - s_i) / sqrt((Tx - tx_i) * (Ty - ty_i))``. Deleting cluster g subtracts the
    cluster's partner counts and adds back its within-cluster pairs (subtracted twice).

    Parameters
    ----------
    x, y : array-like, shape (n,)
    clusters : array-like, shape (n,), optional
        Cluster of each observation; replicates then delete one cluster at a time.

    Returns
    -------
    tau : float
    loo : ndarray, shape (n_clusters,)
        Tau-b without each observation (cluster); NaN where the remainder is constant.
    """
    xa, ya = _check_pair(x, y)
    _constant_error(xa, ya)
    codes = cluster_codes(clusters, xa.shape[0])
    cb = None if codes is None else np.ascontiguousarray(codes, dtype=np.int64).tobytes()
    # the size limits are part of the key: a result is reused only under the same algorithm
    compute = _leave_one_out_cached if xa.shape[0] <= _CACHE_MAX_N else _leave_one_out_cached.__wrapped__
    tau, loo = compute(xa.tobytes(), ya.tobytes(), cb, (_MAX_TABLE_CELLS, _BLOCK, _MAX_WITHIN_CELLS))
    return tau, loo.copy()


#: Largest sample whose leave-one-out results are cached (the cache holds at most 64 of them).
_CACHE_MAX_N = 10_000


@functools.lru_cache(maxsize=64)
def _leave_one_out_cached(x_bytes: bytes, y_bytes: bytes, codes_bytes: bytes | None,
                          limits: tuple[int, int, int]) -> tuple[float, np.ndarray]:
    """`tau_b_leave_one_out` on checked arrays, cached by their bytes (and the size ``limits``).

    A monitor's looks recompute the same pairs of scorings (reference and replicate, the stored
    recent looks, both windows of the rank metric); the cache returns the identical result.
    """
    xa = np.frombuffer(x_bytes, dtype=float)
    ya = np.frombuffer(y_bytes, dtype=float)
    codes = None if codes_bytes is None else np.frombuffer(codes_bytes, dtype=np.int64)
    pc = pair_counts(xa, ya)
    S, Tx, Ty = pc.S, pc.Tx, pc.Ty
    tau = _tau_from(S, Tx, Ty)
    if codes is None:
        s_g, tx_g, ty_g = pc.s, pc.tx, pc.ty
        w_s = w_x = w_y = 0
    else:
        G = int(codes.max()) + 1
        s_g = np.bincount(codes, weights=pc.s, minlength=G)
        tx_g = np.bincount(codes, weights=pc.tx, minlength=G)
        ty_g = np.bincount(codes, weights=pc.ty, minlength=G)
        w_s, w_x, w_y = _within_cluster_counts(xa, ya, codes, G)
    num = S - s_g + w_s
    dx = Tx - tx_g + w_x
    dy = Ty - ty_g + w_y
    with np.errstate(invalid="ignore", divide="ignore"):
        loo = np.where((dx > 0) & (dy > 0), num / np.sqrt(np.maximum(dx, 0) * np.maximum(dy, 0)), np.nan)
    loo = loo.astype(float)
    loo.flags.writeable = False
    return tau, loo


def jackknife_se(loo: np.ndarray) -> float:
    """Jackknife standard error from leave-one-out (or leave-one-cluster-out) estimates.

    Parameters
    ----------
    loo : numpy.ndarray
        The G leave-one-out estimates.

    Returns
    -------
    float
        ``sqrt((G - 1) / G * sum((loo - mean)^2))``; NaN when any estimate is NaN.
    """
    if np.any(np.isnan(loo)):
        return float("nan")
    G = loo.shape[0]
    return float(math.sqrt((G - 1) / G * float(np.sum((loo - loo.mean()) ** 2))))


def tau_b_influence(x: Any, y: Any) -> tuple[float, np.ndarray]:
    """Tau-b and its estimated influence function values (one per observation).

    Tau-b is ``U_s / sqrt(U_x * U_y)`` with three U-statistics of order 2 (kernels
    ``sign(dx) sign(dy)``, ``[dx != 0]``, ``[dy != 0]``). A U-statistic's influence is
    ``2 * (h1(Z_i) - U)`` with ``h1`` estimated by ``s_i / (n - 1)``; the delta method gives::

        IF_i = 2 * [ (s_i/(n-1) - U_s) / sqrt(U_x U_y)
                     - tau/2 * ((tx_i/(n-1) - U_x) / U_x + (ty_i/(n-1) - U_y) / U_y) ]

    and ``Var(tau_b) ~= sum_i IF_i**2 / n**2`` (clustered: sum IF within clusters first).
    """
    xa, ya = _check_pair(x, y)
    _constant_error(xa, ya)
    n = xa.shape[0]
    pc = pair_counts(xa, ya)
    pairs = n * (n - 1) / 2.0
    Us, Ux, Uy = pc.S / pairs, pc.Tx / pairs, pc.Ty / pairs
    tau = _tau_from(pc.S, pc.Tx, pc.Ty)
    hs = pc.s / (n - 1)
    hx = pc.tx / (n - 1)
    hy = pc.ty / (n - 1)
    infl = 2.0 * ((hs - Us) / math.sqrt(Ux * Uy) - tau / 2.0 * ((hx - Ux) / Ux + (hy - Uy) / Uy))
    return tau, infl


@dataclass(frozen=True)
class TauResult:
    """Kendall's tau-b with a standard error and a confidence interval.

    Attributes
    ----------
    tau : float
    se : float
    ci : (lo, hi)
        ``tau -/+ t_{G-1, 1-alpha/2} * se`` clipped to [-1, 1] (G = clusters, or n).
    n : int
    n_clusters : int
    se_method : {"jackknife", "influence"}
    alpha : float
    """

    tau: float
    se: float
    ci: tuple[float, float]
    n: int
    n_clusters: int
    se_method: str
    alpha: float

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON form (non-finite numbers as null)."""
        return jsonable(
            {
                "tau": self.tau,
                "se": self.se,
                "ci": list(self.ci),
                "n": self.n,
                "n_clusters": self.n_clusters,
                "se_method": self.se_method,
                "alpha": self.alpha,
            }
        )


def kendall_tau_b(
    x: Any,
    y: Any,
    *,
    alpha: float = 0.05,
    se_method: str = "jackknife",
    clusters: Any = None,
) -> TauResult:
    """Exact Kendall's tau-b (ties allowed) with a confidence interval.

    ``tau_b = (C - D) / sqrt((n0 - n1) (n0 - n2))`` with C, D the concordant and discordant
    pairs, ``n0 = n(n-1)/2`` and n1, n2 the pairs tied in x, in y. Equals
    ``scipy.stats.kendalltau(x, y).statistic``.

    Parameters
    ----------
    x, y : array-like of float, shape (n,)
    alpha : float
        CI level is ``1 - alpha``.
    se_method : {"jackknife", "influence"}
        ``"jackknife"``: delete-one (delete-one-cluster) jackknife, exact in O(n) (default).
        ``"influence"``: delta-method influence function of the three U-statistics.
        Both are valid with ties; see ``docs/drift.md``.
    clusters : array-like, shape (n,), optional
        Cluster (e.g. prompt) of each pair; the SE then treats clusters as the independent units.
    """
    check_alpha(alpha)
    if se_method not in ("jackknife", "influence"):
        raise CJEInputError(f"se_method must be 'jackknife' or 'influence', got {se_method!r}")
    xa, ya = _check_pair(x, y)
    codes = cluster_codes(clusters, xa.shape[0])
    if se_method == "jackknife":
        tau, loo = tau_b_leave_one_out(xa, ya, clusters=codes)
        se = jackknife_se(loo)
        G = loo.shape[0]
    else:
        tau, infl = tau_b_influence(xa, ya)
        n = xa.shape[0]
        if codes is not None:
            G = int(codes.max()) + 1
            infl_g = np.bincount(codes, weights=infl, minlength=G)
            se = float(math.sqrt(G / max(G - 1, 1) * np.sum(infl_g**2)) / n)
        else:
            G = n
            se = float(math.sqrt(np.sum(infl**2)) / n)
    return tau_result(tau, se, int(xa.shape[0]), int(G), se_method, alpha)


def tau_result(tau: float, se: float, n: int, G: int, se_method: str, alpha: float) -> TauResult:
    """A `TauResult` with its t interval (``G - 1`` degrees of freedom), clipped to [-1, 1].

    Parameters
    ----------
    tau, se : float
        The estimate and its standard error (a non-finite SE gives a NaN interval).
    n, G : int
        Observations and clusters.
    se_method : str
        How ``se`` was computed.
    alpha : float
        One minus the interval's level.

    Returns
    -------
    TauResult
    """
    crit = t_isf(alpha / 2, max(G - 1, 1))
    if np.isfinite(se):
        lo, hi = max(-1.0, tau - crit * se), min(1.0, tau + crit * se)
    else:
        lo = hi = float("nan")
    return TauResult(tau=tau, se=se, ci=(lo, hi), n=n, n_clusters=G, se_method=se_method, alpha=alpha)


