"""Claims under repeated looks (`cje_engine.inference.sequential`, ``looks="repeated"``).

Pinned twice: the closed forms against a slow, obvious computation (the mixture integral done
numerically), and by the time-uniform error rate on simulated sequences with known truth.
"""
import math

import numpy as np
import pytest
from scipy import integrate
from scipy.stats import norm

from cje_engine import evaluate
from cje_engine.inference.sequential import (anytime_half_width, anytime_p_value, information_ratio, mixture_r,
                                             sequential_width_ratio)
from cje_engine.simulate.direct import PolicySpec, simulate


def _mixture_by_quadrature(z: float, info: float, tau: float) -> float:
    """E over theta ~ N(0, tau^2) of the likelihood ratio exp(theta S - theta^2 I / 2), S = z sqrt(I)."""
    s = z * math.sqrt(info)
    f = lambda th: math.exp(th * s - th * th * info / 2) * norm.pdf(th, scale=tau)  # noqa: E731
    return integrate.quad(f, -50 * tau, 50 * tau, points=[0.0, s / info], limit=400)[0]


@pytest.mark.parametrize("z,info,tau", [(0.0, 100.0, 0.2), (1.5, 400.0, 0.1), (2.7, 50.0, 0.5), (-3.1, 900.0, 0.05)])
def test_the_anytime_p_value_is_one_over_the_mixture_martingale(z, info, tau):
    a = tau * tau * info
    m = _mixture_by_quadrature(z, info, tau)
    se = 1 / math.sqrt(info)
    assert anytime_p_value(z * se, se, a) == pytest.approx(min(1.0, 1 / m), rel=1e-7)


@pytest.mark.parametrize("alpha", [0.01, 0.05, 0.1])
@pytest.mark.parametrize("ratio", [0.05, 1.0, 7.9, 200.0])
def test_the_interval_ends_where_the_anytime_p_value_is_alpha(alpha, ratio):
    se = 0.013
    half = anytime_half_width(se, ratio, alpha)
    assert anytime_p_value(half, se, ratio) == pytest.approx(alpha, rel=1e-9)
    assert anytime_p_value(0.99 * half, se, ratio) > alpha > anytime_p_value(1.01 * half, se, ratio)
    assert half > norm.ppf(1 - alpha / 2) * se  # wider than one look's interval at every information


def test_the_boundary_is_tightest_at_the_planned_labels():
    alpha, planned = 0.05, 200
    # the critical value (half-width over the SE of that look) is smallest at the planned count
    crit = {n: anytime_half_width(1.0, information_ratio(n, planned, alpha), alpha) for n in (50, 100, 150, 200, 260, 400, 800)}
    assert min(crit, key=crit.get) == 200
    assert mixture_r(alpha) == pytest.approx(7.936, abs=1e-3)
    assert sequential_width_ratio(alpha) == pytest.approx(1.549, abs=1e-3)


def _gaussian_looks(theta: float, n_seq: int, looks: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Means of i.i.d. N(theta, 1) observations at each look (n_seq sequences) and their SEs."""
    rng = np.random.default_rng(seed)
    incr = np.diff(np.concatenate([[0], looks]))
    sums = np.cumsum(rng.normal(theta * incr, np.sqrt(incr), size=(n_seq, incr.size)), axis=1)
    return sums / looks, 1 / np.sqrt(looks)


def test_ten_looks_keep_the_false_claim_rate_below_alpha_where_one_look_tests_do_not():
    """4,000 null sequences, a look after every 20 labels up to 200 (the planned count).

    One-look tests at 0.05 claim a difference at some look in about 19% of sequences (the classical
    group-sequential figure for ten equally spaced looks). The anytime p-value must stay at or below
    alpha; the bound 0.05 + 3 x 0.0034 (the binomial SE at 0.05 over 4,000) allows for simulation noise only.
    """
    alpha, looks = 0.05, np.arange(20, 201, 20)
    mean, se = _gaussian_looks(0.0, 4000, looks, seed=11)
    fixed = (np.abs(mean / se) > norm.ppf(1 - alpha / 2)).any(axis=1).mean()
    p = np.array([[anytime_p_value(m, s, information_ratio(n, 200, alpha)) for m, s, n in zip(row, se, looks)]
                  for row in mean])
    anytime = (p <= alpha).any(axis=1).mean()
    assert fixed > 0.15
    assert anytime <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / 4000)


def test_the_confidence_sequence_covers_at_every_look_at_once():
    """Under an alternative (theta = 0.15), the intervals at all ten looks contain theta in >= 95% of
    4,000 sequences (minus 3 binomial SEs); one-look intervals do so far less often."""
    alpha, looks, theta = 0.05, np.arange(20, 201, 20), 0.15
    mean, se = _gaussian_looks(theta, 4000, looks, seed=12)
    half = np.array([anytime_half_width(s, information_ratio(n, 200, alpha), alpha) for s, n in zip(se, looks)])
    covered = (np.abs(mean - theta) <= half).all(axis=1).mean()
    fixed = (np.abs(mean - theta) <= norm.ppf(1 - alpha / 2) * se).all(axis=1).mean()
    assert covered >= 1 - alpha - 3 * math.sqrt(alpha * (1 - alpha) / 4000)
    assert fixed < 0.88


@pytest.fixture(scope="module")
def two_equal_policies():
    return simulate(500, [PolicySpec("a"), PolicySpec("b"), PolicySpec("c", quality_shift=0.6)],
                    oracle_fraction=0.3, seed=3).frame


def test_repeated_looks_widen_every_claim_by_the_confidence_sequence(two_equal_policies):
    one = evaluate(two_equal_policies, inference="analytic", baseline="a").to_dict()
    rep = evaluate(two_equal_policies, inference="analytic", baseline="a", looks="repeated",
                   planned_labels=100).to_dict()
    assert one["multiplicity"]["looks"] == "one" and one["multiplicity"]["planned_labels"] is None
    assert rep["multiplicity"] == {**rep["multiplicity"], "looks": "repeated", "planned_labels": 100, "method": "holm"}
    own = {n: p["audit"]["n_labels"] for n, p in rep["policies"].items()}
    for c1, cr in zip(one["comparisons"], rep["comparisons"]):
        assert (c1["a"], c1["b"]) == (cr["a"], cr["b"]) and cr["diff"] == pytest.approx(c1["diff"])
        n = min(own[cr["a"]], own[cr["b"]])
        half = anytime_half_width(cr["se"], information_ratio(n, 100, 0.05), 0.05)  # by hand
        assert cr["ci"] == pytest.approx([cr["diff"] - half, cr["diff"] + half], abs=1e-12)
        assert cr["p_value"] >= c1["p_value"]
    for b1, br in zip(one["baseline_comparisons"], rep["baseline_comparisons"]):
        assert br["critical_value"] > b1["critical_value"]
        assert br["ci"][0] < b1["ci"][0] and br["ci"][1] > b1["ci"][1]
    # a large true difference is still claimed (c is 0.6 on the probit scale above a and b)
    assert any(c["significant"] for c in rep["comparisons"] if "c" in (c["a"], c["b"]))


def test_bad_look_options_are_one_line_input_errors():
    from cje_engine.errors import CJEInputError
    from cje_engine.options import EvaluationOptions

    with pytest.raises(CJEInputError, match="looks must be one or repeated; got 'repeat'.*did you mean 'repeated'"):
        EvaluationOptions.build(looks="repeat")
    with pytest.raises(CJEInputError, match="planned_labels must be at least 2"):
        EvaluationOptions.build(looks="repeated", planned_labels=1)
    with pytest.raises(CJEInputError, match="planned_labels must be an integer"):
        EvaluationOptions.build(planned_labels="many")
