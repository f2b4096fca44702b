"""Judge-to-oracle calibrators (AutoCal-R): monotone isotonic and two-stage.

Both follow scikit-learn conventions: configuration in the constructor, ``fit`` returns
``self``, fitted state in attributes ending with ``_``. Both are non-decreasing in the
judge score for fixed covariates *by construction*, and both are flat outside the range
of the scores they were fitted on (out of range = limited calibration support).
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import isotonic_regression, nnls

from cje_engine.errors import CJEInputError

MODES = ("monotone", "two_stage")


def _pava(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted isotonic regression of ``y`` on ``x`` after pooling tied ``x``.

    Returns the sorted distinct x with positive weight, the fitted values there, and the
    pooled weights. Ties in ``x`` are pooled first (a weighted mean), which is the
    'secondary' tie treatment: tied scores always get one fitted value.
    """
    keep = w > 0
    x, y, w = x[keep], y[keep], w[keep]
    if x.size == 0:
        raise ValueError("isotonic fit needs at least one row with positive weight")
    ux, inv = np.unique(x, return_inverse=True)
    sw = np.bincount(inv, weights=w, minlength=ux.size)
    swy = np.bincount(inv, weights=w * y, minlength=ux.size)
    fitted = isotonic_regression(swy / sw, weights=sw, increasing=True).x
    return ux, fitted, sw


class IsotonicCalibrator:
    """Monotone calibration: isotonic regression of the oracle label on the judge score.

    Parameters
    ----------
    clip : tuple of float, optional
        Bounds (the label scale) applied to predictions; isotonic fits already stay
        inside the range of the labels, so this only guards rounding.

    Attributes
    ----------
    x_ : ndarray
        Distinct fitted judge scores (sorted).
    y_ : ndarray
        Fitted calibrated value at each ``x_`` (non-decreasing). Between two fitted
        scores predictions are linearly interpolated; outside the fitted range they are
        flat (the boundary value).
    weights_ : ndarray
        Total sample weight at each ``x_``.
    """

    mode = "monotone"

    def __init__(self, clip: tuple[float, float] | None = None) -> None:
        self.clip = clip

    def fit(self, score: np.ndarray, y: np.ndarray, X: np.ndarray | None = None,
            sample_weight: np.ndarray | None = None) -> "IsotonicCalibrator":
        score = np.asarray(score, dtype=float)
        w = np.ones_like(score) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        self.x_, self.y_, self.weights_ = _pava(score, np.asarray(y, dtype=float), w)
        return self

    def index(self, score: np.ndarray, X: np.ndarray | None = None) -> np.ndarray:
        """The one-dimensional index the isotonic stage works on (here the score itself)."""
        return np.asarray(score, dtype=float)

    def predict(self, score: np.ndarray, X: np.ndarray | None = None) -> np.ndarray:
        out = np.interp(self.index(score, X), self.x_, self.y_)
        return out if self.clip is None else np.clip(out, *self.clip)


def _ramp_basis(s: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Monotone ramp basis: column j rises linearly from 0 to 1 between knots j and j+1.

    Any non-negative combination is a non-decreasing piecewise-linear function of ``s``,
    flat outside [knots[0], knots[-1]].
    """
    lo, hi = knots[:-1], knots[1:]
    return np.clip((s[:, None] - lo[None, :]) / (hi - lo)[None, :], 0.0, 1.0)


def _signed_log(X: np.ndarray) -> np.ndarray:
    return np.sign(X) * np.log1p(np.abs(X))


class TwoStageCalibrator:
    """Two-stage calibration: a smooth monotone index of score and covariates, then isotonic.

    Stage 1 fits ``Z = h(S) + X @ beta`` by non-negative least squares, where ``h`` is a
    non-decreasing piecewise-linear function of the judge score (ramp basis with knots at
    score quantiles, non-negative coefficients) and ``beta`` is free. Stage 2 is isotonic
    regression of the label on ``Z``. Because ``h`` is non-decreasing and stage 2 is
    isotonic, the calibrated value is non-decreasing in the judge score for any fixed
    covariates (the property the reference's spline index can violate).

    Parameters
    ----------
    n_knots : int
        Number of ramp segments of ``h`` (knots at quantiles of the training scores).
    log_covariates : bool
        Apply ``sign(x) * log1p(|x|)`` to covariates (lengths are heavy-tailed).
    clip : tuple of float, optional
        Bounds for predictions.
    """

    mode = "two_stage"

    def __init__(self, n_knots: int = 6, log_covariates: bool = True,
                 clip: tuple[float, float] | None = None) -> None:
        self.n_knots = n_knots
        self.log_covariates = log_covariates
        self.clip = clip

    def _features(self, score: np.ndarray, X: np.ndarray) -> np.ndarray:
        Xt = _signed_log(X) if self.log_covariates else X
        Xs = (Xt - self.x_mean_) / self.x_scale_
        return np.hstack([_ramp_basis(score, self.knots_), Xs])

    def fit(self, score: np.ndarray, y: np.ndarray, X: np.ndarray | None = None,
            sample_weight: np.ndarray | None = None) -> "TwoStageCalibrator":
        score = np.asarray(score, dtype=float)
        y = np.asarray(y, dtype=float)
        X = np.empty((score.size, 0)) if X is None else np.asarray(X, dtype=float)
        w = np.ones_like(score) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        keep = w > 0
        s, yk, Xk, wk = score[keep], y[keep], X[keep], w[keep]
        knots = np.unique(np.quantile(s, np.linspace(0, 1, self.n_knots + 1)))
        if knots.size < 2:
            knots = np.array([s.min() - 0.5, s.min() + 0.5])
        self.knots_ = knots
        Xt = _signed_log(Xk) if self.log_covariates else Xk
        wsum = wk.sum()
        self.x_mean_ = (wk[:, None] * Xt).sum(0) / wsum if Xt.shape[1] else np.zeros(0)
        sd = np.sqrt((wk[:, None] * (Xt - self.x_mean_) ** 2).sum(0) / wsum) if Xt.shape[1] else np.zeros(0)
        self.x_scale_ = np.where(sd > 0, sd, 1.0)
        F = self._features(s, Xk)
        n_ramp = knots.size - 1
        # NNLS with sign-free intercept and covariates: split them into +/- columns.
        A = np.hstack([F[:, :n_ramp], F[:, n_ramp:], -F[:, n_ramp:], np.ones((s.size, 1)), -np.ones((s.size, 1))])
        sq = np.sqrt(wk)
        coef, _ = nnls(A * sq[:, None], yk * sq, maxiter=50 * A.shape[1])
        p = F.shape[1] - n_ramp
        self.ramp_coef_ = coef[:n_ramp]
        self.beta_ = coef[n_ramp:n_ramp + p] - coef[n_ramp + p:n_ramp + 2 * p]
        self.intercept_ = coef[-2] - coef[-1]
        z = self.index(s, Xk)
        self.x_, self.y_, self.weights_ = _pava(z, yk, wk)
        return self

    def index(self, score: np.ndarray, X: np.ndarray | None = None) -> np.ndarray:
        """Stage-1 index Z = h(S) + X beta (+ intercept)."""
        score = np.asarray(score, dtype=float)
        X = np.empty((score.size, 0)) if X is None else np.asarray(X, dtype=float)
        # sum_j a_j ramp_j(s) is the piecewise-linear interpolant through (knot_j, a_0 + ... + a_{j-1}),
        # flat outside the knots: np.interp evaluates it without building the basis matrix.
        h = np.interp(score, self.knots_, np.concatenate([[0.0], np.cumsum(self.ramp_coef_)]))
        if X.shape[1]:
            Xt = _signed_log(X) if self.log_covariates else X
            h = h + ((Xt - self.x_mean_) / self.x_scale_) @ self.beta_
        return h + self.intercept_

    def predict(self, score: np.ndarray, X: np.ndarray | None = None) -> np.ndarray:
        out = np.interp(self.index(score, X), self.x_, self.y_)
        return out if self.clip is None else np.clip(out, *self.clip)


def make_calibrator(mode: str, clip: tuple[float, float] | None = None):
    """A fresh, unfitted calibrator for ``mode`` ('monotone' or 'two_stage')."""
    if mode == "monotone":
        return IsotonicCalibrator(clip=clip)
    if mode == "two_stage":
        return TwoStageCalibrator(clip=clip)
    raise CJEInputError(f"calibration_mode must be one of auto, monotone, two_stage; got {mode!r}")
