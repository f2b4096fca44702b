"""The sharded row pass (`cje_engine.pipeline.sharded`) gives the single-process numbers.

Estimates, SEs and intervals agree to 1e-12 (relative) with `cje_engine.pipeline.direct` under any number
of shards; bootstrap replicates are bit-identical under any sharding and any order of arrival.
"""
from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.direct.verified import power_tuned_lambda
from cje_engine.errors import CJEInputError
from cje_engine.inference.gram import Basis, BasisSums, GramTerms, Moments, SummedBasis, TermsNotKept, third_moments
from cje_engine.inference.intervals import acceleration
from cje_engine.inference.variance import cluster_cov
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline import direct, sharded
from cje_engine.simulate import simulate

TOL = 1e-12


@pytest.fixture(scope="module")
def table() -> pa.Table:
    return pa.Table.from_pandas(simulate(1500, seed=1, oracle_fraction=0.05).frame, preserve_index=False)


def _numbers(x, path=""):
    """Every number of a result dict with its path (strings kept for exact comparison)."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")
    else:
        yield path, x


def _scale(numbers: dict, key: str) -> float:
    """The magnitude a difference of two numbers was computed from: ``variance_components.sigma2_eval`` is
    ``(Var_total - Var_cal) * n`` (`policies.variance_components`), which cancels where the calibration part
    dominates (verified levels): its rounding is relative to ``Var_total * n``, ``sigma2_eval + sigma2_cal * n / m``
    (the Gram form and the per-prompt terms sum in different orders). 0 for any other number."""
    if not key.endswith(".variance_components.sigma2_eval"):
        return 0.0
    base = key.removesuffix("sigma2_eval")
    m = numbers.get(base + "m_labels") or 1
    return abs(numbers[key]) + abs(numbers[base + "sigma2_cal"] or 0.0) * numbers[base + "n_prompts"] / m


def assert_same_result(a: dict, b: dict, influence: str = "per_prompt") -> None:
    """``b`` (sharded) has ``a``'s (single-process) numbers to `TOL`, and says it took the sharded path."""
    b = {**b, "inference": dict(b["inference"])}
    row_pass = b["inference"].pop("row_pass")
    assert row_pass["path"] == "sharded" and row_pass["influence"] == influence
    na, nb = dict(_numbers(a)), dict(_numbers(b))
    assert na.keys() == nb.keys()
    for k, x in na.items():
        y = nb[k]
        if isinstance(x, float) and isinstance(y, float):
            if np.isnan(x):
                assert np.isnan(y), k
            else:
                assert abs(x - y) <= TOL * max(abs(x), abs(y), _scale(na, k), 1e-300) or abs(x - y) < 1e-15, (k, x, y)
        else:
            assert x == y, (k, x, y)


@pytest.mark.parametrize("n_shards", [1, 3, 17])
@pytest.mark.parametrize("kw", [dict(inference="analytic"),
                                dict(inference="analytic", covariates=("response_length",),
                                     calibration_mode="two_stage")], ids=["monotone", "two_stage"])
def test_shard_counts_give_the_single_process_numbers(table, n_shards, kw):
    opts = EvaluationOptions.of(None, seed=3, **kw)
    single = direct.evaluate(table, opts).to_dict()
    sp = sharded.prepare_sharded(sharded.split_by_shard(table, n_shards), opts)
    assert len(sp.shards) == n_shards
    assert_same_result(single, sp.finalize([]).to_dict())
    # the Gram form of the evaluation terms is the per-prompt terms' (any contrast's variance is a merge)
    K = sp.prep.design.n_policies
    e = sp.prep.infl["total"][:, :K] - sp.prep.infl["calibration"][:, :K]
    np.testing.assert_allclose(sp.gram["gram"], e.T @ e, rtol=1e-10, atol=1e-18)
    assert sp.gram["count"] == sp.n_prompts


def test_bootstrap_replicates_are_bit_identical_in_any_order_of_arrival(table):
    opts = EvaluationOptions.of(None, seed=5, inference="bootstrap", n_bootstrap=60)
    prep = direct.prepare(table, opts)
    expected = direct.bootstrap_chunk(prep, 0, 60)

    def shuffled(fn, items):
        out = [(i, fn(*item)) for i, item in enumerate(items)]
        random.Random(7).shuffle(out)
        return out

    for n in (3, 17):
        sp = sharded.prepare_sharded(sharded.split_by_shard(table, n), opts, mapper=shuffled)
        got = np.vstack([sp.replicates(0, 25), sp.replicates(25, 60)])  # any chunking too
        assert np.array_equal(got, expected, equal_nan=True)
        assert_same_result(direct.finalize(prep, [expected]).to_dict(), sp.finalize([got]).to_dict())


def test_a_shard_without_labels(table):
    parts = sharded.split_by_shard(table, 17)
    lab = np.asarray(table["oracle_label"].is_valid())
    # drop the labels of one shard's rows: that shard holds none; the single path sees the same rows
    drop_prompts = set(parts[4]["prompt_id"].to_pylist())
    keep = np.array([p not in drop_prompts for p in table["prompt_id"].to_pylist()]) | ~lab
    label = np.where(keep, table["oracle_label"].to_numpy(zero_copy_only=False), np.nan)
    t2 = table.set_column(table.column_names.index("oracle_label"), "oracle_label", pa.array(label))
    parts2 = sharded.split_by_shard(t2, 17)
    assert parts2[4].num_rows > 0 and parts2[4]["oracle_label"].null_count + int(
        np.isnan(parts2[4]["oracle_label"].to_numpy(zero_copy_only=False)).sum()) >= parts2[4].num_rows
    opts = EvaluationOptions.of(None, seed=3, inference="analytic")
    assert_same_result(direct.evaluate(t2, opts).to_dict(),
                       sharded.prepare_sharded(parts2, opts).finalize([]).to_dict())


def test_a_prompt_spread_over_two_files_of_different_days(table):
    """The rows of one prompt come from two daily files: both readers send them to the same shard, and the
    window order (file, row) is kept, so the numbers are the single-process ones on the two files."""
    n = table.num_rows
    day1, day2 = table.slice(0, n // 2), table.slice(n // 2)
    # the simulator writes policy after policy: every prompt of day1 also has rows in day2
    assert set(day1["prompt_id"].to_pylist()) & set(day2["prompt_id"].to_pylist())
    n_shards = 3
    a = sharded.split_by_shard(day1, n_shards, row_offset=0)
    b = sharded.split_by_shard(day2, n_shards, row_offset=day1.num_rows)
    shards = [pa.concat_tables([b[s], a[s]]) for s in range(n_shards)]  # arrival order does not matter
    opts = EvaluationOptions.of(None, seed=3, inference="analytic")
    single = direct.evaluate(pa.concat_tables([day1, day2]), opts).to_dict()
    assert_same_result(single, sharded.prepare_sharded(shards, opts).finalize([]).to_dict())


def test_a_prompt_in_two_shards_is_refused(table):
    parts = sharded.split_by_shard(table, 3)
    wrong = [pa.concat_tables([parts[0], parts[1].slice(0, 1)]), parts[1], parts[2]]
    with pytest.raises(CJEInputError, match="is in two shards"):
        sharded.prepare_sharded(wrong, EvaluationOptions.of(None, inference="analytic"))


def test_shard_of_is_stable_and_independent_of_the_folds():
    ids = [f"p{i}" for i in range(2000)]
    s = sharded.shard_of(ids, 5)
    assert np.array_equal(s, sharded.shard_of(np.array(ids, dtype=object), 5))
    assert list(sharded.shard_of(["p0", "p1", "p2"], 7)) == list(sharded.shard_of(["p0", "p1", "p2"], 7))
    from cje_engine.data.frame import fold_of
    assert (s == fold_of(np.array(ids, dtype=object), 5)).mean() < 0.5


def test_per_prompt_terms_over_the_driver_budget_are_refused_before_pass_2(table):
    calls = []

    def counting(fn, items):
        calls.append(fn.__name__)
        return sharded.serial_map(fn, items)

    opts = EvaluationOptions.of(None, inference="analytic")
    with pytest.raises(CJEInputError, match="per-prompt influence terms of 1,500 prompts"):
        sharded.prepare_sharded(sharded.split_by_shard(table, 3), opts, mapper=counting, terms_budget=1000,
                                keep_terms=True)
    assert calls == ["reduce_shard"]  # refused after the merge, before the evaluation-terms pass


@pytest.mark.parametrize("n_shards", [1, 3, 17])
@pytest.mark.parametrize("kw", [dict(inference="analytic"),
                                dict(inference="analytic", covariates=("response_length",),
                                     calibration_mode="two_stage"),
                                dict(inference="bootstrap", n_bootstrap=60),
                                dict(inference="analytic", baseline="base")],
                         ids=["monotone", "two_stage", "bootstrap", "baseline_max_t"])
def test_the_gram_form_gives_the_single_process_numbers(table, n_shards, kw):
    """Over the driver's budget the sharded path keeps the Gram form (labelled prompts' terms plus the moments
    of the rest): the same numbers as the single path to 1e-12 relative, and the driver holds no
    per-prompt array of all prompts."""
    opts = EvaluationOptions.of(None, seed=3, **kw)
    prep = direct.prepare(table, opts)
    chunks = [direct.bootstrap_chunk(prep, 0, 60)] if kw["inference"] == "bootstrap" else []
    single = direct.finalize(prep, chunks).to_dict()
    sp = sharded.prepare_sharded(sharded.split_by_shard(table, n_shards), opts, terms_budget=1000)
    assert sp.influence == "gram"
    for name, terms in sp.prep.infl.items():
        assert isinstance(terms, GramTerms), name
        # the labelled prompts' basis rows are kept as sums only: no array of them on the driver
        assert terms.basis.n_rows == np.unique(sp.prep.design.data.prompt).size < sp.n_prompts / 2
        assert terms.basis.dim == 5 * sp.prep.design.n_policies
        with pytest.raises(TermsNotKept):
            terms.basis.rows
    assert_same_result(single, sp.finalize(chunks).to_dict(), influence="gram")


def test_gram_reductions_equal_the_per_prompt_ones():
    """Every reduction of `GramTerms` (covariance, column variance, acceleration, power-tuning weight) and
    every linear operation equals the per-prompt matrix's, NaN columns included."""
    rng = np.random.default_rng(0)
    K, D, L, U = 3, 6, 40, 500
    e = rng.standard_normal((U, K)) ** 2 - 1  # skewed: the third moments matter
    base = rng.standard_normal((L, D))
    M = rng.standard_normal((D, 2 * K))
    M[:, 2 * K - 1] = np.nan
    full = np.vstack([base @ np.nan_to_num(M), e @ np.nan_to_num(M[:K])])
    full[:, 2 * K - 1] = np.nan
    g = GramTerms(Basis(base, Moments.of(e[:200]) + Moments.of(e[200:])), M)
    assert g.shape == full.shape
    np.testing.assert_allclose(cluster_cov(g), cluster_cov(full), rtol=1e-12, atol=1e-15)
    d = g[:, [0, 1]] - g[:, [K]]
    np.testing.assert_allclose(cluster_cov(d), cluster_cov(full[:, [0, 1]] - full[:, [K]]), rtol=1e-12, atol=1e-15)
    mixed = np.where(np.array([[True, False, True]]), g[:, :K], g[:, K:])
    np.testing.assert_allclose(cluster_cov(np.hstack([mixed, 0.3 * g[:, :1] + g[:, 1:2]])),
                               cluster_cov(np.hstack([np.where(np.array([[True, False, True]]), full[:, :K], full[:, K:]),
                                                      0.3 * full[:, :1] + full[:, 1:2]])), rtol=1e-12, atol=1e-15)
    for c in range(2 * K):
        assert acceleration(g[:, c]) == pytest.approx(acceleration(full[:, c]), rel=1e-12, abs=1e-15)
    own = g[:, 0] - g[:, 1]
    assert power_tuned_lambda(own, g[:, K]) == pytest.approx(
        power_tuned_lambda(full[:, 0] - full[:, 1], full[:, K]), rel=1e-12)
    assert power_tuned_lambda(own, g[:, 2 * K - 1]) == 1.0 == power_tuned_lambda(full[:, 0], full[:, 2 * K - 1])
    with pytest.raises(TermsNotKept, match="row_pass.influence = 'gram'"):
        np.asarray(g)


def test_third_moments_are_the_triple_sum():
    """`third_moments` (K matrix products) against the obvious triple loop summed in exact rational arithmetic:
    within rounding. Each entry is a sum of n products; a float sum in any order is within ~n * eps of the sum
    of the products' absolute values (the classic bound for recursive/blocked summation, each product itself
    within 2 eps), so the tolerance is 4 n eps of that sum, far below anything the Gram form reads."""
    from fractions import Fraction

    rng = np.random.default_rng(7)
    for n, K in ((0, 3), (1, 2), (37, 4), (300, 5)):
        e = rng.standard_normal((n, K)) ** 3
        got = third_moments(e)
        assert got.shape == (K, K, K)
        exact = np.zeros((K, K, K))
        bound = np.zeros((K, K, K))
        for i in range(K):
            for j in range(K):
                for k in range(K):
                    exact[i, j, k] = float(sum((Fraction(float(x)) * Fraction(float(y)) * Fraction(float(z))
                                                for x, y, z in zip(e[:, i], e[:, j], e[:, k])), Fraction(0)))
                    bound[i, j, k] = np.abs(e[:, i] * e[:, j] * e[:, k]).sum()
        assert np.all(np.abs(got - exact) <= 4 * max(n, 1) * np.finfo(float).eps * bound)
        np.testing.assert_allclose(Moments.of(e).T, got, rtol=0, atol=0)  # Moments.of uses it as it is


def test_summed_basis_reductions_equal_the_per_prompt_ones():
    """A basis kept as sums (`BasisSums`, added a block of rows at a time) gives the per-prompt matrix's
    covariance, power-tuning weight and, for a column within one policy's dimensions, acceleration; a column
    mixing two policies' dimensions asks for rows that were not kept."""
    rng = np.random.default_rng(1)
    K, L, U = 3, 50, 400
    D = 5 * K
    groups = np.arange(D).reshape(5, K).T
    e = rng.standard_normal((U, K)) ** 2 - 1
    base = rng.standard_normal((L, D)) ** 2 - 1
    sums = BasisSums(D, groups)
    for a in range(0, L, 7):
        sums.add(base[a:a + 7])
    M = np.zeros((D, 2 * K))
    for k in range(K):  # a policy's columns read its own dimensions only (as `GramBuilder`'s maps)
        M[groups[k], k] = rng.standard_normal(5)
        M[groups[k], K + k] = rng.standard_normal(5)
    full = np.vstack([base @ M, e @ M[:K]])
    g = GramTerms(SummedBasis(sums, Moments.of(e)), M)
    ref = GramTerms(Basis(base, Moments.of(e)), M)
    assert g.shape == full.shape and g.basis.n_rows == L
    np.testing.assert_allclose(cluster_cov(g), cluster_cov(full), rtol=1e-12, atol=1e-15)
    for c in range(2 * K):
        assert acceleration(g[:, c]) == pytest.approx(acceleration(full[:, c]), rel=1e-12, abs=1e-15)
        assert acceleration(g[:, c]) == pytest.approx(acceleration(ref[:, c]), rel=1e-12, abs=1e-15)
    assert power_tuned_lambda(g[:, 0], g[:, K]) == pytest.approx(power_tuned_lambda(full[:, 0], full[:, K]), rel=1e-12)
    with pytest.raises(TermsNotKept, match="within a policy"):
        acceleration(g[:, 0] - g[:, 1])
    with pytest.raises(TermsNotKept):
        g.rows
    with pytest.raises(ValueError, match="finite"):
        sums.add(np.full((1, D), np.nan))


@pytest.mark.parametrize("kw", [{}, dict(calibration_policies=("base",))], ids=["all", "calibration_policies"])
def test_the_gram_builder_writes_the_labelled_parts_bit_for_bit_a_block_at_a_time(table, monkeypatch, kw):
    """The basis rows `GramBuilder` reduces, built a shard and a block of prompts at a time, are bit for bit the
    calibration, label-residual, audit and own-label parts computed over every labelled prompt at once
    (`labelled_influence_parts`, `own_label_influence`)."""
    import dataclasses

    from cje_engine.direct.verified import own_label_influence

    seen = []

    class Recording(sharded.BasisSums):
        def add(self, rows, **kw):
            seen.append(rows.copy())
            super().add(rows, **kw)

    monkeypatch.setattr(sharded, "BasisSums", Recording)
    monkeypatch.setattr(sharded, "BASIS_BLOCK_BYTES", 8 * 15 * 17)  # blocks of 17 prompts
    opts = EvaluationOptions.of(None, seed=3, inference="analytic", **kw)
    sp = sharded.prepare_sharded(_range_split(table, 3), opts, keep_terms=False)
    got = np.vstack(seen)
    design, K = sp.prep.design, sp.prep.design.n_policies
    d = design.data
    lab_prompts = np.unique(d.prompt)
    L = lab_prompts.size
    assert got.shape == (L, 5 * K) and len(seen) > 3
    assert design.lab_rows.size == d.n_rows > design.cal_rows.size  # no copy of the labelled rows; of the calibration rows
    local_prompt = np.searchsorted(lab_prompts, d.prompt)
    local = dataclasses.replace(design, data=dataclasses.replace(
        d, prompt=local_prompt, prompt_ids=np.broadcast_to(np.array("", dtype="<U1"), (L,))))
    want = np.empty((L, 5 * K))
    sharded.labelled_influence_parts(local, sp.prep.f, sp.prep.full, sp.prep.stats, design.cells.counts.sum(1),
                                     calibration=want[:, K:2 * K], residual=want[:, 2 * K:3 * K],
                                     audit=want[:, 3 * K:4 * K])
    lab = design.lab_rows
    want[:, 4 * K:] = np.nan_to_num(own_label_influence(local_prompt[lab], d.policy[lab], d.label[lab],
                                                        d.label_weight[lab], L, K)[1])
    assert np.array_equal(got[:, K:], want[:, K:])


def test_the_labelled_basis_sums_reduced_on_the_shards_are_the_drivers_bit_for_bit(table, monkeypatch):
    """Pass 2 reduces each shard's labelled prompts to their basis sums on the shard (its `LabelledBasis`, sent
    with the task); without it the driver reduces them from the returned terms: the same sums, bit for bit, and
    the same result, whatever the order the shards' parts arrive in."""
    monkeypatch.setattr(sharded, "BASIS_BLOCK_BYTES", 8 * 15 * 17)  # blocks of 17 prompts: several a shard
    opts = EvaluationOptions.of(None, seed=3, inference="analytic", calibration_policies=("base", "clone"))
    sent = []

    def on_driver(fn, items):  # the basis not sent: each part returns its labelled terms, reduced by the driver
        if fn is sharded.shard_evaluation_terms:
            sent.extend(item[-1] for item in items)
            items = [item[:-1] + (None,) for item in items]
        return reversed(list(sharded.serial_map(fn, items)))

    shards = _range_split(table, 3)
    on_shards = sharded.prepare_sharded(shards, opts, keep_terms=False)
    driver = sharded.prepare_sharded(shards, opts, mapper=on_driver, keep_terms=False)
    assert len(sent) == 3 and all(isinstance(b, sharded.LabelledBasis) and b.prompt_lab.size for b in sent)
    a, b = on_shards.prep.infl["total"].basis, driver.prep.infl["total"].basis
    for name in ("n", "sum", "cross", "cubes"):
        assert np.array_equal(getattr(a.sums, name), getattr(b.sums, name)), name
    for name in ("n", "s", "S", "T"):
        assert np.array_equal(getattr(a.moments, name), getattr(b.moments, name)), name
    x, y = dict(_numbers(on_shards.finalize([]).to_dict())), dict(_numbers(driver.finalize([]).to_dict()))
    assert x.keys() == y.keys()
    assert {k: v for k, v in x.items() if "generated" not in k} == {k: v for k, v in y.items() if "generated" not in k}


def test_a_gram_result_answers_confint_and_compare_and_refuses_per_prompt_terms(table, tmp_path):
    opts = EvaluationOptions.of(None, seed=3, inference="analytic")
    single = direct.evaluate(table, opts)
    res = sharded.prepare_sharded(sharded.split_by_shard(table, 3), opts, keep_terms=False).finalize([])
    assert res.model.inference.row_pass.influence == "gram"
    a, b = single.confint(level=0.9, joint=True), res.confint(level=0.9, joint=True)
    cols = ["ci_low", "ci_high"]
    assert np.isfinite(np.asarray(a[cols], float)).any()
    np.testing.assert_allclose(np.asarray(b[cols], float), np.asarray(a[cols], float), rtol=1e-12)
    names = list(single.model.policies)
    ca, cb = single.compare(names[0], names[1]), res.compare(names[0], names[1])
    assert cb.diff == pytest.approx(ca.diff, rel=1e-12) and cb.se == pytest.approx(ca.se, rel=1e-12)
    with pytest.raises(TermsNotKept, match="save_terms writes per-prompt terms"):
        res.save_terms(tmp_path / "terms.npz")
    assert not list(tmp_path.iterdir())  # nothing partial written


def test_the_gram_form_with_a_policy_without_labels(table):
    """A policy without own labels has NaN augmented, audit and own-label columns on every prompt: the Gram form
    carries them as NaN columns of its map and gives the single path's numbers."""
    pol = np.asarray(table["policy"].to_pylist())
    label = np.where(pol == "clone", np.nan, table["oracle_label"].to_numpy(zero_copy_only=False))
    t2 = table.set_column(table.column_names.index("oracle_label"), "oracle_label", pa.array(label))
    opts = EvaluationOptions.of(None, seed=3, inference="analytic")
    single = direct.evaluate(t2, opts).to_dict()
    assert single["policies"]["clone"]["n_labelled"] == 0
    sp = sharded.prepare_sharded(sharded.split_by_shard(t2, 3), opts, keep_terms=False)
    assert np.isnan(sp.prep.infl["own"].M).any()
    assert_same_result(single, sp.finalize([]).to_dict(), influence="gram")


def test_labelled_folds_are_hashed_a_chunk_at_a_time(monkeypatch):
    from cje_engine.data.frame import fold_of

    ids = pa.array([f"p{i}" for i in range(100)])
    monkeypatch.setattr(sharded, "FOLD_CHUNK", 7)
    assert np.array_equal(sharded._folds(ids, 5), fold_of(ids.to_pylist(), 5))
    assert sharded._folds(pa.array([], pa.string()), 5).size == 0


def _range_split(table: pa.Table, n: int, *days: pa.Table) -> list:
    """Shards by prompt-id range, as the Ray readers split them: splitters from a sample of every file's ids."""
    files = days or (table,)
    cut = sharded.range_splitters([sharded.sample_prompt_ids(t["prompt_id"], 8 * n) for t in files], n)
    if not days:
        return sharded.split_by_shard(table, n, splitters=cut)
    offset, pieces = 0, []
    for t in days:
        pieces.append(sharded.split_by_shard(t, n, row_offset=offset, splitters=cut))
        offset += t.num_rows
    return [pa.concat_tables([p[s] for p in reversed(pieces)]) for s in range(n)]


@pytest.mark.parametrize("n_shards", [1, 3, 17])
@pytest.mark.parametrize("kw", [dict(inference="analytic"), dict(inference="bootstrap", n_bootstrap=60),
                                dict(inference="analytic", covariates=("response_length",),
                                     calibration_mode="two_stage")], ids=["monotone", "bootstrap", "two_stage"])
def test_shards_by_range_code_prompts_without_their_ids_on_the_driver(table, n_shards, kw):
    """Split by prompt-id range, a shard's prompts are coded as its offset plus their rank in it: no prompt id
    reaches the driver (pass 1 returns none, nor does any other call), and every number, replicates included,
    is the single-process one (per-prompt terms and Gram form alike)."""
    opts = EvaluationOptions.of(None, seed=3, **kw)
    prep = direct.prepare(table, opts)
    chunks = [direct.bootstrap_chunk(prep, 0, 60)] if kw["inference"] == "bootstrap" else []
    single = direct.finalize(prep, chunks).to_dict()
    n = table.num_rows
    for parts in (_range_split(table, n_shards), _range_split(table, n_shards, table.slice(0, n // 3),
                                                              table.slice(n // 3))):
        assert all(sharded.RANGE_META in p.schema.metadata for p in parts)
        calls, summaries = [], []

        def watching(fn, items):
            calls.append(fn.__name__)
            for i, res in sharded.serial_map(fn, items):
                if fn is sharded.reduce_shard:
                    assert res.prompt_ids is None and res.n_ids == len(set(items[i][0]["prompt_id"].to_pylist()))
                    summaries.append(res)
                yield i, res

        for keep in (True, False):
            calls.clear()
            sp = sharded.prepare_sharded(parts, opts, mapper=watching, keep_terms=keep)
            assert "shard_prompt_ids" not in calls
            assert all(c.prompt_rank is None for c in sp.codes)
            got = [sp.replicates(0, 60)] if chunks else []
            if chunks:
                assert np.array_equal(got[0], chunks[0], equal_nan=True)
            assert_same_result(single, sp.finalize(got).to_dict(), influence="per_prompt" if keep else "gram")


def test_range_shards_out_of_order_are_ranked_on_the_driver(table):
    """Range shards handed over in another order (or overlapping) fall back to ranking their ids on the driver:
    same numbers; a prompt in two range shards is refused."""
    opts = EvaluationOptions.of(None, seed=3, inference="analytic")
    single = direct.evaluate(table, opts).to_dict()
    parts = _range_split(table, 3)
    calls = []

    def counting(fn, items):
        calls.append(fn.__name__)
        return sharded.serial_map(fn, items)

    assert_same_result(single, sharded.prepare_sharded(parts[::-1], opts, mapper=counting).finalize([]).to_dict())
    assert calls[:2] == ["reduce_shard", "shard_prompt_ids"]
    wrong = [pa.concat_tables([parts[0], parts[1].slice(0, 1)]), parts[1], parts[2]]
    with pytest.raises(CJEInputError, match="is in two shards"):
        sharded.prepare_sharded(wrong, opts)


def test_range_splitters_cut_the_pooled_samples_evenly():
    ids = pa.array([f"p{i:05d}" for i in range(1000)])
    sample = sharded.sample_prompt_ids(ids, 101)
    assert sample == sorted(sample) and sample[0] == "p00000" and sample[-1] == "p00999"
    cut = sharded.range_splitters([sample[::2], sample[1::2]], 4)
    assert cut == sorted(cut) and len(cut) == 3
    sizes = [p.num_rows for p in sharded.split_by_shard(pa.table({"prompt_id": ids}), 4, splitters=cut)]
    assert sum(sizes) == 1000 and min(sizes) > 200
    assert sharded.range_splitters([], 3) == ["", ""] and sharded.range_splitters([["a"]], 1) == []


def test_third_moments_fast_path_is_its_reference_bit_for_bit():
    """`third_moments` writes its products into one reused buffer (and takes ``e.T`` when the caller has it):
    the same matrix products on the same values as its reference (a new temporary a product), so the same
    bits, not merely the same to rounding (`test_third_moments_are_the_triple_sum` bounds both)."""
    from cje_engine.inference.gram import _third_moments_reference

    rng = np.random.default_rng(11)
    for n, K in ((0, 3), (1, 1), (2, 5), (37, 4), (300, 5), (4096, 3), (50_000, 5)):
        e = rng.standard_normal((n, K)) ** 3
        want = _third_moments_reference(e)
        assert np.array_equal(third_moments(e), want), (n, K)
        assert np.array_equal(third_moments(e, reference=True), want), (n, K)
        assert np.array_equal(third_moments(e, et=np.ascontiguousarray(e.T)), want), (n, K)
        assert np.array_equal(Moments.of(e).T, Moments.of(e, reference=True).T)


def test_basis_sums_fast_path_is_its_reference_bit_for_bit():
    """`BasisSums.add` (each group's columns taken from one transposed copy, products in a reused buffer) adds
    the same count, sums, cross-products and per-group third moments as its reference, bit for bit."""
    rng = np.random.default_rng(12)
    K = 5
    D = 5 * K
    groups = np.arange(D).reshape(5, K).T
    fast, ref = BasisSums(D, groups), BasisSums(D, groups)
    for n in (1, 17, 3000, 20_000):
        rows = rng.standard_normal((n, D)) ** 3
        fast.add(rows)
        ref.add(rows, reference=True)
    for name in ("n", "sum", "cross", "cubes"):
        assert np.array_equal(getattr(fast, name), getattr(ref, name)), name
    with pytest.raises(ValueError, match="finite"):
        fast.add(np.full((2, D), np.inf))


def _labelled_basis(rng, K: int, n_prompts: int, n_lab: int, n_cal: int, gone=(), own_gone=()) -> tuple:
    """A `LabelledBasis` of ``n_prompts`` labelled prompts (codes 0..n-1), its rows' contributions with NaN and
    infinite entries, and the prompts' terms."""
    n_blocks = 4
    prompt_lab = np.sort(np.concatenate([np.arange(n_prompts), rng.integers(0, max(n_prompts, 1), n_lab)]))
    prompt_lab = prompt_lab[:max(n_lab, n_prompts)] if n_prompts else prompt_lab[:0]
    L = prompt_lab.size
    res, own = rng.standard_normal(L) ** 3, rng.standard_normal(L)
    if L > 3:
        res[1], own[2], res[3] = np.nan, np.inf, -np.inf
    prompt_cal = rng.integers(0, max(n_prompts, 1), n_cal if n_prompts else 0)
    gone_mask, own_mask = np.zeros(K, bool), np.zeros(K, bool)
    gone_mask[list(gone)] = True
    own_mask[list(own_gone)] = True
    rho = rng.standard_normal((K, n_blocks))
    rho[0, 1] = np.inf
    basis = sharded.LabelledBasis(
        K=K, groups=np.arange(5 * K).reshape(5, K).T, block=max(n_prompts, 1), gone=np.flatnonzero(gone_mask),
        own_gone=own_mask,
        rho_cal=rho, rho_audit=rng.standard_normal((K, n_blocks)), m=3.0, prompt_lab=prompt_lab,
        lab_pol=rng.integers(0, K, L), res_contrib=res, own_contrib=own, prompt_cal=prompt_cal,
        b_cal=rng.integers(0, n_blocks, prompt_cal.size), resid_cal=rng.standard_normal(prompt_cal.size))
    terms = rng.standard_normal((n_prompts, K))
    return basis, np.unique(prompt_lab), terms


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the largest floats summed: inf, NaN (alike in both)
def test_labelled_basis_rows_built_transposed_are_its_reference_bit_for_bit():
    """`LabelledBasis._rows_t` (each column of the basis rows written as one contiguous row, the per-policy sums
    binned by ``policy * n + position``) is `LabelledBasis._rows`' reference transposed, bit for bit (NaN and
    infinite contributions, policies without labels, one prompt, blocks of every size); `gram.transposed` is
    ``numpy.ascontiguousarray(a.T)``; and `LabelledBasis.sums` (the rows from their transpose, `BasisSums.add`
    given ``rows_t``) is its reference's, bit for bit."""
    from cje_engine.inference import gram

    rng = np.random.default_rng(14)
    for shape in ((0, 0), (1, 1), (3, 0), (25, 1), (5, gram.TRANSPOSE_STEP - 1), (25, gram.TRANSPOSE_STEP),
                  (7, 2 * gram.TRANSPOSE_STEP + 3)):
        a = rng.standard_normal(shape)
        got = gram.transposed(a)
        assert got.flags.c_contiguous and np.array_equal(got, np.ascontiguousarray(a.T))
    for K, n, n_lab, n_cal, gone, own_gone in ((5, 1, 1, 1, (), ()), (5, 40, 90, 30, (2,), (2, 4)),
                                               (3, 700, 1500, 400, (), (0,)), (1, 9, 9, 0, (0,), (0,)),
                                               (5, 5000, 9000, 2000, (4,), ())):
        basis, P, terms = _labelled_basis(rng, K, n, n_lab, n_cal, gone, own_gone)
        loc_l, loc_c = np.searchsorted(P, basis.prompt_lab), np.searchsorted(P, basis.prompt_cal)
        want = basis._rows(terms, None, None, loc_l, loc_c, reference=True)
        got = basis._rows_t(terms, None, None, loc_l, loc_c)
        assert got.flags.c_contiguous and got.tobytes() == np.ascontiguousarray(want.T).tobytes(), (K, n)
        for block in (1, 7, max(n // 3, 1), n, n + 1):
            basis.block = block
            fast, ref = basis.sums(P, terms), basis.sums(P, terms, reference=True)
            for name in ("n", "sum", "cross", "cubes"):
                assert np.asarray(getattr(fast, name)).tobytes() == np.asarray(getattr(ref, name)).tobytes(), \
                    (K, n, block, name)
    rows = rng.standard_normal((300, 25))
    with_t, without = BasisSums(25, np.arange(25).reshape(5, 5).T), BasisSums(25, np.arange(25).reshape(5, 5).T)
    with_t.add(rows, rows_t=gram.transposed(rows))
    without.add(rows)
    assert all(np.array_equal(getattr(with_t, f), getattr(without, f)) for f in ("n", "sum", "cross", "cubes"))


def test_nan_to_num_in_place_is_numpys():
    """`sharded._nan_to_num` (replacements only where an entry is not finite) leaves what `numpy.nan_to_num`
    leaves, on a strided view as on a whole array, with and without non-finite entries."""
    rng = np.random.default_rng(13)
    base = rng.standard_normal((200, 15))
    base[rng.integers(0, 200, 30), rng.integers(0, 15, 30)] = np.nan
    base[3, 4], base[7, 9], base[8, 2] = np.inf, -np.inf, np.inf
    base[:, 6] = np.nan  # a policy without labels: a whole column
    for view in (lambda a: a, lambda a: a[:, 5:10], lambda a: a[:, 10:]):
        a, b = base.copy(), base.copy()
        got = sharded._nan_to_num(view(a))
        np.nan_to_num(view(b), copy=False)
        assert np.array_equal(a, b, equal_nan=True) and np.shares_memory(got, a)  # (NaN outside the view)
        assert np.isfinite(view(a)).all()


@pytest.mark.parametrize("kw", [{}, dict(calibration_policies=("base", "clone"))], ids=["all", "calibration_policies"])
def test_pass_2_fast_path_is_its_reference(table, monkeypatch, kw):
    """`shard_evaluation_terms` in the Gram form (labelled prompts marked, not sorted; `LabelledBasis.sums`
    without a second sort, `_nan_to_num`, the fast `BasisSums.add` and `Moments.of`) returns the reference's
    labelled prompts, unlabelled moments and basis sums bit for bit; its diagnostic totals (the sums of the two
    parts instead of one pass over every prompt) agree to rounding: a sum of n terms in another order differs by
    at most ~2 n eps times the sum of their absolute values, itself <= sqrt(n * sum of squares) (Cauchy-Schwarz),
    and likewise for the cross-products with sqrt(S_ii S_jj)."""
    monkeypatch.setattr(sharded, "BASIS_BLOCK_BYTES", 8 * 15 * 17)  # blocks of 17 prompts: several a shard
    items = []

    def capturing(fn, its):
        its = list(its)
        if fn is sharded.shard_evaluation_terms:
            items.extend(its)
        return sharded.serial_map(fn, its)

    opts = EvaluationOptions.of(None, seed=3, inference="analytic", **kw)
    sharded.prepare_sharded(_range_split(table, 3), opts, mapper=capturing, keep_terms=False)
    assert len(items) == 3
    eps = np.finfo(float).eps
    for item in items:
        fast = sharded.shard_evaluation_terms(*item)
        ref = sharded.shard_evaluation_terms(*item[:-1], basis=item[-1], reference=True)
        assert fast.labelled.size and np.array_equal(fast.labelled, ref.labelled)
        assert fast.labelled.dtype == ref.labelled.dtype and fast.count == ref.count
        for name in ("n", "s", "S", "T"):
            assert np.array_equal(getattr(fast.rest, name), getattr(ref.rest, name)), name
        for name in ("n", "sum", "cross", "cubes"):
            assert np.array_equal(getattr(fast.sums, name), getattr(ref.sums, name)), name
        n, d = ref.count, np.sqrt(np.diag(ref.gram))
        assert np.all(np.abs(fast.total - ref.total) <= 2 * n * eps * np.sqrt(n) * d)
        assert np.all(np.abs(fast.gram - ref.gram) <= 2 * n * eps * np.outer(d, d))
        # the places of the rows' prompts the shard hints (`_places`), right, wrong or none: the same sums
        basis = item[-1]
        got = sharded.shard_evaluation_terms(*item[:-1], basis=None)
        want = sharded.shard_evaluation_terms(*item[:-1], basis=None, reference=True)
        x, y = got.labelled_terms, want.labelled_terms  # rows taken by `numpy.take`: the reference's indexing's
        assert x.dtype == y.dtype and x.shape == y.shape and x.flags.c_contiguous and x.tobytes() == y.tobytes()
        for name in ("n", "s", "S", "T"):  # of the rows `numpy.compress` took
            assert np.array_equal(getattr(got.rest, name), getattr(want.rest, name)), name
        n_l, n_c = basis.prompt_lab.size, basis.prompt_cal.size
        right = (np.searchsorted(got.labelled, basis.prompt_lab), np.searchsorted(got.labelled, basis.prompt_cal))
        for at in (None, right, (right[0], None), (np.zeros(n_l, np.int64), np.zeros(n_c, np.int64)),
                   (right[0][:-1], right[1][1:]), (right[0] + 1, right[1] - 1)):
            sums = basis.sums(got.labelled, got.labelled_terms, at=at)
            for name in ("n", "sum", "cross", "cubes"):
                assert np.array_equal(getattr(sums, name), getattr(ref.sums, name)), name
        # the check of the labelled prompts against the driver's: both paths refuse another set
        P = fast.labelled
        for wrong in (P[1:], np.append(P, P[-1] + 1), P[::-1].copy()):
            for reference in (False, True):
                with pytest.raises(ValueError, match="labelled prompts are not the driver's"):
                    item[-1].sums(wrong, np.zeros((wrong.size, 5)), reference=reference)
            with pytest.raises(ValueError, match="labelled prompts are not the driver's"):
                item[-1].sums(wrong, np.zeros((wrong.size, 5)), at=(np.arange(n_l) % wrong.size, None))


def test_the_driver_tails_fast_paths_are_their_references():
    """`calibration.labelled_prompt_index` (a bit a prompt and a running count a 64-bit word) is `unique_inverse`'s
    index (values and dtype), prompts few or many, at the words' bounds and over several blocks of rows;
    `audit.residual_deciles` (rows put in bin order once) returns the reference's bins, every float bit for bit
    (the same slices summed alike), ties and one-value scores included."""
    from cje_engine.audit import residual_deciles
    from cje_engine.pipeline.calibration import labelled_prompt_index

    rng = np.random.default_rng(41)
    for rows, n_prompts in ((0, 10), (1, 1), (50, 40), (5000, 20_000), (5000, 10**6), (100_000, 30_000),
                            (140_000, 64 * 9000 + 7), (70_000, 64)):
        p = rng.integers(0, n_prompts, rows)
        if rows > 10:  # the words' bounds (bits 0 and 63, the last word's partial bits) and the rows' blocks
            p[:6] = [0, min(63, n_prompts - 1), min(64, n_prompts - 1), n_prompts - 1, n_prompts - 1, 0]
            p[-3:] = n_prompts - 1
        n, inv = labelled_prompt_index(p, n_prompts)
        n_ref, inv_ref = labelled_prompt_index(p, n_prompts, reference=True)
        assert n == n_ref == np.unique(p).size and inv.dtype == inv_ref.dtype and np.array_equal(inv, inv_ref)
    for n, values in ((0, 5), (1, 3), (7, 2), (1000, 21), (50_000, 21), (50_000, 10**6), (3000, 1)):
        score = rng.integers(0, values, n) / max(values - 1, 1)
        resid, w = rng.standard_normal(n), rng.random(n)
        assert residual_deciles(score, resid, w) == residual_deciles(score, resid, w, reference=True)
        assert residual_deciles(score, resid, w, n_bins=3) == residual_deciles(score, resid, w, n_bins=3, reference=True)


def test_a_design_whose_rows_all_calibrate_reads_the_datas_arrays_and_equals_the_gathers():
    """The sharded driver's data holds its labelled rows only: in the first round of robust pooling every row
    calibrates, and the design reads the data's own label, score and fold arrays (`at_rows`: no 5M-row copies)
    instead of gathering them. The cell index and the calibration plan are the gathers' array for array (values and
    dtypes); with a subset of the policies calibrating, they are gathers (not the data's arrays)."""
    from cje_engine.data.frame import EvalData
    from cje_engine.data.ints import at_rows, small_unique_inverse
    from cje_engine.direct.estimators import calibration_plan, make_design, row_cells

    a = np.arange(10.0)
    assert at_rows(a, np.arange(10)) is a and at_rows(a, np.arange(0)).size == 0
    assert np.array_equal(at_rows(a, np.array([1, 4, 9])), [1.0, 4.0, 9.0])
    assert at_rows(a, np.array([0, 2, 9])) is not a and at_rows(a[:0], np.arange(0)).size == 0
    frame = simulate(1500, seed=7, oracle_fraction=0.2).frame
    data = EvalData.from_frame(frame[frame["oracle_label"].notna()].reset_index(drop=True))
    assert data.labelled.all()
    for sources in (None, tuple(data.policies[:2])):
        design = make_design(data, "monotone", sources)
        cal, ci = design.cal_rows, design.cells
        plan = calibration_plan(design)
        cells, row_cell, _, _ = row_cells(data, "monotone")
        glob, cell = small_unique_inverse(row_cell[cal].copy(), cells.size)
        for got, want in ((ci.cal_global, glob), (ci.cal_cell, cell.astype(np.int64)),
                          (ci.cal_key, data.fold[cal] * glob.size + cell), (plan.y, data.label[cal]),
                          (design.cal_fold, data.fold[cal])):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        every = sources is None
        assert every == (cal.size == data.n_rows)
        assert (plan.y is data.label) == every and (design.cal_fold is data.fold) == every
