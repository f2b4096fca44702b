"""Importance weights computed in log space, weight diagnostics, and SIMCal weight stabilisation.

Raw importance weights ``w_i = exp(logp_target_i - logp_logger_i)`` of LLM responses can span
more than a hundred orders of magnitude, so nothing here ever forms ``w`` directly: weights are
kept as log-weights and turned into *mean-one* weights ``W = w / mean(w)`` by a log-sum-exp
normalisation, which is exact whenever the result is representable.

SIMCal (score-indexed monotone calibration of the weights, see ``docs/offpolicy.md``):

1. candidates: isotonic regressions of the mean-one weights on the judge score S, one
   increasing and one decreasing, each fitted out-of-fold (folds by prompt, shared with the
   reward calibrator through `cje_engine.data.frame.fold_of`);
2. stacking: simplex weights over the candidates minimising their out-of-fold squared error
   in predicting W (or, optionally, the variance of their influence-function columns);
3. variance cap: blend toward 1, ``W_blend = 1 + alpha (W_stack - 1)`` with
   ``alpha = min(1, rho / Var(W_stack))`` (so ``Var(W_blend) <= rho``);
4. mean one: the exact projection onto S-monotone, non-negative, mean-one vectors
   (`project_monotone_mean_one`), which cannot increase the variance; naive multiplicative
   rescaling is available as an option and is reported when used.
"""
from __future__ import annotations

import itertools
import logging
from typing import Sequence

import numpy as np
from scipy.special import logsumexp

from cje_engine.calibration.isotonic import isotonic_fit as _isotonic_fit
from cje_engine.calibration.isotonic import isotonic_predict as _isotonic_predict
from cje_engine.data.frame import fold_of
from cje_engine.errors import CJEInputError
from cje_engine.inference.variance import cluster_covariance

logger = logging.getLogger(__name__)

#: Sequence log-probabilities above 0 by at most this much are treated as rounding noise (set to 0).
LOG_PROB_ATOL = 1e-6


# --------------------------------------------------------------------------------------------
# log-weights
# --------------------------------------------------------------------------------------------


def as_1d(values: object, column: str, source: str | None) -> np.ndarray:
    """``values`` as a 1-d float array; `CJEInputError` naming ``column`` otherwise."""
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise CJEInputError("expected numbers", column=column, source=source) from None
    if arr.ndim != 1:
        raise CJEInputError(f"expected a 1-D array, got shape {arr.shape}", column=column, source=source)
    return arr


def _check_logprob(arr: np.ndarray, column: str, source: str | None, *, allow_neg_inf: bool) -> np.ndarray:
    bad = np.isnan(arr)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise CJEInputError(
            "log-probability is NaN; expected a finite log-probability <= 0 (teacher-forced sum over tokens)",
            column=column, row=row, source=source,
        )
    bad = np.isposinf(arr)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise CJEInputError("log-probability is +inf; expected a finite value <= 0", column=column, row=row,
                            source=source)
    if not allow_neg_inf:
        bad = np.isneginf(arr)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise CJEInputError(
                "logger log-probability is -inf, but the logger produced this response so its probability "
                "must be positive; expected a finite value <= 0",
                column=column, row=row, source=source,
            )
    bad = arr > LOG_PROB_ATOL
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise CJEInputError(
            f"log-probability {arr[row]:.6g} is positive; a sequence log-probability must be <= 0 "
            "(was a probability, a negated value or a per-token average passed instead?)",
            column=column, row=row, source=source,
        )
    return np.minimum(arr, 0.0)


def log_importance_weights(
    logger_logprob: Sequence[float] | np.ndarray,
    target_logprob: Sequence[float] | np.ndarray,
    *,
    source: str | None = None,
    logger_column: str = "base_policy_logprob",
    target_column: str = "target_policy_logprob",
) -> np.ndarray:
    """Validated log importance weights ``log w_i = logp_target_i - logp_logger_i``.

    Parameters
    ----------
    logger_logprob, target_logprob : array of shape (n,)
        Teacher-forced sequence log-probabilities of each logged response under the logger and
        the target. Logger values must be finite and <= 0; target values may be ``-inf`` (the
        target can never produce that response: weight exactly 0) but not NaN or ``+inf``.
    source, logger_column, target_column : str
        Used in error messages only.

    Returns
    -------
    ndarray of shape (n,)
        Log-weights (``-inf`` where the target probability is 0).

    Raises
    ------
    CJEInputError
        NaN/inf/positive log-probabilities, length mismatch, empty input, or all weights zero.
    """
    lp0 = as_1d(logger_logprob, logger_column, source)
    lp1 = as_1d(target_logprob, target_column, source)
    if lp0.shape[0] != lp1.shape[0]:
        raise CJEInputError(
            f"length mismatch: {lp0.shape[0]} logger log-probabilities but {lp1.shape[0]} target "
            "log-probabilities; expected one of each per logged response",
            column=target_column, source=source,
        )
    if lp0.shape[0] == 0:
        raise CJEInputError("no logged responses; expected at least one row", column=logger_column, source=source)
    lp0 = _check_logprob(lp0, logger_column, source, allow_neg_inf=False)
    lp1 = _check_logprob(lp1, target_column, source, allow_neg_inf=True)
    log_w = lp1 - lp0
    if np.all(np.isneginf(log_w)):
        raise CJEInputError(
            "all importance weights are zero: the target assigns probability 0 to every logged response, "
            "so logs cannot say anything about it; collect fresh draws from the target (Direct)",
            column=target_column, source=source,
        )
    return log_w


def mean_one_weights(log_w: np.ndarray) -> np.ndarray:
    """Mean-one weights ``W_i = w_i / mean(w)`` from log-weights by log-sum-exp normalisation.

    Exact wherever representable: the largest weight is at most ``n`` so nothing overflows;
    weights more than ~700 nats below the largest underflow to 0, which is their value to
    double precision anyway.
    """
    log_w = np.asarray(log_w, dtype=float)
    n = log_w.shape[0]
    return np.exp(log_w - logsumexp(log_w) + np.log(n))


def log_mean_weight(log_w: np.ndarray) -> float:
    """log of the mean raw weight, ``log(mean w)``; it estimates log 1 = 0 when the target's
    support lies inside the logger's, so a value far from 0 flags support mismatch or noise."""
    log_w = np.asarray(log_w, dtype=float)
    return float(logsumexp(log_w) - np.log(log_w.shape[0]))


# --------------------------------------------------------------------------------------------
# weight diagnostics
# --------------------------------------------------------------------------------------------


def ess_fraction(weights: np.ndarray) -> float:
    """Effective sample size over n: ``(sum w)^2 / (n sum w^2)`` (scale-free)."""
    w = np.asarray(weights, dtype=float)
    scale = w.max()
    if scale <= 0:
        return 0.0
    v = w / scale
    return float(v.sum() ** 2 / (w.shape[0] * np.sum(v * v)))


def max_weight_share(weights: np.ndarray) -> float:
    """Share of the total weight carried by the single largest weight."""
    w = np.asarray(weights, dtype=float)
    return float(w.max() / w.sum())


def hill_tail_index(log_w: np.ndarray, k: int | None = None) -> float:
    """Hill estimator of the tail index of the weights, computed from log-weights.

    ``alpha_hat = 1 / mean_{i<=k}(log w_(i) - log w_(k+1))`` over the k largest weights
    (default ``k = max(10, floor(0.05 n))``). Below 2 the weights' variance is infinite and
    IF standard errors are unreliable. Returns NaN when it cannot be estimated (n < 50, or zero
    weights among the top k+1) and ``inf`` when the top k+1 weights are all equal.
    """
    lw = np.sort(np.asarray(log_w, dtype=float))[::-1]
    n = lw.shape[0]
    if k is None:
        k = max(10, int(0.05 * n))
    if n < 50 or k >= n:
        return float("nan")
    top = lw[: k + 1]
    if not np.all(np.isfinite(top)):
        return float("nan")
    gap = float(np.mean(top[:k] - top[k]))
    if gap <= 0:
        return float("inf")
    return 1.0 / gap


# --------------------------------------------------------------------------------------------
# isotonic helpers (ties in S share one fitted value)
# --------------------------------------------------------------------------------------------


def isotonic_fit(s: np.ndarray, y: np.ndarray, *, increasing: bool = True,
                 sample_weight: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares isotonic regression of ``y`` on ``s`` (ties in ``s`` pooled first).

    Returns ``(knots, values)``: the distinct values of ``s`` (sorted) and the fitted level at
    each. PAVA is mean-preserving: ``sum(counts * values) == sum(y)`` (weighted).
    """
    knots, values, _ = _isotonic_fit(s, y, sample_weight, increasing=increasing)
    return knots, values


def isotonic_predict(knots: np.ndarray, values: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Evaluate a fitted isotonic curve: linear between knots, flat outside their range."""
    return _isotonic_predict(knots, values, s)


def project_monotone_mean_one(s: np.ndarray, u: np.ndarray, *, increasing: bool,
                              target_mean: float = 1.0) -> np.ndarray:
    """Exact Euclidean projection of ``u`` onto {v : v monotone in s, v >= 0, mean(v) = target_mean}.

    Ties in ``s`` share one value. With Lagrange multiplier ``lam`` for the mean constraint the
    solution is ``v = max(iso(u) + lam, 0)`` (isotonic regression commutes with adding a
    constant, and the non-negative isotonic fit is the clipped unconstrained one); ``lam`` is
    found exactly because the mean is piecewise linear in it.
    """
    if target_mean <= 0:
        raise CJEInputError(f"target_mean must be positive, got {target_mean}")
    s = np.asarray(s, dtype=float)
    u = np.asarray(u, dtype=float)
    n = u.shape[0]
    knots, g = isotonic_fit(s, u, increasing=increasing)
    counts = np.bincount(np.searchsorted(knots, s), minlength=knots.shape[0]).astype(float)
    order = np.argsort(-g, kind="stable")
    g_sorted, c_sorted = g[order], counts[order]
    csum_c = np.cumsum(c_sorted)
    csum_cg = np.cumsum(c_sorted * g_sorted)
    lam = None
    for j in range(g_sorted.shape[0]):
        cand = (n * target_mean - csum_cg[j]) / csum_c[j]
        nxt_inactive = j + 1 == g_sorted.shape[0] or g_sorted[j + 1] + cand <= 0
        if g_sorted[j] + cand > 0 and nxt_inactive:
            lam = cand
            break
    assert lam is not None  # the top level alone always gives a positive solution
    levels = np.maximum(g + lam, 0.0)
    return levels[np.searchsorted(knots, s)]


# --------------------------------------------------------------------------------------------
# simplex quadratic program (shared by SIMCal stacking and IF stacking)
# --------------------------------------------------------------------------------------------


def solve_simplex_qp(sigma: np.ndarray) -> np.ndarray:
    """Exact minimiser of ``b' sigma b`` over the simplex {b >= 0, sum b = 1}.

    ``sigma`` is a small (K <= 12) positive semi-definite matrix. The optimum lies on some
    face; on each face (support set) the equality-constrained minimiser solves the KKT system
    ``[[S, 1], [1', 0]] [b; nu] = [0; 1]`` (least squares when singular). Every face is
    enumerated and the best feasible face solution returned, so the answer is the global
    minimum, not a local one; ties go to the smallest support.
    """
    sigma = np.asarray(sigma, dtype=float)
    if sigma.ndim != 2 or sigma.shape[0] != sigma.shape[1] or sigma.shape[0] == 0:
        raise CJEInputError(f"covariance must be a non-empty square matrix, got shape {sigma.shape}")
    if not np.all(np.isfinite(sigma)):
        raise CJEInputError("covariance of the candidates contains NaN or inf")
    k = sigma.shape[0]
    if k > 12:
        raise CJEInputError(f"too many candidates to stack exactly ({k}); expected at most 12")
    sigma = 0.5 * (sigma + sigma.T)
    scale = float(np.max(np.abs(np.diag(sigma)))) or 1.0
    best_b, best_val = None, np.inf
    tol = 1e-12 * scale
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            idx = list(support)
            sub = sigma[np.ix_(idx, idx)]
            kkt = np.zeros((size + 1, size + 1))
            kkt[:size, :size] = 2.0 * sub
            kkt[:size, size] = 1.0
            kkt[size, :size] = 1.0
            rhs = np.zeros(size + 1)
            rhs[size] = 1.0
            sol = np.linalg.lstsq(kkt, rhs, rcond=None)[0]
            b_sub = sol[:size]
            if abs(b_sub.sum() - 1.0) > 1e-8 or np.any(b_sub < -1e-10):
                continue
            b = np.zeros(k)
            b[idx] = np.clip(b_sub, 0.0, None)
            b /= b.sum()
            val = float(b @ sigma @ b)
            if val < best_val - tol:
                best_b, best_val = b, val
    assert best_b is not None  # every vertex is feasible
    return best_b


# --------------------------------------------------------------------------------------------
# SIMCal
# --------------------------------------------------------------------------------------------

_DIRECTIONS = {"increasing": True, "decreasing": False}


class SIMCal:
    """Score-indexed monotone calibration of importance weights (SIMCal-W).

    Parameters
    ----------
    rho : float, default 1.0
        Variance cap on the stabilised mean-one weights. ``Var <= rho`` means
        ``ESS/n >= 1/(1+rho)`` (0.5 at the default) **(choice)**.
    n_folds : int, default 5
        Folds by prompt (`cje_engine.data.frame.fold_of`); candidates are fitted out-of-fold.
    directions : sequence of {"increasing", "decreasing"}
        Monotone candidates to stack.
    include_raw : bool, default False
        Also offer the raw mean-one weights as a candidate.
    projection : {"exact", "rescale"}, default "exact"
        Final mean-one step: exact S-monotone mean-one projection (cannot increase the
        variance; keeps the cap), or naive multiplicative rescaling (may break both).
    stack_by : {"mse", "if_variance"}, default "mse"
        Stacking criterion over the out-of-fold candidates: out-of-fold squared error in
        predicting W (super-learner stacking of estimates of E[W | S]; default **(choice)**), or
        the clustered variance of the candidates' IF columns ``C_k * y``. Variance alone prefers
        the flattest candidate (the wrong-direction fit is nearly constant), i.e. weights ~ 1
        and a biased estimate, so it is not the default (docs/offpolicy.md).

    Attributes (after `fit`)
    ------------------------
    weights_ : final stabilised mean-one weights, shape (n,)
    raw_weights_ : mean-one raw weights W, shape (n,)
    candidates_oof_ : out-of-fold candidate weights, shape (n, K)
    candidate_names_ : tuple of str
    stack_coef_ : simplex stacking weights, shape (K,)
    stacked_weights_ : ``candidates_oof_ @ stack_coef_``
    alpha_ : blend factor toward 1 (1 = no blending)
    var_stack_ : variance of the stacked weights before blending
    projection_ : "exact-increasing", "exact-decreasing" or "rescale"
    oof_ : whether candidates were fitted out-of-fold (False when only one fold has rows)
    influence_weights_ : ``weights_ + alpha_ * (raw_weights_ - stacked_weights_)``: the weights
        to use in influence functions so the smoothing of W is not mistaken for information
        (see docs/offpolicy.md)
    """

    def __init__(self, rho: float = 1.0, n_folds: int = 5,
                 directions: Sequence[str] = ("increasing", "decreasing"),
                 include_raw: bool = False, projection: str = "exact", stack_by: str = "mse") -> None:
        self.rho = rho
        self.stack_by = stack_by
        self.n_folds = n_folds
        self.directions = tuple(directions)
        self.include_raw = include_raw
        self.projection = projection

    def _validate(self) -> None:
        if not (np.isfinite(self.rho) and self.rho > 0):
            raise CJEInputError(f"SIMCal variance cap rho must be a positive number, got {self.rho!r}")
        if self.n_folds < 2:
            raise CJEInputError(f"SIMCal n_folds must be at least 2, got {self.n_folds}")
        if not self.directions and not self.include_raw:
            raise CJEInputError("SIMCal needs at least one candidate: give directions or include_raw=True")
        for d in self.directions:
            if d not in _DIRECTIONS:
                raise CJEInputError(f"unknown SIMCal direction {d!r}; expected 'increasing' or 'decreasing'")
        if self.stack_by not in ("mse", "if_variance"):
            raise CJEInputError(f"unknown stack_by {self.stack_by!r}; expected 'mse' or 'if_variance'")
        if self.projection not in ("exact", "rescale"):
            raise CJEInputError(f"unknown projection {self.projection!r}; expected 'exact' or 'rescale'")

    def fit(self, log_w: np.ndarray, scores: np.ndarray, prompt_ids: np.ndarray | None = None,
            y: np.ndarray | None = None, *, folds: np.ndarray | None = None,
            clusters: np.ndarray | None = None) -> "SIMCal":
        """Fit on log-weights and judge scores.

        Parameters
        ----------
        log_w : log importance weights, shape (n,) (see `log_importance_weights`)
        scores : judge scores S, shape (n,)
        prompt_ids : prompt of each row (folds and clusters); or give ``folds`` and ``clusters``
        y : outcome in the stacking influence function: R for IPS, R - q for DR; ``None`` stacks
            on the weights alone (IF = W - 1)
        """
        self._validate()
        log_w = np.asarray(log_w, dtype=float)
        s = as_1d(scores, "judge_score", None)
        n = log_w.shape[0]
        if s.shape[0] != n:
            raise CJEInputError(f"length mismatch: {n} weights but {s.shape[0]} judge scores", column="judge_score")
        if not np.all(np.isfinite(s)):
            row = int(np.flatnonzero(~np.isfinite(s))[0])
            raise CJEInputError("judge score is not finite", column="judge_score", row=row)
        if folds is None:
            if prompt_ids is None:
                raise CJEInputError("SIMCal needs prompt_ids (or folds and clusters)")
            folds = fold_of(np.asarray(prompt_ids), self.n_folds)
        if clusters is None:
            clusters = np.asarray(prompt_ids) if prompt_ids is not None else np.arange(n)
        folds = np.asarray(folds)
        yv = np.ones(n) if y is None else np.asarray(y, dtype=float)
        if yv.shape[0] != n or not np.all(np.isfinite(yv)):
            raise CJEInputError("SIMCal outcome y must be finite with one value per logged row")

        W = mean_one_weights(log_w)
        names: list[str] = []
        cols: list[np.ndarray] = []
        fold_ids = np.unique(folds)
        oof = fold_ids.shape[0] >= 2
        if not oof:
            logger.warning("SIMCal: all rows are in one fold; candidates are fitted in-sample")
        for d in self.directions:
            inc = _DIRECTIONS[d]
            col = np.empty(n)
            if oof:
                for f in fold_ids:
                    test = folds == f
                    knots, vals = isotonic_fit(s[~test], W[~test], increasing=inc)
                    col[test] = isotonic_predict(knots, vals, s[test])
            else:
                knots, vals = isotonic_fit(s, W, increasing=inc)
                col[:] = isotonic_predict(knots, vals, s)
            names.append(d)
            cols.append(col)
        if self.include_raw:
            names.append("raw")
            cols.append(W.copy())
        C = np.column_stack(cols)
        if C.shape[1] == 1:
            coef = np.ones(1)
        elif self.stack_by == "mse":
            # sum_k b_k = 1, so ||W - C b||^2 = b' E'E b with E_k = W - C_k: a simplex QP.
            E = W[:, None] - C
            coef = solve_simplex_qp(E.T @ E / n)
        else:
            phi = C * yv[:, None]
            coef = solve_simplex_qp(cluster_covariance(phi, clusters))
        stack = C @ coef
        var_stack = float(np.var(stack))
        alpha = 1.0 if var_stack <= self.rho else self.rho / var_stack
        blend = 1.0 + alpha * (stack - 1.0)
        if self.projection == "exact":
            best = None
            for d, inc in (("increasing", True), ("decreasing", False)):
                v = project_monotone_mean_one(s, blend, increasing=inc)
                dist = float(np.sum((v - blend) ** 2))
                if best is None or dist < best[0] - 1e-15:
                    best = (dist, v, f"exact-{d}")
            assert best is not None
            final, proj = best[1], best[2]
        else:
            m = float(blend.mean())
            if m <= 0:
                raise CJEInputError("stabilised weights have non-positive mean; cannot rescale to mean one")
            final, proj = blend / m, "rescale"

        self.raw_weights_ = W
        self.candidates_oof_ = C
        self.candidate_names_ = tuple(names)
        self.stack_coef_ = coef
        self.stacked_weights_ = stack
        self.var_stack_ = var_stack
        self.alpha_ = float(alpha)
        self.projection_ = proj
        self.oof_ = oof
        self.weights_ = final
        self.influence_weights_ = final + alpha * (W - stack)
        self.ess_before_ = ess_fraction(W)
        self.ess_after_ = ess_fraction(final)
        return self
