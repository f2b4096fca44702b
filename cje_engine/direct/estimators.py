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

from dataclasses import dataclass, replace

import numpy as np

from cje_engine.calibration import registry
from cje_engine.calibration.calibrators import TWO_STAGE_MAX_KNOTS, Cells, clip_to, interp_flat, make_cells
from cje_engine.data.frame import EvalData
from cje_engine.data.ints import at_rows, small_unique_inverse
from cje_engine.errors import CJEInputError

#: Rows per chunk of the row passes that would otherwise allocate several row-sized temporaries.
_ROW_CHUNK = 1 << 20


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
    n_knots: int = TWO_STAGE_MAX_KNOTS  # an index's segments (the mode's `n_knots` of the labels)

    @property
    def entry(self) -> registry.CalibrationMode:
        """The registered calibration mode of this design."""
        return registry.get(self.mode)

    @property
    def n_policies(self) -> int:
        """Number of policies in the design."""
        return len(self.data.policies)

    def __getstate__(self) -> dict:
        # the private caches (calibration plan, bootstrap view) are rebuilt where they are needed
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    @property
    def cal_fold(self) -> np.ndarray:
        """Cross-fitting fold of each calibration row."""
        return at_rows(self.data.fold, self.cal_rows)


def row_cells(data: EvalData, mode: str) -> tuple:
    """The row-level part of a `CellIndex` (cells, row_cell, row_key, counts): it depends on the mode
    only, so designs of one mode with other calibration rows can share it (`make_design`)."""
    X = data.X if registry.get(mode).uses_covariates else None
    cells, row_cell = make_cells(data.score, X)
    G = cells.size
    K = len(data.policies)
    small = np.int32 if K * G < 2**31 else np.int64  # 4 bytes a row where it fits
    row_cell = row_cell.astype(small)
    row_key = data.policy.astype(small) * small(G) + row_cell
    counts = np.bincount(row_key, minlength=K * G).reshape(K, G).astype(float)
    return cells, row_cell, row_key, counts


def _cell_index(data: EvalData, mode: str, cal: np.ndarray, rows: tuple | None = None,
                folds: np.ndarray | None = None) -> CellIndex:
    """The design's `CellIndex`; ``folds``: the calibration rows' folds when the caller has them."""
    cells, row_cell, row_key, counts = rows if rows is not None else row_cells(data, mode)
    # the cells' codes are a small table: counted, not sorted (`numpy.unique`'s arrays)
    cal_global, cal_cell = small_unique_inverse(at_rows(row_cell, cal), cells.size)
    cal_cells = Cells(cells.score[cal_global], cells.X[cal_global],
                      *np.unique(cells.score[cal_global], return_inverse=True))
    cal_key = (at_rows(data.fold, cal) if folds is None else folds) * cal_global.size + cal_cell
    return CellIndex(cells, row_cell, row_key, cal_cells, cal_global, cal_cell.astype(np.int64, copy=False), cal_key,
                     counts)


def design_from_parts(data: EvalData, mode: str, cal_rows: np.ndarray, lab_rows: np.ndarray, rows: tuple,
                      n_knots: int) -> Design:
    """The `Design` `make_design` returned for ``data``, rebuilt from its parts: its calibration and labelled rows
    (already chosen and checked), `row_cells` of ``data`` in ``mode`` and its ``n_knots``; the same cell index,
    array for array (`cje_engine.pipeline.sharded.refit_view` rebuilds a design where its refits run)."""
    return Design(data=data, mode=mode, cal_rows=cal_rows, lab_rows=lab_rows,
                  cells=_cell_index(data, mode, cal_rows, rows), n_knots=n_knots)


def make_design(data: EvalData, mode: str, calibration_policies: tuple[str, ...] | None,
                rows: tuple | None = None) -> Design:
    """Select the calibration rows, check there is enough to cross-fit, and code the cells.

    ``rows``: `row_cells` of ``data`` in ``mode``, when already computed (saves a pass over the rows).
    """
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
        is_cal = np.zeros(len(data.policies), dtype=bool)  # a lookup a row: `numpy.isin`'s mask, without its sort
        is_cal[[data.policies.index(p) for p in calibration_policies]] = True
        cal = lab[is_cal[data.policy[lab]]]
    if cal.size == 0:
        raise CJEInputError(
            "no labelled rows to calibrate on"
            + ("" if calibration_policies is None else f" in calibration policies {list(calibration_policies)}"),
            column="oracle_label",
        )
    folds = at_rows(data.fold, cal)  # read only: the data's own arrays where every row calibrates
    y, s = at_rows(data.label, cal), at_rows(data.score, cal)
    spread = [_spread_without(folds, y, data.n_folds), _spread_without(folds, s, data.n_folds)]
    for k in range(data.n_folds):
        if spread[0][k] and spread[1][k]:
            continue  # both the smallest and the largest label and score are in the other folds
        train = folds != k
        if not train.any() or np.ptp(y[train]) == 0 or np.ptp(s[train]) == 0:
            raise CJEInputError(
                f"too few labelled prompts to cross-fit: without fold {k} the calibration rows have fewer than "
                f"two distinct labels or scores ({cal.size} calibration labels in all)",
                column="oracle_label",
            )
    entry = registry.get(mode)
    short = entry.shortfall(cal.size, data.X.shape[1])
    if short is not None:
        raise CJEInputError(short, column="oracle_label", option="calibration_mode")
    n_knots = entry.n_knots(cal.size, data.X.shape[1])
    return Design(data=data, mode=mode, cal_rows=cal, lab_rows=lab, cells=_cell_index(data, mode, cal, rows, folds),
                  n_knots=n_knots)


def _spread_without(folds: np.ndarray, v: np.ndarray, n_folds: int) -> np.ndarray:
    """Per fold k: whether the rows of the other folds surely hold two distinct values of ``v`` (both its
    smallest and its largest value, which differ). False means "not known" (the exact check then runs): one pass
    and two counts instead of K copies of the training rows."""
    if v.size == 0:
        return np.zeros(n_folds, dtype=bool)
    lo, hi = v.min(), v.max()
    if not lo < hi:  # one value, or NaN
        return np.zeros(n_folds, dtype=bool)
    n_lo = np.bincount(folds[v == lo], minlength=n_folds)
    n_hi = np.bincount(folds[v == hi], minlength=n_folds)
    return ((n_lo.sum() - n_lo) > 0) & ((n_hi.sum() - n_hi) > 0)


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


@dataclass(frozen=True)
class CalibrationPlan:
    """What a refit of the cross-fitted calibrator reads: O(labels + cells), no per-row arrays.

    Built once per design (`calibration_plan`); the refits of `cross_fit` and of every bootstrap
    replicate run on it (`cell_fits`), so both compute the same numbers the same way. A mode fitted one fit
    at a time reads ``fold_cells`` and not the calibration rows in fold order (``order``, ``z_index``,
    ``global_sorted``, ``cell_sorted``: None); a batched mode the reverse (``fold_cells`` empty): each plan
    holds only what its refits read (32 or 16 bytes a calibration row less).
    """

    mode: str
    n_folds: int
    label_scale: tuple[float, float] | None
    cells: Cells  # every cell (G): where the full fit is evaluated
    cal_cells: Cells  # the cells holding calibration rows (Gc)
    cal_global: np.ndarray  # (Gc,) each calibration cell's index in ``cells``
    cal_cell: np.ndarray  # (m,) calibration cell of every calibration row
    y: np.ndarray  # (m,) label of every calibration row
    cal_key: np.ndarray  # (m,) flat (fold, cell) key of the fold sums
    order: np.ndarray | None  # (m,) batched: calibration rows grouped by fold
    fold_bounds: tuple  # (K,) (start, stop) of each fold in ``order``
    z_index: np.ndarray | None  # (m,) batched, in ``order``: flat (fit = fold + 1, cell) index into the fits' index
    global_sorted: np.ndarray | None  # (m,) batched, in ``order``: each row's cell in ``cells``
    fold_cells: tuple  # (K,) one fit at a time: (rows of fold k, the cells they occupy, index into those); batched ()
    warm: dict | None  # batched: where the solver of every refit starts (`_warm_start`)
    n_knots: int = TWO_STAGE_MAX_KNOTS  # an index's segments (the design's)
    cell_sorted: np.ndarray | None = None  # (m,) batched, in ``order``: each row's calibration cell

    @property
    def entry(self) -> registry.CalibrationMode:
        """The registered calibration mode of this plan."""
        return registry.get(self.mode)


def calibration_plan(design: Design) -> CalibrationPlan:
    """The design's `CalibrationPlan` (cached on the design)."""
    plan = design.__dict__.get("_calibration_plan")
    if plan is None:
        d, ci = design.data, design.cells
        K, Gc = d.n_folds, ci.cal_cells.size
        folds = design.cal_fold
        size = np.bincount(folds, minlength=K)
        ends = np.cumsum(size)
        batched = registry.get(design.mode).batched
        fold_cells = []
        for k in range(0 if batched else K):  # a mode fitted one fit at a time predicts each fold at its cells
            held = np.flatnonzero(folds == k)
            used, pos = small_unique_inverse(ci.cal_cell[held], Gc)
            c = ci.cal_cells
            fold_cells.append((held, Cells(c.score[used], c.X[used], c.score_values, c.score_code[used]), pos))
        order = np.argsort(folds, kind="stable") if batched else None  # batched: out of fold in fold order
        plan = CalibrationPlan(
            mode=design.mode, n_folds=K, label_scale=d.label_scale, cells=ci.cells, cal_cells=ci.cal_cells,
            cal_global=ci.cal_global, cal_cell=ci.cal_cell, y=at_rows(d.label, design.cal_rows),
            cal_key=ci.cal_key,
            order=order, fold_bounds=tuple(zip((ends - size).tolist(), ends.tolist())),
            z_index=(folds[order] + 1) * Gc + ci.cal_cell[order] if batched else None,
            global_sorted=ci.cal_global[ci.cal_cell[order]] if batched else None,
            fold_cells=tuple(fold_cells), warm=None, n_knots=design.n_knots,
            cell_sorted=ci.cal_cell[order] if batched else None)
        if plan.entry.batched:
            plan = replace(plan, warm=_warm_start(plan))
        object.__setattr__(design, "_calibration_plan", plan)  # frozen dataclass: a private cache
    return plan


def _fold_sums(plan: CalibrationPlan, wc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-(fold, cell) sums of the calibration rows under weights ``wc``, and the fits' sums.

    Returns ``S`` (3, K, Gc): weight, weighted label sum and rows with positive weight per fold
    and calibration cell (a ``bincount`` each), and ``M`` (3, K + 1, Gc): the same for the full
    fit (``M[:, 0]``, all folds) and each fold's complement (``M[:, k + 1]``, all but fold k).
    """
    K, Gc = plan.n_folds, plan.cal_cells.size
    S = np.empty((3, K, Gc))
    # one bincount a quantity over the same key: each bin sums its rows in row order, the bits of one bincount
    # over the three keys side by side, without their (3m,) key and weights
    S[0] = np.bincount(plan.cal_key, weights=wc, minlength=K * Gc).reshape(K, Gc)
    S[1] = np.bincount(plan.cal_key, weights=wc * plan.y, minlength=K * Gc).reshape(K, Gc)
    S[2] = np.bincount(plan.cal_key, weights=(wc > 0).astype(float), minlength=K * Gc).reshape(K, Gc)
    M = np.empty((3, K + 1, Gc))
    np.sum(S, axis=1, out=M[:, 0])
    np.subtract(M[:, :1], S, out=M[:, 1:])
    return S, M


def cell_fits(plan: CalibrationPlan, wc: np.ndarray, with_models: bool = True):
    """Full and per-fold fits from per-(fold, cell) sums of calibration-row weights ``wc``.

    Returns the full model's prediction at every cell (G,), the out-of-fold prediction of every
    calibration row (m,), the full model and the fold models (None: empty fold or complement;
    both None when ``with_models`` is false, for bootstrap replicates).
    """
    K, clip = plan.n_folds, plan.label_scale
    S, M = _fold_sums(plan, wc)
    has_rows = S[2].sum(1) > 0
    entry = plan.entry
    if entry.batched:
        # all K + 1 fits at once (e.g. two-stage: shared design matrices, batched normal equations and solves)
        fits = entry.fit_many(plan.cal_cells, M[0], M[1], M[2], clip=clip, warm=plan.warm, n_knots=plan.n_knots)
        F_all = fits.predict_cells(0, plan.cells)
        live = [k for k in range(K) if has_rows[k] and fits.ok[k + 1]]
        f_cal = _out_of_fold(plan, F_all, fits.Z, live, fits.x[1:], fits.y[1:])
        if not with_models:
            return F_all, f_cal, None, None
        return F_all, f_cal, fits.model(0), [fits.model(k + 1) if k in live else None for k in range(K)]
    full = entry.make(clip, plan.n_knots).fit_cells(plan.cal_cells, M[0, 0], M[1, 0], M[2, 0])
    fold_models = [None if not has_rows[k] or not M[2, k + 1].any() else
                   entry.make(clip, plan.n_knots).fit_cells(plan.cal_cells, M[0, k + 1], M[1, k + 1],
                                                            M[2, k + 1], full)
                   for k in range(K)]
    F_all = full.predict_cells(plan.cells)
    f_cal = F_all[plan.cal_global][plan.cal_cell]
    for k, model in enumerate(fold_models):
        if model is not None:
            held, cells_k, pos_k = plan.fold_cells[k]
            f_cal[held] = model.predict_cells(cells_k)[pos_k]  # predicted only where fold k has rows
    return F_all, f_cal, full, fold_models


def _warm_start(plan: CalibrationPlan) -> dict | None:
    """Where the batched solver of every refit starts (two-stage: the active ramps of the unweighted
    full fit): a function of the design only, so every process starts alike (the fits do not depend
    on the start; the number of solver rounds does)."""
    _, M = _fold_sums(plan, np.ones(plan.y.size))
    return plan.entry.warm_start(plan.cal_cells, M[0, :1], M[1, :1], M[2, :1], clip=plan.label_scale,
                                 n_knots=plan.n_knots)


def _fold_cell_index(plan: CalibrationPlan) -> np.ndarray:
    """Each calibration row's (fold, calibration cell) in its own row order, as ``fold * Gc + cell``
    (`_out_of_fold`'s table; cached on the plan)."""
    idx = plan.__dict__.get("_fold_cell_index")
    if idx is None:
        sizes = [b - a for a, b in plan.fold_bounds]
        fold = np.repeat(np.arange(plan.n_folds), sizes)
        idx = np.empty(plan.order.size, dtype=np.intp)
        idx[plan.order] = fold * plan.cal_cells.size + plan.cell_sorted
        object.__setattr__(plan, "_fold_cell_index", idx)  # frozen dataclass: a private cache
    return idx


def _out_of_fold(plan: CalibrationPlan, F_all: np.ndarray, Z: np.ndarray, live: list[int], xs: list,
                 ys: list) -> np.ndarray:
    """Out-of-fold value of every calibration row from the fits' index matrix ``Z`` (fit k + 1 at
    the cells of fold k's rows, then its stage-2 curve ``xs[k], ys[k]``); folds not in ``live``
    keep the full fit's value ``F_all``."""
    if plan.cell_sorted is not None and len(live) == plan.n_folds and Z.shape[1] == plan.cal_cells.size:
        # every fold refitted: each (fold, cell)'s value interpolated and clipped once, then one gather in
        # the calibration rows' own order (np.interp and the clip are elementwise: the same bits as the
        # per-row passes below, without the sorted copy, its clip and the scatter)
        Gc = plan.cal_cells.size
        table = np.empty(plan.n_folds * Gc)
        for k in live:
            table[k * Gc:(k + 1) * Gc] = interp_flat(Z[k + 1], xs[k], ys[k])
        return clip_to(table, plan.label_scale)[_fold_cell_index(plan)]
    out = F_all[plan.global_sorted]
    if plan.cell_sorted is not None:
        # a row's index value is its (fit, cell)'s: the stage-2 curve at each cell once, then read per row
        # (np.interp is elementwise: the same bits as interpolating every row)
        for k in live:
            a, b = plan.fold_bounds[k]
            out[a:b] = interp_flat(Z[k + 1], xs[k], ys[k])[plan.cell_sorted[a:b]]
    else:
        z = Z.ravel()[plan.z_index]
        for k in live:
            a, b = plan.fold_bounds[k]
            out[a:b] = interp_flat(z[a:b], xs[k], ys[k])
    f_cal = np.empty(out.size)
    f_cal[plan.order] = clip_to(out, plan.label_scale)
    return f_cal


def cross_fit_models(design: Design, row_w: np.ndarray | None = None):
    """`cross_fit`, also returning the per-fold models (``None`` for a fold that kept the full fit)."""
    cr = design.cal_rows
    wc = np.ones(cr.size) if row_w is None else row_w[cr]
    F_all, f_cal, full, models = cell_fits(calibration_plan(design), wc)
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


def cell_policy_stats(design: Design, F_all: np.ndarray, f_cal: np.ndarray, f_lab: np.ndarray) -> np.ndarray:
    """`policy_stats` of a cross-fit without a pass over the rows: the plug-in numerators are
    ``counts @ F_all`` (every row at the full fit's value of its cell) plus the calibration rows' out-of-fold
    corrections, as a bootstrap replicate computes them (`_replicate_stats`). Depends on the rows only through
    the per-(policy, cell) counts, so a sharded preparation gets the same bits (`cje_engine.pipeline.sharded`).

    ``F_all``: the full fit at every cell; ``f_cal``: the calibration rows' out-of-fold values; ``f_lab``: the
    labelled rows' calibrated values (``design.lab_rows`` order).
    """
    d = design.data
    K = design.n_policies
    counts = design.cells.counts
    cr = design.cal_rows
    n_k = counts.sum(1)
    # einsum, not BLAS: the same bits whatever the BLAS thread count of the process
    num = np.einsum("kg,g->k", counts, F_all) + np.bincount(
        d.policy[cr], weights=f_cal - F_all[design.cells.row_cell[cr]], minlength=K)
    lab = design.lab_rows
    lw = d.label_weight[lab]
    with np.errstate(invalid="ignore", divide="ignore"):
        plug = num / n_k
        den = np.bincount(d.policy[lab], weights=lw, minlength=K)
        corr = np.bincount(d.policy[lab], weights=lw * (d.label[lab] - f_lab), minlength=K) / den
    return np.concatenate([plug, plug + corr])


@dataclass(frozen=True)
class BootstrapView:
    """Everything a bootstrap replicate reads, and nothing else: what a Ray worker receives.

    Per row only the prompt code and the (policy, cell) key of the weighted histogram (int32
    where they fit: 8 bytes a row); the rest is O(labels + cells): the `CalibrationPlan`, and the
    prompt, policy, cell, label and label weight of the labelled rows. `bootstrap_replicates`
    on it gives the replicates ``bootstrap_chunk`` gives on the whole prepared state, bit for bit
    (`replicate` itself runs on the view).
    """

    calibration: CalibrationPlan
    seed: int
    n_prompts: int
    n_policies: int
    row_prompt: np.ndarray  # (n,) prompt code of every row
    row_key: np.ndarray  # (n,) policy * G + cell of every row
    cal_prompt: np.ndarray  # (m,) calibration rows: prompt, policy, cell
    cal_policy: np.ndarray
    cal_cell_global: np.ndarray
    lab_prompt: np.ndarray  # labelled rows (any policy): prompt, policy, cell, label, label weight
    lab_policy: np.ndarray
    lab_cell: np.ndarray
    lab_y: np.ndarray
    lab_lw: np.ndarray
    lab_is_cal: np.ndarray  # labelled rows that calibrate, and their index among the calibration rows
    lab_cal: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes held in arrays (the size of what a worker receives, up to pickling overhead)."""
        c = self.calibration
        arrays = [v for v in vars(self).values() if isinstance(v, np.ndarray)]
        arrays += [v for v in vars(c).values() if isinstance(v, np.ndarray)]
        arrays += [c.cells.score, c.cells.X, c.cal_cells.score, c.cal_cells.X]
        return int(sum(a.nbytes for a in arrays))

    def replicates(self, start: int, stop: int) -> np.ndarray:
        """Replicates ``start..stop-1`` (`bootstrap_replicates`): a bootstrap worker's replicate source."""
        return bootstrap_replicates(self, start, stop)


def bootstrap_view(design: Design, seed: int = 0) -> BootstrapView:
    """The design's `BootstrapView` for bootstrap seed ``seed`` (the arrays are cached on the design)."""
    base = design.__dict__.get("_bootstrap_view")
    if base is None:
        d, ci = design.data, design.cells
        lab, cr = design.lab_rows, design.cal_rows
        pos = np.full(d.n_rows, -1, dtype=np.int64)
        pos[cr] = np.arange(cr.size)
        lab_cal = pos[lab]
        small = np.int32 if d.n_prompts < 2**31 else np.int64
        base = BootstrapView(
            calibration=calibration_plan(design), seed=0, n_prompts=d.n_prompts, n_policies=design.n_policies,
            row_prompt=d.prompt.astype(small, copy=False), row_key=ci.row_key,
            cal_prompt=d.prompt[cr], cal_policy=d.policy[cr], cal_cell_global=ci.row_cell[cr],
            lab_prompt=d.prompt[lab], lab_policy=d.policy[lab], lab_cell=ci.row_cell[lab],
            lab_y=d.label[lab], lab_lw=d.label_weight[lab], lab_is_cal=lab_cal >= 0, lab_cal=lab_cal[lab_cal >= 0])
        object.__setattr__(design, "_bootstrap_view", base)  # frozen dataclass: a private cache
    return base if base.seed == seed else replace(base, seed=seed)


def replicate_view(view: BootstrapView, prompt_w: np.ndarray, T: np.ndarray | None = None) -> np.ndarray:
    """One replicate (``policy_stats`` under prompt weights ``prompt_w``, calibrator refitted) on a view.

    Per-(fold, cell) sums of the calibration rows, refits from them, and one weighted histogram
    of all rows over (policy, cell): equal to ``policy_stats(design, *cross_fit(design, row_w),
    row_w)`` with ``row_w = prompt_w[prompt]``. ``T``: the replicate's weighted (policy, cell) histogram when
    the rows are elsewhere (merged from the shards, `cje_engine.pipeline.sharded`). All NaN when the resample holds no calibration prompt
    (a handful of calibration labels); intervals and tests use the finite replicates and the result
    says how many were dropped.
    """
    plan = view.calibration
    wc = prompt_w[view.cal_prompt]
    if not (wc > 0).any():  # the resample drew no calibration prompt: no calibrator, no statistic
        return np.full(2 * view.n_policies, np.nan)
    if plan.entry.batched:
        F_all, f_cal = _batched_refits(plan, [wc])[0]
    else:
        F_all, f_cal, _, _ = cell_fits(plan, wc, with_models=False)
    return _replicate_stats(view, prompt_w, wc, F_all, f_cal, T)


#: Replicates of a batched mode refitted together: one `fit_many` call (two-stage: `fit_two_stage_many`) for the
#: K + 1 fits of each of up
#: to this many replicates (the numpy calls of the fit are shared, not the arithmetic; every fit's
#: numbers are the same bits as when fitted alone, see tests/unit/test_fast_paths.py).
REPLICATE_BATCH = 32
_BATCH_ELEMENTS = 2**20  # at most ~8 MB of per-replicate arrays held for one batch (10M rows: one a batch)


def _replicates(view: BootstrapView, weights: list, Ts: np.ndarray | None = None) -> np.ndarray:
    """Batched `replicate_view` for each prompt-weight vector of ``weights``, shape (len(weights), 2K):
    the refits of all of them in one batched fit (`_batched_refits`)."""
    out = np.full((len(weights), 2 * view.n_policies), np.nan)
    wcs = [w[view.cal_prompt] for w in weights]
    live = [i for i, wc in enumerate(wcs) if (wc > 0).any()]  # no calibration prompt: no calibrator, NaN
    fitted = _batched_refits(view.calibration, [wcs[i] for i in live])
    for i, (F_all, f_cal) in zip(live, fitted):
        out[i] = _replicate_stats(view, weights[i], wcs[i], F_all, f_cal, None if Ts is None else Ts[i])
    return out


def _batched_refits(plan: CalibrationPlan, wcs: list) -> list:
    """(full fit at every cell, out-of-fold values) of a batched mode's cross-fit under each weight
    vector of ``wcs``: the (K + 1) fits of every replicate in one ``entry.fit_many`` call."""
    if not wcs:
        return []
    K, J = plan.n_folds, plan.n_folds + 1
    sums = [_fold_sums(plan, wc) for wc in wcs]
    M = np.concatenate([m for _, m in sums], axis=1) if len(sums) > 1 else sums[0][1]
    fits = plan.entry.fit_many(plan.cal_cells, M[0], M[1], M[2], clip=plan.label_scale, warm=plan.warm,
                               n_knots=plan.n_knots)
    out = []
    for r, (S, _) in enumerate(sums):
        j0 = r * J
        has_rows = S[2].sum(1) > 0
        F_all = fits.predict_cells(j0, plan.cells)
        live = [k for k in range(K) if has_rows[k] and fits.ok[j0 + k + 1]]
        out.append((F_all, _out_of_fold(plan, F_all, fits.Z[j0:j0 + J], live, fits.x[j0 + 1:j0 + J],
                                        fits.y[j0 + 1:j0 + J])))
    return out


def _replicate_stats(view: BootstrapView, prompt_w: np.ndarray, wc: np.ndarray, F_all: np.ndarray,
                     f_cal: np.ndarray, T: np.ndarray | None = None) -> np.ndarray:
    """Plug-in and augmented values of one replicate from its refits (`replicate_view`); ``T``: its
    weighted (policy, cell) histogram when given (merged from shards), else computed from the view's rows."""
    plan = view.calibration
    K, G = view.n_policies, plan.cells.size
    # Every row at the full fit's value, then the calibration rows corrected to out of fold.
    if T is None:
        T = np.bincount(view.row_key, weights=prompt_w[view.row_prompt], minlength=K * G)
    T = np.asarray(T, dtype=float).reshape(K, G)
    n_k = T.sum(1)
    # einsum, not BLAS: the same bits whatever the BLAS thread count of the process
    num = np.einsum("kg,g->k", T, F_all) + np.bincount(view.cal_policy, weights=wc * (f_cal - F_all[view.cal_cell_global]), minlength=K)
    f_lab = F_all[view.lab_cell]
    f_lab[view.lab_is_cal] = f_cal[view.lab_cal]
    lw = prompt_w[view.lab_prompt] * view.lab_lw
    with np.errstate(invalid="ignore", divide="ignore"):
        plug = num / n_k
        den = np.bincount(view.lab_policy, weights=lw, minlength=K)
        corr = np.bincount(view.lab_policy, weights=lw * (view.lab_y - f_lab), minlength=K) / den
    return np.concatenate([plug, plug + corr])


def own_label_means(view: BootstrapView, prompt_w: np.ndarray) -> np.ndarray:
    """Each policy's own-label mean (Hajek, weighted by ``label_weight``) under prompt weights, shape (K,).

    The oracle-only level: it needs no calibrator, so a replicate's value is a weighted mean of the
    labelled rows alone (NaN for a policy without positively weighted labels in the resample).
    """
    K = view.n_policies
    lw = prompt_w[view.lab_prompt] * view.lab_lw
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.bincount(view.lab_policy, weights=lw * view.lab_y, minlength=K)
                / np.bincount(view.lab_policy, weights=lw, minlength=K))


def bootstrap_replicates(view: BootstrapView, start: int, stop: int,
                         histograms: np.ndarray | None = None, weights: np.ndarray | None = None) -> np.ndarray:
    """Replicates ``start..stop-1`` on a view, shape (stop - start, 3K): the 2K statistics of
    `policy_stats` (calibrator refitted) then every policy's own-label mean (`own_label_means`, the
    third block: the power-tuned verified level combines it with the augmented one). Replicate ``b``
    depends only on ``(view.seed, b)``, so any split into chunks gives the same rows (the same bits:
    the batches of `_replicates` do not change any replicate's numbers). ``histograms``: the replicates'
    weighted (policy, cell) histograms, shape (stop - start, K * G), when the rows are on shards
    (`cje_engine.pipeline.sharded.shard_histograms`, summed over the shards: whole numbers, exact).
    ``weights``: the replicates' prompt weights when already drawn, shape (stop - start, view.n_prompts), any
    integer or float dtype (row ``i``: ``bootstrap_weights(view.seed, start + i, ...)`` at the view's prompts,
    e.g. those of a `compact_view`), instead of drawing them again.

    Each replicate is computed as `replicate_view` then `own_label_means` compute it, the same bits, in one pass
    (`_replicate_row`: the labelled rows' weights and their per-policy totals once for both parts; when the
    labelled rows are the calibration rows, their weights and calibrated values are read once)."""
    K = view.n_policies

    def draw(b: int) -> np.ndarray:
        if weights is None:
            return bootstrap_weights(view.seed, b, view.n_prompts)
        # float64 once a replicate (whole numbers: exact), then gathered (numpy gathers 8-byte items fastest)
        return weights[b - start].astype(float)

    out = np.empty((stop - start, 3 * K))
    plan = view.calibration
    same = _labelled_are_calibration(view)

    def row(i: int, w: np.ndarray, wc: np.ndarray, fit: tuple | None) -> np.ndarray:
        if histograms is not None:
            T = np.asarray(histograms[i], dtype=float)
        else:
            T = np.bincount(view.row_key, weights=w[view.row_prompt], minlength=K * plan.cells.size)
        lw = np.multiply(wc if same else w[view.lab_prompt], view.lab_lw)
        return _replicate_row(view, w, wc, fit, T, lw, same)

    if not plan.entry.batched:
        for i, b in enumerate(range(start, stop)):
            w = draw(b)
            wc = w[view.cal_prompt]
            fit = cell_fits(plan, wc, with_models=False)[:2] if (wc > 0).any() else None
            out[i] = row(i, w, wc, fit)
        return out
    # per replicate of a batch: its prompt weights, calibration weights and out-of-fold values, its
    # fold sums and fits over the calibration cells, its full fit at every cell
    per = view.n_prompts + 2 * plan.y.size + (6 * plan.n_folds + 10) * plan.cal_cells.size + plan.cells.size
    batch = max(1, min(REPLICATE_BATCH, _BATCH_ELEMENTS // max(per, 1)))
    for a in range(start, stop, batch):
        b = min(a + batch, stop)
        ws = [draw(i) for i in range(a, b)]
        wcs = [w[view.cal_prompt] for w in ws]
        fits = _refits(plan, wcs)  # the batch's refits in one batched fit, as `_replicates` fits them
        for j, w in enumerate(ws):
            out[a - start + j] = row(a - start + j, w, wcs[j], fits.get(j))
    return out


def _labelled_are_calibration(view: BootstrapView) -> bool:
    """Whether the view's labelled rows are its calibration rows, in the same order (no calibration policies:
    the sharded driver's case), so a replicate reads their weights and out-of-fold values once (cached)."""
    same = view.__dict__.get("_lab_are_cal")
    if same is None:
        same = bool(view.lab_is_cal.all() and view.lab_cal.size == view.cal_prompt.size
                    and np.array_equal(view.lab_cal, np.arange(view.lab_cal.size))
                    and np.array_equal(view.lab_prompt, view.cal_prompt))
        object.__setattr__(view, "_lab_are_cal", same)  # frozen dataclass: a private cache
    return same


def _refits(plan: CalibrationPlan, wcs: list) -> dict:
    """Index -> (full fit at every cell, out-of-fold values) of each weight vector of ``wcs`` that holds a
    calibration prompt, computed as `bootstrap_replicates` computes them (batched modes: one `_batched_refits`
    call for the batch; else `cell_fits` one at a time), so the same bits."""
    live = [i for i, wc in enumerate(wcs) if (wc > 0).any()]  # no calibration prompt: no calibrator, NaN
    if plan.entry.batched:
        return dict(zip(live, _batched_refits(plan, [wcs[i] for i in live])))
    return {i: cell_fits(plan, wcs[i], with_models=False)[:2] for i in live}


def same_calibration(a: CalibrationPlan, b: CalibrationPlan) -> bool:
    """Whether two plans refit to the same numbers under the same calibration-row weights (the same mode,
    label bounds, folds, cells and calibration rows), so one refit serves both."""
    if (a.mode, a.n_folds, a.label_scale, a.n_knots) != (b.mode, b.n_folds, b.label_scale, b.n_knots):
        return False
    pairs = [(a.cells.score, b.cells.score), (a.cells.X, b.cells.X), (a.cal_cells.score, b.cal_cells.score),
             (a.cal_cells.X, b.cal_cells.X), (a.cal_global, b.cal_global), (a.cal_cell, b.cal_cell), (a.y, b.y),
             (a.cal_key, b.cal_key)]
    return all(x.shape == y.shape and np.array_equal(x, y) for x, y in pairs)


def joint_replicates(view: BootstrapView, cells: BootstrapView, to_plain: np.ndarray, start: int, stop: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """`bootstrap_replicates` ``start..stop-1`` of a run (``view``) and of a refinement of its rows (``cells``:
    the segment x policy cells of `cje_engine.pipeline.segments`, the same rows recoded) in one pass.

    Per replicate: one set of prompt weights, one weighted histogram of the rows over the refined (policy, cell)
    keys, the run's histogram summed from it (``to_plain``: each refined key's run key; whole-number weights, so
    the sums are exact and the run's histogram the same bits as its own pass), and one refit when both plans
    refit alike (`same_calibration`). Returns both replicate arrays, each equal bit for bit to
    ``bootstrap_replicates`` of its view.
    """
    if view.n_prompts != cells.n_prompts or view.row_prompt.size != cells.row_prompt.size or view.seed != cells.seed:
        raise ValueError("joint_replicates: the cells' view must recode the same rows, prompts and seed")
    K, Kc = view.n_policies, cells.n_policies
    plan, cplan = view.calibration, cells.calibration
    G, Gc = plan.cells.size, cplan.cells.size
    same_cal_rows = np.array_equal(view.cal_prompt, cells.cal_prompt)  # the calibration rows' weights shared
    shared = same_cal_rows and same_calibration(plan, cplan)
    same_labels = np.array_equal(view.lab_prompt, cells.lab_prompt) and np.array_equal(view.lab_lw, cells.lab_lw)
    out, out_c = np.empty((stop - start, 3 * K)), np.empty((stop - start, 3 * Kc))
    # the refits of a batch are held together (their prompt weights too): sized by the refits' arrays
    per = max(_replicate_elements(plan), _replicate_elements(cplan)) + view.n_prompts // 4
    batch = max(1, min(REPLICATE_BATCH, _BATCH_ELEMENTS // max(per, 1)))
    for a in range(start, stop, batch):
        ws = [bootstrap_weights(view.seed, i, view.n_prompts) for i in range(a, min(a + batch, stop))]
        wcs = [w[view.cal_prompt] for w in ws]
        fits = _refits(plan, wcs)
        wcs_c = wcs if same_cal_rows else [w[cells.cal_prompt] for w in ws]
        fits_c = fits if shared else _refits(cplan, wcs_c)
        for j, w in enumerate(ws):
            i = a - start + j
            T_c = np.bincount(cells.row_key, weights=w[cells.row_prompt], minlength=Kc * Gc)
            T = np.bincount(to_plain, weights=T_c, minlength=K * G)
            lw = w[view.lab_prompt] * view.lab_lw
            out[i] = _replicate_row(view, w, wcs[j], fits.get(j), T, lw)
            out_c[i] = _replicate_row(cells, w, wcs_c[j], fits_c.get(j), T_c,
                                      lw if same_labels else w[cells.lab_prompt] * cells.lab_lw)
    return out, out_c


@dataclass(frozen=True)
class JointView:
    """The replicate source of a run with segment cells on bootstrap workers: the run's `BootstrapView`, the
    cells' (``cells``: the same rows recoded, `cje_engine.pipeline.segments`) and each cell key's run key
    (``to_plain``). `replicates` computes both in one pass (`joint_replicates`) and returns them side by side,
    shape (stop - start, 3K + 3Kc): the run's columns first, then the cells'; each block equal bit for bit
    to `bootstrap_replicates` of its view (`cje_engine.pipeline.direct.finalize` splits them)."""

    view: BootstrapView
    cells: BootstrapView
    to_plain: np.ndarray

    @property
    def n_plain(self) -> int:
        """Columns of the run's replicates (3K), the first block of a chunk."""
        return 3 * self.view.n_policies

    @property
    def nbytes(self) -> int:
        """Bytes held in arrays (the run's view, the cells' arrays not shared with it, the key map)."""
        shared = {id(v) for v in vars(self.view).values() if isinstance(v, np.ndarray)}
        own = sum(v.nbytes for v in vars(self.cells).values() if isinstance(v, np.ndarray) and id(v) not in shared)
        c = self.cells.calibration
        own += sum(v.nbytes for v in vars(c).values() if isinstance(v, np.ndarray))
        return int(self.view.nbytes + own + self.to_plain.nbytes)

    def replicates(self, start: int, stop: int) -> np.ndarray:
        """Replicates ``start..stop-1`` of the run and of its cells, side by side (`joint_replicates`)."""
        plain, cells = joint_replicates(self.view, self.cells, self.to_plain, start, stop)
        return np.hstack([plain, cells])


def _replicate_row(view: BootstrapView, prompt_w: np.ndarray, wc: np.ndarray, fit: tuple | None, T: np.ndarray,
                   lw: np.ndarray, lab_are_cal: bool = False) -> np.ndarray:
    """One replicate's row of `bootstrap_replicates` (3K: `_replicate_stats` then `own_label_means`, the same
    bits) from its refit ``fit`` (None: no calibration prompt, NaN statistics), its weighted (policy, cell)
    histogram ``T`` and its labelled rows' weights ``lw`` (prompt weight times label weight), the denominators
    shared by both parts. ``lab_are_cal``: the labelled rows are the calibration rows in order
    (`_labelled_are_calibration`), so their calibrated values are the out-of-fold ``f_cal`` as they are."""
    K = view.n_policies
    out = np.full(3 * K, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        den = np.bincount(view.lab_policy, weights=lw, minlength=K)
        out[2 * K:] = np.bincount(view.lab_policy, weights=lw * view.lab_y, minlength=K) / den
        if fit is None:
            return out
        F_all, f_cal = fit
        T = T.reshape(K, view.calibration.cells.size)
        n_k = T.sum(1)
        # as `_replicate_stats`: einsum, not BLAS (the same bits whatever the BLAS thread count)
        num = np.einsum("kg,g->k", T, F_all) + np.bincount(view.cal_policy, weights=wc * (f_cal - F_all[view.cal_cell_global]), minlength=K)
        if lab_are_cal:  # every labelled row is overwritten by its out-of-fold value below: f_cal itself
            f_lab = f_cal
        else:
            f_lab = F_all[view.lab_cell]
            f_lab[view.lab_is_cal] = f_cal[view.lab_cal]
        plug = num / n_k
        corr = np.bincount(view.lab_policy, weights=lw * (view.lab_y - f_lab), minlength=K) / den
    out[:K] = plug
    out[K:2 * K] = plug + corr
    return out


def _replicate_elements(plan: CalibrationPlan) -> int:
    """Per-replicate array elements of a batch of refits beyond the prompt weights (`bootstrap_replicates`)."""
    return 2 * plan.y.size + (6 * plan.n_folds + 10) * plan.cal_cells.size + plan.cells.size


def replicate(design: Design, prompt_w: np.ndarray | None = None) -> np.ndarray:
    """Refit the calibration under prompt weights and return ``policy_stats`` (see `replicate_view`)."""
    if prompt_w is None:
        f, _ = cross_fit(design)
        return policy_stats(design, f)
    return replicate_view(bootstrap_view(design), prompt_w)


def compact_view(view: BootstrapView) -> tuple[BootstrapView, np.ndarray]:
    """(view, prompts): ``view`` restricted to the prompts a replicate reads when its weighted (policy, cell)
    histogram is given (`bootstrap_replicates` with ``histograms``): those of the calibration and labelled rows,
    ``prompts`` (sorted global codes), recoded ``0..len(prompts)-1``; no per-row arrays. With the weights at
    ``prompts`` (``weights[:, prompts]``) it gives the same replicates, bit for bit: every weight it reads is
    the same number."""
    read = np.zeros(view.n_prompts, dtype=bool)
    read[view.cal_prompt] = True
    read[view.lab_prompt] = True
    prompts = np.flatnonzero(read)
    read = None
    small = np.int32 if prompts.size < 2**31 else np.int64
    empty = np.zeros(0, dtype=small)
    return replace(view, n_prompts=int(prompts.size), row_prompt=empty, row_key=empty,
                   cal_prompt=np.searchsorted(prompts, view.cal_prompt).astype(small),
                   lab_prompt=np.searchsorted(prompts, view.lab_prompt).astype(small)), prompts


def bootstrap_counts(seed: int, b: int, n_prompts: int) -> np.ndarray:
    """`bootstrap_weights` as whole numbers in the smallest unsigned integer type holding them (uint8 unless a
    prompt is drawn more than 255 times): the same draws and counts, 1 byte a prompt instead of 8."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(b,)))
    counts = np.bincount(rng.integers(0, n_prompts, n_prompts), minlength=n_prompts)
    return counts.astype(count_dtype(int(counts.max()) if counts.size else 0))


def count_dtype(largest: int) -> type:
    """The smallest unsigned integer type holding ``0..largest``."""
    for t in (np.uint8, np.uint16, np.uint32):
        if largest <= np.iinfo(t).max:
            return t
    return np.uint64


def bootstrap_weights(seed: int, b: int, n_prompts: int) -> np.ndarray:
    """Prompt multiplicities of bootstrap replicate ``b`` (depends only on ``seed`` and ``b``): `bootstrap_counts`
    as floats."""
    return bootstrap_counts(seed, b, n_prompts).astype(float)


def _level_sets(full) -> tuple[np.ndarray, int]:
    """Block id of each fitted point of an isotonic fit (consecutive equal values pool)."""
    fy = full.y_
    scale = max(1.0, float(np.max(np.abs(fy))))
    jumps = np.abs(np.diff(fy)) > 1e-12 * scale
    block = np.concatenate([[0], np.cumsum(jumps)])
    return block, int(block[-1]) + 1


def influence(design: Design, f: np.ndarray, full, stats: np.ndarray | None = None) -> dict[str, np.ndarray]:
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
    ``stats``: `policy_stats` of ``(design, f)`` when the caller has it (computed otherwise).

    Memory: besides the three results, one int64 key and one float64 value per row (the
    histogram's input); the histograms are laid out as the results, so no copies of them.
    """
    d = design.data
    K = design.n_policies
    if stats is None:
        stats = policy_stats(design, f)
    n_k = np.bincount(d.policy, minlength=K).astype(float)
    total = evaluation_terms(d.prompt, d.policy, f, stats[:K], n_k, d.n_prompts)
    return influence_with_evaluation_terms(design, f, full, stats, total, n_k)


def evaluation_terms(prompt: np.ndarray, policy: np.ndarray, f: np.ndarray, plug: np.ndarray, n_k: np.ndarray,
                     n_prompts: int) -> np.ndarray:
    """The evaluation part of the influence terms: ``(f_i - theta_k) / n_k`` summed per (prompt, policy).

    One pass over the rows (a chunk at a time) into one histogram laid out as ``influence``'s ``total``
    (n_prompts, 2K), the plug-in columns filled and copied into the augmented ones. Each bin sums its rows in
    row order, so a shard holding all rows of its prompts in the same order gets the same bits per prompt
    (`cje_engine.pipeline.sharded`).
    """
    K = plug.size
    n = policy.shape[0]
    key = np.empty(n, dtype=np.int64)
    contrib = np.empty(n)
    for lo in range(0, n, _ROW_CHUNK):
        sl = slice(lo, lo + _ROW_CHUNK)
        pol = policy[sl]
        np.subtract(f[sl], plug[pol], out=contrib[sl])
        np.divide(contrib[sl], n_k[pol], out=contrib[sl])
        np.multiply(prompt[sl], 2 * K, out=key[sl])
        key[sl] += pol
    total = np.bincount(key, weights=contrib, minlength=n_prompts * 2 * K).reshape(n_prompts, 2 * K)
    del key, contrib
    total[:, K:] = total[:, :K]
    return total


def influence_with_evaluation_terms(design: Design, f: np.ndarray, full, stats: np.ndarray, total: np.ndarray,
                                    n_k: np.ndarray) -> dict[str, np.ndarray]:
    """`influence` from its evaluation part ``total`` (`evaluation_terms`, added to in place) and the
    policies' row counts ``n_k``: the label and calibration parts read the labelled rows and the
    per-(policy, cell) counts only, so a design of the labelled rows alone (with every row's counts) gives
    the same terms (`cje_engine.pipeline.sharded`)."""
    d = design.data
    K = design.n_policies
    n_p = d.n_prompts
    plug, aug = stats[:K], stats[K:]

    # Augmented: label residual terms, one histogram over (prompt, augmented column) laid out as ``cal``
    # (each bin sums its rows in row order, as one histogram per policy would).
    lab = design.lab_rows
    lw = d.label_weight[lab]
    r = d.label[lab] - f[lab]
    lab_pol = d.policy[lab]
    den = np.bincount(lab_pol, weights=lw, minlength=K)
    with np.errstate(invalid="ignore", divide="ignore"):
        lab_contrib = lw * (r - (aug - plug)[lab_pol]) / den[lab_pol]
    lab_key = d.prompt[lab].astype(np.int64) * (2 * K)
    lab_key += K
    lab_key += lab_pol
    cal = np.bincount(lab_key, weights=lab_contrib, minlength=n_p * 2 * K).reshape(n_p, 2 * K)
    del lab_key, lab_contrib
    cal[:, K + np.flatnonzero(den <= 0)] = np.nan
    total[:, K:] += cal[:, K:]

    # Plug-in: the calibration term over level sets of the full fit, weighted by every row of the
    # policy; the audit's calibration term: the same, weighted by the policy's labelled rows.
    cells, counts = design.cells.cells, design.cells.counts
    f_cal = f[design.cal_rows]  # out of fold: the residuals of singleton level sets
    calibration_term(design, full, counts / n_k[:, None], f_cal, out=cal[:, :K])
    total[:, :K] += cal[:, :K]
    G = cells.size
    lab_key = lab_pol.astype(np.int64) * G + design.cells.row_cell[lab]
    lab_counts = np.bincount(lab_key, weights=lw, minlength=K * G).reshape(K, G)
    with np.errstate(invalid="ignore", divide="ignore"):
        lab_share = np.where(den[:, None] > 0, lab_counts / den[:, None], 0.0)
    audit = calibration_term(design, full, lab_share, f_cal)
    np.subtract(cal[:, K:], audit, out=audit)  # in place: cal - term, one (n_prompts, K) array fewer
    audit[:, den <= 0] = np.nan
    return {"total": total, "calibration": cal, "audit": audit}


def corrected_residuals(r_in: np.ndarray, block: np.ndarray, n_blocks: int, r_oof: np.ndarray) -> np.ndarray:
    """Leverage-corrected isotonic residuals: ``r_in / sqrt(1 - 1/k)`` for a row of a level set of
    ``k >= 2`` calibration rows (HC2), the out-of-fold residual ``r_oof`` for a singleton.

    In-sample isotonic residuals are shrunk: the fit is the projection onto block means, so a row of
    a block of ``k`` rows has leverage ``1 / k`` (a singleton's residual is exactly 0). Measured on
    2,000 simulated off-policy data sets, the uncorrected residuals made analytic SEs 0.93-0.94 of
    the RMSE, corrected 1.00-1.02 (docs/statistics.md, "Off-policy coverage").
    """
    k = np.bincount(block, minlength=n_blocks)[block]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(k > 1, r_in * np.sqrt(k / np.maximum(k - 1, 1)), r_oof)


@dataclass(frozen=True)
class LevelSetShares:
    """What `calibration_term` reads of a fitted isotonic calibrator: each calibration row's level set
    (``b_cal``) and residual (``resid_cal``, leverage-corrected when the out-of-fold values were given), the
    calibration rows' share of each level set (``q``) and each cell's split between the level sets of its two
    neighbouring fitted points (``bj`` with weight ``1 - t``, ``bj1`` with weight ``t``)."""

    b_cal: np.ndarray  # (m,)
    resid_cal: np.ndarray  # (m,)
    m: int
    q: np.ndarray  # (n_blocks,)
    n_blocks: int
    bj: np.ndarray  # (G,)
    bj1: np.ndarray  # (G,)
    t: np.ndarray  # (G,)


def level_set_shares(design: Design, full, f_cal: np.ndarray | None = None) -> LevelSetShares:
    """The `LevelSetShares` of ``full`` on the design (the part of `calibration_term` that does not depend on
    the weights of the cells)."""
    d = design.data
    cr = design.cal_rows
    block_of_x, n_blocks = _level_sets(full)
    ux = full.x_
    z_cal = full.index(d.score[cr], d.X[cr])
    pos = np.clip(np.searchsorted(ux, z_cal), 0, ux.size - 1)
    b_cal = block_of_x[pos]
    m = cr.size
    q = np.bincount(b_cal, minlength=n_blocks) / m
    resid_cal = d.label[cr] - np.interp(z_cal, ux, full.y_)
    if f_cal is not None:
        resid_cal = corrected_residuals(resid_cal, b_cal, n_blocks, d.label[cr] - np.asarray(f_cal, dtype=float))
    # Each row's share of the level sets depends only on its cell.
    cells = design.cells.cells
    z_all = full.index(cells.score, cells.X)
    j = np.clip(np.searchsorted(ux, z_all, side="right") - 1, 0, ux.size - 1)
    j1 = np.minimum(j + 1, ux.size - 1)
    gap = ux[j1] - ux[j]
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(gap > 0, np.clip((z_all - ux[j]) / gap, 0.0, 1.0), 0.0)
    return LevelSetShares(b_cal, resid_cal, m, q, n_blocks, block_of_x[j], block_of_x[j1], t)


def calibration_term(design: Design, full, share: np.ndarray, f_cal: np.ndarray | None = None, *,
                     out: np.ndarray | None = None) -> np.ndarray:
    """Per-prompt first-order effect of estimating the calibrator on ``sum_c share[k, c] f(c)``.

    ``share`` (K', G) weights the cells (rows of a policy per cell over the policy's rows: its
    plug-in; labelled rows' label weights over their total: the mean calibrated value on its audit
    slice; any weights ``a_i`` summed per cell: an off-policy estimate). For an isotonic fit on level
    sets, a calibration row ``j`` contributes ``rho_k(block_j) r_j / m``, with ``rho_k`` the weighted
    share of the cells in a level set over the calibration rows' share of it (linear interpolation
    between level sets splits a cell between them) and ``r_j`` its residual: leverage-corrected
    (`corrected_residuals`) when the cross-fitted values of the calibration rows ``f_cal`` are given,
    else in sample (the exact derivative for fixed level sets). Returns (n_prompts, K'), written into
    ``out`` when given (an (n_prompts, K') array or view).
    """
    d = design.data
    n_p = d.n_prompts
    cr = design.cal_rows
    ls = level_set_shares(design, full, f_cal)
    b_cal, resid_cal, m, q, n_blocks = ls.b_cal, ls.resid_cal, ls.m, ls.q, ls.n_blocks
    bj, bj1, t = ls.bj, ls.bj1, ls.t
    if out is None:
        out = np.empty((n_p, share.shape[0]))
    prompt_cr = d.prompt[cr]
    for k in range(share.shape[0]):
        p_k = (np.bincount(bj, weights=share[k] * (1 - t), minlength=n_blocks)
               + np.bincount(bj1, weights=share[k] * t, minlength=n_blocks))
        with np.errstate(invalid="ignore", divide="ignore"):
            rho = np.where(q > 0, p_k / q, 0.0)
        out[:, k] = np.bincount(prompt_cr, weights=rho[b_cal] * resid_cal / m, minlength=n_p)
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
            model = design.entry.make(d.label_scale, design.n_knots).fit(
                d.score[cr[keep]], d.label[cr[keep]], d.X[cr[keep]], None
            )
        thetas.append(counts @ model.predict_cells(design.cells.cells) / n_k)
    th = np.array(thetas)
    return (d.n_folds - 1) / d.n_folds * ((th - th.mean(0)) ** 2).sum(0)
