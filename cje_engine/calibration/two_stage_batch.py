"""Many two-stage fits at once: the cross-fit's full fit and its fold complements.

A cross-fit (and every bootstrap replicate of it) fits the same two-stage model six times, on
per-cell sums that differ only in which fold is left out. Fitting them one by one spends most of
the time in per-call overhead (a few hundred small numpy calls), not in arithmetic: ~400 cells and
a 9-column least squares. `fit_two_stage_many` does every step for all fits together:

* knots of all fits from one (fit, distinct score) count matrix (numpy's linear quantile rule,
  as `quantile_of_counts`);
* one design matrix ``[ramps, covariates, 1]`` per distinct knot vector, cached on the cells
  together with its per-cell outer products, so the normal equations of all fits sharing those
  knots are one product ``W @ O`` (``einsum``: no threaded BLAS, whose rounding depends on
  the thread count, so every process computes the same bits; the least squares runs in the raw (log) covariates:
  with an intercept the fitted index does not depend on centring and scaling; the coefficients
  are then expressed in each fit's own standardisation, as ``fit_cells`` stores them);
* every fit's active set at once (`_ramp_lsq_stack`): batched LAPACK solves of the masked
  normal equations, each fit with its own free set, started from the design's point fit and
  checked by the KKT conditions; the scalar solver (`ramp_lsq_gram`) and finally scipy NNLS
  (``fit_cells``) only for the fits that fail the checks;
* stage 2 for all fits from one stable sort of the index matrix, one pooling ``reduceat`` and
  one PAVA call per fit.

With the logit first stage (the default) the least squares above is the inner step of a Newton
loop run for all fits at once (`_solve_logit`, `cje_engine.calibration.logit_stack.newton_stack`): per
step, each fit's sums over the cells of each distinct score (a cell's ramps depend on its score only,
so the Gram matrix and gradient are linear in those sums, `_score_design`), then the Gram matrices of
every group of fits sharing a knot vector from a small per-design map, one batched solve on each
fit's free set, step halving only where a step may change an index by more than log 2; a converged
fit leaves the loop. The bootstrap refits the cross-fits of a batch of replicates in one call.

The models equal ``TwoStageCalibrator.fit_cells`` on each row of sums (the same convex problems;
tests pin least squares to 1e-9 against a row-level fit with scipy NNLS, and the logit stage to 1e-6
against a row-level L-BFGS-B optimum and against ``fit_cells``). `TwoStageFits.models` builds the
calibrator objects; the bootstrap uses the arrays directly (`index`, `predict_cells`).
"""
from __future__ import annotations

import logging

import numpy as np
from numpy.linalg import _umath_linalg as _lapack  # the batched LAPACK gufuncs, without the wrappers' checks
from numpy._core._multiarray_umath import c_einsum as _einsum  # what np.einsum runs (optimize=False), no wrapper

from cje_engine.calibration.calibrators import (
    RIDGE,
    Cells,
    TwoStageCalibrator,
    clip_to,
    interp_flat,
    knot_levels,
    ramp_basis,
    ramp_lsq_gram,
)
from cje_engine.calibration.isotonic import isotonic_pooled_segments
from cje_engine.calibration.logit_stack import eye_stack, triangle_index, newton_stack

log = logging.getLogger(__name__)

__all__ = ["TwoStageFits", "fit_two_stage_many"]

_MAX_BASES = 256  # design matrices cached per cells object (one per distinct knot vector)


def _cells_cache(cells: Cells) -> dict:
    """A private dict on the (frozen) cells object for arrays that depend on the cells only."""
    cache = cells.__dict__.get("_batch_cache")
    if cache is None:
        cache = {}
        object.__setattr__(cells, "_batch_cache", cache)
    return cache


def _cached_basis(cells: Cells, name: str, key: tuple, build):
    """``build()`` cached under ``key`` in the cells' table ``name``, at most ``_MAX_BASES`` entries
    (one per distinct knot vector; the table is emptied when full)."""
    table = _cells_cache(cells).setdefault(name, {})
    hit = table.get(key)
    if hit is None:
        if len(table) >= _MAX_BASES:
            table.clear()
        hit = table[key] = build()
    return hit


def _score_key(cells: Cells, J: int) -> np.ndarray:
    """Flat (fit, distinct score) key of every (fit, cell) pair, for the per-score counts."""
    cache = _cells_cache(cells)
    key = cache.get(("score_key", J))
    if key is None:
        D = cells.score_values.size
        key = cache[("score_key", J)] = (np.arange(J)[:, None] * D + cells.score_code[None, :]).ravel()
    return key


def _basis(cells: Cells, Xt: np.ndarray, knots: np.ndarray, log_covariates: bool) -> tuple[np.ndarray, np.ndarray]:
    """Design matrix ``[ramps(knots), Xt, 1]`` of the cells and its per-cell outer products (cached).

    ``O[g] = F[g] (x) F[g]`` flattened, so the normal equations of weights ``w`` are ``w @ O``.
    """
    def build() -> tuple[np.ndarray, np.ndarray]:
        nr, p = knots.size - 1, Xt.shape[1]
        F = np.empty((cells.size, nr + p + 1))
        F[:, :nr] = ramp_basis(cells.score, knots)
        F[:, nr:nr + p] = Xt
        F[:, -1] = 1.0
        return F, (F[:, :, None] * F[:, None, :]).reshape(cells.size, -1)

    return _cached_basis(cells, "bases", (log_covariates, knots.tobytes()), build)


def _levels(cells: Cells, Xt: np.ndarray, log_covariates: bool) -> tuple:
    """The cells grouped by score for the logit stage (cached): the first cell of each distinct score
    (cells are score-ordered, so each score's cells are a run), each cell's score level, the
    covariates and their pairwise products (upper triangle) per cell."""
    cache = _cells_cache(cells)
    key = ("levels", log_covariates)
    lv = cache.get(key)
    if lv is None:
        code = cells.score_code
        if (np.diff(code) < 0).any():  # pragma: no cover - Cells are score-ordered by construction
            raise ValueError("cells must be ordered by score")
        first = np.ones(code.size, dtype=bool)
        np.not_equal(code[1:], code[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        p = Xt.shape[1]
        k, l = np.triu_indices(p)
        lv = cache[key] = (starts, np.cumsum(first) - 1, np.ascontiguousarray(Xt), np.ascontiguousarray(Xt[:, k] * Xt[:, l]))
    return lv


def _score_design(cells: Cells, Xt: np.ndarray, knots: np.ndarray, log_covariates: bool) -> tuple:
    """The logit stage's design ``F = [ramps(knots), Xt, 1]`` on the score levels (cached per knot vector).

    A cell's ramps depend on its score only, so every Gram entry of a fit is linear in its per-score
    sums ``s = [sum v, sum v x_k (per score), sum v x_k x_l]`` of the cells' weights ``v``:
    ``h = s @ L`` (upper triangle, `triangle_index` order); likewise the gradient ``b = [sum r, sum r x_k
    (per score)] @ Lb``, and the index ``F theta`` is the ramp part at the score levels (``R' theta``)
    taken to the cells plus ``Xt theta_x``. Returns ``(L, Lb, R', largest |F| per column)``.
    """
    def build() -> tuple:
        starts, level, X, _ = _levels(cells, Xt, log_covariates)
        D, p, nr = starts.size, Xt.shape[1], knots.size - 1
        P = nr + p + 1
        R = ramp_basis(cells.score[starts], knots)  # (D, nr): the ramps at each score level
        iu0, iu1, _ = triangle_index(P)
        kind = np.array([0] * nr + [1] * p + [2])  # ramp, covariate, intercept
        S = D + D * p + p * (p + 1) // 2
        L = np.zeros((S, iu0.size))
        Lb = np.zeros((D + D * p, P))
        xx = {kl: i for i, kl in enumerate(zip(*np.triu_indices(p)))}
        vx = D + np.arange(D)[:, None] * p  # row of sum v x_k at level d: vx[d] + k
        for t, (a, b) in enumerate(zip(iu0.tolist(), iu1.tolist())):
            ka, kb = kind[a], kind[b]
            if ka == 0 and kb == 0:
                L[:D, t] = R[:, a] * R[:, b]
            elif ka == 0 and kb == 1:
                L[vx[:, 0] + b - nr, t] = R[:, a]
            elif ka == 0:
                L[:D, t] = R[:, a]
            elif ka == 1 and kb == 1:
                L[D + D * p + xx[(a - nr, b - nr)], t] = 1.0
            elif ka == 1:
                L[vx[:, 0] + a - nr, t] = 1.0
            else:
                L[:D, t] = 1.0
        Lb[:D, :nr] = R
        for k in range(p):
            Lb[vx[:, 0] + k, nr + k] = 1.0
        Lb[:D, -1] = 1.0
        fmax = np.concatenate([np.abs(R).max(0), np.abs(X).max(0) if p else np.zeros(0), [1.0]])
        return L, Lb, np.ascontiguousarray(R.T), fmax

    return _cached_basis(cells, "score_designs", (log_covariates, knots.tobytes()), build)


def _all_knots(cells: Cells, C: np.ndarray, n_knots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw knots of every fit (J, n_knots + 1), rows with positive weight per fit, per-score counts."""
    J = C.shape[0]
    D = cells.score_values.size
    per_score = np.bincount(_score_key(cells, J), weights=C.ravel(), minlength=J * D).reshape(J, D)
    cum = per_score.cumsum(1)
    n = cum[:, -1:]
    virtual = (n - 1) * knot_levels(n_knots)[None, :]
    prev = np.floor(virtual)
    both = np.concatenate([prev, np.minimum(prev + 1, n - 1)], axis=1)
    # per fit, how many cumulative counts are <= each order statistic: one searchsorted over the
    # rows laid end to end (shifted apart by more than any count; integer counts, so exact)
    shift = np.arange(J)[:, None] * (n.max() + 1.0)
    below = np.searchsorted((cum + shift).ravel(), (both + shift).ravel(), side="right").reshape(both.shape)
    below -= np.arange(J)[:, None] * D
    ab = cells.score_values[below.clip(max=D - 1)]
    L = prev.shape[1]
    a, b = ab[:, :L], ab[:, L:]
    t = virtual - prev
    diff = b - a
    return np.where(t >= 0.5, b - diff * (1 - t), a + diff * t), n[:, 0], per_score


class TwoStageFits:
    """The fitted parameters of J two-stage models on the same cells (None rows: no data).

    Attributes
    ----------
    ok : ndarray of bool, shape (J,)
        Fits with at least one row of positive weight.
    knots, cum : list of ndarray
        Ramp knots of each fit and the cumulative ramp coefficients (the index's
        piecewise-linear part passes through ``(knots[i], cum[i])``).
    x_mean, x_scale, beta : ndarray, shape (J, p)
        Covariate standardisation and coefficients on the standardised covariates.
    intercept : ndarray, shape (J,)
    Z : ndarray, shape (J, G)
        Stage-1 index of every fit at every cell.
    x, y, w : list of ndarray
        Stage 2: the pooled index values, the isotonic fitted values and their weights.
    """

    def __init__(self, J: int, p: int, clip, n_knots: int, log_covariates: bool, link: str = "logit") -> None:
        self.J, self.clip, self.n_knots, self.log_covariates, self.link = J, clip, n_knots, log_covariates, link
        self.ok = np.zeros(J, dtype=bool)
        self.knots: list = [None] * J
        self.cum: list = [None] * J
        self.ramp: list = [None] * J
        self.x_mean = np.zeros((J, p))
        self.x_scale = np.ones((J, p))
        self.beta = np.zeros((J, p))
        self.intercept = np.zeros(J)
        self.x: list = [None] * J
        self.y: list = [None] * J
        self.w: list = [None] * J
        self.Z = np.empty((J, 0))

    def index(self, j: int, score: np.ndarray, Xt: np.ndarray) -> np.ndarray:
        """Stage-1 index of fit ``j`` at scores ``score`` and transformed covariates ``Xt``."""
        h = interp_flat(score, self.knots[j], self.cum[j])
        if Xt.shape[1]:
            h = h + ((Xt - self.x_mean[j]) / self.x_scale[j]) @ self.beta[j]
        return h + self.intercept[j]

    def predict_cells(self, j: int, cells: Cells) -> np.ndarray:
        """Calibrated value of fit ``j`` at every cell of ``cells`` (any cells object)."""
        Xt = TwoStageCalibrator(log_covariates=self.log_covariates)._xt(cells)
        return clip_to(interp_flat(self.index(j, cells.score, Xt), self.x[j], self.y[j]), self.clip)

    def model(self, j: int) -> TwoStageCalibrator | None:
        """Fit ``j`` as a `TwoStageCalibrator` (None for a fit without data)."""
        if not self.ok[j]:
            return None
        m = TwoStageCalibrator(n_knots=self.n_knots, log_covariates=self.log_covariates, clip=self.clip,
                               link=self.link)
        m.knots_, m.x_mean_, m.x_scale_ = self.knots[j], self.x_mean[j], self.x_scale[j]
        m.ramp_coef_, m.beta_, m.intercept_ = self.ramp[j], self.beta[j], float(self.intercept[j])
        m._cum = self.cum[j]
        m.x_, m.y_, m.weights_ = self.x[j], self.y[j], self.w[j]
        return m

    def models(self) -> list:
        """Every fit as a `TwoStageCalibrator` (``model(j)`` for each j)."""
        return [self.model(j) for j in range(self.J)]


def _ramp_lsq_stack(G: np.ndarray, b: np.ndarray, n_ramp: int, free: np.ndarray | None = None,
                    rounds: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """The active set of `ramp_lsq_gram` for a stack of systems at once, each with its own free set.

    ``free`` (n_ramp,): the ramps every system starts with (all if None). Every round solves all
    unsettled systems in one batched call, with the fixed ramps masked out (their rows and
    columns replaced by the identity, their right-hand side by 0, so they solve to exactly 0); a
    system with a negative free ramp drops its non-positive ramps, one without gains the fixed
    ramps with a descent direction, one with neither is a KKT point: THE solution of its strictly
    convex problem, computed from the final free set alone (so the start does not change it).
    Returns ``theta`` (N, P) and ``done`` (N,): False where the system is (nearly) rank deficient
    or did not settle (the caller then takes the exact path).
    """
    N, P = b.shape
    theta = np.zeros((N, P))
    done = np.zeros(N, dtype=bool)
    tol = 1e-9 * (np.abs(b).max(1) + 1e-300)
    mask = np.ones((N, P), dtype=bool)
    if free is not None:
        mask[:, :n_ramp] = free
    act = np.flatnonzero((np.diagonal(G, axis1=1, axis2=2) > 0).all(1))
    eye = eye_stack(P)
    for _ in range(rounds):
        if act.size == 0:
            break
        every = act.size == N
        m = mask if every else mask[act]
        Ga, ba = (G, b) if every else (G[act], b[act])
        Gm = np.where(m[:, :, None] & m[:, None, :], Ga, eye)
        with np.errstate(invalid="ignore"):  # not positive definite: NaN factor, fails the check
            L = _lapack.cholesky_lo(Gm, signature="d->d")
            rank_ok = (np.diagonal(L, axis1=1, axis2=2) ** 2 / np.diagonal(Gm, axis1=1, axis2=2)).min(1) >= 1e-12
            x = _lapack.solve1(Gm, np.where(m, ba, 0.0), signature="dd->d")
        x[~m] = 0.0
        ramps, fr = x[:, :n_ramp], m[:, :n_ramp]
        neg = (ramps < 0).any(1)
        grad = ba - np.matmul(Ga, x[:, :, None])[:, :, 0]  # positive: the objective falls if theta_j grows
        viol = ~fr & (grad[:, :n_ramp] > tol[act, None])
        settled = rank_ok & ~neg & ~viol.any(1)
        if settled.all():
            theta[act], done[act] = x, True
            break
        mask[act, :n_ramp] = np.where(neg[:, None], fr & (ramps > 0), fr | viol)
        theta[act[settled]] = x[settled]
        done[act[settled]] = True
        act = act[rank_ok & ~settled]
    return theta, done


def _solve_all(cells: Cells, Xt: np.ndarray, knots: np.ndarray, W: np.ndarray, WY: np.ndarray,
               log_covariates: bool, warm: dict | None) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares coefficients (raw covariates) of fits with the same number of knots
    (``knots`` (J, k)); ``done`` False where the fast path failed (the caller refits those)."""
    J = W.shape[0]
    groups: dict[bytes, list[int]] = {}
    for j in range(J):
        groups.setdefault(knots[j].tobytes(), []).append(j)
    parts = []
    for js in groups.values():
        F, O = _basis(cells, Xt, knots[js[0]], log_covariates)
        P = F.shape[1]
        Ws, WYs = (W, WY) if len(js) == J else (W[js], WY[js])
        # einsum, not BLAS: a threaded BLAS product's rounding depends on its thread count, and
        # replicates must be the same bits in every process (any node, any chunking)
        parts.append((js, _einsum("jg,gq->jq", Ws, O).reshape(len(js), P, P), _einsum("jg,gp->jp", WYs, F)))
    n_ramp = knots.shape[1] - 1
    if len(parts) == 1:
        G, b = parts[0][1], parts[0][2]
    else:
        order = np.array([j for part in parts for j in part[0]])
        G = np.empty((J, P, P))
        b = np.empty((J, P))
        G[order] = np.concatenate([part[1] for part in parts])
        b[order] = np.concatenate([part[2] for part in parts])
    theta, done = _ramp_lsq_stack(G, b, n_ramp, None if warm is None else warm.get(n_ramp))
    for j in np.flatnonzero(~done):  # the scalar solver (its own checks), then NNLS in the caller
        th = ramp_lsq_gram(G[j], b[j], n_ramp, None)
        if th is not None:
            theta[j], done[j] = th, True
    return theta, done


def _unit_labels(W: np.ndarray, WY: np.ndarray, C: np.ndarray, clip) -> tuple[np.ndarray, np.ndarray]:
    """Per fit and cell ``W t``, ``t`` the mean label on [0, 1] (as `label_unit`; 0 where a cell has
    no rows), and which fits have labels off both ends (the others get a constant index, as
    ``fit_cells``)."""
    has = C > 0
    ybar = np.divide(WY, W, out=np.zeros(W.shape), where=has)
    if clip is None:
        lo = np.where(has, ybar, np.inf).min(1, keepdims=True)
        hi = np.where(has, ybar, -np.inf).max(1, keepdims=True)
    else:
        lo, hi = np.full((W.shape[0], 1), float(clip[0])), np.full((W.shape[0], 1), float(clip[1]))
    span = hi - lo
    ok = span[:, 0] > 0
    ybar -= lo
    ybar /= np.where(span > 0, span, 1.0)
    np.maximum(ybar, 0.0, out=ybar)
    np.minimum(ybar, 1.0, out=ybar)
    WT = ybar
    WT *= W  # 0 where a cell has no rows
    return WT, ok & (WT > 0).any(1) & (W > WT).any(1)


def _solve_logit(cells: Cells, Xt: np.ndarray, knots: np.ndarray, W: np.ndarray, WY: np.ndarray, C: np.ndarray,
                 clip, log_covariates: bool, warm: dict | None, x_scale: np.ndarray) -> np.ndarray:
    """The logit stage-1 coefficients (raw covariates) of fits with the same number of knots
    (``knots`` (J, k)): `_logit_newton` for all of them at once. One Newton loop: per step, the
    Gram matrices and gradients of each group of fits sharing a knot vector (its cached design),
    then one batched quadratic programme for all fits, each with its own active set and step
    length (`newton_stack`); a fit that has converged leaves the loop while the others go on."""
    J = W.shape[0]
    n_ramp = knots.shape[1] - 1
    P = n_ramp + Xt.shape[1] + 1
    WT, live = _unit_labels(W, WY, C, clip)
    theta = np.zeros((J, P))
    js = np.flatnonzero(live)
    if js.size == 0:
        return theta
    groups: dict[bytes, list[int]] = {}
    for j in js.tolist():
        groups.setdefault(knots[j].tobytes(), []).append(j)
    designs = [_score_design(cells, Xt, knots[rows[0]], log_covariates) for rows in groups.values()]
    counts = np.array([len(rows) for rows in groups.values()])
    # the fits in design order, so that each design's fits are a slice (views, no copies)
    sel = slice(None) if js.size == J and len(designs) == 1 else np.array([j for rows in groups.values() for j in rows])
    Ws, WTs = W[sel], WT[sel]
    lam = RIDGE * Ws.sum(1) / C[sel].sum(1)
    pen = np.empty((js.size, P))
    pen[:, :n_ramp] = lam[:, None]
    pen[:, n_ramp:-1] = lam[:, None] * x_scale[sel] ** 2  # the ridge is on standardised coefficients
    pen[:, -1] = 0.0
    # the start: the mean label of each distinct score, (sum w t + 1/2) / (sum w + 1) (`_logit_newton`)
    N, D = js.size, cells.score_values.size
    key = _score_key(cells, N)
    mu = ((np.bincount(key, weights=WTs.ravel(), minlength=N * D) + 0.5)
          / (np.bincount(key, weights=Ws.ravel(), minlength=N * D) + 1.0)).reshape(N, D)[:, cells.score_code]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # a diverging fit is handled below
        fitted = newton_stack(_levels(cells, Xt, log_covariates), designs, counts, Ws, WTs, pen, mu, n_ramp,
                              None if warm is None else warm.get(n_ramp))
    # A fit whose Newton system is singular (a cross-fit fold of a bootstrap replicate with as many
    # labelled rows as coefficients, labels all on one side) has no finite index: it gets the constant
    # index, as a fit without labels does, so the isotonic stage predicts its labels' mean.
    bad = ~np.isfinite(fitted).all(axis=1)
    if bad.any():
        fitted[bad] = 0.0
        log.debug("two-stage: %d of %d logit fits diverged; constant index (the fold's mean label)",
                  int(bad.sum()), bad.size)
    theta[sel] = fitted
    return theta


def fit_two_stage_many(cells: Cells, W: np.ndarray, WY: np.ndarray, C: np.ndarray,
                       clip: tuple[float, float] | None = None, n_knots: int = 6,
                       log_covariates: bool = True, warm: dict | None = None, link: str = "logit") -> TwoStageFits:
    """Fit one two-stage model per row of the per-cell sums (shape (J, G) each).

    Parameters
    ----------
    cells : Cells
        The cells the sums refer to.
    W, WY, C : ndarray, shape (J, G)
        Per fit and cell: total weight, weighted label sum, rows with positive weight.
    clip, n_knots, log_covariates, link
        As `TwoStageCalibrator`.
    warm : dict, optional
        Number of ramps -> the ramps the active-set solver starts with (e.g. the active ramps of
        the point-estimate fit). Only the number of solver rounds depends on it, not the result.

    Returns
    -------
    TwoStageFits
        Row ``j`` equals ``TwoStageCalibrator(...).fit_cells(cells, W[j], WY[j], C[j])``.
    """
    J = W.shape[0]
    Xt = TwoStageCalibrator(log_covariates=log_covariates)._xt(cells)
    p = Xt.shape[1]
    out = TwoStageFits(J, p, clip, n_knots, log_covariates, link)
    raw, n, per_score = _all_knots(cells, C, n_knots)
    out.ok = ok = n > 0
    keep = np.empty(raw.shape, dtype=bool)
    keep[:, 0] = True
    np.greater(raw[:, 1:], raw[:, :-1], out=keep[:, 1:])  # sorted: drop repeats
    sizes = keep.sum(1)
    for j in np.flatnonzero(ok & (sizes < 2)):  # one distinct score: a unit-wide ramp around it
        s_min = cells.score_values[np.flatnonzero(per_score[j])[0]]
        raw[j, :2] = s_min - 0.5, s_min + 0.5
        keep[j], sizes[j] = False, 2
        keep[j, :2] = True
    if not ok.any():
        out.Z = np.full((J, cells.size), np.nan)
        return out
    if p:
        wsum = W.sum(1)[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            x_mean = _einsum("jg,gp->jp", W, Xt) / wsum
            if p == 1:
                dev = Xt[:, 0] - x_mean
                dev *= dev
                sd = np.sqrt((W * dev).sum(1)[:, None] / wsum)
            else:
                sd = np.sqrt(_einsum("jg,jgp->jp", W, (Xt[None] - x_mean[:, None, :]) ** 2) / wsum)
        out.x_mean, out.x_scale = x_mean, np.where(sd > 0, sd, 1.0)
    refit = []
    every = ok.all() and (sizes == sizes[0]).all()
    for size in [int(sizes[0])] if every else np.unique(sizes[ok]).tolist():
        # fits with the same number of knots solve together
        js = np.arange(J) if every else np.flatnonzero(ok & (sizes == size))
        kn = (raw[keep] if every else raw[js][keep[js]]).reshape(js.size, size)
        if link == "identity":
            theta, done = _solve_all(cells, Xt, kn, *((W, WY) if every else (W[js], WY[js])), log_covariates, warm)
        else:
            theta = _solve_logit(cells, Xt, kn, *((W, WY, C) if every else (W[js], WY[js], C[js])), clip,
                                 log_covariates, warm, out.x_scale[js])
            done = np.ones(js.size, dtype=bool)
        nr = size - 1
        cum = np.zeros((js.size, size))
        np.cumsum(theta[:, :nr], axis=1, out=cum[:, 1:])
        beta_raw = theta[:, nr:nr + p]
        beta = beta_raw * out.x_scale[js]
        out.beta[js] = beta
        out.intercept[js] = theta[:, -1] + (out.x_mean[js] * beta_raw).sum(1)
        for i, j in enumerate(js.tolist()):
            out.knots[j], out.ramp[j], out.cum[j] = kn[i], theta[i, :nr], cum[i]
        refit += js[~done].tolist()
    fallback = {}
    for j in refit:  # (nearly) collinear or unsettled: the exact per-fit path (NNLS)
        m = fallback[j] = TwoStageCalibrator(n_knots, log_covariates, clip, link).fit_cells(cells, W[j], WY[j], C[j])
        out.knots[j], out.ramp[j], out.cum[j] = m.knots_, m.ramp_coef_, m._cum
        out.x_mean[j], out.x_scale[j], out.beta[j], out.intercept[j] = m.x_mean_, m.x_scale_, m.beta_, m.intercept_
    _stage2_all(out, cells, Xt, W, WY, C)
    for j, m in fallback.items():  # its own stage 2 (the same pooled data; kept for exactness)
        out.x[j], out.y[j], out.w[j] = m.x_, m.y_, m.weights_
    return out


def _stage2_all(out: TwoStageFits, cells: Cells, Xt: np.ndarray, W: np.ndarray, WY: np.ndarray,
                C: np.ndarray) -> None:
    """Stage-1 index of every fit at every cell, then every fit's isotonic stage 2 at once.

    Per fit the cells with rows are sorted by index (stable), cells with equal index pool, and
    PAVA runs on the pooled sums: as ``_stage2`` fit by fit.
    """
    J, G = W.shape
    Z = np.empty((J, G))
    rows = np.flatnonzero(out.ok).tolist()
    for j in rows:
        Z[j] = interp_flat(cells.score, out.knots[j], out.cum[j])
    if Xt.shape[1] == 1:
        Z += ((Xt[:, 0] - out.x_mean) / out.x_scale) * out.beta
    elif Xt.shape[1]:
        Z += _einsum("jgp,jp->jg", (Xt[None] - out.x_mean[:, None, :]) / out.x_scale[:, None, :], out.beta)
    Z += out.intercept[:, None]
    Z[~out.ok] = np.nan
    out.Z = Z
    # Sort each fit's index (stable). Cells are ordered by score, then covariates, so each fit's
    # index is monotone within a score: a few runs, which the stable sort (timsort) merges fast.
    flat = np.argsort(Z, axis=1, kind="stable")
    flat += _row_offsets(cells, J)
    flat = flat.ravel()
    kept = flat[C.take(flat) > 0]  # cells with rows, sorted by index within each fit, fits in order
    zs = Z.take(kept)
    n_kept = (C > 0).sum(1)
    row_start = np.cumsum(n_kept) - n_kept
    first = np.empty(zs.size, dtype=bool)
    first[0] = True
    np.greater(zs[1:], zs[:-1], out=first[1:])
    first[row_start[n_kept > 0]] = True  # a group never spans two fits
    starts = np.flatnonzero(first)
    sw = np.add.reduceat(W.take(kept), starts)
    swy = np.add.reduceat(WY.take(kept), starts)
    ux = zs[starts]
    g = np.searchsorted(starts, np.append(row_start, zs.size)).tolist()
    bounds = [(g[j], g[j + 1]) for j in rows]
    fitted = isotonic_pooled_segments(sw, swy, bounds)
    for j, (a, b), yj in zip(rows, bounds, fitted):
        out.x[j], out.w[j], out.y[j] = ux[a:b], sw[a:b], yj


def _row_offsets(cells: Cells, J: int) -> np.ndarray:
    """``j * G`` for each of J rows, shape (J, 1): row-wise indices into a flattened (J, G) array."""
    cache = _cells_cache(cells)
    off = cache.get(("rows", J))
    if off is None:
        off = cache[("rows", J)] = (np.arange(J) * cells.size)[:, None]
    return off
