"""Judge-drift monitoring on a fixed anchor set: the `DriftMonitor`.

An anchor set is a fixed list of (prompt, response) pairs, some with oracle labels. The judge
re-scores the anchors every period (a *look*). Each look is compared with reference scores of the
same anchors (paired by ``anchor_id``):

- ``tau_b``: rank agreement, the Kendall tau-b of the recent looks with the reference judge's
  scorings against the agreement within them (`cje_engine.drift.metrics.rank_change`), one-sided;
- ``mean_shift``: the paired mean shift of the scores;
- ``distribution``: the change of the score distribution (KS / TV distance), exact sign tests;
- ``residual_mean`` / ``calibration_loss`` (labelled anchors): the change of the mean
  calibration residual ``oracle - f(score)`` and of the calibration loss.

Every test is valid with clusters (a prompt's anchors sharing the judge's noise) when the
clusters are given. Every look spends a share ``alpha * w_metric * g(look)`` of the error budget
(sum over metrics and looks <= ``alpha``), so the family-wise false-alarm rate over all metrics
and all looks is at most ``alpha`` (union bound). See ``docs/drift.md``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from cje_engine.drift.inputs import (
    ANCHOR, LABEL, as_clusters, as_scores, call_calibrate, check_alpha, jsonable, t_lower_p,
)
from cje_engine.drift.kendall import jackknife_se, kendall_tau_b, tau_b_leave_one_out, tau_result
from cje_engine.drift.metrics import (
    DriftLook, MetricResult, cluster_sums, distribution_change, paired_mean, rank_change,
)
from cje_engine.drift.monitor_state import check_state, state_dict
from cje_engine.drift.signflip import sign_flip_interval, sign_flip_p
from cje_engine.errors import CJEInputError
from cje_engine.inference.reference_t import t_isf

__all__ = ["METRICS", "DEFAULT_WEIGHTS", "WINDOW_SHARE", "DriftMonitor", "look_spending"]

logger = logging.getLogger(__name__)

#: Alarm metrics, in the order they are reported.
METRICS: tuple[str, ...] = ("tau_b", "mean_shift", "distribution", "residual_mean", "calibration_loss")

#: Default share of ``alpha`` per metric (fixed in advance; unused shares are not moved). The
#: rank metric gets the largest share: it is the only one that sees a reordering that leaves
#: the score distribution unchanged, and it needs the most evidence (docs/drift.md).
DEFAULT_WEIGHTS: dict[str, float] = {
    "tau_b": 0.3, "mean_shift": 0.175, "distribution": 0.175, "residual_mean": 0.175, "calibration_loss": 0.175,
}

#: Share of the rank metric's budget spent on the full window of looks (the rest: the current look).
WINDOW_SHARE = 0.75

NO_CLUSTERS_WARNING = (
    "no clusters given: every test assumes the judge's noise is independent across anchors; if anchors "
    "share prompts, pass their prompt as clusters or the false-alarm guarantee does not hold"
)


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


def _check_options(alpha: float, horizon: Any, w: dict[str, float], se_method: str, min_anchors: int,
                   min_labels: int, tau_floor: float | None, max_thresholds: int, rank_window: int) -> None:
    check_alpha(alpha)
    if horizon is not None and (not isinstance(horizon, (int, np.integer)) or horizon < 1):
        raise CJEInputError(f"horizon must be a positive integer or None, got {horizon!r}")
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
    if int(rank_window) < 1:
        raise CJEInputError(f"rank_window must be >= 1, got {rank_window}")


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
        `DEFAULT_WEIGHTS`. A metric that cannot be computed at a look (no labels, no baseline)
        keeps its share unused, so the guarantee never depends on the data.
    min_anchors : int
        Fewest paired anchors accepted in a look (default 20).
    min_labels : int
        Fewest labelled paired anchors for the residual metrics (default 10).
    tau_floor : float, optional
        Used only when the rank metric has no baseline (one reference scoring and
        ``rank_window=1``): tau-b alarms when it is credibly *below* this floor (one-sided).
    se_method : {"jackknife", "influence"}
        SE of the reported tau-b (reference vs current) and of the floor test.
    max_thresholds : int
        Most thresholds in the distribution test.
    rank_window : int
        Looks (the current one included) compared with the reference scorings by the rank
        metric (default 3): a persistent reordering accumulates evidence over the window.

    Attributes
    ----------
    n_looks_ : int
        Looks taken so far.
    first_alarm_ : dict of str to int or None
        Look at which each metric first alarmed.
    history_ : list of dict
        Compact per-look summary (look, alarms, estimates, p-values, meta).
    recent_ : list of dict
        Scores by anchor id of the last ``rank_window - 1`` looks (for the rank metric).
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
        rank_window: int = 3,
    ) -> None:
        w = dict(DEFAULT_WEIGHTS if weights is None else weights)
        _check_options(alpha, horizon, w, se_method, min_anchors, min_labels, tau_floor, max_thresholds,
                       rank_window)
        self.alpha = float(alpha)
        self.horizon = None if horizon is None else int(horizon)
        self.weights = {m: float(w.get(m, 0.0)) for m in METRICS}
        self.min_anchors = int(min_anchors)
        self.min_labels = int(min_labels)
        self.tau_floor = None if tau_floor is None else float(tau_floor)
        self.se_method = se_method
        self.max_thresholds = int(max_thresholds)
        self.rank_window = int(rank_window)
        self.n_looks_ = 0
        self.first_alarm_: dict[str, int | None] = {m: None for m in METRICS}
        self.history_: list[dict[str, Any]] = []
        self.recent_: list[dict[str, float]] = []

    # -- state ---------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """The monitor's settings as a plain dict (what the state stores and a new monitor accepts)."""
        return {
            "alpha": self.alpha,
            "horizon": self.horizon,
            "weights": dict(self.weights),
            "min_anchors": self.min_anchors,
            "min_labels": self.min_labels,
            "tau_floor": self.tau_floor,
            "se_method": self.se_method,
            "max_thresholds": self.max_thresholds,
            "rank_window": self.rank_window,
        }

    def to_dict(self) -> dict[str, Any]:
        """Configuration and state as plain JSON data (persist between scheduled runs)."""
        return state_dict(self.get_config(), self.n_looks_, self.first_alarm_, self.history_, self.recent_)

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], *, source: str = "<monitor state>") -> "DriftMonitor":
        """Rebuild a monitor saved with `to_dict` (also reads version-1 states)."""
        cfg, n_looks, first, history, recent = check_state(state, METRICS, source)
        try:
            mon = cls(**cfg)
        except TypeError as exc:
            raise CJEInputError(f"bad monitor config: {exc}", source=source, column="config") from None
        mon.n_looks_, mon.first_alarm_, mon.history_, mon.recent_ = n_looks, first, history, recent
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
        reference_replicate: Any = None,
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
        reference_replicate : scores, or a list of scores, optional
            Further independent scorings of the anchors by the reference judge: the rank
            metric's baseline (several give a more precise one).
        clusters : Series by anchor_id or mapping, optional
            Cluster (prompt) of each anchor. Required for the guarantee when anchors share a
            prompt; without it the look carries a warning.
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
        codes = None if clusters is None else as_clusters(clusters, common)
        replicates = self._replicates(reference_replicate, common)
        warnings = [] if codes is not None else [NO_CLUSTERS_WARNING]

        metrics: dict[str, MetricResult] = {}
        metrics["tau_b"] = self._tau_metric(look, common, r, c, replicates, codes)
        metrics["mean_shift"] = self._mean_metric("mean_shift", look, c - r, codes, n)
        metrics["distribution"] = self._distribution_metric(look, r, c, codes)
        n_lab = self._label_metrics(metrics, look, common, r, c, labels, calibrate, codes)
        return self._record(look, metrics, n, int(ref.shape[0] - n), n_lab, codes, warnings, meta, cur)

    def _record(self, look: int, metrics: dict[str, MetricResult], n: int, n_missing: int, n_lab: int,
                codes: np.ndarray | None, warnings: list[str], meta: Mapping[str, Any] | None,
                cur: pd.Series) -> DriftLook:
        alarms = [m for m in METRICS if metrics[m].alarm]
        self.n_looks_ = look
        for m in alarms:
            if self.first_alarm_[m] is None:
                self.first_alarm_[m] = look
                logger.warning("judge drift alarm on %s at look %d: estimate %.4g, p=%.3g <= %.3g", m, look,
                               metrics[m].estimate, metrics[m].p_value, metrics[m].alpha_spent)
        if self.rank_window > 1:
            stored = dict(zip(map(str, cur.index.tolist()), cur.to_numpy(dtype=float).tolist()))
            self.recent_ = (self.recent_ + [stored])[-(self.rank_window - 1):]
        meta_d = dict(meta or {})
        self.history_.append(jsonable({
            "look": look, "alarms": alarms, "estimate": {m: metrics[m].estimate for m in METRICS},
            "p_value": {m: metrics[m].p_value for m in METRICS}, "meta": meta_d,
        }))
        return DriftLook(look=look, n_anchors=n, n_missing=n_missing, n_labelled=n_lab, alpha=self.alpha,
                         metrics=metrics, alarms=alarms, first_alarm=dict(self.first_alarm_), meta=meta_d,
                         n_clusters=None if codes is None else int(codes.max()) + 1, warnings=warnings)

    def _replicates(self, replicate: Any, common: pd.Index) -> list[np.ndarray]:
        if replicate is None:
            return []
        items = list(replicate) if isinstance(replicate, (list, tuple)) else [replicate]
        out = []
        for k, item in enumerate(items):
            what = "reference_replicate" if len(items) == 1 else f"reference_replicate[{k}]"
            rep = as_scores(item, what)  # its index is unique (as_scores checks)
            missing = rep.index.get_indexer(common) < 0  # a hash lookup (isin on Arrow strings is slow)
            if missing.any():
                raise CJEInputError(
                    f"{int(missing.sum())} paired anchors have no replicate score (first: "
                    f"{common[np.flatnonzero(missing)[0]]!r}); the replicate must cover every anchor of the look",
                    source=what, column=ANCHOR,
                )
            out.append(rep.reindex(common).to_numpy())
        return out

    def _label_metrics(self, metrics: dict[str, MetricResult], look: int, common: pd.Index, r: np.ndarray,
                       c: np.ndarray, labels: Any, calibrate: Any, codes: np.ndarray | None) -> int:
        n_lab = 0
        if labels is not None:
            if calibrate is None:
                raise CJEInputError("labels were given without a calibrate function f(score) -> oracle scale",
                                    column="calibrate")
            lab = as_scores(labels, "labels", value_column=LABEL, allow_missing=True)
            y = lab.reindex(common).to_numpy()
            has = ~np.isnan(y)
            n_lab = int(has.sum())
            if n_lab >= self.min_labels:
                fr = call_calibrate(calibrate, r[has])
                fc = call_calibrate(calibrate, c[has])
                res_ref, res_cur = y[has] - fr, y[has] - fc
                sub = None if codes is None else np.unique(codes[has], return_inverse=True)[1]
                extra = {"mean_residual_reference": float(res_ref.mean()),
                         "mean_residual_current": float(res_cur.mean())}
                metrics["residual_mean"] = self._mean_metric("residual_mean", look, res_cur - res_ref, sub, n_lab,
                                                             extra)
                extra_loss = {"mse_reference": float(np.mean(res_ref**2)), "mse_current": float(np.mean(res_cur**2))}
                metrics["calibration_loss"] = self._mean_metric(
                    "calibration_loss", look, res_cur**2 - res_ref**2, sub, n_lab, extra_loss)
        for name in ("residual_mean", "calibration_loss"):
            if name not in metrics:
                why = ("no labels given" if labels is None
                       else f"only {n_lab} labelled anchors (min_labels={self.min_labels})")
                metrics[name] = self._skipped(name, look, n_lab, why)
        return n_lab

    # -- metric helpers ------------------------------------------------------------------

    def _skipped(self, name: str, look: int, n: int, why: str, detail: dict[str, Any] | None = None) -> MetricResult:
        return MetricResult(name, None, None, None, None, 0.0, None, self.alpha_spent(look, name), False, n, why,
                            detail or {})

    def _mean_metric(self, name: str, look: int, d: np.ndarray, codes: np.ndarray | None, n: int,
                     detail: dict[str, Any] | None = None) -> MetricResult:
        """Paired mean: exact sign-flip test over clusters; t interval for this look alone."""
        a_spent = self.alpha_spent(look, name)
        mean, se, df = paired_mean(d, codes)
        p, method = sign_flip_p(cluster_sums(d, codes))
        q = t_isf(self.alpha / 2, max(int(df), 1))
        ci = (mean - q * se, mean + q * se) if np.isfinite(se) else None
        ci_any = sign_flip_interval(d, codes, a_spent) if a_spent > 0 else (-np.inf, np.inf)
        alarm = bool(a_spent > 0 and p <= a_spent)
        return MetricResult(name, mean, se, ci, ci_any, 0.0, p, a_spent, alarm, n,
                            "sign-flip test over " + ("anchors" if codes is None else "clusters"), detail or {},
                            "two-sided", "sign_flip_" + method)

    def _distribution_metric(self, look: int, r: np.ndarray, c: np.ndarray, codes: np.ndarray | None) -> MetricResult:
        a_spent = self.alpha_spent(look, "distribution")
        dc = distribution_change(r, c, max_thresholds=self.max_thresholds, clusters=codes)
        return MetricResult(
            "distribution", dc.ks, None, None, None, 0.0, dc.p_value, a_spent,
            bool(a_spent > 0 and dc.p_value <= a_spent), int(r.shape[0]),
            "estimate is the KS distance; exact sign(-flip) tests, Bonferroni over thresholds",
            {"ks": dc.ks, "tv": dc.tv, "n_thresholds": dc.n_thresholds, "worst_threshold": dc.worst_threshold},
            "two-sided", dc.method,
        )

    def _window(self, common: pd.Index) -> list[np.ndarray]:
        """Scores of the stored recent looks on the paired anchors (looks missing one are dropped)."""
        ids = common.tolist()
        out = []
        for past in self.recent_:
            vals = self._same_anchors(past, ids)
            if vals is not None:
                if not np.isnan(vals).any():
                    out.append(vals)
                continue
            series = pd.Series(past, dtype=float).reindex(common)
            if not series.isna().any():
                out.append(series.to_numpy())
        return out

    @staticmethod
    def _same_anchors(past: Mapping[str, Any], ids: list[str]) -> np.ndarray | None:
        """A stored look's scores as floats when it holds exactly ``ids`` in order (the usual case), else None."""
        if list(past) != ids:
            return None
        try:
            return np.fromiter((float(v) for v in past.values()), dtype=float, count=len(ids))
        except (TypeError, ValueError):
            return None

    def _tau_metric(self, look: int, common: pd.Index, r: np.ndarray, c: np.ndarray,
                    replicates: list[np.ndarray], codes: np.ndarray | None) -> MetricResult:
        n = int(r.shape[0])
        try:
            if self.se_method == "jackknife":
                t_rc, loo_rc = tau_b_leave_one_out(r, c, codes)
                tau = tau_result(t_rc, jackknife_se(loo_rc), n, loo_rc.shape[0], "jackknife", self.alpha)
            else:
                tau = kendall_tau_b(r, c, alpha=self.alpha, se_method=self.se_method, clusters=codes)
        except CJEInputError as exc:
            return self._skipped("tau_b", look, n, f"tau-b undefined: {exc.detail}")
        detail: dict[str, Any] = {"tau": tau.tau, "tau_se": tau.se, "tau_ci": list(tau.ci)}
        refs = [r] + replicates
        past = self._window(common)
        # windows: the full one (a persistent reordering accumulates evidence over its looks) and
        # the current look alone (a step change at its first look); weighted Bonferroni over the
        # windows that have a baseline: WINDOW_SHARE of the budget to the full window
        windows = sorted({w for w in (1, len(past) + 1) if len(refs) + w >= 3}, reverse=True)
        if windows:
            try:
                fits = [(w, rank_change(refs, past[len(past) - w + 1:] + [c], codes)) for w in windows]
            except CJEInputError as exc:
                return self._skipped("tau_b", look, n, f"tau-b undefined: {exc.detail}", detail)
            shares = [1.0] if len(fits) == 1 else [WINDOW_SHARE, 1.0 - WINDOW_SHARE]
            k = int(np.argmin([f.p_value / sh for (_, f), sh in zip(fits, shares)]))
            (w, rc), share = fits[k], shares[k]
            detail.update({"tau_baseline": rc.tau_within_reference, "tau_between": rc.tau_between,
                           "tau_within": rc.tau_within, "comparison": "rank_change",
                           "n_reference_scorings": len(refs), "window": w,
                           "p_by_window": {str(wf): f.p_value for wf, f in fits}})
            return self._one_sided(look, rc.estimate, rc.se, rc.df, 0.0, min(1.0, rc.p_value / share), n, detail,
                                   rc.method, "estimate is mean tau(reference scorings, recent looks) - mean tau "
                                   f"within them, over the last {w} look(s); weighted Bonferroni over "
                                   f"{len(fits)} window(s)", share=share)
        if self.tau_floor is not None:
            detail["comparison"] = "tau_floor"
            df = tau.n_clusters - 1
            if not (np.isfinite(tau.se) and tau.se > 0):
                return self._skipped("tau_b", look, n, "tau_floor test impossible: the SE of tau-b is 0", detail)
            p = t_lower_p((tau.tau - self.tau_floor) / tau.se, max(df, 1))
            return self._one_sided(look, tau.tau, tau.se, df, self.tau_floor, p, n, detail, "jackknife_t",
                                   f"estimate is tau(reference, current), tested one-sided below "
                                   f"tau_floor={self.tau_floor}")
        detail["comparison"] = "none"
        note = ("no reference_replicate, no earlier look in the window and no tau_floor: tau-b is reported but "
                "cannot alarm (its no-drift value is the judge's unknown test-retest agreement)")
        return MetricResult("tau_b", tau.tau, tau.se, tau.ci, None, float("nan"), None, self.alpha_spent(look, "tau_b"),
                            False, n, note, detail, "less", "")

    def _one_sided(self, look: int, est: float, se: float, df: int, null: float, p: float, n: int,
                   detail: dict[str, Any], method: str, note: str, share: float = 1.0) -> MetricResult:
        """A lower-tail test: alarm when ``est`` is credibly below ``null`` (``p`` already divided by
        the ``share`` of the budget its test gets; the upper bound is at level ``share * alpha_spent``)."""
        a_spent = self.alpha_spent(look, "tau_b")
        df = max(int(df), 1)
        ok = bool(np.isfinite(se))
        ci = (est - t_isf(self.alpha / 2, df) * se, est + t_isf(self.alpha / 2, df) * se) if ok else None
        upper = est + t_isf(a_spent * share, df) * se if ok and a_spent > 0 else np.inf
        alarm = bool(a_spent > 0 and p <= a_spent)
        return MetricResult("tau_b", est, se, ci, (-np.inf, upper), null, p, a_spent, alarm, n, note, detail,
                            "less", method)

