"""The evaluation pipeline: prepare (validate, calibrate), bootstrap chunks, finalize.

``evaluate(data, **options)`` is ``finalize(prep, [bootstrap_chunk(prep, 0, B)])`` with
``prep = prepare(data, **options)``. The split exists so an orchestrator can run the
bootstrap in chunks on many workers: replicate ``b`` depends only on ``(seed, b)``, so any
chunking gives bit-identical numbers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from cje_engine.data.frame import EvalData
from cje_engine.data.io import load_coded
from cje_engine.direct.estimators import (BootstrapView, Design, JointView, bootstrap_replicates, bootstrap_view,
                                          bootstrap_weights, fold_jackknife, joint_replicates, own_label_means)
from cje_engine.errors import CJEInputError
from cje_engine.inference.comparisons import PolicyColumns, claim_kind, relative_claims
from cje_engine.inference.intervals import OWN_LABEL_ANALYTIC, OWN_LABEL_BOOTSTRAP
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline.assemble import assemble
from cje_engine.pipeline.calibration import fit_calibration
from cje_engine.pipeline.pooling_replay import PoolingReplay, build_replay
from cje_engine.pipeline.policies import RowTotals, row_totals, summarize_direct
from cje_engine.pipeline.segments import (SegmentPass, SegmentRows, segment_error, segment_pass, segment_rows,
                                         summarize_segments)
from cje_engine.result import EvaluationResult
from cje_engine.result.model import PolicyResult

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """Everything computed before the bootstrap (picklable): Direct's `cje_engine.pipeline.prepared.Prepared`."""

    options: EvaluationOptions
    design: Design
    selection: dict
    f: np.ndarray
    full: Any
    stats: np.ndarray
    infl: dict
    jackknife: np.ndarray
    models: list | None = None  # per-fold calibrators of the cross-fit (None: the fold kept the full fit)
    excluded: list = field(default_factory=list)  # calibration sources removed by robust pooling
    replay: PoolingReplay | None = None  # robust pooling rerun in each replicate (pooling_bootstrap="rerun")
    rows: RowTotals | None = None  # sharded: every row's totals (the design holds the labelled rows only)
    segments: SegmentRows | None = None  # each row's segment (options.segment_by), docs/segments.md

    @property
    def n_replicate_stats(self) -> int:
        """Columns of a bootstrap replicate: the 2K statistics and the K own-label means."""
        return int(self.stats.size + self.design.n_policies)

    def replicates(self, start: int, stop: int) -> np.ndarray:
        """Bootstrap replicates ``start..stop-1`` (`bootstrap_chunk`)."""
        return bootstrap_chunk(self, start, stop)

    def check_bootstrap_memory(self) -> None:
        """The options' memory check for the 2K statistics of a replicate."""
        self.options.check_bootstrap_memory(self.stats.size or 1)

    def bootstrap_source(self) -> Any:
        """The design's `BootstrapView` (8 bytes a row plus the labelled rows; replicates bit-identical
        to `bootstrap_chunk`) unless robust pooling is rerun in each replicate, else this state. With
        ``segment_by`` on the bootstrap route: a `JointView` (the run's and the cells' replicates in one pass
        on the workers, side by side; `finalize` splits them), see `joint_source`."""
        if self.replay is None:
            view = bootstrap_view(self.design, seed=self.options.seed)
            if view.n_policies * 2 == self.stats.size:
                return joint_source(self, view)
        return self

    def finalize(self, chunks: Sequence[np.ndarray]) -> EvaluationResult:
        """The result from the bootstrap chunks (`finalize`)."""
        return finalize(self, chunks)


def _to_evaldata(data: Any, opts: EvaluationOptions) -> tuple[EvalData, SegmentRows | None]:
    if isinstance(data, EvalData):
        if opts.segment_by:
            raise CJEInputError("segment_by needs the rows' columns: give a path, a frame or a table, not an EvalData",
                                option="segment_by")
        return data, None
    try:
        frame, codes = load_coded(
            data,
            label_scale=opts.label_scale,
            score_scale=opts.score_scale,
            covariates=list(opts.covariates),
            policies=list(opts.policies) if opts.policies else None,
            keep_columns=list(opts.segment_by),
        )
    except CJEInputError as exc:
        raise segment_error(exc, opts.segment_by) from None
    seg = segment_rows(frame, opts.segment_by) if opts.segment_by else None
    ed = _from_frame(frame, codes, opts)
    if seg is not None and seg.code.size != ed.n_rows:
        raise CJEInputError(f"segment_by: {seg.code.size} rows read, {ed.n_rows} kept", option="segment_by")
    return ed, seg


def _from_frame(frame: Any, codes: Any, opts: EvaluationOptions) -> EvalData:
    return EvalData.from_frame(
        frame,
        covariates=opts.covariates,
        label_scale=opts.label_scale,
        score_scale=opts.score_scale,
        n_folds=opts.n_folds,
        policies=list(opts.policies) if opts.policies else None,
        consume=True,  # the frame is ours (load_coded's output) and not used afterwards
        codes=codes,  # the ids were factorised by load_coded's identity checks: not again
    )


def prepare(data: Any, options: EvaluationOptions | None = None, **kwargs: Any) -> Prepared:
    """Validate the data, choose and fit the calibration, compute point estimates.

    Parameters
    ----------
    data : path, list of paths, pandas.DataFrame, pyarrow.Table or EvalData
    options : EvaluationOptions, optional
        The options parsed once at the edge (used as they are, never rebuilt); or
    **kwargs : keyword options, see `EvaluationOptions`
    """
    opts = EvaluationOptions.of(options, **kwargs)
    ed, seg = _to_evaldata(data, opts)
    if opts.calibration_policies is not None:
        missing = [p for p in opts.calibration_policies if p not in ed.policies]
        if missing:
            raise CJEInputError(f"calibration policy {missing[0]!r} has no rows", column="policy")
    fit, selection, excluded = fit_calibration(ed, opts)
    jk = fold_jackknife(fit.design, fit.models)
    log.info("prepared %d rows, %d prompts, %d policies, mode=%s%s", ed.n_rows, ed.n_prompts,
             len(ed.policies), selection["chosen"],
             f", excluded from the calibrator: {', '.join(e['policy'] for e in excluded)}" if excluded else "")
    rerun = opts.inference == "bootstrap" and opts.pooling_bootstrap == "rerun"
    replay = build_replay(ed, opts, fit.design, excluded) if rerun else None
    return Prepared(opts, fit.design, selection, fit.f, fit.full, fit.stats, fit.infl, jk, fit.models, excluded,
                    replay, segments=seg)


def bootstrap_chunk(prep: Prepared, start: int, stop: int, with_segments: bool = False) -> np.ndarray:
    """Replicates ``start..stop-1`` of the calibration-aware cluster bootstrap.

    Each replicate resamples prompts with replacement, refits the calibrator (all folds)
    and recomputes every policy's plug-in and augmented value, so differences are paired.
    With ``pooling_bootstrap="rerun"`` and two or more calibration sources each replicate also
    reruns robust pooling on its resample (`cje_engine.pipeline.pooling_replay`), so the intervals
    carry that selection.

    ``with_segments`` (a run with ``segment_by``, in this process): the segment x policy cells' replicates
    are computed in the same pass (one histogram and, when the calibration is the run's, one refit per
    replicate: `cje_engine.direct.estimators.joint_replicates`) and kept on ``prep`` for `finalize`; the
    returned replicates are the same bits either way.
    """
    if with_segments and prep.segments is not None and prep.replay is None and prep.options.inference == "bootstrap":
        sp = segments_of(prep)
        if sp.to_plain is not None:
            seed = prep.options.seed
            plain, cells = joint_replicates(bootstrap_view(prep.design, seed), bootstrap_view(sp.vprep.design, seed),
                                            sp.to_plain, start, stop)
            sp.chunks[(start, stop)] = cells
            return plain
    view = bootstrap_view(prep.design, prep.options.seed)
    if prep.replay is None:
        return bootstrap_replicates(view, start, stop)
    n_p, n2 = prep.design.data.n_prompts, prep.stats.size
    out = np.empty((stop - start, prep.n_replicate_stats))
    for i, b in enumerate(range(start, stop)):
        w = bootstrap_weights(prep.options.seed, b, n_p)
        out[i, :n2] = prep.replay.replicate(w)
        out[i, n2:] = own_label_means(view, w)
    return out


def evaluate(data: Any, options: EvaluationOptions | None = None, **kwargs: Any) -> EvaluationResult:
    """Calibrated Direct evaluation of every policy (see the README and docs/statistics.md).

    ``options``: an `EvaluationOptions` (used as it is), or keyword options (``**kwargs``).

    Example
    -------
    >>> res = evaluate(frame, covariates=["response_length"], n_bootstrap=2000, seed=0)
    >>> res.to_dict()["policies"]["base"]["ci"]
    """
    prep = prepare(data, options, **kwargs)
    chunks = []
    if prep.options.inference == "bootstrap":
        chunks.append(bootstrap_chunk(prep, 0, prep.options.n_bootstrap, with_segments=True))
    return finalize(prep, chunks)


def joint_source(prep: Prepared, view: BootstrapView) -> BootstrapView | JointView:
    """``view`` (the run's `BootstrapView`), or with segment cells on the bootstrap route a `JointView` of the
    run and its cells: a bootstrap worker then computes the cells' replicates in the run's pass (one set of
    prompt weights, one histogram, shared refits; `joint_replicates`), as `bootstrap_chunk(with_segments=True)`
    does in process, and `finalize` does not bootstrap the cells again. The cells' view takes the run's row
    prompts (the same values: shipped once)."""
    if prep.segments is None or prep.options.inference != "bootstrap":
        return view
    sp = segments_of(prep)
    if sp.to_plain is None:
        return view
    cells = bootstrap_view(sp.vprep.design, view.seed)
    if cells.row_prompt is not view.row_prompt and np.array_equal(cells.row_prompt, view.row_prompt):
        cells = replace(cells, row_prompt=view.row_prompt)
    return JointView(view, cells, sp.to_plain)


def split_joint_chunks(prep: Prepared, chunks: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The run's replicates of bootstrap chunks from a `JointView` (run's and cells' columns side by side),
    the cells' kept on the run's `SegmentPass` for `summarize_segments` (as `bootstrap_chunk(with_segments=True)`
    keeps them); chunks of the run's width pass through unchanged. Chunks come in replicate order and cover
    0..B-1 (`stacked_replicates` checks the count)."""
    n = prep.n_replicate_stats
    if prep.segments is None or not chunks or all(np.shape(c)[1] == n for c in chunks):
        return list(chunks)
    sp = segments_of(prep)
    n_cells = 3 * sp.vprep.design.n_policies
    if sp.to_plain is None or any(np.shape(c)[1] != n + n_cells for c in chunks):
        raise ValueError(f"bootstrap chunks of {sorted({np.shape(c)[1] for c in chunks})} columns: expected {n}, "
                         f"or {n + n_cells} (the run's and its segment cells' replicates)")
    sp.chunks.clear()
    sp.chunks[(0, sum(len(c) for c in chunks))] = np.vstack([c[:, n:] for c in chunks])
    return [c[:, :n] for c in chunks]


def segments_of(prep: Prepared) -> SegmentPass:
    """The run's `cje_engine.pipeline.segments.SegmentPass` (plan, omnibus tests, prepared cells), computed once
    and kept on ``prep`` (a private cache: not a field, so not copied by ``dataclasses.replace``)."""
    sp = prep.__dict__.get("_segment_pass")
    if sp is None:
        sp = prep.__dict__["_segment_pass"] = segment_pass(prep)
    return sp


# --------------------------------------------------------------------------------------
# finalize


def stacked_replicates(chunks: Sequence[np.ndarray], n_expected: int, n_stats: int) -> np.ndarray:
    """The bootstrap chunks as one (B, n_stats) array, checking that all replicates arrived."""
    reps = np.vstack(chunks) if chunks else np.empty((0, n_stats))
    if reps.shape[0] != n_expected:
        raise ValueError(f"expected {n_expected} bootstrap replicates, got {reps.shape[0]}")
    if reps.shape[1] != n_stats:
        raise ValueError(f"expected {n_stats} statistics per replicate, got {reps.shape[1]}")
    return reps


def direct_data_summary(prep: Prepared) -> dict:
    """The result's ``data`` block of a Direct evaluation (rows, prompts, labels, policies, covariates)."""
    d = prep.design.data
    return {"n_rows": int(row_totals(prep).n_rows.sum()), "n_prompts": d.n_prompts, "n_labelled": int(d.labelled.sum()),
            "n_calibration_labels": int(prep.design.cal_rows.size), "policies": list(d.policies),
            "covariates": list(d.covariate_names)}


def inference_summary(opts: EvaluationOptions) -> dict:
    """The result's ``inference`` block: route, replicates, interval methods, seed, alpha, cluster."""
    boot = opts.inference == "bootstrap"
    return {"method": opts.inference, "n_bootstrap": opts.n_bootstrap if boot else 0,
            "ci_method": "percentile" if boot else "normal (influence function)",
            "own_label_ci_method": OWN_LABEL_BOOTSTRAP if boot else OWN_LABEL_ANALYTIC,
            "seed": opts.seed, "alpha": opts.alpha, "cluster": "prompt_id"}


def finalize(prep: Prepared, chunks: Sequence[np.ndarray]) -> EvaluationResult:
    """Turn point estimates and bootstrap replicates into the gated, compared result."""
    opts = prep.options
    d = prep.design.data
    use_boot = opts.inference == "bootstrap"
    if use_boot:
        chunks = split_joint_chunks(prep, chunks)  # a `JointView`'s chunks: the cells' replicates kept for them
    reps = stacked_replicates(chunks, opts.n_bootstrap if use_boot else 0, prep.n_replicate_stats)
    s = summarize_direct(prep, reps if use_boot else None)
    K = len(prep.design.data.policies)
    if use_boot and reps.size:
        dropped = int(np.all(np.isnan(reps[:, :2 * K]), axis=1).sum())
        if dropped:
            s.warnings.append(f"{dropped} of {reps.shape[0]} bootstrap replicates drew no calibration label "
                              f"(only {prep.design.cal_rows.size} in all) and were left out of the intervals")
    names = list(d.policies)
    pols = s.policies
    span = d.label_scale[1] - d.label_scale[0]
    cols = direct_columns(s, pols, names, use_boot, span, calibration_labels=prep.design.cal_rows.size)
    rel = relative_claims(cols, alpha=opts.alpha, method=opts.multiplicity, span=span, warnings=s.warnings,
                          baseline=opts.baseline, noninferiority_margin=opts.noninferiority_margin * span,
                          planned_labels=opts.sequential_labels)
    rel["assumes_transport"] = assumed_claims(s, pols, names, use_boot, opts, span, prep.design.cal_rows.size)
    result = assemble(mode="direct", config=opts.to_dict(), data=direct_data_summary(prep),
                      calibration=s.calibration, inference=inference_summary(opts),
                      policies={n: p.model_dump(exclude_unset=True, by_alias=True) for n, p in pols.items()},
                      relative=rel, warnings=s.warnings)
    if prep.segments is not None:
        result["segments"] = summarize_segments(prep, prep.segments, precomputed=prep.__dict__.get("_segment_pass"))
    return EvaluationResult(result, replicates=s.reps, influence=s.influence, columns=s.cols, dfs=s.dfs)


def direct_columns(s, pols: dict[str, PolicyResult], names: list[str], use_boot: bool, span: float,
                   calibration_labels: int = 1) -> PolicyColumns:
    """The comparison step's view of the reported levels (verified, or trusted assumes-transport ones);
    ``calibration_labels`` is the information of a level without own labels (repeated looks)."""
    relative = [pols[n].relative_claim for n in names]
    return PolicyColumns(
        names=names, estimate=np.array([pols[n].estimate for n in names], dtype=float),
        replicates=s.reps[:, s.cols] if use_boot else None, influence=s.influence[:, s.cols],
        dfs=s.dfs[s.cols], refused=s.refused, claims=[pols[n].level_claim for n in names],
        raw=np.array([pols[n].raw_judge_mean for n in names], dtype=float),
        relative=relative, relative_reason=[pols[n].relative_reason for n in names],
        kinds=[claim_kind(pols[n].basis_code) for n in names], bias_bound=rank_only_bias(
            [pols[n].support.share_thin for n in names], span, relative),
        labels=np.array([pols[n].audit.n_labels for n in names], dtype=float),
        calibration_labels=float(max(calibration_labels, 1)))


def rank_only_bias(share_thin: Sequence[float], span: float, relative: list[str]) -> np.ndarray:
    """Bias bound of each rank-only level (every mode): the share of its rows (or, logs-only, of its estimate's
    weight) where calibration support is thin or absent (the calibrator extrapolates there, and can be off by up
    to the label span) times the span; 0 elsewhere."""
    return np.array([float(sh) * span if r == "rank_only" else 0.0 for sh, r in zip(share_thin, relative)])


def assumed_claims(s, pols: dict[str, PolicyResult], names: list[str], use_boot: bool, opts: EvaluationOptions, span: float,
                   calibration_labels: int = 1) -> dict:
    """Comparisons, ranking and best policy on the assumes-transport levels (the paper's protocol),
    kept beside the verified claims and named as such (never the basis of a gate or of "best")."""
    c = s.assumed_cols
    cols = PolicyColumns(
        names=names, estimate=np.array([pols[n].assumed.estimate for n in names], dtype=float),
        replicates=s.reps[:, c] if use_boot else None, influence=s.influence[:, c], dfs=s.dfs[c],
        refused=s.assumed_refused, claims=[pols[n].assumed.level_claim for n in names],
        raw=np.array([pols[n].raw_judge_mean for n in names], dtype=float),
        relative=[r[0] for r in s.assumed_relative], relative_reason=[r[1] for r in s.assumed_relative],
        kinds=[claim_kind(pols[n].assumed.basis_code) for n in names],
        bias_bound=rank_only_bias([pols[n].support.share_thin for n in names], span,
                                  [r[0] for r in s.assumed_relative]),
        labels=np.array([pols[n].audit.n_labels for n in names], dtype=float),
        calibration_labels=float(max(calibration_labels, 1)))
    return assumes_transport_block(cols, opts, span)


def assumes_transport_block(cols: PolicyColumns, opts: EvaluationOptions, span: float) -> dict:
    """The result's ``assumes_transport`` block (every mode): comparisons, ranking and best policy of the
    assumes-transport levels ``cols``, by the same comparison step as the verified claims."""
    rel = relative_claims(cols, alpha=opts.alpha, method=opts.multiplicity, span=span, warnings=[],
                          planned_labels=opts.sequential_labels)
    return {k: rel[k] for k in ("comparisons", "ranking", "best_policy", "best_policy_reason")}
