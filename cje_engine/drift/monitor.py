"""Judge-drift monitoring on a fixed anchor set.

An anchor set is a fixed list of (prompt, response) pairs, some with oracle labels. The judge
re-scores the anchors every period (a *look*). Each look is compared with reference scores of the
same anchors (paired by ``anchor_id``):

- Kendall's tau-b between reference and current scores (exact, ties allowed) with a
  jackknife or influence-function standard error (optionally clustered);
- the paired mean shift of the scores;
- the change of the score distribution (Kolmogorov-Smirnov / total-variation distance over the
  score values) with an exact sign test per threshold;
- on labelled anchors, the change of the mean calibration residual ``oracle - f(score)`` and of
  the calibration loss ``(oracle - f(score))**2``.

`DriftMonitor` raises alarms that stay valid under repeated looks: every look spends a share
``alpha * w_metric * g(look)`` of the error budget (sum over metrics and looks <= ``alpha``), so
the family-wise false-alarm rate over all metrics and all looks is at most ``alpha`` (union
bound; valid whatever the dependence between looks). See ``docs/drift.md``.
"""
from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy import special

from cje_engine.errors import CJEInputError
from cje_engine.result.jsonable import jsonable

logger = logging.getLogger(__name__)

ANCHOR, SCORE, LABEL = "anchor_id", "judge_score", "oracle_label"

#: Alarm metrics, in the order they are reported.
METRICS: tuple[str, ...] = ("tau_b", "mean_shift", "distribution", "residual_mean", "calibration_loss")

#: Default share of ``alpha`` given to each metric (fixed in advance; unused shares are not moved).
DEFAULT_WEIGHTS: dict[str, float] = {m: 1.0 / len(METRICS) for m in METRICS}

STATE_VERSION = 1

# Above this many cells (distinct x values times distinct y values) the pair counts are computed
# by blocked pairwise comparison instead of a contingency table.
_MAX_TABLE_CELLS = 4_000_000
_BLOCK = 512


# --------------------------------------------------------------------------------------------
# Kendall's tau-b
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PairCounts:
    """Per-observation pair counts behind tau-b.

    ``s[i] = sum_j sign(x_i - x_j) * sign(y_i - y_j)`` (concordant minus discordant partners),
    ``tx[i] = #{j : x_j != x_i}``, ``ty[i] = #{j : y_j != y_i}``. Then ``S = sum(s) / 2`` is
    concordant minus discordant pairs, ``Tx = sum(tx) / 2`` the pairs not tied in x.
    """

    s: np.ndarray
    tx: np.ndarray
    ty: np.ndarray

    @property
    def S(self) -> int:
        return int(self.s.sum()) // 2

    @property
    def Tx(self) -> int:
        return int(self.tx.sum()) // 2

    @property
    def Ty(self) -> int:
        return int(self.ty.sum()) // 2


def _pair_counts(x: np.ndarray, y: np.ndarray) -> _PairCounts:
    """Exact integer pair counts in O(n + kx*ky) (few distinct values) or O(n^2) blocked."""
    n = x.shape[0]
    ux, cx = np.unique(x, return_inverse=True)
    uy, cy = np.unique(y, return_inverse=True)
    kx, ky = ux.shape[0], uy.shape[0]
    nx = np.bincount(cx, minlength=kx)
    ny = np.bincount(cy, minlength=ky)
    tx = (n - nx[cx]).astype(np.int64)
    ty = (n - ny[cy]).astype(np.int64)
    if kx * ky <= _MAX_TABLE_CELLS:
        table = np.zeros((kx, ky), dtype=np.int64)
        np.add.at(table, (cx, cy), 1)
        cum = np.zeros((kx + 1, ky + 1), dtype=np.int64)
        cum[1:, 1:] = table.cumsum(axis=0).cumsum(axis=1)
        a, b = cx, cy
        lt_lt = cum[a, b]  # x < a, y < b
        lt_gt = cum[a, ky] - cum[a, b + 1]  # x < a, y > b
        gt_lt = cum[kx, b] - cum[a + 1, b]  # x > a, y < b
        gt_gt = n - cum[a + 1, ky] - cum[kx, b + 1] + cum[a + 1, b + 1]  # x > a, y > b
        s = (lt_lt + gt_gt - lt_gt - gt_lt).astype(np.int64)
    else:
        s = np.empty(n, dtype=np.int64)
        for start in range(0, n, _BLOCK):
            stop = min(start + _BLOCK, n)
            sx = np.sign(cx[start:stop, None] - cx[None, :])
            sy = np.sign(cy[start:stop, None] - cy[None, :])
            s[start:stop] = (sx * sy).sum(axis=1)
    return _PairCounts(s=s, tx=tx, ty=ty)


def _as_float_array(values: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise CJEInputError(f"{name} must be numbers", column=name) from None
    if arr.ndim != 1:
        raise CJEInputError(f"{name} must be one-dimensional, got shape {arr.shape}", column=name)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise CJEInputError(
            f"{name} must be finite; found {arr[bad[0]]!r}", column=name, row=int(bad[0])
        )
    return arr


def _cluster_codes(clusters: Any, n: int) -> np.ndarray | None:
    if clusters is None:
        return None
    arr = np.asarray(clusters)
    if arr.shape != (n,):
        raise CJEInputError(
            f"clusters must have one entry per observation ({n}), got shape {arr.shape}",
            column="clusters",
        )
    _, codes = np.unique(arr.astype(str), return_inverse=True)
    return codes


def _check_pair(x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    xa = _as_float_array(x, "x")
    ya = _as_float_array(y, "y")
    if xa.shape != ya.shape:
        raise CJEInputError(f"x and y must have the same length, got {xa.shape[0]} and {ya.shape[0]}")
    if xa.shape[0] < 3:
        raise CJEInputError(f"tau-b needs at least 3 pairs, got {xa.shape[0]}")
    return xa, ya


def _tau_from(S: float, Tx: float, Ty: float) -> float:
    if Tx <= 0 or Ty <= 0:
        return float("nan")
    return float(S / math.sqrt(float(Tx) * float(Ty)))


def _constant_error(x: np.ndarray, y: np.ndarray) -> None:
    for name, arr in (("x", x), ("y", y)):
        if np.all(arr == arr[0]):
            raise CJEInputError(
                f"all {name} values equal {float(arr[0])!r}: tau-b is undefined for a constant variable",
                column=name,
            )


def tau_b_leave_one_out(
    x: Any, y: Any, clusters: Any = None
) -> tuple[float, np.ndarray]:
    """Tau-b and its delete-one (or delete-one-cluster) jackknife replicates.

    Exact in O(n) after the pair counts: deleting observation i gives
    ``tau_(-i) = (S - s_i) / sqrt((Tx - tx_i) * (Ty - ty_i))``. Deleting cluster g subtracts the
    cluster's partner counts and adds back its within-cluster pairs (subtracted twice).

    Parameters
    ----------
    x, y : array-like, shape (n,)
    clusters : array-like, shape (n,), optional
        Cluster of each observation; replicates then delete one cluster at a time.

    Returns
    -------
    tau : float
    loo : ndarray, shape (n_clusters,)
        Tau-b without each observation (cluster); NaN where the remainder is constant.
    """
    xa, ya = _check_pair(x, y)
    _constant_error(xa, ya)
    pc = _pair_counts(xa, ya)
    S, Tx, Ty = pc.S, pc.Tx, pc.Ty
    tau = _tau_from(S, Tx, Ty)
    codes = _cluster_codes(clusters, xa.shape[0])
    if codes is None:
        s_g, tx_g, ty_g = pc.s, pc.tx, pc.ty
        w_s = w_x = w_y = 0
    else:
        G = int(codes.max()) + 1
        s_g = np.bincount(codes, weights=pc.s, minlength=G)
        tx_g = np.bincount(codes, weights=pc.tx, minlength=G)
        ty_g = np.bincount(codes, weights=pc.ty, minlength=G)
        w_s = np.zeros(G)
        w_x = np.zeros(G)
        w_y = np.zeros(G)
        order = np.argsort(codes, kind="stable")
        bounds = np.flatnonzero(np.diff(codes[order])) + 1
        for idx in np.split(order, bounds):
            if idx.shape[0] < 2:
                continue
            inner = _pair_counts(xa[idx], ya[idx])
            g = codes[idx[0]]
            w_s[g], w_x[g], w_y[g] = inner.S, inner.Tx, inner.Ty
    num = S - s_g + w_s
    dx = Tx - tx_g + w_x
    dy = Ty - ty_g + w_y
    with np.errstate(invalid="ignore", divide="ignore"):
        loo = np.where((dx > 0) & (dy > 0), num / np.sqrt(np.maximum(dx, 0) * np.maximum(dy, 0)), np.nan)
    return tau, loo.astype(float)


def _jackknife_se(loo: np.ndarray) -> float:
    if np.any(np.isnan(loo)):
        return float("nan")
    G = loo.shape[0]
    return float(math.sqrt((G - 1) / G * float(np.sum((loo - loo.mean()) ** 2))))


def tau_b_influence(x: Any, y: Any) -> tuple[float, np.ndarray]:
    """Tau-b and its estimated influence function values (one per observation).

    Tau-b is ``U_s / sqrt(U_x * U_y)`` with three U-statistics of order 2 (kernels
    ``sign(dx) sign(dy)``, ``[dx != 0]``, ``[dy != 0]``). A U-statistic's influence is
    ``2 * (h1(Z_i) - U)`` with ``h1`` estimated by ``s_i / (n - 1)``; the delta method gives::

        IF_i = 2 * [ (s_i/(n-1) - U_s) / sqrt(U_x U_y)
                     - tau/2 * ((tx_i/(n-1) - U_x) / U_x + (ty_i/(n-1) - U_y) / U_y) ]

    and ``Var(tau_b) ~= sum_i IF_i**2 / n**2`` (clustered: sum IF within clusters first).
    """
    xa, ya = _check_pair(x, y)
    _constant_error(xa, ya)
    n = xa.shape[0]
    pc = _pair_counts(xa, ya)
    pairs = n * (n - 1) / 2.0
    Us, Ux, Uy = pc.S / pairs, pc.Tx / pairs, pc.Ty / pairs
    tau = _tau_from(pc.S, pc.Tx, pc.Ty)
    hs = pc.s / (n - 1)
    hx = pc.tx / (n - 1)
    hy = pc.ty / (n - 1)
    infl = 2.0 * ((hs - Us) / math.sqrt(Ux * Uy) - tau / 2.0 * ((hx - Ux) / Ux + (hy - Uy) / Uy))
    return tau, infl


@dataclass(frozen=True)
class TauResult:
    """Kendall's tau-b with a standard error and a confidence interval.

    Attributes
    ----------
    tau : float
    se : float
    ci : (lo, hi)
        ``tau -/+ t_{G-1, 1-alpha/2} * se`` clipped to [-1, 1] (G = clusters, or n).
    n : int
    n_clusters : int
    se_method : {"jackknife", "influence"}
    alpha : float
    """

    tau: float
    se: float
    ci: tuple[float, float]
    n: int
    n_clusters: int
    se_method: str
    alpha: float

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(
            {
                "tau": self.tau,
                "se": self.se,
                "ci": list(self.ci),
                "n": self.n,
                "n_clusters": self.n_clusters,
                "se_method": self.se_method,
                "alpha": self.alpha,
            }
        )


def kendall_tau_b(
    x: Any,
    y: Any,
    *,
    alpha: float = 0.05,
    se_method: str = "jackknife",
    clusters: Any = None,
) -> TauResult:
    """Exact Kendall's tau-b (ties allowed) with a confidence interval.

    ``tau_b = (C - D) / sqrt((n0 - n1) (n0 - n2))`` with C, D the concordant and discordant
    pairs, ``n0 = n(n-1)/2`` and n1, n2 the pairs tied in x, in y. Equals
    ``scipy.stats.kendalltau(x, y).statistic``.

    Parameters
    ----------
    x, y : array-like of float, shape (n,)
    alpha : float
        CI level is ``1 - alpha``.
    se_method : {"jackknife", "influence"}
        ``"jackknife"``: delete-one (delete-one-cluster) jackknife, exact in O(n) (default).
        ``"influence"``: delta-method influence function of the three U-statistics.
        Both are valid with ties; see ``docs/drift.md``.
    clusters : array-like, shape (n,), optional
        Cluster (e.g. prompt) of each pair; the SE then treats clusters as the independent units.
    """
    _check_alpha(alpha)
    if se_method not in ("jackknife", "influence"):
        raise CJEInputError(f"se_method must be 'jackknife' or 'influence', got {se_method!r}")
    xa, ya = _check_pair(x, y)
    codes = _cluster_codes(clusters, xa.shape[0])
    if se_method == "jackknife":
        tau, loo = tau_b_leave_one_out(xa, ya, clusters=codes)
        se = _jackknife_se(loo)
        G = loo.shape[0]
    else:
        tau, infl = tau_b_influence(xa, ya)
        n = xa.shape[0]
        if codes is not None:
            G = int(codes.max()) + 1
            infl_g = np.bincount(codes, weights=infl, minlength=G)
            se = float(math.sqrt(G / max(G - 1, 1) * np.sum(infl_g**2)) / n)
        else:
            G = n
            se = float(math.sqrt(np.sum(infl**2)) / n)
    return _tau_result(tau, se, int(xa.shape[0]), int(G), se_method, alpha)


def _tau_result(tau: float, se: float, n: int, G: int, se_method: str, alpha: float) -> TauResult:
    crit = _t_isf(alpha / 2, max(G - 1, 1))
    if np.isfinite(se):
        lo, hi = max(-1.0, tau - crit * se), min(1.0, tau + crit * se)
    else:
        lo = hi = float("nan")
    return TauResult(tau=tau, se=se, ci=(lo, hi), n=n, n_clusters=G, se_method=se_method, alpha=alpha)


# --------------------------------------------------------------------------------------------
# Per-look comparisons
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _t_isf(tail: float, df: int) -> float:
    """Upper ``tail`` quantile of Student's t with ``df`` degrees of freedom (cached)."""
    return float(-special.stdtrit(df, tail))


def _t_two_sided_p(z: float, df: int) -> float:
    """Two-sided Student-t p-value of a t statistic."""
    return float(2.0 * special.stdtr(df, -abs(z)))


def _check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
        raise CJEInputError(f"alpha must be a number in (0, 1), got {alpha!r}")


def paired_mean(
    d: np.ndarray, clusters: np.ndarray | None = None
) -> tuple[float, float, int]:
    """Mean of paired differences with its (cluster-robust) standard error.

    Returns ``(mean, se, df)``; ``df = G - 1`` with G the number of clusters (or pairs).
    """
    n = d.shape[0]
    mean = float(d.mean())
    if clusters is None:
        se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
        return mean, se, n - 1
    G = int(clusters.max()) + 1
    u = np.bincount(clusters, weights=d - mean, minlength=G)
    se = float(math.sqrt(G / (G - 1) * np.sum(u**2)) / n) if G > 1 else float("nan")
    return mean, se, G - 1


@dataclass(frozen=True)
class DistributionChange:
    """Change of the marginal score distribution between two paired scorings.

    Attributes
    ----------
    ks : float
        ``max_v |F_current(v) - F_reference(v)|``.
    tv : float
        Total-variation distance ``0.5 * sum_v |p_current(v) - p_reference(v)|``.
    p_value : float
        Bonferroni over thresholds of exact two-sided sign tests (see `distribution_change`).
    n_thresholds : int
        Thresholds with at least one discordant anchor (the Bonferroni factor).
    worst_threshold : float or None
        Threshold with the smallest p-value.
    """

    ks: float
    tv: float
    p_value: float
    n_thresholds: int
    worst_threshold: float | None


def distribution_change(
    reference: np.ndarray, current: np.ndarray, *, max_thresholds: int = 32
) -> DistributionChange:
    """KS and TV distance between paired score distributions, with an exact test.

    For a threshold v, an anchor is *discordant* when exactly one of ``reference <= v`` and
    ``current <= v`` holds; ``k_v`` of the ``m_v`` discordant anchors have ``current <= v``.
    Under no drift the two scorings of an anchor are exchangeable and independent across
    anchors, so given the unordered pairs ``k_v ~ Binomial(m_v, 1/2)`` exactly (a sign test;
    no permutation and no large-sample approximation). ``F_cur(v) - F_ref(v) = (2 k_v - m_v)/n``.
    The p-value is ``min(1, L * min_v p_v)`` over the L thresholds with ``m_v > 0``.
    Thresholds are the distinct pooled values (all but the largest); with more than
    ``max_thresholds`` of them, pooled quantiles are used (pooled values are invariant under the
    exchange, so the test stays exact).
    """
    n = reference.shape[0]
    pooled = np.concatenate([reference, current])
    values = np.unique(pooled)
    cand = values[:-1]
    if cand.shape[0] > max_thresholds:
        qs = np.quantile(pooled, np.linspace(0, 1, max_thresholds + 2)[1:-1], method="lower")
        cand = np.unique(qs)
        cand = cand[cand < values[-1]]
    # total variation over the pooled values
    ref_hist = np.bincount(np.searchsorted(values, reference), minlength=values.shape[0])
    cur_hist = np.bincount(np.searchsorted(values, current), minlength=values.shape[0])
    tv = 0.5 * float(np.abs(cur_hist - ref_hist).sum()) / n
    if cand.shape[0] == 0:
        return DistributionChange(ks=0.0, tv=tv, p_value=1.0, n_thresholds=0, worst_threshold=None)
    ref_le = reference[None, :] <= cand[:, None]
    cur_le = current[None, :] <= cand[:, None]
    k = np.sum(cur_le & ~ref_le, axis=1)
    m = k + np.sum(ref_le & ~cur_le, axis=1)
    ks = float(np.max(np.abs(2 * k - m)) / n)
    informative = m > 0
    L = int(informative.sum())
    if L == 0:
        return DistributionChange(ks=ks, tv=tv, p_value=1.0, n_thresholds=0, worst_threshold=None)
    ki, mi = k[informative], m[informative]
    # two-sided exact binomial(m, 1/2) p-value; by symmetry P(K >= k) = P(K <= m - k)
    p = np.minimum(1.0, 2.0 * special.bdtr(np.minimum(ki, mi - ki), mi, 0.5))
    j = int(np.argmin(p))
    return DistributionChange(
        ks=ks,
        tv=tv,
        p_value=float(min(1.0, L * p[j])),
        n_thresholds=L,
        worst_threshold=float(cand[informative][j]),
    )


@dataclass(frozen=True)
class MetricResult:
    """One drift metric at one look.

    Attributes
    ----------
    name : str
    estimate : float or None
        None when the metric could not be computed at this look (see ``note``).
    se : float or None
    ci : (lo, hi) or None
        Fixed-sample ``1 - alpha`` interval (valid for this look alone).
    ci_anytime : (lo, hi) or None
        Interval at level ``1 - alpha_spent``: all anytime intervals of all metrics and looks
        hold simultaneously with probability >= 1 - alpha.
    null_value : float
        Value under no drift.
    p_value : float or None
        Per-look p-value for "no drift".
    alpha_spent : float
        Error budget spent by this metric at this look.
    alarm : bool
        ``p_value <= alpha_spent`` (for CI-based metrics: ``ci_anytime`` excludes ``null_value``).
    n : int
        Anchors (or labelled anchors) used.
    note : str
    detail : dict
    """

    name: str
    estimate: float | None
    se: float | None
    ci: tuple[float, float] | None
    ci_anytime: tuple[float, float] | None
    null_value: float
    p_value: float | None
    alpha_spent: float
    alarm: bool
    n: int
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(
            {
                "name": self.name,
                "estimate": self.estimate,
                "se": self.se,
                "ci": None if self.ci is None else list(self.ci),
                "ci_anytime": None if self.ci_anytime is None else list(self.ci_anytime),
                "null_value": self.null_value,
                "p_value": self.p_value,
                "alpha_spent": self.alpha_spent,
                "alarm": self.alarm,
                "n": self.n,
                "note": self.note,
                "detail": self.detail,
            }
        )


@dataclass(frozen=True)
class DriftLook:
    """Result of one look of a `DriftMonitor`.

    Attributes
    ----------
    look : int
        1-based index of the look within the monitor.
    n_anchors : int
        Anchors scored in both the reference and the current look.
    n_missing : int
        Reference anchors absent from the current look.
    n_labelled : int
        Paired anchors with an oracle label.
    alpha : float
        Family-wise error budget of the monitor.
    metrics : dict of str to MetricResult
    alarms : list of str
        Metrics that alarmed at this look.
    first_alarm : dict of str to int or None
        Look at which each metric first alarmed (monitor history, this look included).
    meta : dict
        Free-form labels passed to `DriftMonitor.update` (judge version, timestamp, ...).
    """

    look: int
    n_anchors: int
    n_missing: int
    n_labelled: int
    alpha: float
    metrics: dict[str, MetricResult]
    alarms: list[str]
    first_alarm: dict[str, int | None]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def alarm(self) -> bool:
        """True when any metric alarmed at this look."""
        return bool(self.alarms)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(
            {
                "look": self.look,
                "n_anchors": self.n_anchors,
                "n_missing": self.n_missing,
                "n_labelled": self.n_labelled,
                "alpha": self.alpha,
                "alarm": self.alarm,
                "alarms": list(self.alarms),
                "first_alarm": dict(self.first_alarm),
                "metrics": {k: v.to_dict() for k, v in self.metrics.items()},
                "meta": dict(self.meta),
            }
        )


def _jsonable(obj: Any) -> Any:
    """Plain JSON data (`cje_engine.result.jsonable`); other objects (timestamps in ``meta``) to str."""
    return jsonable(obj, default=str)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def scores_from_frame(
    frame: pd.DataFrame,
    *,
    value_column: str = SCORE,
    source: str = "<DataFrame>",
    allow_missing: bool = False,
) -> pd.Series:
    """Scores of one look from rows ``anchor_id, <value_column>`` as a Series by anchor id.

    Other columns (``judge_id``, ``judge_version``, ``ts``, ...) are ignored; select the look's
    rows before calling. Raises `CJEInputError` naming the row of a duplicate anchor or a
    non-finite value (NaN is allowed when ``allow_missing``, e.g. unlabelled anchors).
    """
    for col in (ANCHOR, value_column):
        if col not in frame.columns:
            raise CJEInputError(
                f"missing column '{col}' (have {list(frame.columns)})", source=source, column=col
            )
    ids = frame[ANCHOR].astype(str).to_numpy()
    raw = frame[value_column]
    conv = pd.to_numeric(raw, errors="coerce")
    bad = np.flatnonzero(conv.isna().to_numpy() & raw.notna().to_numpy())
    if bad.size:
        raise CJEInputError(
            f"expected a number, got {raw.iloc[bad[0]]!r}", source=source, column=value_column, row=int(bad[0])
        )
    vals = conv.to_numpy(dtype=float)
    return _finish_series(pd.Series(vals, index=pd.Index(ids, name=ANCHOR)), value_column, source, allow_missing)


def _finish_series(s: pd.Series, column: str, source: str, allow_missing: bool) -> pd.Series:
    if not s.index.is_unique:
        dup = np.flatnonzero(s.index.duplicated())
        raise CJEInputError(
            f"anchor_id {s.index[dup[0]]!r} appears more than once", source=source, column=ANCHOR, row=int(dup[0])
        )
    vals = s.to_numpy(dtype=float)
    bad = ~np.isfinite(vals)
    if allow_missing:
        bad &= ~np.isnan(vals)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CJEInputError(
            f"expected a finite number for anchor {s.index[i]!r}, got {vals[i]!r}",
            source=source,
            column=column,
            row=i,
        )
    return s


def as_scores(
    values: pd.Series | pd.DataFrame | Mapping[Any, float],
    what: str,
    *,
    value_column: str = SCORE,
    allow_missing: bool = False,
) -> pd.Series:
    """Coerce scores (Series by anchor id, mapping, or frame with ``anchor_id``) to a float Series.

    ``what`` names the input in error messages (e.g. ``"current_scores"``).
    """
    if isinstance(values, pd.DataFrame):
        return scores_from_frame(values, value_column=value_column, source=what, allow_missing=allow_missing)
    if isinstance(values, pd.Series):
        s = values
    elif isinstance(values, Mapping):
        s = pd.Series(dict(values), dtype=object)
    else:
        raise CJEInputError(
            f"expected a pandas Series indexed by anchor_id, a mapping anchor_id -> value, or a "
            f"frame with columns '{ANCHOR}' and '{value_column}'; got {type(values).__name__}",
            source=what,
        )
    if pd.api.types.is_float_dtype(s.dtype) and pd.api.types.is_string_dtype(s.index.dtype):
        # fast path (scheduled looks reuse one float Series layout): only the checks remain
        return _finish_series(s, value_column, what, allow_missing)
    try:
        vals = pd.to_numeric(s, errors="raise").to_numpy(dtype=float)
    except (TypeError, ValueError):
        conv = pd.to_numeric(s, errors="coerce")
        i = int(np.flatnonzero(conv.isna() & s.notna())[0])
        raise CJEInputError(
            f"expected a number for anchor {s.index[i]!r}, got {s.iloc[i]!r}",
            source=what,
            column=value_column,
            row=i,
        ) from None
    idx = s.index if pd.api.types.is_string_dtype(s.index.dtype) else s.index.astype(str)
    return _finish_series(pd.Series(vals, index=idx.rename(ANCHOR)), value_column, what, allow_missing)


def _call_calibrate(calibrate: Any, scores: np.ndarray) -> np.ndarray:
    fn = calibrate if callable(calibrate) else getattr(calibrate, "predict", None)
    if fn is None:
        raise CJEInputError(
            f"calibrate must be a callable f(scores) -> calibrated values (or have .predict), "
            f"got {type(calibrate).__name__}",
            column="calibrate",
        )
    out = np.asarray(fn(scores), dtype=float).reshape(-1)
    if out.shape != scores.shape:
        raise CJEInputError(
            f"calibrate returned {out.shape[0]} values for {scores.shape[0]} scores", column="calibrate"
        )
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        raise CJEInputError(
            f"calibrate returned a non-finite value {out[bad[0]]!r} for score {scores[bad[0]]!r}",
            column="calibrate",
            row=int(bad[0]),
        )
    return out


# --------------------------------------------------------------------------------------------
# The monitor
# --------------------------------------------------------------------------------------------


def look_spending(look: int, horizon: int | None) -> float:
    """Share ``g(look)`` of the budget spent at a look; ``sum_t g(t) <= 1``.

    Unbounded (``horizon=None``): ``g(t) = 1 / (t (t + 1))`` (sums to exactly 1 over t >= 1).
    Stated horizon H: ``g(t) = 1 / H`` for ``t <= H``.
    """
    if look < 1:
        raise CJEInputError(f"look must be >= 1, got {look}")
    if horizon is None:
        return 1.0 / (look * (look + 1))
    if look > horizon:
        raise CJEInputError(
            f"look {look} is past the monitor's horizon of {horizon} looks: the error budget is "
            "spent; start a new monitor (new reference) or use horizon=None"
        )
    return 1.0 / horizon


class DriftMonitor:
    """Judge-drift alarms with family-wise false-alarm rate <= ``alpha`` over metrics and looks.

    Parameters
    ----------
    alpha : float
        Family-wise error budget over all metrics and all looks (default 0.05).
    horizon : int, optional
        Number of scheduled looks. None (default) spends ``alpha / (t (t+1))`` at look t, valid
        for any number of looks; an integer H spends ``alpha / H`` per look up to look H and
        refuses later looks.
    weights : dict, optional
        Share of ``alpha`` per metric (see `METRICS`); must be >= 0 and sum to <= 1. Default
        equal shares. A metric that cannot be computed at a look (no labels, no replicate)
        keeps its share unused, so the guarantee never depends on the data.
    min_anchors : int
        Fewest paired anchors accepted in a look (default 20).
    min_labels : int
        Fewest labelled paired anchors for the residual metrics (default 10).
    tau_floor : float, optional
        Without a ``reference_replicate``, tau-b alarms when it is credibly different from
        this floor (e.g. the judge's known test-retest tau); with neither, tau-b is reported but
        never alarms.
    se_method : {"jackknife", "influence"}
        SE of tau-b.
    max_thresholds : int
        Most thresholds in the distribution test.

    Attributes
    ----------
    n_looks_ : int
        Looks taken so far.
    first_alarm_ : dict of str to int or None
        Look at which each metric first alarmed.
    history_ : list of dict
        Compact per-look summary (look, alarms, estimates, p-values, meta).
    """

    def __init__(
        self,
        alpha: float = 0.05,
        *,
        horizon: int | None = None,
        weights: Mapping[str, float] | None = None,
        min_anchors: int = 20,
        min_labels: int = 10,
        tau_floor: float | None = None,
        se_method: str = "jackknife",
        max_thresholds: int = 32,
    ) -> None:
        _check_alpha(alpha)
        if horizon is not None and (not isinstance(horizon, (int, np.integer)) or horizon < 1):
            raise CJEInputError(f"horizon must be a positive integer or None, got {horizon!r}")
        w = dict(DEFAULT_WEIGHTS if weights is None else weights)
        unknown = sorted(set(w) - set(METRICS))
        if unknown:
            raise CJEInputError(f"unknown metric(s) in weights: {unknown}; known: {list(METRICS)}")
        if any((not np.isfinite(v)) or v < 0 for v in w.values()):
            raise CJEInputError(f"weights must be finite and >= 0, got {w}")
        if sum(w.values()) > 1 + 1e-12:
            raise CJEInputError(f"weights must sum to <= 1, got {sum(w.values()):.6g}")
        if se_method not in ("jackknife", "influence"):
            raise CJEInputError(f"se_method must be 'jackknife' or 'influence', got {se_method!r}")
        if int(min_anchors) < 3:
            raise CJEInputError(f"min_anchors must be >= 3, got {min_anchors}")
        if int(min_labels) < 2:
            raise CJEInputError(f"min_labels must be >= 2, got {min_labels}")
        if tau_floor is not None and not (-1 <= tau_floor <= 1):
            raise CJEInputError(f"tau_floor must be in [-1, 1], got {tau_floor}")
        if int(max_thresholds) < 1:
            raise CJEInputError(f"max_thresholds must be >= 1, got {max_thresholds}")
        self.alpha = float(alpha)
        self.horizon = None if horizon is None else int(horizon)
        self.weights = {m: float(w.get(m, 0.0)) for m in METRICS}
        self.min_anchors = int(min_anchors)
        self.min_labels = int(min_labels)
        self.tau_floor = None if tau_floor is None else float(tau_floor)
        self.se_method = se_method
        self.max_thresholds = int(max_thresholds)
        self.n_looks_ = 0
        self.first_alarm_: dict[str, int | None] = {m: None for m in METRICS}
        self.history_: list[dict[str, Any]] = []

    # -- state ---------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "horizon": self.horizon,
            "weights": dict(self.weights),
            "min_anchors": self.min_anchors,
            "min_labels": self.min_labels,
            "tau_floor": self.tau_floor,
            "se_method": self.se_method,
            "max_thresholds": self.max_thresholds,
        }

    def to_dict(self) -> dict[str, Any]:
        """Configuration and state as plain JSON data (persist between scheduled runs)."""
        return _jsonable(
            {
                "state_version": STATE_VERSION,
                "config": self.get_config(),
                "n_looks": self.n_looks_,
                "first_alarm": dict(self.first_alarm_),
                "history": list(self.history_),
            }
        )

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], *, source: str = "<monitor state>") -> "DriftMonitor":
        """Rebuild a monitor saved with `to_dict`."""
        if not isinstance(state, Mapping):
            raise CJEInputError(f"monitor state must be a mapping, got {type(state).__name__}", source=source)
        for key in ("state_version", "config", "n_looks", "first_alarm", "history"):
            if key not in state:
                raise CJEInputError(f"monitor state lacks key '{key}'", source=source, column=key)
        if state["state_version"] != STATE_VERSION:
            raise CJEInputError(
                f"monitor state version {state['state_version']!r} is not supported (expected {STATE_VERSION})",
                source=source,
                column="state_version",
            )
        cfg = dict(state["config"])
        try:
            mon = cls(**cfg)
        except TypeError as exc:
            raise CJEInputError(f"bad monitor config: {exc}", source=source, column="config") from None
        n_looks = state["n_looks"]
        if not isinstance(n_looks, int) or n_looks < 0:
            raise CJEInputError(
                f"n_looks must be a non-negative integer, got {n_looks!r}", source=source, column="n_looks"
            )
        first = dict(state["first_alarm"])
        if set(first) != set(METRICS):
            raise CJEInputError(
                f"first_alarm must have keys {list(METRICS)}, got {sorted(first)}", source=source, column="first_alarm"
            )
        mon.n_looks_ = n_looks
        mon.first_alarm_ = {m: (None if first[m] is None else int(first[m])) for m in METRICS}
        mon.history_ = list(state["history"])
        return mon

    @property
    def alarmed(self) -> bool:
        """True once any metric has alarmed."""
        return any(v is not None for v in self.first_alarm_.values())

    def alpha_spent(self, look: int, metric: str) -> float:
        """Budget ``alpha * w_metric * g(look)`` of one metric at one look."""
        return self.alpha * self.weights[metric] * look_spending(look, self.horizon)

    # -- one look ------------------------------------------------------------------------

    def update(
        self,
        reference_scores: pd.Series | pd.DataFrame | Mapping[Any, float],
        current_scores: pd.Series | pd.DataFrame | Mapping[Any, float],
        labels: pd.Series | pd.DataFrame | Mapping[Any, float] | None = None,
        calibrate: Callable[[np.ndarray], np.ndarray] | None = None,
        *,
        reference_replicate: pd.Series | pd.DataFrame | Mapping[Any, float] | None = None,
        clusters: pd.Series | Mapping[Any, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> DriftLook:
        """Compare one look with the reference and update the alarm state.

        Parameters
        ----------
        reference_scores, current_scores : Series by anchor_id, mapping, or frame
            Judge scores of the anchors (frames need ``anchor_id`` and ``judge_score``).
        labels : Series by anchor_id, mapping, or frame with ``oracle_label``, optional
            Oracle labels (NaN = unlabelled). Needs ``calibrate``.
        calibrate : callable, optional
            ``f(scores) -> calibrated values`` on the label scale; must not have been fitted on
            these anchors' reference scores (in-sample residuals would be optimistic).
        reference_replicate : optional
            A second, independent scoring of the anchors by the reference judge; the tau-b
            alarm compares ``tau(reference, current)`` with ``tau(reference, replicate)``.
        clusters : Series by anchor_id or mapping, optional
            Cluster (e.g. prompt) of each anchor for clustered SEs.
        meta : mapping, optional
            Labels kept with the look (judge version, timestamp, ...).
        """
        look = self.n_looks_ + 1
        look_spending(look, self.horizon)  # refuses a look past the horizon before any work
        ref = as_scores(reference_scores, "reference_scores")
        cur = as_scores(current_scores, "current_scores")
        common = ref.index if ref.index.equals(cur.index) else ref.index.intersection(cur.index, sort=False)
        n = int(common.shape[0])
        if n < self.min_anchors:
            raise CJEInputError(
                f"only {n} of {ref.shape[0]} reference anchors were found in the current look; "
                f"at least {self.min_anchors} paired anchors are needed",
                source="current_scores",
                column=ANCHOR,
            )
        r = ref.reindex(common).to_numpy()
        c = cur.reindex(common).to_numpy()
        codes = None
        if clusters is not None:
            cl = clusters if isinstance(clusters, pd.Series) else pd.Series(dict(clusters), dtype=object)
            cl = cl.copy()
            cl.index = cl.index.astype(str)
            cl = cl.reindex(common)
            if cl.isna().any():
                miss = common[np.flatnonzero(cl.isna().to_numpy())[0]]
                raise CJEInputError(f"no cluster given for anchor {miss!r}", source="clusters", column=ANCHOR)
            _, codes = np.unique(cl.astype(str).to_numpy(), return_inverse=True)

        metrics: dict[str, MetricResult] = {}
        metrics["tau_b"] = self._tau_metric(look, common, r, c, reference_replicate, codes)
        d = c - r
        metrics["mean_shift"] = self._mean_metric("mean_shift", look, d, codes, n)
        metrics["distribution"] = self._distribution_metric(look, r, c)

        n_lab = 0
        if labels is not None:
            if calibrate is None:
                raise CJEInputError(
                    "labels were given without a calibrate function f(score) -> oracle scale",
                    column="calibrate",
                )
            lab = as_scores(labels, "labels", value_column=LABEL, allow_missing=True)
            y = lab.reindex(common).to_numpy()
            has = ~np.isnan(y)
            n_lab = int(has.sum())
            if n_lab >= self.min_labels:
                fr = _call_calibrate(calibrate, r[has])
                fc = _call_calibrate(calibrate, c[has])
                res_ref, res_cur = y[has] - fr, y[has] - fc
                sub_codes = None
                if codes is not None:
                    _, sub_codes = np.unique(codes[has], return_inverse=True)
                extra = {
                    "mean_residual_reference": float(res_ref.mean()),
                    "mean_residual_current": float(res_cur.mean()),
                }
                metrics["residual_mean"] = self._mean_metric(
                    "residual_mean", look, res_cur - res_ref, sub_codes, n_lab, extra
                )
                extra_loss = {
                    "mse_reference": float(np.mean(res_ref**2)),
                    "mse_current": float(np.mean(res_cur**2)),
                }
                metrics["calibration_loss"] = self._mean_metric(
                    "calibration_loss", look, res_cur**2 - res_ref**2, sub_codes, n_lab, extra_loss
                )
        for name in ("residual_mean", "calibration_loss"):
            if name not in metrics:
                why = (
                    "no labels given"
                    if labels is None
                    else f"only {n_lab} labelled anchors (min_labels={self.min_labels})"
                )
                metrics[name] = self._skipped(name, look, n_lab, why)

        alarms = [m for m in METRICS if metrics[m].alarm]
        self.n_looks_ = look
        for m in alarms:
            if self.first_alarm_[m] is None:
                self.first_alarm_[m] = look
                logger.warning(
                    "judge drift alarm on %s at look %d: estimate %.4g, p=%.3g <= %.3g",
                    m,
                    look,
                    metrics[m].estimate,
                    metrics[m].p_value,
                    metrics[m].alpha_spent,
                )
        meta_d = dict(meta or {})
        self.history_.append(
            _jsonable(
                {
                    "look": look,
                    "alarms": alarms,
                    "estimate": {m: metrics[m].estimate for m in METRICS},
                    "p_value": {m: metrics[m].p_value for m in METRICS},
                    "meta": meta_d,
                }
            )
        )
        return DriftLook(
            look=look,
            n_anchors=n,
            n_missing=int(ref.shape[0] - n),
            n_labelled=n_lab,
            alpha=self.alpha,
            metrics=metrics,
            alarms=alarms,
            first_alarm=dict(self.first_alarm_),
            meta=meta_d,
        )

    # -- metric helpers ------------------------------------------------------------------

    def _ci_metric(
        self,
        name: str,
        look: int,
        estimate: float,
        se: float,
        df: int,
        null_value: float,
        n: int,
        detail: dict[str, Any] | None = None,
        note: str = "",
    ) -> MetricResult:
        a_spent = self.alpha_spent(look, name)
        df = max(int(df), 1)
        q = _t_isf(self.alpha / 2, df)
        q_any = _t_isf(a_spent / 2, df) if a_spent > 0 else float("inf")
        if not np.isfinite(se):
            return MetricResult(name, estimate, se, None, None, null_value, None, a_spent, False, n,
                                note or "standard error undefined", detail or {})
        if se == 0:
            p = 1.0 if estimate == null_value else 0.0
        else:
            p = _t_two_sided_p((estimate - null_value) / se, df)
        ci = (estimate - q * se, estimate + q * se)
        ci_any = (estimate - q_any * se, estimate + q_any * se) if np.isfinite(q_any) else (-np.inf, np.inf)
        alarm = bool(a_spent > 0 and p <= a_spent)
        return MetricResult(name, estimate, se, ci, ci_any, null_value, p, a_spent, alarm, n, note, detail or {})

    def _skipped(self, name: str, look: int, n: int, why: str, detail: dict[str, Any] | None = None) -> MetricResult:
        return MetricResult(name, None, None, None, None, 0.0, None, self.alpha_spent(look, name), False, n, why,
                            detail or {})

    def _mean_metric(
        self,
        name: str,
        look: int,
        d: np.ndarray,
        codes: np.ndarray | None,
        n: int,
        detail: dict[str, Any] | None = None,
    ) -> MetricResult:
        mean, se, df = paired_mean(d, codes)
        return self._ci_metric(name, look, mean, se, df, 0.0, n, detail)

    def _distribution_metric(self, look: int, r: np.ndarray, c: np.ndarray) -> MetricResult:
        a_spent = self.alpha_spent(look, "distribution")
        dc = distribution_change(r, c, max_thresholds=self.max_thresholds)
        return MetricResult(
            "distribution",
            dc.ks,
            None,
            None,
            None,
            0.0,
            dc.p_value,
            a_spent,
            bool(a_spent > 0 and dc.p_value <= a_spent),
            int(r.shape[0]),
            "estimate is the KS distance; exact sign tests, Bonferroni over thresholds",
            {"ks": dc.ks, "tv": dc.tv, "n_thresholds": dc.n_thresholds, "worst_threshold": dc.worst_threshold},
        )

    def _tau_metric(
        self,
        look: int,
        common: pd.Index,
        r: np.ndarray,
        c: np.ndarray,
        replicate: Any,
        codes: np.ndarray | None,
    ) -> MetricResult:
        n = int(r.shape[0])
        loo_rc = None
        try:
            if self.se_method == "jackknife":  # keep the replicates for the difference below
                t_rc, loo_rc = tau_b_leave_one_out(r, c, codes)
                tau = _tau_result(t_rc, _jackknife_se(loo_rc), n, loo_rc.shape[0], "jackknife", self.alpha)
            else:
                tau = kendall_tau_b(r, c, alpha=self.alpha, se_method=self.se_method, clusters=codes)
        except CJEInputError as exc:
            return self._skipped("tau_b", look, n, f"tau-b undefined: {exc.detail}")
        detail: dict[str, Any] = {"tau": tau.tau, "tau_se": tau.se, "tau_ci": list(tau.ci)}
        if replicate is not None:
            rep = as_scores(replicate, "reference_replicate")
            has = np.ones(common.shape[0], dtype=bool) if rep.index.equals(common) else common.isin(rep.index)
            m = int(has.sum())
            if m < self.min_anchors:
                raise CJEInputError(
                    f"only {m} paired anchors have a reference replicate score; at least "
                    f"{self.min_anchors} are needed",
                    source="reference_replicate",
                    column=ANCHOR,
                )
            b = rep.reindex(common[has]).to_numpy()
            a, cc = r[has], c[has]
            sub = None if codes is None else np.unique(codes[has], return_inverse=True)[1]
            try:
                if self.se_method == "jackknife":
                    t_ac, loo_ac = (t_rc, loo_rc) if has.all() else tau_b_leave_one_out(a, cc, sub)
                    t_ab, loo_ab = tau_b_leave_one_out(a, b, sub)
                    se = _jackknife_se(loo_ac - loo_ab)
                    G = loo_ac.shape[0]
                else:
                    t_ac, if_ac = tau_b_influence(a, cc)
                    t_ab, if_ab = tau_b_influence(a, b)
                    diff = if_ac - if_ab
                    if sub is not None:
                        G = int(sub.max()) + 1
                        diff = np.bincount(sub, weights=diff, minlength=G)
                        se = float(math.sqrt(G / max(G - 1, 1) * np.sum(diff**2)) / m)
                    else:
                        G = m
                        se = float(math.sqrt(np.sum(diff**2)) / m)
            except CJEInputError as exc:
                return self._skipped("tau_b", look, n, f"tau-b undefined: {exc.detail}", detail)
            detail.update({"tau_baseline": t_ab, "comparison": "reference_replicate", "n_replicate": m})
            return self._ci_metric(
                "tau_b", look, t_ac - t_ab, se, G - 1, 0.0, m, detail,
                "estimate is tau(reference, current) - tau(reference, replicate)",
            )
        if self.tau_floor is not None:
            detail["comparison"] = "tau_floor"
            return self._ci_metric(
                "tau_b", look, tau.tau, tau.se, tau.n_clusters - 1, self.tau_floor, n, detail,
                f"estimate is tau(reference, current), tested against tau_floor={self.tau_floor}",
            )
        detail["comparison"] = "none"
        res = self._skipped(
            "tau_b", look, n,
            "no reference_replicate and no tau_floor: tau-b is reported but cannot alarm "
            "(its no-drift value is the judge's unknown test-retest agreement)",
            detail,
        )
        return MetricResult(
            "tau_b", tau.tau, tau.se, tau.ci, None, float("nan"), None, res.alpha_spent, False, n, res.note, detail
        )
