"""Confidence intervals for small-sample (own-label) statistics.

An own-label level (augmented / recalibrated) is a calibrated plug-in plus the weighted mean of the
policy's own label residuals. With 25-50 labels that mean dominates its variance, and when the
calibration does not transport (an adversarial policy) the residuals are skewed or bimodal: the
percentile bootstrap and the symmetric t interval then miss on the long-tail side
(docs/statistics.md, "Own-label intervals"; measured in benchmarks/bench_intervals.py).

Everything here is a pure function of what the engine already has: the point estimate, the
bootstrap replicates of the statistic and its per-prompt influence values (``theta_hat - theta ~
sum_c U_c`` over prompts ``c``). Nothing new is needed from a bootstrap replicate.

* `acceleration`: the BCa acceleration ``a = sum U^3 / (6 (sum U^2)^(3/2))`` (Efron 1987; the
  jackknife's value for a mean, and the first-order skewness of the statistic divided by 6).
* `bias_correction`: ``z0 = Phi^-1(share of replicates below the estimate)`` (ties count half).
* `expanded_quantile`: the t quantile of ``df`` degrees of freedom widened for the bootstrap's
  ``(n-1)/n`` variance deficit (Hesterberg 2015, "expanded percentile"): ``sqrt((df+1)/df) t_df``.
* `bca_interval`: BCa percentiles of the replicates, optionally with the expanded quantile (the
  engine's bootstrap-route choice, ``OWN_LABEL_BOOTSTRAP``).
* `skew_t_interval`: the analytic analogue, a t interval with Hall's (1992) first-order
  Edgeworth correction for skewness, whose skewness term is the same ``a`` (the analytic-route
  choice, ``OWN_LABEL_ANALYTIC``).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.special import ndtr, ndtri

from cje_engine.inference.gram import GramTerms
from cje_engine.inference.reference_t import t_ppf

#: Own-label interval methods of the bootstrap route (``percentile`` = the plug-in columns' method).
BOOTSTRAP_METHODS = ("percentile", "bca", "bca_expanded", "t_bootstrap_se")
#: Own-label interval methods of the analytic route.
ANALYTIC_METHODS = ("t", "skew_t")
#: The engine's choice for own-label levels, by route (measured: docs/statistics.md, "Own-label intervals").
OWN_LABEL_BOOTSTRAP = "bca_expanded"
OWN_LABEL_ANALYTIC = "skew_t"


def acceleration(infl: np.ndarray) -> float:
    """BCa acceleration from per-cluster influence values.

    Parameters
    ----------
    infl : ndarray, shape (G,)
        Each cluster's (prompt's) first-order contribution to the statistic's error. They are
        centred here; NaN counts as 0 (a cluster that does not enter the statistic).

    Returns
    -------
    float
        ``sum U^3 / (6 (sum U^2)^(3/2))`` with ``U`` the centred values; 0 when they are all 0.
    """
    if isinstance(infl, GramTerms):  # the sharded path's Gram form: from the moments (orders 1-3)
        return infl.acceleration()
    u = np.nan_to_num(np.asarray(infl, dtype=float))
    u = u - u.mean()
    s2 = float(np.sum(u * u))
    if not s2 > 0:
        return 0.0
    return float(np.sum(u * u * u) / (6.0 * s2**1.5))  # u * u * u: ~50x faster than u**3, within an ulp


def bias_correction(estimate: float, reps: np.ndarray) -> float:
    """BCa bias correction ``z0 = Phi^-1(#(rep < est) + #(rep == est)/2) / B)``.

    The share is kept inside ``[1/(2B), 1 - 1/(2B)]`` so that ``z0`` is finite.
    """
    r = np.asarray(reps, dtype=float)
    r = r[np.isfinite(r)]
    b = r.size
    if b == 0:
        return 0.0
    share = (np.sum(r < estimate) + 0.5 * np.sum(r == estimate)) / b
    share = min(max(share, 0.5 / b), 1.0 - 0.5 / b)
    return float(ndtri(share))


def expanded_quantile(alpha: float, df: float) -> float:
    """Upper ``1 - alpha/2`` quantile on the normal scale for an expanded bootstrap interval.

    ``sqrt((df + 1) / df) * t_{df, 1 - alpha/2}``: the t quantile for a mean of ``df + 1``
    clusters, times the factor that undoes the bootstrap variance's ``(n - 1)/n`` deficit.
    ``df = inf`` gives the normal quantile.
    """
    if not np.isfinite(df):
        return float(ndtri(1 - alpha / 2))
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df!r}")
    return float(np.sqrt((df + 1.0) / df) * t_ppf(1 - alpha / 2, float(df)))


def percentile_interval(reps: np.ndarray, alpha: float) -> tuple[float, float]:
    """Percentile interval: the ``alpha/2`` and ``1 - alpha/2`` quantiles of the finite replicates."""
    r = np.asarray(reps, dtype=float)
    r = r[np.isfinite(r)]
    lo, hi = np.quantile(r, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def bca_levels(z0: float, a: float, z: Sequence[float]) -> np.ndarray:
    """BCa's adjusted percentile levels ``Phi(z0 + (z0 + z) / (1 - a (z0 + z)))`` for normal-scale ``z``.

    Where ``1 - a (z0 + z) <= 0`` (only for |a| far beyond what a mean of two or more clusters
    can produce) the level is pushed to the end of its side (0 or 1).
    """
    z = np.asarray(z, dtype=float)
    w = z0 + z
    den = 1.0 - a * w
    with np.errstate(divide="ignore", invalid="ignore"):
        lev = ndtr(z0 + w / den)
    return np.where(den > 0, lev, (z > 0).astype(float))


def bca_interval(estimate: float, reps: np.ndarray, infl: np.ndarray, alpha: float, *,
                 df: float | None = None, accel: float | None = None) -> tuple[float, float]:
    """Bias-corrected and accelerated (BCa) bootstrap interval.

    Parameters
    ----------
    estimate : float
        The statistic on the data.
    reps : ndarray, shape (B,)
        Its bootstrap replicates (non-finite ones are dropped).
    infl : ndarray, shape (G,)
        Its per-cluster influence values (for the acceleration, `acceleration`).
    alpha : float
        Two-sided level: the interval aims at coverage ``1 - alpha``.
    df : float, optional
        Expand the interval for a small number of clusters: the normal quantile is replaced by
        `expanded_quantile` ``(alpha, df)`` (``df`` = clusters - 1). None: plain BCa.
    accel : float, optional
        ``acceleration(infl)`` when already computed (the same number; ``infl`` is then not read).

    Returns
    -------
    (lo, hi)
    """
    r = np.asarray(reps, dtype=float)
    r = r[np.isfinite(r)]
    q = float(ndtri(1 - alpha / 2)) if df is None else expanded_quantile(alpha, df)
    lev = bca_levels(bias_correction(estimate, r), acceleration(infl) if accel is None else accel, [-q, q])
    lo, hi = np.quantile(r, lev)
    return float(lo), float(hi)


def t_bootstrap_se_interval(estimate: float, reps: np.ndarray, alpha: float, df: float) -> tuple[float, float]:
    """``estimate +/- t_{df, 1-alpha/2} * SD(replicates)``: bootstrap SE with a t quantile."""
    r = np.asarray(reps, dtype=float)
    r = r[np.isfinite(r)]
    se = float(np.std(r, ddof=1))
    q = t_ppf(1 - alpha / 2, float(df))
    return estimate - q * se, estimate + q * se


def skew_t_interval(estimate: float, se: float, infl: np.ndarray, alpha: float, df: float, *,
                    accel: float | None = None) -> tuple[float, float]:
    """t interval with a first-order Edgeworth correction for skewness (Hall 1992).

    For a studentized mean, ``P(T <= x) = Phi(x) + (gamma / (6 sqrt(n))) (2 x^2 + 1) phi(x) + O(1/n)``,
    and ``gamma / (6 sqrt(n))`` is the BCa acceleration ``a`` of the influence values. Both ends move
    by ``se * a * (2 q^2 + 1)`` towards the long tail:
    ``[est - q se + a (2q^2+1) se, est + q se + a (2q^2+1) se]`` with ``q = t_{df, 1-alpha/2}``.
    ``accel``: ``acceleration(infl)`` when already computed.
    """
    q = t_ppf(1 - alpha / 2, float(df)) if np.isfinite(df) else float(ndtri(1 - alpha / 2))
    shift = (acceleration(infl) if accel is None else accel) * (2 * q * q + 1) * se
    return estimate - q * se + shift, estimate + q * se + shift


def own_label_interval(method: str, estimate: float, *, alpha: float, df: float, infl: np.ndarray,
                       se: float | None = None, reps: np.ndarray | None = None,
                       accel: float | None = None) -> tuple[float, float]:
    """The interval of one own-label statistic by the named method.

    Parameters
    ----------
    method : str
        One of `BOOTSTRAP_METHODS` (needs ``reps``) or `ANALYTIC_METHODS` (needs ``se``).
    estimate : float
    alpha : float
    df : float
        Labelled prompts - 1 (``inf`` when not a small-sample statistic).
    infl : ndarray, shape (G,)
        Per-prompt influence values of the statistic.
    se : float, optional
        Influence-function standard error (analytic methods).
    reps : ndarray, shape (B,), optional
        Bootstrap replicates (bootstrap methods).
    accel : float, optional
        ``acceleration(infl)`` when already computed (a caller that asks for two methods computes it once).
    """
    if method in BOOTSTRAP_METHODS:
        if reps is None:
            raise ValueError(f"interval method {method!r} needs bootstrap replicates")
        if method == "percentile":
            return percentile_interval(reps, alpha)
        if method == "bca":
            return bca_interval(estimate, reps, infl, alpha, accel=accel)
        if method == "bca_expanded":
            return bca_interval(estimate, reps, infl, alpha, df=df, accel=accel)
        return t_bootstrap_se_interval(estimate, reps, alpha, df)
    if method in ANALYTIC_METHODS:
        if se is None:
            raise ValueError(f"interval method {method!r} needs a standard error")
        if method == "skew_t":
            return skew_t_interval(estimate, se, infl, alpha, df, accel=accel)
        q = t_ppf(1 - alpha / 2, float(df)) if np.isfinite(df) else float(ndtri(1 - alpha / 2))
        return estimate - q * se, estimate + q * se
    raise ValueError(f"unknown interval method {method!r}; one of {BOOTSTRAP_METHODS + ANALYTIC_METHODS}")
