"""Segmented evaluation: every segment x policy evaluated by the product's own estimator.

A segment x policy *cell* is treated as a policy of its own: the rows are recoded to one virtual policy
per cell and run through the same steps as any evaluation (`fit_mode` with the calibration sources of
the run, the cluster bootstrap that refits the calibrator, `summarize_direct`'s verified and
assumes-transport levels and transport audits), so a segment's level, interval and audit are exactly
those of the product restricted to the segment's rows, with the calibration fitted on all the labels
(the same labelled rows train it; only the bookkeeping of the rows differs). When the omnibus
calibration test over all labels fails (and ``segment_recalibrate="auto"``), the calibration of the
segment levels gets the segment as a covariate (one-hot, a covariate-reading registered mode).

Then: comparisons with the baseline within each segment (paired replicates), their family adjusted
(BH or Holm) and the selected ones given Benjamini-Yekutieli intervals; the omnibus test per policy
and over all labels (`cje_engine.inference.segments.wald_test`); reliability diagrams per policy.
docs/segments.md states the method and its measured power and coverage.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import pandas as pd

from cje_engine.calibration import registry
from cje_engine.calibration.calibrators import make_cells
from cje_engine.data.frame import EvalData
from cje_engine.direct.estimators import bootstrap_replicates, bootstrap_view, fold_jackknife
from cje_engine.direct.segment_terms import prompts_per_column, sparse_influence
from cje_engine.errors import CJEInputError
from cje_engine.inference.distributions import norm_sf
from cje_engine.inference.multiplicity import adjust, holm
from cje_engine.inference.variance import cluster_cov_padded
from cje_engine.pipeline.calibration import fit_mode
from cje_engine.pipeline.policies import RowTotals, summarize_direct
from cje_engine.result.jsonable import jsonable
from cje_engine.inference.segments import (by_interval_level, eb_pool, group_mean_residuals, normal_interval,
                                           paired_difference, reliability_bins, score_bins, wald_test)
from cje_engine.result.segments import OTHER, SegmentsResult

log = logging.getLogger(__name__)

#: Separator of several segment columns' values in a segment's name.
JOIN = " / "
#: The value of a missing segment column.
MISSING = "(missing)"
#: Score bins of the omnibus test and of the reliability diagrams.
N_BINS = 10


@dataclass(frozen=True)
class SegmentRows:
    """Each row's segment (before pooling): codes into ``names``, and the columns they came from."""

    columns: tuple[str, ...]
    names: tuple[str, ...]
    code: np.ndarray  # (n_rows,)


def segment_rows(frame: pd.DataFrame, columns: Sequence[str]) -> SegmentRows:
    """The segments of a frame's rows: the values of ``columns`` (several: joined by `JOIN`).

    Raises
    ------
    CJEInputError
        A column is missing.
    """
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise CJEInputError(f"segment_by column {missing[0]!r} is not a column of the input "
                            f"(columns: {', '.join(map(str, frame.columns))})", column=missing[0],
                            option="segment_by")
    parts = [frame[c].astype("string").fillna(MISSING).astype(str) for c in columns]
    text = parts[0] if len(parts) == 1 else parts[0].str.cat(parts[1:], sep=JOIN)
    code, names = pd.factorize(text, sort=True)
    return SegmentRows(tuple(columns), tuple(str(n) for n in names), code.astype(np.int64))


def segment_error(exc: CJEInputError, segment_by: Sequence[str]) -> CJEInputError:
    """A reader's "keep_columns asks for COL" about a ``segment_by`` column, reworded to name the option the
    user gave (``exc`` itself otherwise)."""
    if segment_by and exc.column in segment_by and "keep_columns asks for" in (exc.detail or ""):
        return CJEInputError(exc.detail.replace("keep_columns asks for", "segment_by names"), source=exc.source,
                             column=exc.column, option="segment_by")
    return exc


def plan_from_counts(rows: np.ndarray, labels: np.ndarray, names: Sequence[str], min_rows: int, min_labels: int
                     ) -> tuple[np.ndarray, list[str], list[dict]]:
    """`plan_segments` from the counts: (each segment's shown group, group names, segment infos).

    The rule itself (the sharded path calls it on the shards' merged counts): a segment is shown when every
    policy has ``min_rows`` rows in it and it holds ``min_labels`` labels; the others are pooled into `OTHER`,
    itself ``too_few`` below the same minimums. ``rows`` (segments, K) are the rows per segment and policy,
    ``labels`` (segments,) the labels per segment."""
    S = len(names)
    big = (rows.min(axis=1) >= min_rows) & (labels >= min_labels)
    shown = [s for s in range(S) if big[s]]
    group_names = [names[s] for s in shown]
    remap = np.full(S, len(shown), dtype=np.int64)
    remap[shown] = np.arange(len(shown))
    info = [{"name": names[s], "status": "shown" if big[s] else "pooled", "n_rows": int(rows[s].sum()),
             "n_labels": int(labels[s])} for s in range(S)]
    pooled = [s for s in range(S) if not big[s]]
    if pooled:
        o_rows, o_labels = rows[pooled].sum(axis=0), int(labels[pooled].sum())
        ok = bool(o_rows.min() >= min_rows and o_labels >= min_labels)
        group_names.append(OTHER)
        info.append({"name": OTHER, "status": "shown" if ok else "too_few", "n_rows": int(o_rows.sum()),
                     "n_labels": o_labels, "members": [names[s] for s in pooled]})
    return remap, group_names, info


def plan_segments(policy: np.ndarray, code: np.ndarray, labelled: np.ndarray, n_policies: int,
                  names: Sequence[str], min_rows: int, min_labels: int) -> tuple[np.ndarray, list[str], list[dict]]:
    """Which segments are shown on their own and which are pooled into `OTHER` (by size only).

    A segment is shown when every policy has at least ``min_rows`` rows in it and it holds at least
    ``min_labels`` labels; the others are pooled into `OTHER`, itself ``too_few`` when below the same
    minimums. The rule reads counts only, never outcomes, so the shown cells are not selected by their values.

    Returns
    -------
    group : ndarray of int (n_rows,)
        Each row's shown group (index into ``group_names``).
    group_names : list of str
        The shown segments, then `OTHER` when anything was pooled.
    info : list of dict
        `cje_engine.result.segments.SegmentInfo` of every segment (and of `OTHER`).
    """
    S = len(names)
    rows = np.bincount(code * n_policies + policy, minlength=S * n_policies).reshape(S, n_policies)
    remap, group_names, info = plan_from_counts(rows, np.bincount(code[labelled], minlength=S), names,
                                                min_rows, min_labels)
    return remap[code], group_names, info




def virtual_data(data: EvalData, group: np.ndarray, n_groups: int, extra_X: np.ndarray | None = None,
                 extra_names: Sequence[str] = ()) -> tuple[EvalData, np.ndarray]:
    """``data`` with one policy per non-empty (policy, group) cell; optionally extra covariate columns.

    Returns the recoded data and ``cells`` (n_cells, 2): each virtual policy's (policy, group).
    """
    K = len(data.policies)
    key = data.policy.astype(np.int64) * n_groups + group
    # np.unique's sorted keys and inverse, by a histogram of the K x G keys (no hash or sort of the rows)
    present = np.flatnonzero(np.bincount(key, minlength=K * n_groups))
    remap = np.zeros(K * n_groups, dtype=np.int64)
    remap[present] = np.arange(present.size)
    code = remap[key]
    cells = np.stack([present // n_groups, present % n_groups], axis=1)
    names = tuple(f"{data.policies[k]}\x1f{g}" for k, g in cells)
    X = data.X if extra_X is None else extra_X if data.X.shape[1] == 0 else np.hstack([data.X, extra_X])
    out = replace(data, policies=names, policy=code.astype(data.policy.dtype), X=X,
                  covariate_names=tuple(data.covariate_names) + tuple(extra_names))
    return out, cells


def _sources(prep: Any, data: EvalData, cells: np.ndarray) -> tuple[str, ...] | None:
    """The calibration sources of the run as virtual policies (None: every labelled row)."""
    opts = prep.options
    excluded = {e["policy"] for e in prep.excluded}
    if opts.calibration_policies is None and not excluded:
        return None
    base = prep.design.data.policies
    allowed = set(opts.calibration_policies or base) - excluded
    return tuple(n for n, (k, _) in zip(data.policies, cells) if base[k] in allowed)


def recalibration_mode(n_labels: int, n_covariates: int) -> tuple[str | None, str]:
    """The first registered mode that reads covariates and can be fitted on these labels (the mode of
    `segment_prepared`'s recalibration by segment, on the single and the sharded path), or None and why not."""
    for entry in registry.entries():
        if entry.uses_covariates:
            short = entry.shortfall(n_labels, n_covariates)
            if short is None:
                return entry.name, ""
            return None, short
    return None, "no registered calibration mode reads covariates"


def segment_prepared(prep: Any, group: np.ndarray, group_names: list[str], recalibrate: bool) -> tuple[Any, np.ndarray, dict]:
    """The virtual-policy evaluation of every cell, prepared (fitted, point estimates).

    Returns the prepared state (`cje_engine.pipeline.direct.Prepared`), the cells' (policy, group) and
    the `Recalibration` block.
    """

    d, opts = prep.design.data, prep.options
    G = len(group_names)
    mode = prep.design.mode
    recal = {"applied": False, "reason": "the omnibus calibration test over all labels did not fail",
             "mode": mode, "covariates": list(d.covariate_names)}
    extra_X, extra_names = None, ()
    if recalibrate:
        onehot = (group[:, None] == np.arange(1, G)[None, :]).astype(float)
        new_mode, why = recalibration_mode(int(prep.design.cal_rows.size), d.X.shape[1] + G - 1)
        if new_mode is None or G < 2:
            recal["reason"] = ("the omnibus calibration test failed but the segment cannot be a covariate: "
                               + (why or "a single segment"))
        else:
            extra_X, extra_names, mode = onehot, tuple(f"segment={n}" for n in group_names[1:]), new_mode
            recal = {"applied": True, "reason": "the omnibus calibration test over all labels failed: the segment "
                                                "levels use a calibration with the segment as a covariate",
                     "mode": mode, "covariates": list(d.covariate_names) + list(extra_names)}
    vdata, cells = virtual_data(d, group, G, extra_X, extra_names)
    fit = fit_mode(vdata, mode, _sources(prep, vdata, cells), virtual_cells(prep, vdata, group, G, mode, extra_X))
    names = set(vdata.policies)
    trust = opts.trust_transport
    if trust and "*" not in trust:
        trust = tuple(n for n in names if n.split("\x1f")[0] in trust)
    vopts = replace(opts, policies=None, baseline=None, trust_transport=trust, segment_by=(),
                    calibration_policies=_sources(prep, vdata, cells),
                    covariates=tuple(vdata.covariate_names))
    jk = fold_jackknife(fit.design, fit.models)
    f = fit.f
    infl = sparse_influence(fit.design, f, fit.full, fit.stats)  # never the dense (prompts, 2 K S) arrays
    # the same prepared class as the run's (a dataclass), on the virtual design
    vprep = replace(prep, options=vopts, design=fit.design, f=f, full=fit.full, stats=fit.stats, infl=infl,
                    jackknife=jk, models=fit.models, excluded=[], replay=None, segments=None,
                    rows=virtual_row_totals(fit.design, infl))
    return vprep, cells, recal


def virtual_cells(prep: Any, vdata: EvalData, group: np.ndarray, n_groups: int, mode: str,
                  extra_X: np.ndarray | None) -> tuple | None:
    """`cje_engine.direct.estimators.row_cells` of the virtual data from the run's cells, without coding the
    rows' scores and covariates again: the same cells when the calibration is the run's; with the segment
    one-hot columns, the cells of the distinct (run's cell, segment) pairs. None when the run's cells do
    not determine the virtual ones (another mode, or covariates the run's mode did not read)."""
    ci = prep.design.cells
    if ci is None:
        return None
    K = len(vdata.policies)
    if extra_X is None and mode == prep.design.mode:
        cells, row_cell = ci.cells, ci.row_cell
    elif extra_X is not None and (prep.design.entry.uses_covariates or prep.design.data.X.shape[1] == 0):
        pair = ci.row_cell.astype(np.int64) * n_groups + group
        present = np.flatnonzero(np.bincount(pair, minlength=ci.cells.size * n_groups))
        code = np.zeros(ci.cells.size * n_groups, dtype=np.int64)
        code[present] = np.arange(present.size)
        code = code[pair]
        first = np.zeros(present.size, dtype=np.int64)
        first[code[::-1]] = np.arange(code.size - 1, -1, -1)  # a row of each pair (the first)
        cells, pair_cell = make_cells(vdata.score[first], vdata.X[first])  # sorted as make_cells sorts the rows
        row_cell = pair_cell[code]
    else:
        return None
    G = cells.size
    small = np.int32 if K * G < 2**31 else np.int64  # as `row_cells`
    row_cell = row_cell.astype(small)
    row_key = vdata.policy.astype(small) * small(G) + row_cell
    counts = np.bincount(row_key, minlength=K * G).reshape(K, G).astype(float)
    return cells, row_cell, row_key, counts


def virtual_row_totals(design: Any, terms: dict | None = None) -> RowTotals:
    """`cje_engine.pipeline.policies.RowTotals` of the virtual design (histograms of its policy codes; the
    judge means as score sums over row counts, not one row mask per cell; the prompt counts from the
    structure of the cells' sparse terms ``terms`` when given)."""
    d = design.data
    K = len(d.policies)
    return RowTotals(n_rows=np.bincount(d.policy, minlength=K), n_prompts=prompts_per_column(design, terms),
                     score_sum=np.bincount(d.policy, weights=d.score, minlength=K),
                     score_min=float(d.score.min()), score_max=float(d.score.max()))


def _omnibus(policy_name: str, prompt: np.ndarray, resid: np.ndarray, weight: np.ndarray, score: np.ndarray,
             group: np.ndarray, group_names: list[str], n_prompts: int, alpha: float) -> dict:
    """The omnibus test on these labelled rows: mean residual by segment and by score decile.

    ``prompt``: the rows' clusters among ``n_prompts``; the covariances are over all of them
    (`cluster_cov_padded`), the per-cluster sums built for the clusters of these rows only."""
    G = len(group_names)
    present, local = np.unique(prompt, return_inverse=True)
    n_c = int(present.size)
    means_s, psi_s, n_s = group_mean_residuals(local, group, resid, weight, G, n_c)
    dec, edges = score_bins(score, N_BINS)
    D = edges.size - 1
    means_d, psi_d, n_d = group_mean_residuals(local, dec, resid, weight, D, n_c)
    delta = np.concatenate([means_s, means_d])
    psi = np.hstack([psi_s, psi_d])
    n = np.concatenate([n_s, n_d])
    delta[n < 2] = np.nan  # a group of one row has no variance of its own
    # the weighted segment means and the weighted decile means both sum to the pooled residual sum: one
    # decile follows from the rest, so it leaves the test (df = segments + deciles - 1)
    test = delta.copy()
    last = np.flatnonzero(np.isfinite(test[G:]))
    if G > 0 and last.size:
        test[G + last[-1]] = np.nan
    V = cluster_cov_padded(psi, n_prompts)
    stat, df, p = wald_test(test, None, V=V)
    se = np.sqrt(np.clip(np.diag(V), 0, None))
    comps = [{"kind": "segment", "name": group_names[j], "n": int(n_s[j]), "mean_residual": float(means_s[j]),
              "se": float(se[j])} for j in range(G) if n_s[j] > 0]
    comps += [{"kind": "decile", "name": f"{edges[j]:.4g}-{edges[j + 1]:.4g}", "n": int(n_d[j]),
               "mean_residual": float(means_d[j]), "se": float(se[G + j])} for j in range(D) if n_d[j] > 0]
    pooled, psi_p, _ = group_mean_residuals(local, np.zeros(resid.size, np.int64), resid, weight, 1, n_c)
    pse = float(np.sqrt(max(cluster_cov_padded(psi_p[:, 0], n_prompts)[0, 0], 0.0))) if resid.size > 1 else float("nan")
    return {"policy": policy_name, "statistic": stat, "df": df, "p_value": p,
            "reject": None if not np.isfinite(p) else bool(p <= alpha), "n_labels": int(resid.size),
            "n_clusters": n_c, "pooled_residual_mean": float(pooled[0]),
            "pooled_se": pse, "pooled_p_value": float(2 * norm_sf(abs(pooled[0]) / pse)) if pse > 0 else None,
            "components": comps}


def omnibus_tests(prep: Any, group: np.ndarray, group_names: list[str]) -> list[dict]:
    """The omnibus calibration test per policy and over every policy's labels (``policy`` '*').

    Residuals are the run's calibration residuals ``Y - f`` on the labelled rows (out of fold on the
    rows that train the calibrator); the covariance is prompt-clustered over the residual terms (for the
    cross-fitted rows conservative, as the product's source audits: docs/segments.md).
    """
    d, design = prep.design.data, prep.design
    lab = design.lab_rows
    resid = d.label[lab] - prep.f[lab]
    # the clusters are the labelled prompts (the others contribute nothing to a residual mean)
    _, prompt = np.unique(d.prompt[lab], return_inverse=True)
    n_clusters = int(prompt.max()) + 1 if prompt.size else 0
    args = (prompt, resid, d.label_weight[lab], d.score[lab], group[lab])
    out = [_omnibus("*", *args, group_names, n_clusters, prep.options.alpha)]
    pol = d.policy[lab]
    for k, name in enumerate(d.policies):
        sel = pol == k
        if sel.sum() >= 2:
            out.append(_omnibus(name, *(a[sel] for a in args), group_names, n_clusters, prep.options.alpha))
    return out


def reliability(prep: Any) -> list[dict]:
    """Per policy: reliability diagram data of the run's calibration on the policy's labelled rows."""
    d, lab = prep.design.data, prep.design.lab_rows
    pol = d.policy[lab]
    out = []
    for k, name in enumerate(d.policies):
        sel = lab[pol == k]
        if sel.size:
            out.append({"policy": name, "bins": reliability_bins(prep.f[sel], d.label[sel], d.label_weight[sel],
                                                                 d.prompt[sel], N_BINS)})
    return out


def _cell_level(pol: Any, col: int, n_virtual: int, assumed_col: int) -> tuple[str, int | None, str | None]:
    """(claim kind, column of the printed level or None, reason) of one cell's summarised policy."""
    if pol.level_claim == "ok" and col >= n_virtual:
        return "verified", col, None
    reason = (pol.relative_reason or "too few own labels to verify the level") if pol.level_claim != "refused" \
        else "; ".join(pol.refusal_reasons)
    if pol.assumed is not None and pol.assumed.level_claim == "ok":
        return "assumes_transport", assumed_col, f"assumes transport: {reason}"
    return "assumes_transport", None, "; ".join(pol.assumed.refusal_reasons) if pol.assumed else reason


def segment_cells(prep: Any, group: np.ndarray, group_names: list[str], recalibrate: bool
                  ) -> tuple[Any, np.ndarray, dict, np.ndarray | None]:
    """`segment_prepared` and the bootstrap replicates of its cells (None on the analytic route)."""
    vprep, cells, recal = segment_prepared(prep, group, group_names, recalibrate)
    opts = prep.options
    boot = opts.inference == "bootstrap"
    reps = bootstrap_replicates(bootstrap_view(vprep.design, opts.seed), 0, opts.n_bootstrap) if boot else None
    return vprep, cells, recal, reps


@dataclass
class SegmentPass:
    """A run's segments before the replicates: the plan, the omnibus tests and the prepared cells
    (`segment_pass`), and the cells' bootstrap replicates computed beside the run's (`chunks`, by range)."""

    plan: tuple  # `plan_segments`' (group, group_names, info)
    omnibus: list
    vprep: Any  # the cells' prepared state (`segment_prepared`)
    cells: np.ndarray  # (n_cells, 2) each cell's (policy, group)
    recal: dict
    to_plain: np.ndarray | None  # each cell key's run key (`plain_keys`); None: no joint pass
    chunks: dict = field(default_factory=dict)  # (start, stop) -> the cells' replicates start..stop-1

    def replicates(self, n_bootstrap: int, seed: int) -> np.ndarray:
        """The cells' replicates 0..n_bootstrap-1: the stored chunks when they cover the range exactly, else
        `bootstrap_replicates` of the cells (the same bits either way)."""
        spans = sorted(self.chunks)
        if spans and spans[0][0] == 0 and spans[-1][1] == n_bootstrap and all(
                a[1] == b[0] for a, b in zip(spans, spans[1:])):
            return np.vstack([self.chunks[k] for k in spans])
        return bootstrap_replicates(bootstrap_view(self.vprep.design, seed), 0, n_bootstrap)


def plain_keys(prep: Any, vprep: Any, cells: np.ndarray) -> np.ndarray | None:
    """Each (cell, calibration cell) histogram key of the cells' design mapped to the run's (policy, calibration
    cell) key, or None when the cells' calibration cells do not refine the run's (then no joint bootstrap pass).

    The cells' rows are the run's rows recoded (`virtual_data`): a cell's policy is the run's policy, and its
    calibration cells are the run's cells or (with the segment covariate) the (run's cell, segment) pairs; the
    map is read from the rows and checked on every row."""
    ci, vci = prep.design.cells, vprep.design.cells
    if ci is None or vci is None or ci.row_cell.size != vci.row_cell.size:
        return None
    G = ci.cells.size
    cell_map = np.zeros(vci.cells.size, dtype=np.int64)
    cell_map[vci.row_cell] = ci.row_cell
    if not np.array_equal(cell_map[vci.row_cell], ci.row_cell):
        return None
    return (cells[:, 0].astype(np.int64)[:, None] * G + cell_map[None, :]).ravel()


def segment_pass(prep: Any) -> SegmentPass:
    """`SegmentPass` of a prepared run with segments (``prep.segments``): the plan, the omnibus tests, the
    recalibration decision and the prepared cells, without replicates (`summarize_segments` reads it)."""
    opts, d = prep.options, prep.design.data
    group, group_names, info = plan_segments(d.policy, prep.segments.code, d.labelled, len(d.policies),
                                             prep.segments.names, opts.segment_min_rows, opts.segment_min_labels)
    omnibus = omnibus_tests(prep, group, group_names)
    recalibrate = opts.segment_recalibrate == "auto" and bool(omnibus[0]["reject"])
    vprep, cells, recal = segment_prepared(prep, group, group_names, recalibrate)
    joint = opts.inference == "bootstrap" and getattr(prep, "replay", None) is None
    return SegmentPass((group, group_names, info), omnibus, vprep, cells, recal,
                       plain_keys(prep, vprep, cells) if joint else None)


def summarize_segments(prep: Any, rows: SegmentRows, plan: tuple | None = None, cell_pass: Any = None,
                       precomputed: SegmentPass | None = None) -> dict:
    """The result's ``segments`` block (`cje_engine.result.segments.SegmentsResult`) of a prepared run.

    ``plan`` and ``cell_pass`` are for a run whose rows are not in ``prep`` (the sharded row pass,
    `cje_engine.pipeline.sharded_segments`): ``plan`` is `plan_segments`' ``(group, group_names, info)`` with
    ``group`` given for the rows of ``prep.design.data`` only; ``cell_pass`` replaces `segment_cells`.
    ``precomputed``: the run's `SegmentPass` (with the cells' replicates computed beside the run's,
    `cje_engine.pipeline.direct.bootstrap_chunk`), used instead of computing it again.
    """
    opts, d = prep.options, prep.design.data
    alpha, K = opts.alpha, len(d.policies)
    baseline = opts.baseline or d.policies[0]
    b = d.policies.index(baseline)
    if precomputed is not None:
        (group, group_names, info), omnibus = precomputed.plan, precomputed.omnibus
        vprep, cells, recal = precomputed.vprep, precomputed.cells, precomputed.recal
        reps = precomputed.replicates(opts.n_bootstrap, opts.seed) if opts.inference == "bootstrap" else None
    else:
        group, group_names, info = plan if plan is not None else plan_segments(
            d.policy, rows.code, d.labelled, K, rows.names, opts.segment_min_rows, opts.segment_min_labels)
        omnibus = omnibus_tests(prep, group, group_names)
        recalibrate = opts.segment_recalibrate == "auto" and bool(omnibus[0]["reject"])
        vprep, cells, recal, reps = (cell_pass or segment_cells)(prep, group, group_names, recalibrate)
    G = len(group_names)
    too_few = {g for g, n in enumerate(group_names) if n == OTHER and info[-1]["status"] == "too_few"}
    s = summarize_direct(vprep, reps)
    n_v = len(cells)
    names = list(vprep.design.data.policies)
    where = {(int(k), int(g)): i for i, (k, g) in enumerate(cells)}

    cell_blocks, printed = [], {}
    for i, (k, g) in enumerate(cells):
        pol = s.policies[names[i]]
        if g in too_few:
            kind, col, reason = "too_few", None, (f"'{OTHER}' holds too few rows or labels (at least "
                                                  f"{opts.segment_min_rows} rows of each policy and "
                                                  f"{opts.segment_min_labels} labels)")
        else:
            kind, col, reason = _cell_level(pol, int(s.cols[i]), n_v, int(s.assumed_cols[i]))
        printed[i] = (kind, col)
        cell_blocks.append({"i": i, "k": int(k), "g": int(g), "kind": kind, "col": col, "reason": reason, "pol": pol})

    n_cells, n_shown = len(cell_blocks), sum(c["col"] is not None for c in cell_blocks)
    lvl = by_interval_level(n_shown, n_cells, alpha) or 1 - alpha
    est = s.reps  # extended replicates (B, 4 n_v) or None
    infl = s.influence
    _, aud_p = _audit_family(s, names)
    out_cells = []
    for c in cell_blocks:
        pol, col = c["pol"], c["col"]
        a = pol.audit
        block = {"segment": group_names[c["g"]], "policy": d.policies[c["k"]], "n_rows": pol.n_rows,
                 "n_prompts": pol.n_prompts or 0, "n_labels": pol.n_labelled, "claim_kind": c["kind"],
                 "estimate": None, "se": None, "ci": None, "ci_marginal": None, "assumed_estimate": None,
                 "plug_in": None,
                 "reason": c["reason"],
                 "audit": {"verdict": a.verdict, "n_labels": a.n_labels, "residual_mean": a.residual_mean,
                           "se": a.se, "p_value": a.p_value, "p_adjusted": aud_p.get(c["i"])}}
        if col is not None:
            level = _level_of(s, c["i"], col, n_v, pol)
            block.update(level)
            if level["se"] is not None and level["estimate"] is not None:
                block["ci"] = (level["ci_marginal"] if abs(lvl - (1 - alpha)) < 1e-12
                               else _clip(normal_interval(level["estimate"], level["se"], lvl, float(s.dfs[col])),
                                          d.label_scale))
            if c["kind"] == "verified" and pol.assumed is not None:
                block["assumed_estimate"] = pol.assumed.estimate
        if c["kind"] != "too_few" and pol.plug_in is not None:
            block["plug_in"] = pol.plug_in.estimate
        out_cells.append(block)

    comps = []
    for g in range(G):
        if (b, g) not in where:
            continue
        ib = where[(b, g)]
        for k in range(K):
            if k == b or (k, g) not in where:
                continue
            i = where[(k, g)]
            comps.append(_comparison(s, est, infl, i, ib, printed, n_v, alpha, group_names[g], d.policies[k],
                                     baseline))
    live = [c for c in comps if c["p_value"] is not None and np.isfinite(c["p_value"])]
    if live:
        padj = adjust(np.array([c["p_value"] for c in live]), opts.segment_claims)
        for c, p in zip(live, padj):
            c["p_adjusted"] = float(p)
            c["significant"] = bool(p <= alpha)
            c["better"] = c["significant"] and c["diff"] > 0
            c["worse"] = c["significant"] and c["diff"] < 0
    R, m = sum(bool(c.get("significant")) for c in live), len(live)
    cmp_level = by_interval_level(R, m, alpha)
    for c in live:
        if c["significant"]:
            c["ci_fcr"] = normal_interval(c["diff"], c["se"], cmp_level, c["df"] if c["df"] is not None else np.inf)
    err = {"alpha": alpha, "claims_method": opts.segment_claims, "n_comparisons": m, "n_selected": R,
           "comparison_interval_method": "by_fcr", "comparison_interval_level": cmp_level,
           "n_cells": n_cells, "n_shown": n_shown, "level_interval_level": lvl, "audit_method": "holm",
           "omnibus": "clustered Wald chi-square on the mean residuals by segment and by score decile, one test per "
                      "policy and one over all labels, each at alpha; the calibration by segment is refitted when "
                      "the test over all labels fails"}
    pooling = partial_pooling(out_cells, alpha, d.label_scale) if opts.segment_pooling == "eb" else None
    block = {"columns": list(rows.columns), "baseline": baseline, "partial_pooling": pooling, "min_rows": opts.segment_min_rows,
             "min_labels": opts.segment_min_labels, "segments": info, "cells": out_cells, "comparisons": comps,
             "error_control": err, "omnibus": omnibus, "recalibration": recal, "reliability": reliability(prep)}
    return SegmentsResult.model_validate(_plain(block)).model_dump(mode="json", exclude_none=False)


def partial_pooling(cells: list[dict], alpha: float, scale: tuple[float, float]) -> list[dict]:
    """Empirical-Bayes pooling (`eb_pool`) of each policy's verified segment levels (three or more); writes
    each pooled cell's ``pooled`` block and returns the per-policy `PartialPooling` blocks."""
    out = []
    for policy in dict.fromkeys(c["policy"] for c in cells):
        mine = [c for c in cells if c["policy"] == policy and c["claim_kind"] == "verified"
                and c["estimate"] is not None and c["se"] is not None and c["se"] > 0]
        if len(mine) < 3:
            continue
        r = eb_pool(np.array([c["estimate"] for c in mine]), np.array([c["se"] for c in mine]), alpha)
        for j, c in enumerate(mine):
            c["pooled"] = {"estimate": float(r["estimate"][j]), "ci": _clip(list(map(float, r["ci"][j])), scale),
                           "shrinkage": float(r["shrinkage"][j])}
        out.append({"policy": policy, "method": "robust_ebci", "n_segments": len(mine), "mean": r["mean"],
                    "mean_se": r["mean_se"], "mu2": r["mu2"]})
    return out


def _audit_family(s: Any, names: list[str]) -> tuple[list[int], dict]:
    """Holm over the audited cells: index -> adjusted p-value."""
    idx = [i for i, n in enumerate(names) if s.policies[n].audit.p_value is not None]
    if not idx:
        return idx, {}
    p = holm(np.array([s.policies[names[i]].audit.p_value for i in idx], dtype=float))
    return idx, {i: float(q) for i, q in zip(idx, p)}


def _clip(ci: list[float], scale: tuple[float, float]) -> list[float]:
    return [max(ci[0], scale[0]), min(ci[1], scale[1])]


def _level_of(s: Any, i: int, col: int, n_v: int, pol: Any) -> dict:
    """Estimate, SE and marginal interval of the printed level of cell ``i`` (column ``col``)."""
    if col == int(s.cols[i]) and pol.estimate is not None:
        return {"estimate": pol.estimate, "se": pol.se, "ci_marginal": pol.ci}
    a = pol.assumed
    return {"estimate": a.estimate, "se": a.se, "ci_marginal": a.ci}


def _comparison(s: Any, reps: np.ndarray | None, infl: np.ndarray, i: int, ib: int, printed: dict, n_v: int,
                alpha: float, segment: str, policy: str, baseline: str) -> dict:
    """``policy - baseline`` in one segment, on the levels both cells print."""
    (ka, ca), (kb, cb) = printed[i], printed[ib]
    out = {"segment": segment, "policy": policy, "baseline": baseline, "claim_kind": "too_few", "diff": None,
           "se": None, "df": None, "ci": None, "ci_fcr": None, "p_value": None, "p_adjusted": None,
           "significant": None, "better": None, "worse": None}
    if ca is None or cb is None or "too_few" in (ka, kb):
        return out
    kind = "verified" if ka == kb == "verified" else "assumes_transport"
    if kind == "assumes_transport":  # compare the same kind of level: both plug-ins (the protocol's)
        ca, cb = int(s.assumed_cols[i]), int(s.assumed_cols[ib])
    est = np.array([_stat(s, ca, i), _stat(s, cb, ib)])
    df = float(np.nanmin([s.dfs[ca], s.dfs[cb], np.inf]))
    r = paired_difference(est[0], est[1], None if reps is None else reps[:, ca], None if reps is None else reps[:, cb],
                          infl[:, ca], infl[:, cb], alpha, df)
    out.update(claim_kind=kind, diff=r["diff"], se=r["se"] if np.isfinite(r["se"]) else None, ci=r["ci"],
               p_value=r["p_value"] if np.isfinite(r["p_value"]) else None, df=df if np.isfinite(df) else None)
    return out


def _stat(s: Any, col: int, i: int) -> float:
    """The point estimate of extended column ``col`` (the summaries keep them per policy)."""
    n = list(s.policies)[i]
    pol = s.policies[n]
    n_v = len(s.policies)
    block, k = divmod(col, n_v)
    if block == 0:
        return float(pol.plug_in.estimate)
    if block == 1:
        return float(pol.augmented.estimate)
    if block == 3:
        return float(pol.verified.estimate)
    return float(pol.oracle_only.estimate) if pol.oracle_only else float("nan")


def _plain(x: Any) -> Any:
    """Numbers made JSON-plain (NaN/inf to None)."""
    return jsonable(x)
