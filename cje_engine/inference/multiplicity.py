"""P-value adjustments for families of tests."""
from __future__ import annotations

import numpy as np


def holm(p: np.ndarray) -> np.ndarray:
    """Holm step-down adjusted p-values (family-wise error control)."""
    p = np.asarray(p, dtype=float)
    m = p.size
    if m == 0:
        return p
    order = np.argsort(p, kind="stable")
    adj = np.maximum.accumulate((m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.minimum(adj, 1.0)
    return out


def bonferroni(p: np.ndarray) -> np.ndarray:
    """Bonferroni-adjusted p-values (family-wise error control), capped at 1."""
    p = np.asarray(p, dtype=float)
    return np.minimum(p * p.size, 1.0)


def benjamini_hochberg(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg step-up adjusted p-values (false discovery rate control)."""
    p = np.asarray(p, dtype=float)
    m = p.size
    if m == 0:
        return p
    order = np.argsort(p, kind="stable")
    ranked = p[order] * m / np.arange(1, m + 1)
    adj = np.minimum.accumulate(ranked[::-1])[::-1]
    out = np.empty(m)
    out[order] = np.minimum(adj, 1.0)
    return out


def adjust(p: np.ndarray, method: str) -> np.ndarray:
    """Adjust ``p`` with ``method`` in {'bh', 'holm', 'bonferroni'}."""
    if method == "bh":
        return benjamini_hochberg(p)
    if method == "holm":
        return holm(p)
    if method == "bonferroni":
        return bonferroni(p)
    raise ValueError(f"unknown multiplicity method {method!r}")
