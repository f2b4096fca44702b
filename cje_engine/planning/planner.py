"""Budget planner: how many judged responses and oracle labels to buy.

Model (METHOD.md, "Budget"; docs/planner.md)::

    Var(theta) ~ sigma2_eval / n + sigma2_cal / m
    cost       = c_S * r * n + c_Y * l * m

``n`` is prompts per policy (one judged response per prompt and policy), ``m`` is oracle labels
per policy (own labels of an augmented estimate) or shared calibration labels (plug-in), ``r``
judged responses per prompt and ``l`` label sets per unit of ``m`` (both 1 for one policy; a
difference of two augmented policies has r = l = 2). Unit costs times multipliers are the
*effective* costs ``cs = c_S r`` and ``cy = c_Y l``.

Minimising the variance at fixed cost gives the square-root law ``n ∝ sqrt(sigma2_eval / cs)``,
``m ∝ sqrt(sigma2_cal / cy)``, so the variance-optimal oracle fraction is
``m / n = sqrt(sigma2_cal cs / (sigma2_eval cy))`` (at most 1: a label needs a response), and at
the optimum the calibration share of the variance equals the oracle share of the budget.
MDE = (z_{1-alpha/2} + z_power) * SE.

Pure functions; the only I/O-like entry is `plan_from_data`, which runs the engine on a pilot.
"""
from __future__ import annotations

import html
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from scipy.stats import norm

from cje_engine.errors import CJEInputError

log = logging.getLogger(__name__)

PLANNER_VERSION = 1
#: Oracle fractions of the default MDE table.
DEFAULT_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
#: Multiples of the chosen n in the default MDE table.
DEFAULT_N_MULTIPLES = (0.25, 0.5, 1.0, 2.0, 4.0)
_AUGMENTED = ("augmented", "recalibrated")
_SCAN_CHUNK = 1_000_000


# --------------------------------------------------------------------------------------
# validation helpers


def _positive(value: Any, what: str, allow_zero: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise CJEInputError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise CJEInputError(f"{what} must be {need}, got {value!r}")
    return v


def _costs(c_S: Any, c_Y: Any) -> tuple[float, float]:
    return (_positive(c_S, "c_S (cost of one judged response)"),
            _positive(c_Y, "c_Y (cost of one oracle label)"))


def _check_alpha_power(alpha: Any, power: Any) -> tuple[float, float]:
    a = float(alpha) if isinstance(alpha, (int, float)) else float("nan")
    p = float(power) if isinstance(power, (int, float)) else float("nan")
    if not 0 < a < 1:
        raise CJEInputError(f"alpha must be in (0, 1), got {alpha!r}")
    if not 0 < p < 1:
        raise CJEInputError(f"power must be in (0, 1), got {power!r}")
    return a, p


def _min_labels(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise CJEInputError(f"min_labels must be a whole number >= 1, got {value!r}")
    return int(value)


def mde_multiplier(alpha: float = 0.05, power: float = 0.8) -> float:
    """``z_{1-alpha/2} + z_power``: MDE = multiplier * SE (two-sided test at level alpha)."""
    a, p = _check_alpha_power(alpha, power)
    return float(norm.ppf(1 - a / 2) + norm.ppf(p))


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
            object.__setattr__(self, name, _positive(getattr(self, name), name, allow_zero=True))
        if self.sigma2_eval == 0 and self.sigma2_cal == 0:
            raise CJEInputError(f"{self.target}: both variance components are zero, so there is nothing to plan")
        for name in ("n_pilot", "m_pilot"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, _positive(v, name))
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
        cs, cy = _costs(c_S, c_Y)
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
        if self.n_pilot is None or self.m_pilot is None:
            return None
        return self.variance(self.n_pilot, self.m_pilot)

    def to_dict(self) -> dict:
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
        return self.m / self.n

    def to_dict(self) -> dict:
        d = asdict(self)
        d["oracle_fraction"] = self.oracle_fraction
        return d


def _as_list(components: Any) -> list[VarianceComponents]:
    comps = [components] if isinstance(components, VarianceComponents) else list(components)
    if not comps or not all(isinstance(c, VarianceComponents) for c in comps):
        raise CJEInputError("components must be a VarianceComponents or a non-empty sequence of them")
    mult = {(c.responses_per_prompt, c.labels_per_unit) for c in comps}
    if len(mult) > 1:
        raise CJEInputError(f"components planned together must share their cost multipliers, got {sorted(mult)}")
    return comps


def _max_variance(comps: Sequence[VarianceComponents], n: Any, m: Any) -> np.ndarray:
    out = comps[0].variance(n, m) * np.ones(np.broadcast(np.asarray(n), np.asarray(m)).shape)
    for c in comps[1:]:
        out = np.maximum(out, c.variance(n, m))
    return out


def _allocation(comps: Sequence[VarianceComponents], n: int, m: int, c_S: float, c_Y: float, alpha: float,
                power: float, cont: tuple[float, float], binding: str | None) -> Allocation:
    j = int(np.argmax([c.variance(n, m) for c in comps]))
    comp = comps[j]
    var = comp.variance(n, m)
    cal, bud = comp.shares(n, m, c_S, c_Y)
    se = math.sqrt(var)
    return Allocation(n=int(n), m=int(m), responses=int(n) * comp.responses_per_prompt,
                      labels=int(m) * comp.labels_per_unit, cost=float(comp.cost(n, m, c_S, c_Y)),
                      variance=var, se=se, mde=mde_multiplier(alpha, power) * se, alpha=alpha, power=power,
                      calibration_share=cal, oracle_budget_share=bud,
                      n_continuous=float(cont[0]), m_continuous=float(cont[1]), binding=binding,
                      target=comp.target)


def _golden_min(fn: Callable[[float], float], lo: float, hi: float, iters: int = 200) -> float:
    """Minimiser of a convex function on [lo, hi] (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = fn(c), fn(d)
    for _ in range(iters):
        if b - a <= 1e-9 * max(1.0, abs(a)):
            break
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = fn(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = fn(d)
    return (a + b) / 2


def continuous_optimum(components: VarianceComponents, budget: float, c_S: float = 1.0,
                       c_Y: float = 16.0) -> tuple[float, float]:
    """Real-valued variance-minimising ``(n, m)`` at cost ``budget`` with ``m <= n``.

    ``r = optimal_fraction``, ``n = budget / (cs + cy r)``, ``m = r n``.
    """
    cs, cy = components.effective_costs(c_S, c_Y)
    budget = _positive(budget, "budget")
    r = components.optimal_fraction(c_S, c_Y)
    n = budget / (cs + cy * r)
    return n, r * n


def _int_argmin(obj: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
                lower: Callable[[float], float], lo: int, hi: int | None, x_guess: float) -> int:
    """Exact integer minimiser of ``obj`` on ``lo..hi`` (``hi=None``: unbounded).

    ``obj(x)`` returns ``(primary, secondary)`` arrays (ties on primary broken by secondary);
    ``lower`` is a convex function with ``lower(x) <= primary(x)`` at every integer. Any
    minimiser lies in the sublevel set ``{lower <= best value found at the guess}``, which is an
    interval (convexity) containing the guess: find its ends by bisection and scan it.
    """
    top = hi if hi is not None else max(lo, int(math.ceil(x_guess)) + 1)
    cands = np.unique(np.clip(np.array([math.floor(x_guess), math.ceil(x_guess)], dtype=np.int64), lo, top))
    vals = obj(cands)[0]
    i = int(np.argmin(vals))
    x_in, best = int(cands[i]), float(vals[i])
    t = best * (1 + 1e-9) + 1e-300

    def inside(x: int) -> bool:
        return lower(float(x)) <= t

    a, b = lo, x_in  # smallest x in [lo, x_in] inside (inside(x_in) holds)
    while a < b:
        mid = (a + b) // 2
        if inside(mid):
            b = mid
        else:
            a = mid + 1
    left = a
    if hi is None:
        step = 1
        while inside(x_in + step):
            step *= 2
        a, b = x_in + step // 2 if step > 1 else x_in, x_in + step
    else:
        a, b = x_in, hi
    while a < b:  # largest x in [a, b] inside
        mid = (a + b + 1) // 2
        if inside(mid):
            a = mid
        else:
            b = mid - 1
    right = a
    best_x, best_p, best_s = x_in, best, float(obj(np.array([x_in]))[1][0])
    for start in range(left, right + 1, _SCAN_CHUNK):
        xs = np.arange(start, min(right, start + _SCAN_CHUNK - 1) + 1, dtype=np.int64)
        p, s = obj(xs)
        j = int(np.argmin(p))
        pmin = float(p[j])
        tied = np.flatnonzero(p <= pmin * (1 + 1e-12))
        k = int(tied[np.argmin(s[tied])])
        if float(p[k]) < best_p * (1 - 1e-12) or (float(p[k]) <= best_p * (1 + 1e-12) and float(s[k]) < best_s):
            best_x, best_p, best_s = int(xs[k]), float(p[k]), float(s[k])
    return best_x


def _floor(x: Any) -> Any:
    return np.floor(np.asarray(x, dtype=float) + 1e-9).astype(np.int64)


def optimal_allocation(components: VarianceComponents | Sequence[VarianceComponents], budget: float,
                       c_S: float = 1.0, c_Y: float = 16.0, *, min_labels: int = 1, alpha: float = 0.05,
                       power: float = 0.8) -> Allocation:
    """Integer ``(n, m)`` with the smallest variance at cost <= ``budget``.

    Constraints: ``min_labels <= m <= n``. For each m the best n spends the rest of the budget,
    so the search is one-dimensional and exact (`_int_argmin`); ties go to the cheaper design.
    Several components (e.g. every pairwise difference): minimise the largest variance.

    Raises
    ------
    CJEInputError
        Non-positive costs or budget, or a budget below the cheapest allowed design
        (``min_labels`` labels on as many responses).
    """
    comps = _as_list(components)
    first = comps[0]
    cs, cy = first.effective_costs(c_S, c_Y)
    C = _positive(budget, "budget")
    min_labels = _min_labels(min_labels)
    alpha, power = _check_alpha_power(alpha, power)
    cheapest = (cs + cy) * min_labels
    if C < cheapest * (1 - 1e-12):
        raise CJEInputError(
            f"budget {C:g} is too small for {first.target}: the cheapest allowed design "
            f"({min_labels} oracle label(s) on as many prompts, {first.responses_per_prompt} judged response(s) and "
            f"{first.labels_per_unit} label(s) per unit at c_S={c_S:g}, c_Y={c_Y:g}) costs {cheapest:g}")

    def n_of(m: Any) -> np.ndarray:
        return _floor((C - cy * np.asarray(m, dtype=float)) / cs)

    m_max = int(_floor(C / (cs + cy)))
    while m_max > min_labels and n_of(m_max) < m_max:
        m_max -= 1
    m_max = max(m_max, min_labels)

    def obj(ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ns = n_of(ms)
        return _max_variance(comps, ns, ms), cs * ns + cy * ms

    def lower(m: float) -> float:
        rest = C - cy * m
        return max((c.sigma2_eval * cs / rest if c.sigma2_eval > 0 else 0.0) +
                   (c.sigma2_cal / m if c.sigma2_cal > 0 else 0.0) for c in comps)

    if len(comps) == 1:
        nc, mc = continuous_optimum(first, C, c_S, c_Y)
    else:
        mc = _golden_min(lower, float(min_labels), C / (cs + cy))
        nc = (C - cy * mc) / cs
    m = _int_argmin(obj, lower, min_labels, m_max, mc)
    n = int(n_of(m))
    binding = None
    if m == n and mc >= nc * (1 - 1e-9):
        binding = "m <= n (every response labelled)"
    elif m == min_labels and mc < min_labels:
        binding = f"m >= min_labels ({min_labels})"
    return _allocation(comps, n, m, c_S, c_Y, alpha, power, (nc, mc), binding)


def allocation_for_mde(components: VarianceComponents | Sequence[VarianceComponents], target_mde: float,
                       alpha: float = 0.05, power: float = 0.8, c_S: float = 1.0, c_Y: float = 16.0, *,
                       min_labels: int = 1) -> Allocation:
    """Cheapest integer ``(n, m)`` whose MDE is at most ``target_mde`` (for every component given).

    The target variance is ``V = (target_mde / (z_{1-alpha/2} + z_power))^2``; for each m the
    cheapest n is ``max(m, ceil(sigma2_eval / (V - sigma2_cal / m)))`` (the largest over several
    components). Ties in cost go to the smaller variance.
    """
    comps = _as_list(components)
    first = comps[0]
    cs, cy = first.effective_costs(c_S, c_Y)
    alpha, power = _check_alpha_power(alpha, power)
    mde = _positive(target_mde, "target_mde")
    min_labels = _min_labels(min_labels)
    V = (mde / mde_multiplier(alpha, power)) ** 2

    def n_one(c: VarianceComponents, ms: np.ndarray) -> np.ndarray:
        A, B = c.sigma2_eval, c.sigma2_cal
        slack = V - B / ms
        with np.errstate(divide="ignore", invalid="ignore"):
            if A > 0:
                need = np.where(slack > 0, A / np.where(slack > 0, slack, 1.0), np.inf)
            else:
                need = np.where(slack >= -1e-15 * V, 0.0, np.inf)
        n = np.where(np.isfinite(need), np.ceil(need * (1 - 1e-12)), np.inf)
        n = np.maximum(n, ms)
        ok = np.isfinite(n)
        bad = ok & (c.variance(np.where(ok, n, 1.0), ms) > V * (1 + 1e-12))
        return np.where(bad, n + 1, n)

    def n_of(ms: np.ndarray) -> np.ndarray:
        ms = np.asarray(ms, dtype=float)
        out = n_one(comps[0], ms)
        for c in comps[1:]:
            out = np.maximum(out, n_one(c, ms))
        return out

    lo = min_labels
    for c in comps:
        if c.sigma2_eval > 0:
            lo = max(lo, int(math.floor(c.sigma2_cal / V)) + 1)
        else:
            lo = max(lo, int(math.ceil(c.sigma2_cal / V * (1 - 1e-12))))

    def obj(ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ns = n_of(ms)
        fin = np.isfinite(ns)
        cost = np.where(fin, cs * np.where(fin, ns, 0.0) + cy * ms, np.inf)
        return cost, _max_variance(comps, np.where(fin, ns, 1.0), ms)

    def lower(m: float) -> float:
        need = m
        for c in comps:
            slack = V - c.sigma2_cal / m
            if c.sigma2_eval > 0:
                if slack <= 0:
                    return math.inf
                need = max(need, c.sigma2_eval / slack)
        return cs * need + cy * m

    guesses = []
    for c in comps:
        r = c.optimal_fraction(c_S, c_Y)
        n_c = (c.sigma2_eval + (c.sigma2_cal / r if r > 0 else 0.0)) / V
        guesses.append((n_c, r * n_c))
    if len(comps) == 1:
        n_c, m_c = guesses[0]
    else:
        hi_g = max(lo + 1.0, 2 * max(g[1] for g in guesses) + 10)
        m_c = _golden_min(lower, float(lo), hi_g)
        n_c = max(m_c, max((c.sigma2_eval / (V - c.sigma2_cal / m_c) if c.sigma2_eval > 0 else 0.0)
                           for c in comps))
    m = _int_argmin(obj, lower, lo, None, max(m_c, lo))
    n = int(n_of(np.array([m]))[0])
    binding = "m <= n (every response labelled)" if (m == n and m_c >= n_c * (1 - 1e-9)) else (
        f"m >= min_labels ({min_labels})" if m == min_labels and m_c < min_labels else None)
    return _allocation(comps, n, m, c_S, c_Y, alpha, power, (n_c, m_c), binding)


# --------------------------------------------------------------------------------------
# tables, curves, diagnostics


def mde_table(components: VarianceComponents, n_grid: Sequence[int], oracle_fraction_grid: Sequence[float],
              alpha: float = 0.05, power: float = 0.8, *, c_S: float | None = None,
              c_Y: float | None = None) -> dict:
    """MDE over prompts ``n`` (rows) and oracle fractions (columns), ``m = max(1, round(f n))``.

    Returns a JSON-ready dict with ``n``, ``oracle_fraction``, and row-major matrices ``m``,
    ``se``, ``mde`` (and ``cost`` when both costs are given).
    """
    alpha, power = _check_alpha_power(alpha, power)
    ns = [int(v) for v in n_grid]
    fs = [float(v) for v in oracle_fraction_grid]
    if not ns or any(v < 1 for v in ns):
        raise CJEInputError(f"n_grid must hold whole numbers >= 1, got {list(n_grid)!r}")
    if not fs or any(not (0 < f <= 1) for f in fs):
        raise CJEInputError(f"oracle fractions must lie in (0, 1], got {list(oracle_fraction_grid)!r}")
    N = np.array(ns, dtype=float)[:, None]
    F = np.array(fs)[None, :]
    M = np.maximum(1, np.round(F * N)).astype(int)
    M = np.minimum(M, N.astype(int))
    se = np.sqrt(components.variance(N * np.ones_like(F), M))
    out = {"n": ns, "oracle_fraction": fs, "m": M.tolist(), "se": se.tolist(),
           "mde": (mde_multiplier(alpha, power) * se).tolist(), "alpha": alpha, "power": power}
    if c_S is not None and c_Y is not None:
        out["cost"] = components.cost(N * np.ones_like(F), M, c_S, c_Y).tolist()
    return out


def iso_cost_curve(components: VarianceComponents, budget: float, c_S: float = 1.0, c_Y: float = 16.0, *,
                   fractions: Sequence[float] | None = None, alpha: float = 0.05, power: float = 0.8) -> dict:
    """SE along the budget line as a function of the oracle fraction ``f = m / n``.

    Continuous: ``n = budget / (cs + cy f)``, ``m = f n``. Also the calibration share of the
    variance and the oracle share of the budget at each point (they cross at the optimum).
    """
    cs, cy = components.effective_costs(c_S, c_Y)
    C = _positive(budget, "budget")
    alpha, power = _check_alpha_power(alpha, power)
    if fractions is None:
        f_min = max(1e-3, 1.0 / (C / (cs + cy)))  # at least one label at the smallest fraction
        f_min = min(f_min, 0.5)
        fr = np.geomspace(f_min, 1.0, 81)
    else:
        fr = np.asarray(fractions, dtype=float)
        if fr.size == 0 or np.any(~(fr > 0)) or np.any(fr > 1):
            raise CJEInputError(f"oracle fractions must lie in (0, 1], got {list(fractions)!r}")
    r = components.optimal_fraction(c_S, c_Y)
    fr = np.unique(np.append(fr, r))
    n = C / (cs + cy * fr)
    m = fr * n
    se = np.sqrt(components.variance(n, m))
    cal, bud = components.shares(n, m, c_S, c_Y)
    n_opt, m_opt = continuous_optimum(components, C, c_S, c_Y)
    se_opt = float(np.sqrt(components.variance(n_opt, m_opt)))
    k = mde_multiplier(alpha, power)
    return {"budget": C, "oracle_fraction": fr.tolist(), "n": n.tolist(), "m": m.tolist(), "se": se.tolist(),
            "mde": (k * se).tolist(), "calibration_share": np.asarray(cal).tolist(),
            "oracle_budget_share": np.asarray(bud).tolist(),
            "optimum": {"oracle_fraction": r, "n": n_opt, "m": m_opt, "se": se_opt, "mde": k * se_opt}}


def _check_design(n: Any, m: Any) -> tuple[float, float]:
    n_ = _positive(n, "n (prompts)")
    m_ = _positive(m, "m (labels)", allow_zero=True)
    if m_ > n_:
        raise CJEInputError(f"m (labels, {m_:g}) cannot exceed n (prompts, {n_:g}): a label needs a response")
    return n_, m_


def allocation_diagnostic(components: VarianceComponents, n: float, m: float, c_S: float = 1.0,
                          c_Y: float = 16.0) -> dict:
    """Calibration share of variance vs oracle share of budget at a design ``(n, m)``.

    ``under_labelled``: calibration share > budget share (the oracle fraction is below the
    square-root-law optimum) and not every response is labelled; ``over_labelled``: the reverse.
    ``efficiency`` = variance of the continuous optimum at the same cost / variance at ``(n, m)``.
    """
    n, m = _check_design(n, m)
    cost = float(components.cost(n, m, c_S, c_Y))
    var = components.variance(n, m) if m > 0 else math.inf
    cal, bud = components.shares(n, m, c_S, c_Y) if m > 0 else (1.0, 0.0)
    n_o, m_o = continuous_optimum(components, cost, c_S, c_Y)
    var_o = components.variance(n_o, m_o)
    return {"n": n, "m": m, "oracle_fraction": m / n, "cost": cost,
            "se": math.sqrt(var) if math.isfinite(var) else None,
            "calibration_share": cal, "oracle_budget_share": bud,
            "optimal_fraction": components.optimal_fraction(c_S, c_Y),
            "under_labelled": bool(cal > bud and m < n), "over_labelled": bool(cal < bud),
            "se_at_same_cost_optimum": math.sqrt(var_o),
            "efficiency": (var_o / var) if math.isfinite(var) else 0.0}


def is_under_labelled(components: VarianceComponents, n: float, m: float, c_S: float = 1.0, c_Y: float = 16.0, *,
                      margin: float = 0.0) -> bool:
    """True when the calibration share of the variance exceeds the oracle share of the budget
    by more than ``margin`` (equivalently: ``m / n`` is below the variance-optimal fraction).

    False when every response is already labelled (``m >= n``): no label can be added without
    new responses.
    """
    margin = _positive(margin, "margin", allow_zero=True)
    n, m = _check_design(n, m)
    if m >= n:
        return False
    if m == 0:
        return True
    cal, bud = components.shares(n, m, c_S, c_Y)
    return bool(cal > bud + margin)


def labels_to_request(components: VarianceComponents, n: float, m: float, c_S: float = 1.0, c_Y: float = 16.0, *,
                      target_se: float | None = None, max_labels: int | None = None) -> dict:
    """Size a label request at a fixed number of prompts ``n`` with ``m`` labels in hand.

    Goal ``"balance"`` (no ``target_se``): raise m to ``ceil(r* n)`` (r* the variance-optimal
    fraction), where the calibration share equals the oracle budget share. Goal ``"target_se"``:
    the fewest extra labels with ``SE <= target_se``, i.e. ``m >= sigma2_cal / (target_se^2 -
    sigma2_eval / n)``; if labels alone cannot reach it (evaluation variance too large, or m would
    exceed n) the request falls back to the balance point and ``reachable`` is false.
    ``max_labels`` caps the request (total labels, so per-unit ``floor(max_labels / labels_per_unit)``).

    Returns a JSON-ready dict; ``labels`` is the total number of labels to request and
    ``m_extra`` the per-policy increase of m.
    """
    n, m = _check_design(n, m)
    n_int, m_int = int(math.floor(n)), int(math.ceil(m))
    r = components.optimal_fraction(c_S, c_Y)
    m_balance = min(n_int, int(math.ceil(r * n - 1e-9)))
    A, B = components.sigma2_eval, components.sigma2_cal
    goal, reachable = "balance", True
    if target_se is None:
        m_goal = m_balance
        reason = (f"raise the oracle fraction to the variance-optimal {r:.1%} at n={n_int}: then the calibration "
                  f"share of the variance equals the oracle share of the budget")
    else:
        tse = _positive(target_se, "target_se")
        goal = "target_se"
        slack = tse**2 - A / n
        m_need = int(math.ceil(B / slack * (1 - 1e-12))) if (slack > 0 and B > 0) else (0 if slack > 0 else None)
        if m_need is None or m_need > n_int:
            reachable = False
            m_goal = m_balance
            reason = (f"labels alone cannot bring the SE to {tse:g} at n={n_int} (evaluation variance alone gives "
                      f"SE {math.sqrt(A / n):.4g}); more prompts are needed, so the request only balances the design")
        else:
            m_goal = m_need
            reason = f"fewest labels that bring the SE to {tse:g} at n={n_int}"
    extra = max(0, m_goal - m_int)
    capped = False
    if max_labels is not None:
        if isinstance(max_labels, bool) or not isinstance(max_labels, (int, np.integer)) or max_labels < 0:
            raise CJEInputError(f"max_labels must be a whole number >= 0, got {max_labels!r}")
        cap = int(max_labels) // components.labels_per_unit
        if extra > cap:
            extra, capped = cap, True
            reason += f"; capped at {max_labels} labels by the request budget"
    m_after = m_int + extra
    se_before = math.sqrt(components.variance(n, m)) if m > 0 else None
    se_after = math.sqrt(components.variance(n, m_after)) if m_after > 0 else None
    return {"goal": goal, "labels": extra * components.labels_per_unit, "m_extra": extra, "n": n_int,
            "m_before": m_int, "m_after": m_after, "oracle_fraction_after": m_after / n,
            "se_before": se_before, "se_after": se_after, "target_se": target_se, "reachable": reachable,
            "capped": capped, "cost": extra * components.effective_costs(c_S, c_Y)[1], "reason": reason}


# --------------------------------------------------------------------------------------
# components from an evaluation result


@dataclass
class _Pilot:
    result: dict
    cov_total: np.ndarray | None = None
    cov_cal: np.ndarray | None = None
    cov_eval: np.ndarray | None = None
    columns: np.ndarray | None = None

    @property
    def names(self) -> list[str]:
        return list(self.result["policies"])


def _pilot(source: Any) -> _Pilot:
    if isinstance(source, _Pilot):
        return source
    from cje_engine.result import EvaluationResult

    if isinstance(source, EvaluationResult):
        from cje_engine.inference.variance import cluster_cov

        cov = cluster_cov(np.asarray(source.influence, dtype=float)) if source.influence is not None else None
        return _Pilot(source.to_dict(), cov_total=cov, columns=np.asarray(source.columns))
    if not isinstance(source, Mapping):
        raise CJEInputError(f"expected an evaluation result (dict from evaluate(...).to_dict() or the "
                            f"EvaluationResult), got {type(source).__name__}")
    if not isinstance(source.get("policies"), Mapping) or not source["policies"]:
        raise CJEInputError("the result has no 'policies' section: expected the dict of evaluate(...).to_dict()",
                            column="policies")
    return _Pilot(dict(source))


def _entry(pilot: _Pilot, name: str) -> dict:
    pols = pilot.result["policies"]
    if name not in pols:
        raise CJEInputError(f"unknown policy {name!r}; the result has: {', '.join(map(repr, pols))}",
                            column="policy")
    return pols[name]


def _raw(pilot: _Pilot, name: str) -> tuple[float, float, float, float, bool]:
    """(sigma2_eval, sigma2_cal, n_prompts, m_labels, augmented) of one policy."""
    e = _entry(pilot, name)
    vc = e.get("variance_components")
    if not isinstance(vc, Mapping):
        raise CJEInputError(f"policy {name!r} has no variance_components (results written before the planner "
                            f"existed lack them): re-run evaluate on the pilot data", column="variance_components")
    for key in ("sigma2_eval", "sigma2_cal", "n_prompts", "m_labels"):
        if vc.get(key) is None:
            raise CJEInputError(f"policy {name!r}: variance_components lack {key!r}", column="variance_components")
    A = _positive(vc["sigma2_eval"], f"policy {name!r} sigma2_eval", allow_zero=True)
    B = _positive(vc["sigma2_cal"], f"policy {name!r} sigma2_cal", allow_zero=True)
    n = _positive(vc["n_prompts"], f"policy {name!r} n_prompts")
    m = float(vc["m_labels"]) if isinstance(vc["m_labels"], (int, float)) else float("nan")
    if not (m >= 1 and math.isfinite(m)):
        raise CJEInputError(f"policy {name!r}: the estimate rests on {vc['m_labels']!r} labels, so its calibration "
                            f"variance cannot be estimated (at least 1 label needed)", column="variance_components")
    return A, B, n, m, e.get("basis_code") in _AUGMENTED


def _scope_multipliers(pilot: _Pilot) -> tuple[int, int]:
    """Cost multipliers when the whole pilot design (every policy) is scaled together."""
    n_aug = sum(1 for p in pilot.names if _entry(pilot, p).get("basis_code") in _AUGMENTED)
    return len(pilot.names), max(1, n_aug)


def policy_components(result: Any, policy: str, *, scope: str = "target") -> VarianceComponents:
    """Variance components of one policy's reported estimate (its ``variance_components``).

    ``scope="target"``: costs count this policy only; ``"all"``: every policy of the pilot is
    run on the n prompts (K responses per prompt) with a label set per augmented policy.
    """
    pilot = _pilot(result)
    A, B, n, m, aug = _raw(pilot, policy)
    r, l = _multipliers(pilot, scope, (1, 1))
    return VarianceComponents(A, B, target=policy, n_pilot=n, m_pilot=m, responses_per_prompt=r, labels_per_unit=l,
                              method=("own-label residual variance (augmented estimate)" if aug else
                                      "calibration influence variance (plug-in estimate)") + " from the pilot result")


def _multipliers(pilot: _Pilot, scope: str, own: tuple[int, int]) -> tuple[int, int]:
    if scope == "target":
        return own
    if scope == "all":
        return _scope_multipliers(pilot)
    raise CJEInputError(f"scope must be 'target' or 'all', got {scope!r}")


def _pair_total_variance(pilot: _Pilot, a: str, b: str) -> float | None:
    names = pilot.names
    if pilot.cov_total is not None and pilot.columns is not None:
        ca, cb = (int(pilot.columns[names.index(x)]) for x in (a, b))
        c = pilot.cov_total
        return float(max(c[ca, ca] + c[cb, cb] - 2 * c[ca, cb], 0.0))
    for comp in pilot.result.get("comparisons") or []:
        if {comp.get("a"), comp.get("b")} == {a, b}:
            se = comp.get("se_analytic")
            if se is None and (pilot.result.get("inference") or {}).get("method") == "analytic":
                se = comp.get("se")
            if isinstance(se, (int, float)) and math.isfinite(se) and se >= 0:
                return float(se) ** 2
    return None


def difference_components(result: Any, a: str, b: str, *, scope: str = "target") -> VarianceComponents:
    """Variance components of the paired difference ``a - b`` (n prompts shared by both policies).

    Calibration part, in per-label units:

    * at least one augmented estimate: the label-residual terms of the two policies sit on
      different rows, so ``sigma2_cal = B_a + B_b`` with m labels per policy;
      ``m_pilot = (B_a + B_b) / (B_a/m_a + B_b/m_b)`` is the per-policy label count that
      reproduces the pilot's calibration variance;
    * both plug-in on one shared calibrator: ``sigma2_cal = m Var_cal(a - b)`` with the exact
      calibration covariance when available (`plan_from_data`), else ``Var_cal(a - b)`` is
      approximated by the mean of the two calibration shares times the paired variance.

    Evaluation part, ``sigma2_eval = n Var_eval(a - b)`` (paired, so shared-prompt effects cancel):

    * exact from the per-prompt evaluation influence terms (`plan_from_data`);
    * otherwise ``n (V_diff - Var_cal)``, floored at 0, with ``V_diff`` the pilot's paired
      variance from the influence terms (EvaluationResult) or the comparison's analytic SE (dict):
      the covariance between the two calibration terms (labels on the same prompts) lands here;
    * no paired information at all: the policies are treated as independent.
    """
    pilot = _pilot(result)
    if a == b:
        raise CJEInputError(f"a difference needs two different policies, got {a!r} twice", column="policy")
    Aa, Ba, n_a, m_a, aug_a = _raw(pilot, a)
    Ab, Bb, n_b, m_b, aug_b = _raw(pilot, b)
    n = min(n_a, n_b)
    va_cal, vb_cal = Ba / m_a, Bb / m_b
    names = pilot.names
    cols = None if pilot.columns is None else [int(pilot.columns[names.index(x)]) for x in (a, b)]

    def diff_var(cov: np.ndarray) -> float:
        ca, cb = cols
        return float(max(cov[ca, ca] + cov[cb, cb] - 2 * cov[ca, cb], 0.0))

    if aug_a or aug_b:
        B = Ba + Bb
        v_cal = va_cal + vb_cal
        m = B / v_cal if v_cal > 0 else (m_a + m_b) / 2
        own = (2, 2 if (aug_a and aug_b) else 1)
        cal_how = "calibration part = the two policies' label-residual terms (m labels each)"
    else:
        m = m_a
        own = (2, 1)
        if pilot.cov_cal is not None and cols is not None:
            v_cal = diff_var(pilot.cov_cal)
            cal_how = "exact calibration covariance of the shared calibrator"
        else:
            v_tot = _pair_total_variance(pilot, a, b)
            v_tot = v_tot if v_tot is not None else Aa / n_a + va_cal + Ab / n_b + vb_cal
            sa = va_cal / (Aa / n_a + va_cal) if (Aa / n_a + va_cal) > 0 else 0.0
            sb = vb_cal / (Ab / n_b + vb_cal) if (Ab / n_b + vb_cal) > 0 else 0.0
            v_cal = 0.5 * (sa + sb) * v_tot
            cal_how = "calibration part approximated by the mean calibration share (shared calibrator)"
        B = v_cal * m
    if pilot.cov_eval is not None and cols is not None:
        A = diff_var(pilot.cov_eval) * n
        eval_how = "exact paired evaluation variance"
    else:
        v_tot = _pair_total_variance(pilot, a, b)
        if v_tot is None:
            A = Aa * n / n_a + Ab * n / n_b
            eval_how = "no paired variance in the result: policies treated as independent"
        else:
            A = max(v_tot - v_cal, 0.0) * n
            eval_how = "paired evaluation variance = paired total minus calibration part"
            if v_tot <= v_cal:
                eval_how += (" (not identifiable here: the calibration terms exceed the paired total, so it is "
                             "taken as 0; plan_from_data gives it exactly)")
    r, l = _multipliers(pilot, scope, own)
    return VarianceComponents(A, B, target=f"{a} - {b}", n_pilot=n, m_pilot=m, responses_per_prompt=r,
                              labels_per_unit=l, method=f"{eval_how}; {cal_how}")


def parse_target(result: Any, target: Any) -> tuple[str, ...]:
    """``"base"`` -> ("base",); ``"a - b"`` or ``("a", "b")`` -> ("a", "b"); names are checked."""
    pilot = _pilot(result)
    names = pilot.names
    if isinstance(target, str):
        if target in names:
            return (target,)
        if " - " in target:
            parts = tuple(p.strip() for p in target.split(" - ", 1))
        else:
            parts = (target,)
    elif isinstance(target, (list, tuple)) and len(target) in (1, 2) and all(isinstance(t, str) for t in target):
        parts = tuple(target)
    else:
        raise CJEInputError(f"target must be a policy name, 'a - b' or a pair of names, got {target!r}")
    for p in parts:
        _entry(pilot, p)
    return parts


def components_from_result(result: Any, target: Any = None, *, scope: str = "target") -> VarianceComponents:
    """Components for a policy (``"base"``) or a paired difference (``"a - b"``, ``("a", "b")``);
    ``target=None`` only for a one-policy result."""
    pilot = _pilot(result)
    if target is None:
        if len(pilot.names) > 1:
            raise CJEInputError(f"the result has {len(pilot.names)} policies: name a target policy or 'a - b'",
                                column="policy")
        target = pilot.names[0]
    parts = parse_target(pilot, target)
    if len(parts) == 1:
        return policy_components(pilot, parts[0], scope=scope)
    return difference_components(pilot, parts[0], parts[1], scope=scope)


# --------------------------------------------------------------------------------------
# plans


def _nice(x: float) -> int:
    """Round to two significant digits (at least 1)."""
    if x < 10:
        return max(1, int(round(x)))
    p = 10 ** (int(math.floor(math.log10(x))) - 1)
    return int(round(x / p) * p)


def _pilot_block(c: VarianceComponents, c_S: float, c_Y: float, alpha: float, power: float) -> dict | None:
    if c.n_pilot is None or c.m_pilot is None:
        return None
    n0, m0 = c.n_pilot, min(c.m_pilot, c.n_pilot)
    diag = allocation_diagnostic(c, n0, m0, c_S, c_Y)
    se0 = math.sqrt(c.variance(n0, m0))
    return {"n": n0, "m": m0, "cost": diag["cost"], "se": se0, "mde": mde_multiplier(alpha, power) * se0,
            "diagnostic": diag, "label_request": labels_to_request(c, n0, m0, c_S, c_Y)}


def plan(components: VarianceComponents | Sequence[VarianceComponents], *, budget: float | None = None,
         target_mde: float | None = None, c_S: float = 1.0, c_Y: float = 16.0, alpha: float = 0.05,
         power: float = 0.8, min_labels: int = 1, default_budget: float | None = None,
         n_grid: Sequence[int] | None = None, fraction_grid: Sequence[float] | None = None) -> dict:
    """Full plan (JSON-ready dict; see docs/planner.md).

    Several components are planned together (minimax: the design is sized for the worst of them);
    the tables, curves and pilot diagnostic then describe the **headline**, the component with the
    largest variance at the chosen design. With neither ``budget`` nor ``target_mde`` the budget is
    ``default_budget`` or else the headline's pilot cost (needs ``n_pilot`` and ``m_pilot``).
    """
    comps = _as_list(components)
    c_S, c_Y = _costs(c_S, c_Y)
    alpha, power = _check_alpha_power(alpha, power)
    min_labels = _min_labels(min_labels)
    notes: list[str] = []
    by_budget = by_mde = None
    if budget is not None:
        by_budget = optimal_allocation(comps, budget, c_S, c_Y, min_labels=min_labels, alpha=alpha, power=power)
    if target_mde is not None:
        by_mde = allocation_for_mde(comps, target_mde, alpha, power, c_S, c_Y, min_labels=min_labels)
        if by_budget is not None and by_mde.cost > by_budget.cost * (1 + 1e-12):
            notes.append(f"the budget {float(budget):g} cannot reach the target MDE {float(target_mde):g}: "
                         f"that needs {by_mde.cost:g}; with the budget the MDE is {by_budget.mde:.4g}")
    if by_budget is None and by_mde is None:
        if default_budget is None:
            worst = max(comps, key=lambda c: c.pilot_variance() or 0.0)
            if worst.pilot_variance() is None:
                raise CJEInputError("give a budget or a target MDE (the components carry no pilot size to plan from)")
            default_budget = float(worst.cost(worst.n_pilot, min(worst.m_pilot, worst.n_pilot), c_S, c_Y))
        notes.append(f"no budget or target MDE given: the pilot's own cost ({default_budget:g}) is the budget")
        by_budget = optimal_allocation(comps, default_budget, c_S, c_Y, min_labels=min_labels, alpha=alpha,
                                       power=power)
    chosen = by_budget if by_budget is not None else by_mde
    head = max(comps, key=lambda c: c.variance(chosen.n, chosen.m))
    log.info("plan for %d target(s): n=%d, m=%d, cost %.6g, SE %.4g (binding: %s)", len(comps), chosen.n,
             chosen.m, chosen.cost, chosen.se, head.target)
    if n_grid is None:
        n_grid = sorted({max(min_labels, _nice(chosen.n * k)) for k in DEFAULT_N_MULTIPLES})
    if fraction_grid is None:
        fraction_grid = DEFAULT_FRACTIONS
    cs, cy = head.effective_costs(c_S, c_Y)
    return {
        "planner_version": PLANNER_VERSION,
        "target": head.target,
        "planned_for": [c.target for c in comps],
        "components": head.to_dict(),
        "costs": {"c_S": c_S, "c_Y": c_Y, "ratio": c_Y / c_S, "effective_c_S": cs, "effective_c_Y": cy},
        "alpha": alpha, "power": power, "mde_multiplier": mde_multiplier(alpha, power), "min_labels": min_labels,
        "optimal_fraction": head.optimal_fraction(c_S, c_Y),
        "pilot": _pilot_block(head, c_S, c_Y, alpha, power),
        "budget": None if budget is None else float(budget),
        "target_mde": None if target_mde is None else float(target_mde),
        "allocation_for_budget": by_budget.to_dict() if by_budget is not None else None,
        "allocation_for_mde": by_mde.to_dict() if by_mde is not None else None,
        "chosen": "budget" if by_budget is not None else "target_mde",
        "mde_table": mde_table(head, n_grid, fraction_grid, alpha, power, c_S=c_S, c_Y=c_Y),
        "iso_cost": iso_cost_curve(head, chosen.cost, c_S, c_Y, alpha=alpha, power=power),
        "notes": notes,
    }


def plan_from_result(result: Any, budget: float | None = None, target_mde: float | None = None, c_S: float = 1.0,
                     c_Y: float = 16.0, *, target: Any = None, scope: str = "all", alpha: float | None = None,
                     power: float = 0.8, min_labels: int | None = None) -> dict:
    """The planner's entry point for a CLI: a JSON-ready plan from a pilot result.

    Parameters
    ----------
    result : dict or EvaluationResult
        ``evaluate(...).to_dict()`` (or the object: its influence terms give exact paired variances).
    budget, target_mde : float, optional
        Plan for a budget (cost units of c_S/c_Y), for a minimum detectable effect on the label
        scale, or both. Neither: the pilot's own cost is the budget (``scope="all"``: c_S times the
        pilot's rows plus c_Y times its labelled rows).
    c_S, c_Y : float
        Cost of one judged response and of one oracle label.
    target : str or pair, optional
        A policy, ``"a - b"`` or ``(a, b)``. Default: every pairwise difference at once (the design
        is sized so the worst of them meets the budget or MDE goal); one policy if there is only one.
    scope : {"all", "target"}
        ``"all"`` (default): costs count the whole design, every policy of the pilot run on the n
        prompts and a label set per augmented policy; ``"target"``: only the target's policies.
    alpha, power : float
        Test level (default: the result's ``config.alpha``) and power for MDEs.
    min_labels : int, optional
        Fewest labels per policy (default: the result's ``config.min_labels``).

    Returns
    -------
    dict
        `plan` output plus ``policies`` (per policy: optimal fraction, pilot diagnostic, SE/MDE at
        the chosen design), ``differences`` (same per pair), ``scope``, ``target_choice`` and ``source``.
    """
    pilot = _pilot(result)
    c_S, c_Y = _costs(c_S, c_Y)
    if scope not in ("all", "target"):
        raise CJEInputError(f"scope must be 'target' or 'all', got {scope!r}")
    cfg = pilot.result.get("config") or {}
    if alpha is None:
        alpha = cfg.get("alpha", 0.05)
    if min_labels is None:
        min_labels = int(cfg.get("min_labels", 1) or 1)
    names = pilot.names
    if target is None and len(names) > 1:
        comps = [difference_components(pilot, a, b, scope=scope) for i, a in enumerate(names) for b in names[i + 1:]]
        how = "every pairwise difference (sized for the worst)"
    else:
        comps = [components_from_result(pilot, target if target is not None else names[0], scope=scope)]
        how = "requested" if target is not None else "the only policy"
    data = pilot.result.get("data") or {}
    default_budget = None
    if scope == "all" and isinstance(data.get("n_rows"), (int, float)) and isinstance(data.get("n_labelled"),
                                                                                     (int, float)):
        default_budget = c_S * data["n_rows"] + c_Y * data["n_labelled"]
    out = plan(comps, budget=budget, target_mde=target_mde, c_S=c_S, c_Y=c_Y, alpha=alpha, power=power,
               min_labels=min_labels, default_budget=default_budget)
    chosen = out["allocation_for_budget"] or out["allocation_for_mde"]
    n, m = chosen["n"], chosen["m"]
    k = out["mde_multiplier"]

    def summary(c: VarianceComponents) -> dict:
        se = math.sqrt(c.variance(n, m))
        d = {"optimal_fraction": c.optimal_fraction(c_S, c_Y), "se_at_plan": se, "mde_at_plan": k * se,
             "sigma2_eval": c.sigma2_eval, "sigma2_cal": c.sigma2_cal, "method": c.method}
        if c.n_pilot is not None and c.m_pilot is not None:
            diag = allocation_diagnostic(c, c.n_pilot, min(c.m_pilot, c.n_pilot), c_S, c_Y)
            d.update(pilot_n=c.n_pilot, pilot_m=c.m_pilot, pilot_calibration_share=diag["calibration_share"],
                     pilot_oracle_budget_share=diag["oracle_budget_share"], under_labelled=diag["under_labelled"])
        return d

    out["policies"] = {p: summary(policy_components(pilot, p, scope=scope)) for p in names}
    out["differences"] = [dict(a=a, b=b, **summary(difference_components(pilot, a, b, scope=scope)))
                          for i, a in enumerate(names) for b in names[i + 1:]]
    out["scope"] = scope
    out["target_choice"] = how
    out["source"] = {"engine_version": pilot.result.get("engine_version"), "n_prompts": data.get("n_prompts"),
                     "n_rows": data.get("n_rows"), "n_labelled": data.get("n_labelled"), "policies": names,
                     "paired_variance": "influence" if pilot.cov_total is not None else
                     ("comparisons" if pilot.result.get("comparisons") else "none")}
    return out


def plan_from_data(data: Any, budget: float | None = None, target_mde: float | None = None, c_S: float = 1.0,
                   c_Y: float = 16.0, *, target: Any = None, scope: str = "all", alpha: float | None = None,
                   power: float = 0.8, min_labels: int | None = None, **evaluate_options: Any) -> dict:
    """Plan from a pilot dataset: runs the engine (analytic inference) and keeps the calibration
    influence terms, so paired plug-in differences get their exact calibration covariance."""
    from cje_engine.inference.variance import cluster_cov
    from cje_engine.pipeline.direct import finalize, prepare

    evaluate_options = {**evaluate_options, "inference": "analytic"}
    prep = prepare(data, **evaluate_options)
    res = finalize(prep, [])
    total, cal = prep.infl["total"], prep.infl["calibration"]
    pilot = _Pilot(res.to_dict(), cov_total=cluster_cov(total), cov_cal=cluster_cov(cal),
                   cov_eval=cluster_cov(np.nan_to_num(total) - np.nan_to_num(cal)), columns=np.asarray(res.columns))
    return plan_from_result(pilot, budget, target_mde, c_S, c_Y, target=target, scope=scope, alpha=alpha,
                            power=power, min_labels=min_labels)


# --------------------------------------------------------------------------------------
# rendering


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return f"{int(x):,}"
    x = float(x)
    if x != 0 and (abs(x) >= 1e6 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def _alloc_lines(title: str, a: Mapping[str, Any]) -> list[str]:
    lines = [title,
             f"  prompts per policy n   {a['n']:>10,}    judged responses {a['responses']:,}",
             f"  labels m               {a['m']:>10,}    oracle labels    {a['labels']:,}",
             f"  oracle fraction m/n    {a['oracle_fraction']:>10.1%}",
             f"  cost                   {_fmt(a['cost'], 6):>10}",
             f"  SE                     {_fmt(a['se']):>10}    MDE {_fmt(a['mde'])} "
             f"(alpha {a['alpha']:g}, power {a['power']:.0%})",
             f"  calibration share of variance {a['calibration_share']:.1%} vs oracle share of budget "
             f"{a['oracle_budget_share']:.1%}"]
    if a.get("binding"):
        lines.append(f"  binding constraint: {a['binding']}")
    return lines


def render_plan_text(plan: Mapping[str, Any]) -> str:
    """A plain-text report of a plan (terminal width ~100)."""
    p = plan
    c = p["components"]
    costs = p["costs"]
    L = [f"CJE budget plan for {p['target']}" + (f"  ({p['target_choice']})" if p.get("target_choice") else ""),
         "=" * 72,
         f"costs: c_S={_fmt(costs['c_S'])} per judged response, c_Y={_fmt(costs['c_Y'])} per oracle label "
         f"(ratio {costs['ratio']:g}); per unit of n {_fmt(costs['effective_c_S'])}, "
         f"of m {_fmt(costs['effective_c_Y'])}",
         f"variance model: Var = {_fmt(c['sigma2_eval'])} / n + {_fmt(c['sigma2_cal'])} / m   [{c['method']}]",
         f"variance-optimal oracle fraction (square-root law): {p['optimal_fraction']:.1%}", ""]
    if p.get("pilot"):
        pl = p["pilot"]
        d = pl["diagnostic"]
        state = ("UNDER-labelled" if d["under_labelled"] else "over-labelled" if d["over_labelled"] else "balanced")
        L += [f"pilot: n={_fmt(pl['n'])}, m={_fmt(pl['m'])} ({d['oracle_fraction']:.1%}), SE {_fmt(pl['se'])}, "
              f"MDE {_fmt(pl['mde'])}",
              f"  calibration share {d['calibration_share']:.1%} vs oracle budget share {d['oracle_budget_share']:.1%}"
              f" -> {state}; efficiency {d['efficiency']:.0%} of the same-cost optimum",
              f"  label request at this n: {pl['label_request']['labels']:,} labels "
              f"(SE {_fmt(pl['label_request']['se_before'])} -> {_fmt(pl['label_request']['se_after'])})", ""]
    if p.get("allocation_for_budget"):
        L += _alloc_lines(f"best design for budget {_fmt(p['allocation_for_budget']['cost'], 6)}"
                          if p.get("budget") is None else f"best design for budget {_fmt(p['budget'], 6)}",
                          p["allocation_for_budget"]) + [""]
    if p.get("allocation_for_mde"):
        L += _alloc_lines(f"cheapest design for MDE {_fmt(p['target_mde'])}", p["allocation_for_mde"]) + [""]
    t = p["mde_table"]
    L.append("MDE by prompts per policy (rows) and oracle fraction (columns)")
    head = "n".rjust(10) + "".join(f"{f:>9.0%}" if f >= 0.1 or f == 0 else f"{f:>9.1%}" for f in t["oracle_fraction"])
    L.append(head)
    for i, n in enumerate(t["n"]):
        L.append(f"{n:>10,}" + "".join(f"{v:>9.4f}" for v in t["mde"][i]))
    L.append("")
    iso = p["iso_cost"]
    L.append(f"iso-cost trade-off at budget {_fmt(iso['budget'], 6)} (SE by oracle fraction)")
    fr = np.asarray(iso["oracle_fraction"])
    show = sorted({float(fr[np.argmin(np.abs(fr - f))]) for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)}
                  | {iso["optimum"]["oracle_fraction"]})
    L.append(f"{'fraction':>10}{'n':>12}{'m':>10}{'SE':>10}{'cal.share':>11}{'budget sh.':>11}")
    for f in show:
        j = int(np.argmin(np.abs(fr - f)))
        mark = "  <- optimum" if abs(f - iso["optimum"]["oracle_fraction"]) < 1e-12 else ""
        L.append(f"{fr[j]:>10.1%}{iso['n'][j]:>12,.0f}{iso['m'][j]:>10,.0f}{iso['se'][j]:>10.4f}"
                 f"{iso['calibration_share'][j]:>11.1%}{iso['oracle_budget_share'][j]:>11.1%}{mark}")
    if p.get("policies"):
        L += ["", "per policy and per difference (SE/MDE at the chosen design)",
              f"{'target':<44}{'opt.frac':>9}{'SE':>9}{'MDE':>9}  pilot"]
        rows = [(k, v) for k, v in p["policies"].items()] + [(f"{d['a']} - {d['b']}", d) for d in p["differences"]]
        for name, v in rows:
            flag = ""
            if "under_labelled" in v:
                flag = "under-labelled" if v["under_labelled"] else "ok"
            L.append(f"{name[:43]:<44}{v['optimal_fraction']:>9.1%}{v['se_at_plan']:>9.4f}{v['mde_at_plan']:>9.4f}"
                     f"  {flag}")
    if p.get("notes"):
        L += ["", "notes:"] + [f"  - {x}" for x in p["notes"]]
    return "\n".join(L) + "\n"


_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf")


class _Axes:
    """A panel with a log-x axis (oracle fraction) and a linear y axis, in SVG coordinates."""

    def __init__(self, x0: float, y0: float, w: float, h: float, xlim: tuple[float, float],
                 ylim: tuple[float, float]) -> None:
        self.x0, self.y0, self.w, self.h = x0, y0, w, h
        self.lx = (math.log10(xlim[0]), math.log10(xlim[1]))
        self.ylim = ylim

    def X(self, f: float) -> float:
        return self.x0 + (math.log10(f) - self.lx[0]) / (self.lx[1] - self.lx[0]) * self.w

    def Y(self, v: float) -> float:
        lo, hi = self.ylim
        return self.y0 + self.h - (v - lo) / (hi - lo) * self.h

    def path(self, xs: Sequence[float], ys: Sequence[float], color: str, width: float = 2.0,
             dash: str | None = None) -> str:
        pts = [(self.X(x), self.Y(y)) for x, y in zip(xs, ys) if x > 0 and math.isfinite(y)
               and self.ylim[0] - 1e-12 <= y <= self.ylim[1] * 1.0001]
        if len(pts) < 2:
            return ""
        d = "M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        return f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{width}"{extra}/>'


def _ticks(lo: float, hi: float, k: int = 5) -> list[float]:
    span = hi - lo
    raw = span / k
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = min((s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw), default=mag)
    start = math.ceil(lo / step) * step
    out = []
    v = start
    while v <= hi + 1e-12 * max(1.0, abs(hi)):
        out.append(round(v, 12))
        v += step
    return out


def _frame(ax: _Axes, title: str, ylabel: str, yfmt: Callable[[float], str]) -> list[str]:
    s = [f'<rect x="{ax.x0}" y="{ax.y0}" width="{ax.w}" height="{ax.h}" fill="#ffffff" stroke="#999"/>']
    for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0):
        if 10 ** ax.lx[0] * 0.999 <= f <= 10 ** ax.lx[1] * 1.001:
            x = ax.X(f)
            s.append(f'<line x1="{x:.1f}" y1="{ax.y0}" x2="{x:.1f}" y2="{ax.y0 + ax.h}" stroke="#eee"/>')
            s.append(f'<text x="{x:.1f}" y="{ax.y0 + ax.h + 15}" text-anchor="middle" class="tick">{f:.0%}</text>')
    for v in _ticks(*ax.ylim):
        y = ax.Y(v)
        s.append(f'<line x1="{ax.x0}" y1="{y:.1f}" x2="{ax.x0 + ax.w}" y2="{y:.1f}" stroke="#eee"/>')
        s.append(f'<text x="{ax.x0 - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{yfmt(v)}</text>')
    s.append(f'<text x="{ax.x0}" y="{ax.y0 - 10}" class="title">{html.escape(title)}</text>')
    s.append(f'<text x="{ax.x0 + ax.w / 2}" y="{ax.y0 + ax.h + 32}" text-anchor="middle" class="label">'
             f'oracle fraction m/n (log scale)</text>')
    s.append(f'<text transform="translate({ax.x0 - 48},{ax.y0 + ax.h / 2}) rotate(-90)" text-anchor="middle" '
             f'class="label">{html.escape(ylabel)}</text>')
    return s


def render_plan_svg(plan: Mapping[str, Any], width: int = 900, height: int = 700) -> str:
    """A self-contained SVG: MDE vs oracle fraction for a few n, the iso-cost SE curve with the
    optimum, and the share diagnostic (calibration share of variance vs oracle share of budget)."""
    p = plan
    comp = VarianceComponents(**p["components"])
    k = p["mde_multiplier"]
    iso = p["iso_cost"]
    opt = iso["optimum"]
    chosen = p["allocation_for_budget"] or p["allocation_for_mde"]
    fr_iso = np.asarray(iso["oracle_fraction"])
    f_lo = float(min(fr_iso.min(), 0.01))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
           "<style>.title{font-size:14px;font-weight:bold;fill:#222}.tick{font-size:10px;fill:#555}"
           ".label{font-size:11px;fill:#333}"
           ".legend{font-size:11px;fill:#222;paint-order:stroke;stroke:#fff;stroke-width:3px}"
           ".small{font-size:11px;fill:#333}"
           "</style>",
           f'<rect width="{width}" height="{height}" fill="#fafafa"/>',
           f'<text x="20" y="26" style="font-size:17px;font-weight:bold;fill:#111">'
           f'CJE budget plan: {html.escape(str(p["target"]))}</text>',
           f'<text x="20" y="44" class="small">c_Y/c_S = {p["costs"]["ratio"]:g}; variance-optimal oracle fraction '
           f'{p["optimal_fraction"]:.1%}; MDE = {k:.2f} x SE (alpha {p["alpha"]:g}, power {p["power"]:.0%})</text>']
    left, gap, right = 75, 95, 25
    pw, ph = (width - left - gap - right) / 2, (height - 200) / 2
    x_r = left + pw + gap
    # Panel 1: MDE vs oracle fraction for a few n
    ns = list(p["mde_table"]["n"])[:5]
    fgrid = np.geomspace(f_lo, 1.0, 120)
    curves = []
    for n in ns:
        m = np.maximum(1.0, fgrid * n)
        curves.append(k * np.sqrt(comp.variance(np.full_like(fgrid, n), m)))
    ymax = float(max(np.max(c) for c in curves))
    ymin = float(min(np.min(c) for c in curves))
    top = min(ymax, 4 * max(ymin, 1e-12)) * 1.05
    if p.get("target_mde"):
        top = max(top, p["target_mde"] * 1.3)
    ax1 = _Axes(left, 80, pw, ph, (f_lo, 1.0), (0.0, top))
    yf = (lambda v: f"{v:.3g}")
    out += _frame(ax1, "MDE vs oracle fraction, by prompts per policy n", "MDE (label scale)", yf)
    for i, (n, cv) in enumerate(zip(ns, curves)):
        col = _PALETTE[i % len(_PALETTE)]
        out.append(ax1.path(fgrid, cv, col))
        ly = ax1.y0 + ax1.h - 12 - 15 * (len(ns) - 1 - i)
        out.append(f'<line x1="{ax1.x0 + 10}" y1="{ly - 4}" x2="{ax1.x0 + 28}" y2="{ly - 4}" '
                   f'stroke="{col}" stroke-width="2"/>')
        out.append(f'<text x="{ax1.x0 + 33}" y="{ly}" class="legend">n = {n:,}</text>')
    if p.get("target_mde"):
        y = ax1.Y(p["target_mde"])
        out.append(f'<line x1="{ax1.x0}" y1="{y:.1f}" x2="{ax1.x0 + ax1.w}" y2="{y:.1f}" stroke="#444" '
                   f'stroke-dasharray="6,4"/>')
        out.append(f'<text x="{ax1.x0 + 6}" y="{y - 5:.1f}" class="legend">target MDE {p["target_mde"]:g}</text>')
    if chosen["mde"] <= top and chosen["oracle_fraction"] >= f_lo:
        cx, cy_ = ax1.X(chosen["oracle_fraction"]), ax1.Y(chosen["mde"])
        out.append(f'<circle cx="{cx:.1f}" cy="{cy_:.1f}" r="5" fill="#111"/>')
        out.append(f'<text x="{cx - 8:.1f}" y="{cy_ + 16:.1f}" text-anchor="end" class="legend">plan: '
                   f'n={chosen["n"]:,}, m={chosen["m"]:,}</text>')
    # Panel 2: iso-cost SE curve
    se = np.asarray(iso["se"])
    se_top = float(min(se.max(), 3 * opt["se"])) * 1.08
    se_bot = float(opt["se"]) * 0.8
    ax2 = _Axes(x_r, 80, pw, ph, (float(fr_iso.min()), 1.0), (se_bot, se_top))
    out += _frame(ax2, f"Iso-cost: SE at budget {iso['budget']:,.0f}", "SE", yf)
    out.append(ax2.path(fr_iso, se, _PALETTE[0], 2.5))
    ox, oy = ax2.X(opt["oracle_fraction"]), ax2.Y(opt["se"])
    out.append(f'<line x1="{ox:.1f}" y1="{ax2.y0}" x2="{ox:.1f}" y2="{ax2.y0 + ax2.h}" stroke="#d62728" '
               f'stroke-dasharray="4,3"/>')
    out.append(f'<circle cx="{ox:.1f}" cy="{oy:.1f}" r="6" fill="#d62728"/>')
    anchor = "start" if opt["oracle_fraction"] < 0.3 else "end"
    dx = 10 if anchor == "start" else -10
    out.append(f'<text x="{ox + dx:.1f}" y="{oy - 12:.1f}" text-anchor="{anchor}" class="legend">optimum '
               f'{opt["oracle_fraction"]:.1%}: n={opt["n"]:,.0f}, m={opt["m"]:,.0f}, SE {opt["se"]:.4f}</text>')
    if p.get("pilot"):
        pf = p["pilot"]["diagnostic"]["oracle_fraction"]
        if fr_iso.min() <= pf <= 1:
            x = ax2.X(pf)
            out.append(f'<line x1="{x:.1f}" y1="{ax2.y0}" x2="{x:.1f}" y2="{ax2.y0 + ax2.h}" stroke="#777" '
                       f'stroke-dasharray="2,3"/>')
            out.append(f'<text x="{x + 4:.1f}" y="{ax2.y0 + 14}" class="tick">pilot {pf:.0%}</text>')
    on_line = abs(chosen["cost"] - iso["budget"]) <= 1e-9 * max(1.0, iso["budget"])
    if on_line and fr_iso.min() <= chosen["oracle_fraction"]:
        cx, cy_ = ax2.X(chosen["oracle_fraction"]), ax2.Y(chosen["se"])
        out.append(f'<circle cx="{cx:.1f}" cy="{cy_:.1f}" r="4.5" fill="#111"/>')
        out.append(f'<text x="{cx:.1f}" y="{cy_ + 18:.1f}" text-anchor="middle" class="legend">plan</text>')
    # Panel 3: share diagnostic along the iso-cost line
    ax3 = _Axes(left, 80 + ph + 80, pw, ph, (float(fr_iso.min()), 1.0), (0.0, 1.0))
    out += _frame(ax3, "Calibration share of variance vs oracle share of budget", "share", lambda v: f"{v:.0%}")
    x_opt = ax3.X(opt["oracle_fraction"])
    out.append(f'<rect x="{ax3.x0}" y="{ax3.y0}" width="{max(0.0, x_opt - ax3.x0):.1f}" height="{ax3.h}" '
               f'fill="#d62728" fill-opacity="0.06"/>')
    out.append(f'<text x="{ax3.x0 + 6}" y="{ax3.y0 + ax3.h - 8}" class="tick">under-labelled</text>')
    out.append(ax3.path(fr_iso, iso["calibration_share"], _PALETTE[1], 2.5))
    out.append(ax3.path(fr_iso, iso["oracle_budget_share"], _PALETTE[2], 2.5))
    share_opt = float(np.interp(math.log(opt["oracle_fraction"]), np.log(fr_iso), iso["oracle_budget_share"]))
    out.append(f'<circle cx="{x_opt:.1f}" cy="{ax3.Y(share_opt):.1f}" r="5" fill="#111"/>')
    for i, (lab, col) in enumerate((("calibration share of variance", _PALETTE[1]),
                                    ("oracle share of budget", _PALETTE[2]))):
        ly = ax3.y0 + 16 + 15 * i
        out.append(f'<line x1="{ax3.x0 + 8}" y1="{ly - 4}" x2="{ax3.x0 + 26}" y2="{ly - 4}" stroke="{col}" '
                   f'stroke-width="2.5"/>')
        out.append(f'<text x="{ax3.x0 + 31}" y="{ly}" class="legend">{lab}</text>')
    # Panel 4: summary
    x4, y4 = x_r, 80 + ph + 80
    out.append(f'<rect x="{x4}" y="{y4}" width="{pw}" height="{ph}" fill="#ffffff" stroke="#999"/>')
    out.append(f'<text x="{x4 + 12}" y="{y4 + 22}" class="title">Recommended design</text>')
    lines = [f"prompts per policy n: {chosen['n']:,}  (judged responses {chosen['responses']:,})",
             f"labels m: {chosen['m']:,}  (oracle labels {chosen['labels']:,})",
             f"oracle fraction: {chosen['oracle_fraction']:.1%}",
             f"cost: {chosen['cost']:,.6g}",
             f"SE {chosen['se']:.4f}   MDE {chosen['mde']:.4f}",
             f"calibration share {chosen['calibration_share']:.0%} / budget share "
             f"{chosen['oracle_budget_share']:.0%}"]
    planned = p.get("planned_for") or [p["target"]]
    if len(planned) > 1:
        lines.append(f"sized for {len(planned)} targets; binding: {chosen.get('target', p['target'])}")
    if p.get("pilot"):
        d = p["pilot"]["diagnostic"]
        state = "under-labelled" if d["under_labelled"] else ("over-labelled" if d["over_labelled"] else "balanced")
        lines += ["", f"pilot: n={p['pilot']['n']:,.0f}, m={p['pilot']['m']:,.0f} "
                      f"({d['oracle_fraction']:.0%}): {state}",
                  f"pilot SE {p['pilot']['se']:.4f}; efficiency {d['efficiency']:.0%} of optimum"]
    for note in p.get("notes") or []:
        lines += ["", note[:70]]
    for i, line in enumerate(lines[:14]):
        out.append(f'<text x="{x4 + 12}" y="{y4 + 46 + 17 * i}" class="small">{html.escape(line)}</text>')
    out.append("</svg>")
    return "\n".join(s for s in out if s) + "\n"
