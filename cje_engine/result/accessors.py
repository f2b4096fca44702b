"""Accessors of a result computed from its replicates and influence terms (`EvaluationResult.confint`, ...).

The result keeps, beside the typed model, the bootstrap replicates and the per-prompt influence terms of
each policy's reported level (`Terms`). These functions recompute intervals, differences and adjusted
p-values from them at any level, in the style of DoubleML's ``confint(joint=True)`` and ``p_adjust``:

- `confint`: marginal intervals by the reported level's own method (percentile or normal on the plug-in
  levels, the small-sample own-label methods on own-label levels), or simultaneous max-T intervals;
- `compare`: a paired difference by the same code as the result's comparisons (equal numbers at the
  result's level);
- `p_adjust`: the reported comparisons' p-values adjusted by Holm, Bonferroni or single-step max-T.

Claims are respected: only quotable levels get an interval (docs/statistics.md, "From Python").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cje_engine.inference.comparisons import PolicyColumns, claim_kind, compare_pairs
from cje_engine.inference.distributions import t_ppf
from cje_engine.inference.intervals import ANALYTIC_METHODS, BOOTSTRAP_METHODS, own_label_interval
from cje_engine.inference.multiplicity import adjust
from cje_engine.inference.variance import cluster_cov
from cje_engine.result.model import Comparison, EvaluationModel, PolicyResult

#: Fixed draws of the analytic max-T quantile (as `cje_engine.inference.comparisons.baseline_comparisons`).
MAXT_DRAWS = 200_000
MAXT_SEED = 20240611
#: Own-label interval methods `confint` reproduces from the terms (the others: percentile / normal).
OWN_LABEL_METHODS = tuple(m for m in BOOTSTRAP_METHODS + ANALYTIC_METHODS if m not in ("percentile", "t"))


@dataclass
class Terms:
    """The reported levels' replicates and influence terms, one column per policy (result order).

    Attributes
    ----------
    replicates : ndarray (B, K) or None
        Bootstrap replicates (None: analytic route).
    influence : ndarray (G, K) or None
        Per-prompt influence terms.
    dfs : ndarray (K,)
        Degrees of freedom of each level (inf: normal reference).
    """

    replicates: np.ndarray | None
    influence: np.ndarray | None
    dfs: np.ndarray


# ------------------------------------------------------------------------------------ helpers


def _names(model: EvaluationModel, policies: Sequence[str] | str | None) -> list[str]:
    names = list(model.policies)
    if policies is None:
        return names
    chosen = [policies] if isinstance(policies, str) else list(policies)
    for n in chosen:
        if n not in model.policies:
            raise ValueError(f"policy {n!r} is not in the result (policies: {', '.join(names)})")
    return chosen


def _check_level(level: float) -> float:
    if not 0 < float(level) < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    return float(level)


def label_scale(model: EvaluationModel) -> tuple[float, float]:
    """The result's label scale (``config.label_scale``; 0-1 when absent)."""
    s = model.config.get("label_scale") or (0.0, 1.0)
    return float(s[0]), float(s[1])


def _clip(lo: float, hi: float, scale: tuple[float, float]) -> tuple[float, float]:
    return float(np.clip(lo, *scale)), float(np.clip(hi, *scale))


def quotable(p: PolicyResult) -> bool:
    """Does the policy have a level to put an interval on? ``ok`` levels, and assumes-transport levels the team
    trusts (``trust_transport``: they carry an estimate); never refused levels or untrusted assumed ones."""
    return p.estimate is not None and p.level_claim != "refused"


def _require(terms: Terms) -> None:
    if terms.replicates is None and terms.influence is None:
        raise ValueError("this result carries no replicates or influence terms (a result.json read without its "
                         "terms.npz): give EvaluationResult.load the terms file `cje evaluate` writes beside it")


def _finite_rows(x: np.ndarray) -> np.ndarray:
    return x[np.all(np.isfinite(x), axis=1)]


# ------------------------------------------------------------------------------------ confint


def marginal_interval(p: PolicyResult, k: int, terms: Terms, level: float, result_level: float,
                      scale: tuple[float, float]) -> tuple[float, float, str]:
    """(lo, hi, method) of policy ``p`` (column ``k``) at ``level`` by its reported level's method.

    Bootstrap route: the percentile interval of its replicates, or the own-label method the result names
    (``ci_method``: bca_expanded, skew_t, ...). Analytic route: ``estimate +/- t_df * se`` with the influence
    SE (df inf: normal), or skew_t. A selective interval (conditional on a failed audit) is only known at
    the result's own level: elsewhere NaN. Clipped to the label scale, as the result's ``ci``.
    """
    est, alpha, df = float(p.estimate), 1.0 - level, float(terms.dfs[k])
    infl = None if terms.influence is None else terms.influence[:, k]
    method = p.ci_method or ("percentile" if terms.replicates is not None else "normal")
    if method == "selective":
        if abs(level - result_level) < 1e-12 and p.ci is not None:
            return float(p.ci[0]), float(p.ci[1]), "selective"
        return np.nan, np.nan, "selective (only at the result's level)"
    if terms.replicates is not None:
        r = terms.replicates[:, k]
        r = r[np.isfinite(r)]
        if method in OWN_LABEL_METHODS and method in BOOTSTRAP_METHODS:
            lo, hi = own_label_interval(method, est, reps=r, alpha=alpha, df=df, infl=infl)
        else:
            method = "percentile"
            lo, hi = np.percentile(r, [50 * alpha, 100 - 50 * alpha])
        return (*_clip(lo, hi, scale), method)
    se = float(np.sqrt(max(cluster_cov(infl)[0, 0], 0.0)))
    if method in OWN_LABEL_METHODS and method in ANALYTIC_METHODS:
        lo, hi = own_label_interval(method, est, se=se, alpha=alpha, df=df, infl=infl)
    else:
        method = "normal" if not np.isfinite(df) else "t"
        q = float(t_ppf(1 - alpha / 2, df))
        lo, hi = est - q * se, est + q * se
    return (*_clip(lo, hi, scale), method)


def maxt_critical(terms: Terms, cols: list[int], est: np.ndarray, level: float) -> tuple[float, np.ndarray, str]:
    """(critical value c, SEs, method) of simultaneous intervals ``est +/- c se`` over ``cols`` (single-step
    max-T): the ``level`` quantile of ``max_k |theta*_k - theta_k| / se_k`` over the replicates (rows finite in
    every column), or of ``max_k |Z_k|`` with ``Z`` normal with the influence terms' correlation."""
    if terms.replicates is not None:
        r = _finite_rows(terms.replicates[:, cols])
        se = r.std(axis=0, ddof=1)
        tmax = (np.abs(r - est) / np.where(se > 0, se, np.inf)).max(axis=1)
        return float(np.quantile(tmax, level)), se, "max-t (bootstrap)"
    C = cluster_cov(terms.influence[:, cols])
    se = np.sqrt(np.clip(np.diag(C), 0, None))
    s = np.where(se > 0, se, 1.0)
    corr = C / np.outer(s, s)
    Z = np.random.default_rng(MAXT_SEED).multivariate_normal(np.zeros(len(cols)), corr + 1e-12 * np.eye(len(cols)),
                                                             MAXT_DRAWS, method="eigh")
    return float(np.quantile(np.abs(Z).max(axis=1), level)), se, "max-t (normal)"


def confint(model: EvaluationModel, terms: Terms, policies: Sequence[str] | str | None = None,
            level: float = 0.95, joint: bool = False):
    """Intervals of the chosen policies' levels (a DataFrame; see `EvaluationResult.confint`)."""
    import pandas as pd

    _require(terms)
    level = _check_level(level)
    names = _names(model, policies)
    index = {n: i for i, n in enumerate(model.policies)}
    scale = label_scale(model)
    result_level = 1.0 - model.inference.alpha
    rows = []
    for n in names:
        p = model.policies[n]
        rows.append({"policy": n, "estimate": np.nan if p.estimate is None else float(p.estimate),
                     "ci_low": np.nan, "ci_high": np.nan, "level": level, "level_claim": p.level_claim,
                     "verified": p.level_claim == "ok", "method": "none: no quotable level"})
    live = [i for i, n in enumerate(names) if quotable(model.policies[n])]
    if joint and live:
        cols = [index[names[i]] for i in live]
        est = np.array([rows[i]["estimate"] for i in live])
        c, se, method = maxt_critical(terms, cols, est, level)
        for j, i in enumerate(live):
            lo, hi = _clip(est[j] - c * se[j], est[j] + c * se[j], scale)
            rows[i].update(ci_low=lo, ci_high=hi, method=method)
    elif not joint:
        for i in live:
            n = names[i]
            lo, hi, method = marginal_interval(model.policies[n], index[n], terms, level, result_level, scale)
            rows[i].update(ci_low=lo, ci_high=hi, method=method)
    return pd.DataFrame(rows).set_index("policy")


# ------------------------------------------------------------------------------------ compare


def _columns(model: EvaluationModel, terms: Terms, names: list[str]) -> PolicyColumns:
    """The comparison step's view of ``names`` (as `cje_engine.pipeline.direct.direct_columns` builds it)."""
    index = [list(model.policies).index(n) for n in names]
    pols = [model.policies[n] for n in names]
    lo, hi = label_scale(model)
    rel = [p.relative_claim or "ok" for p in pols]
    return PolicyColumns(
        names=list(names), estimate=np.array([np.nan if p.estimate is None else p.estimate for p in pols], float),
        replicates=None if terms.replicates is None else terms.replicates[:, index],
        influence=None if terms.influence is None else terms.influence[:, index],
        dfs=np.asarray(terms.dfs, float)[index], refused=np.array([p.level_claim == "refused" for p in pols]),
        claims=[p.level_claim for p in pols], raw=np.array([p.raw_judge_mean or np.nan for p in pols], float),
        relative=rel, relative_reason=[p.relative_reason for p in pols],
        kinds=[claim_kind(p.basis_code) for p in pols],  # every mode (the off-policy ones since issue 24)
        bias_bound=np.array([(p.support.share_thin or 0.0) * (hi - lo) if r == "rank_only" else 0.0
                             for p, r in zip(pols, rel)]))


def compare(model: EvaluationModel, terms: Terms, a: str, b: str, level: float = 0.95) -> Comparison:
    """``a - b`` with its interval and p-value (see `EvaluationResult.compare`)."""
    _require(terms)
    level = _check_level(level)
    names = _names(model, [a, b])
    if a == b:
        raise ValueError(f"compare needs two different policies, got {a!r} twice")
    lo, hi = label_scale(model)
    item = compare_pairs(_columns(model, terms, names), alpha=1.0 - level, method="holm", span=hi - lo,
                         warnings=[])[0]
    return Comparison(**item)


# ------------------------------------------------------------------------------------ p_adjust


def p_adjust(model: EvaluationModel, terms: Terms, method: str = "holm", level: float | None = None):
    """The reported comparisons' p-values adjusted over their family (see `EvaluationResult.p_adjust`)."""
    import pandas as pd

    _require(terms)
    if method not in ("holm", "bonferroni", "max-t"):
        raise ValueError(f"method must be 'holm', 'bonferroni' or 'max-t', got {method!r}")
    level = _check_level(1.0 - model.inference.alpha if level is None else level)
    names = list(model.policies)
    pairs = [(c.a, c.b) for c in model.comparisons if c.reported is not False and c.diff is not None]
    rows = [compare(model, terms, a, b, level) for a, b in pairs]
    p = np.array([c.p_value for c in rows], float)
    if method == "max-t":
        # never below the pair's own p-value (a percentile p on the bootstrap route: another statistic)
        padj = np.maximum(p, _maxt_pvalues(model, terms, [(names.index(a), names.index(b)) for a, b in pairs],
                                           np.array([c.diff for c in rows], float),
                                           np.array([c.se for c in rows], float)))
    else:
        padj = adjust(p, method) if p.size else p
    out = pd.DataFrame({"a": [c.a for c in rows], "b": [c.b for c in rows], "diff": [c.diff for c in rows],
                        "se": [c.se for c in rows], "p_value": p, "p_adjusted": padj})
    out["significant"] = out["p_adjusted"] <= 1.0 - level
    out.attrs["method"] = method
    return out


def _maxt_pvalues(model: EvaluationModel, terms: Terms, pairs: list[tuple[int, int]], diff: np.ndarray,
                  se: np.ndarray) -> np.ndarray:
    """Single-step max-T adjusted p-values ``P(max_j |T*_j| >= |t_j|)`` of the pairwise differences."""
    if not pairs:
        return np.zeros(0)
    ia, ib = np.array([a for a, _ in pairs]), np.array([b for _, b in pairs])
    t = np.abs(diff) / np.where(se > 0, se, np.inf)
    if terms.replicates is not None:
        D = _finite_rows(terms.replicates[:, ia] - terms.replicates[:, ib])
        s = D.std(axis=0, ddof=1)
        tmax = (np.abs(D - diff) / np.where(s > 0, s, np.inf)).max(axis=1)
        return np.minimum((1 + (tmax[:, None] >= t[None, :]).sum(axis=0)) / (tmax.size + 1), 1.0)
    C = cluster_cov(terms.influence[:, ia] - terms.influence[:, ib])
    s = np.sqrt(np.clip(np.diag(C), 0, None))
    s1 = np.where(s > 0, s, 1.0)
    Z = np.random.default_rng(MAXT_SEED).multivariate_normal(np.zeros(len(pairs)), C / np.outer(s1, s1)
                                                             + 1e-12 * np.eye(len(pairs)), MAXT_DRAWS, method="eigh")
    tmax = np.abs(Z).max(axis=1)
    return np.array([(1 + np.sum(tmax >= tj)) / (tmax.size + 1) for tj in t])


# ------------------------------------------------------------------------------------ summary


def summary(model: EvaluationModel):
    """One row per policy with its reported figures (see `EvaluationResult.summary`)."""
    import pandas as pd

    level = 1.0 - model.inference.alpha
    rows = []
    for n, p in model.policies.items():
        ci = p.ci if quotable(p) and p.ci is not None else None
        rows.append({"policy": n, "estimate": np.nan if p.estimate is None else p.estimate,
                     "se": np.nan if p.se is None else p.se,
                     "ci_low": np.nan if ci is None or ci[0] is None else ci[0],
                     "ci_high": np.nan if ci is None or ci[1] is None else ci[1], "level": level,
                     "level_claim": p.level_claim, "verified": p.level_claim == "ok", "basis_code": p.basis_code,
                     "ci_method": p.ci_method, "audit": p.audit.verdict, "relative_claim": p.relative_claim,
                     "n_rows": p.n_rows, "n_labelled": p.n_labelled})
    return pd.DataFrame(rows).set_index("policy")
