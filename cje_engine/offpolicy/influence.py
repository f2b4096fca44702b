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

The residuals stand in for the label noise ``y - E[y | z]``, but in-sample isotonic residuals are
shrunk: the fit is the projection onto block means, so each level set's residuals sum to zero and
a row of a block of ``k`` rows has leverage ``1 / k`` (a singleton's residual is exactly 0, however
much target weight sits on it). They are corrected as HC2 corrects least-squares residuals,
``r / sqrt(1 - 1/k)``, and a singleton block takes the row's cross-fitted (out-of-fold) residual
``y - f^(-k)(z)``, the prediction error of a fit that did not see it. Measured on 2,000 simulated
data sets (benchmarks/bench_offpolicy.py): the in-sample residuals made the analytic SE of the
reported levels 0.93-0.94 of the actual RMSE (coverage 0.928); corrected, 1.00-1.02 (0.948).
docs/statistics.md ("Off-policy coverage") has the numbers.
"""
from __future__ import annotations

import numpy as np

from cje_engine.direct.estimators import Design
from cje_engine.direct.estimators import calibration_term as direct_calibration_term


def calibration_term(design: Design, full, rows: np.ndarray, a: np.ndarray, f_cal: np.ndarray) -> np.ndarray:
    """Per-prompt calibration influence of ``theta = sum_i a_i f(z_i)`` over design ``rows``.

    Parameters
    ----------
    design : the evaluation's design (calibration rows, data)
    full : the calibrator fitted on all calibration rows (``x_``, ``y_``, ``index``)
    rows, a : design row indices and their weights (non-finite weights count as 0)
    f_cal : cross-fitted (out-of-fold) calibrated values of the calibration rows
        (``design.cal_rows`` order), used for the residuals of singleton level sets

    Returns
    -------
    ndarray, shape (n_prompts,): Direct's `cje_engine.direct.estimators.calibration_term` with the
    weights ``a`` summed per calibration cell.
    """
    a = np.nan_to_num(np.asarray(a, dtype=float), nan=0.0, posinf=0.0, neginf=0.0)
    share = np.bincount(design.cells.row_cell[rows], weights=a, minlength=design.cells.cells.size)
    return direct_calibration_term(design, full, share[None, :], f_cal)[:, 0]
