"""Logs-only and hybrid evaluation as a mode of the engine: prepare, bootstrap chunks, finalize.

``evaluate_offpolicy(logged, fresh, mode=...)`` is ``finalize(prep, [bootstrap_chunk(prep, 0, B)])``
with ``prep = prepare(logged, fresh, ...)``, exactly like Direct's `cje_engine.pipeline.direct`, and for
the same reason: replicate ``b`` depends only on ``(seed, b)``, so the bootstrap can be chunked
over workers (the evaluate flow does it on Ray) with bit-identical numbers.

What is shared with Direct (not re-implemented):

- the data go through `cje_engine.data.io.load_frame` (see `cje_engine.data.offpolicy`);
- the calibration: `cje_engine.pipeline.direct.prepare` runs on the logged responses (as the logger's
  rows) plus the fresh draws (as each candidate's rows): mode selection (``auto`` by
  out-of-fold RMSE), the cross-fitted calibrator and its folds by prompt hash; the rewards and the
  DR outcome model come from that one cross-fit (`outcome_model`);
- the bootstrap: prompt multiplicities `cje_engine.direct.estimators.bootstrap_weights(seed, b, G)`; in
  each replicate Direct's statistics come from `cje_engine.pipeline.direct.bootstrap_chunk` and the
  off-policy ones from the same prompt draw, with the calibrator (`registry.get(mode).make`, full fit
  plus one fit per held-out fold) and SIMCal refitted, so every difference is paired;
- the Direct entries (logger, and each candidate's fresh draws in hybrid mode) are
  `cje_engine.pipeline.policies.summarize_direct`, whose calibration summary, audits and support
  checks are reused; comparisons, multiplicity, ranking and the best policy are
  `cje_engine.inference.comparisons.relative_claims` and the result is built by
  `cje_engine.pipeline.assemble.assemble`, exactly as for Direct.

Rewards: ``R`` is Direct's calibrated value of each row (out-of-fold on calibration rows, the
full fit elsewhere), so the Direct estimate of a candidate from its fresh draws equals Direct's
plug-in. The DR outcome model ``q`` is the cross-fitted ``f^(-k)`` for every row (k = fold of the
row's prompt), on logged rows and fresh draws alike.

Headline estimate per candidate (``estimator="auto"``): calibrated IPS (SIMCal) in logs-only
mode and for candidates without fresh draws; the IF stack (over SNIPS, calibrated IPS, DR and
Direct, leaving out refused components) for candidates with fresh draws in hybrid mode.
Gate verdicts (`cje_engine.offpolicy.estimators.gate_verdicts`) become ``level_claim``: "refused" keeps the
reasons and a recommendation to collect fresh draws (Direct); "downgraded" keeps the level
(``downgraded="ok"``, with a warning) or refuses it (``downgraded="refused"``). In hybrid mode a
candidate whose own labels fail the transport audit takes Direct's level path: with enough own labels
(``min_labels``) its level is Direct's recalibrated one (fresh draws plus own labels, Direct's
replicates and influence in comparisons), otherwise it is refused and not estimable even relatively,
as in Direct: every off-policy estimate rests on the logger's calibration.

Inference: ``inference="bootstrap"`` (default) or ``"analytic"`` (no replicates: each estimate's
clustered influence function with the first-order calibration term, normal intervals; comparisons
from the influence columns), which agrees with the bootstrap SE within 25% (tests/unit/test_offpolicy_analytic.py).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

import numpy as np
import pandas as pd

from cje_engine.data.frame import EvalData
from cje_engine.data.offpolicy import (
    LOGGER_COLUMNS,
    OffPolicyData,
    load_offpolicy,
    projection_columns,
)
from cje_engine.direct.estimators import Design, bootstrap_weights, cross_fit_models
from cje_engine.errors import CJEInputError
from cje_engine.inference.comparisons import PolicyColumns, claim_kind, relative_claims
from cje_engine.inference.variance import align_clusters, cluster_cov
from cje_engine.offpolicy.gates import OffPolicyGates
from cje_engine.offpolicy.influence import calibration_term
from cje_engine.offpolicy.inputs import FreshData, LoggedData, Rewards
from cje_engine.offpolicy.target import TargetReport, compute_estimates, evaluate_target
from cje_engine.pipeline import direct as direct_pipeline
from cje_engine.pipeline.assemble import assemble
from cje_engine.pipeline.direct import (assumes_transport_block, direct_data_summary, inference_summary,
                                       rank_only_bias, stacked_replicates)
from cje_engine.pipeline.offpolicy_options import OffPolicyOptions
from cje_engine.pipeline.offpolicy_segments import summarize_offpolicy_segments
from cje_engine.pipeline.policies import summarize_direct, variance_components
from cje_engine.pipeline.segments import SegmentRows
from cje_engine.pipeline.targets import claimed_entry, protocol_view, target_entry, uses_direct_level
from cje_engine.result import EvaluationResult

log = logging.getLogger(__name__)


@dataclass
class OffPolicyPrepared:
    """Everything computed before the bootstrap (picklable; shipped to workers whole): the off-policy
    modes' `cje_engine.pipeline.prepared.Prepared`."""

    options: OffPolicyOptions
    data: OffPolicyData
    direct: Any  # cje_engine.pipeline.direct.Prepared of the logger's rows plus the fresh draws
    logged_rows: np.ndarray  # rows of the design that are logged responses
    fresh_rows: dict[str, np.ndarray]
    logged: dict[str, LoggedData]
    fresh: dict[str, FreshData | None]
    reports: dict[str, TargetReport]
    headline: dict[str, str]
    layout: list[tuple[str, str]]  # off-policy replicate columns: (candidate, estimator)
    rewards: np.ndarray
    q: np.ndarray
    notes: list[str]
    segments: Any = None  # `cje_engine.pipeline.segments.SegmentRows` of the frame's rows (``segment_by``), or None

    @property
    def n_direct_stats(self) -> int:
        """Columns of a replicate that are Direct's (the logger's and the fresh draws' statistics)."""
        return int(self.direct.n_replicate_stats)

    def replicates(self, start: int, stop: int) -> np.ndarray:
        """Bootstrap replicates ``start..stop-1`` (`bootstrap_chunk`)."""
        return bootstrap_chunk(self, start, stop)

    def check_bootstrap_memory(self) -> None:
        """The engine options' memory check (as the flow ran it: one statistic)."""
        self.options.engine.check_bootstrap_memory(1)

    def bootstrap_source(self) -> "OffPolicyPrepared":
        """This state: its replicates read the whole design."""
        return self

    def finalize(self, chunks: Sequence[np.ndarray]) -> "OffPolicyResult":
        """The result from the bootstrap chunks (`finalize`)."""
        return finalize(self, chunks)


def outcome_model(design: Design, full, models: Sequence | None) -> np.ndarray:
    """The DR outcome model ``q[i] = f^(-k(i))`` of every design row, from the cross-fit's fold models.

    ``k(i)`` is the fold of the row's prompt; a fold without a model (an empty complement, or no
    calibration rows of its own) keeps the full fit. On calibration rows ``q`` equals the
    cross-fitted value ``f`` (`cje_engine.direct.estimators.cross_fit_models`).
    """
    d = design.data
    q = full.predict(d.score, d.X)
    for k, model in enumerate(models or []):
        rows = d.fold == k
        if model is not None and rows.any():
            q[rows] = model.predict(d.score[rows], d.X[rows])
    return q


def rewards_and_outcome(design: Design, row_w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Calibrated rewards ``R`` (out of fold on calibration rows, the full fit elsewhere) and the
    outcome model ``q`` of every design row under row weights (one cross-fit)."""
    R, full, models = cross_fit_models(design, row_w)
    return R, outcome_model(design, full, models)


def _headline(opts: OffPolicyOptions, report: TargetReport, has_fresh: bool, notes: list[str], t: str) -> str:
    if opts.estimator == "auto":
        if opts.mode == "hybrid" and has_fresh:
            return "stacked" if "stacked" in report.estimates else "dr"
        return "calibrated_ips"
    if opts.estimator in report.estimates:
        return opts.estimator
    notes.append(f"{t}: estimator '{opts.estimator}' needs fresh draws, which '{t}' has none of; its headline is "
                 "calibrated IPS")
    return "calibrated_ips"


def prepare(logged: Any, fresh: Any = None, options: OffPolicyOptions | None = None,
            **kwargs: Any) -> OffPolicyPrepared:
    """Load and validate, calibrate (Direct's `prepare`), point estimates, diagnostics, gates.

    Parameters
    ----------
    logged, fresh : see `cje_engine.data.offpolicy.load_offpolicy`
    options : OffPolicyOptions, optional
        The options parsed once at the edge (used as they are); or
    **kwargs : keyword options, see `OffPolicyOptions` (mode, targets, gates, ... and the engine's options)
    """
    opts = OffPolicyOptions.of(options, **kwargs)
    eng = opts.engine
    data = load_offpolicy(logged, fresh, mode=opts.mode, targets=opts.targets, logger_policy=opts.logger,
                          covariates=eng.covariates, label_scale=eng.label_scale, score_scale=eng.score_scale,
                          logger_column=opts.logger_column, length_column=opts.length_column,
                          segment_by=eng.segment_by)
    return prepare_data(data, opts)


def prepare_data(data: OffPolicyData, opts: OffPolicyOptions) -> OffPolicyPrepared:
    """`prepare` from loaded data (`cje_engine.data.offpolicy.OffPolicyData`): calibrate, point estimates,
    diagnostics, gates; a segment's evaluation runs this on the segment's rows (docs/segments.md)."""
    eng = opts.engine
    ed = EvalData.from_frame(data.frame, covariates=eng.covariates, label_scale=eng.label_scale,
                             score_scale=eng.score_scale, n_folds=eng.n_folds)
    direct = direct_pipeline.prepare(ed, replace(eng, segment_by=()) if eng.segment_by else eng)
    R, q = direct.f, outcome_model(direct.design, direct.full, direct.models)
    pol = np.asarray(ed.policies)[ed.policy]
    logged_rows = np.arange(data.n_logged)
    assert np.all(pol[logged_rows] == data.logger)
    config = opts.config()
    notes = list(data.notes)
    fresh_rows, lds, fds, reports, headline = {}, {}, {}, {}, {}
    layout: list[tuple[str, str]] = []
    for t in data.targets:
        ld = data.logged_data(t)
        fr = data.fresh_rows(t) if opts.mode == "hybrid" else np.empty(0, dtype=int)
        fd = data.fresh_data(t) if fr.size else None
        rw = (Rewards(R[logged_rows], R[fr], q[logged_rows], q[fr]) if fd is not None else Rewards(R[logged_rows]))
        rep = evaluate_target(ld, rw, fd, target=t, config=config)
        fresh_rows[t], lds[t], fds[t], reports[t] = fr, ld, fd, rep
        headline[t] = _headline(opts, rep, fd is not None, notes, t)
        layout.extend((t, k) for k in rep.estimates)
    log.info("off-policy prepared: mode=%s, logger=%s, %d logged rows, candidates %s", opts.mode, data.logger,
             data.n_logged, ", ".join(f"{t} ({headline[t]}: {reports[t].verdicts[headline[t]].claim})"
                                      for t in data.targets))
    seg = None
    if data.segment_values is not None:
        code, names = pd.factorize(pd.Series(data.segment_values, dtype=object).astype(str), sort=True)
        seg = SegmentRows(tuple(eng.segment_by), tuple(str(n) for n in names), code.astype(np.int64))
    return OffPolicyPrepared(opts, data, direct, logged_rows, fresh_rows, lds, fds, reports, headline, layout,
                             R, q, notes, seg)


# --------------------------------------------------------------------------------------------
# bootstrap
# --------------------------------------------------------------------------------------------


def _expand(rows: np.ndarray, prompt: np.ndarray, mult: np.ndarray, big: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions into ``rows`` repeated by their prompt's multiplicity, and a cluster label per copy
    (prompt * big + copy number: the k-th draw of a prompt is one cluster across logs and fresh draws)."""
    r = mult[prompt[rows]]
    pos = np.repeat(np.arange(rows.size), r)
    starts = np.cumsum(r) - r
    copy = np.arange(pos.size) - np.repeat(starts, r)
    return pos, prompt[rows][pos] * big + copy


def _replicate(prep: OffPolicyPrepared, mult: np.ndarray) -> np.ndarray:
    """Off-policy statistics (``prep.layout`` order) under prompt multiplicities ``mult``."""
    design = prep.direct.design
    d = design.data
    R, q = rewards_and_outcome(design, mult[d.prompt].astype(float))
    m = mult.astype(np.int64)
    big = int(m.max()) + 1
    config = prep.options.config()
    out: dict[tuple[str, str], float] = {}
    L = prep.logged_rows
    li, lc = _expand(L, d.prompt, m, big)
    for t in prep.data.targets:
        ld, rep = prep.logged[t], prep.reports[t]
        F = prep.fresh_rows[t]
        vals: dict[str, float] = {}
        if li.size:
            rows = L[li]
            fc = None
            if F.size:
                fi, fc = _expand(F, d.prompt, m, big)
                rw = Rewards(R[rows], R[F[fi]], q[rows], q[F[fi]]).checked(rows.size, fi.size) if fi.size else None
            else:
                rw = Rewards(R[rows]).checked(rows.size, None)
            if rw is not None:
                ests, _, _ = compute_estimates(ld.log_w[li], ld.scores[li], d.fold[rows], lc, rw, fc, config,
                                                rep.stack_candidates)
                vals = {k: e.value for k, e in ests.items()}
        for k in rep.estimates:
            out[(t, k)] = vals.get(k, np.nan)
    return np.array([out[key] for key in prep.layout], dtype=float)


def bootstrap_chunk(prep: OffPolicyPrepared, start: int, stop: int) -> np.ndarray:
    """Replicates ``start..stop-1``: Direct's statistics then the off-policy ones, from one prompt draw.

    Returns an array of shape ``(stop - start, n_direct_stats + len(prep.layout))``; replicate
    ``b`` depends only on ``(seed, b)``.
    """
    direct = direct_pipeline.bootstrap_chunk(prep.direct, start, stop)
    n_p = prep.direct.design.data.n_prompts
    seed = prep.options.engine.seed
    off = np.empty((stop - start, len(prep.layout)))
    for i, b in enumerate(range(start, stop)):
        off[i] = _replicate(prep, bootstrap_weights(seed, b, n_p))
    return np.hstack([direct, off])


# --------------------------------------------------------------------------------------------
# finalize
# --------------------------------------------------------------------------------------------


class OffPolicyResult(EvaluationResult):
    """Result of `evaluate_offpolicy`: the same schema as Direct (``to_dict``, ``to_policy_table``)
    plus ``reports`` (candidate -> `TargetReport`)."""

    def __init__(self, data: dict, replicates: np.ndarray, influence: np.ndarray, columns: np.ndarray,
                 reports: dict[str, TargetReport], dfs: np.ndarray | None = None) -> None:
        super().__init__(data, replicates=replicates, influence=influence, columns=columns, dfs=dfs)
        self.reports = reports


def _target_influence(prep: OffPolicyPrepared, t: str, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-prompt influence of candidate ``t``'s estimate ``name`` (default: the headline):
    (total, calibration part).

    Total = the estimator's clustered influence with the calibrator fixed (`Estimate.psi`) plus
    the first-order effect of estimating the calibrator (`cje_engine.offpolicy.influence`).
    """
    design = prep.direct.design
    d = design.data
    name = name or prep.headline[t]
    est = prep.reports[t].estimates[name]
    psi = align_clusters(est.clusters, est.psi, d.prompt_ids)
    a_logged, a_fresh = prep.reports[t].reward_weights[name]
    rows, a = prep.logged_rows, a_logged
    if a_fresh is not None:
        rows, a = np.concatenate([rows, prep.fresh_rows[t]]), np.concatenate([a_logged, a_fresh])
    cal = calibration_term(design, prep.direct.full, rows, a, prep.rewards[design.cal_rows])
    return psi + cal, cal


def _influence_ses(prep: OffPolicyPrepared, t: str) -> dict[str, float]:
    """Influence-function SE (with the calibration term) of every estimate of candidate ``t``."""
    out = {}
    for k, e in prep.reports[t].estimates.items():
        if not (np.isfinite(e.value) and np.all(np.isfinite(e.psi))) or k not in prep.reports[t].reward_weights:
            out[k] = float(e.se)
            continue
        total, _ = _target_influence(prep, t, k)
        out[k] = float(np.sqrt(max(cluster_cov(total)[0, 0], 0.0)))
    return out


def _variance(total: np.ndarray, cal: np.ndarray, n_prompts: int, m_labels: int) -> dict:
    v_tot = float(cluster_cov(total)[0, 0])
    v_cal = float(cluster_cov(cal)[0, 0])
    return {"variance_components": variance_components(v_tot, v_cal, n_prompts, m_labels),
            "variance_share_calibration": v_cal / v_tot if v_tot > 0 else None}


def _logger_entry(direct_entry: dict) -> dict:
    lp = dict(direct_entry)
    lp["claim"] = "refused" if lp["level_claim"] == "refused" else "level"  # no gates: the logger's own rows
    lp["offpolicy"] = {"role": "logger", "estimator": "direct (on-policy logs)"}
    return lp


def _data_summary(prep: OffPolicyPrepared, names: list[str]) -> dict:
    base = direct_data_summary(prep.direct)
    return {"n_rows": int(prep.data.frame.shape[0]), "n_prompts": base["n_prompts"],
            "n_labelled": base["n_labelled"], "n_calibration_labels": base["n_calibration_labels"],
            "policies": names, "covariates": list(prep.options.engine.covariates), "logger": prep.data.logger,
            "n_logged": prep.data.n_logged, "n_fresh": {t: int(prep.fresh_rows[t].size) for t in prep.data.targets},
            "source": prep.data.source, "logger_column": prep.data.logger_column}


def _run_block(prep: OffPolicyPrepared, direct_policies: dict, protocol: dict) -> dict:
    """The result's ``offpolicy`` block: mode, logger, each candidate's protocol estimator, gates, options and
    Direct's reported entry of each candidate's fresh draws (``protocol``: Direct's protocol views)."""
    opts = prep.options
    return {
        "mode": opts.mode, "logger": prep.data.logger, "targets": list(prep.data.targets),
        "estimator": {t: ("direct_recalibrated" if uses_direct_level(prep, t, protocol) else h)
                      for t, h in prep.headline.items()}, "gates": asdict(opts.gates),
        "simcal": {"rho": opts.rho, "projection": opts.projection, "stack_by": opts.simcal_stack_by},
        "ttc_mass": opts.ttc_mass, "stack": list(opts.stack), "downgraded": opts.downgraded,
        "direct_from_fresh": {t: {k: direct_policies[t][k] for k in ("estimate", "se", "ci", "level_claim",
                                                                   "basis_code")}
                              for t in prep.data.targets if t in direct_policies},
    }


@dataclass
class _Column:
    """Where a reported level's replicates and influence terms are: Direct's extended columns
    (``direct`` True: `DirectSummaries.reps`/``influence``, index ``index``) or a candidate's off-policy
    estimate (``off``: its (candidate, estimator) key in ``prep.layout``)."""

    direct: bool
    index: int = -1
    off: tuple[str, str] | None = None


def _stack_columns(prep: OffPolicyPrepared, direct, reps_off: np.ndarray | None, policies: dict, levels: dict,
                   where: dict[str, _Column], head_infl: dict[str, np.ndarray], boot: bool) -> PolicyColumns:
    """The comparison step's view of one family of levels (``levels[name]``: a dict with estimate, level_claim,
    basis_code, relative_claim/reason; ``where[name]``: its column; ``head_infl``: each candidate's headline
    influence terms), Direct's way (`cje_engine.pipeline.direct.direct_columns`)."""
    eng = prep.options.engine
    names = list(policies)
    layout = {key: j for j, key in enumerate(prep.layout)}
    rep_cols, infl, dfs = [], [], []
    for n in names:
        c = where[n]
        if c.direct:
            rep_cols.append(direct.reps[:, c.index] if boot else np.empty(0))
            infl.append(np.nan_to_num(direct.influence[:, c.index]))
            dfs.append(float(direct.dfs[c.index]))
        else:
            rep_cols.append(reps_off[:, layout[c.off]] if boot else np.empty(0))
            infl.append(head_infl[c.off[0]])
            dfs.append(np.inf)
    relative = [levels[n]["relative_claim"] for n in names]
    span = eng.label_scale[1] - eng.label_scale[0]
    return PolicyColumns(
        names=names, estimate=np.array([np.nan if levels[n]["estimate"] is None else levels[n]["estimate"]
                                        for n in names], dtype=float),
        replicates=np.column_stack(rep_cols) if boot else None, influence=np.column_stack(infl),
        dfs=np.array(dfs, dtype=float), refused=np.array([levels[n]["level_claim"] == "refused" for n in names]),
        claims=[levels[n]["level_claim"] for n in names],
        raw=np.array([policies[n]["raw_judge_mean"] for n in names], dtype=float),
        relative=relative, relative_reason=[levels[n]["relative_reason"] for n in names],
        kinds=[claim_kind(levels[n]["basis_code"]) for n in names],
        bias_bound=rank_only_bias([policies[n]["support"]["share_thin"] or 0.0 for n in names], span, relative),
        labels=np.array([policies[n]["audit"]["n_labels"] for n in names], dtype=float),
        calibration_labels=float(max(int(prep.direct.design.cal_rows.size), 1)))


def finalize(prep: OffPolicyPrepared, chunks: Sequence[np.ndarray]) -> OffPolicyResult:
    """Direct's entries for the logger (and the fresh draws), every candidate's gated entry under Direct's
    verified-claim rule (`cje_engine.pipeline.targets.claimed_entry`), then the shared comparison, ranking and
    result steps for the verified claims and for the assumes-transport ones (the best policy is never a refused
    one)."""
    eng = prep.options.engine
    nd = prep.n_direct_stats
    boot = eng.inference == "bootstrap"
    reps = stacked_replicates(chunks, eng.n_bootstrap if boot else 0, nd + len(prep.layout))
    direct = summarize_direct(prep.direct, reps[:, :nd] if boot else None)
    # the candidates' entries are built as dicts (`target_entry`): Direct's typed entries in their JSON form
    direct_policies = {n: p.model_dump(exclude_unset=True, by_alias=True) for n, p in direct.policies.items()}
    d = prep.direct.design.data
    k_of = {n: k for k, n in enumerate(d.policies)}
    # the protocol's levels (what the candidates' off-policy entries are built on), Direct's rule on top
    protocol = {n: protocol_view(p, direct.assumed_relative[k_of[n]]) for n, p in direct_policies.items()}
    off = reps[:, nd:] if boot else None
    warnings = direct.warnings + list(prep.notes)
    logger_name = prep.data.logger
    k_log = k_of[logger_name]
    policies = {logger_name: _logger_entry(direct_policies[logger_name])}
    reported = {logger_name: _Column(True, int(direct.cols[k_log]))}
    assumed = {logger_name: _Column(True, int(direct.assumed_cols[k_log]))}
    assumed_levels = {logger_name: protocol[logger_name]}  # each policy's protocol level and its relative status
    n_cal = int(prep.direct.design.cal_rows.size)
    head_infl: dict[str, np.ndarray] = {}
    verified_mode = eng.level_estimator == "verified"
    for t in prep.data.targets:
        total, cal = _target_influence(prep, t)
        head_infl[t] = total
        entry = target_entry(prep, t, off, protocol, warnings, _variance(total, cal, d.n_prompts, n_cal),
                             _influence_ses(prep, t))
        dpol = direct_policies.get(t) if prep.fresh[t] is not None else None
        policies[t], choice = claimed_entry(entry, t, dpol, verified_mode, eng.trusts(t), eng.min_labels)
        assumed_levels[t] = entry
        if uses_direct_level(prep, t, protocol):  # Direct's recalibrated level: its column, paired draws
            assumed[t] = _Column(True, int(direct.assumed_cols[k_of[t]]))
        else:
            assumed[t] = _Column(False, off=(t, prep.headline[t]))
        reported[t] = _Column(True, int(direct.cols[k_of[t]])) if choice == "verified" else assumed[t]
    names = list(policies)
    cols = _stack_columns(prep, direct, off, policies, policies, reported, head_infl, boot)
    span = eng.label_scale[1] - eng.label_scale[0]
    rel = relative_claims(cols, alpha=eng.alpha, method=eng.multiplicity, span=span, warnings=warnings,
                          baseline=eng.baseline, noninferiority_margin=eng.noninferiority_margin * span,
                          planned_labels=eng.sequential_labels)
    rel["assumes_transport"] = assumes_transport_block(
        _stack_columns(prep, direct, off, policies, assumed_levels, assumed, head_infl, boot), eng, span)
    inference = {**inference_summary(eng), "offpolicy": (
        "the same prompt draws refit the calibrator (full and per-fold fits) and SIMCal in every replicate; IF "
        "stacks are re-solved per replicate" if boot else
        "influence functions: each estimator's clustered influence with the calibrator and SIMCal fixed plus the "
        "first-order calibration term (cje_engine.offpolicy.influence); normal intervals")}
    result = assemble(mode=prep.options.mode, config=prep.options.to_dict(), data=_data_summary(prep, names),
                      calibration=direct.calibration, inference=inference, policies=policies, relative=rel,
                      warnings=warnings, offpolicy=_run_block(prep, direct_policies, protocol))
    if prep.segments is not None:
        result["segments"] = summarize_offpolicy_segments(prep, result, evaluate_data)
    return OffPolicyResult(result, cols.replicates if boot else np.empty((0, len(names))), cols.influence,
                           np.arange(len(names)), dict(prep.reports), dfs=cols.dfs)


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def evaluate_data(data: OffPolicyData, options: OffPolicyOptions) -> dict:
    """The whole evaluation (prepare, bootstrap, finalize) of loaded data, as a result dict: one segment's
    evaluation (`cje_engine.pipeline.offpolicy_segments`)."""
    prep = prepare_data(data, options)
    chunks = [bootstrap_chunk(prep, 0, options.n_bootstrap)] if options.inference == "bootstrap" else []
    return finalize(prep, chunks).to_dict()


def evaluate_offpolicy(
    logged: Any,
    fresh: Any = None,
    *,
    mode: str = "logs-only",
    targets: Sequence[str] | None = None,
    covariates: Sequence[str] = (),
    n_bootstrap: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
    calibration_mode: str = "auto",
    gates: OffPolicyGates | dict | None = None,
    options: OffPolicyOptions | None = None,
    **kwargs: Any,
) -> OffPolicyResult:
    """Logs-only or hybrid evaluation of candidate policies from a logger's logged responses.

    Parameters
    ----------
    logged : path, pandas.DataFrame or pyarrow.Table
        The logger's responses with ``base_logprob`` (or ``logger_logprob``) and one
        ``logprob__<policy>`` column per candidate, a long table, the arena's
        ``logged_data.jsonl`` (or its folder), or the evaluate flow's combined log table
        (see `cje_engine.data.offpolicy`).
    fresh : optional
        Fresh draws of the candidates (hybrid), anything `cje_engine.data.io.load_frame` reads.
    mode : {"logs-only", "hybrid"}
    targets : candidates (default: all with a log-probability column)
    covariates, n_bootstrap, alpha, seed, calibration_mode : as Direct's `cje_engine.evaluate`;
        ``inference="analytic"`` (in ``options``) skips the bootstrap: influence-function intervals
        with the first-order calibration term (within 25% of the bootstrap SE, see docs/offpolicy.md)
    gates : `OffPolicyGates` or a dict of thresholds (default: TTC >= 0.70, ESS/n >= 0.30, Hill >= 2)
    options : OffPolicyOptions, optional
        Options parsed once at the edge (e.g. the command line): used as they are, and the keywords
        above are not read.
    **kwargs : see `OffPolicyOptions` (logger, estimator, rho, downgraded, calibration_policies,
        multiplicity, label_scale, score_scale, ...)

    Returns
    -------
    OffPolicyResult
        ``to_dict()`` follows docs/result-schema.md; each candidate adds an ``offpolicy`` block
        (estimates, diagnostics, verdicts, gate checks). Same seed, same numbers.

    Example
    -------
    >>> res = evaluate_offpolicy("arena_sample/logged_data.jsonl", mode="logs-only", logger="base", seed=0)
    >>> res.to_dict()["policies"]["unhelpful"]["level_claim"]
    'refused'
    """
    if options is None:
        options = OffPolicyOptions.build(mode=mode, targets=targets, covariates=covariates, n_bootstrap=n_bootstrap,
                                         alpha=alpha, seed=seed, calibration_mode=calibration_mode, gates=gates,
                                         **kwargs)
    elif kwargs:
        raise CJEInputError(f"give the options as an OffPolicyOptions or as keywords, not both (got "
                            f"{', '.join(sorted(kwargs))} besides)")
    prep = prepare(logged, fresh, options)
    if prep.options.inference != "bootstrap":
        return finalize(prep, [])
    return finalize(prep, [bootstrap_chunk(prep, 0, prep.options.n_bootstrap)])


# --------------------------------------------------------------------------------------------
# helpers for the evaluate flow
# --------------------------------------------------------------------------------------------


def flow_options(options: "dict | OffPolicyOptions | None", policies: Sequence[str] | None,
                 mode: str) -> OffPolicyOptions:
    """The typed options of an off-policy flow run (parsed once; an `OffPolicyOptions` is returned as it is).

    ``policies`` (the flow's parameter) name the candidates when ``options`` has no ``targets``.
    """
    if isinstance(options, OffPolicyOptions):
        return options
    opts = dict(options or {})
    opts["mode"] = mode
    if not opts.get("targets") and policies:
        opts["targets"] = [p for p in policies if p != opts.get("logger")]
    return OffPolicyOptions.build(**opts)


def flow_columns(opts: OffPolicyOptions) -> list[str]:
    """Log columns to read besides Direct's: the logger's and the candidates' log-probabilities
    (and the token counts if ``length_column`` is set, and the ``segment_by`` columns): the read's projection."""
    if not opts.targets:
        raise CJEInputError("an off-policy flow run needs its candidates: give options={'targets': [...]} or "
                            "policies=[...] (the logs' logprob__<policy> columns to read)", column="targets")
    return projection_columns(list(opts.targets), logger_column=opts.logger_column or LOGGER_COLUMNS[0],
                              length_column=opts.length_column) + list(opts.engine.segment_by)


def flow_policies(opts: OffPolicyOptions) -> list[str] | None:
    """Policy filter pushed into the read: the logger plus the candidates (hybrid), the logger alone
    (logs-only), or None when the logger's name is not given."""
    if not opts.logger:
        return None
    return [opts.logger] + (list(opts.targets or []) if opts.mode == "hybrid" else [])


__all__ = ["evaluate_offpolicy", "evaluate_data", "prepare", "prepare_data", "bootstrap_chunk", "finalize", "OffPolicyPrepared",
           "OffPolicyResult", "outcome_model", "rewards_and_outcome", "flow_options", "flow_columns", "flow_policies"]
