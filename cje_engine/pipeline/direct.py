"""The evaluation pipeline: prepare (validate, calibrate), bootstrap chunks, finalize.

``evaluate(data, **options)`` is ``finalize(prep, [bootstrap_chunk(prep, 0, B)])`` with
``prep = prepare(data, **options)``. The split exists so an orchestrator can run the
bootstrap in chunks on many workers: replicate ``b`` depends only on ``(seed, b)``, so any
chunking gives bit-identical numbers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy.stats import kendalltau, norm, t as student_t

from cje_engine import __version__
from cje_engine.audit import audit_policies, residual_deciles
from cje_engine.data.frame import EvalData
from cje_engine.errors import CJEInputError
from cje_engine.direct.estimators import (
    Design,
    bootstrap_weights,
    cluster_cov,
    cross_fit_models,
    fold_jackknife,
    influence,
    make_design,
    policy_stats,
    replicate,
)
from cje_engine.inference.multiplicity import adjust
from cje_engine.options import EvaluationOptions
from cje_engine.result import EvaluationResult

log = logging.getLogger(__name__)

#: Relative disagreement between bootstrap and analytic SEs that triggers a warning.
SE_AGREEMENT_RATIO = 1.25


@dataclass
class Prepared:
    """Everything computed before the bootstrap (picklable, shipped to workers)."""

    options: EvaluationOptions
    design: Design
    selection: dict
    f: np.ndarray
    full: Any
    stats: np.ndarray
    infl: dict
    jackknife: np.ndarray


def _to_evaldata(data: Any, opts: EvaluationOptions) -> EvalData:
    if isinstance(data, EvalData):
        return data
    from cje_engine.data.io import load_frame  # local import keeps module import light

    frame = load_frame(
        data,
        label_scale=opts.label_scale,
        score_scale=opts.score_scale,
        covariates=list(opts.covariates),
        policies=list(opts.policies) if opts.policies else None,
    )
    return EvalData.from_frame(
        frame,
        covariates=opts.covariates,
        label_scale=opts.label_scale,
        score_scale=opts.score_scale,
        n_folds=opts.n_folds,
        policies=list(opts.policies) if opts.policies else None,
    )


def select_mode(data: EvalData, opts: EvaluationOptions) -> tuple[dict, dict]:
    """Pick the calibration mode; ``auto`` compares out-of-fold RMSE on calibration rows.

    Returns the selection (for the result) and the cross-fits of every mode tried, keyed by
    mode, as ``(design, f, full, fold_models)`` so the chosen one is not fitted twice.
    """
    has_cov = data.X.shape[1] > 0
    modes = ["monotone", "two_stage"] if has_cov else ["monotone"]
    fits, rmse = {}, {}
    for mode in modes:
        design = make_design(data, mode, opts.calibration_policies)
        f, full, models = cross_fit_models(design)
        cr = design.cal_rows
        fits[mode] = (design, f, full, models)
        rmse[mode] = float(np.sqrt(np.mean((data.label[cr] - f[cr]) ** 2)))
    if opts.calibration_mode != "auto":
        chosen, reason = opts.calibration_mode, "requested by the user"
    elif not has_cov:
        chosen, reason = "monotone", "no covariates given, so the two-stage index has nothing to add"
    elif rmse["two_stage"] < rmse["monotone"]:
        chosen = "two_stage"
        reason = (f"two-stage has the lower out-of-fold RMSE ({rmse['two_stage']:.4f} vs "
                  f"{rmse['monotone']:.4f} for monotone)")
    else:
        chosen = "monotone"
        reason = (f"monotone has an out-of-fold RMSE ({rmse['monotone']:.4f}) no worse than two-stage "
                  f"({rmse['two_stage']:.4f}); the simpler mode wins ties")
    selection = {"requested": opts.calibration_mode, "oof_rmse": rmse, "chosen": chosen, "reason": reason}
    return selection, fits


def prepare(data: Any, **options: Any) -> Prepared:
    """Validate the data, choose and fit the calibration, compute point estimates.

    Parameters
    ----------
    data : path, list of paths, pandas.DataFrame, pyarrow.Table or EvalData
    **options : see `EvaluationOptions`
    """
    opts = EvaluationOptions.build(**options)
    ed = _to_evaldata(data, opts)
    if opts.calibration_policies is not None:
        missing = [p for p in opts.calibration_policies if p not in ed.policies]
        if missing:
            raise CJEInputError(f"calibration policy {missing[0]!r} has no rows", column="policy")
    selection, fits = select_mode(ed, opts)
    design, f, full, models = fits[selection["chosen"]]
    stats = policy_stats(design, f)
    infl = influence(design, f, full)
    jk = fold_jackknife(design, models)
    log.info("prepared %d rows, %d prompts, %d policies, mode=%s", ed.n_rows, ed.n_prompts,
             len(ed.policies), selection["chosen"])
    return Prepared(opts, design, selection, f, full, stats, infl, jk)


def bootstrap_chunk(prep: Prepared, start: int, stop: int) -> np.ndarray:
    """Replicates ``start..stop-1`` of the calibration-aware cluster bootstrap.

    Each replicate resamples prompts with replacement, refits the calibrator (all folds)
    and recomputes every policy's plug-in and augmented value, so differences are paired.
    """
    n_p = prep.design.data.n_prompts
    out = np.empty((stop - start, prep.stats.size))
    for i, b in enumerate(range(start, stop)):
        out[i] = replicate(prep.design, bootstrap_weights(prep.options.seed, b, n_p))
    return out


def evaluate(data: Any, **options: Any) -> EvaluationResult:
    """Calibrated Direct evaluation of every policy (see the README and docs/statistics.md).

    Example
    -------
    >>> res = evaluate(frame, covariates=["response_length"], n_bootstrap=2000, seed=0)
    >>> res.to_dict()["policies"]["base"]["ci"]
    """
    prep = prepare(data, **options)
    chunks = []
    if prep.options.inference == "bootstrap":
        chunks.append(bootstrap_chunk(prep, 0, prep.options.n_bootstrap))
    return finalize(prep, chunks)


# --------------------------------------------------------------------------------------
# finalize


def _clip(ci: Sequence[float], scale: tuple[float, float]) -> list[float]:
    return [float(np.clip(ci[0], *scale)), float(np.clip(ci[1], *scale))]


def _support(design: Design, opts: EvaluationOptions) -> list[dict]:
    d = design.data
    cs = np.sort(d.score[design.cal_rows])
    if d.score_scale is not None:
        width = d.score_scale[1] - d.score_scale[0]
    else:
        width = float(d.score.max() - d.score.min()) or 1.0
    h = opts.support_bandwidth * width
    tol = 1e-9 * width
    out = []
    for k in range(len(d.policies)):
        s = d.score[d.policy == k]
        cnt = np.searchsorted(cs, s + h + tol, side="right") - np.searchsorted(cs, s - h - tol, side="left")
        outside = (s < cs[0] - tol) | (s > cs[-1] + tol)
        thin = (cnt < opts.support_min_labels) | outside
        share_thin = float(thin.mean())
        out.append({
            "share_outside_range": float(outside.mean()),
            "share_thin": share_thin,
            "limited": share_thin > opts.support_material_share,
            "rule": (f"thin = fewer than {opts.support_min_labels} calibration labels within "
                     f"+/-{h:.4g} of the score, or outside [{cs[0]:.4g}, {cs[-1]:.4g}]; limited when more than "
                     f"{opts.support_material_share:.0%} of rows are thin"),
        })
    return out


def _variance_components(var_total: float, var_cal: float, n_prompts: int, m_labels: int) -> dict:
    """Per-unit variance components for budget planning: Var ~ sigma_eval^2 / n + sigma_cal^2 / m.

    ``var_cal`` is the influence-function variance of the calibration term (plug-in) or of the
    label-residual term (augmented); the rest is attributed to evaluation sampling.
    """
    var_eval = max(var_total - var_cal, 0.0)
    return {"sigma2_eval": var_eval * n_prompts, "sigma2_cal": var_cal * m_labels,
            "n_prompts": int(n_prompts), "m_labels": int(m_labels)}


def _oracle_only(d: EvalData, sel: np.ndarray, alpha: float) -> dict:
    """The oracle-only baseline: weighted mean of the policy's own labels, prompt-clustered t interval."""
    w = d.label_weight[sel]
    y = d.label[sel]
    mean = float(np.sum(w * y) / np.sum(w))
    prompts, inv = np.unique(d.prompt[sel], return_inverse=True)
    c = np.bincount(inv, weights=w * (y - mean) / np.sum(w))
    n = prompts.size
    se = float(np.sqrt(np.sum(c**2) * n / (n - 1)))
    q = float(student_t.ppf(1 - alpha / 2, n - 1))
    return {"estimate": mean, "se": se, "ci": _clip([mean - q * se, mean + q * se], d.label_scale), "n_labels": int(sel.sum())}


def _calibration_summary(prep: Prepared) -> dict:
    d = prep.design.data
    cr = prep.design.cal_rows
    s_all = d.score
    lo, hi = float(s_all.min()), float(s_all.max())
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
    cal_pols = sorted({d.policies[i] for i in np.unique(d.policy[cr])})
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
    }


def finalize(prep: Prepared, chunks: Sequence[np.ndarray]) -> EvaluationResult:
    """Turn point estimates and bootstrap replicates into the gated, compared result."""
    opts = prep.options
    design = prep.design
    d = design.data
    K = len(d.policies)
    alpha = opts.alpha
    reps = np.vstack(chunks) if chunks else np.empty((0, 2 * K))
    use_boot = opts.inference == "bootstrap"
    if use_boot and reps.shape[0] != opts.n_bootstrap:
        raise ValueError(f"expected {opts.n_bootstrap} bootstrap replicates, got {reps.shape[0]}")
    cov = cluster_cov(prep.infl["total"])
    cov_cal = cluster_cov(prep.infl["calibration"])
    stats = prep.stats
    warnings: list[str] = []

    lab = d.labelled
    n_own = np.bincount(d.policy[lab], minlength=K)
    n_own_prompts = np.array([np.unique(d.prompt[lab & (d.policy == k)]).size for k in range(K)])
    cal_set = set(np.unique(d.policy[design.cal_rows]).tolist())
    n_cal = design.cal_rows.size

    # Audits on residual means (= augmented - plug-in) with clustered SEs.
    delta = stats[K:] - stats[:K]
    se_delta = np.sqrt(np.maximum(np.diag(cov_cal)[K:], 0.0))
    margin = opts.audit_margin * (d.label_scale[1] - d.label_scale[0])
    audits = audit_policies(delta, se_delta, n_own, n_own_prompts, alpha, margin)
    support = _support(design, opts)

    dfs = _degrees_of_freedom(prep, n_own_prompts)
    crit = student_t.ppf(1 - alpha / 2, dfs)

    def stat_summary(col: int) -> dict:
        est = float(stats[col])
        se_a = float(np.sqrt(max(cov[col, col], 0.0)))
        out = {"estimate": est, "se_analytic": se_a,
               "ci_analytic": _clip([est - crit[col] * se_a, est + crit[col] * se_a], d.label_scale)}
        if use_boot:
            r = reps[:, col]
            r = r[np.isfinite(r)]
            se_b = float(np.std(r, ddof=1))
            out.update(se_bootstrap=se_b, ci_bootstrap=_clip(np.percentile(r, [50 * alpha, 100 - 50 * alpha]),
                                                             d.label_scale))
            out.update(se=se_b, ci=out["ci_bootstrap"])
        else:
            out.update(se=se_a, ci=out["ci_analytic"])
        return out

    policies: dict[str, dict] = {}
    cols = np.zeros(K, dtype=int)
    refused = np.zeros(K, dtype=bool)
    for k, name in enumerate(d.policies):
        rows = d.policy == k
        audit = audits[k]
        audit["calibrator"] = "cross_fitted" if k in cal_set else "borrowed"
        sel_lab = lab & rows
        w_lab = d.label_weight[sel_lab]
        resid = d.label[sel_lab] - prep.f[sel_lab]
        audit["deciles"] = residual_deciles(d.score[sel_lab], resid, w_lab)
        has_aug = n_own[k] > 0
        if opts.estimator == "plug_in":
            use_aug = False
        elif opts.estimator == "augmented":
            use_aug = has_aug
        else:
            use_aug = n_own[k] >= opts.min_labels
        cols[k] = K + k if use_aug else k
        reasons: list[str] = []
        if use_aug:
            if audit["verdict"] == "fail":
                basis_code = "recalibrated"
                basis = (f"recalibrated: the borrowed calibration failed its audit, so the level is the calibrated "
                         f"plug-in plus the mean residual on {n_own[k]} own labels (augmented)")
            else:
                basis_code = "augmented"
                basis = f"augmented: calibrated plug-in plus the mean residual on {n_own[k]} own labels"
        else:
            basis_code = "plug_in"
            basis = "calibrated plug-in: mean of calibrated judge scores" + (
                "; rests on the untested assumption that the calibration transports to this policy"
                if n_own[k] == 0 else f" ({n_own[k]} own labels audit it)")
            if audit["verdict"] == "fail":
                reasons.append(
                    f"the transport audit failed and {n_own[k]} own labels are too few to recalibrate "
                    f"(at least {opts.min_labels} needed)" if opts.estimator != "plug_in" else
                    "the transport audit failed and the plug-in estimator was forced")
            if support[k]["limited"]:
                reasons.append(
                    f"limited calibration support: {support[k]['share_thin']:.0%} of this policy's judge scores lie "
                    f"where calibration labels are thin or absent")
        if n_cal < opts.min_labels:
            reasons.append(f"only {n_cal} calibration labels (at least {opts.min_labels} needed)")
        refused[k] = bool(reasons)
        summ = stat_summary(cols[k])
        var_tot = cov[cols[k], cols[k]]
        share = float(cov_cal[cols[k], cols[k]] / var_tot) if var_tot > 0 else None
        w_all = d.label_weight[sel_lab]
        entry = {
            "estimate": summ["estimate"], "se": summ["se"], "ci": summ["ci"],
            "level_claim": "refused" if refused[k] else "ok",
            "refusal_reasons": reasons,
            "basis": basis, "basis_code": basis_code,
            "transport": "audited" if audit["verdict"] != "not_run" else "unaudited",
            "plug_in": stat_summary(k),
            "augmented": stat_summary(K + k) if has_aug else None,
            "raw_judge_mean": float(d.score[rows].mean()),
            "oracle_mean": float(np.sum(w_all * d.label[sel_lab]) / np.sum(w_all)) if has_aug else None,
            "oracle_only": _oracle_only(d, sel_lab, alpha) if n_own_prompts[k] >= 2 else None,
            "n_rows": int(rows.sum()),
            "n_labelled": int(n_own[k]),
            "variance_share_calibration": share,
            "variance_components": _variance_components(
                cov[cols[k], cols[k]], cov_cal[cols[k], cols[k]], d.n_prompts,
                int(n_own[k]) if use_aug else int(n_cal)),
            "se_analytic": summ["se_analytic"],
            "se_bootstrap": summ.get("se_bootstrap"),
            "var_cal_jackknife_plug_in": float(prep.jackknife[k]),
            "var_cal_influence_plug_in": float(cov_cal[k, k]),
            "support": support[k],
            "audit": audit,
        }
        if use_boot and summ["se_analytic"] > 0:
            ratio = summ["se_bootstrap"] / summ["se_analytic"]
            if not (1 / SE_AGREEMENT_RATIO <= ratio <= SE_AGREEMENT_RATIO):
                warnings.append(f"{name}: bootstrap SE {summ['se_bootstrap']:.4f} and analytic SE "
                                f"{summ['se_analytic']:.4f} differ by a factor {ratio:.2f}")
        policies[name] = entry

    comparisons = _compare(prep, reps if use_boot else None, cols, refused, cov, dfs, warnings)
    raw = np.array([policies[p]["raw_judge_mean"] for p in d.policies])
    est = np.array([policies[p]["estimate"] for p in d.policies])
    ranking, win, best, best_reason = rank_policies(
        list(d.policies), est, comparisons, refused, [policies[p]["level_claim"] for p in d.policies])
    tau = float(kendalltau(raw, est, variant="b").statistic) if K >= 2 else None
    if tau is not None and not np.isfinite(tau):
        tau = None
    result = {
        "schema_version": 1,
        "engine_version": __version__,
        "config": opts.to_dict(),
        "data": {"n_rows": d.n_rows, "n_prompts": d.n_prompts, "n_labelled": int(lab.sum()),
                 "n_calibration_labels": int(n_cal), "policies": list(d.policies),
                 "covariates": list(d.covariate_names)},
        "calibration": _calibration_summary(prep),
        "inference": {"method": opts.inference, "n_bootstrap": opts.n_bootstrap if use_boot else 0,
                      "ci_method": "percentile" if use_boot else "normal (influence function)",
                      "seed": opts.seed, "alpha": alpha, "cluster": "prompt_id"},
        "policies": policies,
        "comparisons": comparisons,
        "multiplicity": {"method": opts.multiplicity, "alpha": alpha, "n_comparisons": len(comparisons)},
        "ranking": ranking,
        "win_matrix": win,
        "best_policy": best,
        "best_policy_reason": best_reason,
        "rank_agreement": {
            "kendall_tau_b_raw_vs_calibrated": tau,
            "raw_order": [d.policies[i] for i in np.argsort(-raw, kind="stable")],
            "calibrated_order": [d.policies[i] for i in np.argsort(-est, kind="stable")],
        },
        "warnings": warnings,
    }
    return EvaluationResult(result, replicates=reps, influence=prep.infl["total"], columns=cols)


def _degrees_of_freedom(prep: Prepared, n_label_prompts: np.ndarray) -> np.ndarray:
    """Degrees of freedom of each statistic for analytic intervals and tests.

    Plug-in columns are means over many prompts (normal quantile, df = inf). Augmented
    columns use (labelled prompts - 1): their variance is dominated by the mean of a few
    label residuals, and the normal quantile under-covers with 10-30 labels.
    """
    K = len(prep.design.data.policies)
    dfs = np.full(2 * K, np.inf)
    for k in range(K):
        if n_label_prompts[k] >= 2:
            dfs[K + k] = n_label_prompts[k] - 1
    return dfs


def _compare(prep: Prepared, reps, cols, refused, cov, dfs, warnings) -> list[dict]:
    d = prep.design.data
    K = len(d.policies)
    alpha = prep.options.alpha
    span = d.label_scale[1] - d.label_scale[0]
    out = []
    for a in range(K):
        for b in range(a + 1, K):
            ca, cb = cols[a], cols[b]
            diff = float(prep.stats[ca] - prep.stats[cb])
            se_a = float(np.sqrt(max(cov[ca, ca] + cov[cb, cb] - 2 * cov[ca, cb], 0.0)))
            item = {"a": d.policies[a], "b": d.policies[b], "diff": diff, "se_analytic": se_a}
            if reps is not None:
                D = reps[:, ca] - reps[:, cb]
                D = D[np.isfinite(D)]
                B = D.size
                se = float(np.std(D, ddof=1))
                ci = np.percentile(D, [50 * alpha, 100 - 50 * alpha]).tolist()
                p = min(1.0, 2 * min(1 + np.sum(D <= 0), 1 + np.sum(D >= 0)) / (B + 1))
                prob = float(np.mean(D > 0) + 0.5 * np.mean(D == 0))
                if se_a > 0 and not (1 / SE_AGREEMENT_RATIO <= se / se_a <= SE_AGREEMENT_RATIO):
                    warnings.append(f"{d.policies[a]} - {d.policies[b]}: bootstrap SE {se:.4f} and analytic SE "
                                    f"{se_a:.4f} differ by a factor {se / se_a:.2f}")
            else:
                se = se_a
                df_ = min(dfs[ca], dfs[cb])  # the policy with fewer labels sets the tails
                c = student_t.ppf(1 - alpha / 2, df_)
                ci = [diff - c * se, diff + c * se]
                p = float(2 * student_t.sf(abs(diff) / se, df_)) if se > 0 else (0.0 if diff != 0 else 1.0)
                prob = float(norm.cdf(diff / se)) if se > 0 else float(diff > 0)
            item.update(se=se, ci=[float(max(ci[0], -span)), float(min(ci[1], span))], p_value=float(p),
                        prob_a_better=prob, involves_refused=bool(refused[a] or refused[b]))
            out.append(item)
    if out:
        padj = adjust(np.array([c["p_value"] for c in out]), prep.options.multiplicity)
        for c, pa_ in zip(out, padj):
            c["p_adjusted"] = float(pa_)
            c["significant"] = bool(pa_ <= alpha)
    return out


def rank_policies(names: Sequence[str], est: np.ndarray, comparisons: list[dict], refused: np.ndarray,
                  claims: Sequence[str]):
    """Ranking with ties, win matrix and best policy from significance-marked comparisons.

    Rank = 1 + number of policies significantly better. The best policy is the top unrefused one
    when it is significantly better than every other policy; a refused policy is never best.
    Estimates may be NaN (ranked last); ``prob_a_better`` may be None.
    """
    K = len(names)
    idx = {n: i for i, n in enumerate(names)}
    sig = np.zeros((K, K), dtype=int)  # sig[i, j] = 1 if i significantly better than j
    prob = np.full((K, K), np.nan)
    for c in comparisons:
        a, b = idx[c["a"]], idx[c["b"]]
        if c.get("prob_a_better") is not None:
            prob[a, b], prob[b, a] = c["prob_a_better"], 1 - c["prob_a_better"]
        if c["significant"]:
            if c["diff"] > 0:
                sig[a, b] = 1
            elif c["diff"] < 0:
                sig[b, a] = 1
    rank = 1 + sig.sum(axis=0)
    key = np.where(np.isfinite(est), est, -np.inf)
    order = sorted(range(K), key=lambda i: (rank[i], -key[i]))
    ranking = [{"policy": names[i], "rank": int(rank[i]), "estimate": float(est[i]), "level_claim": claims[i],
                "tied_with": [names[j] for j in range(K) if j != i and rank[j] == rank[i]]} for i in order]
    win = {"policies": list(names),
           "significant": (sig - sig.T).tolist(),
           "prob_row_better": [[None if not np.isfinite(v) else float(v) for v in row] for row in prob]}
    ok = [i for i in range(K) if not refused[i] and np.isfinite(est[i])]
    best, reason = None, "no policy has an unrefused level claim"
    if ok:
        top = max(ok, key=lambda i: est[i])
        if all(sig[top, j] for j in range(K) if j != top):
            best, reason = names[top], f"{names[top]} is significantly better than every other policy"
        else:
            ties = [names[j] for j in range(K) if j != top and not sig[top, j]]
            reason = (f"no clear winner: {names[top]} has the highest unrefused estimate but is not significantly "
                      f"better than {', '.join(ties)}")
        top_all = int(np.argmax(key))
        if refused[top_all] and top_all != top:
            reason += f"; {names[top_all]} has a higher estimate but its level claim is refused"
    return ranking, win, best, reason
