"""Overlap and weight diagnostics of one target: TTC, the CLE floor, judge-score affinity, DR orthogonality."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.offpolicy.estimators import estimate_weighted
from cje_engine.offpolicy.weights import log_importance_weights, mean_one_weights


@dataclass(frozen=True)
class TTCResult:
    """Target-typical coverage.

    ``ttc`` = beta = share of logged rows inside the target-typical region T;
    ``alpha`` = the target's probability mass on T (~ ``mass`` by construction);
    ``threshold`` = surprisal cut-off defining T; ``reference`` = "fresh" or "weighted-logs".
    """

    ttc: float
    alpha: float
    threshold: float
    in_region: np.ndarray = field(repr=False)
    reference: str
    per_token: bool


def _weighted_quantile(x: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(x, kind="stable")
    cum = np.cumsum(weights[order])
    cum = cum / cum[-1]
    idx = int(np.searchsorted(cum, q - 1e-12))
    return float(x[order[min(idx, x.shape[0] - 1)]])


def target_typical_coverage(logger_logprob: np.ndarray, target_logprob: np.ndarray, *, mass: float = 0.9,
                            lengths: np.ndarray | None = None,
                            fresh_target_logprob: np.ndarray | None = None,
                            fresh_lengths: np.ndarray | None = None) -> TTCResult:
    """TTC: the logger's probability of producing a response typical of the target.

    Surprisal u(a) = -log pi'(a|x), per token when ``lengths`` are given. The target-typical
    region is T = {u <= t}, with t the ``mass``-quantile (0.9) of u under the target, so T holds
    ~90% of the target's mass. t is taken from the target's own fresh draws when their target
    log-probabilities are given (``reference="fresh"``), else from the logged rows weighted by the
    self-normalised importance weights (``"weighted-logs"``; biased when the weights degenerate).
    TTC = beta = share of logged rows inside T. Identical policies give TTC ~ ``mass``.
    """
    if not 0 < mass < 1:
        raise CJEInputError(f"TTC mass must lie in (0, 1), got {mass}")
    lp1 = np.asarray(target_logprob, dtype=float)
    log_w = log_importance_weights(logger_logprob, lp1)
    u = -lp1 if lengths is None else -lp1 / np.asarray(lengths, dtype=float)
    per_token = lengths is not None
    if fresh_target_logprob is not None:
        fl = np.asarray(fresh_target_logprob, dtype=float)
        if per_token and fresh_lengths is None:
            raise CJEInputError("per-token TTC needs the fresh draws' lengths too", column="response_length",
                                source="<fresh>")
        fu = -fl if not per_token else -fl / np.asarray(fresh_lengths, dtype=float)
        t = float(np.quantile(fu, mass, method="inverted_cdf"))
        alpha = float(np.mean(fu <= t))
        reference = "fresh"
    else:
        W = mean_one_weights(log_w)
        finite = np.isfinite(u)
        t = _weighted_quantile(u[finite], W[finite], mass)
        alpha = float(np.sum(W[u <= t]) / np.sum(W))
        reference = "weighted-logs"
    in_region = u <= t
    return TTCResult(float(np.mean(in_region)), alpha, t, in_region, reference, per_token)


@dataclass(frozen=True)
class CLEResult:
    """Coverage-limited efficiency floor: ``SE >= sigma_T * alpha / sqrt(beta n) * sqrt(1 + chi2_T)``.

    ``factor = alpha / sqrt(beta) * sqrt(1 + chi2_T)`` is the inflation over an on-policy sample
    of the same size; ``floor_se`` the resulting lower bound on any logs-only standard error.
    """

    factor: float
    floor_se: float
    sigma_T: float
    chi2_T: float


def cle_floor(W: np.ndarray, rewards: np.ndarray, ttc: TTCResult) -> CLEResult:
    """CLE floor from mean-one weights, rewards and the target-typical region (see `CLEResult`).

    ``chi2_T`` is the variance of the weights inside T renormalised to mean one there (shape
    mismatch within T); ``sigma_T`` the target-weighted SD of the rewards inside T.
    """
    n = W.shape[0]
    T = ttc.in_region
    beta = ttc.ttc
    if beta <= 0 or not T.any() or W[T].sum() <= 0:
        return CLEResult(float("inf"), float("inf"), float("nan"), float("inf"))
    wt = W[T] / W[T].mean()
    chi2 = float(np.var(wt))
    p = W[T] / W[T].sum()
    mu = float(np.sum(p * rewards[T]))
    sigma = float(np.sqrt(np.sum(p * (rewards[T] - mu) ** 2)))
    factor = ttc.alpha / np.sqrt(beta) * np.sqrt(1.0 + chi2)
    return CLEResult(float(factor), float(sigma * factor / np.sqrt(n)), sigma, chi2)


def judge_score_affinity(logged_scores: np.ndarray, *, target_scores: np.ndarray | None = None,
                         weights: np.ndarray | None = None, max_categories: int = 50, n_bins: int = 20) -> float:
    """Bhattacharyya affinity ``sum_b sqrt(p_b q_b)`` of the judge-score distributions.

    p: logged scores; q: the target's fresh-draw scores when given, else the logged scores
    reweighted by ``weights`` (the importance-weighted estimate of the target's distribution).
    Scores with at most ``max_categories`` distinct values are compared value by value, others
    on ``n_bins`` equal-width bins over the joint range. 1 = same distribution, 0 = disjoint.
    """
    s0 = np.asarray(logged_scores, dtype=float)
    if target_scores is None and weights is None:
        raise CJEInputError("judge-score affinity needs the target's fresh scores or importance weights")
    if target_scores is not None:
        s1 = np.asarray(target_scores, dtype=float)
        w1 = np.ones_like(s1)
    else:
        s1 = s0
        w1 = np.asarray(weights, dtype=float)
    both = np.concatenate([s0, s1])
    uniq = np.unique(both)
    if uniq.shape[0] <= max_categories:
        i0, i1 = np.searchsorted(uniq, s0), np.searchsorted(uniq, s1)
        nb = uniq.shape[0]
    else:
        edges = np.linspace(both.min(), both.max(), n_bins + 1)
        i0 = np.clip(np.searchsorted(edges, s0, side="right") - 1, 0, n_bins - 1)
        i1 = np.clip(np.searchsorted(edges, s1, side="right") - 1, 0, n_bins - 1)
        nb = n_bins
    p = np.bincount(i0, minlength=nb).astype(float)
    q = np.bincount(i1, weights=w1, minlength=nb)
    p, q = p / p.sum(), q / q.sum()
    return float(min(1.0, np.sum(np.sqrt(p * q))))


@dataclass(frozen=True)
class Orthogonality:
    """DR orthogonality check: mean of W (R - q) over logged rows with a clustered CI.

    A CI covering 0 means the weighted residual correction adds no detectable signal: the
    outcome model already explains the logged rewards (DR ~ its outcome model)."""

    mean: float
    se: float
    ci: tuple[float, float]


def dr_orthogonality(W: np.ndarray, W_if: np.ndarray, rewards: np.ndarray, q_logged: np.ndarray,
                     clusters: np.ndarray, level: float = 0.95) -> Orthogonality:
    """Orthogonality check of the DR estimator: the weighted mean of the outcome model's residuals.

    Parameters
    ----------
    W, W_if : numpy.ndarray
        The mean-one weights used and those standing in for them in the influence function.
    rewards, q_logged : numpy.ndarray
        Calibrated rewards and the outcome model on the logged rows.
    clusters : numpy.ndarray
        Prompt clusters of the rows.
    level : float
        Level of the interval.

    Returns
    -------
    Orthogonality
        The residual mean, its SE and interval (near 0 when the outcome model is orthogonal to the weights).
    """
    est = estimate_weighted("orthogonality", W, W_if, rewards - q_logged, clusters)
    return Orthogonality(est.value, est.se, est.ci(level))


@dataclass(frozen=True)
class Diagnostics:
    """Per-target weight and overlap diagnostics (see docs/offpolicy.md for each)."""

    n: int
    ess_raw: float
    ess_stabilised: float
    max_share_raw: float
    max_share_stabilised: float
    q995_raw: float
    q995_stabilised: float
    hill_index: float
    log_mean_weight: float
    log10_weight_span: float
    ttc: float
    ttc_alpha: float
    ttc_reference: str
    cle_factor: float
    cle_floor_se: float
    affinity: float
    affinity_reference: str
    simcal_alpha: float
    simcal_coef: Mapping[str, float]
    simcal_projection: str
    orthogonality: Orthogonality | None = None

    @property
    def ess_uplift(self) -> float:
        """Stabilised over raw effective sample size (inf when the raw ESS is 0)."""
        return self.ess_stabilised / self.ess_raw if self.ess_raw > 0 else float("inf")
