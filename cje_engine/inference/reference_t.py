"""The audit's reference distribution: Student-t with ``df`` degrees of freedom, the normal when ``df``
is None or inf (`cje_engine.audit` tests with it; `cje_engine.inference.selective` inverts the same test)."""
from __future__ import annotations

import functools
import math

from scipy.stats import norm
from scipy.stats import t as student_t


def _is_normal(df: float | None) -> bool:
    return df is None or math.isinf(df)


@functools.lru_cache(maxsize=4096)
def t_ppf(q: float, df: float) -> float:
    """``scipy.stats.t.ppf(q, df)`` as a float, remembered (the same number: a finalize asks for the same few
    quantiles once per segment cell, and each call costs more than the quantile)."""
    return float(student_t.ppf(q, df))


def quantile(q: float, df: float | None) -> float:
    """Quantile ``q`` of t with ``df`` degrees of freedom (the normal when ``df`` is None or inf)."""
    return float(norm.ppf(q)) if _is_normal(df) else t_ppf(float(q), float(df))


def upper_quantile(p: float, df: float | None) -> float:
    """The point with upper tail ``p`` (``quantile(1 - p)``, computed without the cancellation)."""
    return float(norm.isf(p) if _is_normal(df) else student_t.isf(p, df))


def two_sided_p(z: float, df: float | None) -> float:
    """Two-sided p-value of ``|z|`` (``z >= 0``) under t with ``df`` degrees of freedom."""
    return float(2 * (norm.sf(z) if _is_normal(df) else student_t.sf(z, df)))
