"""Logs-only and hybrid (off-policy) evaluation: estimators, IF stacking, diagnostics, gates, bootstrap.

Inputs are plain arrays (see `LoggedData`, `FreshData`, `Rewards`): the logged responses of a
logger policy with teacher-forced log-probabilities under the logger and one target, their judge
scores S, calibrated rewards R = f(S) from a calibrator the caller fitted, prompt ids (the
clusters), and optionally fresh draws from the target (hybrid/Direct).

Estimators (each returns an `Estimate` with a prompt-clustered influence-function SE):

- ``ips``: mean of w R with raw weights (log-space, may be astronomically noisy);
- ``snips``: sum W R / sum W (self-normalised);
- ``calibrated_ips``: mean of W~ R with SIMCal-stabilised weights W~ (`cje_engine.offpolicy.weights.SIMCal`);
- ``dr``: mean over fresh draws of q + mean over logged rows of W~ (R - q) (hybrid);
- ``direct``: mean of the fresh draws' calibrated rewards;
- ``stacked``: influence-function stacking of the candidates (simplex weights minimising the
  clustered variance of the combined influence function).

`evaluate_target` adds the diagnostics (ESS before/after stabilisation, max-weight share, 99.5th
percentile weight, Hill tail index, TTC, Bhattacharyya affinity of judge scores, the CLE floor,
DR orthogonality) and the gates (TTC >= 0.70 for logs-only, ESS/n >= 0.30), each failing gate
giving a refused or downgraded claim with a plain-language reason and a recommendation.
`bootstrap_target` is the calibration-aware cluster bootstrap: prompts are resampled, the
caller's ``refit`` callable refits the reward calibrator on each replicate, and the weight
stabiliser is refitted too. Formulas and choices are in docs/offpolicy.md.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
from scipy.stats import norm

from cje_engine.data.frame import fold_of
from cje_engine.errors import CJEInputError
from cje_engine.offpolicy.weights import (
    SIMCal,
    _as_1d,
    ess_fraction,
    hill_tail_index,
    log_importance_weights,
    log_mean_weight,
    max_weight_share,
    mean_one_weights,
    solve_simplex_qp,
)

logger = logging.getLogger(__name__)

LOGS_ONLY = ("ips", "snips", "calibrated_ips")
ALL_ESTIMATORS = ("ips", "snips", "calibrated_ips", "dr", "direct")
DEFAULT_STACK = ("snips", "calibrated_ips", "dr", "direct")


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------


def _ids(values: object, n: int, column: str, source: str | None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise CJEInputError(f"expected {n} prompt ids (one per row), got shape {arr.shape}", column=column,
                            source=source)
    arr = arr.astype(str)
    bad = np.isin(arr, ["", "nan", "None"])
    if bad.any():
        raise CJEInputError("prompt id is missing", column=column, row=int(np.flatnonzero(bad)[0]), source=source)
    return arr


def _finite(values: object, n: int, column: str, source: str | None) -> np.ndarray:
    arr = _as_1d(values, column, source)
    if arr.shape[0] != n:
        raise CJEInputError(f"length mismatch: expected {n} values (one per row), got {arr.shape[0]}",
                            column=column, source=source)
    bad = ~np.isfinite(arr)
    if bad.any():
        raise CJEInputError("value is NaN or infinite; expected a finite number", column=column,
                            row=int(np.flatnonzero(bad)[0]), source=source)
    return arr


def _lengths(values: object | None, n: int, column: str, source: str | None) -> np.ndarray | None:
    if values is None:
        return None
    arr = _finite(values, n, column, source)
    bad = arr <= 0
    if bad.any():
        raise CJEInputError("response length must be positive (tokens, or characters as a proxy)",
                            column=column, row=int(np.flatnonzero(bad)[0]), source=source)
    return arr


@dataclass(frozen=True)
class LoggedData:
    """Logged responses of the logger, with log-probabilities under the logger and one target.

    ``lengths`` (token counts, or characters as a proxy) make TTC use per-token surprisal.
    """

    prompt_ids: np.ndarray
    scores: np.ndarray
    logger_logprob: np.ndarray
    target_logprob: np.ndarray
    lengths: np.ndarray | None = None
    source: str | None = None
    target_column: str = "target_policy_logprob"
    log_w: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lp0 = _as_1d(self.logger_logprob, "base_policy_logprob", self.source)
        n = lp0.shape[0]
        log_w = log_importance_weights(lp0, self.target_logprob, source=self.source,
                                       target_column=self.target_column)
        object.__setattr__(self, "logger_logprob", np.minimum(lp0, 0.0))
        object.__setattr__(self, "target_logprob", np.minimum(np.asarray(self.target_logprob, float), 0.0))
        object.__setattr__(self, "log_w", log_w)
        object.__setattr__(self, "prompt_ids", _ids(self.prompt_ids, n, "prompt_id", self.source))
        object.__setattr__(self, "scores", _finite(self.scores, n, "judge_score", self.source))
        object.__setattr__(self, "lengths", _lengths(self.lengths, n, "response_length", self.source))

    @property
    def n(self) -> int:
        return int(self.scores.shape[0])


@dataclass(frozen=True)
class FreshData:
    """Fresh responses drawn from the target (hybrid mode), optionally with their own target
    log-probabilities (then TTC uses them as the reference for target-typical surprisal)."""

    prompt_ids: np.ndarray
    scores: np.ndarray
    target_logprob: np.ndarray | None = None
    lengths: np.ndarray | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        s = _as_1d(self.scores, "judge_score", self.source)
        n = s.shape[0]
        if n == 0:
            raise CJEInputError("no fresh draws; expected at least one row", column="judge_score", source=self.source)
        object.__setattr__(self, "scores", _finite(s, n, "judge_score", self.source))
        object.__setattr__(self, "prompt_ids", _ids(self.prompt_ids, n, "prompt_id", self.source))
        if self.target_logprob is not None:
            lp = _finite(self.target_logprob, n, "target_policy_logprob", self.source)
            bad = lp > 1e-6
            if bad.any():
                raise CJEInputError("log-probability is positive; expected <= 0", column="target_policy_logprob",
                                    row=int(np.flatnonzero(bad)[0]), source=self.source)
            object.__setattr__(self, "target_logprob", np.minimum(lp, 0.0))
        object.__setattr__(self, "lengths", _lengths(self.lengths, n, "response_length", self.source))

    @property
    def n(self) -> int:
        return int(self.scores.shape[0])


@dataclass(frozen=True)
class Rewards:
    """Calibrated rewards from the caller's calibrator.

    ``logged``: R = f(S) on logged rows; ``fresh``: f(S) on fresh draws; ``q_logged`` and
    ``q_fresh``: the DR outcome model q(x, a) on logged rows and fresh draws (default: the
    calibrated rewards themselves, i.e. q = f(S), in which case DR equals Direct exactly).
    """

    logged: np.ndarray
    fresh: np.ndarray | None = None
    q_logged: np.ndarray | None = None
    q_fresh: np.ndarray | None = None

    def checked(self, n_logged: int, n_fresh: int | None) -> "Rewards":
        logged = _finite(self.logged, n_logged, "calibrated_reward", "<rewards>")
        if (self.q_logged is None) != (self.q_fresh is None):
            raise CJEInputError("give both q_logged and q_fresh (the DR outcome model on logged rows and on "
                                "fresh draws) or neither", column="q", source="<rewards>")
        if n_fresh is None:
            if self.fresh is not None or self.q_fresh is not None:
                raise CJEInputError("fresh rewards were given but no fresh draws", column="fresh", source="<rewards>")
            return Rewards(logged)
        if self.fresh is None:
            raise CJEInputError("fresh draws were given but no calibrated rewards for them", column="fresh",
                                source="<rewards>")
        fresh = _finite(self.fresh, n_fresh, "fresh_reward", "<rewards>")
        if self.q_logged is None:
            return Rewards(logged, fresh, logged.copy(), fresh.copy())
        return Rewards(logged, fresh, _finite(self.q_logged, n_logged, "q_logged", "<rewards>"),
                       _finite(self.q_fresh, n_fresh, "q_fresh", "<rewards>"))


# --------------------------------------------------------------------------------------------
# estimates with clustered influence functions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its prompt-clustered influence function.

    ``psi[c]`` is cluster c's contribution to ``value - truth`` (sum over the cluster's rows of
    the row influence divided by the sample size); ``se = sqrt(G/(G-1) * sum psi^2)``.
    """

    name: str
    value: float
    se: float
    clusters: np.ndarray = field(repr=False)
    psi: np.ndarray = field(repr=False)

    def ci(self, level: float = 0.95) -> tuple[float, float]:
        z = float(norm.ppf(0.5 + level / 2))
        return (self.value - z * self.se, self.value + z * self.se)


def _cluster_psi(phi_over_n: np.ndarray, clusters: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    labels, inv = np.unique(clusters, return_inverse=True)
    psi = np.bincount(inv, weights=phi_over_n, minlength=labels.shape[0])
    return labels, psi


def _merge_psi(parts: Iterable[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    parts = list(parts)
    labels = np.unique(np.concatenate([p[0] for p in parts]))
    psi = np.zeros(labels.shape[0])
    for lab, val in parts:
        psi[np.searchsorted(labels, lab)] += val
    return labels, psi


def _se(psi: np.ndarray) -> float:
    g = psi.shape[0]
    factor = g / (g - 1) if g > 1 else 1.0
    return float(np.sqrt(factor * np.sum(psi * psi)))


def _make(name: str, value: float, parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> Estimate:
    labels, psi = _merge_psi(parts)
    return Estimate(name, float(value), _se(psi), labels, psi)


def estimate_ips(log_w: np.ndarray, rewards: np.ndarray, clusters: np.ndarray) -> Estimate:
    """IPS, ``mean(w R)`` with raw weights, computed as ``mean(w) * mean(W R)`` in log space.

    The value is ``inf`` when the mean raw weight overflows double precision (the gates refuse it).
    """
    W = mean_one_weights(log_w)
    n = W.shape[0]
    lmw = log_mean_weight(log_w)
    scale = float(np.exp(lmw)) if lmw <= 709.0 else float("inf")
    if not np.isfinite(scale):
        nan_psi = np.full(np.unique(clusters).shape[0], np.nan)
        return Estimate("ips", float("inf"), float("inf"), np.unique(clusters), nan_psi)
    theta1 = float(np.mean(W * rewards))
    phi = scale * (W * rewards - theta1)
    return _make("ips", scale * theta1, [_cluster_psi(phi / n, clusters)])


def estimate_snips(W: np.ndarray, rewards: np.ndarray, clusters: np.ndarray) -> Estimate:
    """SNIPS, ``sum W R / sum W``; influence ``W (R - theta) / mean(W)``."""
    n = W.shape[0]
    mw = float(W.mean())
    theta = float(np.sum(W * rewards) / np.sum(W))
    phi = W * (rewards - theta) / mw
    return _make("snips", theta, [_cluster_psi(phi / n, clusters)])


def estimate_weighted(name: str, W_used: np.ndarray, W_if: np.ndarray, y: np.ndarray,
                      clusters: np.ndarray) -> Estimate:
    """``theta = mean(W_used * y)`` with mean-one (self-normalised) weights ``W_used``.

    Influence ``W_if * (y - theta)`` (centred), the self-normalised form; ``W_if`` are the
    weights standing in for W_used in the influence function (SIMCal's ``influence_weights_``).
    """
    n = W_used.shape[0]
    theta = float(np.mean(W_used * y))
    phi = W_if * (y - theta)
    phi = phi - phi.mean()
    return _make(name, theta, [_cluster_psi(phi / n, clusters)])


def estimate_dr(W_used: np.ndarray, W_if: np.ndarray, rewards: np.ndarray, q_logged: np.ndarray,
                q_fresh: np.ndarray, clusters: np.ndarray, fresh_clusters: np.ndarray,
                name: str = "dr") -> Estimate:
    """Calibrated DR: ``mean_fresh(q) + mean_logged(W (R - q))``.

    The two samples are independent given the prompts; their influence contributions are added
    per prompt, so prompts shared by fresh and logged rows are handled as one cluster.
    """
    n, m = W_used.shape[0], q_fresh.shape[0]
    resid = rewards - q_logged
    corr = float(np.mean(W_used * resid))
    base = float(np.mean(q_fresh))
    phi_l = W_if * (resid - corr)
    phi_l = phi_l - phi_l.mean()
    phi_f = q_fresh - base
    return _make(name, base + corr, [_cluster_psi(phi_l / n, clusters), _cluster_psi(phi_f / m, fresh_clusters)])


def estimate_direct(fresh_rewards: np.ndarray, fresh_clusters: np.ndarray) -> Estimate:
    """Direct: mean calibrated reward of the target's fresh draws (treats the calibrator as fixed;
    the bootstrap adds the calibration uncertainty)."""
    m = fresh_rewards.shape[0]
    theta = float(np.mean(fresh_rewards))
    return _make("direct", theta, [_cluster_psi((fresh_rewards - theta) / m, fresh_clusters)])


@dataclass(frozen=True)
class StackedEstimate(Estimate):
    """IF-stacked estimate; ``coef`` maps candidate name to its simplex weight."""

    coef: Mapping[str, float] = field(default_factory=dict)


def stack_estimates(candidates: Sequence[Estimate] | Mapping[str, Estimate], name: str = "stacked") -> StackedEstimate:
    """Influence-function stacking: simplex weights b minimising ``b' Cov(Psi) b``.

    ``Psi`` holds the candidates' clustered influence contributions aligned on the union of
    prompts; ``Cov = G/(G-1) Psi' Psi``. The stacked value is ``sum b_k theta_k`` and its SE
    ``sqrt(b' Cov b)``, never above the best single candidate's (every vertex is feasible).
    The weights are chosen on the same data, so the SE is slightly optimistic; the bootstrap
    re-stacks in every replicate.
    """
    cands = list(candidates.values()) if isinstance(candidates, Mapping) else list(candidates)
    if not cands:
        raise CJEInputError("no candidate estimators to stack; expected at least one")
    names = [c.name for c in cands]
    if len(set(names)) != len(names):
        raise CJEInputError(f"candidate names must be distinct, got {names}")
    for c in cands:
        if not (np.isfinite(c.value) and np.all(np.isfinite(c.psi))):
            raise CJEInputError(f"candidate {c.name!r} has no finite estimate or influence function; "
                                "drop it from the stack")
    labels = np.unique(np.concatenate([c.clusters for c in cands]))
    Psi = np.zeros((labels.shape[0], len(cands)))
    for k, c in enumerate(cands):
        Psi[np.searchsorted(labels, c.clusters), k] = c.psi
    g = labels.shape[0]
    cov = (g / (g - 1) if g > 1 else 1.0) * Psi.T @ Psi
    b = solve_simplex_qp(cov)
    value = float(sum(bk * c.value for bk, c in zip(b, cands)))
    psi = Psi @ b
    return StackedEstimate(name, value, float(np.sqrt(max(b @ cov @ b, 0.0))), labels, psi,
                           coef={c.name: float(bk) for bk, c in zip(b, cands)})


# --------------------------------------------------------------------------------------------
# diagnostics
# --------------------------------------------------------------------------------------------


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
    est = estimate_weighted("orthogonality", W, W_if, rewards - q_logged, clusters)
    return Orthogonality(est.value, est.se, est.ci(level))


# --------------------------------------------------------------------------------------------
# gates
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffPolicyGates:
    """Gate thresholds (defaults from the paper, calibrated for n ~ 5k and MDE ~ 0.02).

    min_ttc: logs-only estimates are refused below it (DR is downgraded);
    min_ess_fraction: ESS/n of the weights an estimator uses; below it the variance is inflated
    more than 1/0.3 = 3.3x and the SE is unreliable (logs-only refused, DR downgraded);
    min_tail_index: raw IPS/SNIPS are downgraded when the Hill index of the weights is below it
    (infinite variance).
    """

    min_ttc: float = 0.70
    min_ess_fraction: float = 0.30
    min_tail_index: float = 2.0


@dataclass(frozen=True)
class Verdict:
    """What may be claimed from one estimator: ``"level"`` (a level claim with its CI),
    ``"downgraded"`` (report, but flag the CI as unreliable) or ``"refused"`` (no level claim)."""

    estimator: str
    claim: str
    reasons: tuple[str, ...] = ()
    recommendation: str | None = None


_RANK = {"level": 0, "downgraded": 1, "refused": 2}


def _recommendation(target: str, direct: Estimate | None) -> str:
    if direct is not None:
        lo, hi = direct.ci()
        return (f"use the Direct estimate from the fresh draws of '{target}' ({direct.value:.3f}, 95% CI "
                f"{lo:.3f} to {hi:.3f} before calibration uncertainty), which needs no overlap")
    return (f"collect fresh draws: generate responses from '{target}' on a sample of the prompts, score them "
            "with the same judge, and report the Direct estimate (mean calibrated reward of the fresh draws), "
            "which needs no overlap with the logger")


def gate_verdicts(estimates: Mapping[str, Estimate], diag: "Diagnostics", gates: OffPolicyGates,
                  target: str) -> dict[str, Verdict]:
    """Apply the gates to every estimator (see `OffPolicyGates` and docs/offpolicy.md)."""
    direct = estimates.get("direct")
    rec = _recommendation(target, direct)
    n = diag.n
    out: dict[str, Verdict] = {}
    ttc_reason = (f"only {diag.ttc:.0%} of the logged responses are typical of '{target}' (target-typical "
                  f"coverage TTC {diag.ttc:.2f} < {gates.min_ttc:.2f}): the logger rarely writes what this target "
                  f"writes, so importance weighting has a precision floor (CLE factor {diag.cle_factor:.1f}x) that "
                  "no weight stabilisation removes")

    def ess_reason(ess: float, which: str) -> str:
        return (f"the {which} weights leave an effective sample of {ess:.0%} of the {n} logged responses (< "
                f"{gates.min_ess_fraction:.0%}): the variance is inflated more than "
                f"{1 / gates.min_ess_fraction:.1f}x and the standard error itself is unreliable")

    for name, est in estimates.items():
        reasons: list[str] = []
        claim = "level"
        if name in LOGS_ONLY or name == "dr":
            fail_claim = "refused" if name in LOGS_ONLY else "downgraded"
            if not np.isfinite(est.value) or not np.isfinite(est.se):
                claim = "refused"
                reasons.append("the raw importance weights overflow double precision (their mean is "
                               f"exp({diag.log_mean_weight:.0f})), so this estimate is meaningless")
            if diag.ttc < gates.min_ttc:
                claim = max(claim, fail_claim, key=_RANK.get)
                reasons.append(ttc_reason)
            ess = diag.ess_raw if name in ("ips", "snips") else diag.ess_stabilised
            if ess < gates.min_ess_fraction:
                claim = max(claim, fail_claim, key=_RANK.get)
                reasons.append(ess_reason(ess, "raw" if name in ("ips", "snips") else "stabilised"))
            if name in ("ips", "snips") and np.isfinite(diag.hill_index) and diag.hill_index < gates.min_tail_index:
                claim = max(claim, "downgraded", key=_RANK.get)
                reasons.append(f"the largest weights are heavy-tailed (Hill tail index {diag.hill_index:.2f} < "
                               f"{gates.min_tail_index:g}): the weights' variance may be infinite, so the standard "
                               "error is unreliable")
            if name == "dr" and reasons:
                reasons.append("DR stays consistent if its outcome model is right, but its weighted correction "
                               "adds noise rather than information here")
        out[name] = Verdict(name, claim, tuple(reasons), rec if claim != "level" else None)
    stacked = estimates.get("stacked")
    if isinstance(stacked, StackedEstimate):
        reasons, claim = [], "level"
        for comp, b in stacked.coef.items():
            v = out.get(comp)
            if v is None or b <= 1e-6 or v.claim == "level":
                continue
            comp_claim = v.claim if (v.claim == "downgraded" or b >= 0.05) else "downgraded"
            claim = max(claim, comp_claim, key=_RANK.get)
            reasons.append(f"puts weight {b:.2f} on '{comp}', whose claim is {v.claim}")
        out["stacked"] = Verdict("stacked", claim, tuple(reasons), rec if claim != "level" else None)
    return out


# --------------------------------------------------------------------------------------------
# per-target evaluation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffPolicyConfig:
    """Options of `evaluate_target` / `bootstrap_target`.

    rho, n_folds, projection, simcal_stack_by: SIMCal (see `cje_engine.offpolicy.weights.SIMCal`);
    ttc_mass: target mass of the target-typical region (0.9);
    stack: candidates for IF stacking (those available are used; ``()`` disables stacking);
    level: CI level; gates: `OffPolicyGates`.
    """

    rho: float = 1.0
    n_folds: int = 5
    projection: str = "exact"
    simcal_stack_by: str = "mse"
    ttc_mass: float = 0.9
    stack: tuple[str, ...] = DEFAULT_STACK
    level: float = 0.95
    gates: OffPolicyGates = field(default_factory=OffPolicyGates)


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
        return self.ess_stabilised / self.ess_raw if self.ess_raw > 0 else float("inf")


@dataclass(frozen=True)
class TargetReport:
    """Estimates, diagnostics and verdicts for one target."""

    target: str
    estimates: Mapping[str, Estimate]
    diagnostics: Diagnostics
    verdicts: Mapping[str, Verdict]
    level: float = 0.95
    stack_candidates: tuple[str, ...] = ()

    @property
    def logs_only_verdict(self) -> Verdict:
        """Verdict on the headline logs-only estimate (calibrated IPS)."""
        return self.verdicts["calibrated_ips"]

    def to_dict(self) -> dict:
        def num(x: float) -> float | None:
            return float(x) if np.isfinite(x) else None

        d = self.diagnostics
        diag = {k: (num(v) if isinstance(v, float) else v) for k, v in d.__dict__.items()
                if k not in ("orthogonality", "simcal_coef")}
        diag["ess_uplift"] = num(d.ess_uplift)
        diag["simcal_coef"] = dict(d.simcal_coef)
        if d.orthogonality is not None:
            diag["dr_orthogonality"] = {"mean": d.orthogonality.mean, "se": d.orthogonality.se,
                                        "ci": list(d.orthogonality.ci)}
        ests = {}
        for k, e in self.estimates.items():
            lo, hi = e.ci(self.level)
            ests[k] = {"value": num(e.value), "se": num(e.se), "ci": [num(lo), num(hi)]}
            if isinstance(e, StackedEstimate):
                ests[k]["coef"] = dict(e.coef)
        verdicts = {k: {"claim": v.claim, "reasons": list(v.reasons), "recommendation": v.recommendation}
                    for k, v in self.verdicts.items()}
        return {"target": self.target, "estimates": ests, "diagnostics": diag, "verdicts": verdicts,
                "stack_candidates": list(self.stack_candidates)}


def _compute_estimates(log_w: np.ndarray, scores: np.ndarray, folds: np.ndarray, clusters: np.ndarray,
                       rw: Rewards, fresh_clusters: np.ndarray | None, config: OffPolicyConfig,
                       stack_names: Sequence[str] = ()) -> tuple[dict[str, Estimate], SIMCal, SIMCal | None]:
    W = mean_one_weights(log_w)
    R = rw.logged

    def simcal(y: np.ndarray) -> SIMCal:
        return SIMCal(rho=config.rho, n_folds=config.n_folds, projection=config.projection,
                      stack_by=config.simcal_stack_by).fit(log_w, scores, y=y, folds=folds, clusters=clusters)

    cal = simcal(R)
    ests: dict[str, Estimate] = {
        "ips": estimate_ips(log_w, R, clusters),
        "snips": estimate_snips(W, R, clusters),
        "calibrated_ips": estimate_weighted("calibrated_ips", cal.weights_, cal.influence_weights_, R, clusters),
    }
    cal_dr = None
    if rw.fresh is not None:
        assert rw.q_logged is not None and rw.q_fresh is not None and fresh_clusters is not None
        # MSE stacking ignores the outcome, so the IPS fit serves DR too; IF-variance stacking
        # stacks on the DR residuals instead.
        cal_dr = cal if config.simcal_stack_by == "mse" else simcal(R - rw.q_logged)
        ests["dr"] = estimate_dr(cal_dr.weights_, cal_dr.influence_weights_, R, rw.q_logged, rw.q_fresh,
                                 clusters, fresh_clusters)
        ests["direct"] = estimate_direct(rw.fresh, fresh_clusters)
    cands = [ests[k] for k in stack_names if k in ests and np.isfinite(ests[k].value)]
    if cands:
        ests["stacked"] = stack_estimates(cands)
    return ests, cal, cal_dr


def _stack_candidates(ests: Mapping[str, Estimate], pre: Mapping[str, Verdict], config: OffPolicyConfig
                      ) -> tuple[str, ...]:
    """Configured candidates that exist and are finite, leaving out refused ones (unless all are):
    IF variances of estimators with degenerate weights are themselves unreliable, and a stack
    trusting them would lean on exactly the estimates the gates refuse."""
    avail = [k for k in config.stack if k in ests and np.isfinite(ests[k].value) and np.isfinite(ests[k].se)]
    kept = [k for k in avail if pre[k].claim != "refused"]
    return tuple(kept or avail)


def _check_stack(config: OffPolicyConfig) -> None:
    unknown = [k for k in config.stack if k not in ALL_ESTIMATORS]
    if unknown:
        raise CJEInputError(f"unknown stacking candidate {unknown[0]!r}; expected some of {', '.join(ALL_ESTIMATORS)}")


def evaluate_target(logged: LoggedData, rewards: Rewards, fresh: FreshData | None = None, *,
                    target: str = "target", config: OffPolicyConfig | None = None) -> TargetReport:
    """Estimates, diagnostics and gated verdicts for one target policy.

    Parameters
    ----------
    logged : the logger's responses with log-probabilities under the logger and this target
    rewards : calibrated rewards (and optionally the DR outcome model), see `Rewards`
    fresh : fresh draws from the target (enables DR, Direct, and fresh-draw TTC/affinity references)
    target : name used in messages
    """
    config = config or OffPolicyConfig()
    _check_stack(config)
    rw = rewards.checked(logged.n, fresh.n if fresh is not None else None)
    folds = fold_of(logged.prompt_ids, config.n_folds)
    fresh_ids = fresh.prompt_ids if fresh is not None else None
    ests, cal, cal_dr = _compute_estimates(logged.log_w, logged.scores, folds, logged.prompt_ids, rw, fresh_ids,
                                           config)
    W = cal.raw_weights_
    ttc = target_typical_coverage(
        logged.logger_logprob, logged.target_logprob, mass=config.ttc_mass, lengths=logged.lengths,
        fresh_target_logprob=fresh.target_logprob if fresh is not None else None,
        fresh_lengths=fresh.lengths if fresh is not None else None)
    cle = cle_floor(W, rw.logged, ttc)
    if fresh is not None:
        aff = judge_score_affinity(logged.scores, target_scores=fresh.scores)
        aff_ref = "fresh"
    else:
        aff = judge_score_affinity(logged.scores, weights=W)
        aff_ref = "weighted-logs"
    finite_lw = logged.log_w[np.isfinite(logged.log_w)]
    orth = None
    if cal_dr is not None:
        assert rw.q_logged is not None
        orth = dr_orthogonality(cal_dr.weights_, cal_dr.influence_weights_, rw.logged, rw.q_logged,
                                logged.prompt_ids, config.level)
    diag = Diagnostics(
        n=logged.n,
        ess_raw=ess_fraction(W),
        ess_stabilised=ess_fraction(cal.weights_),
        max_share_raw=max_weight_share(W),
        max_share_stabilised=max_weight_share(cal.weights_),
        q995_raw=float(np.quantile(W, 0.995)),
        q995_stabilised=float(np.quantile(cal.weights_, 0.995)),
        hill_index=hill_tail_index(logged.log_w),
        log_mean_weight=log_mean_weight(logged.log_w),
        log10_weight_span=float((finite_lw.max() - finite_lw.min()) / np.log(10)),
        ttc=ttc.ttc,
        ttc_alpha=ttc.alpha,
        ttc_reference=ttc.reference + ("/per-token" if ttc.per_token else "/total"),
        cle_factor=cle.factor,
        cle_floor_se=cle.floor_se,
        affinity=aff,
        affinity_reference=aff_ref,
        simcal_alpha=cal.alpha_,
        simcal_coef=dict(zip(cal.candidate_names_, map(float, cal.stack_coef_))),
        simcal_projection=cal.projection_,
        orthogonality=orth,
    )
    stack_names = _stack_candidates(ests, gate_verdicts(ests, diag, config.gates, target), config)
    if stack_names:
        ests["stacked"] = stack_estimates([ests[k] for k in stack_names])
    verdicts = gate_verdicts(ests, diag, config.gates, target)
    for name, v in verdicts.items():
        if v.claim != "level":
            logger.info("target %s, %s: %s (%s)", target, name, v.claim, "; ".join(v.reasons))
    return TargetReport(target, ests, diag, verdicts, config.level, stack_names)


# --------------------------------------------------------------------------------------------
# calibration-aware cluster bootstrap
# --------------------------------------------------------------------------------------------

#: ``refit(logged_idx, fresh_idx) -> Rewards``: refit the reward calibrator on the replicate
#: (rows ``logged_idx`` of the logged data, with repeats) and return the rewards of exactly those
#: rows, in that order (and of ``fresh_idx`` for fresh draws, or ``None`` without fresh draws).
RefitFn = Callable[[np.ndarray, "np.ndarray | None"], Rewards]


@dataclass(frozen=True)
class BootstrapResult:
    """Replicate estimates per estimator and percentile intervals."""

    point: Mapping[str, float]
    replicates: Mapping[str, np.ndarray] = field(repr=False)
    n_boot: int
    seed: int
    level: float
    stack_candidates: tuple[str, ...] = ()

    def se(self, name: str) -> float:
        r = self.replicates[name]
        r = r[np.isfinite(r)]
        return float(np.std(r, ddof=1)) if r.shape[0] > 1 else float("nan")

    def ci(self, name: str) -> tuple[float, float]:
        """Percentile interval of the replicate estimates."""
        r = self.replicates[name]
        r = r[np.isfinite(r)]
        a = (1 - self.level) / 2
        return (float(np.quantile(r, a)), float(np.quantile(r, 1 - a)))


def bootstrap_target(logged: LoggedData, refit: RefitFn, fresh: FreshData | None = None, *,
                     n_boot: int = 2000, seed: int = 0, config: OffPolicyConfig | None = None) -> BootstrapResult:
    """Calibration-aware cluster bootstrap of every estimator for one target.

    Each replicate draws prompts with replacement (the union of logged and fresh prompts), takes
    all their logged rows and fresh draws (a prompt drawn twice contributes two clusters, both in
    the prompt's own fold), calls ``refit`` to refit the reward calibrator on the replicate, refits
    SIMCal and the IF stack weights (over the candidates chosen on the full data by
    `evaluate_target`), and records every estimate. Same seed, same numbers.
    """
    config = config or OffPolicyConfig()
    _check_stack(config)
    if n_boot < 2:
        raise CJEInputError(f"n_boot must be at least 2, got {n_boot}")
    n = logged.n
    m = fresh.n if fresh is not None else None
    all_l = np.arange(n)
    point_rw = _call_refit(refit, all_l, np.arange(m) if m is not None else None, n, m)
    folds = fold_of(logged.prompt_ids, config.n_folds)
    report = evaluate_target(logged, point_rw, fresh, config=config)
    point = report.estimates
    prompts = np.unique(np.concatenate([logged.prompt_ids] + ([fresh.prompt_ids] if fresh is not None else [])))
    g = prompts.shape[0]
    code_l = np.searchsorted(prompts, logged.prompt_ids)
    code_f = np.searchsorted(prompts, fresh.prompt_ids) if fresh is not None else None
    rng = np.random.default_rng(seed)
    reps: dict[str, list[float]] = {k: [] for k in point}

    def expand(codes: np.ndarray, mult: np.ndarray, big: int) -> tuple[np.ndarray, np.ndarray]:
        r = mult[codes]
        idx = np.repeat(np.arange(codes.shape[0]), r)
        starts = np.cumsum(r) - r
        copy = np.arange(idx.shape[0]) - np.repeat(starts, r)
        return idx, codes[idx] * big + copy

    for _ in range(n_boot):
        mult = np.bincount(rng.integers(0, g, size=g), minlength=g)
        big = int(mult.max()) + 1
        li, lc = expand(code_l, mult, big)
        if li.shape[0] == 0:
            for k in reps:
                reps[k].append(np.nan)
            continue
        fi, fc = (expand(code_f, mult, big) if code_f is not None else (None, None))
        if fi is not None and fi.shape[0] == 0:
            for k in reps:
                reps[k].append(np.nan)
            continue
        rw = _call_refit(refit, li, fi, li.shape[0], fi.shape[0] if fi is not None else None)
        ests, _, _ = _compute_estimates(logged.log_w[li], logged.scores[li], folds[li], lc, rw, fc, config,
                                        report.stack_candidates)
        for k in reps:
            reps[k].append(ests[k].value if k in ests else np.nan)
    return BootstrapResult({k: v.value for k, v in point.items()},
                           {k: np.asarray(v) for k, v in reps.items()}, n_boot, seed, config.level,
                           report.stack_candidates)


def _call_refit(refit: RefitFn, li: np.ndarray, fi: np.ndarray | None, n: int, m: int | None) -> Rewards:
    out = refit(li, fi)
    if not isinstance(out, Rewards):
        raise CJEInputError(f"refit must return a Rewards object, got {type(out).__name__}")
    return out.checked(n, m)
