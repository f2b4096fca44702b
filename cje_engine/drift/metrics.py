"""Per-look drift statistics: paired means, the score distribution, and rank agreement.

Every test here is valid when the scoring noise is shared within clusters (a prompt's anchors):
the mean-type metrics and the distribution test use sign-flip tests over clusters
(`cje_engine.drift.signflip`), the rank metric a delete-one-cluster jackknife with a
within-cluster permutation test when the clusters are few. See ``docs/drift.md``.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import special

from cje_engine.drift.inputs import jsonable, t_lower_p
from cje_engine.drift.kendall import jackknife_se, pair_counts, tau_b_leave_one_out
from cje_engine.drift.signflip import sign_flip_p

#: Fewest clusters for the Student-t rank test; with fewer (or a zero SE) a permutation test.
MIN_CLUSTERS_T = 20
#: Monte Carlo permutations of the small-sample rank test.
N_PERMUTATIONS = 999


def paired_mean(d: np.ndarray, clusters: np.ndarray | None = None) -> tuple[float, float, int]:
    """Mean of paired differences with its (cluster-robust) standard error.

    Returns ``(mean, se, df)``; ``df = G - 1`` with G the number of clusters (or pairs).
    """
    n = d.shape[0]
    mean = float(d.mean())
    if clusters is None:
        se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
        return mean, se, n - 1
    G = int(clusters.max()) + 1
    u = np.bincount(clusters, weights=d - mean, minlength=G)
    se = float(math.sqrt(G / (G - 1) * np.sum(u**2)) / n) if G > 1 else float("nan")
    return mean, se, G - 1


def cluster_sums(d: np.ndarray, codes: np.ndarray | None) -> np.ndarray:
    """Sums of ``d`` within clusters (``d`` itself without clusters)."""
    if codes is None:
        return np.asarray(d, dtype=float)
    return np.bincount(codes, weights=d, minlength=int(codes.max()) + 1)


@dataclass(frozen=True)
class DistributionChange:
    """Change of the marginal score distribution between two paired scorings.

    Attributes
    ----------
    ks : float
        ``max_v |F_current(v) - F_reference(v)|``.
    tv : float
        Total-variation distance ``0.5 * sum_v |p_current(v) - p_reference(v)|``.
    p_value : float
        Bonferroni over thresholds of exact two-sided sign(-flip) tests.
    n_thresholds : int
        Thresholds with at least one discordant anchor (the Bonferroni factor).
    worst_threshold : float or None
        Threshold with the smallest p-value.
    method : str
        ``"binomial"`` (independent anchors) or the sign-flip method over clusters.
    """

    ks: float
    tv: float
    p_value: float
    n_thresholds: int
    worst_threshold: float | None
    method: str = "binomial"


def _thresholds(reference: np.ndarray, current: np.ndarray, max_thresholds: int) -> tuple[np.ndarray, float]:
    n = reference.shape[0]
    pooled = np.concatenate([reference, current])
    values = np.unique(pooled)
    cand = values[:-1]
    if cand.shape[0] > max_thresholds:
        qs = np.quantile(pooled, np.linspace(0, 1, max_thresholds + 2)[1:-1], method="lower")
        cand = np.unique(qs)
        cand = cand[cand < values[-1]]
    ref_hist = np.bincount(np.searchsorted(values, reference), minlength=values.shape[0])
    cur_hist = np.bincount(np.searchsorted(values, current), minlength=values.shape[0])
    return cand, 0.5 * float(np.abs(cur_hist - ref_hist).sum()) / n


def distribution_change(
    reference: np.ndarray,
    current: np.ndarray,
    *,
    max_thresholds: int = 32,
    clusters: np.ndarray | None = None,
) -> DistributionChange:
    """KS and TV distance between paired score distributions, with an exact test.

    For a threshold v let ``z_i = [current_i <= v] - [reference_i <= v]``; then
    ``F_cur(v) - F_ref(v) = sum_i z_i / n``. Under no drift the two scorings of a cluster are
    exchangeable, which flips the sign of the cluster sum ``z_gv``: without clusters this is the
    exact sign test ``k_v ~ Binomial(m_v, 1/2)`` over the ``m_v`` discordant anchors; with
    clusters the exact sign-flip distribution of the integer cluster sums (convolution). The
    p-value is ``min(1, L * min_v p_v)`` over the L thresholds with a non-zero ``z``.
    Thresholds are the distinct pooled values (all but the largest); with more than
    ``max_thresholds`` of them, pooled quantiles (invariant under the exchange, so still exact).
    """
    n = reference.shape[0]
    cand, tv = _thresholds(reference, current, max_thresholds)
    if cand.shape[0] == 0:
        return DistributionChange(0.0, tv, 1.0, 0, None, "binomial" if clusters is None else "sign_flip")
    z = (current[None, :] <= cand[:, None]).astype(np.int64) - (reference[None, :] <= cand[:, None])
    ks = float(np.max(np.abs(z.sum(axis=1))) / n)
    if clusters is None:
        k = np.sum(z == 1, axis=1)
        m = k + np.sum(z == -1, axis=1)
        informative = m > 0
        ki, mi = k[informative], m[informative]
        # two-sided exact binomial(m, 1/2) p-value; by symmetry P(K >= k) = P(K <= m - k)
        p = np.minimum(1.0, 2.0 * special.bdtr(np.minimum(ki, mi - ki), mi, 0.5))
        method = "binomial"
    else:
        G = int(clusters.max()) + 1
        zg = np.stack([np.bincount(clusters, weights=row, minlength=G) for row in z])
        informative = np.any(zg != 0, axis=1)
        tests = [sign_flip_p(row) for row in zg[informative]]
        p = np.array([t[0] for t in tests])
        method = "sign_flip_" + (tests[int(np.argmin(p))][1] if tests else "none")
    L = int(informative.sum())
    if L == 0:
        return DistributionChange(ks, tv, 1.0, 0, None, method)
    j = int(np.argmin(p))
    return DistributionChange(ks, tv, float(min(1.0, L * p[j])), L, float(cand[informative][j]), method)


# --------------------------------------------------------------------------------------------
# Rank agreement: between-scoring tau against within-scoring tau
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankChange:
    """Kendall-tau agreement of the current judge with the reference judge, against a baseline.

    ``estimate = mean_{b in B, c in R} tau(b, c) - mean_{within pairs} tau``: B are the
    reference judge's scorings (reference and replicates), R the recent looks (the current one
    last), within pairs are the pairs inside B and inside R. Zero in expectation under no drift
    (all scorings exchangeable); negative when the current judge ranks the anchors differently
    from the reference judge (its scorings agree with each other more than with the reference's).
    """

    estimate: float
    se: float
    df: int
    p_value: float
    method: str
    n_between: int
    n_within: int
    tau_between: float
    tau_within: float
    tau_within_reference: float | None


def _mean_tau(pairs: list[tuple[np.ndarray, np.ndarray]], codes: np.ndarray | None
              ) -> tuple[float, np.ndarray, list[float]]:
    taus, loos = zip(*(tau_b_leave_one_out(a, b, codes) for a, b in pairs))
    return float(np.mean(taus)), np.mean(np.stack(loos), axis=0), list(taus)


def _tau_plain(a: np.ndarray, b: np.ndarray) -> float:
    pc = pair_counts(a, b)
    if pc.Tx <= 0 or pc.Ty <= 0:
        return float("nan")
    return pc.S / math.sqrt(float(pc.Tx) * float(pc.Ty))


def _rank_statistic(scorings: np.ndarray, n_ref: int) -> float:
    k = scorings.shape[0]
    between = [_tau_plain(scorings[i], scorings[j]) for i in range(n_ref) for j in range(n_ref, k)]
    within = [_tau_plain(scorings[i], scorings[j]) for i, j in itertools.combinations(range(k), 2)
              if (i < n_ref) == (j < n_ref)]
    return float(np.nanmean(between) - np.nanmean(within))


def _permutation_p(scorings: np.ndarray, n_ref: int, codes: np.ndarray | None, observed: float,
                   n_perm: int) -> float:
    """Lower-tail p-value: scorings relabelled at random within each cluster (exchangeable)."""
    rng = np.random.default_rng(0)  # fixed: the p-value is a deterministic function of the data
    k, n = scorings.shape
    unit = np.arange(n) if codes is None else codes
    G = int(unit.max()) + 1
    cols = np.arange(n)
    hits = 0
    for _ in range(n_perm):
        perm = np.argsort(rng.random((G, k)), axis=1)[unit]  # (n, k): a label order per cluster
        shuffled = scorings[perm.T, cols[None, :]]
        hits += _rank_statistic(shuffled, n_ref) <= observed + 1e-12
    return (1.0 + hits) / (n_perm + 1.0)


def rank_change(
    references: list[np.ndarray],
    recent: list[np.ndarray],
    codes: np.ndarray | None = None,
    *,
    n_permutations: int = N_PERMUTATIONS,
) -> RankChange:
    """Between-minus-within Kendall agreement of the recent looks with the reference scorings.

    Parameters
    ----------
    references : list of ndarray, shape (n,)
        The reference judge's scorings of the anchors (reference first, then replicates).
    recent : list of ndarray, shape (n,)
        The recent looks, the current one last. Needs ``len(references) + len(recent) >= 3``.
    codes : ndarray of int, optional
        Cluster of each anchor.

    Returns
    -------
    RankChange
        One-sided p-value for ``estimate < 0``: Student t with ``G - 1`` df on the
        delete-one-cluster jackknife SE when there are at least `MIN_CLUSTERS_T` clusters and
        the SE is positive, else a within-cluster permutation test.
    """
    between = [(b, c) for b in references for c in recent]
    within_ref = list(itertools.combinations(references, 2))
    within = within_ref + list(itertools.combinations(recent, 2))
    t_b, loo_b, _ = _mean_tau(between, codes)
    t_w, loo_w, taus_w = _mean_tau(within, codes)
    est = t_b - t_w
    se = jackknife_se(loo_b - loo_w)
    G = loo_b.shape[0]
    if G >= MIN_CLUSTERS_T and np.isfinite(se) and se > 0:
        p, method = t_lower_p(est / se, G - 1), "jackknife_t"
    else:
        stacked = np.stack(list(references) + list(recent))
        p = _permutation_p(stacked, len(references), codes, est, n_permutations)
        method = f"permutation_{n_permutations}"
    t_ref = float(np.mean(taus_w[: len(within_ref)])) if within_ref else None
    return RankChange(est, se, G - 1, float(p), method, len(between), len(within), t_b, t_w, t_ref)


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricResult:
    """One drift metric at one look.

    Attributes
    ----------
    name : str
    estimate : float or None
        None when the metric could not be computed at this look (see ``note``).
    se : float or None
    ci : (lo, hi) or None
        Fixed-sample ``1 - alpha`` interval (valid for this look alone).
    ci_anytime : (lo, hi) or None
        Interval at level ``1 - alpha_spent`` of the look's test (one-sided metrics: an upper
        bound, the lower end is -inf): all of them hold simultaneously with probability >= 1 - alpha.
    null_value : float
        Value under no drift.
    p_value : float or None
        Per-look p-value for "no drift".
    alpha_spent : float
        Error budget spent by this metric at this look.
    alarm : bool
        ``p_value <= alpha_spent``.
    n : int
        Anchors (or labelled anchors) used.
    note : str
    detail : dict
    alternative : {"two-sided", "less"}
    method : str
        How the p-value was computed (``sign_flip_lattice``, ``jackknife_t``, ...).
    """

    name: str
    estimate: float | None
    se: float | None
    ci: tuple[float, float] | None
    ci_anytime: tuple[float, float] | None
    null_value: float
    p_value: float | None
    alpha_spent: float
    alarm: bool
    n: int
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    alternative: str = "two-sided"
    method: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON form (non-finite numbers as null)."""
        return jsonable(
            {
                "name": self.name,
                "estimate": self.estimate,
                "se": self.se,
                "ci": None if self.ci is None else list(self.ci),
                "ci_anytime": None if self.ci_anytime is None else list(self.ci_anytime),
                "null_value": self.null_value,
                "p_value": self.p_value,
                "alpha_spent": self.alpha_spent,
                "alarm": self.alarm,
                "n": self.n,
                "note": self.note,
                "detail": self.detail,
                "alternative": self.alternative,
                "method": self.method,
            }
        )


@dataclass(frozen=True)
class DriftLook:
    """Result of one look of a `DriftMonitor`.

    Attributes
    ----------
    look : int
        1-based index of the look within the monitor.
    n_anchors : int
        Anchors scored in both the reference and the current look.
    n_missing : int
        Reference anchors absent from the current look.
    n_labelled : int
        Paired anchors with an oracle label.
    alpha : float
        Family-wise error budget of the monitor.
    metrics : dict of str to MetricResult
    alarms : list of str
        Metrics that alarmed at this look.
    first_alarm : dict of str to int or None
        Look at which each metric first alarmed (monitor history, this look included).
    meta : dict
        Free-form labels passed to `DriftMonitor.update` (judge version, timestamp, ...).
    n_clusters : int or None
        Clusters (prompts) of the paired anchors; None when no clusters were given.
    warnings : list of str
        Conditions the guarantee depends on (e.g. no clusters given).
    """

    look: int
    n_anchors: int
    n_missing: int
    n_labelled: int
    alpha: float
    metrics: dict[str, MetricResult]
    alarms: list[str]
    first_alarm: dict[str, int | None]
    meta: dict[str, Any] = field(default_factory=dict)
    n_clusters: int | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def alarm(self) -> bool:
        """True when any metric alarmed at this look."""
        return bool(self.alarms)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON form of the look, its metrics included."""
        return jsonable(
            {
                "look": self.look,
                "n_anchors": self.n_anchors,
                "n_missing": self.n_missing,
                "n_labelled": self.n_labelled,
                "alpha": self.alpha,
                "alarm": self.alarm,
                "alarms": list(self.alarms),
                "first_alarm": dict(self.first_alarm),
                "metrics": {k: v.to_dict() for k, v in self.metrics.items()},
                "meta": dict(self.meta),
                "n_clusters": self.n_clusters,
                "warnings": list(self.warnings),
            }
        )
