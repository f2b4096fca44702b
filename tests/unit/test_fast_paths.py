"""The fast paths against slow, obvious reference computations.

* isotonic: `cje_engine.calibration.isotonic` vs scikit-learn's IsotonicRegression;
* two-stage: the cell-level fit (sufficient statistics + warm-started active set) vs a
  row-level fit written out plainly (numpy quantiles of the rows, scipy NNLS on every row);
* replicates: the cell/histogram replicate vs refitting on physically resampled rows (monotone)
  and vs the row-level two-stage reference under the same row weights.
Tolerances: both sides solve the same convex problems in floating point; differences come from
summation order (~1e-15 relative) and the normal equations of a well-conditioned ~10-column
least squares (condition number < 1e3 here, so < 1e-10), hence rtol 1e-9.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy.optimize import nnls
from sklearn.isotonic import IsotonicRegression

from cje_engine.calibration.calibrators import TwoStageCalibrator, quantile_of_counts, two_stage_knots
from cje_engine.calibration.isotonic import isotonic_fit, isotonic_predict
from cje_engine.data.frame import EvalData
from cje_engine.direct.estimators import (bootstrap_weights, calibration_plan, cross_fit_models, make_design,
                                         replicate, replicate_view)


def _slow_isotonic(x, y, w):
    """Tie-pooled PAVA via sklearn on the distinct x (weights summed per x)."""
    keep = w > 0
    x, y, w = x[keep], y[keep], w[keep]
    ux = np.unique(x)
    sw = np.array([w[x == v].sum() for v in ux])
    sy = np.array([(w * y)[x == v].sum() for v in ux])
    return ux, IsotonicRegression().fit(ux, sy / sw, sample_weight=sw).predict(ux)


@pytest.mark.parametrize("seed", range(5))
def test_isotonic_matches_sklearn(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 15, 300) / 14
    y = np.clip(x + rng.normal(0, .3, 300), 0, 1)
    w = rng.integers(0, 4, 300).astype(float)
    kx, kv, kw = isotonic_fit(x, y, w)
    ux, ref = _slow_isotonic(x, y, w)
    np.testing.assert_array_equal(kx, ux)
    np.testing.assert_allclose(kv, ref, rtol=1e-12, atol=1e-12)
    assert np.sum(kw * kv) == pytest.approx(np.sum(w * y))  # mean preserving
    kx2, kv2, _ = isotonic_fit(x, -y, w, increasing=False)
    np.testing.assert_allclose(kv2, -ref, atol=1e-12)
    np.testing.assert_allclose(isotonic_predict(kx, kv, [-1, 2]), [kv[0], kv[-1]])


@pytest.mark.parametrize("seed", range(5))
def test_quantile_of_counts_is_numpy_quantile(seed):
    rng = np.random.default_rng(seed)
    values = np.sort(rng.choice(np.arange(40) / 39, 12, replace=False))
    counts = rng.integers(0, 5, 12)
    counts[0] += 1
    q = np.linspace(0, 1, 7)
    np.testing.assert_allclose(quantile_of_counts(values, counts, q), np.quantile(np.repeat(values, counts), q),
                               rtol=0, atol=1e-15)


class SlowTwoStageLS:
    """The least-squares (``link="identity"``) two-stage calibrator written row by row."""

    def _design(self, s, y, X, w, n_knots):
        """Rows with positive weight; knots at score quantiles, the ramps R and the standardised
        (signed-log) covariates Z of those rows; stores knots and standardisation."""
        keep = w > 0
        s, y, X, w = s[keep], y[keep], X[keep], w[keep]
        knots = np.unique(np.quantile(s, np.linspace(0, 1, n_knots + 1)))
        Xt = np.sign(X) * np.log1p(np.abs(X))
        mean = (w[:, None] * Xt).sum(0) / w.sum()
        sd = np.sqrt((w[:, None] * (Xt - mean) ** 2).sum(0) / w.sum())
        self.k, self.m, self.sd = knots, mean, np.where(sd > 0, sd, 1)
        R = np.clip((s[:, None] - knots[:-1]) / (knots[1:] - knots[:-1]), 0, 1)
        return s, y, X, w, R, (Xt - mean) / self.sd

    def fit(self, s, y, X, w, n_knots=6):
        s, y, X, w, R, Z = self._design(s, y, X, w, n_knots)
        one = np.ones((s.size, 1))
        A = np.hstack([R, Z, -Z, one, -one]) * np.sqrt(w)[:, None]
        c, _ = nnls(A, y * np.sqrt(w), maxiter=2000)
        nr, p = R.shape[1], Z.shape[1]
        self.a, self.b, self.c = c[:nr], c[nr:nr + p] - c[nr + p:nr + 2 * p], c[-2] - c[-1]
        z = self.index(s, X)
        self.ux, self.uy = _slow_isotonic(z, y, w)
        return self

    def index(self, s, X):
        R = np.clip((s[:, None] - self.k[:-1]) / (self.k[1:] - self.k[:-1]), 0, 1)
        Xt = np.sign(X) * np.log1p(np.abs(X))
        return R @ self.a + ((Xt - self.m) / self.sd) @ self.b + self.c

    def predict(self, s, X):
        return np.clip(np.interp(self.index(s, X), self.ux, self.uy), 0, 1)


class SlowTwoStage(SlowTwoStageLS):
    """The default (logit) two-stage calibrator written row by row, from its definition: the labels on
    [0, 1] (scale (0, 1)), stage 1 minimises the row-level quasi-binomial deviance plus the ridge
    ``0.1 * mean positive weight * (|ramps|^2 + |beta on standardised covariates|^2)`` over ramps >= 0
    with a generic bounded quasi-Newton solver (scipy L-BFGS-B, analytic gradient, run to its
    tolerance floor), stage 2 is sklearn's isotonic regression on the index."""

    def fit(self, s, y, X, w, n_knots=6):
        from scipy.optimize import minimize

        s, y, X, w, R, Z = self._design(s, y, X, w, n_knots)
        A = np.hstack([R, Z, np.ones((s.size, 1))])
        nr, P = R.shape[1], A.shape[1]
        lam = np.full(P, 0.1 * w.sum() / w.size)
        lam[-1] = 0.0
        t = np.clip(y, 0, 1)

        def obj(th):
            eta = A @ th
            mu = 1 / (1 + np.exp(-eta))
            return (np.sum(w * (np.logaddexp(0, eta) - t * eta)) + 0.5 * np.sum(lam * th * th),
                    A.T @ (w * (mu - t)) + lam * th)

        x0 = np.zeros(P)
        x0[:nr] = 0.1
        sol = minimize(obj, x0, jac=True, method="L-BFGS-B", bounds=[(0, None)] * nr + [(None, None)] * (P - nr),
                       options={"ftol": 1e-16, "gtol": 1e-12, "maxiter": 20000, "maxcor": 30})
        self.a, self.b, self.c = sol.x[:nr], sol.x[nr:-1], sol.x[-1]
        z = self.index(s, X)
        self.ux, self.uy = _slow_isotonic(z, y, w)
        return self


def _two_stage_data(seed, n=400):
    rng = np.random.default_rng(seed)
    length = rng.integers(20, 60, n).astype(float)
    q = rng.uniform(0, 1, n)
    s = np.clip(np.round((q + 0.3 * np.log(length / 40) + rng.normal(0, .1, n)) * 10) / 10, 0, 1)
    y = np.clip(q + rng.normal(0, .1, n), 0, 1)
    return s, y, length[:, None]


#: Logit stage against the row-level L-BFGS-B reference: Newton stops once its step moves no
#: coefficient by more than NEWTON_TOL (1 + max|theta|) = 1e-4 * (1 + ~5); its convergence is
#: quadratic with a constant ~0.3 (measured step sequences 0.27, 0.016, 4e-5, 2.5e-10), so its
#: coefficients are within ~0.3 * (6e-4)^2 ~ 1e-7 of the optimum; L-BFGS-B at gtol 1e-12 on this
#: 8-parameter strongly convex problem reaches ~1e-9. Index tolerance 1e-6 = 10x the sum. Stage 2
#: is fitted at the same index ordering (the same pooled points and values); predictions
#: interpolate linearly in the index between them (slopes <~ 1 per index unit here), so they
#: move by at most about the index error: also 1e-6.
LOGIT_INDEX_TOL = 1e-6


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("link", ["logit", "identity"])
def test_two_stage_cells_match_the_row_level_fit(seed, link):
    s, y, X = _two_stage_data(seed)
    w = np.random.default_rng(seed + 100).integers(0, 3, s.size).astype(float)  # bootstrap-like weights
    fast = TwoStageCalibrator(clip=(0, 1), link=link).fit(s, y, X, w)
    slow = (SlowTwoStage() if link == "logit" else SlowTwoStageLS()).fit(s, y, X, w)
    tol = LOGIT_INDEX_TOL if link == "logit" else 1e-9
    grid_s, grid_x = np.repeat(np.linspace(0, 1, 21), 5), np.tile([20., 30, 40, 50, 60], 21)[:, None]
    np.testing.assert_allclose(fast.index(s, X), slow.index(s, X), rtol=0, atol=tol)
    np.testing.assert_allclose(fast.predict(grid_s, grid_x), slow.predict(grid_s, grid_x), rtol=0, atol=tol)


def _sim_frame(seed, n_prompts=150):
    rng = np.random.default_rng(seed)
    rows = []
    for k, shift in enumerate([0.0, 0.2, -0.3]):
        length = rng.integers(20, 60, n_prompts)
        q = 1 / (1 + np.exp(-(rng.normal(0, 1, n_prompts) + shift)))
        s = np.clip(np.round((q + 0.3 * np.log(length / 40) + rng.normal(0, .1, n_prompts)) * 10) / 10, 0, 1)
        y = np.clip(q + rng.normal(0, .1, n_prompts), 0, 1)
        lab = rng.uniform(size=n_prompts) < 0.4
        for i in range(n_prompts):
            rows.append({"prompt_id": f"q{i}", "policy": f"p{k}", "judge_score": s[i],
                         "oracle_label": y[i] if lab[i] else np.nan, "len": float(length[i])})
    return pd.DataFrame(rows)


def _slow_stats(data, cal, f, w):
    """Plug-in and augmented values by explicit loops over policies."""
    out_p, out_a = [], []
    for k in range(len(data.policies)):
        r = data.policy == k
        plug = np.sum(w[r] * f[r]) / np.sum(w[r])
        lab = r & data.labelled
        lw = w[lab] * data.label_weight[lab]
        out_p.append(plug)
        out_a.append(plug + np.sum(lw * (data.label[lab] - f[lab])) / np.sum(lw) if lw.sum() > 0 else np.nan)
    return np.array(out_p + out_a)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cal_pols", [None, ("p0",)])
def test_two_stage_replicate_matches_row_level_refits(seed, cal_pols):
    frame = _sim_frame(seed)
    data = EvalData.from_frame(frame, covariates=["len"])
    design = make_design(data, "two_stage", cal_pols)
    cr = design.cal_rows
    for b in range(3):
        pw = bootstrap_weights(seed, b, data.n_prompts)
        w = pw[data.prompt]
        s, y, X, wc, fold = data.score[cr], data.label[cr], data.X[cr], w[cr], data.fold[cr]
        f = SlowTwoStage().fit(s, y, X, wc).predict(data.score, data.X)
        for k in range(data.n_folds):
            held = fold == k
            if (wc[held] > 0).any():
                f[cr[held]] = SlowTwoStage().fit(s, y, X, np.where(held, 0, wc)).predict(s[held], X[held])
        # logit stage 1 to LOGIT_INDEX_TOL (above); the statistics are means of predictions
        np.testing.assert_allclose(replicate(design, pw), _slow_stats(data, cr, f, w), rtol=0, atol=LOGIT_INDEX_TOL)


@pytest.mark.parametrize("seed", range(3))
def test_monotone_replicate_equals_refitting_physically_resampled_rows(seed):
    """Resample prompts for real (copies of rows), fit sklearn isotonic per fold, average: same numbers."""
    frame = _sim_frame(seed)
    data = EvalData.from_frame(frame)
    design = make_design(data, "monotone", None)
    pw = bootstrap_weights(seed, 7, data.n_prompts)
    rows = np.repeat(np.arange(data.n_rows), pw[data.prompt].astype(int))  # each row once per draw of its prompt
    s, y, pol, fold = data.score[rows], data.label[rows], data.policy[rows], data.fold[rows]
    lab = ~np.isnan(y)

    def iso(mask):
        ux, uy = _slow_isotonic(s[mask], y[mask], np.ones(mask.sum()))
        return lambda v: np.interp(v, ux, uy)

    f = iso(lab)(s)
    for k in range(data.n_folds):
        held = lab & (fold == k)
        if held.any():
            f[held] = iso(lab & (fold != k))(s[held])
    K = len(data.policies)
    plug = np.array([f[pol == k].mean() for k in range(K)])
    aug = np.array([plug[k] + (y[lab & (pol == k)] - f[lab & (pol == k)]).mean() for k in range(K)])
    np.testing.assert_allclose(replicate(design, pw), np.concatenate([plug, aug]), rtol=1e-10, atol=1e-12)


def test_two_stage_replicate_survives_an_exactly_singular_batched_solve():
    """17 calibration labels, bootstrap replicate 162 (found by benchmarks/bench_protocol.py): the folds'
    batched normal equations are exactly singular. The replicate falls back to the per-fit solver and
    matches the slow row-level refits."""
    from cje_engine.simulate.direct import PolicySpec, simulate

    pols = (PolicySpec("base", 0.8), PolicySpec("clone", 0.8), PolicySpec("verbose", 0.7, verbosity=2.0),
            PolicySpec("concise", 1.0, verbosity=0.6), PolicySpec("better", 1.1, verbosity=1.2),
            PolicySpec("worse", 0.55, verbosity=1.5), PolicySpec("unhelpful", -1.0, adversarial=True))
    seed = 7_000_000_000 + (50 * 100_000 + 500) * 1_000
    sim = simulate(500, pols, oracle_fraction=0.05, label_design="calibration_policy", calibration_policy="base",
                   audit_labels=50, seed=seed, judge_noise_sd=0.0)
    data = EvalData.from_frame(sim.frame, covariates=["response_length"])
    design = make_design(data, "two_stage", ("base",))
    cr = design.cal_rows
    assert cr.size == 17
    pw = bootstrap_weights(seed % 2**31, 162, data.n_prompts)
    w = pw[data.prompt]
    s, y, X, wc, fold = data.score[cr], data.label[cr], data.X[cr], w[cr], data.fold[cr]
    f = SlowTwoStage().fit(s, y, X, wc).predict(data.score, data.X)
    for k in range(data.n_folds):
        held = fold == k
        if (wc[held] > 0).any() and (wc[~held] > 0).any():
            f[cr[held]] = SlowTwoStage().fit(s, y, X, np.where(held, 0, wc)).predict(s[held], X[held])
    np.testing.assert_allclose(replicate(design, pw), _slow_stats(data, cr, f, w), rtol=0, atol=LOGIT_INDEX_TOL)


# --- the batched two-stage cross-fit (cje_engine.calibration.two_stage_batch) -------------------

def _fold_sums_of(seed, n=400, J=6):
    """Per-(fit, cell) sums like a cross-fit's: fit 0 all rows, fit j>0 without a random fold."""
    from cje_engine.calibration.calibrators import make_cells, pool_rows

    s, y, X = _two_stage_data(seed, n)
    cells, row_cell = make_cells(s, X)
    rng = np.random.default_rng(seed + 7)
    w = rng.integers(0, 3, n).astype(float)
    fold = rng.integers(0, J - 1, n)
    sums = [pool_rows(row_cell, cells.size, y, w)] + [pool_rows(row_cell, cells.size, y, np.where(fold == k, 0, w))
                                                      for k in range(J - 1)]
    W, WY, C = (np.array(part) for part in zip(*sums))
    return cells, W, WY, C


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("link", ["logit", "identity"])
def test_batched_fits_equal_fit_cells_row_by_row(seed, link):
    """Every row of `fit_two_stage_many` is the model `fit_cells` fits on that row's sums: same
    knots, coefficients and predictions; rows without data give None; a fit whose knots differ
    (here: fit 3 keeps only two distinct scores) is solved in its own group. Least squares: rtol
    1e-9 (the same KKT point from differently ordered solves). Logit: both Newton loops stop within
    ~1e-7 of the same optimum (`LOGIT_INDEX_TOL` above; the batched loop re-solves on the free set
    where the scalar one runs the active set every step, so they can stop one step apart)."""
    from cje_engine.calibration.two_stage_batch import fit_two_stage_many

    cells, W, WY, C = _fold_sums_of(seed)
    lo = cells.score <= np.quantile(cells.score, 0.3)
    W[3, ~lo], WY[3, ~lo], C[3, ~lo] = 0, 0, 0  # few distinct scores: fewer knots than the others
    W[4], WY[4], C[4] = 0, 0, 0  # no data
    fits = fit_two_stage_many(cells, W, WY, C, clip=(0, 1), link=link)
    models = fits.models()
    assert models[4] is None and not fits.ok[4]
    assert fits.knots[3].size < fits.knots[0].size
    rtol, atol = (1e-9, 1e-10) if link == "identity" else (0, LOGIT_INDEX_TOL)
    for j in (0, 1, 2, 3, 5):
        ref = TwoStageCalibrator(clip=(0, 1), link=link).fit_cells(cells, W[j], WY[j], C[j])
        m = models[j]
        assert m.link == link
        np.testing.assert_array_equal(m.knots_, ref.knots_)
        for attr in ("ramp_coef_", "beta_", "x_mean_", "x_scale_"):
            np.testing.assert_allclose(getattr(m, attr), getattr(ref, attr), rtol=rtol, atol=max(atol, 1e-12))
        assert m.intercept_ == pytest.approx(ref.intercept_, rel=rtol, abs=max(atol, 1e-12))
        np.testing.assert_allclose(m.predict_cells(cells), ref.predict_cells(cells), rtol=rtol, atol=atol)
        np.testing.assert_allclose(fits.predict_cells(j, cells), ref.predict_cells(cells), rtol=rtol, atol=atol)
        np.testing.assert_allclose(fits.Z[j], ref._index_t(cells.score, ref._xt(cells)), rtol=rtol, atol=atol)


def test_logit_stage_is_the_row_level_optimum_and_batched_like_fit_cells_in_a_real_cross_fit():
    """The replicate path's six fits (full + fold complements, bootstrap weights) on the protocol
    simulator equal the row-level L-BFGS-B optimum of each (index to LOGIT_INDEX_TOL)."""
    from cje_engine.calibration.calibrators import make_cells, pool_rows
    from cje_engine.calibration.two_stage_batch import fit_two_stage_many
    from cje_engine.simulate.direct import simulate

    sim = simulate(800, oracle_fraction=0.3, seed=11, judge_noise_sd=0.0)
    fr = sim.frame[sim.frame["oracle_label"].notna()]
    s, y, X = fr["judge_score"].to_numpy(), fr["oracle_label"].to_numpy(), fr[["response_length"]].to_numpy(float)
    cells, row_cell = make_cells(s, X)
    rng = np.random.default_rng(3)
    w = rng.poisson(1.0, s.size).astype(float)
    fold = rng.integers(0, 5, s.size)
    ws = [w] + [np.where(fold == k, 0, w) for k in range(5)]
    W, WY, C = (np.array(part) for part in zip(*[pool_rows(row_cell, cells.size, y, wk) for wk in ws]))
    fits = fit_two_stage_many(cells, W, WY, C, clip=(0, 1))
    for j, wk in enumerate(ws):
        slow = SlowTwoStage().fit(s, y, X, wk)
        np.testing.assert_allclose(fits.Z[j][row_cell], slow.index(s, X), rtol=0, atol=LOGIT_INDEX_TOL)


@pytest.mark.parametrize("seed", range(20))
def test_stacked_active_set_is_nnls(seed):
    """The batched active set solves min ||A theta - t|| with theta[:r] >= 0 exactly as scipy's NNLS
    (sign-free columns split into +/- pairs), whatever set it starts from; random problems with
    negative unconstrained solutions so that several rounds are needed. Conditioning < 1e3, so
    the two solvers agree to ~1e-12; rtol 1e-8."""
    from cje_engine.calibration.two_stage_batch import _ramp_lsq_stack

    rng = np.random.default_rng(seed)
    N, n, r, q = 8, 60, 5, 2
    A = rng.normal(size=(N, n, r + q))
    t = rng.normal(size=(N, n)) + A[:, :, :r] @ rng.normal(0, 1, r)  # some ramps want to be negative
    G, b = np.einsum("jnp,jnq->jpq", A, A), np.einsum("jnp,jn->jp", A, t)
    for free in (None, rng.uniform(size=r) < 0.5):
        theta, done = _ramp_lsq_stack(G, b, r, free)
        assert done.all()
        for i in range(N):
            coef, _ = nnls(np.hstack([A[i, :, :r], A[i, :, r:], -A[i, :, r:]]), t[i], maxiter=2000)
            ref = np.concatenate([coef[:r], coef[r:r + q] - coef[r + q:]])
            np.testing.assert_allclose(theta[i], ref, rtol=1e-8, atol=1e-10)


def test_stacked_active_set_refuses_singular_systems():
    """A rank-deficient system is left undone (the caller falls back to NNLS); the others settle."""
    from cje_engine.calibration.two_stage_batch import _ramp_lsq_stack

    rng = np.random.default_rng(0)
    A = rng.normal(size=(3, 40, 4))
    A[1, :, 3] = A[1, :, 2]  # two equal columns
    t = rng.normal(size=(3, 40))
    theta, done = _ramp_lsq_stack(np.einsum("jnp,jnq->jpq", A, A), np.einsum("jnp,jn->jp", A, t), 2)
    assert done.tolist() == [True, False, True]


def test_isotonic_segments_equal_one_fit_per_segment():
    from cje_engine.calibration.isotonic import isotonic_pooled, isotonic_pooled_segments

    rng = np.random.default_rng(3)
    sw = rng.uniform(0.5, 2, 30)
    swy = sw * rng.uniform(0, 1, 30)
    bounds = [(0, 9), (9, 10), (12, 30)]  # 10-11 lie outside every segment (e.g. empty cells)
    sw[10:12] = 0
    for (a, b), got in zip(bounds, isotonic_pooled_segments(sw, swy, bounds)):
        np.testing.assert_array_equal(got, isotonic_pooled(sw[a:b], swy[a:b]))


@pytest.mark.parametrize("n_prompts", [150, 40])
def test_batched_two_stage_replicates_are_the_bits_of_one_at_a_time(n_prompts):
    """`bootstrap_replicates` refits up to REPLICATE_BATCH replicates' cross-fits in one
    `fit_two_stage_many` call; every fit's arithmetic is row-wise (einsum, batched LAPACK, per-fit
    masks and step lengths), so each replicate is the same bits as `replicate_view` fitting it
    alone, whatever the batch holds (here fits of two or three knot counts and up to ~80 distinct
    knot vectors in one batch). A resample without calibration prompts is all NaN in the batch
    too, without disturbing its neighbours."""
    from cje_engine.direct.estimators import REPLICATE_BATCH, _replicates, bootstrap_replicates, bootstrap_view

    data = EvalData.from_frame(_sim_frame(3, n_prompts), covariates=["len"])
    view = bootstrap_view(make_design(data, "two_stage", ("p0",)), seed=5)
    B = 2 * REPLICATE_BATCH + 7  # two full batches and a short one
    K2 = 2 * view.n_policies
    batched = bootstrap_replicates(view, 0, B)
    alone = np.array([replicate_view(view, bootstrap_weights(5, b, data.n_prompts)) for b in range(B)])
    assert np.isfinite(alone).all()
    assert np.array_equal(batched[:, :K2], alone)
    assert np.array_equal(bootstrap_replicates(view, 3, 40)[:, :K2], alone[3:40])  # batches cut elsewhere
    empty = np.ones(data.n_prompts)
    empty[view.cal_prompt] = 0.0  # no calibration prompt drawn
    both = _replicates(view, [bootstrap_weights(5, 0, data.n_prompts), empty, bootstrap_weights(5, 1, data.n_prompts)])
    assert np.isnan(both[1]).all()
    assert np.array_equal(both[[0, 2]], alone[:2])


@pytest.mark.parametrize("p", [0, 1, 2])
def test_score_level_gram_equals_the_cell_level_products(p):
    """The logit stage's Gram matrices, gradients and indices come from per-score sums (the ramps
    depend on the score only): they equal ``F' diag(v) F``, ``F' r`` and ``F theta`` computed on the
    cells' full design matrix. Only the order of the sums differs: rtol 1e-12 (sums of a few hundred
    positive terms of similar size; float64 rounding ~1e-16 each)."""
    from cje_engine.calibration.calibrators import ramp_basis, make_cells
    from cje_engine.calibration.logit_stack import _apply, _gram, _parts, triangle_index
    from cje_engine.calibration.two_stage_batch import _levels, _score_design

    rng = np.random.default_rng(p)
    n = 600
    s = rng.integers(0, 15, n) / 14
    X = rng.integers(1, 40, (n, p)).astype(float)
    cells, _ = make_cells(s, X if p else None)
    Xt = np.log1p(cells.X)
    knots = np.array([0.0, 0.2, 0.5, 0.8, 1.0])
    F = np.hstack([ramp_basis(cells.score, knots), Xt, np.ones((cells.size, 1))])
    P = F.shape[1]
    levels = _levels(cells, Xt, True)
    design = _score_design(cells, Xt, knots, True)
    parts = _parts([design], np.array([4]))
    v, r = rng.uniform(0, 1, (4, cells.size)), rng.normal(0, 1, (4, cells.size))
    theta = rng.normal(0, 1, (4, P))
    h, b = _gram(parts, levels, v, r, P)
    iu0, iu1, _ = triangle_index(P)
    np.testing.assert_allclose(h, np.einsum("jg,gp,gq->jpq", v, F, F)[:, iu0, iu1], rtol=1e-12)
    np.testing.assert_allclose(b, r @ F, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_apply(parts, levels, theta, cells.size), theta @ F.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(design[3], np.abs(F).max(0))  # the step bound's largest |F| per column


@pytest.mark.parametrize("b", range(3))
def test_two_stage_with_few_labels_threads_its_knot_count_through_fits_and_replicates(b):
    """12 calibration labels with one covariate: `make_design` gives the two-stage index
    ``two_stage_knots(12, 1) = 4`` segments, and the cross-fit, the fold jackknife's models and every
    bootstrap replicate use that count: the replicate equals the row-level reference refitted with
    ``n_knots=4`` (and not the six-segment one)."""
    frame = _sim_frame(11, n_prompts=60)
    p0_lab = frame.index[(frame["policy"] == "p0") & frame["oracle_label"].notna()]
    frame.loc[p0_lab[12:], "oracle_label"] = np.nan  # 12 labels on the calibration policy
    data = EvalData.from_frame(frame, covariates=["len"])
    design = make_design(data, "two_stage", ("p0",))
    cr = design.cal_rows
    assert cr.size == 12 and design.n_knots == two_stage_knots(12, 1) == 4
    assert calibration_plan(design).n_knots == 4
    _, full, _ = cross_fit_models(design)
    assert full.n_knots == 4 and full.knots_.size <= 5
    pw = bootstrap_weights(b, b, data.n_prompts)
    w = pw[data.prompt]
    s, y, X, wc, fold = data.score[cr], data.label[cr], data.X[cr], w[cr], data.fold[cr]

    def slow(n_knots):
        f = SlowTwoStage().fit(s, y, X, wc, n_knots=n_knots).predict(data.score, data.X)
        for k in range(data.n_folds):
            held = fold == k
            if (wc[held] > 0).any() and (wc[~held] > 0).any():
                f[cr[held]] = SlowTwoStage().fit(s, y, X, np.where(held, 0, wc),
                                                 n_knots=n_knots).predict(s[held], X[held])
        return _slow_stats(data, cr, f, w)

    fast = replicate(design, pw)
    np.testing.assert_allclose(fast, slow(4), rtol=0, atol=LOGIT_INDEX_TOL)
    assert np.nanmax(np.abs(fast - slow(6))) > 10 * LOGIT_INDEX_TOL  # the count matters here


def test_a_diverging_logit_fit_gets_the_constant_index(monkeypatch):
    """A fit whose Newton system has no finite solution (NaN coefficients) is given the constant
    index, as a fit without labels is: its calibration is then the mean of its labels everywhere."""
    from cje_engine.calibration import two_stage_batch

    cells, W, WY, C = _fold_sums_of(0)
    real = two_stage_batch.newton_stack

    def diverging(*args, **kwargs):
        theta = real(*args, **kwargs)
        theta[2] = np.nan
        return theta

    monkeypatch.setattr(two_stage_batch, "newton_stack", diverging)
    fits = two_stage_batch.fit_two_stage_many(cells, W, WY, C, clip=(0, 1), link="logit")
    preds = [fits.predict_cells(j, cells) for j in range(W.shape[0])]  # the stack is in knot-group order
    flat = [j for j, p in enumerate(preds) if np.ptp(p) == 0]
    assert len(flat) == 1, flat  # the diverged fit, and only it
    j = flat[0]
    np.testing.assert_allclose(preds[j], WY[j].sum() / W[j].sum(), rtol=1e-12)
    assert all(np.isfinite(p).all() for p in preds)


def test_the_protocol_cell_with_singular_bootstrap_folds_runs_without_warnings():
    """n=250, 5% of base labelled, dataset 6 of benchmarks/bench_protocol.py: one cross-fit fold of one
    bootstrap replicate has 3 labelled rows for 3 coefficients and its Newton solve is singular. Before
    the constant-index fallback it raised RuntimeWarnings (the isotonic stage then pooled the NaN index
    into the same constant); now it runs clean and every estimate is finite."""
    import warnings

    from cje_engine import evaluate
    from cje_engine.simulate.direct import protocol_policies, simulate

    seed = 7_000_000_000 + (50 * 100_000 + 250) * 1_000 + 6
    sim = simulate(250, protocol_policies(), oracle_fraction=0.05, label_design="calibration_policy",
                   calibration_policy="base", audit_labels=50, seed=seed, judge_noise_sd=0.0, judge_levels=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = evaluate(sim.frame, covariates=["response_length"], calibration_policies=["base"], n_bootstrap=1000,
                       seed=seed % 2**31).to_dict()
    assert all(np.isfinite(p["se"]) for p in res["policies"].values() if p["se"] is not None)


@pytest.mark.parametrize("cal_pols", [None, ("p0",)])
def test_one_pass_replicates_are_replicate_view_and_own_label_means(cal_pols):
    """`bootstrap_replicates` computes each replicate's statistics and own-label means in one pass (the labelled
    rows' weights and per-policy totals once; with no calibration policies the labelled rows are the calibration
    rows, read once): the same bits as the two obvious calls, `replicate_view` then `own_label_means`, under
    weights drawn there, given as integer counts (a compact view's, `sharded.replicate_refits`) and with the
    histograms given; a resample without any calibration prompt gives NaN statistics and the own-label means of
    the labelled rows it still weights."""
    from cje_engine.direct.estimators import (_labelled_are_calibration, bootstrap_counts, bootstrap_replicates,
                                              bootstrap_view, compact_view, own_label_means)

    data = EvalData.from_frame(_sim_frame(4), covariates=["len"])
    view = bootstrap_view(make_design(data, "monotone", cal_pols), seed=3)
    assert _labelled_are_calibration(view) == (cal_pols is None)
    B, K, G = 12, view.n_policies, view.calibration.cells.size
    counts = np.stack([bootstrap_counts(3, b, data.n_prompts) for b in range(B)])
    counts[5] = 1
    counts[5, view.cal_prompt] = 0  # no calibration prompt in this resample
    weights = counts.astype(float)
    obvious = np.array([np.concatenate([replicate_view(view, w), own_label_means(view, w)]) for w in weights])
    assert np.isnan(obvious[5, :2 * K]).all()
    # own-label means from the labelled rows off the calibration prompts: p1's and p2's with p0 calibrating, none
    # without calibration policies
    assert np.isfinite(obvious[5, 2 * K:]).tolist() == ([False, True, True] if cal_pols else [False] * 3)
    assert np.isfinite(np.delete(obvious, 5, axis=0)).all()
    drawn = bootstrap_replicates(view, 0, B)
    assert np.array_equal(np.delete(drawn, 5, axis=0), np.delete(obvious, 5, axis=0))
    assert np.array_equal(bootstrap_replicates(view, 0, B, weights=counts), obvious, equal_nan=True)
    hist = np.stack([np.bincount(view.row_key, weights=w[view.row_prompt], minlength=K * G) for w in weights])
    small, prompts = compact_view(view)
    assert np.array_equal(bootstrap_replicates(small, 0, B, hist.astype(np.int64), weights=counts[:, prompts]),
                          obvious, equal_nan=True)
