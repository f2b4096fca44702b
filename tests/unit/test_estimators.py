"""Direct estimators and inference against slow, obvious reference computations."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from sklearn.isotonic import IsotonicRegression

from cje_engine import bootstrap_chunk, evaluate, finalize, prepare
from cje_engine.data.frame import EvalData
from cje_engine.direct.estimators import bootstrap_weights, cross_fit, influence, make_design, policy_stats


def make_frame(seed: int, n_prompts: int = 120, label_frac: float = 0.4) -> pd.DataFrame:
    """Small three-policy frame with shared prompts, discrete judge scores and some labels."""
    rng = np.random.default_rng(seed)
    u = rng.normal(0, 1, n_prompts)
    rows = []
    for k, (name, shift) in enumerate([("a", 0.0), ("b", 0.3), ("c", -0.2)]):
        q = 1 / (1 + np.exp(-(u + shift + rng.normal(0, 0.5, n_prompts))))
        s = np.clip(np.round((q + rng.normal(0, 0.15, n_prompts)) * 10) / 10, 0, 1)
        y = np.clip(q + rng.normal(0, 0.1, n_prompts), 0, 1)
        lab = rng.uniform(size=n_prompts) < label_frac
        for p in range(n_prompts):
            rows.append({"prompt_id": f"p{p}", "policy": name, "judge_score": s[p],
                         "oracle_label": y[p] if lab[p] else np.nan, "len": rng.integers(5, 500)})
    return pd.DataFrame(rows)


def reference_estimates(frame: pd.DataFrame, data: EvalData, cal_policies=None):
    """Cross-fitted plug-in and augmented values by explicit loops and sklearn isotonic fits."""
    lab = frame.oracle_label.notna().to_numpy()
    is_cal = lab & (frame.policy.isin(cal_policies).to_numpy() if cal_policies else True)
    s, y = frame.judge_score.to_numpy(), frame.oracle_label.to_numpy()
    folds = data.fold
    full = IsotonicRegression(out_of_bounds="clip").fit(s[is_cal], y[is_cal])
    by_fold = {}
    for k in range(5):
        tr = is_cal & (folds != k)
        by_fold[k] = IsotonicRegression(out_of_bounds="clip").fit(s[tr], y[tr])
    f = np.empty(len(frame))
    for i in range(len(frame)):
        model = by_fold[folds[i]] if is_cal[i] else full
        f[i] = model.predict([s[i]])[0]
    out = {}
    for name in sorted(frame.policy.unique()):
        idx = [i for i in range(len(frame)) if frame.policy.iat[i] == name]
        plug = sum(f[i] for i in idx) / len(idx)
        labelled = [i for i in idx if lab[i]]
        resid = sum(y[i] - f[i] for i in labelled) / len(labelled) if labelled else np.nan
        out[name] = (plug, plug + resid)
    return out


@pytest.mark.parametrize("seed,cal", [(0, None), (1, None), (2, ("a",)), (3, ("a", "b"))])
def test_point_estimates_match_reference(seed, cal):
    frame = make_frame(seed)
    data = EvalData.from_frame(frame)
    design = make_design(data, "monotone", cal)
    f, _ = cross_fit(design)
    stats = policy_stats(design, f)
    ref = reference_estimates(frame, data, cal)
    K = len(data.policies)
    for k, name in enumerate(data.policies):
        assert stats[k] == pytest.approx(ref[name][0], abs=1e-12)
        assert stats[K + k] == pytest.approx(ref[name][1], abs=1e-12)


def test_folds_follow_prompt_hash_not_row_order():
    frame = make_frame(0)
    a = EvalData.from_frame(frame)
    b = EvalData.from_frame(frame.sample(frac=1.0, random_state=3))
    fa = dict(zip(a.prompt_ids[a.prompt], a.fold))
    fb = dict(zip(b.prompt_ids[b.prompt], b.fold))
    assert fa == fb
    # every prompt has a single fold across its policies
    assert all(len(set(a.fold[a.prompt == p])) == 1 for p in range(a.n_prompts))


def test_bootstrap_replicate_equals_refit_on_physically_resampled_data():
    """A weighted replicate == the reference estimator run on the resampled rows themselves."""
    frame = make_frame(4)
    data = EvalData.from_frame(frame)
    design = make_design(data, "monotone", None)
    from cje_engine.direct.estimators import replicate

    w = bootstrap_weights(seed=11, b=3, n_prompts=data.n_prompts)
    stats = replicate(design, w)
    # Physically duplicate each prompt's rows w_p times (keeping its fold), then fit by loops.
    parts = []
    for p in range(data.n_prompts):
        for c in range(int(w[p])):
            sub = frame[frame.prompt_id == data.prompt_ids[p]]
            parts.append(sub)
    boot = pd.concat(parts, ignore_index=True)
    folds = np.array([data.fold[data.prompt == np.searchsorted(data.prompt_ids, pid)][0] for pid in boot.prompt_id])
    lab = boot.oracle_label.notna().to_numpy()
    s, y = boot.judge_score.to_numpy(), boot.oracle_label.to_numpy()
    full = IsotonicRegression(out_of_bounds="clip").fit(s[lab], y[lab])
    f = full.predict(s)
    for k in range(5):
        tr, te = lab & (folds != k), lab & (folds == k)
        if te.any():
            f[te] = IsotonicRegression(out_of_bounds="clip").fit(s[tr], y[tr]).predict(s[te])
    K = len(data.policies)
    for k, name in enumerate(data.policies):
        sel = (boot.policy == name).to_numpy()
        assert stats[k] == pytest.approx(f[sel].mean(), abs=1e-12)
        assert stats[K + k] == pytest.approx(f[sel].mean() + (y[sel & lab] - f[sel & lab]).mean(), abs=1e-12)


def test_bootstrap_weights_depend_only_on_seed_and_index():
    a = bootstrap_weights(5, 17, 50)
    b = bootstrap_weights(5, 17, 50)
    c = bootstrap_weights(5, 18, 50)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.sum() == 50


def test_chunking_and_reruns_are_bit_identical():
    frame = make_frame(5)
    one = evaluate(frame, n_bootstrap=120, seed=7).to_dict()
    prep = prepare(frame, n_bootstrap=120, seed=7)
    chunked = finalize(prep, [bootstrap_chunk(prep, 0, 50), bootstrap_chunk(prep, 50, 120)]).to_dict()
    assert json.dumps(one, sort_keys=True) == json.dumps(chunked, sort_keys=True)
    other = evaluate(frame, n_bootstrap=120, seed=8).to_dict()
    assert other["policies"]["a"]["ci"] != one["policies"]["a"]["ci"]


def test_finalize_rejects_missing_replicates():
    frame = make_frame(5)
    prep = prepare(frame, n_bootstrap=100, seed=7)
    with pytest.raises(ValueError, match="expected 100"):
        finalize(prep, [bootstrap_chunk(prep, 0, 60)])


def slow_cluster_variance(contrib_by_row, prompt_of_row, n_prompts):
    sums = [0.0] * n_prompts
    for c, p in zip(contrib_by_row, prompt_of_row):
        sums[p] += c
    mean = sum(sums) / n_prompts
    return sum((x - mean) ** 2 for x in sums) * n_prompts / (n_prompts - 1)


def test_augmented_influence_variance_matches_slow_formula():
    frame = make_frame(6)
    data = EvalData.from_frame(frame)
    design = make_design(data, "monotone", None)
    f, full = cross_fit(design)
    stats = policy_stats(design, f)
    inf = influence(design, f, full)["total"]
    K = len(data.policies)
    for k in range(K):
        rows = np.flatnonzero(data.policy == k)
        labs = [i for i in rows if data.labelled[i]]
        n_k, m_k = len(rows), len(labs)
        rbar = np.mean([data.label[i] - f[i] for i in labs])
        contrib, prompts = [], []
        for i in rows:
            contrib.append((f[i] - stats[k]) / n_k)
            prompts.append(data.prompt[i])
        for i in labs:
            contrib.append((data.label[i] - f[i] - rbar) / m_k)
            prompts.append(data.prompt[i])
        slow = slow_cluster_variance(contrib, prompts, data.n_prompts)
        c = inf[:, K + k] - inf[:, K + k].mean()
        fast = (c @ c) * data.n_prompts / (data.n_prompts - 1)
        assert fast == pytest.approx(slow, rel=1e-10)


def test_result_is_plain_json_with_contract_fields():
    frame = make_frame(7)
    d = evaluate(frame, n_bootstrap=60, seed=0).to_dict()
    json.dumps(d, allow_nan=False)
    assert d["schema_version"] == 1
    for name, p in d["policies"].items():
        for key in ("estimate", "se", "ci", "level_claim", "basis", "audit"):
            assert key in p, key
        assert p["level_claim"] in ("ok", "refused")
        assert p["audit"]["verdict"] in ("pass", "fail", "inconclusive", "not_run")
        lo, hi = p["ci"]
        assert 0.0 <= lo <= p["estimate"] <= hi <= 1.0 or p["level_claim"] == "refused"
    for c in d["comparisons"]:
        assert {"a", "b", "diff", "ci", "p_value", "p_adjusted", "significant"} <= set(c)
    assert len(d["comparisons"]) == 3


def test_analytic_and_bootstrap_routes_agree_on_arena(arena_dir):
    """The two inference routes must not silently disagree (the reference's differ 3.4x)."""
    d = evaluate(arena_dir, n_bootstrap=400, seed=1, calibration_policies=["base"]).to_dict()
    for name, p in d["policies"].items():
        ratio = p["se_bootstrap"] / p["se_analytic"]
        # 400 replicates give an SE of the bootstrap SE of about 1/sqrt(2*399) = 3.5%; the
        # analytic route is first-order: allow 25% (the documented warning threshold).
        assert 0.8 < ratio < 1.25, (name, ratio)
    for c in d["comparisons"]:
        assert 0.8 < c["se"] / c["se_analytic"] < 1.25, c
    assert not d["warnings"]


def test_label_scale_equivariance():
    """Labels on 0-100 give 100x the estimates, SEs and margins of the same labels on 0-1."""
    frame = make_frame(8)
    a = evaluate(frame, inference="analytic").to_dict()
    f100 = frame.assign(oracle_label=frame.oracle_label * 100)
    b = evaluate(f100, inference="analytic", label_scale="0-100").to_dict()
    for name in a["policies"]:
        pa_, pb = a["policies"][name], b["policies"][name]
        assert pb["estimate"] == pytest.approx(100 * pa_["estimate"], rel=1e-9)
        assert pb["se"] == pytest.approx(100 * pa_["se"], rel=1e-9)
        assert pb["audit"]["verdict"] == pa_["audit"]["verdict"]
        assert pb["audit"]["margin"] == pytest.approx(100 * pa_["audit"]["margin"])


def test_oracle_only_baseline_matches_slow_computation():
    frame = make_frame(9)
    d = evaluate(frame, inference="analytic").to_dict()
    for name, p in d["policies"].items():
        y = frame[(frame.policy == name) & frame.oracle_label.notna()].oracle_label.to_numpy()
        n = y.size
        assert p["oracle_only"]["estimate"] == pytest.approx(y.mean())
        # one label per prompt here, so the clustered SE is the plain SE of the mean
        assert p["oracle_only"]["se"] == pytest.approx(y.std(ddof=1) / np.sqrt(n), rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["monotone", "two_stage"])
def test_cell_replicates_equal_the_row_level_refit(seed, mode):
    """Replicates work on per-(fold, cell) sums and a (policy, cell) histogram; they must equal
    the row-level refit followed by `policy_stats` (floating-point noise only)."""
    from cje_engine.direct.estimators import replicate

    frame = make_frame(seed)
    data = EvalData.from_frame(frame, covariates=["len"])
    for cal in (None, ("a",)):
        design = make_design(data, mode, cal)
        w = bootstrap_weights(seed, 5, data.n_prompts)
        row_w = w[data.prompt]
        f_generic, _ = cross_fit(design, row_w)
        np.testing.assert_allclose(replicate(design, w), policy_stats(design, f_generic, row_w),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["monotone", "two_stage"])
def test_bootstrap_view_gives_the_in_process_replicates_under_any_chunking(mode):
    """What Ray workers receive (`BootstrapView`, pickled) gives the replicates of
    `bootstrap_chunk` on the whole prepared state bit for bit, however B is split into chunks,
    and it is a fraction of the prepared state's size (8 bytes a row plus the labelled rows)."""
    import pickle

    from cje_engine.direct.estimators import bootstrap_replicates, bootstrap_view

    frame = make_frame(4, n_prompts=600, label_frac=0.1)
    prep = prepare(frame, covariates=["len"], calibration_mode=mode, n_bootstrap=60, seed=11)
    B = prep.options.n_bootstrap
    in_process = bootstrap_chunk(prep, 0, B)
    view = pickle.loads(pickle.dumps(bootstrap_view(prep.design, seed=prep.options.seed)))
    rng = np.random.default_rng(0)
    for _ in range(3):
        cuts = np.unique(np.concatenate([[0, B], rng.integers(1, B, rng.integers(1, 8))]))
        got = np.vstack([bootstrap_replicates(view, a, b) for a, b in zip(cuts[:-1], cuts[1:])])
        assert np.array_equal(got, in_process, equal_nan=True)
    assert np.array_equal(bootstrap_replicates(view, 17, 18)[0], in_process[17], equal_nan=True)
    assert view.row_prompt.dtype == np.int32 and view.row_key.dtype == np.int32  # 8 bytes a row
    # the rest is per labelled row (~150 B) and per cell; the prepared state is ~100 B a row
    assert view.nbytes < 0.35 * len(pickle.dumps(prep))


def test_design_pickles_without_its_caches():
    """The design's private caches (calibration plan, bootstrap view) are not shipped with it."""
    import pickle

    from cje_engine.direct.estimators import bootstrap_view, make_design, replicate

    data = EvalData.from_frame(make_frame(1))
    design = make_design(data, "monotone", None)
    w = bootstrap_weights(1, 3, data.n_prompts)
    before = replicate(design, w)
    bootstrap_view(design)
    copy = pickle.loads(pickle.dumps(design))
    assert not [k for k in vars(copy) if k.startswith("_")]
    assert np.array_equal(replicate(copy, w), before)


def test_replicates_do_not_depend_on_the_blas_thread_count():
    """Replicates run on Ray workers and in drivers with different BLAS thread counts, and a
    threaded BLAS product's rounding depends on how many threads split it (observed at ~30,000
    cells with OpenBLAS); the replicate path uses no BLAS product over the cells, so one thread
    and several give the same bits. ~40,000 (score, length) cells here."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from cje_engine.direct.estimators import bootstrap_replicates, bootstrap_view, make_design

    if max((i.get("num_threads", 1) for i in threadpool_info() if i.get("user_api") == "blas"), default=1) < 2:
        pytest.skip("a single BLAS thread: nothing to compare")
    rng = np.random.default_rng(0)
    n = 20_000
    rows = []
    for k, shift in enumerate([0.0, 0.3, -0.2]):
        q = 1 / (1 + np.exp(-(rng.normal(0, 1, n) + shift)))
        s = np.clip(np.round((q + rng.normal(0, 0.15, n)) * 20) / 20, 0, 1)
        y = np.where(rng.uniform(size=n) < 0.4, np.clip(q + rng.normal(0, 0.1, n), 0, 1), np.nan)
        rows.append(pd.DataFrame({"prompt_id": [f"p{i}" for i in range(n)], "policy": f"pol{k}", "judge_score": s,
                                  "oracle_label": y, "len": rng.integers(5, 4000, n).astype(float)}))
    data = EvalData.from_frame(pd.concat(rows, ignore_index=True), covariates=["len"])
    view = bootstrap_view(make_design(data, "two_stage", None), seed=2)
    assert view.calibration.cal_cells.size > 15_000
    threaded = bootstrap_replicates(view, 0, 2)
    with threadpool_limits(limits=1, user_api="blas"):
        single = bootstrap_replicates(view, 0, 2)
    assert np.array_equal(threaded, single, equal_nan=True)
