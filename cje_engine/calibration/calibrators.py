"""Judge-to-oracle calibrators (AutoCal-R): monotone isotonic and two-stage.

Both follow scikit-learn conventions: configuration in the constructor, ``fit`` returns
``self``, fitted state in attributes ending with ``_``. Both are non-decreasing in the
judge score for fixed covariates *by construction*, and both are flat outside the range
of the scores they were fitted on (out of range = limited calibration support).

Sufficient statistics. Both fits depend on the rows only through, per distinct calibration
input (a *cell*: the judge score in monotone mode, the pair (score, covariates) in two-stage
mode), the total weight, the weighted label sum and the number of rows with positive weight.
`Cells` holds the distinct inputs; ``fit_cells`` fits from those per-cell sums, ``fit`` pools
rows into cells and calls it, so the two give the same model. A bootstrap replicate keeps the
sums per (fold, cell) and refits every fold from them without touching the rows again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from cje_engine.calibration.isotonic import isotonic_pooled

try:  # numpy's compiled interpolation without the Python wrapper's checks (float inputs only here)
    from numpy._core.multiarray import interp as interp_flat
except ImportError:  # pragma: no cover - other numpy layouts
    interp_flat = np.interp


def clip_to(out: np.ndarray, clip: tuple[float, float] | None) -> np.ndarray:
    """In-place clip (np.clip's dispatch costs more than the work on small arrays)."""
    if clip is None:
        return out
    np.maximum(out, clip[0], out=out)
    return np.minimum(out, clip[1], out=out)


LINKS = ("logit", "identity")  # stage 1 of the two-stage index


@dataclass(frozen=True)
class Cells:
    """Distinct calibration inputs, sorted by score (then covariates).

    Attributes
    ----------
    score : ndarray, shape (G,)
        Judge score of each cell.
    X : ndarray, shape (G, p)
        Covariates of each cell (``p = 0`` in monotone mode).
    score_values : ndarray, shape (D,)
        Distinct scores (sorted).
    score_code : ndarray of int, shape (G,)
        Index of each cell's score in ``score_values`` (non-decreasing).
    """

    score: np.ndarray
    X: np.ndarray
    score_values: np.ndarray
    score_code: np.ndarray

    @property
    def size(self) -> int:
        """Number of cells."""
        return int(self.score.shape[0])

    def subset(self, idx: np.ndarray) -> "Cells":
        """The cells ``idx`` (sorted indices), with their own distinct-score coding."""
        s = self.score[idx]
        values, code = np.unique(s, return_inverse=True)
        return Cells(s, self.X[idx], values, code)


def _sorted_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values and each element's index into them (hash-based: O(n + u log u))."""
    codes, uniq = pd.factorize(values, sort=True)
    return np.asarray(uniq), codes.astype(np.int64, copy=False)


def make_cells(score: np.ndarray, X: np.ndarray | None = None) -> tuple[Cells, np.ndarray]:
    """Distinct (score, covariates) rows, sorted, and each row's cell index.

    Codes are built column by column (hash-based factorisation, then a sort of the distinct
    values only), combined into one integer key and factorised again, so ten million rows
    take well under a second.
    """
    score = np.asarray(score, dtype=float)
    n = score.shape[0]
    X = np.empty((n, 0)) if X is None else np.asarray(X, dtype=float)
    if X.ndim != 2 or X.shape[0] != n:  # (n,) or flat: one row each; an (0, p) block (an empty shard) as it is
        X = X.reshape(n, -1)
    values, key = _sorted_codes(score)
    size = values.size
    for j in range(X.shape[1]):
        u, c = _sorted_codes(X[:, j])
        if size * u.size >= 2**62:  # re-code densely so the combined key stays in int64
            _, key = _sorted_codes(key)
            size = int(key.max()) + 1
        key = key * u.size + c
        size *= u.size
    if X.shape[1]:
        ukey, row_cell = _sorted_codes(key)  # sorted keys = cells sorted by (score, x1, x2, ...)
    else:
        row_cell = key
        ukey = np.arange(values.size)
    first = np.zeros(ukey.size, dtype=np.int64)
    first[row_cell[::-1]] = np.arange(n - 1, -1, -1)  # a row of each cell (the first)
    cell_score = score[first]
    cells = Cells(cell_score, X[first], *np.unique(cell_score, return_inverse=True))
    return cells, row_cell


def pool_rows(row_cell: np.ndarray, n_cells: int, y: np.ndarray, w: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-cell total weight, weighted label sum and count of rows with positive weight."""
    pos = w > 0
    return (np.bincount(row_cell, weights=w, minlength=n_cells),
            np.bincount(row_cell, weights=w * np.where(pos, y, 0.0), minlength=n_cells),
            np.bincount(row_cell, weights=pos, minlength=n_cells))


def quantile_of_counts(values: np.ndarray, counts: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``np.quantile(np.repeat(values, counts), q)`` (linear method) without expanding the rows.

    ``values`` are sorted; ``counts`` are non-negative whole numbers with a positive sum.
    Same arithmetic as numpy's ``_lerp``, so the result matches numpy to the last bit in
    practice (tested to 1e-15).
    """
    cum = np.cumsum(counts)
    n = cum[-1]
    virtual = (n - 1) * q
    prev = np.floor(virtual)
    both = np.searchsorted(cum, np.concatenate([prev, np.minimum(prev + 1, n - 1)]), side="right")
    ab = values[both]
    a, b = ab[:q.size], ab[q.size:]
    t = virtual - prev
    diff = b - a
    return np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)


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
    uses_covariates = False

    def __init__(self, clip: tuple[float, float] | None = None) -> None:
        self.clip = clip

    def fit(self, score: np.ndarray, y: np.ndarray, X: np.ndarray | None = None,
            sample_weight: np.ndarray | None = None) -> "IsotonicCalibrator":
        """Fit the isotonic curve of ``y`` on ``score`` (``X`` ignored); returns self."""
        score = np.asarray(score, dtype=float)
        w = np.ones_like(score) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        cells, row_cell = make_cells(score)
        return self.fit_cells(cells, *pool_rows(row_cell, cells.size, np.asarray(y, dtype=float), w))

    def fit_cells(self, cells: Cells, w: np.ndarray, wy: np.ndarray, count: np.ndarray | None = None,
                  warm: object = None) -> "IsotonicCalibrator":
        """Fit from per-cell sums (cells = distinct scores, sorted); ``count`` and ``warm`` are unused."""
        keep = w > 0
        if not keep.any():
            raise ValueError("isotonic fit needs at least one row with positive weight")
        if keep.all():
            self.x_, self.weights_ = cells.score, w
            self.y_ = isotonic_pooled(w, wy)
        else:
            self.x_, self.weights_ = cells.score[keep], w[keep]
            self.y_ = isotonic_pooled(self.weights_, wy[keep])
        return self

    def index(self, score: np.ndarray, X: np.ndarray | None = None) -> np.ndarray:
        """The one-dimensional index the isotonic stage works on (here the score itself)."""
        return np.asarray(score, dtype=float)

    def predict(self, score: np.ndarray, X: np.ndarray | None = None) -> np.ndarray:
        """Calibrated values of ``score`` (interpolated, flat outside, clipped to ``clip``)."""
        out = np.interp(self.index(score, X), self.x_, self.y_)
        return out if self.clip is None else np.clip(out, *self.clip)

    def predict_cells(self, cells: Cells) -> np.ndarray:
        """Predictions at every cell."""
        return clip_to(interp_flat(cells.score, self.x_, self.y_), self.clip)


def ramp_basis(s: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Monotone ramp basis: column j rises linearly from 0 to 1 between knots j and j+1.

    Any non-negative combination is a non-decreasing piecewise-linear function of ``s``,
    flat outside [knots[0], knots[-1]].
    """
    lo = knots[:-1]
    out = np.subtract(s[:, None], lo[None, :])
    out /= (knots[1:] - lo)[None, :]
    np.maximum(out, 0.0, out=out)
    return np.minimum(out, 1.0, out=out)


def _signed_log(X: np.ndarray) -> np.ndarray:
    return np.sign(X) * np.log1p(np.abs(X))


def _ramp_lsq(M: np.ndarray, t: np.ndarray, n_ramp: int, free: np.ndarray | None) -> np.ndarray | None:
    """min ||M theta - t|| with theta[:n_ramp] >= 0, by a warm-started active set on the normal equations.

    Starts from the ramps ``free`` (allowed positive; all if None), solves the least squares on
    them plus the unconstrained columns, and returns the solution once it satisfies the KKT
    conditions (free ramps >= 0, no fixed ramp with a descent direction). The problem is strictly
    convex when ``M`` has full column rank, so a KKT point is THE solution (the one scipy's NNLS
    finds). Returns None (caller falls back to NNLS) when ``M`` is (nearly) rank deficient or the
    active set does not settle within a few steps.
    """
    # einsum, not BLAS: the same bits whatever the BLAS thread count of the process
    return ramp_lsq_gram(np.einsum("gp,gq->pq", M, M), np.einsum("gp,g->p", M, t), n_ramp, free)


def ramp_lsq_gram(G: np.ndarray, b: np.ndarray, n_ramp: int, free: np.ndarray | None) -> np.ndarray | None:
    """`_ramp_lsq` from the normal equations ``G theta = b`` (``G = M'M``, ``b = M't``)."""
    P = G.shape[0]
    g = G.diagonal()
    if not (g > 0).all():
        return None
    # imported here: the fit's (the driver's, the bootstrap's refits'), not the passes' workers, which import this
    # module for `Cells` and `make_cells` (scipy.linalg and scipy.optimize: ~0.3 s of CPU a fresh worker)
    from scipy.linalg.lapack import dposv as _dposv

    tol = 1e-9 * (np.abs(b).max() + 1e-300)
    free = None if free is None or free.size != n_ramp or free.all() else free.copy()
    for _ in range(6):
        if free is None:
            c, theta, info = _dposv(G, b)
            if info != 0 or (c.diagonal() ** 2 / g).min() < 1e-12:  # (nearly) collinear: NNLS decides
                return None
        else:
            idx = np.concatenate([np.flatnonzero(free), np.arange(n_ramp, P)])
            c, x, info = _dposv(G[idx][:, idx], b[idx])
            if info != 0 or (c.diagonal() ** 2 / g[idx]).min() < 1e-12:
                return None
            theta = np.zeros(P)
            theta[idx] = x
        ramps = theta[:n_ramp]
        if (ramps < 0).any():
            free = (ramps > 0) if free is None else free & (ramps > 0)
            continue
        grad = b - G @ theta  # = M' (t - M theta): positive means the objective falls if theta_j grows
        if free is None:
            return theta
        viol = ~free & (grad[:n_ramp] > tol)
        if not viol.any():
            return theta
        free |= viol
    return None


def _ramp_solve(M: np.ndarray, t: np.ndarray, n_ramp: int, free: np.ndarray | None) -> np.ndarray:
    """min ||M theta - t|| with theta[:n_ramp] >= 0: the active set (`_ramp_lsq`), else scipy NNLS."""
    theta = _ramp_lsq(M, t, n_ramp, free)
    if theta is None:
        from scipy.optimize import nnls  # the fit's only (see `ramp_lsq_gram`)

        # NNLS with sign-free intercept and covariates: split them into +/- columns.
        A = np.hstack([M[:, :n_ramp], M[:, n_ramp:], -M[:, n_ramp:]])
        coef, _ = nnls(A, t, maxiter=50 * A.shape[1])
        theta = np.concatenate([coef[:n_ramp], coef[n_ramp:M.shape[1]] - coef[M.shape[1]:]])
    return theta


def qp_ramp(G: np.ndarray, b: np.ndarray, n_ramp: int, free: np.ndarray | None) -> np.ndarray:
    """min 1/2 theta' G theta - b' theta with theta[:n_ramp] >= 0 (G positive definite).

    The active set on the normal equations (`ramp_lsq_gram`); if it declines (near collinearity,
    no settling), scipy NNLS on the equivalent least squares ``||R theta - R^-T b||`` (G = R'R).
    """
    theta = ramp_lsq_gram(G, b, n_ramp, free)
    if theta is None:
        R = np.linalg.cholesky(G).T
        theta = _ramp_solve(R, np.linalg.solve(R.T, b), n_ramp, None)
    return theta


#: Ridge of the logit first stage, per unit of mean row weight, on the ramp and covariate
#: coefficients (not the intercept): it keeps the fit finite when the labels are separated by the
#: index (likely with 16 labels in a bootstrap replicate) and the problem strictly convex; its
#: share of the curvature falls as 1 / (labels), about 0.1 / (0.2 m) (see docs/statistics.md).
RIDGE = 0.1
#: Newton stops when its last step moved no coefficient by more than this (relative to 1 + max|theta|);
#: convergence is quadratic, so the coefficients are then within ~1e-13 of the optimum.
NEWTON_TOL = 1e-4
NEWTON_MAX = 50
LOG2 = float(np.log(2.0))


def ridge_of(w: np.ndarray, count: np.ndarray) -> float:
    """The logit stage's ridge: ``RIDGE`` times the mean weight of the rows with positive weight."""
    return RIDGE * float(w.sum()) / float(count.sum())


def label_unit(w: np.ndarray, wy: np.ndarray, clip: tuple[float, float] | None) -> np.ndarray | None:
    """Each cell's mean label on [0, 1] (``clip`` = the label scale; None: the cells' own range),
    or None when every cell is at one end (the logit fit has no finite optimum, the index no use)."""
    ybar = wy / w
    lo, hi = (float(ybar.min()), float(ybar.max())) if clip is None else clip
    if not hi > lo:
        return None
    t = np.clip((ybar - lo) / (hi - lo), 0.0, 1.0)
    if t.max() <= 0.0 or t.min() >= 1.0:
        return None
    return t


def logit_objective(eta: np.ndarray, w: np.ndarray, t: np.ndarray, theta: np.ndarray, pen: np.ndarray) -> float:
    """Quasi-binomial deviance / 2 of the index ``eta`` plus the ridge: the logit stage's objective."""
    return float(np.einsum("g,g->", w, np.logaddexp(0.0, eta) - t * eta) + 0.5 * np.einsum("p,p,p->", pen, theta,
                                                                                         theta))


def _logit_newton(F: np.ndarray, w: np.ndarray, t: np.ndarray, lam: float, n_ramp: int,
                  free: np.ndarray | None, code: np.ndarray) -> np.ndarray:
    """Ridge-penalised quasi-binomial logistic fit of ``t`` on ``F`` with ``theta[:n_ramp] >= 0``.

    Projected Newton (IRLS): each step minimises the objective's quadratic model under the
    bounds (`qp_ramp`). A step that changes no cell's index by more than log 2 is taken whole
    (along it the curvature changes by less than a factor 2, so it lowers the objective); a
    longer one is halved until the objective does not rise. Starts like R's ``glm``, but from
    the mean label of each distinct score (``code``: the cells' score index) rather than of each
    cell: mu = (sum w t + 1/2) / (sum w + 1) over the cells of a score (closer to the optimum,
    one Newton step fewer); a function of the data only (no starting coefficients).
    """
    P = F.shape[1]
    pen = np.full(P, lam)
    pen[-1] = 0.0
    mu = ((np.bincount(code, weights=w * t) + 0.5) / (np.bincount(code, weights=w) + 1.0))[code]
    eta = np.log(mu / (1.0 - mu))
    theta = None
    for _ in range(NEWTON_MAX):
        v = w * mu * (1.0 - mu)
        G = np.einsum("gp,g,gq->pq", F, v, F)
        G[np.diag_indices(P)] += pen
        new = qp_ramp(G, np.einsum("gp,g->p", F, v * eta + w * (t - mu)), n_ramp, free)
        eta_c = np.einsum("gp,p->g", F, new)
        if theta is None:  # the first step (from the data's start) is taken whole
            moved = np.inf
        else:
            step, s = new - theta, 1.0
            if np.abs(eta_c - eta).max() > LOG2:
                q = logit_objective(eta, w, t, theta, pen)
                while logit_objective(eta_c, w, t, new, pen) > q + 1e-12 * (1.0 + abs(q)) and s >= 1e-6:
                    s *= 0.5
                    new = theta + s * step
                    eta_c = np.einsum("gp,p->g", F, new)
            moved = np.abs(s * step).max()
        theta, eta = new, eta_c
        free = theta[:n_ramp] > 0
        mu = 0.5 * (1.0 + np.tanh(0.5 * eta))  # expit, as the batched loop computes it
        if moved <= NEWTON_TOL * (1.0 + np.abs(theta).max()):
            break
    return theta


def knot_levels(n_knots: int) -> np.ndarray:
    """The ``n_knots + 1`` equally spaced quantile levels of a ramp basis (cached per size)."""
    q = _LEVELS.get(n_knots)
    if q is None:
        q = _LEVELS[n_knots] = np.linspace(0, 1, n_knots + 1)
    return q


_LEVELS: dict[int, np.ndarray] = {}


class TwoStageCalibrator:
    """Two-stage calibration: a smooth monotone index of score and covariates, then isotonic.

    Stage 1 fits an index ``Z = h(S) + X @ beta + c``, where ``h`` is a non-decreasing
    piecewise-linear function of the judge score (ramp basis with knots at score quantiles,
    non-negative coefficients) and ``beta`` is free. Stage 2 is isotonic regression of the
    label on ``Z``. Because ``h`` is non-decreasing and stage 2 is isotonic, the calibrated
    value is non-decreasing in the judge score for any fixed covariates (the property the
    reference's spline index can violate).

    ``link="logit"`` (default): stage 1 is a quasi-binomial logistic regression of the label,
    rescaled to [0, 1] by ``clip`` (the label scale), on the basis: it minimises
    ``sum_i w_i [log(1 + e^Z_i) - t_i Z_i] + (lam / 2) (|a|^2 + |beta|^2)`` over ramps ``a >= 0``,
    ``beta`` (on standardised covariates) and ``c``, with ``lam = RIDGE * mean row weight``
    (projected Newton, `_logit_newton`). The index then lives on a link scale, where a judge bias
    that shifts the judge's latent scale by a function of the covariates is additive; on the
    label's scale it is not (the sigmoid bends it), and least squares of the label on an additive
    index mis-weights the covariate against the score (docs/statistics.md). ``link="identity"``:
    least squares of the label on the basis (the former stage 1, the paper's form).

    The knots are quantiles of the scores of the rows with positive weight (each row counted
    once, whatever its weight). Stage 1 runs on one row per cell (weight = total weight of its
    rows, target = their weighted mean label), which has the same minimiser as the row-level
    problem (both objectives are linear in the label).

    Parameters
    ----------
    n_knots : int
        Number of ramp segments of ``h`` (knots at quantiles of the training scores).
    log_covariates : bool
        Apply ``sign(x) * log1p(|x|)`` to covariates (lengths are heavy-tailed).
    clip : tuple of float, optional
        Bounds for predictions; with the logit link also the label scale mapped to [0, 1]
        (None: the range of the cells' mean labels).
    link : {"logit", "identity"}
        Stage 1's link (above).
    """

    mode = "two_stage"
    uses_covariates = True

    def __init__(self, n_knots: int = 6, log_covariates: bool = True,
                 clip: tuple[float, float] | None = None, link: str = "logit") -> None:
        self.n_knots = n_knots
        self.log_covariates = log_covariates
        self.clip = clip
        self.link = link

    def fit(self, score: np.ndarray, y: np.ndarray, X: np.ndarray | None = None,
            sample_weight: np.ndarray | None = None) -> "TwoStageCalibrator":
        """Fit the monotone index of score and covariates, then isotonic on it; returns self."""
        score = np.asarray(score, dtype=float)
        w = np.ones_like(score) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        cells, row_cell = make_cells(score, X)
        return self.fit_cells(cells, *pool_rows(row_cell, cells.size, np.asarray(y, dtype=float), w))

    def fit_cells(self, cells: Cells, w: np.ndarray, wy: np.ndarray, count: np.ndarray,
                  warm: "TwoStageCalibrator | None" = None) -> "TwoStageCalibrator":
        """Fit from per-cell sums: weight ``w``, weighted label sum ``wy``, rows with weight > 0 ``count``.

        ``warm``: a fitted model whose active ramps start the solver (same answer, fewer steps).
        With the logit link, a fit whose labels all sit at one end of the scale gets a constant index.
        """
        if self.link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {self.link!r}")
        keep = count > 0
        if keep.all():
            s, Xt, wk, wyk, code, cnt = cells.score, self._xt(cells), w, wy, cells.score_code, count
        elif keep.any():
            s, Xt, wk, wyk = cells.score[keep], self._xt(cells)[keep], w[keep], wy[keep]
            code, cnt = cells.score_code[keep], count[keep]
        else:
            raise ValueError("two-stage fit needs at least one row with positive weight")
        per_score = np.bincount(code, weights=cnt, minlength=cells.score_values.size)
        knots = quantile_of_counts(cells.score_values, per_score, knot_levels(self.n_knots))
        knots = knots[np.concatenate(([True], knots[1:] > knots[:-1]))]  # sorted: drop repeats
        if knots.size < 2:
            knots = np.array([s.min() - 0.5, s.min() + 0.5])
        self.knots_ = knots
        p = Xt.shape[1]
        wsum = wk.sum()
        if p:
            self.x_mean_ = np.einsum("g,gp->p", wk, Xt) / wsum
            sd = np.sqrt(np.einsum("g,gp->p", wk, (Xt - self.x_mean_) ** 2) / wsum)
            self.x_scale_ = np.where(sd > 0, sd, 1.0)
        else:
            self.x_mean_ = self.x_scale_ = np.zeros(0)
        n_ramp = knots.size - 1
        sq = np.sqrt(wk)
        F = np.empty((s.size, n_ramp + p + 1))
        F[:, :n_ramp] = ramp_basis(s, knots)
        F[:, n_ramp:n_ramp + p] = (Xt - self.x_mean_) / self.x_scale_
        F[:, -1] = 1.0
        free = None if warm is None or warm.ramp_coef_.size != n_ramp else warm.ramp_coef_ > 0
        if self.link == "identity":
            theta = _ramp_solve(F * sq[:, None], wyk / sq, n_ramp, free)  # t = sqrt(w) * mean label of the cell
        else:
            t_unit = label_unit(wk, wyk, self.clip)
            if t_unit is None:  # every label at one end of the scale: no index to find, a constant one
                theta = np.zeros(F.shape[1])
            else:
                theta = _logit_newton(F, wk, t_unit, ridge_of(wk, cnt), n_ramp, free, code)
        self.ramp_coef_ = theta[:n_ramp]
        self.beta_ = theta[n_ramp:n_ramp + p]
        self.intercept_ = float(theta[-1])
        self._cum = np.concatenate([[0.0], np.cumsum(self.ramp_coef_)])
        self._stage2(s, Xt, wk, wyk)
        return self

    def _stage2(self, s: np.ndarray, Xt: np.ndarray, wk: np.ndarray, wyk: np.ndarray) -> None:
        """Isotonic regression of the label on the fitted index (cells pooled by equal index)."""
        z = self._index_t(s, Xt)
        order = np.argsort(z, kind="stable")
        zs = z[order]
        first = np.empty(zs.size, dtype=bool)
        first[0] = True
        np.greater(zs[1:], zs[:-1], out=first[1:])
        inv = np.cumsum(first) - 1
        sw = np.bincount(inv, weights=wk[order])
        self.x_, self.weights_ = zs[first], sw
        self.y_ = isotonic_pooled(sw, np.bincount(inv, weights=wyk[order]))

    def _xt(self, cells: Cells) -> np.ndarray:
        """The cells' covariates after the optional signed log (cached on the cells)."""
        key = "_xt_log" if self.log_covariates else "_xt_raw"
        Xt = cells.__dict__.get(key)
        if Xt is None:
            Xt = _signed_log(cells.X) if self.log_covariates else cells.X
            object.__setattr__(cells, key, Xt)  # frozen dataclass: a private cache
        return Xt

    def _index_t(self, score: np.ndarray, Xt: np.ndarray) -> np.ndarray:
        # sum_j a_j ramp_j(s) is the piecewise-linear interpolant through (knot_j, a_0 + ... + a_{j-1}),
        # flat outside the knots: np.interp evaluates it without building the basis matrix.
        h = interp_flat(score, self.knots_, self._cum)
        if Xt.shape[1]:
            h = h + ((Xt - self.x_mean_) / self.x_scale_) @ self.beta_
        return h + self.intercept_

    def index(self, score: np.ndarray, X: np.ndarray | None = None) -> np.ndarray:
        """Stage-1 index Z = h(S) + X beta (+ intercept)."""
        score = np.asarray(score, dtype=float)
        X = np.empty((score.size, 0)) if X is None else np.asarray(X, dtype=float)
        return self._index_t(score, _signed_log(X) if self.log_covariates else X)

    def predict(self, score: np.ndarray, X: np.ndarray | None = None) -> np.ndarray:
        """Calibrated values of ``score`` with covariates ``X`` (clipped to ``clip``)."""
        out = np.interp(self.index(score, X), self.x_, self.y_)
        return out if self.clip is None else np.clip(out, *self.clip)

    def predict_cells(self, cells: Cells) -> np.ndarray:
        """Predictions at every cell."""
        return clip_to(interp_flat(self._index_t(cells.score, self._xt(cells)), self.x_, self.y_), self.clip)


#: Ramp segments of the two-stage index with enough labels (`two_stage_knots`).
TWO_STAGE_MAX_KNOTS = 6

#: Fewest calibration labels per stage-1 parameter of the two-stage index (ramps + covariates + intercept).
#: Below 2 the stage-1 fit is not identified in most bootstrap replicates (a replicate of m labels holds
#: about 0.63 m distinct ones).
TWO_STAGE_LABELS_PER_PARAMETER = 2


def two_stage_knots(n_labels: int, n_covariates: int) -> int:
    """Ramp segments of the two-stage index for ``n_labels`` calibration labels (0: too few for any).

    ``min(TWO_STAGE_MAX_KNOTS, n_labels // TWO_STAGE_LABELS_PER_PARAMETER - n_covariates - 1)``: as many
    segments as keep ``TWO_STAGE_LABELS_PER_PARAMETER`` labels per stage-1 parameter, at most six. With
    few labels the index is nearly linear in the score (one segment: ``a S + X beta + c``); its shape
    is then left to stage 2 (isotonic on the index), while the covariate's effect -- a length bias of
    the judge, which the monotone calibration cannot represent at all -- is still estimated
    (docs/statistics.md, "Transport audit"). The default path (16 or more labels with one covariate)
    keeps six.
    """
    return int(max(0, min(TWO_STAGE_MAX_KNOTS, n_labels // TWO_STAGE_LABELS_PER_PARAMETER - n_covariates - 1)))
