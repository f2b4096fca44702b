"""The normal, Student-t and chi-squared functions the engine uses, on `scipy.special`.

Each is the number ``scipy.stats`` gives for valid arguments (its ``norm``, ``t`` and ``chi2`` call these same
special functions after their argument checks; `tests/unit/test_distributions.py` compares them), without
importing ``scipy.stats``: ~0.4-1 CPU s at the start of every process that evaluates (a flow run, a `cje`
command, a Ray worker), which imported it for a handful of quantiles.  Each accepts scalars or arrays and
returns what the special function returns (a numpy float or array).
"""
from __future__ import annotations

from scipy import special


def norm_ppf(q):
    """Standard normal quantile (``scipy.stats.norm.ppf``)."""
    return special.ndtri(q)


def norm_isf(p):
    """Standard normal upper-tail quantile (``scipy.stats.norm.isf``): ``-norm_ppf(p)``, no cancellation."""
    return -special.ndtri(p)


def norm_cdf(x):
    """Standard normal distribution function (``scipy.stats.norm.cdf``)."""
    return special.ndtr(x)


def norm_sf(x):
    """Standard normal upper tail (``scipy.stats.norm.sf``): ``norm_cdf(-x)``, no cancellation."""
    return special.ndtr(-x)


def t_ppf(q, df):
    """Student-t quantile with ``df`` degrees of freedom (``scipy.stats.t.ppf``)."""
    return special.stdtrit(df, q)


def t_cdf(x, df):
    """Student-t distribution function (``scipy.stats.t.cdf``)."""
    return special.stdtr(df, x)


def t_isf(p, df):
    """Student-t upper-tail quantile (``scipy.stats.t.isf``)."""
    return -special.stdtrit(df, p)


def t_sf(x, df):
    """Student-t upper tail (``scipy.stats.t.sf``)."""
    return special.stdtr(df, -x)


def chi2_sf(x, df):
    """Chi-squared upper tail with ``df`` degrees of freedom (``scipy.stats.chi2.sf``)."""
    return special.chdtrc(df, x)
