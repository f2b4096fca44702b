"""Calibration part of the influence function of an off-policy estimate (the analytic route).

An off-policy estimate is, to first order in the calibrator ``f``, a weighted sum of calibrated
rewards ``theta = sum_i a_i f(z_i)`` over logged rows (and fresh draws): ``a_i = W~_i / n`` for
calibrated IPS, ``W_i / sum W`` for SNIPS, ``1 / m`` on the fresh draws for Direct and DR (DR's
logged residuals ``W (R - q)`` do not move with ``f`` to first order: both terms do). An isotonic
fit's error at a level set ``b`` is, to first order, the mean residual of the calibration rows
in ``b``, so the calibration term of calibration row ``j`` is ``rho(b_j) (y_j - f(z_j)) / m_cal``
with ``rho(b) = (sum of a_i over rows in b) / (share of calibration rows in b)``: Direct's
plug-in calibration term (`cje_engine.direct.estimators.influence`) with weights ``a`` in place
of ``1 / n_k``. Linear interpolation between level sets splits a row between its two blocks.
"""
from __future__ import annotations

import numpy as np

from cje_engine.direct.estimators import Design


def _level_sets(fy: np.ndarray) -> tuple[np.ndarray, int]:
    scale = max(1.0, float(np.max(np.abs(fy))))
    jumps = np.abs(np.diff(fy)) > 1e-12 * scale
    block = np.concatenate([[0], np.cumsum(jumps)])
    return block, int(block[-1]) + 1


def calibration_term(design: Design, full, rows: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Per-prompt calibration influence of ``theta = sum_i a_i f(z_i)`` over design ``rows``.

    Parameters
    ----------
    design : the evaluation's design (calibration rows, data)
    full : the calibrator fitted on all calibration rows (``x_``, ``y_``, ``index``)
    rows, a : design row indices and their weights (non-finite weights count as 0)

    Returns
    -------
    ndarray, shape (n_prompts,)
    """
    d = design.data
    cr = design.cal_rows
    a = np.nan_to_num(np.asarray(a, dtype=float), nan=0.0, posinf=0.0, neginf=0.0)
    block_of_x, n_blocks = _level_sets(full.y_)
    ux = full.x_
    z_cal = full.index(d.score[cr], d.X[cr])
    pos = np.clip(np.searchsorted(ux, z_cal), 0, ux.size - 1)
    b_cal = block_of_x[pos]
    m = cr.size
    q = np.bincount(b_cal, minlength=n_blocks) / m
    resid = d.label[cr] - np.interp(z_cal, ux, full.y_)
    z = full.index(d.score[rows], d.X[rows])
    j = np.clip(np.searchsorted(ux, z, side="right") - 1, 0, ux.size - 1)
    j1 = np.minimum(j + 1, ux.size - 1)
    gap = ux[j1] - ux[j]
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(gap > 0, np.clip((z - ux[j]) / gap, 0.0, 1.0), 0.0)
    p_a = (np.bincount(block_of_x[j], weights=a * (1 - t), minlength=n_blocks)
           + np.bincount(block_of_x[j1], weights=a * t, minlength=n_blocks))
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = np.where(q > 0, p_a / q, 0.0)
    return np.bincount(d.prompt[cr], weights=rho[b_cal] * resid / m, minlength=d.n_prompts)
