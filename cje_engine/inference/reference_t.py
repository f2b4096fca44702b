"""The audit's reference distribution: Student-t with ``df`` degrees of freedom, the normal when ``df``
is None or inf (`cje_engine.audit` tests with it; `cje_engine.inference.selective` inverts the same test)."""
from __future__ import annotations

import functools
import math

from cje_engine.inference import distributions as dist


def _is_normal(df: float | None) -> bool:
    return df is None or math.isinf(df)


@functools.lru_cache(maxsize=4096)
def t_ppf(q: float, df: float) -> float:
    """`cje_engine.inference.distributions.t_ppf` as a float, remembered (a finalize asks for the same few
    quantiles once per segment cell)."""
    return float(dist.t_ppf(q, df))


@functools.lru_cache(maxsize=4096)
def t_isf(p: float, df: float) -> float:
    """`cje_engine.inference.distributions.t_isf` as a float, remembered (the drift monitor asks for the same
    upper quantiles at every check)."""
    return float(dist.t_isf(p, df))


def quantile(q: float, df: float | None) -> float:
    """Quantile ``q`` of t with ``df`` degrees of freedom (the normal when ``df`` is None or inf)."""
    return float(dist.norm_ppf(q)) if _is_normal(df) else t_ppf(float(q), float(df))


def upper_quantile(p: float, df: float | None) -> float:
    """The point with upper tail ``p`` (``quantile(1 - p)``, computed without the cancellation)."""
    return float(dist.norm_isf(p)) if _is_normal(df) else t_isf(float(p), float(df))


def two_sided_p(z: float, df: float | None) -> float:
    """Two-sided p-value of ``|z|`` (``z >= 0``) under t with ``df`` degrees of freedom."""
    return float(2 * (dist.norm_sf(z) if _is_normal(df) else dist.t_sf(z, df)))
