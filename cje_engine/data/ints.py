"""Sort-based ``numpy.unique`` of integer arrays.

numpy 2.4's `numpy.unique` of integers is hash-based and takes ~1 s a million int64 values; a sort and a
comparison of neighbours take ~0.1 s. The results are `numpy.unique`'s exactly (sorted distinct values, and
with `unique_inverse` each element's index among them).
"""
from __future__ import annotations

import numpy as np


def unique_ints(values: np.ndarray) -> np.ndarray:
    """``numpy.unique(values)`` of an integer array, by a sort."""
    values = np.asarray(values).reshape(-1)
    if values.size == 0:
        return values.copy()
    s = np.sort(values)
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``numpy.unique(values, return_inverse=True)`` of an integer array, by a sort (inverse as int64)."""
    values = np.asarray(values).reshape(-1)
    order = np.argsort(values, kind="stable")
    s = values[order]
    new = np.empty(s.size, dtype=bool)
    new[:1] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    inv = np.empty(s.size, dtype=np.int64)
    inv[order] = np.cumsum(new) - 1
    return s[new], inv


def small_unique_inverse(values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``numpy.unique(values, return_inverse=True)`` of an integer array whose values lie in ``[0, n)``, by
    counting instead of sorting (O(values + n), no sort: for codes of a small table, such as the calibration
    cells of millions of labelled rows). The same arrays as `numpy.unique`: the distinct values sorted, in the
    dtype of ``values``, and each element's index among them (intp). Falls back to `numpy.unique` when ``n`` is
    larger than the values (the sort is then the cheaper)."""
    values = np.asarray(values).reshape(-1)
    if n > max(values.size, 1 << 16) or values.size == 0:
        return np.unique(values, return_inverse=True)
    present = np.bincount(values, minlength=n) > 0  # raises on a negative value
    if present.size > n:
        raise ValueError(f"a value {present.size - 1} outside [0, {n})")
    rank = np.cumsum(present, dtype=np.intp)
    rank -= 1
    return np.flatnonzero(present).astype(values.dtype, copy=False), rank[values]


def present_codes(values: np.ndarray, n: int) -> np.ndarray:
    """``numpy.unique(values)`` of integer codes in ``[0, n)`` with ``n`` small (policies, cells): by counting, no
    sort or hash (the distinct codes sorted, int64)."""
    values = np.asarray(values).reshape(-1)
    return np.flatnonzero(np.bincount(values, minlength=n) > 0)


def count_distinct(values: np.ndarray, n: int) -> int:
    """``numpy.unique(values).size`` of integer codes in ``[0, n)`` (e.g. prompt codes): a one-byte mark per code
    when ``n`` is at most 64 per value, else `unique_ints`' sort."""
    values = np.asarray(values).reshape(-1)
    if values.size == 0:
        return 0
    if n > 64 * values.size:
        return int(unique_ints(values).size)
    seen = np.zeros(n, dtype=bool)
    seen[values] = True
    return int(np.count_nonzero(seen))


def at_rows(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``a[rows]`` for sorted distinct row indices ``rows``; ``a`` itself (for reading only) when they are every
    row. The sharded driver's data holds the labelled rows only, so its labelled rows, and in the first round of
    robust pooling its calibration rows, are all of them: no copy (a 5M-row gather is 40 MB of fresh pages)."""
    n = a.shape[0]
    if rows.size == n and (n == 0 or (rows[0] == 0 and rows[-1] == n - 1)):
        return a
    return a[rows]
