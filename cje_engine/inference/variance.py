"""Prompt-clustered variance: the one place every estimator gets its standard errors from.

Every statistic in the engine is a mean over rows whose errors are correlated within a prompt
(several policies, logged responses, fresh draws and labels can share a prompt). Its influence
terms are summed per prompt (`cluster_sums`) and the covariance of the statistics is
``G/(G-1) * sum_c psi_c psi_c'`` over the G prompts (`cluster_cov`).
"""
from __future__ import annotations

import numpy as np

from cje_engine.inference.gram import GramTerms


def cluster_sums(values: np.ndarray, clusters: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum ``values`` (one per row) within each distinct cluster label.

    Returns
    -------
    labels : ndarray, shape (G,)
        Sorted distinct cluster labels.
    psi : ndarray, shape (G,) or (G, K)
        Per-cluster sums (``values`` may be 1-d or rows x K).
    """
    labels, inv = np.unique(np.asarray(clusters), return_inverse=True)
    vals = np.asarray(values, dtype=float)
    if vals.ndim == 1:
        return labels, np.bincount(inv, weights=vals, minlength=labels.shape[0])
    psi = np.zeros((labels.shape[0], vals.shape[1]))
    np.add.at(psi, inv, vals)
    return labels, psi


def cluster_cov(psi: np.ndarray, *, center: bool = True) -> np.ndarray:
    """Covariance of statistics from their per-cluster influence sums, with the G/(G-1) correction.

    Parameters
    ----------
    psi : ndarray, shape (G,) or (G, K)
        Cluster ``c``'s contribution to each statistic's error (NaN counts as 0: a statistic
        that does not exist contributes nothing).
    center : bool
        Subtract the column means first (they are 0 for exact influence functions; centring
        guards against rounding and against contributions that are only centred overall).
    """
    if isinstance(psi, GramTerms):  # the sharded path's Gram form: from the moments
        return psi.cluster_cov(center=center)
    c = np.array(psi, dtype=float)  # a copy: centred in place below
    if not np.isfinite(c).all():  # (one scan instead of nan_to_num's three when all are finite)
        np.nan_to_num(c, copy=False)
    if c.ndim == 1:
        c = c[:, None]
    g = c.shape[0]
    if center:
        c -= c.mean(axis=0)  # in place: no second G x K array (the finalize peak at 10M rows)
    return (c.T @ c) * g / max(g - 1, 1)


def cluster_cov_padded(psi: np.ndarray, n_clusters: int) -> np.ndarray:
    """`cluster_cov` (centred) of ``psi`` stacked over ``n_clusters - len(psi)`` more clusters whose sums are 0,
    without building them: ``(sum_c psi_c psi_c' - s s' / G) G / (G - 1)`` with ``s`` the column sums and
    ``G = n_clusters`` (the same matrix up to rounding; the omnibus tests of one policy's labels among every
    labelled prompt's clusters).

    Parameters
    ----------
    psi : ndarray, shape (L,) or (L, K)
        The per-cluster sums of the clusters that hold any (NaN counts as 0).
    n_clusters : int
        Every cluster, ``L`` of them in ``psi`` (at least ``L``).
    """
    c = np.nan_to_num(np.asarray(psi, dtype=float))
    if c.ndim == 1:
        c = c[:, None]
    g = max(int(n_clusters), c.shape[0])
    s = c.sum(axis=0)
    return (c.T @ c - np.outer(s, s) / max(g, 1)) * g / max(g - 1, 1)


def cluster_var(psi: np.ndarray) -> np.ndarray:
    """The diagonal of `cluster_cov` (centred): each column's variance, without the off-diagonal products.

    Parameters
    ----------
    psi : ndarray, shape (G, K), or GramTerms
        Per-cluster influence sums (NaN counts as 0), or the sharded path's Gram form.
    """
    if isinstance(psi, GramTerms):  # the Gram form: the diagonal of its moments' covariance
        return psi.column_var()
    c = np.array(psi, dtype=float)
    if not np.isfinite(c).all():
        np.nan_to_num(c, copy=False)
    if c.ndim == 1:
        c = c[:, None]
    g = c.shape[0]
    c -= c.mean(axis=0)
    return np.einsum("ij,ij->j", c, c) * g / max(g - 1, 1)


def clustered_se(psi: np.ndarray) -> float:
    """Standard error of one statistic from its per-cluster influence sums (uncentred)."""
    p = np.asarray(psi, dtype=float)
    g = p.shape[0]
    return float(np.sqrt((g / (g - 1) if g > 1 else 1.0) * np.sum(p * p)))


def cluster_covariance(columns: np.ndarray, clusters: np.ndarray) -> np.ndarray:
    """Covariance of the column means of ``columns`` (n x K), clustered by ``clusters``.

    ``Cov = G/(G-1) * sum_c psi_c psi_c'`` with ``psi_c = sum_{i in c} (phi_i - mean phi) / n``.
    """
    cols = np.asarray(columns, dtype=float)
    if cols.ndim == 1:
        cols = cols[:, None]
    n = cols.shape[0]
    _, psi = cluster_sums((cols - cols.mean(axis=0)) / n, clusters)
    return cluster_cov(psi, center=False)


def align_clusters(labels: np.ndarray, psi: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Place per-cluster sums ``psi`` (one per entry of ``labels``) on the clusters of ``index``
    (every cluster label of the evaluation, any order); clusters absent from ``labels`` get 0."""
    index = np.asarray(index).astype(str)
    order = np.argsort(index, kind="stable")
    labels = np.asarray(labels).astype(str)
    pos = np.searchsorted(index[order], labels)
    ok = pos < index.size
    if not ok.all() or np.any(index[order][pos] != labels):
        raise ValueError("cluster labels missing from the evaluation's prompt index")
    out = np.zeros(index.shape[0])
    np.add.at(out, order[pos], np.nan_to_num(np.asarray(psi, dtype=float)))
    return out
