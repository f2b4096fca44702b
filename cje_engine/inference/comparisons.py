"""Paired comparisons, multiplicity, ranking and the best policy: one step for every mode.

Input per policy: its reported estimate, its bootstrap replicates (one column per policy, from the
same prompt draws, so differences are paired) and/or its per-prompt influence terms (the analytic
route), degrees of freedom, and whether its level is refused. The modes differ only in how those
columns were computed (`cje_engine.pipeline`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from cje_engine.inference.distributions import norm_cdf, t_ppf, t_sf
from cje_engine.inference.multiplicity import adjust
from cje_engine.inference.sequential import anytime_half_width, anytime_p_value, information_ratio, pair_labels
from cje_engine.inference.variance import cluster_cov

#: Relative disagreement between bootstrap and analytic SEs that triggers a warning.
SE_AGREEMENT_RATIO = 1.25


@dataclass
class PolicyColumns:
    """What the comparison step needs of the K reported policies (in result order).

    Attributes
    ----------
    names : policy names
    estimate : ndarray (K,), NaN when there is none
    replicates : ndarray (B, K) or None (analytic route)
    influence : ndarray (n_prompts, K) or None (no analytic route)
    dfs : ndarray (K,), degrees of freedom of each estimate (inf: normal)
    refused : ndarray (K,) of bool
    claims : level claims ("ok", "refused")
    raw : ndarray (K,), raw judge means (rank agreement)
    """

    names: list[str]
    estimate: np.ndarray
    replicates: np.ndarray | None
    influence: np.ndarray | None
    dfs: np.ndarray
    refused: np.ndarray
    claims: list[str]
    raw: np.ndarray
    #: per policy: "ok", "rank_only" (limited support: conservative intervals) or "not_estimable"
    relative: list[str] | None = None
    relative_reason: list[str | None] | None = None
    #: per policy: "verified" (its level needs no transport assumption) or "assumes_transport"
    kinds: list[str] | None = None
    #: per policy: a bound on the bias of a rank-only level (limited support: the share of its rows the
    #: calibration extrapolates to, times the label span); comparisons widen their interval by it
    bias_bound: np.ndarray | None = None
    #: per policy: the labels behind its level (own labels; 0: none of its own), for repeated-looks claims
    labels: np.ndarray | None = None
    #: the calibration labels: the information of a level without own labels (repeated-looks claims)
    calibration_labels: float = 1.0

    def bias(self, k: int) -> float:
        """Bias bound of policy ``k`` (0 when none is given)."""
        return 0.0 if self.bias_bound is None else float(self.bias_bound[k])

    def kind(self, k: int) -> str:
        """Claim kind of policy ``k`` (``verified`` when none is given)."""
        return "verified" if self.kinds is None else self.kinds[k]

    def status(self, k: int) -> str:
        """Relative status of policy ``k`` (``ok`` when none is given)."""
        return "ok" if self.relative is None else self.relative[k]

    def covariance(self) -> np.ndarray | None:
        """Clustered covariance of the policies' influence columns (None without them)."""
        return None if self.influence is None else cluster_cov(self.influence)


#: Direct basis codes of levels corrected by the policy's own labels (valid without transport).
VERIFIED_BASES = ("power_tuned", "augmented", "recalibrated")


def claim_kind(basis_code: str) -> str:
    """``verified`` for a level corrected by the policy's own labels, else ``assumes_transport``: a calibrated
    plug-in, and every off-policy level (``logs-only/...``, ``hybrid/...``: importance-weighted, DR or stacked
    estimates rest on the calibration transporting to the target's reweighted responses, besides overlap;
    docs/statistics.md, "Off-policy modes")."""
    if basis_code in VERIFIED_BASES:
        return "verified"
    return "assumes_transport"


def _num(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


#: A difference of two levels (or of two replicates) within this many label spans of 0 is rounding, not a
#: difference: a candidate whose level is computed from the same numbers as its comparator's (logs-only, a
#: candidate with the logger's log-probabilities: weights of exactly 1) differs from it by ~1e-16 with an SE of 0,
#: and a p-value of 0 from that is a false claim (docs/failure-modes.md).
ROUNDING = 1e-12


def exact_zero(x: Any, span: float) -> Any:
    """``x`` (a number or an array of differences) with the entries within `ROUNDING` label spans of 0 set to 0."""
    tol = ROUNDING * max(float(span), 1e-300)
    if np.ndim(x) == 0:
        return 0.0 if abs(float(x)) <= tol else float(x)
    x = np.asarray(x, dtype=float)
    return np.where(np.abs(x) <= tol, 0.0, x)


def _bootstrap_pair(D: np.ndarray, alpha: float) -> tuple[float, list[float], float, float]:
    B = D.size
    se = float(np.std(D, ddof=1))
    ci = np.percentile(D, [50 * alpha, 100 - 50 * alpha]).tolist()
    p = min(1.0, 2 * min(1 + np.sum(D <= 0), 1 + np.sum(D >= 0)) / (B + 1))
    prob = float(np.mean(D > 0) + 0.5 * np.mean(D == 0))
    return se, ci, float(p), prob


def _analytic_pair(diff: float, se: float, df: float, alpha: float) -> tuple[list[float], float, float]:
    c = t_ppf(1 - alpha / 2, df)
    ci = [diff - c * se, diff + c * se]
    p = float(2 * t_sf(abs(diff) / se, df)) if se > 0 else (0.0 if diff != 0 else 1.0)
    prob = float(norm_cdf(diff / se)) if se > 0 else (0.5 if diff == 0 else float(diff > 0))
    return ci, p, prob


def compare_pairs(cols: PolicyColumns, *, alpha: float, method: str, span: float,
                  warnings: list[str], planned_labels: int | None = None) -> list[dict]:
    """Every unordered pair once: difference, SE, CI, p-value, adjusted p-value, significance.

    With ``planned_labels`` (repeated looks, `cje_engine.inference.sequential`) the interval is the
    confidence sequence around the difference and the p-value the anytime-valid one, both from the
    pair's SE (bootstrap or analytic) and its labels; ``method`` must then be ``holm`` (BH controls the
    false discovery rate at one look, not over all of them).

    The bootstrap route (``cols.replicates``) uses percentile intervals of the paired replicate
    differences and the two-sided bootstrap p-value ``2 min(1 + #D<=0, 1 + #D>=0) / (B + 1)``; the
    analytic route uses the clustered influence covariance with a t quantile whose df is the
    smaller of the pair's. Both SEs are reported when both exist (a warning when they differ by
    more than `SE_AGREEMENT_RATIO`). Intervals are clipped to +/- the label span.
    """
    cov = cols.covariance()
    K = len(cols.names)
    out = []
    for a in range(K):
        for b in range(a + 1, K):
            diff = exact_zero(float(cols.estimate[a] - cols.estimate[b]), span)
            se_a = None if cov is None else float(np.sqrt(max(cov[a, a] + cov[b, b] - 2 * cov[a, b], 0.0)))
            kind = "verified" if cols.kind(a) == cols.kind(b) == "verified" else "assumes_transport"
            item = {"a": cols.names[a], "b": cols.names[b], "diff": _num(diff), "se_analytic": se_a,
                    "claim_kind": kind}
            D = None
            if cols.replicates is not None:
                D = cols.replicates[:, a] - cols.replicates[:, b]
                D = exact_zero(D[np.isfinite(D)], span)
            dropped = [k for k in (a, b) if cols.status(k) == "not_estimable"]
            if dropped:
                why = "; ".join(f"{cols.names[k]}: {cols.relative_reason[k]}" for k in dropped)
                item.update(diff=None, se=None, ci=None, se_analytic=None, p_value=None, p_adjusted=None,
                            significant=None, prob_a_better=None, involves_refused=True, reported=False,
                            not_estimable=why)
                out.append(item)
                continue
            if not np.isfinite(diff) or (D is not None and D.size < 2) or (D is None and se_a is None):
                se, ci, p, prob = None, None, 1.0, None
            elif D is not None:
                se, ci, p, prob = _bootstrap_pair(D, alpha)
                if se_a is not None and se_a > 0 and not (1 / SE_AGREEMENT_RATIO <= se / se_a <= SE_AGREEMENT_RATIO):
                    warnings.append(f"{cols.names[a]} - {cols.names[b]}: bootstrap SE {se:.4f} and analytic SE "
                                    f"{se_a:.4f} differ by a factor {se / se_a:.2f}")
            else:
                se = se_a
                ci, p, prob = _analytic_pair(diff, se, min(cols.dfs[a], cols.dfs[b]), alpha)
            if ci is not None and "rank_only" in (cols.status(a), cols.status(b)) and D is not None and se_a:
                # conservative: the union of the bootstrap and analytic intervals and the larger p-value
                ci_a, p_an, _ = _analytic_pair(diff, se_a, min(cols.dfs[a], cols.dfs[b]), alpha)
                ci = [min(ci[0], ci_a[0]), max(ci[1], ci_a[1])]
                p = max(p, p_an)
            if planned_labels is not None and ci is not None and se is not None:
                ratio = information_ratio(pair_labels(cols.labels, a, b, cols.calibration_labels), planned_labels,
                                          alpha)
                half = anytime_half_width(se, ratio, alpha)
                ci = [min(ci[0], diff - half), max(ci[1], diff + half)]
                p = max(p, anytime_p_value(diff, se, ratio))
            bound = cols.bias(a) + cols.bias(b)
            if ci is not None and bound > 0 and se is not None and se > 0:
                # a rank-only level's bias is at most its bound: the interval carries it, and the test is the
                # least favourable one within it (the difference shrunk toward 0 by the bound)
                ci = [ci[0] - bound, ci[1] + bound]
                shrunk = max(abs(diff) - bound, 0.0)
                p = max(p, float(2 * t_sf(shrunk / se, min(cols.dfs[a], cols.dfs[b]))))
                item["bias_bound"] = bound
            item.update(se=se, ci=None if ci is None else [float(max(ci[0], -span)), float(min(ci[1], span))],
                        p_value=float(p), prob_a_better=prob,
                        involves_refused=bool(cols.refused[a] or cols.refused[b]), reported=True, not_estimable=None)
            out.append(item)
    shown = [c for c in out if c["reported"]]
    if shown:
        padj = adjust(np.array([c["p_value"] for c in shown]), method)
        for c, pa_ in zip(shown, padj):
            c["p_adjusted"] = float(pa_)
            c["significant"] = bool(pa_ <= alpha and c["se"] is not None)
    return out


def rank_policies(names: Sequence[str], est: np.ndarray, comparisons: list[dict], refused: np.ndarray,
                  claims: Sequence[str], dropped: dict[str, str] | None = None, alpha_iut: float = 0.05):
    """Ranking with ties, win matrix and best policy from significance-marked comparisons.

    Rank = 1 + number of policies significantly better. The best policy is the top unrefused one
    when it beats every other policy, each pairwise test at level ``alpha_iut`` (intersection-union);
    a refused policy is never best, and no policy is best while another has no level to test against.
    Estimates may be NaN (ranked last); ``prob_a_better`` may be None. Policies in ``dropped``
    (name -> reason: not estimable even relatively) are left out of the ranking, the win matrix and
    the best-policy logic.
    """
    dropped = dropped or {}
    keep = [i for i, n in enumerate(names) if n not in dropped]
    names = [names[i] for i in keep]
    est, refused, claims = np.asarray(est)[keep], np.asarray(refused)[keep], [claims[i] for i in keep]
    comparisons = [c for c in comparisons if c.get("reported", True)]
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
    # "best" is a tested claim: the top policy beats every other one, each by its own two-sided test at
    # level alpha (an intersection-union test: the claim is wrong only if some other policy is at least as
    # good, and then that policy's test rejects with probability <= alpha/2; no multiplicity adjustment).
    beats = np.zeros((K, K), dtype=bool)
    for c in comparisons:
        if c.get("p_value") is None or c.get("diff") is None or c.get("se") is None:
            continue
        a, b = idx[c["a"]], idx[c["b"]]
        if c["p_value"] <= alpha_iut:
            beats[a, b], beats[b, a] = c["diff"] > 0, c["diff"] < 0
    ok = [i for i in range(K) if not refused[i] and np.isfinite(est[i])]
    best, reason = None, "no policy has an unrefused level claim"
    if ok:
        top = max(ok, key=lambda i: est[i])
        if dropped:
            reason = (f"no best policy can be claimed: {names[top]} has the highest estimate, but not every policy "
                      f"has a level it can be tested against")
        elif all(beats[top, j] for j in range(K) if j != top):
            best, reason = names[top], (f"{names[top]} is better than every other policy (each pairwise test at "
                                        f"level {alpha_iut:g}: an intersection-union test)")
        else:
            ties = [names[j] for j in range(K) if j != top and not beats[top, j]]
            reason = (f"no clear winner: {names[top]} has the highest unrefused estimate but is not shown better "
                      f"than {', '.join(ties)}")
        top_all = int(np.argmax(key))
        if refused[top_all] and top_all != top:
            reason += f"; {names[top_all]} has a higher estimate but its level claim is refused"
    if dropped:
        reason += "; not ranked: " + "; ".join(f"{n} ({r})" for n, r in dropped.items())
    return ranking, win, best, reason


def _tau_b(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b by `scipy.stats.kendalltau`'s formula (the same number), NaN when either is constant
    or not finite; exact pair counts in O(n^2): ``x`` and ``y`` are one value per policy."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return float("nan")
    sx = np.sign(x[:, None] - x[None, :]).astype(np.int64)
    sy = np.sign(y[:, None] - y[None, :]).astype(np.int64)
    s, tx, ty = int((sx * sy).sum()) // 2, int(np.count_nonzero(sx)) // 2, int(np.count_nonzero(sy)) // 2
    if tx == 0 or ty == 0:
        return float("nan")
    return float(min(1.0, max(-1.0, s / np.sqrt(tx) / np.sqrt(ty))))


def rank_agreement(names: Sequence[str], raw: np.ndarray, est: np.ndarray) -> dict:
    """Kendall tau-b between raw judge means and calibrated estimates, and both orders."""
    tau = None
    if len(names) >= 2 and np.all(np.isfinite(est)):
        tau = _num(_tau_b(raw, est))
    key = np.where(np.isfinite(est), est, -np.inf)
    return {"kendall_tau_b_raw_vs_calibrated": tau,
            "raw_order": [names[i] for i in np.argsort(-raw, kind="stable")],
            "calibrated_order": [names[i] for i in np.argsort(-key, kind="stable")]}


def relative_claims(cols: PolicyColumns, *, alpha: float, method: str, span: float, warnings: list[str],
                    baseline: str | None = None, noninferiority_margin: float = 0.0,
                    planned_labels: int | None = None) -> dict:
    """Comparisons, multiplicity, ranking, win matrix, best policy and rank agreement (result fields);
    with ``baseline``, the many-to-one comparisons against it (`baseline_comparisons`); with
    ``planned_labels``, claims valid under repeated looks (`compare_pairs`; pairwise significance by Holm)."""
    if planned_labels is not None:
        method = "holm"
    comparisons = compare_pairs(cols, alpha=alpha, method=method, span=span, warnings=warnings,
                                planned_labels=planned_labels)
    dropped = {n: cols.relative_reason[k] for k, n in enumerate(cols.names) if cols.status(k) == "not_estimable"}
    ranking, win, best, reason = rank_policies(cols.names, cols.estimate, comparisons, cols.refused, cols.claims,
                                               dropped, alpha_iut=alpha)
    out = {
        "comparisons": comparisons,
        "multiplicity": {"method": method, "alpha": alpha,
                         "n_comparisons": sum(1 for c in comparisons if c["reported"]),
                         "looks": "one" if planned_labels is None else "repeated",
                         "planned_labels": planned_labels},
        "ranking": ranking,
        "win_matrix": win,
        "best_policy": best,
        "best_policy_reason": reason,
        "rank_agreement": rank_agreement(cols.names, cols.raw, cols.estimate),
    }
    if baseline is not None:
        out["baseline_comparisons"] = baseline_comparisons(cols, baseline, alpha=alpha,
                                                           margin=noninferiority_margin,
                                                           planned_labels=planned_labels, span=span)
    return out


#: Draws of the normal vector whose max |z| quantile gives the analytic simultaneous intervals.
_MAXT_DRAWS = 200_000


def baseline_comparisons(cols: PolicyColumns, baseline: str, *, alpha: float, margin: float,
                         planned_labels: int | None = None, span: float = 1.0) -> list[dict]:
    """Many-to-one comparisons ``policy - baseline`` with simultaneous intervals (single-step max-T).

    Every estimable policy against ``baseline``: the difference, its SE, a simultaneous ``1 - alpha``
    interval over the family (the ``1 - alpha`` quantile ``c`` of ``max_j |D*_j - D_j| / se_j`` over the
    paired bootstrap replicates, or of ``max_j |Z_j|`` for the influence terms' correlation on the analytic
    route) and the single-step adjusted p-value ``P(max_j |T_j| >= |t_j|)``. ``better``/``worse``: the
    interval excludes 0; ``non_inferior``: its lower end is above ``-margin`` (label units). Policies that
    are not estimable (or the baseline itself) get ``reported: false`` with the reason. With
    ``planned_labels`` (repeated looks) each interval is the confidence sequence at level ``alpha / m``
    (Bonferroni over the ``m`` comparisons: simultaneous over the family and over every look) and the
    adjusted p-value ``min(1, m p)`` of the anytime p-value; ``critical_value`` is its half-width over the SE.
    ``span``: the label span (differences within `ROUNDING` spans of 0 are 0, `exact_zero`).
    """
    names = list(cols.names)
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not one of the policies ({', '.join(names)})")
    b = names.index(baseline)
    rows, live = [], []
    for j, n in enumerate(names):
        if j == b:
            continue
        row = {"policy": n, "baseline": baseline, "claim_kind": "verified" if cols.kind(j) == cols.kind(b) == "verified"
               else "assumes_transport", "diff": None, "se": None, "ci": None, "p_adjusted": None, "better": None,
               "worse": None, "non_inferior": None, "margin": float(margin), "critical_value": None, "reported": False,
               "not_estimable": None}
        bad = [k for k in (j, b) if cols.status(k) == "not_estimable" or not np.isfinite(cols.estimate[k])]
        if bad:
            row["not_estimable"] = "; ".join(f"{names[k]}: {cols.relative_reason[k] or 'no level'}" for k in bad)
        else:
            live.append(j)
        rows.append(row)
    if not live:
        return rows
    diff = exact_zero(cols.estimate[live] - cols.estimate[b], span)
    if cols.replicates is not None:
        D = cols.replicates[:, live] - cols.replicates[:, [b]]
        D = exact_zero(D[np.all(np.isfinite(D), axis=1)], span)
        se = D.std(axis=0, ddof=1)
        T = np.abs(D - diff) / np.where(se > 0, se, np.inf)
        tmax = T.max(axis=1)
    else:
        C = cluster_cov(cols.influence[:, live] - cols.influence[:, [b]])
        se = np.sqrt(np.clip(np.diag(C), 0, None))
        corr = C / np.outer(np.where(se > 0, se, 1), np.where(se > 0, se, 1))
        rng = np.random.default_rng(20240611)  # a fixed draw: the same quantile in every run
        Z = rng.multivariate_normal(np.zeros(len(live)), corr + 1e-12 * np.eye(len(live)), _MAXT_DRAWS,
                                    method="eigh")
        tmax = np.abs(Z).max(axis=1)
    c = float(np.quantile(tmax, 1 - alpha))
    by_policy = {j: i for i, j in enumerate(live)}
    for row in rows:
        j = names.index(row["policy"])
        if j not in by_policy:
            continue
        i = by_policy[j]
        t = abs(diff[i]) / se[i] if se[i] > 0 else (np.inf if diff[i] != 0 else 0.0)
        c_i, p_adj = c, float((1 + np.sum(tmax >= t)) / (tmax.size + 1))
        if planned_labels is not None:
            m = len(live)
            ratio = information_ratio(pair_labels(cols.labels, j, b, cols.calibration_labels), planned_labels,
                                      alpha / m)
            c_i = anytime_half_width(1.0, ratio, alpha / m) if se[i] > 0 else np.inf
            p_adj = min(1.0, m * anytime_p_value(float(diff[i]), float(se[i]), ratio))
        lo, hi = float(diff[i] - c_i * se[i]), float(diff[i] + c_i * se[i])
        row.update(diff=float(diff[i]), se=float(se[i]), ci=[lo, hi], critical_value=float(c_i),
                   p_adjusted=p_adj, better=lo > 0, worse=hi < 0, non_inferior=lo > -margin, reported=True)
    return rows
