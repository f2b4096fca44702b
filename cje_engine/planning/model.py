"""Variance model of the budget planner: validation helpers, `VarianceComponents`, `Allocation`.

``Var ~ sigma2_eval / n + sigma2_cal / m`` and ``cost = c_S r n + c_Y l m`` (see `cje_engine.planning.planner`
and docs/planner.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.inference.distributions import norm_ppf

# --------------------------------------------------------------------------------------
# validation helpers


def check_positive(value: Any, what: str, allow_zero: bool = False) -> float:
    """``value`` as a finite positive float (zero allowed with ``allow_zero``); `CJEInputError` naming ``what``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise CJEInputError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise CJEInputError(f"{what} must be {need}, got {value!r}")
    return v


def check_costs(c_S: Any, c_Y: Any) -> tuple[float, float]:
    """The checked costs of one judged response and one oracle label."""
    return (check_positive(c_S, "c_S (cost of one judged response)"),
            check_positive(c_Y, "c_Y (cost of one oracle label)"))


def check_alpha_power(alpha: Any, power: Any) -> tuple[float, float]:
    """The checked ``alpha`` and ``power``, each in (0, 1)."""
    a = float(alpha) if isinstance(alpha, (int, float)) else float("nan")
    p = float(power) if isinstance(power, (int, float)) else float("nan")
    if not 0 < a < 1:
        raise CJEInputError(f"alpha must be in (0, 1), got {alpha!r}")
    if not 0 < p < 1:
        raise CJEInputError(f"power must be in (0, 1), got {power!r}")
    return a, p


def min_labels_of(value: Any) -> int:
    """``value`` as a whole number of labels >= 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise CJEInputError(f"min_labels must be a whole number >= 1, got {value!r}")
    return int(value)


def mde_multiplier(alpha: float = 0.05, power: float = 0.8) -> float:
    """``z_{1-alpha/2} + z_power``: MDE = multiplier * SE (two-sided test at level alpha)."""
    a, p = check_alpha_power(alpha, power)
    return float(norm_ppf(1 - a / 2) + norm_ppf(p))


# --------------------------------------------------------------------------------------
# variance components


@dataclass(frozen=True)
class VarianceComponents:
    """Per-unit variance components of one estimate: ``Var ~ sigma2_eval / n + sigma2_cal / m``.

    Parameters
    ----------
    sigma2_eval : float
        Evaluation (prompt-sampling) variance per prompt, >= 0.
    sigma2_cal : float
        Calibration / label-residual variance per label, >= 0.
    target : str
        What the estimate is (``"base"`` or ``"base - clone"``).
    n_pilot, m_pilot : float, optional
        Prompts and labels (per policy) of the pilot the components came from.
    responses_per_prompt, labels_per_unit : int
        Cost multipliers ``r`` and ``l`` (module docstring).
    method : str
        How the components were obtained (plain words, shown in the plan).
    """

    sigma2_eval: float
    sigma2_cal: float
    target: str = "estimate"
    n_pilot: float | None = None
    m_pilot: float | None = None
    responses_per_prompt: int = 1
    labels_per_unit: int = 1
    method: str = "given by the user"

    def __post_init__(self) -> None:
        for name in ("sigma2_eval", "sigma2_cal"):
            object.__setattr__(self, name, check_positive(getattr(self, name), name, allow_zero=True))
        if self.sigma2_eval == 0 and self.sigma2_cal == 0:
            raise CJEInputError(f"{self.target}: both variance components are zero, so there is nothing to plan")
        for name in ("n_pilot", "m_pilot"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, check_positive(v, name))
        for name in ("responses_per_prompt", "labels_per_unit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise CJEInputError(f"{name} must be a whole number >= 1, got {v!r}")
            object.__setattr__(self, name, int(v))

    def variance(self, n: Any, m: Any) -> Any:
        """Predicted variance at ``n`` prompts and ``m`` labels (arrays broadcast)."""
        n = np.asarray(n, dtype=float)
        m = np.asarray(m, dtype=float)
        with np.errstate(divide="ignore"):
            ev = np.where(self.sigma2_eval > 0, self.sigma2_eval / n, 0.0)
            cv = np.where(self.sigma2_cal > 0, self.sigma2_cal / m, 0.0)
        out = ev + cv
        return float(out) if out.ndim == 0 else out

    def se(self, n: Any, m: Any) -> Any:
        """Predicted standard error at ``(n, m)``."""
        return np.sqrt(self.variance(n, m))

    def effective_costs(self, c_S: float, c_Y: float) -> tuple[float, float]:
        """``(c_S * responses_per_prompt, c_Y * labels_per_unit)``: cost of one unit of n and of m."""
        cs, cy = check_costs(c_S, c_Y)
        return cs * self.responses_per_prompt, cy * self.labels_per_unit

    def cost(self, n: Any, m: Any, c_S: float, c_Y: float) -> Any:
        """Total cost of ``n`` prompts and ``m`` labels."""
        cs, cy = self.effective_costs(c_S, c_Y)
        return cs * np.asarray(n, dtype=float) + cy * np.asarray(m, dtype=float)

    def shares(self, n: Any, m: Any, c_S: float, c_Y: float) -> tuple[Any, Any]:
        """(calibration share of the variance, oracle share of the budget) at ``(n, m)``."""
        cs, cy = self.effective_costs(c_S, c_Y)
        n = np.asarray(n, dtype=float)
        m = np.asarray(m, dtype=float)
        cal = self.sigma2_cal / m
        cal_share = cal / (self.sigma2_eval / n + cal)
        budget_share = cy * m / (cs * n + cy * m)
        if cal_share.ndim == 0:
            return float(cal_share), float(budget_share)
        return cal_share, budget_share

    def optimal_fraction(self, c_S: float, c_Y: float) -> float:
        """Variance-optimal oracle fraction ``m / n`` (square-root law, capped at 1)."""
        cs, cy = self.effective_costs(c_S, c_Y)
        if self.sigma2_eval == 0:
            return 1.0
        return float(min(1.0, math.sqrt(self.sigma2_cal * cs / (self.sigma2_eval * cy))))

    def pilot_variance(self) -> float | None:
        """Variance at the pilot's own size (None when the pilot size is unknown)."""
        if self.n_pilot is None or self.m_pilot is None:
            return None
        return self.variance(self.n_pilot, self.m_pilot)

    def to_dict(self) -> dict:
        """Plain dict form (read back by `from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], target: str = "estimate") -> "VarianceComponents":
        """From ``{"sigma2_eval", "sigma2_cal"[, "n_prompts", "m_labels"]}`` (the result's
        ``variance_components``) or from a `to_dict` output."""
        if not isinstance(d, Mapping):
            raise CJEInputError(f"variance components must be a mapping, got {type(d).__name__}")
        missing = [k for k in ("sigma2_eval", "sigma2_cal") if d.get(k) is None]
        if missing:
            raise CJEInputError(f"{target}: variance components lack {', '.join(missing)}",
                                column="variance_components")
        kw = {k: d[k] for k in ("target", "responses_per_prompt", "labels_per_unit", "method") if k in d}
        kw.setdefault("target", target)
        n = d.get("n_pilot", d.get("n_prompts"))
        m = d.get("m_pilot", d.get("m_labels"))
        return cls(sigma2_eval=d["sigma2_eval"], sigma2_cal=d["sigma2_cal"], n_pilot=n, m_pilot=m, **kw)


# --------------------------------------------------------------------------------------
# allocations


@dataclass(frozen=True)
class Allocation:
    """An integer design ``(n, m)`` and what it buys.

    ``n`` prompts per policy, ``m`` labels per policy (or shared calibration labels);
    ``responses`` and ``labels`` are the totals paid for (times the cost multipliers).
    ``n_continuous``/``m_continuous`` are the real-valued square-root-law solution.
    """

    n: int
    m: int
    responses: int
    labels: int
    cost: float
    variance: float
    se: float
    mde: float
    alpha: float
    power: float
    calibration_share: float
    oracle_budget_share: float
    n_continuous: float
    m_continuous: float
    binding: str | None
    target: str = "estimate"

    @property
    def oracle_fraction(self) -> float:
        """Labels per prompt, ``m / n``."""
        return self.m / self.n

    def to_dict(self) -> dict:
        """Plain dict form, the oracle fraction included."""
        d = asdict(self)
        d["oracle_fraction"] = self.oracle_fraction
        return d
