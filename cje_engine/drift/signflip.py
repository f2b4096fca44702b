"""Sign-flip (exchange) tests for paired drift metrics, valid with clusters and in the far tails.

Under no drift the reference and the current scoring of a cluster (a prompt's anchors, or one
anchor) are exchangeable, independently across clusters. Exchanging them flips the sign of the
cluster's sum ``s_g`` of any antisymmetric per-anchor difference (score difference, residual
difference, loss difference, threshold indicator difference). So, given ``|s_g|``, the observed
``S = sum_g s_g`` is distributed as ``sum_g eps_g |s_g|`` with independent random signs: a
conditional test that needs no variance estimate and no normal approximation.

The two-sided p-value ``P(|sum eps_g |s_g|| >= |S|)`` is computed

1. exactly by convolution when the ``|s_g|`` lie on a lattice ``h * integers`` with at most
   `LATTICE_MAX_STEPS` steps in total (integer scores, indicator counts);
2. exactly by enumeration when at most `EXACT_MAX_CLUSTERS` clusters have ``s_g != 0``;
3. otherwise by the Gaussian bound of Bentkus and Dzindzalieta (2015, Bernoulli 21(2)): for
   weights with ``sum a_g^2 = 1``, ``P(sum eps_g a_g >= x) <= c (1 - Phi(x))`` with
   ``c = 1 / (4 (1 - Phi(sqrt 2))) ~= 3.178``; the p-value ``min(1, 2 c (1 - Phi(T)))`` with
   ``T = |S| / sqrt(sum s_g^2)`` is valid for any number of clusters (conservative by at most
   the factor c against a normal tail).
"""
from __future__ import annotations

import functools
import itertools
import math
from collections import Counter

import numpy as np
from scipy import special

#: Clusters with a non-zero sum up to which the sign-flip distribution is enumerated.
EXACT_MAX_CLUSTERS = 16
#: Largest lattice (sum of |s_g| / h) for the exact convolution.
LATTICE_MAX_STEPS = 200_000
#: Constant of the Bentkus-Dzindzalieta Gaussian bound for weighted Rademacher sums.
BD_CONSTANT = 1.0 / (4.0 * 0.5 * special.erfc(1.0))  # 1 - Phi(sqrt 2) = erfc(1) / 2
_REL_TOL = 1e-9


def _norm_sf(x: float) -> float:
    return float(0.5 * special.erfc(x / math.sqrt(2.0)))


def _lattice_step(a: np.ndarray) -> float | None:
    """Common step h with every ``a / h`` an integer (to a relative 1e-9), or None."""
    scale = float(a.max())
    if scale < 1e6 and np.all(a == np.rint(a)):
        # whole numbers (indicator counts): Euclid's float steps are exact and reach their gcd
        h = float(np.gcd.reduce(a.astype(np.int64)))
        return None if scale / h > LATTICE_MAX_STEPS else h
    tol = _REL_TOL * scale
    h = float(a[0])
    for v in a[1:]:
        x, y = max(h, float(v)), min(h, float(v))
        while y > tol:  # Euclid; a float remainder near y is handled by the next step
            x, y = y, math.fmod(x, y)
        h = x
        if h <= tol or scale / h > LATTICE_MAX_STEPS:
            return None
    return h


def _exact_enumeration(a: np.ndarray, observed: float) -> float:
    G = a.shape[0]
    signs = np.array(list(itertools.product((-1.0, 1.0), repeat=G)))
    sums = np.abs(signs @ a)
    return float(np.mean(sums >= observed - _REL_TOL * max(observed, float(a.max()))))


#: Most clusters for which the lattice probabilities are computed as integer counts: every
#: probability is then ``count / 2**G`` with ``count < 2**53``, exact in floating point.
_EXACT_COUNT_CLUSTERS = 52
#: Largest dense convolution (cells) done in one call; larger ones add shifted copies.
_MAX_CONVOLVE_CELLS = 4_000_000


def _lattice_counts(k: np.ndarray) -> np.ndarray:
    """Integer counts of ``sum_g eps_g k_g = -K .. K`` over the ``2**G`` sign vectors (``K = sum k``).

    Equal weights are taken together: ``m`` clusters of weight ``v`` contribute the polynomial
    ``(x^-v + x^v)^m``, whose coefficients are binomial. Exact for ``G <= 62`` (int64). The
    counts depend on the multiset of weights only, so they are cached by it (read-only array).
    """
    weights = tuple(sorted(Counter(k.astype(np.int64).tolist()).items()))
    return (_multiset_counts if k.sum() <= _CACHE_MAX_STEPS else _multiset_counts.__wrapped__)(weights)


#: Largest lattice (``sum k``) whose counts are cached (at most 512 arrays of <= 2001 counts).
_CACHE_MAX_STEPS = 1000


@functools.lru_cache(maxsize=512)
def _multiset_counts(weights: tuple[tuple[int, int], ...]) -> np.ndarray:
    """`_lattice_counts` of the weights ``(value, multiplicity)`` in increasing value."""
    counts = np.ones(1, dtype=np.int64)
    for v, m in weights:
        binom = np.array([math.comb(m, j) for j in range(m + 1)], dtype=np.int64)
        width = 2 * v * m + 1
        if width * counts.shape[0] <= _MAX_CONVOLVE_CELLS:
            poly = np.zeros(width, dtype=np.int64)
            poly[:: max(2 * v, 1)] = binom if v > 0 else binom.sum()
            counts = np.convolve(counts, poly)
        else:
            new = np.zeros(counts.shape[0] + width - 1, dtype=np.int64)
            for j, c in enumerate(binom.tolist()):
                new[2 * v * j: 2 * v * j + counts.shape[0]] += c * counts
            counts = new
    counts.flags.writeable = False
    return counts


def _exact_lattice(k: np.ndarray, observed_steps: int) -> float:
    """Exact ``P(|sum_g eps_g k_g| >= observed_steps)`` for integer weights ``k_g``.

    Up to `_EXACT_COUNT_CLUSTERS` clusters from integer counts (`_lattice_counts`); every
    intermediate of the floating-point convolution below is then exact too, so both give the
    same number. More clusters: the convolution, kept on the support reached so far.
    """
    total = int(k.sum())
    values = np.abs(np.arange(-total, total + 1))
    if k.shape[0] <= _EXACT_COUNT_CLUSTERS:
        counts = _lattice_counts(k)
        return float(min(1.0, int(counts[values >= observed_steps].sum()) / 2.0 ** k.shape[0]))
    dist = np.ones(1)
    for v in k:
        v = int(v)
        new = np.zeros(dist.shape[0] + 2 * v)
        new[2 * v:] += 0.5 * dist
        new[: dist.shape[0]] += 0.5 * dist
        dist = new
    return float(min(1.0, dist[values >= observed_steps].sum()))


def sign_flip_p(cluster_sums: np.ndarray) -> tuple[float, str]:
    """Two-sided sign-flip p-value of ``sum(cluster_sums)`` and the method used.

    Parameters
    ----------
    cluster_sums : ndarray, shape (G,)
        Sum of the antisymmetric per-anchor differences within each cluster.

    Returns
    -------
    p : float
        ``P(|sum_g eps_g s_g| >= |sum_g s_g|)`` (exact), or the Bentkus-Dzindzalieta bound.
    method : {"none", "exact", "lattice", "gaussian_bound"}
    """
    s = np.asarray(cluster_sums, dtype=float)
    a = np.abs(s[s != 0])
    observed = abs(float(s.sum()))
    if a.shape[0] == 0:
        return 1.0, "none"
    h = _lattice_step(a)
    if h is not None:
        k = np.rint(a / h)
        return _exact_lattice(k, int(np.rint(observed / h))), "lattice"
    if a.shape[0] <= EXACT_MAX_CLUSTERS:
        return _exact_enumeration(a, observed), "exact"
    return sign_flip_bound_p(s), "gaussian_bound"


def sign_flip_bound_p(cluster_sums: np.ndarray) -> float:
    """The Bentkus-Dzindzalieta bound ``min(1, 2 c (1 - Phi(|S| / sqrt(sum s_g^2))))``."""
    s = np.asarray(cluster_sums, dtype=float)
    ss = float(np.sum(s**2))
    if ss == 0:
        return 1.0
    T = abs(float(s.sum())) / math.sqrt(ss)
    return float(min(1.0, 2.0 * BD_CONSTANT * _norm_sf(T)))


def bound_critical_value(alpha: float) -> float:
    """``x`` with ``2 c (1 - Phi(x)) = alpha``: the bound test rejects when ``T >= x``."""
    tail = alpha / (2.0 * BD_CONSTANT)
    if tail >= 0.5:
        return 0.0
    return float(-special.ndtri(tail))


def sign_flip_interval(
    d: np.ndarray, codes: np.ndarray | None, alpha: float
) -> tuple[float, float]:
    """Interval for the mean shift ``mu`` of paired differences: the bound test inverted.

    ``mu`` is in the interval when the bound test of ``d - mu`` does not reject at ``alpha``:
    ``|A - mu n| < x sqrt(C - 2 mu D + mu^2 E)`` with ``A = sum s_g``, ``C = sum s_g^2``,
    ``D = sum s_g n_g``, ``E = sum n_g^2`` (s_g cluster sums, n_g cluster sizes). A quadratic
    inequality in ``mu``; unbounded when ``n^2 / E <= x^2`` (too few effective clusters).
    """
    d = np.asarray(d, dtype=float)
    if codes is None:
        s, m = d, np.ones_like(d)
    else:
        G = int(codes.max()) + 1
        s = np.bincount(codes, weights=d, minlength=G)
        m = np.bincount(codes, minlength=G).astype(float)
    x = bound_critical_value(alpha)
    A, N, C, D, E = float(s.sum()), float(m.sum()), float(s @ s), float(s @ m), float(m @ m)
    a2 = N * N - x * x * E
    a1 = -2.0 * A * N + 2.0 * x * x * D
    a0 = A * A - x * x * C
    if a2 <= 0:
        return (-math.inf, math.inf)
    disc = a1 * a1 - 4.0 * a2 * a0
    if disc < 0:  # every mu rejected cannot happen (mu = mean gives A - mu N = 0); guard rounding
        mid = -a1 / (2 * a2)
        return (mid, mid)
    r = math.sqrt(disc)
    return ((-a1 - r) / (2 * a2), (-a1 + r) / (2 * a2))
