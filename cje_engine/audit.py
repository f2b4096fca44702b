"""Transport audit: does the calibration hold, in the mean, for a policy's own labels?

Residuals ``r = Y - f(S, X)`` on the policy's labelled rows, with ``f`` not trained on
those rows (out-of-fold, or trained only on the calibration policies). The mean residual
``delta`` gets a prompt-clustered standard error. Verdicts against a declared margin:

The reference distribution of ``delta / se`` is Student's t with ``df`` degrees of freedom
(`satterthwaite_df`: the audit slice's residual term and, for a borrowed calibrator, its estimation
error from a few calibration labels; ``inf``, the normal, where the SE rests on many labels).

- ``fail``: H0 delta = 0 rejected at level alpha, per policy: the audit guards the validity of that
  policy's level, and an adjustment for the number of audited policies would make a biased level *more*
  likely to pass (multiplicity belongs to the claims made from the levels; ../shared/METHOD.md);
- ``pass``: not failed and the (1 - alpha) CI lies inside [-margin, +margin];
- ``inconclusive``: neither; ``extra_labels_needed`` says how many more labels would make it
  decisive if the residual mean and spread stayed as observed;
- ``not_run``: the policy has fewer than two labelled prompts of its own, or the calibration rests on
  fewer than ``min_labels`` labels (``n_calibration``): then its error cannot be estimated (a bootstrap
  replicate holds ~3 distinct labels of 5), every level is refused already, and a residual mean
  against it tests the calibrator's size, not its transport.
"""
from __future__ import annotations

import math

import numpy as np

from cje_engine.inference import reference_t


def _decile_bins(score: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """The bins of `residual_deciles`: the distinct quantiles of ``score`` as edges (one value: one bin of it) and
    each row's bin (right-closed but the first; ties keep a bin whole)."""
    edges = np.unique(np.quantile(score, np.linspace(0, 1, n_bins + 1)))
    if edges.size == 1:
        edges = np.array([edges[0], edges[0]])
    return edges, np.clip(np.searchsorted(edges, score, side="right") - 1, 0, edges.size - 2)


def residual_deciles(score: np.ndarray, resid: np.ndarray, weight: np.ndarray, n_bins: int = 10,
                     reference: bool = False) -> list[dict]:
    """Mean residual by decile of the judge score (ties keep bins whole, so fewer may appear).

    The rows are put in bin order once (a stable counting sort of their bin: within a bin in row order), so
    each bin's rows are one slice: the arrays a per-bin mask selects, the same values in the same order, summed
    alike (the same bits; ``reference``: a mask a bin, as first written, one pass over every row a bin)."""
    if reference:
        return _residual_deciles_reference(score, resid, weight, n_bins)
    if score.size == 0:
        return []
    edges, idx = _decile_bins(score, n_bins)
    nb = edges.size - 1
    order = np.argsort(idx.astype(np.int16 if nb < 2**15 else np.int64), kind="stable")  # radix: O(rows)
    starts = np.concatenate([[0], np.cumsum(np.bincount(idx, minlength=nb))])
    w_all, r_all = weight[order], resid[order]
    out = []
    for b in range(nb):
        a, e = int(starts[b]), int(starts[b + 1])
        n = e - a
        if n == 0:
            continue
        w, r = w_all[a:e], r_all[a:e]
        mean = float(np.sum(w * r) / np.sum(w))
        se = float(np.sqrt(np.sum(w**2 * (r - mean) ** 2)) / np.sum(w)) if n > 1 else None
        out.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "n": n, "mean_residual": mean, "se": se})
    return out


def _residual_deciles_reference(score: np.ndarray, resid: np.ndarray, weight: np.ndarray, n_bins: int = 10
                                ) -> list[dict]:
    """`residual_deciles` as first written (a boolean mask a bin): its reference."""
    if score.size == 0:
        return []
    edges, idx = _decile_bins(score, n_bins)
    out = []
    for b in range(edges.size - 1):
        sel = idx == b
        n = int(sel.sum())
        if n == 0:
            continue
        w = weight[sel]
        mean = float(np.sum(w * resid[sel]) / np.sum(w))
        se = float(np.sqrt(np.sum(w**2 * (resid[sel] - mean) ** 2)) / np.sum(w)) if n > 1 else None
        out.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "n": n, "mean_residual": mean, "se": se})
    return out


def satterthwaite_df(variances: np.ndarray, dfs: np.ndarray) -> np.ndarray:
    """Welch-Satterthwaite degrees of freedom of a sum of independent variance estimates.

    ``(sum_j v_j)^2 / sum_j (v_j^2 / df_j)`` over the last axis: the df of the chi-square that matches
    the first two moments of ``sum_j v_j`` when ``v_j`` is ``sigma_j^2 chi2_{df_j} / df_j``
    (Satterthwaite 1946; Welch 1947). Terms with ``v_j = 0`` or ``df_j = inf`` add nothing to the
    denominator; ``inf`` when nothing is left (every term exact), NaN where the variances sum to 0.

    Parameters
    ----------
    variances, dfs : ndarray, shape (..., J)
        The variance estimates (>= 0) and their degrees of freedom (> 0, may be inf).
    """
    v = np.asarray(variances, dtype=float)
    nu = np.asarray(dfs, dtype=float)
    tot = v.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        den = np.where(v > 0, v * v / nu, 0.0).sum(axis=-1)
        out = np.where(den > 0, tot * tot / den, np.inf)
    return np.where(tot > 0, out, np.nan)


def audit_policies(
    delta: np.ndarray,
    se: np.ndarray,
    n_labels: np.ndarray,
    n_label_prompts: np.ndarray,
    alpha: float,
    margin: float,
    df: np.ndarray | None = None,
    n_calibration: int | None = None,
    min_labels: int = 0,
) -> list[dict]:
    """Verdicts for every policy from residual means and clustered SEs.

    Parameters
    ----------
    delta, se : ndarray, shape (K,)
        Mean residual and its clustered standard error (NaN where no labels).
    n_labels, n_label_prompts : ndarray, shape (K,)
        Labelled rows and distinct labelled prompts of each policy.
    df : ndarray, shape (K,), optional
        Degrees of freedom of each ``delta / se`` (t reference, p-values and CIs); None or inf: normal.
    n_calibration, min_labels : int, optional
        Labels that train the calibrator and the fewest with which it is audited (below: ``not_run``).
    """
    K = delta.size
    nu = np.full(K, np.inf) if df is None else np.where(np.isnan(df), np.inf, np.asarray(df, dtype=float))
    too_small = n_calibration is not None and n_calibration < min_labels
    audited = np.flatnonzero((n_label_prompts >= 2) & np.isfinite(se) & (se > 0) & (not too_small))
    m = audited.size
    p = np.full(K, np.nan)
    p[audited] = [reference_t.two_sided_p(abs(delta[k] / se[k]), nu[k]) for k in audited]
    p_adj = p.copy()  # no adjustment: each audit guards its own policy's level
    out = []
    for k in range(K):
        base = {"n_labels": int(n_labels[k]), "margin": margin, "family_size": int(m),
                "df": float(nu[k]) if k in audited and np.isfinite(nu[k]) else None}
        if k not in audited:
            base.update(verdict="not_run", reason=(
                "no oracle labels of its own: the calibration's transport to this policy is untested"
                if n_labels[k] == 0 else
                f"only {n_calibration} calibration labels (at least {min_labels} needed): the calibrator's error "
                "cannot be estimated, so its transport is untested" if too_small else
                f"only {int(n_label_prompts[k])} labelled prompt(s); at least 2 needed"),
                residual_mean=None if n_labels[k] == 0 else float(delta[k]), se=None, ci=None,
                ci_adjusted=None, p_value=None, p_adjusted=None, extra_labels_needed=None)
            out.append(base)
            continue
        d, s = float(delta[k]), float(se[k])
        z = z_adj = reference_t.quantile(1 - alpha / 2, nu[k])
        ci = [d - z * s, d + z * s]
        ci_adj = [d - z_adj * s, d + z_adj * s]
        n = int(n_labels[k])
        extra = None
        if p_adj[k] <= alpha:
            verdict = "fail"
            reason = (f"mean residual {d:+.3f} (SE {s:.3f}) differs from 0 at level {alpha}: the calibration "
                      + ("over-states" if d < 0 else "under-states"))
            reason += " this policy's value"
        elif ci_adj[0] >= -margin and ci_adj[1] <= margin:
            verdict = "pass"
            reason = f"CI [{ci_adj[0]:+.3f}, {ci_adj[1]:+.3f}] lies inside +/-{margin:.3g}"
        else:
            verdict = "inconclusive"
            target = (margin - abs(d)) / z_adj if abs(d) < margin else abs(d) / z_adj
            n_needed = n * (s / target) ** 2 if target > 0 else math.inf
            extra = int(math.ceil(n_needed - n)) if math.isfinite(n_needed) else None
            reason = (f"CI [{ci_adj[0]:+.3f}, {ci_adj[1]:+.3f}] neither excludes 0 nor fits inside "
                      f"+/-{margin:.3g}" + (f"; about {extra} more labels would decide it" if extra is not None else ""))
        base.update(verdict=verdict, reason=reason, residual_mean=d, se=s, ci=ci, ci_adjusted=ci_adj,
                    p_value=float(p[k]), p_adjusted=float(p_adj[k]), extra_labels_needed=extra)
        out.append(base)
    return out
