"""Selective (conditional) intervals for levels reported because a transport audit failed.

Under ``level_estimator="audited"`` a policy whose audit fails is reported at its own-label
(``recalibrated``) level ``L`` (plug-in plus the mean residual on its own labels). The audit statistic is
that same residual mean ``R`` (SE ``s``), and the policy was selected for this level by the event
``|R / s| > c`` (``c``: the policy's Holm critical value as realised, the other policies' p-values held
fixed). When the calibration really transports, the audit fails exactly when the labels are extreme, and the
ordinary interval of ``L``, built from those labels, misses (docs/statistics.md, "Selective intervals after a
failed audit").

Post-selection inference by the polyhedral lemma (Lee, Sun, Sun & Taylor 2016; Fithian, Sun & Taylor 2014):
with ``(L, R)`` jointly normal, ``W = R - b L`` with ``b = Cov(L, R) / Var(L)`` is independent of ``L``, so
given ``W = w`` and the selection, ``L`` is normal with its own mean ``theta`` truncated to
``{l : |w + b l| > c s}``, a union of at most two intervals. The truncated-normal CDF at the observed ``L`` is a
pivot, monotone in ``theta``; inverting it gives an interval with conditional coverage ``1 - alpha`` whatever
the residual mean's own expectation (it is the nuisance that conditioning on ``W`` removes).

Pure functions:

* `log_normal_mass`: ``log P(u <= Z <= v)`` for standard normal ``Z``, stable in both tails (``log_ndtr``).
* `truncated_log_cdf`: ``(log F, log (1 - F))`` of a normal truncated to a union of intervals.
* `truncated_pivot`: ``F`` itself.
* `holm_threshold`: the largest p-value at which a policy is still rejected by Holm, the others fixed.
* `selection_region`: the truncation set ``{l : |w + b l| > cut}``.
* `truncated_normal_interval`: the interval by root-finding in ``theta`` (one scale per side).
* `audit_selective_interval`: the whole construction for one recalibrated level.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtri

from cje_engine.inference import reference_t
from cje_engine.inference.multiplicity import holm

#: ``ci_method`` of a level whose interval is conditional on its failed audit.
SELECTIVE = "selective"
#: How far (in units of the side's scale) the root search for an end of the interval goes before
#: declaring it unbounded on that side (the end is then clipped to the label scale by the caller).
MAX_SCALES = 1e4

Interval = tuple[float, float]


def _log1mexp(x: float) -> float:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate near 0 and far below it (Maechler 2012)."""
    if x == 0.0:
        return -math.inf
    return math.log(-math.expm1(x)) if x > -math.log(2.0) else math.log1p(-math.exp(x))


def _log_mass(u: float, v: float) -> float:
    """Scalar kernel of `log_normal_mass`."""
    u, v = float(u), float(v)  # Python floats: -inf + inf is nan without a numpy warning
    if not v > u:
        return -math.inf
    if u + v > 0:  # upper tail: mirror into the lower one (u + v is nan only for the whole line)
        u, v = -v, -u
    lhi = float(log_ndtr(v))
    return lhi + _log1mexp(min(float(log_ndtr(u)) - lhi, 0.0))


def log_normal_mass(u: np.ndarray | float, v: np.ndarray | float) -> np.ndarray:
    """``log(Phi(v) - Phi(u))`` for ``u <= v`` (``-inf`` when ``u == v``), stable in both tails.

    Parameters
    ----------
    u, v : array_like
        Lower and upper ends on the standard normal scale (``+/-inf`` allowed).

    Returns
    -------
    ndarray
        The log mass. An interval in the upper tail is mirrored into the lower one
        (``P(u <= Z <= v) = P(-v <= Z <= -u)``), where ``log_ndtr`` keeps its relative precision, and
        ``log(1 - exp(d))`` is taken by the branch that is accurate for ``d`` near 0 and far below it.
    """
    return np.vectorize(_log_mass, otypes=[float])(u, v)


def _logsumexp(a: np.ndarray) -> float:
    """``log(sum(exp(a)))`` over a handful of terms (scipy's is ~20x slower at this size)."""
    m = float(np.max(a))
    if m == -math.inf:
        return m
    return m + math.log(float(np.sum(np.exp(a - m))))


def _pieces(intervals: Sequence[Interval]) -> np.ndarray:
    a = np.asarray(intervals, dtype=float).reshape(-1, 2)
    if a.size == 0 or np.any(a[:, 0] > a[:, 1]):
        raise ValueError(f"truncation intervals must be non-empty (lo <= hi): {intervals!r}")
    return a


def truncated_log_cdf(x: float, mean: float, sd: float, intervals: Sequence[Interval]) -> tuple[float, float]:
    """``(log F(x), log(1 - F(x)))`` for ``N(mean, sd^2)`` truncated to the union of ``intervals``.

    Parameters
    ----------
    x : float
        The point (normally inside the truncation set: the observed statistic).
    mean, sd : float
        The untruncated normal's mean and standard deviation (``sd > 0``).
    intervals : sequence of (lo, hi)
        Disjoint intervals (``+/-inf`` allowed) whose union is the truncation set.

    Returns
    -------
    (float, float)
        Both tails are computed directly (never as ``1 - F``), so either is accurate when tiny.
    """
    if not sd > 0:
        raise ValueError(f"sd must be > 0, got {sd!r}")
    p = (_pieces(intervals) - mean) / sd
    t = (x - mean) / sd
    total = _logsumexp(np.array([_log_mass(a, b) for a, b in p]))
    below = _logsumexp(np.array([_log_mass(a, min(b, t)) for a, b in p]))
    above = _logsumexp(np.array([_log_mass(max(a, t), b) for a, b in p]))
    return float(below - total), float(above - total)


def truncated_pivot(x: float, mean: float, sd: float, intervals: Sequence[Interval]) -> float:
    """``F(x) = P(X <= x | X in S)`` for ``X ~ N(mean, sd^2)`` and ``S`` the union of ``intervals``."""
    return float(np.exp(truncated_log_cdf(x, mean, sd, intervals)[0]))


def holm_threshold(p: np.ndarray, k: int, alpha: float) -> float:
    """The largest p-value of test ``k`` that Holm still rejects at ``alpha``, the others held fixed.

    Parameters
    ----------
    p : ndarray, shape (m,)
        The family's unadjusted p-values (NaN entries are not in the family).
    k : int
        The test whose threshold is wanted (``p[k]`` itself is ignored).
    alpha : float

    Returns
    -------
    float
        Holm rejects test ``k`` exactly when ``p[k] <= t``. As a function of ``p[k]`` the rejection set is
        ``[0, t]`` (moving past another p-value only lowers ``p[k]``'s multiplier and keeps the other's
        product below ``alpha``), and its end is where ``(m - i + 1) p[k]`` reaches ``alpha`` at some
        position ``i``: ``t`` is the largest ``alpha / (m - i + 1)`` that is rejected when ``p[k]`` equals it.
    """
    p = np.array(p, dtype=float)
    fam = np.flatnonzero(np.isfinite(p) | (np.arange(p.size) == k))
    m = fam.size
    pos = int(np.flatnonzero(fam == k)[0])
    best = alpha / m
    for i in range(1, m + 1):
        cand = alpha / (m - i + 1)
        q = p[fam].copy()
        q[pos] = cand * (1 - 1e-12)  # just inside, so that ties with another p-value cannot decide it
        if holm(q)[pos] <= alpha:
            best = max(best, cand)
    return float(best)


def audit_critical_z(p: np.ndarray, k: int, alpha: float, df: float | None = None) -> tuple[float, float]:
    """``(c, t)``: the audit of test ``k`` fails exactly when ``|z_k| > c``; ``t = alpha``.

    Audits are not adjusted for the number of policies (`cje_engine.audit`), so the threshold is
    ``alpha`` whatever the other policies' p-values (``p`` is kept for the call's shape).

    ``c`` is the two-sided quantile of ``t`` in the audit's reference distribution: normal, or
    Student-t with ``df`` degrees of freedom (a borrowed calibrator's audit, `cje_engine.audit`).
    """
    threshold = float(alpha)
    crit = reference_t.upper_quantile(threshold / 2, df)
    return float(crit), float(threshold)


def selection_region(w: float, b: float, cut: float) -> list[Interval]:
    """The set ``{l : |w + b l| > cut}`` as intervals (``cut >= 0``).

    ``b = 0``: the event does not involve ``l``: the whole line (when ``|w| > cut``, as it is for a selected
    policy) or nothing.
    """
    if b == 0 or not np.isfinite(b):
        return [(-math.inf, math.inf)] if abs(w) > cut else []
    lo, hi = sorted(((-cut - w) / b, (cut - w) / b))
    return [(-math.inf, lo), (hi, math.inf)]


def _end(x: float, intervals: Sequence[Interval], sd: float, alpha: float, upper: bool) -> float:
    """One end of the truncated-normal interval: the mean ``theta`` at which ``x`` sits in the
    ``alpha/2`` tail (upper end: ``F(x; theta) = alpha/2``; lower end: ``1 - F(x; theta) = alpha/2``)."""
    target = math.log(alpha / 2)

    def g(theta: float) -> float:
        lf, ls = truncated_log_cdf(x, theta, sd, intervals)
        # both sides increase in theta (F decreases in theta: the family has monotone likelihood ratio)
        return (target - lf) if upper else (ls - target)

    # g increases in theta: search from x in the direction of the root, doubling the step
    sign = 1.0 if g(x) < 0 else -1.0
    near, step = x, sd
    far = x + sign * step
    while sign * g(far) < 0:  # not yet past the root
        near, step = far, step * 2
        if step > MAX_SCALES * sd:
            return sign * math.inf
        far = x + sign * step
    a, b = sorted((near, far))
    return float(brentq(g, a, b, xtol=1e-12 * max(sd, 1e-300), rtol=4 * np.finfo(float).eps, maxiter=200))


def truncated_normal_interval(x: float, intervals: Sequence[Interval], alpha: float, *,
                              sd: float | None = None, sd_lo: float | None = None,
                              sd_hi: float | None = None) -> Interval:
    """``1 - alpha`` interval for the mean of a normal observed at ``x`` given ``x in S`` (union of ``intervals``).

    Parameters
    ----------
    x : float
        The observation.
    intervals : sequence of (lo, hi)
        The truncation set (``x`` must lie in it).
    alpha : float
    sd : float, optional
        Standard deviation of the untruncated normal.
    sd_lo, sd_hi : float, optional
        Different scales for the two ends (default ``sd``): the lower end is found with ``sd_lo`` and the upper
        with ``sd_hi``. Without truncation the ends are ``x - z sd_lo`` and ``x + z sd_hi`` exactly
        (``z = Phi^-1(1 - alpha/2)``), so an ordinary asymmetric interval is recovered as the truncation recedes.

    Returns
    -------
    (lo, hi)
        ``+/-inf`` on a side whose end lies more than `MAX_SCALES` scales from ``x``.
    """
    sd_lo = sd if sd_lo is None else sd_lo
    sd_hi = sd if sd_hi is None else sd_hi
    if sd_lo is None or sd_hi is None or not (sd_lo > 0 and sd_hi > 0):
        raise ValueError("positive scales needed (sd, or sd_lo and sd_hi)")
    if not any(lo <= x <= hi for lo, hi in _pieces(intervals)):
        raise ValueError(f"the observation {x!r} is outside the truncation set {intervals!r}")
    return _end(x, intervals, sd_lo, alpha, upper=False), _end(x, intervals, sd_hi, alpha, upper=True)


def audit_selective_interval(estimate: float, ci: Interval, var_level: float, cov_level_resid: float,
                             resid: float, se_resid: float, critical_z: float, alpha: float) -> dict:
    """The interval of a recalibrated level conditional on its failed audit.

    Parameters
    ----------
    estimate : float
        The level ``L`` (augmented: plug-in plus the mean own-label residual).
    ci : (lo, hi)
        Its ordinary (unconditional, unclipped) interval; its half-widths set the two sides' scales
        (``(estimate - lo) / z`` and ``(hi - estimate) / z``), so the ordinary interval's small-sample and
        skewness corrections are kept and the result tends to it as the truncation recedes.
    var_level, cov_level_resid : float
        ``Var(L)`` and ``Cov(L, R)`` (bootstrap replicates or influence terms).
    resid, se_resid : float
        The audit's residual mean ``R`` and its SE ``s``, exactly as the audit used them.
    critical_z : float
        The selection threshold on ``|R / s|`` (`holm_threshold` on the normal scale).
    alpha : float

    Returns
    -------
    dict
        ``ci`` (the conditional interval, unclipped), ``ci_unconditional``, ``z`` (= R/s), ``critical_z``,
        ``regression_coef`` (``b``), ``truncation`` (the intervals of ``L``) and ``log_selection_mass``
        (log probability of the selection given ``W`` at ``theta = estimate``, with the upper side's scale:
        near 0 when the truncation is negligible).
    """
    z = ndtri(1 - alpha / 2)
    sd_lo = max((estimate - ci[0]) / z, 0.0)
    sd_hi = max((ci[1] - estimate) / z, 0.0)
    b = cov_level_resid / var_level if var_level > 0 else 0.0
    w = resid - b * estimate
    cut = critical_z * se_resid
    region = selection_region(w, b, cut)
    out = {"ci_unconditional": [float(ci[0]), float(ci[1])], "z": float(resid / se_resid),
           "critical_z": float(critical_z), "regression_coef": float(b),
           "truncation": [[float(lo), float(hi)] for lo, hi in region]}
    if not (sd_lo > 0 and sd_hi > 0) or not region:
        return {**out, "ci": out["ci_unconditional"], "log_selection_mass": None}
    if not any(lo <= estimate <= hi for lo, hi in region):  # only by rounding at the boundary
        eps = 1e-12 * max(1.0, abs(estimate))
        region = [(lo - eps, hi + eps) for lo, hi in region]
    lo, hi = truncated_normal_interval(estimate, region, alpha, sd_lo=sd_lo, sd_hi=sd_hi)
    p = (_pieces(region) - estimate) / sd_hi
    mass = _logsumexp(log_normal_mass(p[:, 0], p[:, 1]))
    return {**out, "ci": [float(lo), float(hi)], "log_selection_mass": mass}
