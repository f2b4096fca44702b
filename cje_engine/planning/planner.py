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

import logging
import math
from typing import Any, Mapping, Sequence

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.planning.allocation import (allocation_diagnostic, allocation_for_mde, iso_cost_curve,
                                            labels_to_request, mde_table, optimal_allocation, as_components)
from cje_engine.planning.components import (Pilot, pilot_of, components_from_result, difference_components,
                                            policy_components)
from cje_engine.planning.model import VarianceComponents, check_alpha_power, check_costs, min_labels_of, mde_multiplier

log = logging.getLogger(__name__)

PLANNER_VERSION = 1
#: Oracle fractions of the default MDE table.
DEFAULT_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
#: Multiples of the chosen n in the default MDE table.
DEFAULT_N_MULTIPLES = (0.25, 0.5, 1.0, 2.0, 4.0)
#: Minimum detectable effect planned for when neither a budget nor an MDE is given, as a fraction of the
#: width of the label scale (0.02 on 0-1, 0.08 label units on 1-5, 2 on 0-100).
DEFAULT_TARGET_MDE = 0.02


def label_scale_of(result: Mapping[str, Any]) -> tuple[float, float]:
    """The declared label scale of a result (``config.label_scale``; 0-1 when the result has none)."""
    scale = (result.get("config") or {}).get("label_scale")
    try:
        lo, hi = (float(v) for v in scale)
    except (TypeError, ValueError):
        return 0.0, 1.0
    return (lo, hi) if hi > lo else (0.0, 1.0)


def default_target_mde(result: Mapping[str, Any]) -> tuple[float, str]:
    """(the default target MDE in label units, the note that says so): `DEFAULT_TARGET_MDE` of the
    width of the result's label scale."""
    lo, hi = label_scale_of(result)
    mde = DEFAULT_TARGET_MDE * (hi - lo)
    return mde, (f"target MDE {mde:g} label units: the default, {DEFAULT_TARGET_MDE:g} of the label scale "
                 f"{lo:g}-{hi:g} (a target MDE given is in label units)")


def default_pairs(result: Mapping[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """The pairs to plan for by default, and notes on the pairs left out.

    A pair is left out when the pilot already resolves it (its multiplicity-adjusted comparison is
    significant: more data cannot change that verdict) or when the result does not report it
    (``reported: false`` / ``not_estimable``). When that leaves nothing, every pair is kept.
    """
    names = list(result["policies"])
    by_pair = {frozenset((c.get("a"), c.get("b"))): c for c in result.get("comparisons") or []}
    keep, resolved, unreported = [], [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            c = by_pair.get(frozenset((a, b))) or {}
            if c.get("reported") is False or c.get("not_estimable"):
                unreported.append(f"{a} - {b}")
            elif c.get("significant"):
                p = c.get("p_adjusted")
                resolved.append(f"{a} - {b}" + (f" (adjusted p {p:.2g})" if isinstance(p, (int, float)) else ""))
            else:
                keep.append((a, b))
    notes = []
    if resolved:
        notes.append("already resolved by the pilot, so not planned for: " + ", ".join(resolved)
                     + "; name a pair as a target to include it")
    if unreported:
        notes.append("not estimable in the pilot, so not planned for: " + ", ".join(unreported))
    if not keep:
        keep = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
        notes = ["every pair is already resolved by the pilot: planning for all of them"]
    return keep, notes

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
    comps = as_components(components)
    c_S, c_Y = check_costs(c_S, c_Y)
    alpha, power = check_alpha_power(alpha, power)
    min_labels = min_labels_of(min_labels)
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
                     c_Y: float = 16.0, *, target: Any = None, targets: Sequence[Any] | None = None,
                     scope: str = "all", alpha: float | None = None, power: float = 0.8,
                     min_labels: int | None = None) -> dict:
    """The planner's entry point for a CLI: a JSON-ready plan from a pilot result.

    Parameters
    ----------
    result : dict or EvaluationResult
        ``evaluate(...).to_dict()`` (or the object: its influence terms give exact paired variances).
    budget, target_mde : float, optional
        Plan for a budget (cost units of c_S/c_Y), for a minimum detectable effect on the label
        scale (label units), or both. Neither: the target MDE is `DEFAULT_TARGET_MDE` (0.02) of the width
        of the result's label scale (``config.label_scale``: 0.02 on 0-1, 0.08 on 1-5), with a note.
    c_S, c_Y : float
        Cost of one judged response and of one oracle label.
    target, targets : str or pair, or a list of them, optional
        A policy, ``"a - b"`` (spaces optional: ``"a-b"``) or ``(a, b)``; several are planned together
        (the design is sized so the worst of them meets the budget or MDE goal). Default: every
        pairwise difference the pilot has not already resolved (its adjusted comparison is not
        significant and is reported); every pair when all are resolved; the policy itself when
        there is only one.
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
    pilot = pilot_of(result)
    c_S, c_Y = check_costs(c_S, c_Y)
    if scope not in ("all", "target"):
        raise CJEInputError(f"scope must be 'target' or 'all', got {scope!r}")
    cfg = pilot.result.get("config") or {}
    if alpha is None:
        alpha = cfg.get("alpha", 0.05)
    if min_labels is None:
        min_labels = int(cfg.get("min_labels", 1) or 1)
    names = pilot.names
    wanted = list(targets or []) + ([target] if target is not None else [])
    extra_notes: list[str] = []
    if budget is None and target_mde is None:
        target_mde, note = default_target_mde(pilot.result)
        extra_notes.append(note)
    if wanted:
        comps = [components_from_result(pilot, t, scope=scope) for t in wanted]
        how = "requested"
    elif len(names) > 1:
        pairs, pair_notes = default_pairs(pilot.result)
        extra_notes += pair_notes
        comps = [difference_components(pilot, a, b, scope=scope) for a, b in pairs]
        how = "every pair not yet resolved by the pilot (sized for the worst)"
    else:
        comps = [components_from_result(pilot, names[0], scope=scope)]
        how = "the only policy"
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
    out["notes"] = extra_notes + out["notes"]
    out["label_scale"] = list(label_scale_of(pilot.result))
    out["scope"] = scope
    out["target_choice"] = how
    out["source"] = {"engine_version": pilot.result.get("engine_version"), "n_prompts": data.get("n_prompts"),
                     "n_rows": data.get("n_rows"), "n_labelled": data.get("n_labelled"), "policies": names,
                     "paired_variance": "influence" if pilot.cov_total is not None else
                     ("comparisons" if pilot.result.get("comparisons") else "none")}
    return out


def plan_from_data(data: Any, budget: float | None = None, target_mde: float | None = None, c_S: float = 1.0,
                   c_Y: float = 16.0, *, target: Any = None, targets: Sequence[Any] | None = None,
                   scope: str = "all", alpha: float | None = None, power: float = 0.8,
                   min_labels: int | None = None, **evaluate_options: Any) -> dict:
    """Plan from a pilot dataset: runs the engine (analytic inference) and keeps the calibration
    influence terms, so paired plug-in differences get their exact calibration covariance."""
    from cje_engine.inference.variance import cluster_cov
    from cje_engine.pipeline.direct import finalize, prepare

    evaluate_options = {**evaluate_options, "inference": "analytic"}
    prep = prepare(data, **evaluate_options)
    res = finalize(prep, [])
    from cje_engine.pipeline.policies import extend_with_verified

    ext = extend_with_verified(prep, None)  # the columns ``res.columns`` index: plug-in, augmented, own, verified
    total, cal = ext.total, ext.calibration
    pilot = Pilot(res.to_dict(), cov_total=cluster_cov(total), cov_cal=cluster_cov(cal),
                   cov_eval=cluster_cov(np.nan_to_num(total) - np.nan_to_num(cal)), columns=np.asarray(res.columns))
    return plan_from_result(pilot, budget, target_mde, c_S, c_Y, target=target, targets=targets, scope=scope,
                            alpha=alpha, power=power, min_labels=min_labels)


__all__ = ["PLANNER_VERSION", "DEFAULT_FRACTIONS", "DEFAULT_N_MULTIPLES", "DEFAULT_TARGET_MDE", "default_pairs", "plan",
           "default_target_mde", "label_scale_of",
           "plan_from_result", "plan_from_data"]
