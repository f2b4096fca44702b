"""The fast paths of segments (docs/segments.md, "Cost") against the slow, obvious computations they replace.

- the cells' influence terms in the sparse Gram form (`cje_engine.direct.segment_terms`) = the dense
  `estimators.influence` and `verified.own_label_influence` of the same virtual design, entry by entry and
  through every reduction the finalize applies (variances, covariances, acceleration, power-tuning weight);
- the virtual design's cells and keys, prompt counts and policy recoding = `row_cells`, `prompts_per_policy`
  and ``np.unique`` on the rows, bit for bit;
- the omnibus covariance over only the clusters that hold labels = `cluster_cov` over every cluster;
- the bootstrap route's one pass (`estimators.joint_replicates`: one histogram per replicate for the run and its
  cells, one refit when the calibration is the run's) = the run's and the cells' own replicate passes, bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from cje_engine.direct.estimators import influence, row_cells
from cje_engine.direct.segment_terms import prompts_per_column, sparse_influence
from cje_engine.direct.verified import own_label_influence, power_tuned_lambda
from cje_engine.inference.intervals import acceleration
from cje_engine.inference.variance import cluster_cov, cluster_cov_padded, cluster_var
from cje_engine.pipeline import segments as seg
from cje_engine.pipeline.direct import prepare
from cje_engine.pipeline.policies import prompts_per_policy
from cje_engine.simulate.segments import segment_scenario, simulate_segments


@pytest.fixture(scope="module")
def virtual():
    """A prepared segmented run (4 segments, 2 policies, some policies' labels removed in one segment) and its
    virtual-policy preparation with and without the segment covariate."""
    data = simulate_segments(segment_scenario("loser", seed=11, n_prompts=600, oracle_fraction=0.2))
    frame = data.frame.copy()
    # a cell without labels: its augmented, audit and own-label columns are NaN
    frame.loc[(frame["segment"] == "c") & (frame["policy"] == "new"), "oracle_label"] = np.nan
    prep = prepare(frame, calibration_mode="monotone", inference="analytic", seed=1, segment_by=["segment"],
                   segment_min_labels=0)
    d = prep.design.data
    group, names, _ = seg.plan_segments(d.policy, prep.segments.code, d.labelled, len(d.policies),
                                        prep.segments.names, 50, 0)
    out = {}
    for recal in (False, True):
        vprep, cells, _ = seg.segment_prepared(prep, group, names, recal)
        out[recal] = vprep
    return prep, group, names, out


def _dense(vprep):
    design = vprep.design
    d = design.data
    infl = influence(design, vprep.f, vprep.full, vprep.stats)
    lab = design.lab_rows
    _, own = own_label_influence(d.prompt[lab], d.policy[lab], d.label[lab], d.label_weight[lab], d.n_prompts,
                                 design.n_policies)
    infl["own"] = own
    return infl


@pytest.mark.parametrize("recal", [False, True])
def test_sparse_terms_equal_the_dense_influence_terms_entry_by_entry(virtual, recal):
    vprep = virtual[3][recal]
    dense = _dense(vprep)
    sparse = sparse_influence(vprep.design, vprep.f, vprep.full, vprep.stats)
    for name in ("total", "calibration", "audit", "own"):
        a, b = dense[name], sparse[name].rows  # the Gram form's every prompt (basis rows times the map)
        assert a.shape == b.shape
        assert np.array_equal(np.isnan(a).all(0), np.isnan(b).all(0)), name
        fin = np.isfinite(a).all(0)
        assert fin.sum() >= a.shape[1] - 3  # only the label-less cell's columns are NaN
        scale = np.abs(a[:, fin]).max()
        assert np.abs(a[:, fin] - b[:, fin]).max() <= 1e-12 * scale, name


@pytest.mark.parametrize("recal", [False, True])
def test_sparse_terms_give_the_dense_variances_accelerations_and_lambdas(virtual, recal):
    vprep = virtual[3][recal]
    dense = _dense(vprep)
    sparse = vprep.infl  # what the virtual preparation carries
    K = vprep.design.n_policies
    for name in ("total", "calibration"):
        v_d, v_s = cluster_var(dense[name]), cluster_var(sparse[name])
        assert v_s == pytest.approx(v_d, rel=1e-12, abs=1e-30)
    for k in range(K):
        col = K + k
        if not np.isfinite(dense["own"][:, k]).all():
            continue
        assert acceleration(sparse["total"][:, col]) == pytest.approx(acceleration(dense["total"][:, col]), rel=1e-9,
                                                                      abs=1e-14)
        assert power_tuned_lambda(sparse["own"][:, k], sparse["total"][:, col]) == pytest.approx(
            power_tuned_lambda(dense["own"][:, k], dense["total"][:, col]), rel=1e-12, abs=1e-14)
    pair = cluster_cov(np.nan_to_num(dense["total"][:, K] - dense["total"][:, K + 1]))[0, 0]
    assert float(cluster_cov(np.nan_to_num(sparse["total"][:, K] - sparse["total"][:, K + 1]))[0, 0]) == pytest.approx(
        pair, rel=1e-12)


@pytest.mark.parametrize("recal", [False, True])
def test_virtual_cells_keys_and_prompt_counts_equal_the_row_passes(virtual, recal):
    prep, group, names, vpreps = virtual
    vdesign = vpreps[recal].design
    slow = row_cells(vdesign.data, vdesign.mode)
    fast = (vdesign.cells.cells, vdesign.cells.row_cell, vdesign.cells.row_key, vdesign.cells.counts)
    for a, b in zip(fast[1:], slow[1:]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    for field in ("score", "X", "score_values", "score_code"):
        assert np.array_equal(getattr(fast[0], field), getattr(slow[0], field))
    d = vdesign.data
    assert np.array_equal(prompts_per_column(vdesign), prompts_per_policy(d.policy, d.prompt, len(d.policies),
                                                                          d.n_prompts))
    assert np.array_equal(vpreps[recal].rows.n_rows, np.bincount(d.policy, minlength=len(d.policies)))


def test_virtual_policy_codes_equal_np_unique(virtual):
    prep, group, names, _ = virtual
    d = prep.design.data
    vdata, cells = seg.virtual_data(d, group, len(names))
    key = d.policy.astype(np.int64) * len(names) + group
    present, code = np.unique(key, return_inverse=True)
    assert np.array_equal(vdata.policy, code.astype(d.policy.dtype))
    assert np.array_equal(cells, np.stack([present // len(names), present % len(names)], axis=1))


def test_padded_cluster_cov_equals_cluster_cov_over_every_cluster():
    rng = np.random.default_rng(0)
    psi = rng.normal(size=(40, 3)) + 0.3
    full = np.zeros((100, 3))
    full[rng.choice(100, 40, replace=False)] = psi
    assert cluster_cov_padded(psi, 100) == pytest.approx(cluster_cov(full), rel=1e-12)
    assert cluster_cov_padded(psi[:, 0], 100)[0, 0] == pytest.approx(cluster_cov(full[:, 0])[0, 0], rel=1e-12)


@pytest.mark.parametrize("scenario", ["null", "opposite"])
def test_joint_bootstrap_pass_gives_the_run_and_cells_replicates_bit_for_bit(scenario):
    """``bootstrap_chunk(with_segments=True)``: the run's replicates and the cells' (kept for finalize) equal the
    separate passes bit for bit, whether the cells refit the run's calibration (null: shared refits) or their
    own with the segment covariate (opposite: two-stage), in any chunking; the result is the same."""
    import json

    from cje_engine.direct.estimators import bootstrap_replicates, bootstrap_view
    from cje_engine.pipeline.direct import bootstrap_chunk, finalize, segments_of

    frame = simulate_segments(segment_scenario(scenario, seed=7, n_prompts=500, oracle_fraction=0.25)).frame
    opts = dict(inference="bootstrap", n_bootstrap=60, seed=3, segment_by=["segment"], segment_min_labels=10)
    prep, ref = prepare(frame.copy(), **opts), prepare(frame.copy(), **opts)
    chunks = [bootstrap_chunk(prep, a, b, with_segments=True) for a, b in ((0, 25), (25, 60))]
    sp = segments_of(prep)
    assert sp.to_plain is not None and sorted(sp.chunks) == [(0, 25), (25, 60)]
    assert sp.recal["applied"] == (scenario == "opposite")
    plain = bootstrap_chunk(ref, 0, 60)
    assert np.array_equal(np.vstack(chunks), plain, equal_nan=True)
    cells = bootstrap_replicates(bootstrap_view(sp.vprep.design, 3), 0, 60)
    assert np.array_equal(sp.replicates(60, 3), cells, equal_nan=True)
    a, b = finalize(prep, chunks).to_dict(), finalize(ref, [plain]).to_dict()
    for r in (a, b):
        r.pop("meta", None)
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def test_bootstrap_workers_get_the_joint_pass_and_finalize_does_not_bootstrap_the_cells_again(monkeypatch):
    """The Ray fan-out's replicate source (`Prepared.bootstrap_source`, pickled as `map_ordered` ships it) is a
    `JointView` with segments: its chunks carry the run's and the cells' replicates side by side, each block the
    same bits as its own `bootstrap_replicates`; `finalize` splits them and runs no cells' bootstrap (patched to
    fail), and its result equals the in-process one's, also on a prepared state that never cached the segment
    pass (as after a reload)."""
    import json
    import pickle

    from cje_engine.direct.estimators import JointView, bootstrap_replicates, bootstrap_view
    from cje_engine.pipeline import direct

    frame = simulate_segments(segment_scenario("opposite", seed=7, n_prompts=500, oracle_fraction=0.25)).frame
    opts = dict(inference="bootstrap", n_bootstrap=60, seed=3, segment_by=["segment"], segment_min_labels=10)
    prep, fresh, ref = (prepare(frame.copy(), **opts) for _ in range(3))
    src = pickle.loads(pickle.dumps(prep.bootstrap_source(), protocol=5))
    assert isinstance(src, JointView) and src.cells.row_prompt is src.view.row_prompt  # shipped once
    chunks = [src.replicates(a, b) for a, b in ((0, 7), (7, 33), (33, 60))]
    K = len(prep.design.data.policies)
    sp = direct.segments_of(prep)
    assert sp.recal["applied"]  # the cells refit their own (two-stage) calibration in the workers' pass
    plain, cells = np.vstack([c[:, :3 * K] for c in chunks]), np.vstack([c[:, 3 * K:] for c in chunks])
    assert np.array_equal(plain, bootstrap_replicates(bootstrap_view(ref.design, 3), 0, 60), equal_nan=True)
    assert np.array_equal(cells, bootstrap_replicates(bootstrap_view(sp.vprep.design, 3), 0, 60), equal_nan=True)
    want = direct.evaluate(frame.copy(), **opts).to_dict()

    def no_second_pass(*a, **k):
        raise AssertionError("finalize bootstrapped the segment cells again")

    monkeypatch.setattr("cje_engine.pipeline.segments.bootstrap_replicates", no_second_pass)
    for p in (prep, fresh):
        got = p.finalize(chunks).to_dict()
        for r in (got, want):
            r.pop("meta", None)
        assert json.dumps(got, sort_keys=True, default=str) == json.dumps(want, sort_keys=True, default=str)
    with pytest.raises(ValueError, match="columns"):
        direct.finalize(ref, [c[:, :-1] for c in chunks])


def test_out_of_fold_table_gather_equals_the_per_row_interpolation_bit_for_bit():
    """`_out_of_fold` with every fold refitted (the segment-covariate two-stage refits of the cells' bootstrap)
    interpolates each (fold, calibration cell) once and gathers in row order: the same bits as interpolating
    and clipping every calibration row on its own (the slow obvious reference), for the point fit and for
    bootstrap-weighted refits."""
    from cje_engine.calibration.calibrators import clip_to, interp_flat
    from cje_engine.direct import estimators as est
    from cje_engine.pipeline.direct import segments_of

    frame = simulate_segments(segment_scenario("opposite", seed=7, n_prompts=500, oracle_fraction=0.25)).frame
    prep = prepare(frame, inference="bootstrap", n_bootstrap=50, seed=3, segment_by=["segment"],
                   segment_min_labels=10)
    plan = est.calibration_plan(segments_of(prep).vprep.design)
    assert plan.entry.batched and plan.cell_sorted is not None  # the two-stage plan of the cells
    fold_of = np.empty(plan.order.size, dtype=int)
    for k, (a, b) in enumerate(plan.fold_bounds):
        fold_of[plan.order[a:b]] = k
    cell_of = np.empty(plan.order.size, dtype=int)
    cell_of[plan.order] = plan.cell_sorted
    n_checked = 0
    for b in (None, 0, 1, 2):
        wc = np.ones(plan.y.size) if b is None else est.bootstrap_weights(3, b, prep.design.data.n_prompts)[
            est.bootstrap_view(segments_of(prep).vprep.design, 3).cal_prompt]
        _, M = est._fold_sums(plan, wc)
        fits = plan.entry.fit_many(plan.cal_cells, M[0], M[1], M[2], clip=plan.label_scale, warm=plan.warm,
                                   n_knots=plan.n_knots)
        F_all = fits.predict_cells(0, plan.cells)
        live = [k for k in range(plan.n_folds) if fits.ok[k + 1]]
        if len(live) < plan.n_folds:
            continue
        got = est._out_of_fold(plan, F_all, fits.Z, live, fits.x[1:], fits.y[1:])
        ref = np.array([clip_to(interp_flat(fits.Z[k + 1, c:c + 1], fits.x[k + 1], fits.y[k + 1]), plan.label_scale)[0]
                        for k, c in zip(fold_of, cell_of)])
        assert np.array_equal(got, ref, equal_nan=True)
        n_checked += 1
    assert n_checked >= 3


def test_cli_bootstrap_with_segments_gives_the_two_pass_segments_block(tmp_path):
    """`cje evaluate --segment-by` on the bootstrap route (chunks of a few replicates, the cells' replicates in
    the same pass) writes the segments block of the two separate passes, number for number."""
    import json

    from cje_engine.options import EvaluationOptions
    from cje_engine.pipeline.direct import bootstrap_chunk, finalize
    from flows.cli.main import main

    frame = simulate_segments(segment_scenario("loser", seed=8, n_prompts=400, oracle_fraction=0.25)).frame
    src = tmp_path / "seg.parquet"
    frame.to_parquet(src, index=False)
    code = main(["evaluate", str(src), "--out", str(tmp_path / "out"), "--segment-by", "segment",
                 "--inference", "bootstrap", "--n-bootstrap", "100", "--exit-zero"])
    assert code == 0
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    prep = prepare(frame, EvaluationOptions.of(None, **{k: v for k, v in res["config"].items() if v is not None}))
    ref = finalize(prep, [bootstrap_chunk(prep, 0, 100)]).to_dict()["segments"]
    assert json.dumps(res["segments"], sort_keys=True) == json.dumps(json.loads(json.dumps(ref)), sort_keys=True)
