"""The `EvalData` build that takes its frame over, and the memory-lean code helpers (issue 15).

Every lower-memory path must give the very same arrays as the plain one: these tests compare
them element for element (integers and floats exactly, no tolerance).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cje_engine.data import identity
from cje_engine.data.frame import EvalData, fold_of
from cje_engine.data.io import load_frame
from cje_engine.inference.variance import cluster_cov
from cje_engine.simulate import simulate

FIELDS = ("prompt", "policy", "score", "label", "label_weight", "X", "fold")


def _frame(seed: int = 3) -> pd.DataFrame:
    frame = load_frame(simulate(n_prompts=400, oracle_fraction=0.2, seed=seed).frame, covariates=["response_length"])
    frame["len2"] = frame["response_length"] * 0.5 + 1.0
    lab = frame["oracle_label"].notna().to_numpy()
    prob = np.where(lab, 0.25 + 0.5 * (np.arange(len(frame)) % 3 == 0), np.nan)  # unequal label probabilities
    prob[np.flatnonzero(lab)[::5]] = np.nan  # missing on some labelled rows: treated as 1
    frame["label_probability"] = prob
    return frame


def _same(a: EvalData, b: EvalData) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), name
    assert list(a.prompt_ids) == list(b.prompt_ids)
    assert (a.policies, a.covariate_names, a.n_folds) == (b.policies, b.covariate_names, b.n_folds)


@pytest.mark.parametrize("covariates,policies", [
    ((), None),
    (("response_length",), None),
    (("response_length", "len2"), None),
    (("len2",), ["clone", "base"]),  # a policy filter: the build works on a filtered copy
])
def test_consuming_build_gives_the_same_arrays_and_empties_the_frame(covariates, policies):
    frame = _frame()
    plain = EvalData.from_frame(frame, covariates=list(covariates), policies=policies)
    assert len(frame.columns) > 0  # the plain build leaves its input alone
    taken = frame.copy()
    consumed = EvalData.from_frame(taken, covariates=list(covariates), policies=policies, consume=True)
    _same(plain, consumed)
    assert list(taken.columns) == []


def test_label_weights_are_inverse_probabilities_on_labelled_rows_only():
    frame = _frame(5)
    data = EvalData.from_frame(frame.copy(), consume=True)
    label = frame["oracle_label"].to_numpy()
    prob = frame["label_probability"].to_numpy()
    # reference: the formula written out row by row
    expected = np.array([0.0 if np.isnan(y) else 1.0 / (1.0 if np.isnan(p) else p) for y, p in zip(label, prob)])
    assert np.array_equal(data.label_weight, expected)
    assert (data.label_weight[np.isnan(label)] == 0).all()


def test_prompt_ids_are_the_sorted_distinct_ids_with_their_folds():
    frame = _frame()
    data = EvalData.from_frame(frame.copy(), consume=True)
    ids = sorted(set(frame["prompt_id"]))
    assert data.prompt_ids.dtype.kind == "U"  # short ids: fixed-width text, not Python objects
    assert list(data.prompt_ids) == ids and data.prompt_ids.astype(str).tolist() == ids
    assert np.array_equal(data.fold, fold_of(np.array(ids, dtype=object), 5)[data.prompt])


@pytest.mark.parametrize("ids,kind", [
    (["p1", "p22", "p333"], "U"),
    (["short", "an-id-longer-than-twelve"], "O"),  # long ids stay objects (width x 4 bytes each)
    (["a\x00", "b"], "O"),  # fixed-width text would drop the trailing NUL
    (["", "x"], "U"),
])
def test_compact_ids_keep_every_string(ids, kind):
    from cje_engine.data.frame import _compact_ids

    out = _compact_ids(pd.Index(ids, dtype="str"))
    assert out.dtype.kind == kind and [str(v) for v in out] == ids
    assert np.array_equal(fold_of(out, 5), fold_of(np.array(ids, dtype=object), 5))


def test_combine_in_place_equals_the_formula_across_chunks(monkeypatch):
    monkeypatch.setattr(identity, "_CHUNK", 7)  # several chunks and a ragged last one
    rng = np.random.default_rng(0)
    a = rng.integers(0, 13, 100)
    b = rng.integers(0, 29, 100)
    a0, b0 = a.copy(), b.copy()
    out, size = identity._combine(a, 13, b, 29)
    assert np.array_equal(out, a0 * 29 + b0) and size == 13 * 29
    assert np.array_equal(a, a0) and np.array_equal(b, b0)  # nothing changed without into_b
    out, _ = identity._combine(a, 13, b, 29, into_b=True)
    assert out is b and np.array_equal(out, a0 * 29 + b0)
    assert np.array_equal(a, a0)
    ro = b0.copy()
    ro.flags.writeable = False  # a read-only array is never written: a fresh one is returned
    out, _ = identity._combine(a, 13, ro, 29, into_b=True)
    assert out is not ro and np.array_equal(out, a0 * 29 + b0)


def test_repeated_marks_rows_whose_key_repeats():
    key = np.array([4, 1, 4, 0, 9, 1, 7])
    assert identity.repeated_values(key, 10).tolist() == [True, True, True, False, False, True, False]


def test_cluster_cov_is_the_centred_cross_product_and_leaves_its_input_alone():
    rng = np.random.default_rng(1)
    psi = rng.normal(size=(500, 4))
    psi[::17, 2] = np.nan
    before = psi.copy()
    c = np.nan_to_num(psi)
    c = c - c.mean(axis=0)
    expected = (c.T @ c) * 500 / 499
    assert np.array_equal(cluster_cov(psi), expected)
    assert np.array_equal(psi, before, equal_nan=True)


def test_consuming_build_with_a_canonical_column_as_covariate():
    """A covariate may be any column, even the judge score: it is copied before it is dropped."""
    frame = _frame()
    plain = EvalData.from_frame(frame, covariates=["judge_score", "len2"])
    taken = frame.copy()
    _same(plain, EvalData.from_frame(taken, covariates=["judge_score", "len2"], consume=True))
    assert list(taken.columns) == []


def test_column_var_is_the_centred_sum_of_squares_and_leaves_its_input_alone():
    from cje_engine.pipeline.calibration import _column_var

    rng = np.random.default_rng(2)
    psi = rng.normal(size=(300, 3))
    psi[::11, 1] = np.nan
    before = psi.copy()
    c = np.nan_to_num(psi)
    c = c - c.mean(axis=0)
    assert np.array_equal(_column_var(psi), 300 / 299 * np.sum(c * c, axis=0))
    assert np.array_equal(psi, before, equal_nan=True)
