"""Weighted isotonic regression: the one implementation every part of the engine uses.

An isotonic fit of ``y`` on ``x`` with sample weights ``w`` depends on the data only through
the total weight and the weighted label sum at each distinct ``x`` (tied ``x`` share one
fitted value: the 'secondary' tie treatment). That is why the fit is split in two steps:

* `pool_ties` turns rows into those per-value sums (``np.unique`` + two ``np.bincount``);
* `isotonic_pooled` runs the pool-adjacent-violators algorithm on the sums
  (``scipy.optimize.isotonic_regression``).

Callers that already hold the sums (the bootstrap keeps them per fold and distinct score, so a
replicate never touches the rows again) call `isotonic_pooled` directly; everyone else calls
`isotonic_fit`. `isotonic_predict` evaluates a fit: linear between fitted points, flat
outside their range. PAVA is mean-preserving: ``sum(weights * values) == sum(w * y)``.
"""
from __future__ import annotations

import functools

import numpy as np


@functools.cache
def _pava_impl():
    """scipy's compiled PAVA without the argument checks of the public wrapper (~10 us a call; a bootstrap
    replicate runs six fits, so the wrapper's overhead would be a third of it), or None in other scipy layouts
    (the public function then). Imported at the first fit, not with this module: the sharded passes' Ray workers
    import it (through `cje_engine.calibration.calibrators`) without fitting, and scipy.optimize costs a fresh
    worker ~0.2-0.3 s of CPU."""
    try:
        from scipy.optimize._pava_pybind import pava
    except ImportError:  # pragma: no cover - other scipy layouts: use the public function
        return None
    return pava


__all__ = ["pool_ties", "isotonic_pooled", "isotonic_pooled_segments", "isotonic_fit", "isotonic_predict"]


def pool_ties(x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct ``x`` (sorted): the total weight and the weighted sum of ``y``.

    Rows with non-positive weight are dropped first, so every returned value has weight > 0.

    Returns
    -------
    ux, sw, swy : ndarray
        Distinct ``x`` values, total weight and weighted ``y`` sum at each.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if w is None:
        w = np.ones_like(y)
    else:
        w = np.asarray(w, dtype=float)
        keep = w > 0
        if not keep.all():
            x, y, w = x[keep], y[keep], w[keep]
    ux, inv = np.unique(x, return_inverse=True)
    sw = np.bincount(inv, weights=w, minlength=ux.size)
    swy = np.bincount(inv, weights=w * y, minlength=ux.size)
    return ux, sw, swy


def isotonic_pooled(sw: np.ndarray, swy: np.ndarray, *, increasing: bool = True) -> np.ndarray:
    """PAVA on tie-pooled sums: the fitted value at each (already sorted, distinct) point.

    ``sw`` must be positive everywhere (drop empty points before calling).
    """
    if sw.size == 0:
        raise ValueError("isotonic fit needs at least one point with positive weight")
    means = swy / sw
    if sw.size == 1:
        return means
    _pava = _pava_impl()
    if _pava is None or not increasing:
        # imported here: the fit's, not the passes' workers' (`cje_engine.calibration.calibrators` imports this module)
        from scipy.optimize import isotonic_regression

        return isotonic_regression(means, weights=sw, increasing=increasing).x
    # pava works in place on (values, weights, block starts); values become the fitted values.
    x, _, _, _ = _pava(means, np.array(sw, dtype=np.float64), np.full(sw.size + 1, -1, dtype=np.intp))
    return x


def isotonic_pooled_segments(sw: np.ndarray, swy: np.ndarray, bounds: list[tuple[int, int]]) -> list[np.ndarray]:
    """`isotonic_pooled` on each segment ``[a, b)`` of one pair of sum arrays (one fit per segment).

    For many small fits at once (a cross-fit's six stage-2 fits): one division and one copy
    for all segments, then one PAVA call per segment. Same values as `isotonic_pooled`.
    """
    _pava = _pava_impl()
    if _pava is None:  # pragma: no cover - other scipy layouts
        return [isotonic_pooled(sw[a:b], swy[a:b]) for a, b in bounds]
    with np.errstate(invalid="ignore", divide="ignore"):  # entries outside the segments may be 0 / 0
        means = swy / sw
    wts = np.array(sw, dtype=np.float64)  # pava overwrites its weights
    blocks = np.full(sw.size + len(bounds), -1, dtype=np.intp)
    out = []
    for i, (a, b) in enumerate(bounds):
        if b <= a:
            raise ValueError("isotonic fit needs at least one point with positive weight")
        if b - a == 1:
            out.append(means[a:b])
            continue
        x, _, _, _ = _pava(means[a:b], wts[a:b], blocks[a + i:b + i + 1])
        out.append(x)
    return out


def isotonic_fit(x: np.ndarray, y: np.ndarray, sample_weight: np.ndarray | None = None, *,
                 increasing: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted least-squares isotonic regression of ``y`` on ``x`` (ties pooled first).

    Parameters
    ----------
    x, y : array_like, shape (n,)
    sample_weight : array_like, shape (n,), optional
        Non-negative weights (rows with weight 0 are ignored). Default: all ones.
    increasing : bool
        Non-decreasing (default) or non-increasing fit.

    Returns
    -------
    knots : ndarray
        Sorted distinct ``x`` with positive weight.
    values : ndarray
        Fitted value at each knot (monotone).
    weights : ndarray
        Total weight at each knot.

    Raises
    ------
    ValueError
        When no row has positive weight.
    """
    ux, sw, swy = pool_ties(x, y, sample_weight)
    return ux, isotonic_pooled(sw, swy, increasing=increasing), sw


def isotonic_predict(knots: np.ndarray, values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Evaluate a fitted isotonic curve at ``x``: linear between knots, flat outside their range."""
    return np.interp(np.asarray(x, dtype=float), knots, values)
