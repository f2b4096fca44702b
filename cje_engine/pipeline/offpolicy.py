"""Logs-only and hybrid evaluation as a mode of the engine: prepare, bootstrap chunks, finalize.

``evaluate_offpolicy(logged, fresh, mode=...)`` is ``finalize(prep, [bootstrap_chunk(prep, 0, B)])``
with ``prep = prepare(logged, fresh, ...)``, exactly like Direct's `cje_engine.pipeline.direct`, and for
the same reason: replicate ``b`` depends only on ``(seed, b)``, so the bootstrap can be chunked
over workers (the evaluate flow does it on Ray) with bit-identical numbers.

What is shared with Direct (not re-implemented):

- the data go through `cje_engine.data.io.load_frame` (see `cje_engine.data.offpolicy`);
- the calibration: `cje_engine.pipeline.direct.prepare` runs on the logged responses (as the logger's
  rows) plus the fresh draws (as each candidate's rows): mode selection (``auto`` by
  out-of-fold RMSE), the cross-fitted calibrator and its folds by prompt hash;
- the bootstrap: prompt multiplicities `cje_engine.direct.estimators.bootstrap_weights(seed, b, G)`; in
  each replicate Direct's statistics come from `cje_engine.pipeline.direct.bootstrap_chunk` and the
  off-policy ones from the same prompt draw, with the calibrator (`make_calibrator`, full fit
  plus one fit per held-out fold) and SIMCal refitted, so every difference is paired;
- the Direct result (logger, and each candidate's fresh draws in hybrid mode) is
  `cje_engine.pipeline.direct.finalize`, whose calibration summary, audits and support checks are
  reused; comparisons are adjusted with `cje_engine.inference.multiplicity.adjust`.

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
candidate whose own labels fail the transport audit is refused too: every off-policy estimate
rests on the logger's calibration.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Sequence

import numpy as np
from scipy.stats import kendalltau

from cje_engine import __version__
from cje_engine.calibration.calibrators import make_calibrator
from cje_engine.data.frame import EvalData
from cje_engine.errors import CJEInputError
from cje_engine.direct.estimators import Design, bootstrap_weights
from cje_engine.inference.multiplicity import adjust
from cje_engine.offpolicy.estimators import (
    ALL_ESTIMATORS,
    DEFAULT_STACK,
    FreshData,
    LoggedData,
    OffPolicyConfig,
    OffPolicyGates,
    Rewards,
    TargetReport,
    _compute_estimates,
    evaluate_target,
)
from cje_engine.offpolicy.weights import mean_one_weights
from cje_engine.data.offpolicy import DEFAULT_LENGTH_COLUMN, LOGGER_COLUMNS, OffPolicyData, load_offpolicy, projection_columns
from cje_engine.options import EvaluationOptions
from cje_engine.result import EvaluationResult

log = logging.getLogger(__name__)

MODES = ("logs-only", "hybrid")
ESTIMATOR_CHOICES = ("auto",) + ALL_ESTIMATORS + ("stacked",)
#: Estimators that use the candidate's fresh draws (their validity also rests on Direct's checks).
USES_FRESH = ("dr", "direct", "stacked")

_LABELS = {"ips": "IPS (raw importance weights)", "snips": "SNIPS (self-normalised importance weights)",
           "calibrated_ips": "calibrated IPS (SIMCal-stabilised importance weights)",
           "dr": "calibrated DR (fresh draws plus weighted residuals of the logs)",
           "direct": "Direct (mean calibrated reward of the fresh draws)",
           "stacked": "IF-stacked combination"}


# --------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffPolicyOptions:
    """Options of an off-policy evaluation (the engine's shared options live in ``engine``).

    Parameters
    ----------
    mode : {"logs-only", "hybrid"}
    targets : candidates (default: every ``logprob__<policy>`` column)
    logger : name of the logging policy (see `cje_engine.data.offpolicy.load_offpolicy`)
    logger_column, length_column : columns of the logger log-probabilities and token counts
    estimator : headline estimator, "auto" or one of ``ips, snips, calibrated_ips, dr, direct,
        stacked`` (falls back to calibrated IPS for a candidate without fresh draws)
    gates : `OffPolicyGates` thresholds (a dict is accepted: min_ttc, min_ess_fraction,
        min_tail_index)
    rho, projection, simcal_stack_by, ttc_mass, stack : see `OffPolicyConfig`
    downgraded : "ok" (a downgraded verdict keeps its level, with a warning) or "refused"
    engine : `EvaluationOptions` (covariates, calibration_mode, calibration_policies, n_bootstrap,
        seed, alpha, audit_margin, n_folds, multiplicity, label_scale, score_scale, min_labels,
        support_*; ``direct_estimator`` maps to its ``estimator``)
    """

    mode: str = "logs-only"
    targets: tuple[str, ...] | None = None
    logger: str | None = None
    logger_column: str | None = None
    length_column: str | None = None
    estimator: str = "auto"
    gates: OffPolicyGates = field(default_factory=OffPolicyGates)
    rho: float = 1.0
    projection: str = "exact"
    simcal_stack_by: str = "mse"
    ttc_mass: float = 0.9
    stack: tuple[str, ...] = DEFAULT_STACK
    downgraded: str = "ok"
    engine: EvaluationOptions = field(default_factory=EvaluationOptions)

    @classmethod
    def build(cls, **kwargs: Any) -> "OffPolicyOptions":
        """Validate keyword options; unknown keys go to `EvaluationOptions` (which rejects them)."""
        own = {f.name for f in fields(cls)} - {"engine"}
        mine = {k: v for k, v in kwargs.items() if k in own}
        rest = {k: v for k, v in kwargs.items() if k not in own}
        if "direct_estimator" in rest:
            rest["estimator"] = rest.pop("direct_estimator")
        engine = EvaluationOptions.build(**rest)
        if engine.inference != "bootstrap":
            raise CJEInputError("off-policy evaluation supports inference='bootstrap' only (its intervals refit the "
                                "calibrator and the weight stabiliser per replicate)")
        if mine.get("mode", "logs-only") not in MODES:
            raise CJEInputError(f"mode must be one of direct, logs-only, hybrid; got {mine.get('mode')!r} "
                                "(this entry point handles logs-only and hybrid)")
        for key in ("targets", "stack"):
            v = mine.get(key)
            if v is not None:
                mine[key] = (v,) if isinstance(v, str) else tuple(str(x) for x in v)
        g = mine.get("gates")
        if g is None:
            mine.pop("gates", None)
        elif isinstance(g, dict):
            unknown = set(g) - {f.name for f in fields(OffPolicyGates)}
            if unknown:
                raise CJEInputError(f"unknown gate(s) {', '.join(sorted(unknown))}; expected min_ttc, "
                                    "min_ess_fraction, min_tail_index")
            mine["gates"] = OffPolicyGates(**{k: float(v) for k, v in g.items()})
        elif not isinstance(g, OffPolicyGates):
            raise CJEInputError(f"gates must be a dict or OffPolicyGates, got {type(g).__name__}")
        opts = cls(engine=engine, **mine)
        opts._check()
        return opts

    def _check(self) -> None:
        if self.estimator not in ESTIMATOR_CHOICES:
            raise CJEInputError(f"estimator must be one of {', '.join(ESTIMATOR_CHOICES)}; got {self.estimator!r}")
        if self.downgraded not in ("ok", "refused"):
            raise CJEInputError(f"downgraded must be 'ok' or 'refused'; got {self.downgraded!r}")
        if not (np.isfinite(self.rho) and self.rho > 0):
            raise CJEInputError(f"rho must be a positive number; got {self.rho!r}")
        if not 0 < self.ttc_mass < 1:
            raise CJEInputError(f"ttc_mass must lie in (0, 1); got {self.ttc_mass!r}")
        if self.projection not in ("exact", "rescale"):
            raise CJEInputError(f"projection must be 'exact' or 'rescale'; got {self.projection!r}")
        if self.simcal_stack_by not in ("mse", "if_variance"):
            raise CJEInputError(f"simcal_stack_by must be 'mse' or 'if_variance'; got {self.simcal_stack_by!r}")
        unknown = [k for k in self.stack if k not in ALL_ESTIMATORS]
        if unknown:
            raise CJEInputError(f"unknown stacking candidate {unknown[0]!r}; expected some of {', '.join(ALL_ESTIMATORS)}")
        g = self.gates
        if not (0 <= g.min_ttc <= 1 and 0 <= g.min_ess_fraction <= 1 and g.min_tail_index >= 0):
            raise CJEInputError(f"gate thresholds out of range: {g}")

    # the attributes the evaluate flow's bootstrap task reads
    @property
    def inference(self) -> str:
        return self.engine.inference

    @property
    def n_bootstrap(self) -> int:
        return self.engine.n_bootstrap

    @property
    def seed(self) -> int:
        return self.engine.seed

    def config(self) -> OffPolicyConfig:
        return OffPolicyConfig(rho=self.rho, n_folds=self.engine.n_folds, projection=self.projection,
                               simcal_stack_by=self.simcal_stack_by, ttc_mass=self.ttc_mass, stack=self.stack,
                               level=1 - self.engine.alpha, gates=self.gates)

    def offpolicy_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "engine"}
        d["gates"] = asdict(self.gates)
        for k in ("targets", "stack"):
            if d[k] is not None:
                d[k] = list(d[k])
        return d

    def to_dict(self) -> dict:
        return {**self.engine.to_dict(), **self.offpolicy_dict()}


# --------------------------------------------------------------------------------------------
# prepared state
# --------------------------------------------------------------------------------------------


@dataclass
class OffPolicyPrepared:
    """Everything computed before the bootstrap (picklable; shipped to workers)."""

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

    @property
    def n_direct_stats(self) -> int:
        return int(self.direct.stats.size)


def refit_rewards(design: Design, row_w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Calibrated rewards ``R`` and the cross-fitted outcome model ``q`` of every design row.

    One full fit and one fit per held-out fold on the calibration rows (weights ``row_w``: the
    bootstrap's prompt multiplicities), with the engine's calibrator for the design's mode.
    ``q[i] = f^(-k(i))``; ``R`` = ``q`` on calibration rows and the full fit elsewhere (exactly
    `cje_engine.direct.estimators.cross_fit`). A fold whose complement has no weight keeps the full fit.
    """
    d = design.data
    cr = design.cal_rows
    wc = np.ones(cr.size) if row_w is None else row_w[cr]
    s, y, X = d.score[cr], d.label[cr], d.X[cr]
    full = make_calibrator(design.mode, d.label_scale).fit(s, y, X, wc)
    R = full.predict(d.score, d.X)
    q = R.copy()
    folds = design.cal_fold
    for k in range(d.n_folds):
        held = folds == k
        wk = np.where(held, 0.0, wc)
        rows = d.fold == k
        if not rows.any() or wk.sum() <= 0:
            continue
        model = make_calibrator(design.mode, d.label_scale).fit(s, y, X, wk)
        q[rows] = model.predict(d.score[rows], d.X[rows])
    R[cr] = q[cr]
    return R, q


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


def prepare(logged: Any, fresh: Any = None, **options: Any) -> OffPolicyPrepared:
    """Load and validate, calibrate (Direct's `prepare`), point estimates, diagnostics, gates.

    Parameters
    ----------
    logged, fresh : see `cje_engine.data.offpolicy.load_offpolicy`
    **options : see `OffPolicyOptions` (mode, targets, gates, ... and the engine's options)
    """
    from cje_engine.pipeline import direct as pipeline

    opts = OffPolicyOptions.build(**options)
    eng = opts.engine
    data = load_offpolicy(logged, fresh, mode=opts.mode, targets=opts.targets, logger_policy=opts.logger,
                          covariates=eng.covariates, label_scale=eng.label_scale, score_scale=eng.score_scale,
                          logger_column=opts.logger_column, length_column=opts.length_column)
    ed = EvalData.from_frame(data.frame, covariates=eng.covariates, label_scale=eng.label_scale,
                             score_scale=eng.score_scale, n_folds=eng.n_folds)
    direct = pipeline.prepare(ed, **eng.to_dict())
    R, q = refit_rewards(direct.design)
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
    return OffPolicyPrepared(opts, data, direct, logged_rows, fresh_rows, lds, fds, reports, headline, layout,
                             R, q, notes)


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
    R, q = refit_rewards(design, mult[d.prompt].astype(float))
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
                ests, _, _ = _compute_estimates(ld.log_w[li], ld.scores[li], d.fold[rows], lc, rw, fc, config,
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
    from cje_engine.pipeline import direct as pipeline

    direct = pipeline.bootstrap_chunk(prep.direct, start, stop)
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
    plus ``reports`` (candidate -> `TargetReport`) and ``direct`` (Direct's `EvaluationResult`)."""

    def __init__(self, data: dict, replicates: np.ndarray, columns: np.ndarray, reports: dict[str, TargetReport],
                 direct: EvaluationResult) -> None:
        super().__init__(data, replicates=replicates, influence=np.empty((0, 0)), columns=columns)
        self.reports = reports
        self.direct = direct


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None


def _boot_summary(r: np.ndarray, alpha: float, scale: tuple[float, float] | None) -> dict:
    fin = r[np.isfinite(r)]
    if fin.size < 2:
        return {"se": None, "ci": None, "n_finite": int(fin.size)}
    lo, hi = np.percentile(fin, [50 * alpha, 100 - 50 * alpha])
    if scale is not None:
        lo, hi = float(np.clip(lo, *scale)), float(np.clip(hi, *scale))
    return {"se": float(np.std(fin, ddof=1)), "ci": [float(lo), float(hi)], "n_finite": int(fin.size)}


def _not_run_audit(t: str, margin: float) -> dict:
    return {"verdict": "not_run", "n_labels": 0, "margin": margin, "family_size": 0,
            "reason": f"no oracle labels on responses of '{t}' itself: the judge calibration learned on the logger is "
                      "assumed to transport to it (untested)",
            "residual_mean": None, "se": None, "ci": None, "ci_adjusted": None, "p_value": None,
            "p_adjusted": None, "extra_labels_needed": None, "calibrator": "borrowed", "deciles": []}


def _target_entry(prep: OffPolicyPrepared, t: str, off: np.ndarray, D: dict, warnings: list[str]) -> dict:
    opts, eng = prep.options, prep.options.engine
    rep = prep.reports[t]
    name = prep.headline[t]
    verdict = rep.verdicts[name]
    alpha = eng.alpha
    col = {key: j for j, key in enumerate(prep.layout)}
    ests: dict[str, dict] = {}
    for k, e in rep.estimates.items():
        lo, hi = e.ci(1 - alpha)
        b = _boot_summary(off[:, col[(t, k)]], alpha, None)  # raw IPS can leave the label scale: no clipping
        ests[k] = {"value": _num(e.value), "se_if": _num(e.se), "ci_if": [_num(lo), _num(hi)],
                   "se": b["se"], "ci": b["ci"], "n_replicates_finite": b["n_finite"],
                   "claim": rep.verdicts[k].claim}
        if hasattr(e, "coef"):
            ests[k]["coef"] = {c: float(v) for c, v in e.coef.items()}
    head = ests[name]
    dpol = D["policies"].get(t) if prep.fresh[t] is not None else None
    reasons: list[str] = []
    claim = verdict.claim
    recommendation = verdict.recommendation
    if claim == "refused" or (claim == "downgraded" and opts.downgraded == "refused"):
        reasons.extend(verdict.reasons)
        claim = "refused"
    audit = dpol["audit"] if dpol is not None else _not_run_audit(t, eng.audit_margin * (eng.label_scale[1] - eng.label_scale[0]))
    if audit["verdict"] == "fail":
        claim = "refused"
        reasons.append(f"the transport audit on {audit['n_labels']} own labels of '{t}' failed ({audit['reason']}): "
                       "the calibration learned on the logger does not hold for this policy, so every calibrated "
                       "off-policy estimate of it is biased")
        if dpol is not None and dpol["level_claim"] == "ok" and dpol["basis_code"] == "recalibrated":
            lo, hi = dpol["ci"]
            recommendation = (f"use the Direct estimate recalibrated on its own {dpol['n_labelled']} labels "
                              f"({dpol['estimate']:.3f}, CI {lo:.3f} to {hi:.3f}; run with mode='direct')")
        else:
            recommendation = (f"label more fresh draws of '{t}' with the oracle and use Direct (mode='direct'), "
                              "which recalibrates on a policy's own labels")
    if audit["verdict"] == "inconclusive" and claim != "refused":
        warnings.append(f"{t}: the {name} estimate uses the calibration learned on the logger; the transport audit on "
                        f"{audit['n_labels']} own labels of '{t}' is inconclusive ({audit['reason']}), so this level "
                        "and comparisons with it rest on that calibration transporting (Direct, mode='direct', uses "
                        "the own labels instead)")
    if dpol is not None and name in USES_FRESH and dpol["level_claim"] == "refused" and dpol["basis_code"] == "plug_in":
        uses_direct = name != "stacked" or head.get("coef", {}).get("direct", 0) + head.get("coef", {}).get("dr", 0) > 1e-6
        if uses_direct:
            claim = "refused"
            reasons.extend(f"Direct on the fresh draws: {r}" for r in dpol["refusal_reasons"])
            if recommendation is None or verdict.claim == "level":
                recommendation = (f"label a sample of the fresh draws of '{t}' with the oracle so the calibration "
                                  "covers its judge scores, then use Direct (mode='direct'), which recalibrates on "
                                  "a policy's own labels")
    if claim == "refused":
        if recommendation is None:
            recommendation = verdict.recommendation or (
                f"collect fresh draws of '{t}' and evaluate them with Direct (mode='direct')")
        reasons.append(f"recommendation: {recommendation}")
    elif claim == "downgraded":
        warnings.append(f"{t}: the {name} estimate's claim is downgraded (its interval may be unreliable): "
                        + "; ".join(verdict.reasons))
    level_claim = "refused" if claim == "refused" else "ok"
    detail = "refused" if claim == "refused" else verdict.claim
    fresh = prep.fresh[t]
    n_fresh = 0 if fresh is None else fresh.n
    n_logged = prep.data.n_logged
    if fresh is not None:
        raw_judge = float(np.mean(fresh.scores))
        raw_judge_basis = "mean judge score of the fresh draws"
    else:
        w = mean_one_weights(prep.logged[t].log_w)
        raw_judge = float(np.sum(w * prep.logged[t].scores) / np.sum(w))
        raw_judge_basis = "importance-weighted (self-normalised) mean judge score of the logs"
    where = ("logs-only" if fresh is None else "hybrid")
    basis = (f"{where}: {_LABELS[name]} of '{t}' from {n_logged} logged responses of '{prep.data.logger}'"
             + (f" and {n_fresh} fresh draws" if n_fresh else "")
             + "; rewards = the judge calibration learned on the labelled rows")
    if name == "stacked" and "coef" in head:
        basis += " (weights " + ", ".join(f"{k} {v:.2f}" for k, v in head["coef"].items()) + ")"
    labelled_fresh = 0 if dpol is None else int(dpol["n_labelled"])
    ci = head["ci"]
    if ci is not None:  # the headline interval is clipped to the label scale, as Direct's
        ci = [float(np.clip(ci[0], *eng.label_scale)), float(np.clip(ci[1], *eng.label_scale))]
    entry = {
        "estimate": head["value"], "se": head["se"], "ci": ci,
        "level_claim": level_claim, "refusal_reasons": reasons,
        "claim": detail, "recommendation": recommendation if detail != "level" else None,
        "basis": basis, "basis_code": f"{where}/{name}",
        "transport": "audited" if audit["verdict"] != "not_run" else "unaudited",
        "plug_in": ({k: dpol["plug_in"][k] for k in ("estimate", "se", "ci")} if dpol is not None else None),
        "augmented": None,
        "raw_judge_mean": raw_judge, "raw_judge_basis": raw_judge_basis,
        "oracle_mean": dpol["oracle_mean"] if dpol is not None else None,
        "oracle_only": dpol.get("oracle_only") if dpol is not None else None,
        "n_rows": n_logged + n_fresh, "n_logged": n_logged, "n_fresh": n_fresh, "n_labelled": labelled_fresh,
        "variance_share_calibration": None,
        "se_analytic": head["se_if"], "se_bootstrap": head["se"],
        "support": dpol["support"] if dpol is not None else D["policies"][prep.data.logger]["support"],
        "audit": audit,
        "direct": ({k: dpol[k] for k in ("estimate", "se", "ci", "level_claim", "refusal_reasons", "basis_code")}
                   if dpol is not None else None),
        "offpolicy": {
            "estimator": name, "estimates": ests,
            "diagnostics": rep.to_dict()["diagnostics"],
            "verdicts": {k: {"claim": v.claim, "reasons": list(v.reasons), "recommendation": v.recommendation}
                         for k, v in rep.verdicts.items()},
            "gate_checks": _gate_checks(rep, opts.gates),
            "stack_candidates": list(rep.stack_candidates),
        },
    }
    return entry


def _gate_checks(rep: TargetReport, gates: OffPolicyGates) -> list[dict]:
    d = rep.diagnostics
    return [
        {"gate": "ttc", "value": _num(d.ttc), "threshold": gates.min_ttc, "passed": bool(d.ttc >= gates.min_ttc),
         "applies_to": "ips, snips, calibrated_ips (refused); dr (downgraded)"},
        {"gate": "ess_raw", "value": _num(d.ess_raw), "threshold": gates.min_ess_fraction,
         "passed": bool(d.ess_raw >= gates.min_ess_fraction), "applies_to": "ips, snips (refused)"},
        {"gate": "ess_stabilised", "value": _num(d.ess_stabilised), "threshold": gates.min_ess_fraction,
         "passed": bool(d.ess_stabilised >= gates.min_ess_fraction),
         "applies_to": "calibrated_ips (refused); dr (downgraded)"},
        {"gate": "tail_index", "value": _num(d.hill_index), "threshold": gates.min_tail_index,
         "passed": bool(not np.isfinite(d.hill_index) or d.hill_index >= gates.min_tail_index),
         "applies_to": "ips, snips (downgraded)"},
    ]


def _compare(names: list[str], point: np.ndarray, reps: np.ndarray, refused: np.ndarray, alpha: float,
             method: str, span: float) -> list[dict]:
    out = []
    K = len(names)
    for a in range(K):
        for b in range(a + 1, K):
            diff = float(point[a] - point[b])
            D = reps[:, a] - reps[:, b]
            D = D[np.isfinite(D)]
            B = D.size
            item = {"a": names[a], "b": names[b], "diff": _num(diff), "se_analytic": None}
            if B < 2 or not np.isfinite(diff):
                item.update(se=None, ci=None, p_value=1.0, prob_a_better=None,
                            involves_refused=bool(refused[a] or refused[b]))
            else:
                ci = np.percentile(D, [50 * alpha, 100 - 50 * alpha])
                p = min(1.0, 2 * min(1 + np.sum(D <= 0), 1 + np.sum(D >= 0)) / (B + 1))
                item.update(se=float(np.std(D, ddof=1)), ci=[float(max(ci[0], -span)), float(min(ci[1], span))],
                            p_value=float(p), prob_a_better=float(np.mean(D > 0) + 0.5 * np.mean(D == 0)),
                            involves_refused=bool(refused[a] or refused[b]))
            out.append(item)
    if out:
        padj = adjust(np.array([c["p_value"] for c in out]), method)
        for c, pa in zip(out, padj):
            c["p_adjusted"] = float(pa)
            c["significant"] = bool(pa <= alpha and c["se"] is not None)
    return out


def finalize(prep: OffPolicyPrepared, chunks: Sequence[np.ndarray]) -> OffPolicyResult:
    """Direct's finalize for the logger (and the fresh draws), then every candidate's gated entry,
    paired comparisons over all policies, ranking and the best policy (never a refused one)."""
    from cje_engine.pipeline import direct as pipeline

    opts, eng = prep.options, prep.options.engine
    nd = prep.n_direct_stats
    reps = np.vstack(chunks) if chunks else np.empty((0, nd + len(prep.layout)))
    if reps.shape[0] != eng.n_bootstrap:
        raise ValueError(f"expected {eng.n_bootstrap} bootstrap replicates, got {reps.shape[0]}")
    if reps.shape[1] != nd + len(prep.layout):
        raise ValueError(f"expected {nd + len(prep.layout)} statistics per replicate, got {reps.shape[1]}")
    direct_res = pipeline.finalize(prep.direct, [reps[:, :nd]])
    D = direct_res.to_dict()
    off = reps[:, nd:]
    warnings = list(D.get("warnings", [])) + list(prep.notes)
    logger_name = prep.data.logger
    policies: dict[str, dict] = {}
    lp = dict(D["policies"][logger_name])
    lp["claim"] = "level" if lp["level_claim"] == "ok" else "refused"
    lp["offpolicy"] = {"role": "logger", "estimator": "direct (on-policy logs)"}
    policies[logger_name] = lp
    for t in prep.data.targets:
        policies[t] = _target_entry(prep, t, off, D, warnings)
    names = list(policies)
    d_pols = list(prep.direct.design.data.policies)
    k_log = d_pols.index(logger_name)
    col = {key: j for j, key in enumerate(prep.layout)}
    rep_cols = [reps[:, int(direct_res.columns[k_log])]] + [off[:, col[(t, prep.headline[t])]] for t in names[1:]]
    R = np.column_stack(rep_cols)
    est = np.array([np.nan if policies[n]["estimate"] is None else policies[n]["estimate"] for n in names])
    refused = np.array([policies[n]["level_claim"] == "refused" for n in names])
    span = eng.label_scale[1] - eng.label_scale[0]
    comparisons = _compare(names, est, R, refused, eng.alpha, eng.multiplicity, span)
    ranking, win, best, best_reason = pipeline.rank_policies(names, est, comparisons, refused,
                                            [policies[n]["level_claim"] for n in names])
    raw = np.array([policies[n]["raw_judge_mean"] for n in names], dtype=float)
    tau = None
    if len(names) >= 2 and np.all(np.isfinite(est)):
        tau = _num(kendalltau(raw, est, variant="b").statistic)
    n_fresh = {t: int(prep.fresh_rows[t].size) for t in prep.data.targets}
    result = {
        "schema_version": 1,
        "engine_version": __version__,
        "mode": opts.mode,
        "config": {**D["config"], **opts.offpolicy_dict()},
        "data": {"n_rows": int(prep.data.frame.shape[0]), "n_prompts": int(prep.direct.design.data.n_prompts),
                 "n_labelled": D["data"]["n_labelled"], "n_calibration_labels": D["data"]["n_calibration_labels"],
                 "policies": names, "covariates": list(eng.covariates), "logger": logger_name,
                 "n_logged": prep.data.n_logged, "n_fresh": n_fresh, "source": prep.data.source,
                 "logger_column": prep.data.logger_column},
        "calibration": D["calibration"],
        "inference": {**D["inference"], "offpolicy": "the same prompt draws refit the calibrator (full and per-fold "
                      "fits) and SIMCal in every replicate; IF stacks are re-solved per replicate"},
        "policies": policies,
        "comparisons": comparisons,
        "multiplicity": {"method": eng.multiplicity, "alpha": eng.alpha, "n_comparisons": len(comparisons)},
        "ranking": ranking,
        "win_matrix": win,
        "best_policy": best,
        "best_policy_reason": best_reason,
        "rank_agreement": {
            "kendall_tau_b_raw_vs_calibrated": tau,
            "raw_order": [names[i] for i in np.argsort(-raw, kind="stable")],
            "calibrated_order": [names[i] for i in np.argsort(-np.where(np.isfinite(est), est, -np.inf), kind="stable")],
        },
        "offpolicy": {
            "mode": opts.mode, "logger": logger_name, "targets": list(prep.data.targets),
            "estimator": dict(prep.headline), "gates": asdict(opts.gates),
            "simcal": {"rho": opts.rho, "projection": opts.projection, "stack_by": opts.simcal_stack_by},
            "ttc_mass": opts.ttc_mass, "stack": list(opts.stack), "downgraded": opts.downgraded,
            "direct_from_fresh": {t: {k: D["policies"][t][k] for k in ("estimate", "se", "ci", "level_claim",
                                                                         "basis_code")}
                                  for t in prep.data.targets if t in D["policies"]},
        },
        "warnings": warnings,
    }
    columns = np.arange(len(names))
    return OffPolicyResult(result, R, columns, dict(prep.reports), direct_res)


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


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
    **options: Any,
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
    covariates, n_bootstrap, alpha, seed, calibration_mode : as Direct's `cje_engine.evaluate`
    gates : `OffPolicyGates` or a dict of thresholds (default: TTC >= 0.70, ESS/n >= 0.30, Hill >= 2)
    **options : see `OffPolicyOptions` (logger, estimator, rho, downgraded, calibration_policies,
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
    prep = prepare(logged, fresh, mode=mode, targets=targets, covariates=covariates, n_bootstrap=n_bootstrap,
                   alpha=alpha, seed=seed, calibration_mode=calibration_mode, gates=gates, **options)
    return finalize(prep, [bootstrap_chunk(prep, 0, prep.options.n_bootstrap)])


# --------------------------------------------------------------------------------------------
# helpers for the evaluate flow
# --------------------------------------------------------------------------------------------


def flow_options(options: dict | None, policies: Sequence[str] | None, mode: str) -> dict:
    """JSON-ready, validated options of an off-policy flow run.

    ``policies`` (the flow's parameter) name the candidates when ``options`` has no ``targets``.
    """
    opts = dict(options or {})
    opts["mode"] = mode
    if not opts.get("targets") and policies:
        opts["targets"] = [p for p in policies if p != opts.get("logger")]
    OffPolicyOptions.build(**opts)
    return opts


def flow_columns(opts: dict) -> list[str]:
    """Log columns to read besides Direct's: the logger's and the candidates' log-probabilities
    (and the token counts if ``length_column`` is set): the read's projection."""
    targets = opts.get("targets")
    if not targets:
        raise CJEInputError("an off-policy flow run needs its candidates: give options={'targets': [...]} or "
                            "policies=[...] (the logs' logprob__<policy> columns to read)", column="targets")
    return projection_columns(targets, logger_column=opts.get("logger_column") or LOGGER_COLUMNS[0],
                              length_column=opts.get("length_column"))


def flow_policies(opts: dict) -> list[str] | None:
    """Policy filter pushed into the read: the logger plus the candidates (hybrid), the logger alone
    (logs-only), or None when the logger's name is not given."""
    lg = opts.get("logger")
    if not lg:
        return None
    return [lg] + (list(opts.get("targets") or []) if opts.get("mode") == "hybrid" else [])


__all__ = ["evaluate_offpolicy", "prepare", "bootstrap_chunk", "finalize", "OffPolicyOptions", "OffPolicyPrepared",
           "OffPolicyResult", "refit_rewards", "flow_options", "flow_columns", "flow_policies", "MODES",
           "DEFAULT_LENGTH_COLUMN"]
