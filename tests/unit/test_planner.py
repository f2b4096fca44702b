"""Budget planner: closed forms against brute force, diagnostics, request sizing, errors, rendering."""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from scipy.stats import norm

from cje_engine import evaluate
from cje_engine.errors import CJEInputError
from cje_engine.planning.allocation import (allocation_diagnostic, allocation_for_mde, continuous_optimum,
                                            is_under_labelled, iso_cost_curve, labels_to_request, mde_table,
                                            optimal_allocation)
from cje_engine.planning.components import (components_from_result, difference_components, policy_components,
                                            parse_target)
from cje_engine.planning.model import VarianceComponents, mde_multiplier
from cje_engine.planning.planner import plan, plan_from_data, plan_from_result
from flows.reports.plan import render_plan_svg, render_plan_text


# --------------------------------------------------------------------------------------
# brute force references


def brute_budget(comps, budget, cs, cy, min_labels=1):
    """Smallest max-variance over every integer (n, m), min_labels <= m <= n, cost <= budget."""
    best = math.inf
    n_max = int(budget // (cs + 0.0)) + 1
    m_all = np.arange(min_labels, int(budget // cy) + 2)
    for n in range(1, n_max + 1):
        m = m_all[(m_all <= n) & (cs * n + cy * m_all <= budget * (1 + 1e-12))]
        if m.size == 0:
            continue
        v = np.max([c.sigma2_eval / n + c.sigma2_cal / m for c in comps], axis=0)
        best = min(best, float(v.min()))
    return best


def brute_mde(comps, V, cs, cy, n_max, min_labels=1):
    """Cheapest integer (n, m) with every variance <= V, searched over n <= n_max."""
    best = math.inf
    for n in range(1, n_max + 1):
        m = np.arange(min_labels, n + 1)
        v = np.max([c.sigma2_eval / n + c.sigma2_cal / m for c in comps], axis=0)
        ok = v <= V * (1 + 1e-12)
        if ok.any():
            best = min(best, float(cs * n + cy * m[ok][0]))
    return best


def _rand_comp(rng, **kw):
    A = float(rng.choice([0.0, 1.0]) * rng.uniform(0.001, 0.1)) if rng.random() < 0.15 else rng.uniform(0.001, 0.1)
    B = rng.uniform(0.001, 0.1) if A > 0 or rng.random() < 0.5 else 0.05
    return VarianceComponents(A, B, **kw)


@pytest.mark.parametrize("seed", range(25))
def test_optimal_allocation_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    comp = _rand_comp(rng)
    c_S = float(rng.choice([1.0, 0.7, 2.5]))
    c_Y = float(rng.choice([16.0, 5.0, 40.0, 1.0]))
    budget = float(rng.uniform(60, 1500))
    min_labels = int(rng.choice([1, 5]))
    if budget < (c_S + c_Y) * min_labels:
        budget = (c_S + c_Y) * min_labels * 3
    al = optimal_allocation(comp, budget, c_S, c_Y, min_labels=min_labels)
    ref = brute_budget([comp], budget, c_S, c_Y, min_labels)
    assert al.cost <= budget * (1 + 1e-12)
    assert min_labels <= al.m <= al.n
    assert al.variance == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_allocation_for_mde_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    comp = _rand_comp(rng)
    c_S = float(rng.choice([1.0, 0.5]))
    c_Y = float(rng.choice([16.0, 4.0, 1.0]))
    alpha, power = 0.05, float(rng.choice([0.8, 0.9]))
    k = mde_multiplier(alpha, power)
    target = k * math.sqrt(comp.sigma2_eval / 300 + comp.sigma2_cal / 150) * rng.uniform(1.0, 2.0)
    al = allocation_for_mde(comp, target, alpha, power, c_S, c_Y)
    V = (target / k) ** 2
    # any design at most as cheap as the planner's has n <= cost / c_S: the search is complete
    ref = brute_mde([comp], V, c_S, c_Y, n_max=int(al.cost / c_S) + 1)
    assert al.mde <= target * (1 + 1e-9)
    assert al.variance <= V * (1 + 1e-12)
    assert al.cost == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_minimax_over_several_components_matches_brute_force(seed):
    rng = np.random.default_rng(200 + seed)
    comps = [VarianceComponents(rng.uniform(0.001, 0.1), rng.uniform(0.001, 0.1), target=f"t{i}") for i in range(3)]
    budget = float(rng.uniform(200, 1200))
    al = optimal_allocation(comps, budget, 1.0, 16.0)
    assert al.variance == pytest.approx(brute_budget(comps, budget, 1.0, 16.0), rel=1e-12)
    assert al.variance == pytest.approx(max(c.variance(al.n, al.m) for c in comps))
    assert al.target == max(comps, key=lambda c: c.variance(al.n, al.m)).target
    k = mde_multiplier()
    target = k * math.sqrt(max(c.sigma2_eval / 250 + c.sigma2_cal / 120 for c in comps))
    am = allocation_for_mde(comps, target, c_S=1.0, c_Y=16.0)
    assert am.cost == pytest.approx(brute_mde(comps, (target / k) ** 2, 1.0, 16.0, n_max=int(am.cost) + 1), rel=1e-12)


def test_large_budget_is_fast_and_exact_near_the_continuous_optimum():
    comp = VarianceComponents(0.02, 0.05)
    al = optimal_allocation(comp, 5e7, 1.0, 16.0)
    # exact integer optimum: no neighbour on the budget line does better
    for m in range(al.m - 50, al.m + 51):
        n = int((5e7 - 16 * m) // 1)
        assert comp.variance(n, m) >= al.variance * (1 - 1e-13)
    assert al.m == pytest.approx(al.m_continuous, rel=1e-3)


def test_square_root_law_closed_form():
    A, B, cs, cy, C = 0.03, 0.02, 1.0, 16.0, 10_000.0
    comp = VarianceComponents(A, B)
    n, m = continuous_optimum(comp, C, cs, cy)
    a, b = math.sqrt(A * cs), math.sqrt(B * cy)
    assert n == pytest.approx(C * math.sqrt(A / cs) / (a + b))
    assert m == pytest.approx(C * math.sqrt(B / cy) / (a + b))
    assert comp.variance(n, m) == pytest.approx((a + b) ** 2 / C)
    # optimum: calibration share of variance == oracle share of budget (exact in the continuous problem)
    cal, bud = comp.shares(n, m, cs, cy)
    assert cal == pytest.approx(bud, abs=1e-12)
    assert comp.optimal_fraction(cs, cy) == pytest.approx(math.sqrt(B * cs / (A * cy)))
    # a design with a higher fraction at the same cost is over-labelled, a lower one under-labelled
    d_lo = allocation_diagnostic(comp, n * 1.2, (C - cs * n * 1.2) / cy, cs, cy)
    d_hi = allocation_diagnostic(comp, n * 0.8, (C - cs * n * 0.8) / cy, cs, cy)
    assert d_lo["under_labelled"] and not d_lo["over_labelled"]
    assert d_hi["over_labelled"] and not d_hi["under_labelled"]
    assert d_lo["efficiency"] < 1 and d_hi["efficiency"] < 1


@pytest.mark.parametrize("budget", [2_000.0, 50_000.0, 3e6])
def test_integer_optimum_balances_shares_within_rounding(budget):
    comp = VarianceComponents(0.03, 0.02)
    cs, cy = 1.0, 16.0
    al = optimal_allocation(comp, budget, cs, cy)
    # Tolerance: the integer optimum sits |m - m_c| labels from the continuous optimum (where the
    # shares are equal); along the budget line d(share_cal - share_budget)/dm is at most
    # 1/m + cy/(cs n) + cy/C (derivatives of the two shares), so the gap is at most
    # (|m - m_c| + 1) times that (the +1 covers the floor of n).
    slope = 1 / al.m + cy / (cs * al.n) + cy / budget
    tol = (abs(al.m - al.m_continuous) + 1) * slope
    assert abs(al.calibration_share - al.oracle_budget_share) <= tol
    assert abs(al.calibration_share - al.oracle_budget_share) < 0.05


def test_m_le_n_constraint_binds_when_labels_are_cheap():
    comp = VarianceComponents(0.001, 0.5)  # calibration dominates: optimal fraction > 1 unconstrained
    al = optimal_allocation(comp, 1700.0, 1.0, 16.0)
    assert comp.optimal_fraction(1.0, 16.0) == 1.0
    assert al.m == al.n == 100 and al.binding.startswith("m <= n")
    assert al.variance == pytest.approx(brute_budget([comp], 1700.0, 1.0, 16.0))


def test_pure_evaluation_variance_uses_min_labels():
    comp = VarianceComponents(0.05, 0.0)
    al = optimal_allocation(comp, 1000.0, 1.0, 16.0, min_labels=10)
    assert al.m == 10 and al.n == 1000 - 160
    am = allocation_for_mde(comp, 0.05, c_S=1.0, c_Y=16.0, min_labels=10)
    V = (0.05 / mde_multiplier()) ** 2
    assert am.n == math.ceil(0.05 / V) and am.m == 10


def test_mde_table_formula():
    comp = VarianceComponents(0.04, 0.03)
    t = mde_table(comp, [100, 1000], [0.05, 0.5, 1.0], alpha=0.1, power=0.9, c_S=1.0, c_Y=16.0)
    k = norm.ppf(0.95) + norm.ppf(0.9)
    assert t["m"] == [[5, 50, 100], [50, 500, 1000]]
    for i, n in enumerate([100, 1000]):
        for j, m in enumerate(t["m"][i]):
            assert t["mde"][i][j] == pytest.approx(k * math.sqrt(0.04 / n + 0.03 / m))
            assert t["cost"][i][j] == pytest.approx(n + 16 * m)
    json.dumps(t, allow_nan=False)


def test_iso_cost_curve_is_iso_cost_and_minimised_at_the_optimum():
    comp = VarianceComponents(0.01, 0.04)
    curve = iso_cost_curve(comp, 20_000.0, 1.0, 16.0)
    n, m = np.array(curve["n"]), np.array(curve["m"])
    assert np.allclose(n + 16 * m, 20_000.0)
    se = np.array(curve["se"])
    opt = curve["optimum"]
    assert se.min() == pytest.approx(opt["se"])
    assert curve["oracle_fraction"][int(np.argmin(se))] == pytest.approx(opt["oracle_fraction"])
    cal, bud = np.array(curve["calibration_share"]), np.array(curve["oracle_budget_share"])
    left = np.array(curve["oracle_fraction"]) < opt["oracle_fraction"]
    assert np.all(cal[left] > bud[left]) and np.all(cal[~left] <= bud[~left] + 1e-12)


def test_is_under_labelled_iff_fraction_below_optimum():
    comp = VarianceComponents(0.02, 0.03)
    r = comp.optimal_fraction(1.0, 16.0)
    n = 1000
    for m in (10, int(r * n) - 2, int(r * n) + 2, 900):
        assert is_under_labelled(comp, n, m, 1.0, 16.0) == (m / n < r)
    assert not is_under_labelled(comp, 100, 100, 1.0, 16.0)  # everything labelled
    assert is_under_labelled(comp, 100, 0, 1.0, 16.0)
    m = int(r * n) - 5
    cal, bud = comp.shares(n, m, 1.0, 16.0)
    assert is_under_labelled(comp, n, m, 1.0, 16.0, margin=(cal - bud) / 2)
    assert not is_under_labelled(comp, n, m, 1.0, 16.0, margin=(cal - bud) * 2)


def test_labels_to_request_balance_and_target():
    comp = VarianceComponents(0.02, 0.05)
    n, m = 2000, 100
    r = comp.optimal_fraction(1.0, 16.0)
    req = labels_to_request(comp, n, m, 1.0, 16.0)
    assert req["goal"] == "balance" and req["m_after"] == math.ceil(r * n)
    assert req["labels"] == math.ceil(r * n) - m and req["cost"] == 16 * req["labels"]
    assert not is_under_labelled(comp, n, req["m_after"], 1.0, 16.0)
    assert is_under_labelled(comp, n, req["m_after"] - 1, 1.0, 16.0)
    # target SE: the fewest labels that reach it
    tse = 0.008
    req = labels_to_request(comp, n, m, 1.0, 16.0, target_se=tse)
    assert req["reachable"] and req["se_after"] <= tse
    assert comp.se(n, req["m_after"] - 1) > tse
    # unreachable by labels: evaluation variance alone exceeds the target
    req = labels_to_request(comp, n, m, 1.0, 16.0, target_se=0.003)
    assert not req["reachable"] and req["m_after"] == math.ceil(r * n)
    # a request budget caps it (labels_per_unit 2: a pair of policies)
    pair = VarianceComponents(0.02, 0.05, labels_per_unit=2, responses_per_prompt=2)
    req = labels_to_request(pair, n, m, 1.0, 16.0, max_labels=51)
    assert req["capped"] and req["m_extra"] == 25 and req["labels"] == 50
    # already balanced: nothing requested
    assert labels_to_request(comp, n, math.ceil(r * n) + 10, 1.0, 16.0)["labels"] == 0


def test_cost_multipliers_scale_costs_not_fraction():
    one = VarianceComponents(0.02, 0.04)
    four = VarianceComponents(0.02, 0.04, responses_per_prompt=4, labels_per_unit=4)
    assert one.optimal_fraction(1, 16) == pytest.approx(four.optimal_fraction(1, 16))
    a1 = optimal_allocation(one, 5000.0, 1.0, 16.0)
    a4 = optimal_allocation(four, 20000.0, 1.0, 16.0)
    assert (a1.n, a1.m) == (a4.n, a4.m)
    assert a4.responses == 4 * a4.n and a4.labels == 4 * a4.m and a4.cost == pytest.approx(4 * a1.cost)
    # shared calibration labels (one label set for four policies) favour a larger oracle fraction
    shared = VarianceComponents(0.02, 0.04, responses_per_prompt=4, labels_per_unit=1)
    assert shared.optimal_fraction(1, 16) == pytest.approx(2 * one.optimal_fraction(1, 16))


# --------------------------------------------------------------------------------------
# components from results


@pytest.fixture(scope="module")
def arena(arena_dir):
    return evaluate(arena_dir, calibration_policies=["base"], inference="analytic", level_estimator="robust")


def test_policy_components_come_from_the_result(arena):
    d = arena.to_dict()
    for name, p in d["policies"].items():
        vc = p["variance_components"]
        c = policy_components(d, name)
        assert (c.sigma2_eval, c.sigma2_cal, c.n_pilot, c.m_pilot) == (
            vc["sigma2_eval"], vc["sigma2_cal"], vc["n_prompts"], vc["m_labels"])
        # the components reproduce the pilot's analytic SE
        assert math.sqrt(c.pilot_variance()) == pytest.approx(p["se"], rel=1e-9)


def test_difference_components_reproduce_the_paired_variance(arena):
    d = arena.to_dict()
    for comp in d["comparisons"]:
        c_dict = difference_components(d, comp["a"], comp["b"])
        c_obj = difference_components(arena, comp["a"], comp["b"])
        assert c_dict.sigma2_eval == pytest.approx(c_obj.sigma2_eval, rel=1e-6, abs=1e-12)
        assert c_dict.responses_per_prompt == 2 and c_dict.labels_per_unit == 2
        if c_dict.sigma2_eval > 0:  # not floored: pilot variance = paired analytic variance
            assert c_dict.pilot_variance() == pytest.approx(comp["se_analytic"] ** 2, rel=1e-9)
    c = components_from_result(d, "base - clone")
    assert c.target == "base - clone"
    assert components_from_result(d, ("clone", "base")).target == "clone - base"


def test_exact_data_route_uses_the_evaluation_influence(arena_dir):
    from cje_engine.inference.variance import cluster_cov
    from cje_engine.pipeline.direct import finalize, prepare

    prep = prepare(arena_dir, calibration_policies=["base"], inference="analytic", level_estimator="audited")
    res = finalize(prep, [])
    plan_d = plan_from_data(arena_dir, calibration_policies=["base"], target="base - unhelpful", scope="target",
                            level_estimator="audited")
    names = list(res.to_dict()["policies"])
    ca, cb = res.columns[names.index("base")], res.columns[names.index("unhelpful")]
    e = np.nan_to_num(prep.infl["total"]) - np.nan_to_num(prep.infl["calibration"])
    v_eval = cluster_cov((e[:, ca] - e[:, cb])[:, None])[0, 0]
    assert plan_d["components"]["sigma2_eval"] == pytest.approx(v_eval * 1000)
    assert plan_d["components"]["method"].startswith("exact paired evaluation variance")


def test_arena_plan_end_to_end(arena):
    d = arena.to_dict()
    pairs = [f"{a} - {b}" for i, a in enumerate(d["policies"]) for b in list(d["policies"])[i + 1:]]
    p = plan_from_result(d, budget=20_000, target_mde=0.05, c_S=1, c_Y=16, targets=pairs)
    json.dumps(p, allow_nan=False)
    assert len(p["planned_for"]) == 6 and p["scope"] == "all"
    al = p["allocation_for_budget"]
    assert al["cost"] <= 20_000 and al["responses"] == 4 * al["n"] and al["labels"] == 4 * al["m"]
    # sized for the worst difference: every pair's variance at the plan is at most the binding one
    assert max(x["se_at_plan"] for x in p["differences"]) == pytest.approx(al["se"])
    for name, s in p["policies"].items():
        vc = d["policies"][name]["variance_components"]
        assert s["optimal_fraction"] == pytest.approx(min(1.0, math.sqrt(vc["sigma2_cal"] / vc["sigma2_eval"] / 16)))
    mde_al = p["allocation_for_mde"]
    k = p["mde_multiplier"]
    pair_mdes = [k * difference_components(d, x["a"], x["b"], scope="all").se(mde_al["n"], mde_al["m"])
                 for x in p["differences"]]
    assert max(pair_mdes) <= 0.05 * (1 + 1e-9)  # every comparison reaches the target MDE
    assert max(pair_mdes) == pytest.approx(mde_al["mde"])
    # text and SVG
    txt = render_plan_text(p)
    assert "square-root law" in txt and f"{al['n']:>10,}" in txt and "base - clone" in txt
    svg = render_plan_svg(p)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    assert "href" not in svg  # self-contained
    assert "optimum" in svg and "Iso-cost" in svg
    # default: the target MDE 0.02 for the pairs the pilot has not resolved yet
    p0 = plan_from_result(arena)
    unresolved = {f"{c['a']} - {c['b']}" for c in d["comparisons"] if not c["significant"]}
    resolved = {f"{c['a']} - {c['b']}" for c in d["comparisons"] if c["significant"]}
    assert unresolved and resolved  # the Arena pilot has both kinds
    assert set(p0["planned_for"]) == unresolved and p0["target_mde"] == 0.02
    assert p0["allocation_for_budget"] is None and p0["allocation_for_mde"]["mde"] <= 0.02 * (1 + 1e-9)
    assert any("already resolved" in n and all(r in n for r in resolved) for n in p0["notes"])
    assert not any("plan_" in n or "(" in n.split(":")[0] for n in p0["notes"])  # no function names
    assert p0["target_choice"].startswith("every pair not yet resolved")


def test_targets_parse_with_or_without_spaces(arena):
    d = arena.to_dict()
    assert parse_target(d, "base-clone") == parse_target(d, "base - clone") == ("base", "clone")
    assert parse_target(d, " base -clone ") == ("base", "clone")
    assert parse_target(d, "parallel_universe_prompt-unhelpful") == ("parallel_universe_prompt", "unhelpful")
    assert parse_target(d, "base") == ("base",)
    # names containing '-': the split that gives two known names wins; two such splits are an error
    hy = {"policies": {n: d["policies"]["base"] for n in ("gpt-4", "gpt", "4-mini", "a-b", "a", "b-c", "c")}}
    assert parse_target(hy, "gpt-4 - gpt") == ("gpt-4", "gpt")
    assert parse_target(hy, "gpt-4-mini") == ("gpt", "4-mini")
    with pytest.raises(CJEInputError, match="ambiguous"):
        parse_target(hy, "a-b-c")
    with pytest.raises(CJEInputError, match="unknown policy 'nope'"):
        parse_target(d, "base-nope")


def test_single_policy_plan_and_user_components():
    comp = VarianceComponents.from_dict({"sigma2_eval": 0.02, "sigma2_cal": 0.04, "n_prompts": 500,
                                         "m_labels": 50}, target="mine")
    p = plan(comp, target_mde=0.05, c_S=1.0, c_Y=16.0)
    assert p["target"] == "mine" and p["allocation_for_mde"]["mde"] <= 0.05
    assert p["pilot"]["diagnostic"]["under_labelled"]
    assert p["pilot"]["label_request"]["labels"] > 0
    text = render_plan_text(p)
    assert "UNDER-labelled" in text
    ET.fromstring(render_plan_svg(p))
    both = plan(comp, budget=1000.0, target_mde=0.01)
    assert any("cannot reach the target MDE" in n for n in both["notes"])


# --------------------------------------------------------------------------------------
# bad input


def test_errors_on_bad_costs_and_budgets():
    comp = VarianceComponents(0.02, 0.04)
    with pytest.raises(CJEInputError, match="c_S"):
        optimal_allocation(comp, 1000.0, -1.0, 16.0)
    with pytest.raises(CJEInputError, match="c_Y"):
        optimal_allocation(comp, 1000.0, 1.0, 0.0)
    with pytest.raises(CJEInputError, match="budget must be"):
        optimal_allocation(comp, -5.0, 1.0, 16.0)
    with pytest.raises(CJEInputError, match="too small"):
        optimal_allocation(comp, 16.5, 1.0, 16.0)
    with pytest.raises(CJEInputError, match="too small"):
        optimal_allocation(comp, 100.0, 1.0, 16.0, min_labels=10)
    with pytest.raises(CJEInputError, match="target_mde"):
        allocation_for_mde(comp, 0.0)
    with pytest.raises(CJEInputError, match="alpha"):
        allocation_for_mde(comp, 0.05, alpha=1.5)
    with pytest.raises(CJEInputError, match="power"):
        mde_multiplier(0.05, 1.0)
    with pytest.raises(CJEInputError, match="cannot exceed n"):
        is_under_labelled(comp, 10, 20)
    with pytest.raises(CJEInputError, match="min_labels"):
        optimal_allocation(comp, 1000.0, min_labels=0)
    with pytest.raises(CJEInputError, match="budget or a target MDE"):
        plan(comp)
    with pytest.raises(CJEInputError, match="oracle fractions"):
        mde_table(comp, [100], [0.0])


def test_errors_on_bad_components():
    with pytest.raises(CJEInputError, match="sigma2_cal"):
        VarianceComponents(0.02, -0.1)
    with pytest.raises(CJEInputError, match="both variance components are zero"):
        VarianceComponents(0.0, 0.0)
    with pytest.raises(CJEInputError, match="lack sigma2_cal"):
        VarianceComponents.from_dict({"sigma2_eval": 0.1})
    with pytest.raises(CJEInputError, match="share their cost multipliers"):
        optimal_allocation([VarianceComponents(0.1, 0.1), VarianceComponents(0.1, 0.1, labels_per_unit=2)], 1000.0)


def test_errors_on_bad_results(arena):
    d = arena.to_dict()
    with pytest.raises(CJEInputError, match="unknown policy 'nope'") as ei:
        plan_from_result(d, target="nope")
    assert ei.value.column == "policy"
    with pytest.raises(CJEInputError, match="unknown policy 'nope'"):
        plan_from_result(d, target="base - nope")
    broken = json.loads(json.dumps(d))
    del broken["policies"]["clone"]["variance_components"]
    with pytest.raises(CJEInputError, match="'clone' has no variance_components") as ei:
        plan_from_result(broken)
    assert ei.value.column == "variance_components"
    no_labels = json.loads(json.dumps(d))
    no_labels["policies"]["base"]["variance_components"]["m_labels"] = 0
    with pytest.raises(CJEInputError, match="rests on 0 labels"):
        plan_from_result(no_labels, target="base")
    with pytest.raises(CJEInputError, match="no 'policies'"):
        plan_from_result({"schema_version": 1})
    with pytest.raises(CJEInputError, match="expected an evaluation result"):
        plan_from_result([1, 2])
    with pytest.raises(CJEInputError, match="scope"):
        plan_from_result(d, scope="everything")
    with pytest.raises(CJEInputError, match="two different policies"):
        difference_components(d, "base", "base")
    with pytest.raises(CJEInputError, match="name a target"):
        components_from_result(d)
    with pytest.raises(CJEInputError, match="too small"):
        plan_from_result(d, budget=50.0)
