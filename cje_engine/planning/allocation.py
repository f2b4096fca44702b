"""Exact integer allocations (budget or target MDE), MDE tables, iso-cost curves, diagnostics and
label requests of the budget planner (docs/planner.md)."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.planning.model import (Allocation, VarianceComponents, check_alpha_power, min_labels_of, check_positive,
                                       mde_multiplier)

_SCAN_CHUNK = 1_000_000


def as_components(components: Any) -> list[VarianceComponents]:
    """One or several `VarianceComponents` as a non-empty list (checked to share their design multipliers)."""
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
    budget = check_positive(budget, "budget")
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
    comps = as_components(components)
    first = comps[0]
    cs, cy = first.effective_costs(c_S, c_Y)
    C = check_positive(budget, "budget")
    min_labels = min_labels_of(min_labels)
    alpha, power = check_alpha_power(alpha, power)
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
    comps = as_components(components)
    first = comps[0]
    cs, cy = first.effective_costs(c_S, c_Y)
    alpha, power = check_alpha_power(alpha, power)
    mde = check_positive(target_mde, "target_mde")
    min_labels = min_labels_of(min_labels)
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
    alpha, power = check_alpha_power(alpha, power)
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
    C = check_positive(budget, "budget")
    alpha, power = check_alpha_power(alpha, power)
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
    n_ = check_positive(n, "n (prompts)")
    m_ = check_positive(m, "m (labels)", allow_zero=True)
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
    margin = check_positive(margin, "margin", allow_zero=True)
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
        tse = check_positive(target_se, "target_se")
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
