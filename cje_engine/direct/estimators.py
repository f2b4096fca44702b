"""Direct estimators: cross-fitted calibration, plug-in and augmented values, influence terms.

Everything here is a pure function of an `EvalData` design and (for bootstrap replicates)
a vector of prompt weights: a replicate is the point estimate under resampled prompt
weights, with the calibrator refitted.

Cost. The calibrators depend on the rows only through per-cell sums (a cell is a distinct
calibration input: the judge score, or (score, covariates) in two-stage mode; see
`cje_engine.calibration.calibrators.Cells`), and every policy statistic is a sum over cells of
the calibrated value times a weight total. So `make_design` codes every row's cell once, and a
replicate does three things: (1) per-(fold, cell) sums of the calibration rows' weights and
labels (O(labels)), (2) the refits on those sums (O(cells), warm-started from the full fit),
(3) one weighted histogram of the rows over (policy, cell) (O(rows), a single ``bincount``);
it never predicts row by row. Same numbers as refitting on the rows (tests pin it to 1e-10).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cje_engine.calibration.calibrators import Cells, TwoStageCalibrator, make_calibrator, make_cells
from cje_engine.data.frame import EvalData
from cje_engine.errors import CJEInputError


@dataclass(frozen=True)
class CellIndex:
    """Every row's calibration cell, and the calibration rows' view of them."""

    cells: Cells  # distinct calibration inputs over all rows, shape (G,)
    row_cell: np.ndarray  # (n,) cell of every row
    row_key: np.ndarray  # (n,) policy * G + cell: the key of the weighted histogram
    cal_cells: Cells  # the cells that hold calibration rows, shape (Gc,)
    cal_global: np.ndarray  # (Gc,) index of each calibration cell in ``cells``
    cal_cell: np.ndarray  # (m,) calibration cell of every calibration row
    cal_key: np.ndarray  # (m,) fold * Gc + calibration cell
    counts: np.ndarray  # (K_policies, G) rows per (policy, cell)


@dataclass(frozen=True)
class Design:
    """What a fit needs beyond the data: the calibration rows, mode and label bounds."""

    data: EvalData
    mode: str
    cal_rows: np.ndarray  # row indices that train the calibrator
    lab_rows: np.ndarray  # all labelled row indices (any policy)
    cells: CellIndex | None = None

    @property
    def n_policies(self) -> int:
        return len(self.data.policies)

    @property
    def cal_fold(self) -> np.ndarray:
        return self.data.fold[self.cal_rows]


def _cell_index(data: EvalData, mode: str, cal: np.ndarray) -> CellIndex:
    X = data.X if mode == "two_stage" else None
    cells, row_cell = make_cells(data.score, X)
    G = cells.size
    K = len(data.policies)
    small = np.int32 if K * G < 2**31 else np.int64  # 4 bytes a row where it fits
    row_cell = row_cell.astype(small)
    row_key = data.policy.astype(small) * small(G) + row_cell
    counts = np.bincount(row_key, minlength=K * G).reshape(K, G).astype(float)
    cal_global, cal_cell = np.unique(row_cell[cal], return_inverse=True)
    cal_cells = Cells(cells.score[cal_global], cells.X[cal_global],
                      *np.unique(cells.score[cal_global], return_inverse=True))
    cal_key = data.fold[cal] * cal_global.size + cal_cell
    return CellIndex(cells, row_cell, row_key, cal_cells, cal_global, cal_cell.astype(np.int64), cal_key, counts)


def make_design(data: EvalData, mode: str, calibration_policies: tuple[str, ...] | None) -> Design:
    """Select the calibration rows, check there is enough to cross-fit, and code the cells."""
    lab = np.flatnonzero(data.labelled)
    if calibration_policies is None:
        cal = lab
    else:
        unknown = [p for p in calibration_policies if p not in data.policies]
        if unknown:
            raise CJEInputError(
                f"calibration policy {unknown[0]!r} has no rows (policies: {', '.join(data.policies)})",
                column="policy", option="calibration_policies",
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
    y, s = data.label[cal], data.score[cal]
    for k in range(data.n_folds):
        train = folds != k
        if not train.any() or np.ptp(y[train]) == 0 or np.ptp(s[train]) == 0:
            raise CJEInputError(
                f"too few labelled prompts to cross-fit: without fold {k} the calibration rows have fewer than "
                f"two distinct labels or scores ({cal.size} calibration labels in all)",
                column="oracle_label",
            )
    return Design(data=data, mode=mode, cal_rows=cal, lab_rows=lab, cells=_cell_index(data, mode, cal))


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


def _cell_fits(design: Design, wc: np.ndarray, warm=None):
    """Full and per-fold fits from per-(fold, cell) sums of calibration-row weights ``wc``.

    Returns the full model's prediction at every cell (G,), the out-of-fold prediction of every
    calibration row (m,), the full model and the fold models (None: empty complement).
    """
    d, ci = design.data, design.cells
    K, Gc = d.n_folds, ci.cal_cells.size
    y = d.label[design.cal_rows]
    W = np.bincount(ci.cal_key, weights=wc, minlength=K * Gc).reshape(K, Gc)
    WY = np.bincount(ci.cal_key, weights=wc * y, minlength=K * Gc).reshape(K, Gc)
    C = np.bincount(ci.cal_key, weights=wc > 0, minlength=K * Gc).reshape(K, Gc)
    w_all, wy_all, c_all = W.sum(0), WY.sum(0), C.sum(0)
    clip = d.label_scale
    folds = design.cal_fold
    if design.mode == "two_stage":
        # all six fits at once (shared design matrix and normal equations where knots agree)
        comp = np.vstack([w_all[None], w_all - W]), np.vstack([wy_all[None], wy_all - WY]), \
            np.vstack([c_all[None], c_all - C])
        fitted = TwoStageCalibrator.fit_many(ci.cal_cells, *comp, clip=clip)
        full = fitted[0]
        fold_models = [m if C[k].sum() > 0 else None for k, m in enumerate(fitted[1:])]
    else:
        full = make_calibrator(design.mode, clip).fit_cells(ci.cal_cells, w_all, wy_all, c_all, warm)
        fold_models = [None if C[k].sum() == 0 or not (c_all - C[k]).any() else
                       make_calibrator(design.mode, clip).fit_cells(ci.cal_cells, w_all - W[k], wy_all - WY[k],
                                                                    c_all - C[k], full)
                       for k in range(K)]
    F_all = full.predict_cells(ci.cells)
    f_cal = F_all[ci.cal_global][ci.cal_cell]
    models = []
    for k, model in enumerate(fold_models):
        if model is None:
            models.append(None)  # (bootstrap only) an empty fold or complement keeps the full fit
            continue
        held, cells_k, pos_k = _fold_cells(design, k)
        f_cal[held] = model.predict_cells(cells_k)[pos_k]  # predicted only where fold k has rows
        models.append(model)
    return F_all, f_cal, full, models


def _fold_cells(design: Design, k: int) -> tuple[np.ndarray, Cells, np.ndarray]:
    """Calibration rows of fold k, the cells they occupy, and each row's index into those (cached)."""
    cache = design.__dict__.setdefault("_fold_cache", {})
    if k not in cache:
        ci = design.cells
        held = np.flatnonzero(design.cal_fold == k)
        used, pos = np.unique(ci.cal_cell[held], return_inverse=True)
        cells = ci.cal_cells
        cache[k] = (held, Cells(cells.score[used], cells.X[used], cells.score_values, cells.score_code[used]), pos)
    return cache[k]


def cross_fit_models(design: Design, row_w: np.ndarray | None = None):
    """`cross_fit`, also returning the per-fold models (``None`` for a fold that kept the full fit)."""
    cr = design.cal_rows
    wc = np.ones(cr.size) if row_w is None else row_w[cr]
    F_all, f_cal, full, models = _cell_fits(design, wc)
    f = F_all[design.cells.row_cell]
    f[cr] = f_cal
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


def _replicate_plan(design: Design) -> dict:
    """Index arrays a replicate reuses (cached on the design; built on first use)."""
    plan = design.__dict__.get("_plan")
    if plan is None:
        d, ci = design.data, design.cells
        lab, cr = design.lab_rows, design.cal_rows
        pos = np.full(d.n_rows, -1, dtype=np.int64)
        pos[cr] = np.arange(cr.size)
        lab_cal = pos[lab]
        plan = {
            "cal_prompt": d.prompt[cr], "lab_prompt": d.prompt[lab], "lab_policy": d.policy[lab],
            "lab_cell": ci.row_cell[lab], "lab_is_cal": lab_cal >= 0, "lab_cal": lab_cal[lab_cal >= 0],
            "lab_y": d.label[lab], "lab_lw": d.label_weight[lab],
            "cal_policy": d.policy[cr], "cal_cell_global": ci.row_cell[cr],
        }
        object.__setattr__(design, "_plan", plan)  # frozen dataclass: a private cache
    return plan


def replicate(design: Design, prompt_w: np.ndarray | None = None) -> np.ndarray:
    """Refit the calibration under prompt weights and return ``policy_stats``.

    Works on cells: per-(fold, cell) sums of the calibration rows, refits from them, and one
    weighted histogram of all rows over (policy, cell); equal to
    ``policy_stats(design, *cross_fit(design, row_w), row_w)`` with ``row_w = prompt_w[prompt]``.
    """
    d, ci = design.data, design.cells
    if prompt_w is None:
        f, _ = cross_fit(design)
        return policy_stats(design, f)
    plan = _replicate_plan(design)
    K, G = design.n_policies, ci.cells.size
    wc = prompt_w[plan["cal_prompt"]]
    F_all, f_cal, _, _ = _cell_fits(design, wc)
    # Every row at the full fit's value, then the calibration rows corrected to out of fold.
    T = np.bincount(ci.row_key, weights=prompt_w[d.prompt], minlength=K * G).reshape(K, G)
    n_k = T.sum(1)
    num = T @ F_all + np.bincount(plan["cal_policy"], weights=wc * (f_cal - F_all[plan["cal_cell_global"]]),
                                  minlength=K)
    f_lab = F_all[plan["lab_cell"]]
    f_lab[plan["lab_is_cal"]] = f_cal[plan["lab_cal"]]
    lw = prompt_w[plan["lab_prompt"]] * plan["lab_lw"]
    with np.errstate(invalid="ignore", divide="ignore"):
        plug = num / n_k
        den = np.bincount(plan["lab_policy"], weights=lw, minlength=K)
        corr = np.bincount(plan["lab_policy"], weights=lw * (plan["lab_y"] - f_lab), minlength=K) / den
    return np.concatenate([plug, plug + corr])


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

    Returns a dict with ``total`` (n_prompts, 2K) -- the column order of `policy_stats` --,
    ``calibration`` (n_prompts, 2K), the part due to estimating the calibrator (plug-in
    columns) or to the label residuals (augmented columns), and ``audit`` (n_prompts, K), the
    influence of each policy's mean label residual (augmented - plug-in) including the
    calibrator's estimation error on its audit slice (`calibration_term`). Summed per prompt,
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

    # Evaluation terms (same for plug-in and augmented): one pass over the rows.
    eval_contrib = (f - plug[d.policy]) / n_k[d.policy]
    key = d.prompt.astype(np.int64) * K
    key += d.policy
    total[:, :K] = np.bincount(key, weights=eval_contrib, minlength=n_p * K).reshape(n_p, K)
    del key, eval_contrib
    total[:, K:] = total[:, :K]

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

    # Plug-in: the calibration term over level sets of the full fit, weighted by every row of the
    # policy; the audit's calibration term: the same, weighted by the policy's labelled rows.
    cells, counts = design.cells.cells, design.cells.counts
    term = calibration_term(design, full, counts / n_k[:, None])
    total[:, :K] += term
    cal[:, :K] = term
    G = cells.size
    lab_key = d.policy[lab].astype(np.int64) * G + design.cells.row_cell[lab]
    lab_counts = np.bincount(lab_key, weights=lw, minlength=K * G).reshape(K, G)
    with np.errstate(invalid="ignore", divide="ignore"):
        lab_share = np.where(den[:, None] > 0, lab_counts / den[:, None], 0.0)
    audit = cal[:, K:] - calibration_term(design, full, lab_share)
    audit[:, den <= 0] = np.nan
    return {"total": total, "calibration": cal, "audit": audit}


def calibration_term(design: Design, full, share: np.ndarray) -> np.ndarray:
    """Per-prompt first-order effect of estimating the calibrator on ``sum_c share[k, c] f(c)``.

    ``share`` (K', G) weights the cells (rows of a policy per cell over the policy's rows: its
    plug-in; labelled rows' label weights over their total: the mean calibrated value on its audit
    slice). For an isotonic fit on level sets, a calibration row ``j`` contributes
    ``rho_k(block_j) (y_j - f(z_j)) / m``, with ``rho_k`` the weighted share of the cells in a level
    set over the calibration rows' share of it (linear interpolation between level sets splits a cell
    between them). Returns (n_prompts, K').
    """
    d = design.data
    n_p = d.n_prompts
    cr = design.cal_rows
    block_of_x, n_blocks = _level_sets(full)
    ux = full.x_
    z_cal = full.index(d.score[cr], d.X[cr])
    pos = np.clip(np.searchsorted(ux, z_cal), 0, ux.size - 1)
    b_cal = block_of_x[pos]
    m = cr.size
    q = np.bincount(b_cal, minlength=n_blocks) / m
    resid_cal = d.label[cr] - np.interp(z_cal, ux, full.y_)
    # Each row's share of the level sets depends only on its cell.
    cells = design.cells.cells
    z_all = full.index(cells.score, cells.X)
    j = np.clip(np.searchsorted(ux, z_all, side="right") - 1, 0, ux.size - 1)
    j1 = np.minimum(j + 1, ux.size - 1)
    gap = ux[j1] - ux[j]
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(gap > 0, np.clip((z_all - ux[j]) / gap, 0.0, 1.0), 0.0)
    bj, bj1 = block_of_x[j], block_of_x[j1]
    out = np.zeros((n_p, share.shape[0]))
    for k in range(share.shape[0]):
        p_k = (np.bincount(bj, weights=share[k] * (1 - t), minlength=n_blocks)
               + np.bincount(bj1, weights=share[k] * t, minlength=n_blocks))
        with np.errstate(invalid="ignore", divide="ignore"):
            rho = np.where(q > 0, p_k / q, 0.0)
        out[:, k] = np.bincount(d.prompt[cr], weights=rho[b_cal] * resid_cal / m, minlength=n_p)
    return out


def fold_jackknife(design: Design, models: list | None = None) -> np.ndarray:
    """Delete-one-fold jackknife variance of the plug-in values (calibration variance only).

    Each fold's calibration rows are removed, the calibrator is refitted on the rest (or the
    fold models of `cross_fit_models` are reused: they are exactly these fits) and the
    plug-in recomputed over all rows; Var = (K-1)/K * sum_k (theta_-k - mean)^2.
    """
    d = design.data
    cr = design.cal_rows
    folds = design.cal_fold
    counts = design.cells.counts
    n_k = counts.sum(1)
    thetas = []
    for k in range(d.n_folds):
        model = models[k] if models is not None and models[k] is not None else None
        if model is None:
            keep = folds != k
            model = make_calibrator(design.mode, d.label_scale).fit(
                d.score[cr[keep]], d.label[cr[keep]], d.X[cr[keep]], None
            )
        thetas.append(counts @ model.predict_cells(design.cells.cells) / n_k)
    th = np.array(thetas)
    return (d.n_folds - 1) / d.n_folds * ((th - th.mean(0)) ** 2).sum(0)
