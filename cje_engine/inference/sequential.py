"""Claims that stay valid under repeated looks: a normal-mixture confidence sequence in information time.

A team that re-evaluates after every round of labels and stops when a comparison turns significant is
optionally stopping: at a fixed level alpha per look, the chance that some look declares a difference that
is not there grows with the number of looks (about 0.14 over five looks at alpha = 0.05 for a Gaussian
statistic). With ``looks="repeated"`` a comparison is tested against a boundary that holds at every look
at once.

The statistic of a difference is asymptotically ``Z = theta_hat sqrt(I)`` with information ``I = 1 / se^2``;
``S = Z sqrt(I)`` behaves as a Brownian motion with drift ``theta`` in information time. Mixing the
likelihood ratio ``exp(theta S - theta^2 I / 2)`` over ``theta ~ N(0, tau^2)`` gives the martingale

    M = (1 + a)^(-1/2) exp(a Z^2 / (2 (1 + a))),   a = tau^2 I,

and by Ville's inequality ``P(M >= 1/alpha at some look) <= alpha`` under ``theta = 0`` (Robbins 1970; the
asymptotic confidence sequences of Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas 2024). So

* the anytime p-value is ``min(1, 1 / M)`` and
* the interval ``theta_hat +/- se sqrt((1 + a) / a * 2 log(sqrt(1 + a) / alpha))`` covers ``theta`` at
  every look simultaneously.

``tau`` is fixed before the first look by ``planned_labels``: the boundary is tightest when the pair's own
labels reach it (``a = r n / planned``, ``r = -2 log alpha + log(1 - 2 log alpha)``, the optimum of
Waudby-Smith et al., with ``I`` proportional to the labels). Any number of looks, before or after the planned
count, stays valid; the price is a wider interval at every look (x1.55 at the planned count for
alpha = 0.05, ``sequential_width_ratio``).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["mixture_r", "information_ratio", "anytime_half_width", "anytime_p_value", "sequential_width_ratio", "pair_labels"]


def mixture_r(alpha: float) -> float:
    """``tau^2 I`` at which the two-sided boundary at level ``alpha`` is tightest.

    Parameters
    ----------
    alpha : float
        Two-sided level of the confidence sequence.

    Returns
    -------
    float
        ``-2 log alpha + log(1 - 2 log alpha)`` (Waudby-Smith et al. 2024, eq. for the optimal rho).
    """
    return -2.0 * math.log(alpha) + math.log(1.0 - 2.0 * math.log(alpha))


def information_ratio(n_labels: float, planned_labels: int, alpha: float) -> float:
    """``a = tau^2 I`` of a pair with ``n_labels`` labels when ``tau`` was set for ``planned_labels``.

    Parameters
    ----------
    n_labels : float
        The labels behind the comparison now (at least 1 is used).
    planned_labels : int
        The label count, fixed before the first look, at which the boundary is tightest.
    alpha : float
        Two-sided level.

    Returns
    -------
    float
        ``mixture_r(alpha) * n_labels / planned_labels``.
    """
    return mixture_r(alpha) * max(float(n_labels), 1.0) / float(planned_labels)


def anytime_half_width(se: float, a: float, alpha: float) -> float:
    """Half-width of the confidence sequence at information ratio ``a``.

    Parameters
    ----------
    se : float
        Standard error of the estimate at this look.
    a : float
        ``tau^2 I`` (`information_ratio`).
    alpha : float
        Two-sided level.

    Returns
    -------
    float
        ``se * sqrt((1 + a) / a * 2 log(sqrt(1 + a) / alpha))``.
    """
    return float(se * math.sqrt((1.0 + a) / a * 2.0 * math.log(math.sqrt(1.0 + a) / alpha)))


def anytime_p_value(diff: float, se: float, a: float) -> float:
    """Anytime-valid two-sided p-value ``min(1, 1 / M)`` of ``diff = 0`` (module docstring).

    Parameters
    ----------
    diff, se : float
        The estimate and its standard error at this look.
    a : float
        ``tau^2 I`` (`information_ratio`).

    Returns
    -------
    float
        ``min(1, sqrt(1 + a) exp(-a z^2 / (2 (1 + a))))`` with ``z = diff / se``; 0 for a nonzero
        difference with no error, 1 for a zero one.
    """
    if not se > 0:
        return 0.0 if diff != 0 else 1.0
    z2 = (diff / se) ** 2
    log_p = 0.5 * math.log1p(a) - a * z2 / (2.0 * (1.0 + a))
    return float(min(1.0, math.exp(log_p)))


def sequential_width_ratio(alpha: float = 0.05) -> float:
    """Width of the confidence sequence at its planned count over the fixed-look normal interval.

    Parameters
    ----------
    alpha : float
        Two-sided level.

    Returns
    -------
    float
        ``anytime_half_width(1, mixture_r(alpha), alpha) / z_{1 - alpha/2}`` (1.55 at alpha = 0.05).
    """
    from cje_engine.inference.distributions import norm_ppf

    return anytime_half_width(1.0, mixture_r(alpha), alpha) / float(norm_ppf(1 - alpha / 2))


def pair_labels(labels: np.ndarray | None, a: int, b: int, fallback: float) -> float:
    """The labels behind a comparison of policies ``a`` and ``b``: the smaller own-label count of the two
    (the verified levels' information grows with it), or ``fallback`` (the calibration labels) when a
    policy has none of its own (a trusted assumes-transport level)."""
    if labels is None:
        return fallback
    n = min(float(labels[a]), float(labels[b]))
    return n if n > 0 else fallback
