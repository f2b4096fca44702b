"""Direct estimators: cross-fitted calibration, plug-in and augmented values, influence terms.

Everything here is a pure function of an `EvalData` design and (for bootstrap replicates)
a vector of prompt weights: a replicate is the point estimate under resampled prompt
weights, with the calibrator refitted. In monotone mode replicates take a shortcut through
per-(fold, score) sums (`_cross_fit_binned`), which gives the same values as `cross_fit`
(tested to 1e-12) at half the cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import isotonic_regression

from cje_engine.calibration.calibrators import make_calibrator
from cje_engine.data.frame import EvalData
from cje_engine.errors import CJEInputError


@dataclass(frozen=True)
class ScoreBins:
    """Distinct judge scores and each row's index into them (monotone mode's sufficient statistics)."""

    values: np.ndarray  # sorted distinct scores over all rows, shape (D,)
    row_code: np.ndarray  # index into ``values`` for every row
    cal_key: np.ndarray  # fold * D + code for every calibration row


@dataclass(frozen=True)
class Design:
    """What a fit needs beyond the data: the calibration rows, mode and label bounds."""

    data: EvalData
    mode: str
    cal_rows: np.ndarray  # row indices that train the calibrator
    lab_rows: np.ndarray  # all labelled row indices (any policy)
    bins: ScoreBins | None = None  # set in monotone mode

    @property
    def n_policies(self) -> int:
        return len(self.data.policies)

    @property
    def cal_fold(self) -> np.ndarray:
        return self.data.fold[self.cal_rows]


def make_design(data: EvalData, mode: str, calibration_policies: tuple[str, ...] | None) -> Design:
    """Select the calibration rows and check there is enough to cross-fit."""
    lab = np.flatnonzero(data.labelled)
    if calibration_policies is None:
        cal = lab
    else:
        unknown = [p for p in calibration_policies if p not in data.policies]
        if unknown:
            raise CJEInputError(
                f"calibration policy {unknown[0]!r} has no rows (policies: {', '.join(data.policies)})",
                column="policy",
            )
        codes = [data.policies.index(p) for p in calibration_policies]
        cal = lab[np.isin(data.policy[lab], codes)]
    if cal.size == 0:
        raise CJEInputError(
            "no labelled rows to calibrate on"
            + ("" if calibration_policies is None else f" in calibration policies {list(calibration_policies)}"),
            column="oracle_label",
        )
    folds = data.fold[cal]
    for k in range(data.n_folds):
        train = cal[folds != k]
        if train.size == 0 or np.unique(data.label[train]).size < 2 or np.unique(data.score[train]).size < 2:
            raise CJEInputError(
                f"too few labelled prompts to cross-fit: without fold {k} the calibration rows have fewer than "
                f"two distinct labels or scores ({cal.size} calibration labels in all)",
                column="oracle_label",
            )
    bins = None
    if mode == "monotone":
        values, code = np.unique(data.score, return_inverse=True)
        bins = ScoreBins(values, code, data.fold[cal] * values.size + code[cal])
    return Design(data=data, mode=mode, cal_rows=cal, lab_rows=lab, bins=bins)


def cross_fit(design: Design, row_w: np.ndarray | None = None):
    """Fit the calibrator on all calibration rows and on each fold's complement.

    Returns
    -------
    f : ndarray, shape (n_rows,)
        Calibrated value of every row: out-of-fold for calibration rows, the full-data
        fit for all other rows.
    full : fitted calibrator on all calibration rows.
    """
    f, full, _ = cross_fit_models(design, row_w)
    return f, full


def cross_fit_models(design: Design, row_w: np.ndarray | None = None):
    """`cross_fit`, also returning the per-fold models (``None`` for a fold that kept the full fit)."""
    d = design.data
    cr = design.cal_rows
    wc = np.ones(cr.size) if row_w is None else row_w[cr]
    s, y, X = d.score[cr], d.label[cr], d.X[cr]
    clip = d.label_scale
    full = make_calibrator(design.mode, clip).fit(s, y, X, wc)
    f = full.predict(d.score, d.X)
    folds = design.cal_fold
    models = []
    for k in range(d.n_folds):
        held = folds == k
        wk = np.where(held, 0.0, wc)
        if not held.any() or wk.sum() <= 0:
            models.append(None)  # (bootstrap only) an empty complement keeps the full fit
            continue
        model = make_calibrator(design.mode, clip).fit(s, y, X, wk)
        rows = cr[held]
        f[rows] = model.predict(d.score[rows], d.X[rows])
        models.append(model)
    return f, full, models


def policy_stats(design: Design, f: np.ndarray, row_w: np.ndarray | None = None) -> np.ndarray:
    """Plug-in and augmented value of every policy under row weights.

    Returns an array of length 2K: ``[plug_in_0..K-1, augmented_0..K-1]``; the augmented
    value is NaN for a policy without (positively weighted) labels. The residual
    correction is a Hajek mean weighted by ``label_weight`` (1 / P(labelled)).
    """
    d = design.data
    K = design.n_policies
    w = np.ones(d.n_rows) if row_w is None else row_w
    n_k = np.bincount(d.policy, weights=w, minlength=K)
    with np.errstate(invalid="ignore", divide="ignore"):
        plug = np.bincount(d.policy, weights=w * f, minlength=K) / n_k
        lab = design.lab_rows
        lw = w[lab] * d.label_weight[lab]
        r = d.label[lab] - f[lab]
        den = np.bincount(d.policy[lab], weights=lw, minlength=K)
        corr = np.bincount(d.policy[lab], weights=lw * r, minlength=K) / den
    return np.concatenate([plug, plug + corr])


def replicate(design: Design, prompt_w: np.ndarray | None = None) -> np.ndarray:
    """Refit the calibration under prompt weights and return ``policy_stats``."""
    row_w = None if prompt_w is None else prompt_w[design.data.prompt]
    if design.bins is not None and row_w is not None:
        f = _cross_fit_binned(design, row_w)
    else:
        f, _ = cross_fit(design, row_w)
    return policy_stats(design, f, row_w)


def _fit_bins(w: np.ndarray, wy: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Isotonic fit on per-score weight sums, evaluated at every distinct score."""
    keep = w > 0
    fitted = isotonic_regression(wy[keep] / w[keep], weights=w[keep], increasing=True).x
    return np.interp(values, values[keep], fitted)


def _cross_fit_binned(design: Design, row_w: np.ndarray) -> np.ndarray:
    """`cross_fit` for monotone mode from per-(fold, score) sums: same values, no per-row sorting.

    Isotonic regression on tie-pooled scores depends on the data only through the weight and
    weighted label sum at each distinct score, so each fold's fit needs D numbers, not m rows.
    """
    d, b = design.data, design.bins
    D, K = b.values.size, d.n_folds
    cr = design.cal_rows
    wc = row_w[cr]
    W = np.bincount(b.cal_key, weights=wc, minlength=K * D).reshape(K, D)
    WY = np.bincount(b.cal_key, weights=wc * d.label[cr], minlength=K * D).reshape(K, D)
    w_all, wy_all = W.sum(0), WY.sum(0)
    full = _fit_bins(w_all, wy_all, b.values)
    f = full[b.row_code]
    folds = d.fold[cr]
    for k in range(K):
        w_k = w_all - W[k]
        held = folds == k
        if not held.any() or w_k.sum() <= 0:
            continue
        f[cr[held]] = _fit_bins(w_k, wy_all - WY[k], b.values)[b.row_code[cr[held]]]
    lo, hi = d.label_scale
    return np.clip(f, lo, hi)


def bootstrap_weights(seed: int, b: int, n_prompts: int) -> np.ndarray:
    """Prompt multiplicities of bootstrap replicate ``b`` (depends only on ``seed`` and ``b``)."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(b,)))
    return np.bincount(rng.integers(0, n_prompts, n_prompts), minlength=n_prompts).astype(float)


def _level_sets(full) -> tuple[np.ndarray, int]:
    """Block id of each fitted point of an isotonic fit (consecutive equal values pool)."""
    fy = full.y_
    scale = max(1.0, float(np.max(np.abs(fy))))
    jumps = np.abs(np.diff(fy)) > 1e-12 * scale
    block = np.concatenate([[0], np.cumsum(jumps)])
    return block, int(block[-1]) + 1


def influence(design: Design, f: np.ndarray, full) -> dict[str, np.ndarray]:
    """Per-prompt influence contributions of every policy statistic.

    Returns a dict with ``total`` (n_prompts, 2K) -- the column order of `policy_stats` --
    and ``calibration`` (n_prompts, 2K), the part due to estimating the calibrator
    (plug-in columns) or to the label residuals (augmented columns). Summed per prompt,
    so cross-policy and label/evaluation coupling on shared prompts is kept.

    Plug-in: eval term ``(f_i - theta_k) / n_k`` plus the isotonic calibration term
    ``rho_k(block_j) (y_j - f(z_j)) / m`` on calibration rows, where ``rho_k`` is the
    policy's share of rows in a level set of the fitted calibrator over the calibration
    rows' share (linear interpolation between level sets splits a row between them).
    Augmented: eval term plus ``lw_i (r_i - rbar_k) / sum(lw)`` on the policy's labels;
    the calibrator's own estimation error drops out at first order (orthogonality).
    """
    d = design.data
    K = design.n_policies
    n_p = d.n_prompts
    stats = policy_stats(design, f)
    plug, aug = stats[:K], stats[K:]
    n_k = np.bincount(d.policy, minlength=K).astype(float)
    total = np.zeros((n_p, 2 * K))
    cal = np.zeros((n_p, 2 * K))

    # Evaluation terms (same for plug-in and augmented).
    eval_contrib = (f - plug[d.policy]) / n_k[d.policy]
    for k in range(K):
        rows = d.policy == k
        col = np.bincount(d.prompt[rows], weights=eval_contrib[rows], minlength=n_p)
        total[:, k] += col
        total[:, K + k] += col

    # Augmented: label residual terms.
    lab = design.lab_rows
    lw = d.label_weight[lab]
    r = d.label[lab] - f[lab]
    den = np.bincount(d.policy[lab], weights=lw, minlength=K)
    for k in range(K):
        if den[k] <= 0:
            total[:, K + k] = np.nan
            cal[:, K + k] = np.nan
            continue
        sel = d.policy[lab] == k
        contrib = lw[sel] * (r[sel] - (aug[k] - plug[k])) / den[k]
        col = np.bincount(d.prompt[lab[sel]], weights=contrib, minlength=n_p)
        total[:, K + k] += col
        cal[:, K + k] = col

    # Plug-in: isotonic calibration term over level sets of the full fit.
    cr = design.cal_rows
    block_of_x, n_blocks = _level_sets(full)
    ux = full.x_
    z_cal = full.index(d.score[cr], d.X[cr])
    pos = np.clip(np.searchsorted(ux, z_cal), 0, ux.size - 1)
    b_cal = block_of_x[pos]
    m = cr.size
    q = np.bincount(b_cal, minlength=n_blocks) / m
    resid_cal = d.label[cr] - np.interp(z_cal, ux, full.y_)
    z_all = full.index(d.score, d.X)
    j = np.clip(np.searchsorted(ux, z_all, side="right") - 1, 0, ux.size - 1)
    j1 = np.minimum(j + 1, ux.size - 1)
    gap = ux[j1] - ux[j]
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(gap > 0, np.clip((z_all - ux[j]) / gap, 0.0, 1.0), 0.0)
    for k in range(K):
        rows = d.policy == k
        p_k = (np.bincount(block_of_x[j[rows]], weights=1 - t[rows], minlength=n_blocks)
               + np.bincount(block_of_x[j1[rows]], weights=t[rows], minlength=n_blocks)) / n_k[k]
        with np.errstate(invalid="ignore", divide="ignore"):
            rho = np.where(q > 0, p_k / q, 0.0)
        contrib = rho[b_cal] * resid_cal / m
        col = np.bincount(d.prompt[cr], weights=contrib, minlength=n_p)
        total[:, k] += col
        cal[:, k] = col
    return {"total": total, "calibration": cal}


def fold_jackknife(design: Design, models: list | None = None) -> np.ndarray:
    """Delete-one-fold jackknife variance of the plug-in values (calibration variance only).

    Each fold's calibration rows are removed, the calibrator is refitted on the rest (or the
    fold models of `cross_fit_models` are reused: they are exactly these fits) and the
    plug-in recomputed over all rows; Var = (K-1)/K * sum_k (theta_-k - mean)^2.
    """
    d = design.data
    K = design.n_policies
    cr = design.cal_rows
    folds = design.cal_fold
    n_k = np.bincount(d.policy, minlength=K)
    thetas = []
    for k in range(d.n_folds):
        model = models[k] if models is not None and models[k] is not None else None
        if model is None:
            keep = folds != k
            model = make_calibrator(design.mode, d.label_scale).fit(
                d.score[cr[keep]], d.label[cr[keep]], d.X[cr[keep]], None
            )
        f = model.predict(d.score, d.X)
        thetas.append(np.bincount(d.policy, weights=f, minlength=K) / n_k)
    th = np.array(thetas)
    return (d.n_folds - 1) / d.n_folds * ((th - th.mean(0)) ** 2).sum(0)
