"""Changes of policy values across evaluation windows, with error rates valid under repeated looks.

A recurring evaluation publishes one estimate per policy and window. This module answers, per
policy and window, "did the value change since the previous window?" (consecutive change) and
"is it different from the pinned baseline window?" (baseline change), with an interval and a test
whose family-wise false-alarm rate over *all* windows stays below ``alpha``.

Assumptions (stated in ``docs/monitoring.md``)
----------------------------------------------
* **Independent windows.** Each window's estimate comes from its own sample of prompts, so the
  standard error of a difference of two windows combines the two windows' standard errors:
  ``SE(v_t - v_s) = sqrt(SE_t^2 + SE_s^2)``. If windows share oracle labels (one calibration
  reused by several windows) the two estimates are positively correlated and this SE is
  conservative for the difference of the calibrated parts.
* **Normal estimates.** Each window's estimate is approximately normal with the published SE
  (bootstrap or influence-function SE of the engine).

Error control: alpha spending with a union bound
------------------------------------------------
Window ``t`` (t = 1 for the first window after the baseline) spends ``alpha * g(t)`` with
``g(t) = 1 / (t (t + 1))`` (unbounded; sums to 1) or ``g(t) = 1 / H`` for a stated horizon ``H``
(`cje_engine.drift.monitor.look_spending`, the same rule the judge-drift monitor uses). The budget of
a window is split equally between its tests: consecutive, baseline, and pooled (the mean of the last k
windows against the baseline, k in 2, 4, 8 as far as there are k windows after the baseline). A test that cannot run (a refused level, a missing
SE) leaves its budget unused, so the guarantee never depends on the data. By the union bound,
P(any false alarm at any window) <= alpha for each policy, whatever the dependence between the
tests (the baseline comparisons all share the baseline window's estimate, which is why a
confidence sequence over the stream of differences would not be valid; see the docs).

Everything here is pure: numbers in, dataclasses out.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any, Mapping, Sequence

from cje_engine.drift.monitor import look_spending
from cje_engine.errors import CJEInputError

__all__ = ["WindowValue", "Change", "PolicyChanges", "window_changes", "changes_by_policy",
           "series_from_results"]

_N = NormalDist()
STATUSES = ("regression", "improvement", "undecided", "stable", "not_estimable")


@dataclass(frozen=True)
class WindowValue:
    """One policy's published value in one window.

    Attributes
    ----------
    window : str
        Window label (time order is the order of the sequence given to `window_changes`).
    estimate, se : float or None
        The level estimate and its standard error (None when not published).
    estimable : bool
        False when the level was refused (the estimate is then a ranking-only number and is
        never compared across windows).
    reason : str or None
        Why the value is not estimable.
    n_labelled : int or None
        Own oracle labels of the policy in the window (for the labels-needed estimate).
    """

    window: str
    estimate: float | None
    se: float | None
    estimable: bool = True
    reason: str | None = None
    n_labelled: int | None = None

    @property
    def usable(self) -> bool:
        """Whether the window has a finite estimate and SE that a change test can use."""
        return (self.estimable and self.estimate is not None and self.se is not None
                and math.isfinite(self.estimate) and math.isfinite(self.se) and self.se >= 0)


@dataclass(frozen=True)
class Change:
    """One test: the change of a policy's value from window ``ref`` to window ``window``.

    ``diff``, ``se``, ``ci`` (fixed-sample ``1 - alpha``), ``ci_anytime`` (at the spent level),
    ``p_value`` (two-sided, normal) are None when ``status == "not_estimable"``; ``reason`` says why.
    ``labels_needed`` estimates the extra own labels in ``window`` that would make an undecided
    drop decidable (None when labels in this window cannot decide it).
    """

    kind: str  # "consecutive" | "baseline" | "pooled"
    window: str
    ref: str
    look: int
    alpha_spent: float
    n_windows: int = 1  # windows averaged on the current side (pooled tests: the last n_windows)
    diff: float | None = None
    se: float | None = None
    ci: tuple[float, float] | None = None
    ci_anytime: tuple[float, float] | None = None
    p_value: float | None = None
    significant: bool = False
    status: str = "not_estimable"
    reason: str | None = None
    labels_needed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict form (intervals as lists)."""
        d = asdict(self)
        for k in ("ci", "ci_anytime"):
            d[k] = list(d[k]) if d[k] is not None else None
        return d


@dataclass
class PolicyChanges:
    """All changes of one policy: one entry per window after the first (None where no test ran)."""

    policy: str
    baseline: str | None
    windows: list[str]
    consecutive: list[Change | None] = field(default_factory=list)
    against_baseline: list[Change | None] = field(default_factory=list)
    pooled: list[list[Change]] = field(default_factory=list)

    def tests_at(self, i: int) -> list[Change]:
        """Every test run at window index ``i``."""
        return [c for c in (self.consecutive[i], self.against_baseline[i]) if c is not None] + list(self.pooled[i])

    @property
    def alarms(self) -> list[str]:
        """Windows with a regression alarm (a significant drop in any test), in time order."""
        return [w for i, w in enumerate(self.windows) if any(c.status == "regression" for c in self.tests_at(i))]

    @property
    def first_alarm(self) -> str | None:
        """The first alarm of the policy, or None."""
        alarms = self.alarms
        return alarms[0] if alarms else None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict form of every test of the policy and its alarms."""
        return {"policy": self.policy, "baseline": self.baseline, "windows": list(self.windows),
                "consecutive": [c.to_dict() if c else None for c in self.consecutive],
                "baseline_changes": [c.to_dict() if c else None for c in self.against_baseline],
                "pooled_changes": [[c.to_dict() for c in cs] for cs in self.pooled],
                "alarms": self.alarms, "first_alarm": self.first_alarm}


def _check(alpha: float, decision_margin: float, horizon: int | None) -> None:
    if not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
        raise CJEInputError(f"alpha must be in (0, 1), got {alpha!r}", column="alpha")
    if not (isinstance(decision_margin, (int, float)) and decision_margin >= 0):
        raise CJEInputError(f"decision_margin must be >= 0, got {decision_margin!r}", column="decision_margin")
    if horizon is not None and (not isinstance(horizon, int) or horizon < 1):
        raise CJEInputError(f"horizon must be a positive integer or None, got {horizon!r}", column="horizon")


def _labels_needed(diff: float, cur: WindowValue, other_se: float, z: float) -> int | None:
    """Extra own labels in the current window that would make |diff| reach the critical value.

    Assumes the current window's variance scales like 1 / (own labels) (conservative: the
    prompt-sampling part of the variance does not shrink with labels, so more may be needed).
    None when the other window's SE alone already exceeds the needed SE.
    """
    if cur.n_labelled is None or cur.n_labelled <= 0 or cur.se is None or cur.se <= 0:
        return None
    need_total = abs(diff) / z
    need_cur_sq = need_total ** 2 - other_se ** 2
    if need_cur_sq <= 0:
        return None
    factor = cur.se ** 2 / need_cur_sq
    return max(0, math.ceil(cur.n_labelled * (factor - 1)))


def _test(kind: str, cur: WindowValue, ref: WindowValue, look: int, alpha: float, spent: float,
          decision_margin: float) -> Change:
    base = dict(kind=kind, window=cur.window, ref=ref.window, look=look, alpha_spent=spent)
    for v, what in ((cur, "this window"), (ref, "the reference window")):
        if not v.usable:
            why = v.reason or ("level refused" if not v.estimable else "no estimate or SE")
            return Change(**base, reason=f"{what} ({v.window}): {why}")
    diff = float(cur.estimate) - float(ref.estimate)
    se = math.sqrt(float(cur.se) ** 2 + float(ref.se) ** 2)
    z_fixed = _N.inv_cdf(1 - alpha / 2)
    z_any = _N.inv_cdf(1 - spent / 2)
    if se == 0:
        p = 0.0 if diff != 0 else 1.0
    else:
        p = 2 * (1 - _N.cdf(abs(diff) / se))
    significant = p <= spent and diff != 0
    if significant:
        status = "regression" if diff < 0 else "improvement"
    elif diff <= -decision_margin and decision_margin > 0:
        status = "undecided"
    else:
        status = "stable"
    needed = _labels_needed(diff, cur, float(ref.se), z_any) if status == "undecided" else None
    return Change(**base, diff=diff, se=se, ci=(diff - z_fixed * se, diff + z_fixed * se),
                  ci_anytime=(diff - z_any * se, diff + z_any * se), p_value=p, significant=significant,
                  status=status, labels_needed=needed)


def _baseline_value(period: Sequence[WindowValue]) -> WindowValue:
    """The mean of a baseline period (independent windows); not usable if any window of it is not."""
    label = f"{period[0].window}..{period[-1].window}"
    bad = next((v for v in period if not v.usable), None)
    if bad is not None:
        return WindowValue(label, None, None, False, f"baseline window {bad.window}: {bad.reason or 'not usable'}")
    k = len(period)
    return WindowValue(label, sum(float(v.estimate) for v in period) / k,
                       math.sqrt(sum(float(v.se) ** 2 for v in period)) / k)


def _pooled(values: Sequence[WindowValue], i: int, k: int, base: WindowValue, look: int, alpha: float,
            spent: float) -> Change:
    """Mean of the last ``k`` windows (``i-k+1 .. i``) against the baseline: a sustained shift."""
    pool = list(values[i - k + 1:i + 1])
    bad = next((v for v in pool if not v.usable), None)
    if bad is not None:
        why = bad.reason or ("level refused" if not bad.estimable else "no estimate or SE")
        return Change("pooled", values[i].window, base.window, look, spent, n_windows=k,
                      reason=f"window {bad.window} of the pool: {why}")
    mean = sum(float(v.estimate) for v in pool) / k
    se = math.sqrt(sum(float(v.se) ** 2 for v in pool)) / k  # independent windows
    merged = WindowValue(values[i].window, mean, se)
    c = _test("pooled", merged, base, look, alpha, spent, 0.0)
    return Change(**{**asdict(c), "n_windows": k})


def window_changes(
    values: Sequence[WindowValue],
    *,
    policy: str = "",
    alpha: float = 0.05,
    baseline: str | None = None,
    horizon: int | None = None,
    decision_margin: float = 0.02,
    pools: Sequence[int] = (2, 4, 8),
    baseline_windows: int = 1,
) -> PolicyChanges:
    """Consecutive, baseline and pooled changes of one policy over windows in time order.

    Parameters
    ----------
    values : sequence of WindowValue
        The policy's value in each window, oldest first (window labels must be distinct).
    policy : str
        Name carried into the result.
    alpha : float
        Family-wise false-alarm rate over all windows and both tests, for this policy.
    baseline : str, optional
        The pinned baseline window; default: the first window with a usable value. Windows before
        the baseline are not tested.
    horizon : int, optional
        Number of windows after the baseline the budget is spread over evenly; default None
        (unbounded spending ``1/(t(t+1))``). Windows past the horizon are not tested.
    decision_margin : float
        A non-significant drop at least this large is "undecided" (more labels could decide it).
    pools : sequence of int
        Pooled tests: the mean of the last k windows against the baseline, for each k >= 2 with k windows
        after the baseline (a sustained shift is detected with the SE of k windows, not of one).

    Returns
    -------
    PolicyChanges
        ``consecutive[i]``, ``against_baseline[i]`` and ``pooled[i]`` test window ``i`` (None / empty for
        untested windows). The budget of window i is split equally over its tests; their number depends only
        on i, never on the data.
    baseline_windows : int
        The baseline is the mean of this many windows from the baseline window on (a baseline period: its SE
        shrinks like 1/sqrt(m), which is what limits the detection of small changes); testing starts after it.
    """
    _check(alpha, decision_margin, horizon)
    windows = [v.window for v in values]
    if len(set(windows)) != len(windows):
        raise CJEInputError(f"window labels must be distinct, got {windows}", column="window")
    if baseline is None:
        b_idx = next((i for i, v in enumerate(values) if v.usable), None)
    else:
        if baseline not in windows:
            raise CJEInputError(f"baseline window {baseline!r} is not one of {windows}", column="baseline")
        b_idx = windows.index(baseline)
    out = PolicyChanges(policy=policy, baseline=windows[b_idx] if b_idx is not None else None,
                        windows=windows, consecutive=[None] * len(values),
                        against_baseline=[None] * len(values), pooled=[[] for _ in values])
    if b_idx is None:
        return out
    m = int(baseline_windows)
    if m < 1:
        raise CJEInputError(f"baseline_windows must be >= 1, got {baseline_windows!r}", column="baseline_windows")
    base = _baseline_value(values[b_idx:b_idx + m]) if m > 1 else values[b_idx]
    for i in range(b_idx + m, len(values)):
        look = i - (b_idx + m - 1)
        if horizon is not None and look > horizon:
            break
        ks = sorted({int(k) for k in pools if 2 <= int(k) <= look})
        spent = alpha * look_spending(look, horizon) / (2 + len(ks))  # equal shares of the window's budget
        out.consecutive[i] = _test("consecutive", values[i], values[i - 1], look, alpha, spent,
                                   decision_margin)
        out.against_baseline[i] = _test("baseline", values[i], base, look, alpha, spent, decision_margin)
        out.pooled[i] = [_pooled(values, i, k, base, look, alpha, spent) for k in ks]
    return out


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(float(x)) else None


def series_from_results(results: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, list[WindowValue]]:
    """Per-policy `WindowValue` series from ``(window, result dict)`` pairs in time order.

    A policy absent from a window's result gets a not-estimable value ("not evaluated").
    """
    names: list[str] = []
    for _, res in results:
        for name in (res.get("policies") or {}):
            if name not in names:
                names.append(name)
    out: dict[str, list[WindowValue]] = {n: [] for n in names}
    for window, res in results:
        pols = res.get("policies") or {}
        for n in names:
            p = pols.get(n)
            if not isinstance(p, Mapping):
                out[n].append(WindowValue(window, None, None, False, "not evaluated in this window"))
                continue
            refused = p.get("level_claim") == "refused"
            reasons = "; ".join(str(r) for r in p.get("refusal_reasons") or []) or "level refused"
            n_lab = p.get("n_labelled")
            out[n].append(WindowValue(window, _num(p.get("estimate")), _num(p.get("se")), not refused,
                                      reasons if refused else None,
                                      int(n_lab) if isinstance(n_lab, (int, float)) and not isinstance(n_lab, bool)
                                      else None))
    return out


def changes_by_policy(
    results: Sequence[tuple[str, Mapping[str, Any]]],
    *,
    alpha: float = 0.05,
    baseline: str | None = None,
    horizon: int | None = None,
    decision_margin: float = 0.02,
    pools: Sequence[int] = (2, 4, 8),
    baseline_windows: int = 1,
) -> dict[str, PolicyChanges]:
    """`window_changes` for every policy of a sequence of ``(window, result dict)`` in time order."""
    return {name: window_changes(vals, policy=name, alpha=alpha, baseline=baseline, horizon=horizon,
                                 decision_margin=decision_margin, pools=pools, baseline_windows=baseline_windows)
            for name, vals in series_from_results(results).items()}
