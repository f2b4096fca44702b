"""Direct policy summaries: each policy's level, basis, audit, support and variance components.

`summarize_direct` turns Direct's prepared statistics and replicates into one entry per design
policy (every mode runs it: Direct for all policies, logs-only and hybrid for the logger and the
candidates' fresh draws). Comparisons and ranking are not done here (`cje_engine.inference.comparisons`).
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel

from cje_engine.audit import audit_policies, residual_deciles
from cje_engine.data.frame import EvalData
from cje_engine.data.ints import count_distinct, present_codes
from cje_engine.direct.estimators import Design
from cje_engine.direct.verified import own_label_influence, power_tuned, power_tuned_lambda
from cje_engine.inference import distributions as dist
from cje_engine.inference.comparisons import SE_AGREEMENT_RATIO
from cje_engine.inference.gram import GramTerms
from cje_engine.inference.reference_t import t_ppf
from cje_engine.inference.intervals import (
    OWN_LABEL_ANALYTIC,
    OWN_LABEL_BOOTSTRAP,
    acceleration,
    own_label_interval,
)
from cje_engine.inference.selective import (
    SELECTIVE,
    audit_critical_z,
    audit_selective_interval,
)
from cje_engine.inference.variance import cluster_cov, cluster_var
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline.calibration import audit_degrees_of_freedom, audit_statistics
from cje_engine.result.jsonable import jsonable
from cje_engine.result.model import (
    AssumedLevel,
    Audit,
    LabelsToVerify,
    OracleOnly,
    PolicyResult,
    SelectiveInterval,
    StatSummary,
    Support,
    VarianceComponents,
    VerifiedLevel,
)

log = logging.getLogger(__name__)


@dataclass
class DirectSummaries:
    """Direct's per-policy results (design policy order) and what the comparison step needs."""

    policies: dict[str, PolicyResult]  # the typed entries (`cje_engine.result.model.PolicyResult`)
    cols: np.ndarray  # reported statistic of each policy (index into the 2K statistics)
    refused: np.ndarray
    dfs: np.ndarray  # degrees of freedom of the 2K statistics
    calibration: dict
    warnings: list[str] = field(default_factory=list)
    reps: np.ndarray | None = None  # (B, 4K) extended replicates (`extend_with_verified`); ``cols`` index them
    influence: np.ndarray | None = None  # (n_prompts, 4K) extended influence terms
    assumed_cols: np.ndarray | None = None  # the assumes-transport (protocol) level's column of each policy
    assumed_refused: np.ndarray | None = None
    assumed_relative: list | None = None  # (relative claim, reason) of each policy's protocol level


@dataclass(frozen=True)
class RowTotals:
    """What the result reads from every row besides the (policy, cell) counts: per policy its rows, distinct
    prompts and judge-score sum, and the judge scores' range. Computed from the rows (`row_totals`) or merged
    from shards (`cje_engine.pipeline.sharded`: prompts never straddle shards, so the prompt counts add)."""

    n_rows: np.ndarray  # (K,) int
    n_prompts: np.ndarray  # (K,) int: distinct prompts with a row of the policy
    score_sum: np.ndarray  # (K,) float: sum of the policy's judge scores
    score_min: float
    score_max: float
    raw_judge_mean: np.ndarray | None = None  # (K,) when computed from the rows (the mean, exactly as before)

    def judge_mean(self, k: int) -> float:
        """Policy ``k``'s mean judge score."""
        if self.raw_judge_mean is not None:
            return float(self.raw_judge_mean[k])
        return float(self.score_sum[k] / self.n_rows[k])


def row_totals(prep: Any) -> RowTotals:
    """The prepared state's `RowTotals`: its ``rows`` when it has them (a sharded preparation, whose design
    holds the labelled rows only), else computed from the design's rows."""
    rows = getattr(prep, "rows", None) or prep.__dict__.get("_row_totals")
    if rows is not None:
        return rows
    d = prep.design.data
    K = len(d.policies)
    rows = prep.__dict__["_row_totals"] = RowTotals(
        n_rows=np.bincount(d.policy, minlength=K),
        n_prompts=prompts_per_policy(d.policy, d.prompt, K, d.n_prompts),
        score_sum=np.bincount(d.policy, weights=d.score, minlength=K),
        score_min=float(d.score.min()), score_max=float(d.score.max()),
        raw_judge_mean=np.array([float(d.score[d.policy == k].mean()) for k in range(K)]))
    return rows


def clip(ci: Sequence[float], scale: tuple[float, float]) -> list[float]:
    """The interval ``ci`` clipped to ``scale``."""
    return [float(np.clip(ci[0], *scale)), float(np.clip(ci[1], *scale))]


def support_checks(design: Design, opts: EvaluationOptions, scores: Sequence[np.ndarray] | None = None,
                   weights: Sequence[np.ndarray | None] | None = None,
                   score_range: tuple[float, float] | None = None) -> list[dict]:
    """Calibration support of each policy's judge scores (or of the given score arrays).

    ``score_range``: (min, max) of every row's judge score when the design does not hold every row.
    ``weights`` (one array or None per score array) make the shares weighted: a logs-only target's
    judge-score distribution is the logger's reweighted by the estimate's weights on its rewards
    (``sum_i a_i R_i``), so its thin share is the share of that weight on thinly supported scores.
    """
    d = design.data
    cs = np.sort(d.score[design.cal_rows])
    if d.score_scale is not None:
        width = d.score_scale[1] - d.score_scale[0]
    else:
        lo, hi = score_range if score_range is not None else (d.score.min(), d.score.max())
        width = float(hi - lo) or 1.0
    h = opts.support_bandwidth * width
    tol = 1e-9 * width
    per_policy = scores is None  # one entry per design policy (not given score arrays)
    by_cell = scores is None and design.cells is not None and bool((design.cells.counts.sum(1) > 0).all())
    if by_cell:
        # Each policy's rows as counts per cell (a cell holds one score value): the same shares as per
        # row, exactly (sums of whole numbers), at the cost of the cells instead of the rows.
        scores = [design.cells.cells.score] * len(d.policies)
        weights = list(design.cells.counts)
    elif scores is None:
        scores = [d.score[d.policy == k] for k in range(len(d.policies))]
    out = []
    x_range = None
    if design.entry.uses_covariates and per_policy and d.X.shape[1]:
        Xc = d.X[design.cal_rows]  # once, not per policy (segments: ~100 virtual policies)
        x_range = (Xc.min(axis=0), Xc.max(axis=0))
    for i, s in enumerate(scores):
        cnt = np.searchsorted(cs, s + h + tol, side="right") - np.searchsorted(cs, s - h - tol, side="left")
        outside = (s < cs[0] - tol) | (s > cs[-1] + tol)
        thin = (cnt < opts.support_min_labels) | outside
        if by_cell:
            w = weights[i]
        else:
            w = None if weights is None or weights[i] is None else np.abs(np.nan_to_num(np.asarray(weights[i], float)))
        if w is None or not w.sum() > 0:
            w = np.ones(s.shape[0])
        share_thin = float(np.sum(w * thin) / np.sum(w))
        entry = {
            "share_outside_range": float(np.sum(w * outside) / np.sum(w)),
            "share_thin": share_thin,
            "limited": share_thin > opts.support_material_share,
            "rule": (f"thin = fewer than {opts.support_min_labels} calibration labels within "
                     f"+/-{h:.4g} of the score, or outside [{cs[0]:.4g}, {cs[-1]:.4g}]; limited when more than "
                     f"{opts.support_material_share:.0%} of rows are thin"),
        }
        if x_range is not None:
            # the index extrapolates where a covariate lies outside the calibration labels' range
            lo, hi = x_range
            cx = design.cells.cells.X if by_cell else d.X[d.policy == i]
            off = np.any((cx < lo - 1e-12) | (cx > hi + 1e-12), axis=1)
            share = float(np.sum(w * off) / np.sum(w))
            entry.update(share_covariate_outside=share,
                         covariate_extrapolation=share > opts.support_material_share)
        out.append(entry)
    return out


def variance_components(var_total: float, var_cal: float, n_prompts: int, m_labels: int) -> dict:
    """Per-unit variance components for budget planning: Var ~ sigma_eval^2 / n + sigma_cal^2 / m.

    ``var_cal`` is the influence-function variance of the calibration term (plug-in) or of the
    label-residual term (augmented); the rest is attributed to evaluation sampling.
    """
    var_eval = max(var_total - var_cal, 0.0)
    return {"sigma2_eval": var_eval * n_prompts, "sigma2_cal": var_cal * m_labels,
            "n_prompts": int(n_prompts), "m_labels": int(m_labels)}


def oracle_only(d: EvalData, sel: np.ndarray, alpha: float) -> dict:
    """The oracle-only baseline: weighted mean of the policy's own labels, prompt-clustered t interval.

    ``sel``: the policy's labelled rows, a boolean mask or their (increasing) indices.
    """
    if sel.dtype == bool:
        sel = np.flatnonzero(sel)
    w = d.label_weight[sel]
    y = d.label[sel]
    mean = float(np.sum(w * y) / np.sum(w))
    prompts, inv = np.unique(d.prompt[sel], return_inverse=True)
    c = np.bincount(inv, weights=w * (y - mean) / np.sum(w))
    n = prompts.size
    se = float(np.sqrt(np.sum(c**2) * n / (n - 1)))
    q = t_ppf(1 - alpha / 2, float(n - 1))
    return {"estimate": mean, "se": se, "ci": clip([mean - q * se, mean + q * se], d.label_scale),
            "n_labels": int(sel.size)}


def calibration_summary(prep: Any) -> dict:
    """The calibration block of the result: mode, selection, curve, points, reliability."""
    d = prep.design.data
    cr = prep.design.cal_rows
    totals = row_totals(prep)
    lo, hi = totals.score_min, totals.score_max
    grid = np.linspace(lo, hi, 101)
    Xmed = np.median(d.X[cr], axis=0) if d.X.shape[1] else np.zeros(0)
    curve = prep.full.predict(grid, np.tile(Xmed, (grid.size, 1)))
    stride = max(1, cr.size // 2000)
    pts = cr[::stride]
    pred = prep.f[cr]
    y = d.label[cr]
    edges = np.linspace(*d.label_scale, 11)
    idx = np.clip(np.searchsorted(edges, pred, side="right") - 1, 0, 9)
    rel = []
    for b in range(10):
        sel = idx == b
        if sel.any():
            rel.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "n": int(sel.sum()),
                        "mean_predicted": float(pred[sel].mean()), "mean_label": float(y[sel].mean())})
    cal_pols = sorted({d.policies[i] for i in present_codes(d.policy[cr], len(d.policies))})
    return {
        "mode": prep.design.mode,
        "selection": prep.selection,
        "n_train": int(cr.size),
        "calibration_policies": cal_pols,
        "curve": {"score": grid.tolist(), "fitted": curve.tolist(),
                  "covariates_at": dict(zip(d.covariate_names, Xmed.tolist()))},
        "points": {"score": d.score[pts].tolist(), "label": d.label[pts].tolist()},
        "reliability": rel,
        "label_range": [float(d.score[cr].min()), float(d.score[cr].max())],
        "excluded_sources": list(prep.excluded),
    }


def degrees_of_freedom(n_policies: int, n_label_prompts: np.ndarray) -> np.ndarray:
    """Degrees of freedom of each statistic for analytic intervals and tests.

    Plug-in columns are means over many prompts (normal quantile, df = inf). Augmented
    columns use (labelled prompts - 1): their variance is dominated by the mean of a few
    label residuals, and the normal quantile under-covers with 10-30 labels.
    """
    K = n_policies
    dfs = np.full(2 * K, np.inf)
    for k in range(K):
        if n_label_prompts[k] >= 2:
            dfs[K + k] = n_label_prompts[k] - 1
    return dfs


def uses_own_labels(level_estimator: str, verdict: str, n_own: int, min_labels: int,
                    support_limited: bool = False) -> bool:
    """Does the policy's reported level use its own labels (augmented/recalibrated column)?

    ``audited``: only where the plug-in would be refused (its audit failed, or its calibration
    support is limited) and there are ``min_labels`` own labels to recalibrate with; ``robust``:
    whenever there are ``min_labels`` own labels; ``augmented``: whenever there are any;
    ``plug_in``: never.
    """
    if level_estimator == "plug_in" or n_own == 0:
        return False
    if level_estimator == "augmented":
        return True
    if level_estimator == "robust":
        return n_own >= min_labels
    return (verdict == "fail" or support_limited) and n_own >= min_labels


def _basis(opts: EvaluationOptions, audit: dict, support: dict, n_own: int, use_aug: bool,
           level_estimator: str) -> tuple[str, str, list]:
    """(basis_code, basis, refusal reasons) of one policy's Direct level."""
    reasons: list[str] = []
    if use_aug:
        if audit["verdict"] == "fail":
            return "recalibrated", (
                f"recalibrated: the borrowed calibration failed its audit, so the level is the calibrated "
                f"plug-in plus the mean residual on {n_own} own labels (augmented)"), reasons
        why = ("; the plug-in's calibration support is limited, so the level rests on the policy's own labels"
               if support["limited"] and level_estimator == "audited" else "")
        return "augmented", f"augmented: calibrated plug-in plus the mean residual on {n_own} own labels{why}", reasons
    verdict = audit["verdict"]
    if n_own == 0 or verdict == "not_run":
        tail = ("; unaudited: rests on the untested assumption that the calibration transports to this policy"
                if n_own == 0 else f"; unaudited: {audit['reason']}")
    elif verdict == "pass":
        tail = f"; the transport audit on {n_own} own labels passed"
    elif verdict == "inconclusive":
        tail = f"; the transport audit on {n_own} own labels did not fail (inconclusive)"
    else:
        tail = f"; the transport audit on {n_own} own labels failed"
    if support.get("covariate_extrapolation"):
        tail += (f"; the two-stage index extrapolates in a covariate for {support['share_covariate_outside']:.0%} of "
                 f"its rows (outside the calibration labels' range)")
    basis = "calibrated plug-in: mean of calibrated judge scores" + tail
    if verdict == "fail":
        reasons.append(
            f"the transport audit failed and {n_own} own labels are too few to recalibrate "
            f"(at least {opts.min_labels} needed)" if level_estimator != "plug_in" else
            "the transport audit failed and the plug-in estimator was forced")
    if support["limited"]:
        reasons.append(
            f"limited calibration support: {support['share_thin']:.0%} of this policy's judge scores lie "
            f"where calibration labels are thin or absent")
    return "plug_in", basis, reasons


def relative_status(transport_failed: bool, support_limited: bool, too_few_labels: bool, n_cal: int,
                    min_labels: int) -> tuple[str, str | None]:
    """May a Direct policy appear in relative claims (docs/statistics.md, "Refused means refused")?

    A failed transport audit without a valid recalibration biases differences as much as the level,
    and so does a calibration on too few labels: not estimable. Limited calibration support only:
    rank-only with conservative intervals.
    """
    if transport_failed:
        return "not_estimable", "transport audit failed and no valid recalibration"
    if too_few_labels:
        return "not_estimable", f"only {n_cal} calibration labels (at least {min_labels} needed)"
    if support_limited:
        return "rank_only", "limited calibration support: rank-only, conservative intervals"
    return "ok", None


class _Stats:
    """Summaries of the 2K statistics by both routes (the reported one in ``se``/``ci``).

    Own-label columns (``col >= n_policies``: plug-in plus own label residuals) get the small-sample
    intervals of `cje_engine.inference.intervals` (``OWN_LABEL_BOOTSTRAP`` / ``OWN_LABEL_ANALYTIC``,
    from the replicates, the influence column ``infl[:, col]`` and ``dfs[col]``); plug-in columns keep
    the percentile and normal intervals.
    """

    def __init__(self, stats: np.ndarray, cov: np.ndarray, reps: np.ndarray | None, crit: np.ndarray,
                 alpha: float, scale: tuple[float, float], *, infl: np.ndarray | None = None,
                 dfs: np.ndarray | None = None, n_policies: int | None = None) -> None:
        self.stats, self.cov, self.reps, self.crit, self.alpha, self.scale = stats, cov, reps, crit, alpha, scale
        self.infl, self.dfs = infl, dfs
        self.n_policies = len(stats) // 2 if n_policies is None else n_policies
        self._done: dict[int, dict] = {}  # col -> its summary
        self._raw: dict[int, tuple[list[float], str]] = {}  # col -> (unclipped reported interval, method)

    def _own(self, col: int) -> bool:
        return self.infl is not None and self.dfs is not None and col >= self.n_policies

    def _ensure(self, col: int) -> None:
        if col not in self._done:
            self._done[col] = self._summary(col)

    def __call__(self, col: int) -> dict:
        """The summary of statistic ``col`` (computed once; callers get their own copy of the dict)."""
        self._ensure(col)
        # the values are numbers and lists of numbers (`_summary`): copying the lists is a deep copy (~20x cheaper)
        return {k: (list(v) if isinstance(v, list) else copy.deepcopy(v)) for k, v in self._done[col].items()}

    def _summary(self, col: int) -> dict:
        est = float(self.stats[col])
        se_a = float(np.sqrt(max(self.cov[col, col], 0.0)))
        c = self.crit[col]
        own = self._own(col)
        kw = dict(alpha=self.alpha, df=float(self.dfs[col]), infl=self.infl[:, col]) if own else {}
        if own and self.reps is not None:  # both routes' intervals read the same acceleration: computed once
            kw["accel"] = acceleration(kw["infl"])
        ci_a = own_label_interval(OWN_LABEL_ANALYTIC, est, se=se_a, **kw) if own else [est - c * se_a, est + c * se_a]
        out = {"estimate": est, "se_analytic": se_a, "ci_analytic": clip(ci_a, self.scale)}
        self._raw[col] = (list(ci_a), (OWN_LABEL_ANALYTIC if own else "normal"))
        if self.reps is not None:
            r = self.reps[:, col]
            r = r[np.isfinite(r)]
            se_b = float(np.std(r, ddof=1))
            a = self.alpha
            ci_b = (own_label_interval(OWN_LABEL_BOOTSTRAP, est, reps=r, **kw) if own
                    else np.percentile(r, [50 * a, 100 - 50 * a]))
            out.update(se_bootstrap=se_b, ci_bootstrap=clip(ci_b, self.scale))
            out.update(se=se_b, ci=out["ci_bootstrap"])
            self._raw[col] = (list(ci_b), (OWN_LABEL_BOOTSTRAP if own else "percentile"))
        else:
            out.update(se=se_a, ci=out["ci_analytic"])
        return out

    def reported_raw(self, col: int) -> tuple[list[float], str]:
        """The reported route's interval of ``col`` before clipping to the label scale, and its method."""
        self._ensure(col)
        return self._raw[col]


def selective_level(summary: _Stats, k: int, audit: dict, p_audit: np.ndarray, reps: np.ndarray | None,
                    infl: dict, is_source: bool, alpha: float) -> dict | None:
    """The interval of policy ``k``'s recalibrated level conditional on its failed audit (docs/statistics.md,
    "Selective intervals after a failed audit"), or None when the audit's event cannot be rebuilt.

    The selection is ``|R / s| > c`` with ``R``, ``s`` the audit's residual mean and SE and ``c`` the
    quantile of the policy's Holm threshold (`holm_threshold`, the other policies' p-values held fixed) in the
    audit's reference distribution: normal, or Student-t with the audit's ``df`` for a borrowed calibrator.
    ``Var(L)`` and ``Cov(L, R)`` come from the replicates (bootstrap route: ``R = L - plug-in`` in each) or
    from the influence terms (analytic route: the level's total influence and the audit's, as in
    `cje_engine.pipeline.calibration.audit_statistics`).
    """
    K = summary.n_policies
    col = K + k
    resid, se_r = audit["residual_mean"], audit["se"]
    if resid is None or not se_r or audit["p_value"] is None:
        return None
    crit, threshold = audit_critical_z(p_audit, k, alpha, audit.get("df"))  # t reference: borrowed calibrators
    if not abs(resid / se_r) > crit:  # the audit's p-value is not the one this rebuilds
        return None
    if reps is not None:
        r = reps[:, [col, k]]
        r = r[np.isfinite(r).all(axis=1)]
        c = np.cov(r[:, 0], r[:, 0] - r[:, 1])
        var_l, cov_lr = float(c[0, 0]), float(c[0, 1])
    else:
        psi = infl["calibration"][:, col] if is_source else infl["audit"][:, k]
        c = cluster_cov(np.column_stack([infl["total"][:, col], psi]))
        var_l, cov_lr = float(c[0, 0]), float(c[0, 1])
    ci_raw, method = summary.reported_raw(col)
    out = audit_selective_interval(float(summary.stats[col]), ci_raw, var_l, cov_lr, float(resid), float(se_r),
                                   crit, alpha)
    out["ci"] = clip(out["ci"], summary.scale)
    out["ci_unconditional"] = clip(out["ci_unconditional"], summary.scale)
    out["unconditional_method"] = method
    out["p_threshold"] = float(threshold)
    return out


def _level_interval(summary: _Stats, k: int, col: int, selected: bool, basis: str, audit: dict,
                    audits: list[dict], reps: np.ndarray | None, infl: dict,
                    is_source: bool) -> tuple[list[float], str, str, dict | None]:
    """(ci, ci_method, basis, selective block) of policy ``k``'s reported level (statistic ``col``).

    ``selected``: the level is own-label *because* the audit failed (``audited`` levels, recalibrated, the
    plug-in's support not limited); its interval is then conditional on that failure (`selective_level`).
    Other levels keep theirs (``robust``/``augmented`` report own-label levels whatever the audit says)."""
    ci, method = summary(col)["ci"], summary.reported_raw(col)[1]
    if not selected:
        return ci, method, basis, None
    p_audit = np.array([np.nan if a["p_value"] is None else a["p_value"] for a in audits])
    sel = selective_level(summary, k, audit, p_audit, reps, infl, is_source, summary.alpha)
    if sel is None:
        return ci, method, basis, None
    basis += (f"; its interval is conditional on the audit having failed (selective: |z| = {abs(sel['z']):.2f} "
              f"against the critical value {sel['critical_z']:.2f}; unconditional {sel['unconditional_method']} "
              f"interval [{sel['ci_unconditional'][0]:.3f}, {sel['ci_unconditional'][1]:.3f}])")
    return sel["ci"], SELECTIVE, basis, sel


def prompts_per_policy(policy: np.ndarray, prompt: np.ndarray, n_policies: int, n_prompts: int) -> np.ndarray:
    """Distinct prompts of each policy (one pass over the (policy, prompt) pairs, not one per policy)."""
    pairs = np.unique(policy.astype(np.int64) * n_prompts + prompt)
    return np.bincount(pairs // n_prompts, minlength=n_policies)


def _own_labels(design: Design) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Each policy's labelled rows as indices (increasing, as a mask would select them: no row-sized
    masks), their number and their number of distinct prompts."""
    d, K = design.data, design.n_policies
    lab_pol = d.policy[design.lab_rows]
    own_rows = [design.lab_rows[lab_pol == k] for k in range(K)]
    n_own_prompts = np.array([count_distinct(d.prompt[rows_k], d.n_prompts) for rows_k in own_rows])
    return own_rows, np.bincount(lab_pol, minlength=K), n_own_prompts


def _audits(prep: Any, reps: np.ndarray | None, n_own: np.ndarray, n_own_prompts: np.ndarray
            ) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """(audit of every policy, its SE route, whether it trains the calibrator): residual means (= augmented -
    plug-in) whose SEs carry a borrowed calibrator's error."""
    opts, design, stats = prep.options, prep.design, prep.stats
    d, K, alpha, n_cal = design.data, design.n_policies, opts.alpha, design.cal_rows.size
    delta, se_delta, is_source = audit_statistics(design, stats, prep.infl)
    se_route = np.where(is_source, "influence (residual term)", "influence")
    if reps is not None:
        # borrowed calibrators: the bootstrap SD of the residual mean, refitting the calibrator (both
        # stages in two-stage mode, whose first stage the influence term leaves out) in every replicate
        for k in np.flatnonzero(~is_source & np.isfinite(se_delta)):
            dk = reps[:, K + k] - reps[:, k]
            dk = dk[np.isfinite(dk)]
            if dk.size > 1:
                se_delta[k] = float(np.std(dk, ddof=1))
                se_route[k] = "bootstrap"
    margin = opts.audit_margin_in(d.label_scale)
    df_delta = audit_degrees_of_freedom(design, prep.infl, se_delta, is_source, n_own_prompts)  # t reference (small calibrators)
    audits = audit_policies(delta, se_delta, n_own, n_own_prompts, alpha, margin, df=df_delta,
                            n_calibration=int(n_cal), min_labels=opts.min_labels)
    return audits, se_route, is_source


@dataclass
class _Extended:
    """Direct's statistics extended by the verified levels: columns ``[plug-in | augmented | own-label
    mean | power-tuned]``, K each, for the point estimates, replicates and influence terms."""

    stats: np.ndarray  # (4K,)
    reps: np.ndarray | None  # (B, 4K)
    total: np.ndarray  # (n_prompts, 4K)
    calibration: np.ndarray  # (n_prompts, 4K): the calibration (plug-in) or label (own-label) part
    lam: np.ndarray  # (K,) power-tuning weight of each policy (NaN without own labels)


def extend_with_verified(prep: Any, reps: np.ndarray | None) -> _Extended:
    """Own-label means and power-tuned (PPI++) levels beside Direct's 2K statistics (`cje_engine.direct.verified`).

    ``reps``: (B, 3K) replicates (the 2K statistics then the own-label means) or None (analytic route).
    """
    design = prep.design
    d, K = design.data, design.n_policies
    lab = design.lab_rows
    tot, cal = prep.infl["total"], prep.infl["calibration"]
    if isinstance(tot, GramTerms):  # Gram form: the own-label terms are in its basis (`sharded.gram_influence`)
        own, _ = own_label_influence(np.zeros(lab.size, np.int64), d.policy[lab], d.label[lab], d.label_weight[lab],
                                     1, K)
        psi_own = prep.infl["own"]
    else:
        own, psi_own = own_label_influence(d.prompt[lab], d.policy[lab], d.label[lab], d.label_weight[lab],
                                           d.n_prompts, K)
    aug = prep.stats[K:]
    lam = np.full(K, np.nan)
    for k in range(K):
        if not np.isfinite(own[k]):
            continue
        if reps is not None:
            lam[k] = power_tuned_lambda(reps[:, 2 * K + k], reps[:, K + k])
        else:
            lam[k] = power_tuned_lambda(psi_own[:, k], prep.infl["total"][:, K + k])
    lam_f = np.nan_to_num(lam, nan=1.0)
    ppi = power_tuned(own, aug, lam_f)
    total = np.hstack([tot, psi_own, power_tuned(psi_own, tot[:, K:], lam_f)])
    calib = np.hstack([cal, psi_own, power_tuned(psi_own, cal[:, K:], lam_f)])
    reps_ext = None
    if reps is not None:
        reps_ext = np.hstack([reps[:, :3 * K], power_tuned(reps[:, 2 * K:], reps[:, K:2 * K], lam_f)])
    return _Extended(np.concatenate([prep.stats, own, ppi]), reps_ext, total, calib, lam)


def labels_to_verify(k: int, n_own: int, n_rows: int, assumed: np.ndarray, se_verified: np.ndarray,
                     resid_sd: float, min_labels: int, alpha: float, power: float = 0.8) -> dict:
    """How many own labels of policy ``k`` would give it a verified level and decide its closest comparison.

    The closest comparison is with the verified policy whose assumes-transport level is nearest
    (``assumed``); at that difference ``diff`` it is decided at ``power`` when the difference's SE is
    ``|diff| / (z_{1-alpha/2} + z_power)``. With ``n`` own labels the new verified level's SE is about
    ``resid_sd / sqrt(n)`` (the label residuals dominate it) and the other level's SE stays
    ``se_verified[j]``, so ``n = resid_sd^2 / ((diff / z)^2 - se_j^2)``; none when the other level alone is
    too imprecise. Capped at the policy's unlabelled rows (``capped``).
    """
    need = max(min_labels - n_own, 0)
    out = {"n_labels": int(need), "for_level": int(need), "for_closest_comparison": None, "closest": None,
           "power": power, "residual_sd": float(resid_sd) if np.isfinite(resid_sd) else None, "capped": False}
    others = [j for j in range(assumed.size) if j != k and np.isfinite(assumed[j]) and np.isfinite(se_verified[j])]
    if others and np.isfinite(assumed[k]) and np.isfinite(resid_sd) and resid_sd > 0:
        j = min(others, key=lambda j: abs(assumed[j] - assumed[k]))
        diff = abs(float(assumed[j] - assumed[k]))
        z = float(dist.norm_ppf(1 - alpha / 2) + dist.norm_ppf(power))
        room = (diff / z) ** 2 - float(se_verified[j]) ** 2
        out["closest"] = {"policy": j, "assumed_difference": diff}
        if room > 0:
            n_cmp = int(np.ceil(resid_sd ** 2 / room))
            out["for_closest_comparison"] = max(n_cmp - n_own, 0)
            out["n_labels"] = int(max(need, n_cmp - n_own))
    if out["n_labels"] > n_rows - n_own:
        out["n_labels"], out["capped"] = int(max(n_rows - n_own, 0)), True
    return out


def level_choice(verified_mode: bool, has_verified: bool, floor: bool, protocol_refused: bool, trusted: bool) -> str:
    """Which level a policy reports (docs/statistics.md, "Verified and assumed claims"); every mode's rule.

    Parameters
    ----------
    verified_mode : ``level_estimator == "verified"`` (the default)
    has_verified : the policy has a verified level (enough own labels for the power-tuned correction)
    floor : a minimum-evidence refusal (too few prompts or calibration labels) applies
    protocol_refused : the protocol's (assumes-transport) level is refused
    trusted : the team trusts the calibration's transport to the policy (``trust_transport``)

    Returns
    -------
    str
        ``"verified"`` (the verified level is reported), ``"unverified"`` (no quotable level: estimate null,
        the protocol's level only in ``assumed``) or ``"protocol"`` (the protocol's level is reported:
        refused, trusted, or every level of a non-default estimator; see `protocol_claim`).
    """
    if verified_mode and not floor and has_verified:
        return "verified"
    if verified_mode and not floor and not protocol_refused and not trusted:
        return "unverified"
    return "protocol"


def unverified_relative(n_own: int, min_labels: int) -> tuple[str, str]:
    """The relative status of a policy without a verified level (it leaves the verified claims)."""
    return "not_estimable", f"no verified level ({n_own} own labels, {min_labels} needed)"


def protocol_claim(verified_mode: bool, claim: str, rests_on_transport: bool, trusted: bool, basis: str,
                   relative: tuple[str, str | None], n_own: int, min_labels: int, what: str = "its plug-in"
                   ) -> tuple[str, str, tuple[str, str | None]]:
    """(level claim, basis, relative status) of a reported protocol level (`level_choice` ``"protocol"``).

    In verified mode a quotable level that rests on transport (a plug-in, an importance-weighted or
    stacked estimate) is reported only when trusted and reads ``assumes_transport``; a refused one
    without a verified level leaves the verified claims unless trusted. ``what`` names the level in
    that reason.
    """
    if verified_mode and claim == "ok" and rests_on_transport:
        return "assumes_transport", f"assumes transport (trusted: trust_transport): {basis}", relative
    if verified_mode and not trusted and relative[0] != "not_estimable":
        # refused and without a verified level: nothing to compare in the verified claims
        return claim, basis, ("not_estimable", f"no verified level ({n_own} own labels, {min_labels} needed) "
                                               f"and {what} is refused")
    return claim, basis, relative


#: A declared label scale whose labels span less than this share of its width gets a warning.
NARROW_LABEL_SHARE = 0.5


def label_scale_warning(labels: np.ndarray, scale: tuple[float, float], opts: Any) -> str | None:
    """A warning when the labels span under `NARROW_LABEL_SHARE` of the declared label scale (e.g. 1-5
    labels declared on 0-10): the audit margin, the interval clipping and the default planner effect are
    fractions of the declared scale, so a scale far wider than the data loosens them without a word.
    ``None`` when the scale fits (or fewer than two labels differ). ``opts``: the `EvaluationOptions` (its
    audit margin, in label units by `EvaluationOptions.audit_margin_in`)."""
    y = np.asarray(labels, dtype=float)
    y = y[np.isfinite(y)]
    lo, hi = float(scale[0]), float(scale[1])
    if y.size < 2 or hi <= lo:
        return None
    span = float(y.max() - y.min())
    if span <= 0 or span >= NARROW_LABEL_SHARE * (hi - lo):
        return None
    margin = opts.audit_margin_in(scale)
    return (f"the oracle labels span {y.min():g}-{y.max():g}, under half of the declared label scale {lo:g}-{hi:g}: "
            f"the transport audit margin ({opts.audit_margin:g} of the declared scale = {margin:.3g} label units) is "
            f"{(hi - lo) / span:.2g}x wider than on the labels' own range; declare the scale the labels were "
            f"given on (e.g. {y.min():g}-{y.max():g}) unless they could use all of {lo:g}-{hi:g}")


def summarize_direct(prep: Any, reps: np.ndarray | None) -> DirectSummaries:
    """Direct's gated entry for every design policy (see docs/statistics.md for the rules).

    Parameters
    ----------
    prep : `cje_engine.pipeline.direct.Prepared`
    reps : ndarray (B, 3K) of Direct's replicates (the 2K statistics, then the own-label means), or
        None for the analytic route

    Each policy gets two levels: the *verified* one (``level_estimator="verified"``: the power-tuned
    own-label correction, valid without transport) and the *assumed* one (the paper's protocol:
    the calibrated plug-in where the audit does not fail). ``DirectSummaries.cols`` index the
    extended columns (`extend_with_verified`); ``assumed_cols`` the protocol's.
    """
    opts, design = prep.options, prep.design
    d = design.data
    K = len(d.policies)
    alpha = opts.alpha
    verified_mode = opts.level_estimator == "verified"
    protocol = "audited" if verified_mode else opts.level_estimator
    reps2 = None if reps is None else reps[:, :2 * K]
    ext = extend_with_verified(prep, reps)
    # only the variances are read (the diagonal): K columns' squares, not the K x K products (segments: K ~ 100)
    cov = np.diag(cluster_var(ext.total))
    cov_cal = np.diag(cluster_var(ext.calibration))
    warnings: list[str] = []
    scale_note = label_scale_warning(d.label, d.label_scale, opts)
    if scale_note:
        log.warning("%s", scale_note)
        warnings.append(scale_note)
    own_rows, n_own, n_own_prompts = _own_labels(design)
    totals = row_totals(prep)
    n_rows, n_prompts_k = totals.n_rows, totals.n_prompts
    cal_set = set(present_codes(d.policy[design.cal_rows], len(d.policies)).tolist())
    excluded = {e["policy"] for e in prep.excluded}
    n_cal = design.cal_rows.size

    audits, se_route, is_source = _audits(prep, reps2, n_own, n_own_prompts)
    support = support_checks(design, opts, score_range=(totals.score_min, totals.score_max))
    dfs2 = degrees_of_freedom(K, n_own_prompts)
    dfs = np.concatenate([dfs2, dfs2[K:], dfs2[K:]])
    summary = _Stats(ext.stats, cov, ext.reps, dist.t_ppf(1 - alpha / 2, dfs), alpha, d.label_scale,
                     infl=ext.total, dfs=dfs, n_policies=K)
    # for labels_to_verify: each policy's assumes-transport (protocol) level and verified SE
    assumed_est = np.array([summary(K + k if uses_own_labels(protocol, audits[k]["verdict"], int(n_own[k]),
                                                             opts.min_labels, bool(support[k]["limited"])) else k)
                            ["estimate"] for k in range(K)])
    se_verified = np.array([summary(3 * K + k)["se"] if verified_mode and n_own[k] >= opts.min_labels
                            and n_own_prompts[k] >= 2 else np.nan for k in range(K)], dtype=float)
    resid = d.label[design.lab_rows] - prep.f[design.lab_rows]
    resid_sd = float(np.std(resid, ddof=1)) if resid.size > 1 else float("nan")

    policies: dict[str, PolicyResult] = {}
    cols, refused = np.zeros(K, dtype=int), np.zeros(K, dtype=bool)
    assumed_cols, assumed_refused = np.zeros(K, dtype=int), np.zeros(K, dtype=bool)
    assumed_rel: list[tuple[str, str | None]] = []
    for k, name in enumerate(d.policies):
        audit = audits[k]
        audit["calibrator"] = "cross_fitted" if k in cal_set else "excluded" if name in excluded else "borrowed"
        audit["se_route"] = str(se_route[k]) if audit["se"] is not None else None
        sel_lab = own_rows[k]
        w_lab = d.label_weight[sel_lab]
        audit["deciles"] = residual_deciles(d.score[sel_lab], d.label[sel_lab] - prep.f[sel_lab], w_lab)
        has_aug = n_own[k] > 0
        # the paper's protocol (or the estimator the options name): the assumes-transport level
        use_aug = uses_own_labels(protocol, audit["verdict"], int(n_own[k]), opts.min_labels,
                                  bool(support[k]["limited"]))
        p_col = K + k if use_aug else k
        p_code, p_basis, p_reasons = _basis(opts, audit, support[k], int(n_own[k]), use_aug, protocol)
        floor = []
        if n_cal < opts.min_labels:
            floor.append(f"only {n_cal} calibration labels (at least {opts.min_labels} needed)")
        if n_prompts_k[k] < opts.min_prompts:
            floor.append(f"only {int(n_prompts_k[k])} prompt(s) of its own (at least {opts.min_prompts} needed to "
                         "estimate its variance)")
        p_reasons = p_reasons + floor
        p_rel = relative_status(p_code == "plug_in" and audit["verdict"] == "fail",
                                p_code == "plug_in" and support[k]["limited"],
                                n_cal < opts.min_labels, int(n_cal), opts.min_labels)
        if n_prompts_k[k] < opts.min_prompts:
            p_rel = ("not_estimable", floor[-1])
        p_summ = summary(p_col)
        p_summ["ci"], p_ci_method, p_basis, selective = _level_interval(
            summary, k, p_col, p_code == "recalibrated" and protocol == "audited"
            and not support[k]["limited"], p_basis, audit, audits, reps2, prep.infl, bool(is_source[k]))
        assumed_cols[k], assumed_refused[k] = p_col, bool(p_reasons)
        assumed_rel.append(p_rel)
        p_claim = "refused" if p_reasons else "ok"

        # the reported level: verified where the policy's own labels allow it
        has_verified = (verified_mode and n_own[k] >= opts.min_labels and n_own_prompts[k] >= 2
                        and np.isfinite(ext.stats[3 * K + k]))
        choice = level_choice(verified_mode, has_verified, bool(floor), bool(p_reasons), opts.trusts(name))
        if choice == "verified":
            col, code, reasons, rel = 3 * K + k, "power_tuned", [], ("ok", None)
            basis = (f"verified: power-tuned residual correction (PPI++, lambda {ext.lam[k]:.2f}) on {int(n_own[k])} "
                     f"own labels; valid whether or not the calibration transports to this policy")
            claim, summ, ci_method, sel = "ok", summary(col), summary.reported_raw(col)[1], None
        elif choice == "unverified":
            col, code, reasons = p_col, p_code, []
            rel = unverified_relative(int(n_own[k]), opts.min_labels)
            basis = f"assumes transport: {p_basis}"
            claim, summ, ci_method, sel = "assumes_transport", None, None, None
        else:  # the protocol's level: refused, a trusted plug-in, or every level of a non-default estimator
            col, code, reasons = p_col, p_code, p_reasons
            claim, basis, rel = protocol_claim(verified_mode, p_claim, p_col < K, opts.trusts(name), p_basis, p_rel,
                                               int(n_own[k]), opts.min_labels)
            summ, ci_method, sel = p_summ, p_ci_method, selective
        cols[k] = col
        refused[k] = claim == "refused"
        var_tot = cov[col, col]
        share = float(cov_cal[col, col] / var_tot) if var_tot > 0 else None
        quoted = summ is not None
        policies[name] = PolicyResult(
            estimate=summ["estimate"] if quoted else None, se=summ["se"] if quoted else None,
            ci=summ["ci"] if quoted else None, ci_method=ci_method,
            selective=_typed(SelectiveInterval, sel),
            level_claim=claim,
            refusal_reasons=reasons,
            basis=basis, basis_code=code,
            transport="audited" if audit["verdict"] != "not_run" else "unaudited",
            verified=(_typed(VerifiedLevel, {"method": "power_tuned", "lambda": float(ext.lam[k]),
                                             "n_labels": int(n_own[k]),
                                             **{f: summary(3 * K + k)[f] for f in ("estimate", "se", "ci")}})
                      if has_verified else None),
            assumed=_typed(AssumedLevel, {"estimate": p_summ["estimate"], "se": p_summ["se"], "ci": p_summ["ci"],
                                          "ci_method": p_ci_method, "basis_code": p_code, "level_claim": p_claim,
                                          "basis": p_basis, "refusal_reasons": p_reasons}),
            labels_to_verify=(None if has_verified or not verified_mode else _typed(LabelsToVerify, labels_to_verify(
                k, int(n_own[k]), int(n_rows[k]), assumed_est, se_verified, resid_sd, opts.min_labels, alpha))),
            plug_in=_typed(StatSummary, summary(k)),
            augmented=_typed(StatSummary, summary(K + k)) if has_aug else None,
            raw_judge_mean=totals.judge_mean(k),
            oracle_mean=float(np.sum(w_lab * d.label[sel_lab]) / np.sum(w_lab)) if has_aug else None,
            oracle_only=_typed(OracleOnly, oracle_only(d, sel_lab, alpha)) if n_own_prompts[k] >= 2 else None,
            n_rows=int(n_rows[k]),
            n_prompts=int(n_prompts_k[k]),
            n_labelled=int(n_own[k]),
            variance_share_calibration=share,
            variance_components=_typed(VarianceComponents, variance_components(
                cov[col, col], cov_cal[col, col], d.n_prompts, int(n_own[k]) if col >= K else int(n_cal))),
            se_analytic=summ["se_analytic"] if quoted else None,
            se_bootstrap=summ.get("se_bootstrap") if quoted else None,
            var_cal_jackknife_plug_in=float(prep.jackknife[k]),
            var_cal_influence_plug_in=float(cov_cal[k, k]),
            support=_typed(Support, support[k]),
            audit=_typed(Audit, audit),
            relative_claim=rel[0],
            relative_reason=rel[1],
        )
        if quoted and reps is not None and summ["se_analytic"] > 0:
            ratio = summ["se_bootstrap"] / summ["se_analytic"]
            if not (1 / SE_AGREEMENT_RATIO <= ratio <= SE_AGREEMENT_RATIO):
                warnings.append(f"{name}: bootstrap SE {summ['se_bootstrap']:.4f} and analytic SE "
                                f"{summ['se_analytic']:.4f} differ by a factor {ratio:.2f}")
    _name_closest(policies, list(d.policies))
    return DirectSummaries(policies, cols, refused, dfs, calibration_summary(prep), warnings,
                           reps=ext.reps, influence=ext.total, assumed_cols=assumed_cols,
                           assumed_refused=assumed_refused, assumed_relative=assumed_rel)


def _name_closest(policies: dict[str, PolicyResult], names: list[str]) -> None:
    """Fill the closest policy's name into each ``labels_to_verify`` block."""
    for n in names:
        ltv = policies[n].labels_to_verify
        if ltv is not None and ltv.closest:
            ltv.closest["policy"] = names[int(ltv.closest["policy"])]


def _typed(model: type[BaseModel], block: dict | None) -> BaseModel | None:
    """A result block (a helper's dict of numpy-laden numbers) as its typed model: numbers made plain
    (NaN/inf to None, as `jsonable` does for every result), None stays None."""
    return None if block is None else model(**jsonable(block))
