"""`cje_engine.calibration.logit_stack._product`: the stacked logit fits' design products without the design's
zeros, the same bits as the einsum they replace (values and signs of zeros)."""
from __future__ import annotations

import numpy as np
import pytest

from cje_engine.calibration import logit_stack as ls


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.int64), b.view(np.int64))


@pytest.mark.parametrize("n, s, q", [(1, 610, 325), (18, 610, 325), (96, 420, 190), (5, 30, 1), (6, 40, 7)])
def test_product_equals_the_einsum_bit_for_bit(n, s, q):
    """Random sums (some +0.0 and -0.0) times a design with unit columns (the covariate products' rows), zero
    columns and sparse dense columns: every output word equal to ``einsum("js,sq->jq")``'s (the reference)."""
    rng = np.random.default_rng(n * 1000 + q)
    a = rng.standard_normal((n, s)) * rng.exponential(1.0, (n, s))
    a[rng.random((n, s)) < 0.1] = 0.0
    a[rng.random((n, s)) < 0.05] = -0.0
    m = rng.standard_normal((s, q))
    m[rng.random((s, q)) < 0.9] = 0.0
    third = q // 3
    m[:, :third] = 0.0
    for t in range(1, third, 2):  # unit columns; the even ones stay all zero
        m[rng.integers(s), t] = 1.0
    ref = ls._einsum("js,sq->jq", a, m)
    assert _same_bits(ls._product(a, m), ref)
    out = np.full((n, q), 7.0)
    ls._product(a, m, out=out)
    assert _same_bits(out, ref)


def test_product_with_a_non_finite_sum_is_the_einsum():
    """An infinite sum makes the einsum's zero products NaN: `_product` then runs the einsum itself."""
    a = np.array([[1.0, np.inf, 2.0]])
    m = np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 3.0]])
    ref = ls._einsum("js,sq->jq", a, m)
    got = ls._product(a, m)
    assert np.isnan(ref).all() and np.array_equal(got, ref, equal_nan=True)
