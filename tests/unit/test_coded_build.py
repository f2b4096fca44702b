"""The 10M-row fast paths of issue 15 (helper `fast10m`) against the plain computations they replace.

Each fast path must give the very same numbers, bit for bit (integers and floats compared exactly):

* `load_coded` + ``EvalData.from_frame(..., codes=...)``: the prompt and policy codes of the load's
  identity checks reused by the build, against the build that factorises the frame itself;
* `fold_of` (hashed a chunk at a time from a copied blake2b state) against blake2b written out;
* `influence` (histograms laid out as the results, the row pass in chunks) against the per-policy
  loops it replaced, written out below;
* the support shares from per-(policy, cell) counts against the per-row search.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pytest

from cje_engine.data.frame import EvalData, FrameCodes, fold_of
from cje_engine.data.io import load_coded, load_frame
from cje_engine.direct.estimators import (_level_sets, calibration_term, cross_fit_models, influence, make_design,
                                          policy_stats)
from cje_engine.errors import CJEInputError
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline.policies import support_checks
from cje_engine.simulate import simulate

FIELDS = ("prompt", "policy", "score", "label", "label_weight", "X", "fold")


def _same(a: EvalData, b: EvalData) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), name
    assert a.prompt_ids.dtype == b.prompt_ids.dtype and list(a.prompt_ids) == list(b.prompt_ids)
    assert (a.policies, a.covariate_names, a.n_folds) == (b.policies, b.covariate_names, b.n_folds)


def _sim(seed: int = 0, n: int = 300) -> pd.DataFrame:
    return simulate(n_prompts=n, oracle_fraction=0.2, seed=seed).frame


def _odd_ids(frame: pd.DataFrame) -> pd.DataFrame:
    """Prompt ids that sort differently as text and as numbers, non-ASCII ones, and shuffled rows."""
    out = frame.sample(frac=1.0, random_state=1).reset_index(drop=True)
    codes, uniq = pd.factorize(out["prompt_id"])
    names = np.array([f"{['é', 'Z', 'a', '10', '9', '日本'][i % 6]}-{i}" for i in range(len(uniq))], dtype=object)
    out["prompt_id"] = names[codes]
    return out


CASES = {
    "simulated": lambda tmp: _sim(),
    "odd ids, shuffled": lambda tmp: _odd_ids(_sim(1)),
    "numeric ids": lambda tmp: _sim(2).assign(prompt_id=lambda f: pd.factorize(f["prompt_id"])[0] * 7 + 3),
    "two inputs": lambda tmp: [_sim(3).iloc[:500], _sim(3).iloc[500:]],
    "parquet file": lambda tmp: _parquet(tmp, _sim(4)),
    "ids with ':' (not canonical)": lambda tmp: _sim(5).assign(prompt_id=lambda f: "x:" + f["prompt_id"].astype(str)),
}


def _parquet(tmp, frame):
    path = tmp / "logs.parquet"
    frame.to_parquet(path, index=False)
    return path


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("policies", [None, ["verbose", "base"]])
def test_build_from_the_loads_codes_gives_the_same_arrays(case, policies, tmp_path):
    source = CASES[case](tmp_path)
    kw = dict(covariates=["response_length"], policies=policies)
    frame, codes = load_coded(source, **kw)
    plain_frame = load_frame(source, **kw)
    pd.testing.assert_frame_equal(frame, plain_frame)  # the frame is load_frame's
    assert isinstance(codes, FrameCodes) and codes.n_rows == len(frame)
    # the codes are what factorising the frame's columns gives (first appearance order)
    for col, c, u in (("prompt_id", codes.prompt, codes.prompt_uniques), ("policy", codes.policy, codes.policy_uniques)):
        ref_c, ref_u = pd.factorize(plain_frame[col])
        assert np.array_equal(c, ref_c) and list(u) == list(ref_u)
    plain = EvalData.from_frame(plain_frame, covariates=["response_length"], policies=policies)
    coded = EvalData.from_frame(frame, covariates=["response_length"], policies=policies, consume=True, codes=codes)
    _same(plain, coded)
    assert list(frame.columns) == []


def test_build_with_codes_and_a_policy_filter_of_its_own():
    """The build's own policy filter drops rows: it factorises the kept rows (the codes are for all)."""
    frame, codes = load_coded(_sim(6), covariates=["response_length"])
    plain = EvalData.from_frame(frame.copy(), covariates=["response_length"], policies=["clone"])
    _same(plain, EvalData.from_frame(frame, covariates=["response_length"], policies=["clone"], codes=codes))


def test_codes_of_another_frame_are_refused():
    frame, codes = load_coded(_sim(7))
    with pytest.raises(ValueError, match="codes are for"):
        EvalData.from_frame(frame.iloc[:10], codes=codes)


def test_codes_subset_renumbers_in_order_of_first_appearance():
    uniq = pd.Index(["b", "a", "c"])
    codes = FrameCodes(6, np.array([0, 1, 2, 1, 0, 2], dtype=np.int32), uniq, np.zeros(6, np.int8), pd.Index(["p"]))
    sub = codes.subset(np.array([False, True, True, False, True, False]))
    assert sub.n_rows == 3 and sub.prompt.dtype == np.int32
    assert sub.prompt.tolist() == [0, 1, 2] and list(sub.prompt_uniques) == ["a", "c", "b"]


def test_load_errors_still_name_the_row():
    frame = _sim(8)
    frame.loc[17, "prompt_id"] = None
    with pytest.raises(CJEInputError) as exc:
        load_coded(frame)
    assert exc.value.row == 17 and exc.value.column == "prompt_id"


def _fold_reference(ids, n_folds):
    """blake2b of each id's UTF-8 text, the first 8 digest bytes as a big-endian integer, mod n_folds."""
    return np.array([int.from_bytes(hashlib.blake2b(str(p).encode("utf-8"), digest_size=8).digest(), "big") % n_folds
                     for p in ids], dtype=np.int64)


def test_fold_of_is_blake2b_of_the_id_across_chunks():
    ids = [f"prompt-{i}" for i in range((1 << 16) + 123)]  # crosses a chunk boundary
    ids[5:10] = ["é", "日本語", "", "a b", "x" * 300]
    ref = _fold_reference(ids, 5)
    assert np.array_equal(fold_of(ids, 5), ref)
    assert np.array_equal(fold_of(np.array(ids, dtype=object), 5), ref)
    assert np.array_equal(fold_of(np.array(ids), 5), ref)  # fixed-width text
    assert np.array_equal(fold_of([3, 17], 7), _fold_reference(["3", "17"], 7))


def _design(seed: int, mode: str = "two_stage", sources=None, unlabelled: str | None = None):
    frame = _sim(seed, 400)
    if unlabelled is not None:  # a policy without labels: its augmented columns are NaN
        frame.loc[frame["policy"] == unlabelled, ["oracle_label", "label_probability"]] = np.nan
    d = EvalData.from_frame(load_frame(frame, covariates=["response_length"]), covariates=["response_length"])
    design = make_design(d, mode, sources)
    f, full, _ = cross_fit_models(design)
    return design, f, full


def _calibration_term_reference(design, full, share, f_cal):
    """`calibration_term` as it was written before (a zeros array filled a column at a time)."""
    from cje_engine.direct.estimators import corrected_residuals

    d, cr = design.data, design.cal_rows
    block_of_x, n_blocks = _level_sets(full)
    ux = full.x_
    z_cal = full.index(d.score[cr], d.X[cr])
    b_cal = block_of_x[np.clip(np.searchsorted(ux, z_cal), 0, ux.size - 1)]
    m = cr.size
    q = np.bincount(b_cal, minlength=n_blocks) / m
    resid = d.label[cr] - np.interp(z_cal, ux, full.y_)
    resid = corrected_residuals(resid, b_cal, n_blocks, d.label[cr] - f_cal)
    cells = design.cells.cells
    z_all = full.index(cells.score, cells.X)
    j = np.clip(np.searchsorted(ux, z_all, side="right") - 1, 0, ux.size - 1)
    j1 = np.minimum(j + 1, ux.size - 1)
    gap = ux[j1] - ux[j]
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(gap > 0, np.clip((z_all - ux[j]) / gap, 0.0, 1.0), 0.0)
    out = np.zeros((d.n_prompts, share.shape[0]))
    for k in range(share.shape[0]):
        p_k = (np.bincount(block_of_x[j], weights=share[k] * (1 - t), minlength=n_blocks)
               + np.bincount(block_of_x[j1], weights=share[k] * t, minlength=n_blocks))
        with np.errstate(invalid="ignore", divide="ignore"):
            rho = np.where(q > 0, p_k / q, 0.0)
        out[:, k] = np.bincount(d.prompt[cr], weights=rho[b_cal] * resid / m, minlength=d.n_prompts)
    return out


def _influence_reference(design, f, full):
    """`influence` as it was written before the issue-15 rewrite: per-policy loops into zeros arrays."""
    d, K, n_p = design.data, design.n_policies, design.data.n_prompts
    stats = policy_stats(design, f)
    plug, aug = stats[:K], stats[K:]
    n_k = np.bincount(d.policy, minlength=K).astype(float)
    total, cal = np.zeros((n_p, 2 * K)), np.zeros((n_p, 2 * K))
    total[:, :K] = np.bincount(d.prompt * K + d.policy, weights=(f - plug[d.policy]) / n_k[d.policy],
                               minlength=n_p * K).reshape(n_p, K)
    total[:, K:] = total[:, :K]
    lab = design.lab_rows
    lw, r = d.label_weight[lab], d.label[lab] - f[lab]
    den = np.bincount(d.policy[lab], weights=lw, minlength=K)
    for k in range(K):
        if den[k] <= 0:
            total[:, K + k] = cal[:, K + k] = np.nan
            continue
        sel = d.policy[lab] == k
        col = np.bincount(d.prompt[lab[sel]], weights=lw[sel] * (r[sel] - (aug[k] - plug[k])) / den[k], minlength=n_p)
        total[:, K + k] += col
        cal[:, K + k] = col
    f_cal = f[design.cal_rows]
    term = _calibration_term_reference(design, full, design.cells.counts / n_k[:, None], f_cal)
    total[:, :K] += term
    cal[:, :K] = term
    G = design.cells.cells.size
    lab_counts = np.bincount(d.policy[lab] * G + design.cells.row_cell[lab], weights=lw, minlength=K * G).reshape(K, G)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(den[:, None] > 0, lab_counts / den[:, None], 0.0)
    audit = cal[:, K:] - _calibration_term_reference(design, full, share, f_cal)
    audit[:, den <= 0] = np.nan
    return {"total": total, "calibration": cal, "audit": audit}


@pytest.mark.parametrize("seed,mode,sources,unlabelled", [
    (0, "two_stage", None, None), (1, "monotone", None, None), (2, "monotone", ("base",), None),
    (3, "two_stage", ("base", "clone"), None), (4, "two_stage", None, "verbose")])
def test_influence_equals_the_per_policy_loops_exactly(seed, mode, sources, unlabelled, monkeypatch):
    import cje_engine.direct.estimators as est

    monkeypatch.setattr(est, "_ROW_CHUNK", 333)  # several chunks and a ragged last one
    design, f, full = _design(seed, mode, sources, unlabelled)
    if unlabelled is not None:
        assert np.isnan(influence(design, f, full)["total"][:, design.n_policies:]).any()
    got = influence(design, f, full)
    ref = _influence_reference(design, f, full)
    for key in ("total", "calibration", "audit"):
        assert got[key].shape == ref[key].shape and got[key].flags.c_contiguous, key
        assert np.array_equal(got[key], ref[key], equal_nan=True), key
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in
               zip(influence(design, f, full, policy_stats(design, f)).values(), got.values()))
    share = design.cells.counts / design.cells.counts.sum(1)[:, None]
    out = np.full((design.data.n_prompts, 7), -1.0)
    calibration_term(design, full, share, f[design.cal_rows], out=out[:, 1:1 + share.shape[0]])
    assert np.array_equal(out[:, 1:1 + share.shape[0]], _calibration_term_reference(design, full, share, f[design.cal_rows]))
    assert (out[:, 0] == -1).all() and (out[:, 1 + share.shape[0]:] == -1).all()  # nothing else written


@pytest.mark.parametrize("seed,mode", [(0, "two_stage"), (1, "monotone")])
def test_support_shares_from_cell_counts_equal_the_per_row_search(seed, mode):
    design, _, _ = _design(seed, mode, ("base",))
    d = design.data
    for bandwidth, min_labels in ((0.05, 3), (0.01, 20)):
        opts = EvaluationOptions.build(support_bandwidth=bandwidth, support_min_labels=min_labels)
        by_cell = support_checks(design, opts)
        by_row = support_checks(design, opts, [d.score[d.policy == k] for k in range(len(d.policies))])
        cov = ("share_covariate_outside", "covariate_extrapolation")
        assert [{k: v for k, v in e.items() if k not in cov} for e in by_cell] == by_row  # whole numbers: exact
        if mode == "two_stage":  # the covariate share from cell counts is the per-row share
            Xc = d.X[design.cal_rows]
            for k, e in enumerate(by_cell):
                x = d.X[d.policy == k]
                off = np.any((x < Xc.min(axis=0)) | (x > Xc.max(axis=0)), axis=1)
                assert e["share_covariate_outside"] == pytest.approx(off.mean(), abs=1e-12)


@pytest.mark.parametrize("values", [
    pd.Series(["b", "a", "b", "é", "a", "c"] * 3, dtype="str"),  # pyarrow-backed: Arrow's dictionary encoding
    pd.Series(pd.array(["b", "a", "b"] * 400, dtype="str")).iloc[::3],  # a sliced column
    pd.Series(["b", None, "a", "b"], dtype="str"),  # missing values: pandas.factorize
    pd.Series(["x", "y", "x"], dtype=object),  # not Arrow: pandas.factorize
])
def test_factorize_text_is_pandas_factorize(values):
    from cje_engine.data.identity import _factorize_text

    codes, uniques = _factorize_text(values)
    ref_codes, ref_uniques = pd.factorize(values)
    assert np.array_equal(codes, ref_codes) and uniques.equals(ref_uniques) and uniques.dtype == ref_uniques.dtype
