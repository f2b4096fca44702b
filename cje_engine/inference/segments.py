"""Statistics of segmented evaluations: pure functions of arrays, one small function per estimand.

- `by_interval_level`: the Benjamini-Yekutieli (2005) level of the intervals of R selected out of m.
- `paired_difference`: a difference of two levels with its SE (bootstrap replicates or influence terms),
  interval and two-sided p-value.
- `group_mean_residuals`: mean residual of each group of labelled rows and its per-prompt influence.
- `wald_test`: the clustered Wald (chi-square) test that a vector of means is 0 (pseudo-inverse, df = rank).
- `score_bins`: decile bins of a score (ties kept whole).
- `reliability_bins`: a reliability diagram's bins with cluster-robust SEs.

Nothing here reads files or the clock (docs/architecture.md); `cje_engine.pipeline.segments` calls them.
"""
from __future__ import annotations

import numpy as np

from cje_engine.inference.distributions import chi2_sf, norm_cdf, norm_ppf, norm_sf, t_ppf, t_sf
from cje_engine.inference.gram import GramTerms
from cje_engine.inference.variance import cluster_cov

#: Relative eigenvalue below which a direction of the omnibus covariance counts as degenerate.
RANK_TOL = 1e-9


def by_interval_level(n_selected: int, n_family: int, alpha: float) -> float | None:
    """Benjamini-Yekutieli (2005) false-coverage-rate level ``1 - R alpha / m`` of the R selected intervals.

    Parameters
    ----------
    n_selected : int
        R, the parameters whose intervals are shown.
    n_family : int
        m, every parameter the selection chose from.
    alpha : float
        The false coverage rate to control.

    Returns
    -------
    float or None
        The marginal level of each shown interval (None when nothing is selected).
    """
    if n_selected <= 0 or n_family <= 0:
        return None
    return 1.0 - min(n_selected, n_family) * alpha / n_family


def normal_interval(estimate: float, se: float, level: float, df: float = np.inf) -> list[float]:
    """``estimate +- q se`` with ``q`` the ``(1 + level) / 2`` quantile of the normal (``df`` inf) or of Student's t."""
    q = float(norm_ppf(0.5 + level / 2) if not np.isfinite(df) else t_ppf(0.5 + level / 2, df))
    return [float(estimate - q * se), float(estimate + q * se)]


def paired_difference(est_a: float, est_b: float, reps_a: np.ndarray | None, reps_b: np.ndarray | None,
                      psi_a: np.ndarray, psi_b: np.ndarray, alpha: float, df: float = np.inf) -> dict:
    """``a - b`` with its SE, interval and two-sided p-value (H0: no difference), t reference with ``df``.

    Parameters
    ----------
    est_a, est_b : float
        The two levels.
    reps_a, reps_b : ndarray (B,) or None
        Their paired bootstrap replicates (each refits the calibrator); None: the analytic route.
    psi_a, psi_b : ndarray (n_prompts,), or `cje_engine.inference.gram.GramTerms` columns
        Their per-prompt influence terms (used when there are no replicates); the sharded path's Gram form too.
    alpha : float
        1 - the interval's level.
    df : float
        Degrees of freedom of ``diff / se`` (inf: normal): the smaller of the two levels' (own labels).

    Returns
    -------
    dict
        ``diff``, ``se``, ``ci``, ``p_value``, ``df`` (NaN where not estimable).
    """
    diff = float(est_a - est_b)
    if reps_a is not None and reps_b is not None:
        d = np.asarray(reps_a, float) - np.asarray(reps_b, float)
        d = d[np.isfinite(d)]
        se = float(np.std(d, ddof=1)) if d.size > 2 else float("nan")
    elif isinstance(psi_a, GramTerms):  # the segment cells' sparse Gram form (`cje_engine.direct.segment_terms`)
        se = float(np.sqrt(max(float(cluster_cov(np.nan_to_num(psi_a - psi_b))[0, 0]), 0.0)))
    else:
        se = float(np.sqrt(cluster_cov(np.nan_to_num(np.subtract(psi_a, psi_b)))[0, 0]))  # arrays or GramTerms
    if not (np.isfinite(diff) and np.isfinite(se) and se > 0):
        return {"diff": diff if np.isfinite(diff) else float("nan"), "se": float("nan"), "ci": None,
                "p_value": float("nan"), "df": df}
    p = norm_sf(abs(diff) / se) if not np.isfinite(df) else t_sf(abs(diff) / se, df)
    return {"diff": diff, "se": se, "ci": normal_interval(diff, se, 1 - alpha, df), "p_value": float(2 * p), "df": df}


def group_mean_residuals(prompt: np.ndarray, group: np.ndarray, resid: np.ndarray, weight: np.ndarray,
                         n_groups: int, n_prompts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted mean residual of each group and its per-prompt influence (the residual term).

    Parameters
    ----------
    prompt, group : ndarray of int (m,)
        Each labelled row's prompt (the cluster) and group (segment or score bin; -1: in no group).
    resid, weight : ndarray (m,)
        Residuals ``Y - f`` and label weights (1 / P(labelled)).
    n_groups, n_prompts : int

    Returns
    -------
    means : ndarray (n_groups,)
        NaN for an empty group.
    psi : ndarray (n_prompts, n_groups)
        ``sum over the prompt's rows in group j of w (r - mean_j) / sum_j(w)``; its `cluster_cov` is the
        covariance of the means (groups sharing prompts are correlated through it).
    n : ndarray of int (n_groups,)
        Rows per group.
    """
    keep = group >= 0
    g, p, r, w = group[keep], prompt[keep], resid[keep], weight[keep]
    den = np.bincount(g, weights=w, minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.bincount(g, weights=w * r, minlength=n_groups) / den
        contrib = w * (r - means[g]) / den[g]
    psi = np.bincount(p.astype(np.int64) * n_groups + g, weights=contrib,
                      minlength=n_prompts * n_groups).reshape(n_prompts, n_groups)
    return means, psi, np.bincount(g, minlength=n_groups)


def wald_test(delta: np.ndarray, psi: np.ndarray | None, V: np.ndarray | None = None) -> tuple[float, int, float]:
    """Clustered Wald test of H0: every entry of ``delta`` is 0.

    ``V = cluster_cov(psi)`` (prompt clusters, G/(G-1)); the statistic ``delta' V^+ delta`` on the
    eigen-directions of V above `RANK_TOL` x its largest eigenvalue, chi-square with df = that rank (a
    guard: the caller leaves out a mean that others determine, such as the last decile's beside the
    segment means of the same rows).

    Parameters
    ----------
    delta : ndarray (J,)
        The means (non-finite entries are left out, with their columns).
    psi : ndarray (n_clusters, J)
        Their per-cluster influence sums.
    V : ndarray (J, J), optional
        ``cluster_cov(psi)`` when the caller has it (``psi`` is then not read).

    Returns
    -------
    (statistic, df, p_value)
        NaN statistic and p-value with df 0 when nothing can be tested.
    """
    delta = np.asarray(delta, float)
    ok = np.isfinite(delta)
    if not ok.any():
        return float("nan"), 0, float("nan")
    V = (np.atleast_2d(cluster_cov(np.asarray(psi, float)[:, ok])) if V is None
         else np.atleast_2d(np.asarray(V, float)[np.ix_(ok, ok)]))
    vals, vecs = np.linalg.eigh(V)
    top = float(vals.max()) if vals.size else 0.0
    keep = vals > RANK_TOL * top if top > 0 else np.zeros(vals.size, bool)
    df = int(keep.sum())
    if df == 0:
        return float("nan"), 0, float("nan")
    proj = vecs[:, keep].T @ delta[ok]
    stat = float(np.sum(proj ** 2 / vals[keep]))
    return stat, df, float(chi2_sf(stat, df))


def score_bins(score: np.ndarray, n_bins: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Decile bins of ``score`` (quantile edges; ties keep a bin whole, so fewer bins may appear).

    Returns
    -------
    idx : ndarray of int (n,)
        Each value's bin (0 .. len(edges) - 2).
    edges : ndarray
        The bins' edges.
    """
    score = np.asarray(score, float)
    if score.size == 0:
        return np.empty(0, dtype=np.int64), np.array([0.0, 0.0])
    edges = np.unique(np.quantile(score, np.linspace(0, 1, n_bins + 1)))
    if edges.size == 1:
        edges = np.array([edges[0], edges[0]])
    idx = np.clip(np.searchsorted(edges, score, side="right") - 1, 0, edges.size - 2)
    return idx.astype(np.int64), edges


def reliability_bins(pred: np.ndarray, y: np.ndarray, weight: np.ndarray, prompt: np.ndarray,
                     n_bins: int = 10) -> list[dict]:
    """Reliability diagram data: labelled rows binned by decile of the calibrated prediction.

    Each bin: ``lo``, ``hi`` (prediction range), ``n``, ``mean_predicted``, ``mean_label`` (weighted) and
    ``se``, the prompt-clustered SE of ``mean_label - mean_predicted`` (None with one row).
    """
    pred, y, weight = (np.asarray(a, float) for a in (pred, y, weight))
    if pred.size == 0:
        return []
    idx, edges = score_bins(pred, n_bins)
    _, codes = np.unique(prompt, return_inverse=True)
    means, psi, n = group_mean_residuals(codes, idx, y - pred, weight, edges.size - 1, int(codes.max()) + 1)
    var = np.diag(np.atleast_2d(cluster_cov(psi)))  # every bin's variance from one covariance (each column centred)
    out = []
    for b in range(edges.size - 1):
        sel = idx == b
        if not sel.any():
            continue
        w = weight[sel]
        se = float(np.sqrt(max(var[b], 0.0))) if n[b] > 1 else None
        out.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "n": int(n[b]),
                    "mean_predicted": float(np.sum(w * pred[sel]) / np.sum(w)),
                    "mean_label": float(np.sum(w * y[sel]) / np.sum(w)), "se": se})
    return out


# ---------------------------------------------------------------- empirical-Bayes partial pooling (robust EBCI)


def _noncoverage(b: float, chi: float) -> float:
    """P(|Z + b| > chi), Z standard normal: the non-coverage of [-chi, chi] at normalised bias ``b``."""
    return float(norm_cdf(-chi - b) + norm_cdf(-chi + b))


def max_noncoverage(m2: float, chi: float) -> float:
    """The largest average non-coverage ``E r(b, chi)`` over distributions of ``b`` with ``E b^2 = m2``.

    Armstrong, Kolesar & Plagborg-Moller (2022, "Robust empirical Bayes confidence intervals"), the
    second-moment case: ``r0(t) = r(sqrt(t), chi)`` where ``t >= t0``, and the chord from ``(0, r0(0))`` to
    ``(t0, r0(t0))`` below it (the least concave majorant), ``t0`` where the chord is tangent.
    """
    from scipy.optimize import minimize_scalar

    def r0(t: np.ndarray | float) -> np.ndarray:
        b = np.sqrt(np.maximum(t, 0.0))
        return norm_cdf(-chi - b) + norm_cdf(-chi + b)

    base = float(r0(0.0))
    # t0: where the chord from (0, r0(0)) is steepest (tangent to r0): a grid over log t, then refined
    grid = np.exp(np.linspace(np.log(1e-6), np.log(max(100.0 * (chi + 1) ** 2, 10.0 * m2 + 1)), 4000))
    slope = (r0(grid) - base) / grid
    i = int(np.argmax(slope))
    lo, hi = np.log(grid[max(i - 1, 0)]), np.log(grid[min(i + 1, grid.size - 1)])
    opt = minimize_scalar(lambda u: -(float(r0(np.exp(u))) - base) / np.exp(u), bounds=(lo, hi), method="bounded",
                          options={"xatol": 1e-10})
    t0 = float(np.exp(opt.x))
    if m2 >= t0:
        return float(r0(m2))
    return base + m2 * (float(r0(t0)) - base) / t0


def robust_critical_value(m2: float, alpha: float) -> float:
    """``cva_alpha(m2)``: the half-length (in SEs of the shrunk estimate) of the robust EBCI, so that the
    average non-coverage is at most ``alpha`` whatever the distribution of the normalised bias with second
    moment ``m2`` (`max_noncoverage`)."""
    from scipy.optimize import brentq

    lo = float(norm_ppf(1 - alpha / 2))
    if m2 <= 0:
        return lo
    hi = lo + np.sqrt(m2 / alpha) + 10.0  # Chebyshev-like: the second-moment bound needs chi ~ sqrt(m2 / alpha)
    while max_noncoverage(m2, hi) > alpha:
        hi *= 2
    return float(brentq(lambda chi: max_noncoverage(m2, chi) - alpha, lo, hi))


def eb_pool(y: np.ndarray, se: np.ndarray, alpha: float) -> dict:
    """Empirical-Bayes partial pooling of levels ``y`` (SEs ``se``) toward their precision-weighted mean,
    with robust EBCIs (Armstrong, Kolesar & Plagborg-Moller 2022).

    ``mu2`` (the spread of the true levels around the mean) is the moment estimate
    ``mean((y - m)^2 - se^2)``, floored at ``2 sum se^4 / (J sum se^2)`` (the paper's floor, unit weights);
    each level is shrunk by ``w_j = mu2 / (mu2 + se_j^2)``; its interval is
    ``m + w_j (y_j - m) +- (cva_alpha(se_j^2 / mu2) w_j se_j + z_{1-alpha/2} (1 - w_j) sd(m))``: the robust
    critical value for the shrinkage bias, plus the mean's own error (added, so conservative).

    Returns
    -------
    dict
        ``mean``, ``mean_se``, ``mu2`` and per level ``estimate``, ``ci``, ``shrinkage`` (1 - w_j).
    """
    y, se = np.asarray(y, float), np.asarray(se, float)
    J = y.size
    w0 = 1.0 / se ** 2
    m = float(np.sum(w0 * y) / np.sum(w0))
    m_se = float(np.sqrt(1.0 / np.sum(w0)))
    floor = float(2 * np.sum(se ** 4) / (J * np.sum(se ** 2)))
    mu2 = max(float(np.mean((y - m) ** 2 - se ** 2)), floor)
    w = mu2 / (mu2 + se ** 2)
    z = float(norm_ppf(1 - alpha / 2))
    est = m + w * (y - m)
    half = np.array([robust_critical_value(se[j] ** 2 / mu2, alpha) * w[j] * se[j] for j in range(J)])
    half += z * (1 - w) * m_se
    return {"mean": m, "mean_se": m_se, "mu2": mu2, "estimate": est, "ci": np.stack([est - half, est + half], 1),
            "shrinkage": 1 - w}
