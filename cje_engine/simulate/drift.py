"""Simulated judge-drift scenarios for checking `cje_engine.drift.monitor.DriftMonitor`.

World: each anchor has a latent quality ``q`` and a nuisance trait ``v`` (e.g. verbosity), both
standard normal. The oracle label is ``Phi((q + 0.3 e) / sqrt(1.09))`` in [0, 1]. A judge scores
``latent = wq * q + wv * v + noise_sd * eps``, maps it to [0, 1] by ``Phi(latent / sd)``, adds
``shift`` (clipped to [0, 1]) and rounds to ``levels`` equally spaced values (11 by default:
0, 0.1, ..., 1), so ties are the norm. Fresh noise ``eps`` at every scoring.

Scenarios (the drifted judge takes over at look ``change_at``):

- ``none``: the reference judge re-scores every look (fresh noise only).
- ``shift``: scores move up uniformly by ``effect`` on the 0-1 scale (default 0.1, one level).
- ``reorder``: on a random share ``effect`` of the anchors (default 0.5) the judge scores each
  anchor as if it were another anchor of that subset (a cyclic relabelling, no fixed points):
  the ranking changes, the score distribution does not.
- ``remap``: the judge's weights rotate by ``effect`` degrees (default 45) from quality towards
  the nuisance trait at the same total variance: the marginal score distribution is unchanged,
  the relation between scores and oracle labels shifts.
- ``length``: a reorder by a covariate: the judge adds ``effect`` (default 0.1, one level) to
  "long" responses (nuisance trait > 0) and subtracts it from "short" ones; mean unchanged.
- ``compress``: scores shrink towards 0.5 by the factor ``1 - effect`` (default 0.5).
- ``slow``: the shift grows by ``effect`` per look from ``change_at`` (default 0.005 per look).

Anchors can share prompts (``anchors_per_prompt``): quality then has a prompt component and the
judge's noise a prompt-shared share ``shared_noise`` (the same draw for every anchor of a prompt
in one scoring), the case where the anchors are not independent and the clusters matter.

The calibration function ``f`` is an isotonic regression of oracle on reference-judge scores fitted
on an independent calibration sample (never on the anchors themselves).

``benchmarks/bench_drift.py`` runs the studies below for the figures in docs/drift.md.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
from scipy import optimize, special

from cje_engine.drift.monitor import METRICS, DriftMonitor
from cje_engine.errors import CJEInputError

logger = logging.getLogger(__name__)

SCENARIOS: tuple[str, ...] = ("none", "shift", "reorder", "remap", "length", "compress", "slow")
#: Stated effect sizes of the detection figures in docs/drift.md.
DEFAULT_EFFECT: dict[str, float] = {"none": 0.0, "shift": 0.1, "reorder": 0.5, "remap": 45.0, "length": 0.1,
                                    "compress": 0.5, "slow": 0.005}


def _phi(z: np.ndarray) -> np.ndarray:
    return 0.5 * special.erfc(-z / math.sqrt(2.0))


@dataclass(frozen=True)
class AnchorSet:
    """Fixed anchors: latent traits, oracle values and which anchors carry a label."""

    anchor_ids: pd.Index
    quality: np.ndarray
    nuisance: np.ndarray
    oracle: np.ndarray
    labelled: np.ndarray
    prompts: np.ndarray | None = None

    @property
    def n(self) -> int:
        """Number of anchors."""
        return int(self.quality.shape[0])

    def clusters(self) -> pd.Series | None:
        """Prompt of each anchor by anchor id (None when every anchor has its own prompt)."""
        if self.prompts is None:
            return None
        return pd.Series([f"p{int(p):05d}" for p in self.prompts], index=self.anchor_ids, dtype=object)

    def labels(self) -> pd.Series:
        """Oracle labels by anchor id (NaN where unlabelled)."""
        return pd.Series(np.where(self.labelled, self.oracle, np.nan), index=self.anchor_ids)


def _oracle(q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return _phi((q + 0.3 * rng.standard_normal(q.shape[0])) / math.sqrt(1.09))


def make_anchor_set(n_anchors: int = 200, label_fraction: float = 0.5, *, rng: np.random.Generator,
                    anchors_per_prompt: int = 1, prompt_share: float = 0.5) -> AnchorSet:
    """Draw an anchor set; ``label_fraction`` of the anchors get an oracle label.

    With ``anchors_per_prompt > 1`` consecutive anchors share a prompt, and a share
    ``prompt_share`` of the quality variance is the prompt's.
    """
    if n_anchors < 3:
        raise CJEInputError(f"n_anchors must be >= 3, got {n_anchors}")
    if not 0 <= label_fraction <= 1:
        raise CJEInputError(f"label_fraction must be in [0, 1], got {label_fraction}")
    if anchors_per_prompt < 1 or not 0 <= prompt_share <= 1:
        raise CJEInputError(f"anchors_per_prompt must be >= 1 and prompt_share in [0, 1], got "
                            f"{anchors_per_prompt}, {prompt_share}")
    prompts = None
    q = rng.standard_normal(n_anchors)
    if anchors_per_prompt > 1:
        prompts = np.arange(n_anchors) // anchors_per_prompt
        a = rng.standard_normal(int(prompts.max()) + 1)[prompts]
        q = math.sqrt(prompt_share) * a + math.sqrt(1 - prompt_share) * q
    v = rng.standard_normal(n_anchors)
    labelled = np.zeros(n_anchors, dtype=bool)
    labelled[rng.choice(n_anchors, size=int(round(label_fraction * n_anchors)), replace=False)] = True
    ids = pd.Index([f"a{i:05d}" for i in range(n_anchors)], name="anchor_id")
    return AnchorSet(ids, q, v, _oracle(q, rng), labelled, prompts)


@dataclass(frozen=True)
class Judge:
    """A simulated judge (see the module docstring for the score model)."""

    quality_weight: float = 1.0
    nuisance_weight: float = 0.5
    noise_sd: float = 0.5
    shift: float = 0.0
    levels: int = 11
    order: np.ndarray | None = field(default=None, repr=False)
    length_bonus: float = 0.0
    scale: float = 1.0
    shared_noise: float = 0.0

    @property
    def sd(self) -> float:
        """Standard deviation of the judge's latent score (quality, nuisance and noise parts)."""
        return math.sqrt(self.quality_weight**2 + self.nuisance_weight**2 + self.noise_sd**2)

    def score_traits(self, q: np.ndarray, v: np.ndarray, rng: np.random.Generator,
                     prompts: np.ndarray | None = None) -> np.ndarray:
        """Scores of items with traits ``q, v``; ``prompts`` (int codes) share noise within a prompt."""
        if self.order is not None:
            q, v = q[self.order], v[self.order]
        eps = rng.standard_normal(q.shape[0])
        if prompts is not None and self.shared_noise > 0:
            shared = rng.standard_normal(int(prompts.max()) + 1)[prompts]
            eps = math.sqrt(1 - self.shared_noise) * eps + math.sqrt(self.shared_noise) * shared
        latent = self.quality_weight * q + self.nuisance_weight * v + self.noise_sd * eps
        u = 0.5 + self.scale * (_phi(latent / self.sd) - 0.5) + self.shift + self.length_bonus * np.sign(v)
        u = np.clip(u, 0.0, 1.0)
        return np.round(u * (self.levels - 1)) / (self.levels - 1)

    def score(self, anchors: AnchorSet, rng: np.random.Generator) -> pd.Series:
        """One scoring of the anchors (fresh noise) as a Series by anchor id."""
        return pd.Series(self.score_traits(anchors.quality, anchors.nuisance, rng, anchors.prompts),
                         index=anchors.anchor_ids)


def drifted_judge(
    scenario: str, reference: Judge, n_anchors: int, effect: float | None, rng: np.random.Generator
) -> Judge:
    """The judge after the update of a scenario (``effect=None``: `DEFAULT_EFFECT`)."""
    if scenario not in SCENARIOS:
        raise CJEInputError(f"unknown scenario {scenario!r}; known: {list(SCENARIOS)}")
    eff = DEFAULT_EFFECT[scenario] if effect is None else float(effect)
    if scenario == "none":
        return reference
    if scenario in ("shift", "slow"):  # slow: the shift of the first drifted look (see `judge_at`)
        return replace(reference, shift=reference.shift + eff)
    if scenario == "length":
        return replace(reference, length_bonus=reference.length_bonus + eff)
    if scenario == "compress":
        if not 0 <= eff < 1:
            raise CJEInputError(f"compress effect is the shrinkage in [0, 1); got {eff}")
        return replace(reference, scale=reference.scale * (1 - eff))
    if scenario == "reorder":
        if not 0 < eff <= 1:
            raise CJEInputError(f"reorder effect is the share of anchors reordered, in (0, 1]; got {eff}")
        m = max(2, int(round(eff * n_anchors)))
        subset = rng.choice(n_anchors, size=m, replace=False)
        order = np.arange(n_anchors)
        order[subset] = np.roll(subset, 1)
        return replace(reference, order=order)
    # remap: rotate (wq, wv) by eff degrees towards the nuisance trait, same length
    r = math.hypot(reference.quality_weight, reference.nuisance_weight)
    angle = math.atan2(reference.nuisance_weight, reference.quality_weight) + math.radians(eff)
    return replace(reference, quality_weight=r * math.cos(angle), nuisance_weight=r * math.sin(angle))


def judge_at(scenario: str, reference: Judge, drifted: Judge, look: int, change_at: int, effect: float | None) -> Judge:
    """The judge scoring look ``look``: the reference before ``change_at``, then the drifted one
    (``slow``: the shift grows by ``effect`` per look)."""
    if look < change_at:
        return reference
    if scenario == "slow":
        eff = DEFAULT_EFFECT["slow"] if effect is None else float(effect)
        return replace(reference, shift=reference.shift + eff * (look - change_at + 1))
    return drifted


@dataclass(frozen=True)
class StepCalibration:
    """Isotonic step function: ``predict`` interpolates linearly between the fitted values at the
    distinct scores and is flat outside them (what an isotonic regression predicts)."""

    scores: np.ndarray
    fitted: np.ndarray

    def predict(self, s: np.ndarray) -> np.ndarray:
        """Calibrated values of scores ``s`` (linear interpolation between the fitted steps)."""
        return np.interp(np.asarray(s, dtype=float), self.scores, self.fitted)

    __call__ = predict


def fit_calibration(judge: Judge, *, n: int = 2000, rng: np.random.Generator) -> StepCalibration:
    """Isotonic oracle-on-score calibration fitted on an independent sample scored by ``judge``.

    Pool-adjacent-violators on the means per distinct score (``scipy.optimize.isotonic_regression``
    with the counts as weights). The shared isotonic of the engine is not used here so that the
    simulator stays independent of the code it checks.
    """
    q = rng.standard_normal(n)
    v = rng.standard_normal(n)
    s = judge.score_traits(q, v, rng)
    y = _oracle(q, rng)
    xs, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    means = np.bincount(inv, weights=y) / counts
    fitted = optimize.isotonic_regression(means, weights=counts.astype(float), increasing=True).x
    return StepCalibration(xs, np.asarray(fitted, dtype=float))


@dataclass
class SimRun:
    """One simulated monitor.

    Attributes
    ----------
    scenario : str
    change_at : int
    first_alarm : dict of str to int or None
        Look at which each metric first alarmed.
    p_values : ndarray, shape (n_looks_run, len(METRICS))
        Per-look p-values (NaN where a metric was not computed).
    alpha_spent : ndarray, shape (n_looks_run, len(METRICS))
    """

    scenario: str
    change_at: int
    first_alarm: dict[str, int | None]
    p_values: np.ndarray
    alpha_spent: np.ndarray

    @property
    def first_alarm_look(self) -> int | None:
        """First look at which any metric alarmed (None without an alarm)."""
        looks = [v for v in self.first_alarm.values() if v is not None]
        return min(looks) if looks else None

    @property
    def n_looks_run(self) -> int:
        """Number of looks the monitor ran."""
        return int(self.p_values.shape[0])


def simulate_monitor(
    scenario: str = "none",
    *,
    effect: float | None = None,
    n_anchors: int = 200,
    n_looks: int = 50,
    change_at: int = 1,
    label_fraction: float = 0.5,
    with_replicate: bool = True,
    with_labels: bool = True,
    stop_at_first_alarm: bool = False,
    monitor_kwargs: dict[str, Any] | None = None,
    anchors_per_prompt: int = 1,
    shared_noise: float = 0.0,
    pass_clusters: bool = True,
    seed: int | np.random.SeedSequence = 0,
) -> SimRun:
    """Run one `DriftMonitor` over ``n_looks`` scheduled looks of a scenario.

    The reference judge scores the anchors once (and once more as the replicate); looks
    ``1 .. change_at - 1`` re-score with the reference judge, later looks with the drifted judge
    (`judge_at`). With ``anchors_per_prompt > 1`` the judge's noise has the prompt-shared share
    ``shared_noise`` and the prompts are passed to the monitor as clusters (``pass_clusters``).
    """
    if n_looks < 1 or change_at < 1:
        raise CJEInputError(f"n_looks and change_at must be >= 1, got {n_looks}, {change_at}")
    rng = np.random.default_rng(seed)
    anchors = make_anchor_set(n_anchors, label_fraction, rng=rng, anchors_per_prompt=anchors_per_prompt)
    ref_judge = Judge(shared_noise=shared_noise)
    new_judge = drifted_judge(scenario, ref_judge, n_anchors, effect, rng)
    calibrate = fit_calibration(ref_judge, rng=rng)
    reference = ref_judge.score(anchors, rng)
    replicate = ref_judge.score(anchors, rng) if with_replicate else None
    labels = anchors.labels() if with_labels else None
    clusters = anchors.clusters() if pass_clusters else None
    mon = DriftMonitor(**(monitor_kwargs or {}))
    pv, sp = [], []
    for t in range(1, n_looks + 1):
        current = judge_at(scenario, ref_judge, new_judge, t, change_at, effect).score(anchors, rng)
        look = mon.update(reference, current, labels, calibrate if with_labels else None,
                          reference_replicate=replicate, clusters=clusters)
        pv.append([np.nan if look.metrics[m].p_value is None else look.metrics[m].p_value for m in METRICS])
        sp.append([look.metrics[m].alpha_spent for m in METRICS])
        if stop_at_first_alarm and look.alarm:
            break
    return SimRun(scenario, change_at, dict(mon.first_alarm_), np.array(pv), np.array(sp))


def _seeds(seed: int, n: int) -> list[np.random.SeedSequence]:
    return np.random.SeedSequence(seed).spawn(n)


def false_alarm_study(
    n_reps: int, *, n_looks: int = 50, seed: int = 20240601, naive_alpha: float = 0.05, **kwargs: Any
) -> dict[str, Any]:
    """Share of no-drift monitors with any alarm within ``n_looks`` looks.

    Also reports the naive rate: any per-look p-value below ``naive_alpha`` (no correction for
    looks or metrics), to show what the spending buys.
    """
    any_alarm = 0
    naive = 0
    by_metric = {m: 0 for m in METRICS}
    for ss in _seeds(seed, n_reps):
        run = simulate_monitor("none", n_looks=n_looks, seed=ss, **kwargs)
        any_alarm += run.first_alarm_look is not None
        naive += bool(np.nanmin(run.p_values) < naive_alpha)
        for m in METRICS:
            by_metric[m] += run.first_alarm[m] is not None
    rate = any_alarm / n_reps
    return {
        "scenario": "none",
        "n_reps": n_reps,
        "n_looks": n_looks,
        "false_alarm_rate": rate,
        "binomial_se": math.sqrt(max(rate * (1 - rate), 1e-12) / n_reps),
        "false_alarms_by_metric": {m: c / n_reps for m, c in by_metric.items()},
        "naive_per_look_rate": naive / n_reps,
    }


def detection_study(
    scenario: str,
    n_reps: int,
    *,
    effect: float | None = None,
    change_at: int = 1,
    within: int = 5,
    seed: int = 20240602,
    **kwargs: Any,
) -> dict[str, Any]:
    """Power to alarm within ``within`` looks of the change, and the detection delay.

    Delay = first alarm look - ``change_at`` (0 = the first drifted look). Runs that alarmed
    before the change count as false alarms, not detections. Each run stops at its first alarm
    or after ``change_at + within - 1`` looks.
    """
    n_looks = change_at + within - 1
    delays: list[int] = []
    early = 0
    first_metric = {m: 0 for m in METRICS}
    for ss in _seeds(seed, n_reps):
        run = simulate_monitor(
            scenario, effect=effect, n_looks=n_looks, change_at=change_at, stop_at_first_alarm=True, seed=ss, **kwargs
        )
        first = run.first_alarm_look
        if first is None:
            continue
        if first < change_at:
            early += 1
            continue
        delays.append(first - change_at)
        for m in METRICS:
            if run.first_alarm[m] == first:
                first_metric[m] += 1
    d = np.array(delays, dtype=float)
    power = d.shape[0] / n_reps
    return {
        "scenario": scenario,
        "effect": DEFAULT_EFFECT[scenario] if effect is None else effect,
        "n_reps": n_reps,
        "change_at": change_at,
        "within": within,
        "power": power,
        "binomial_se": math.sqrt(max(power * (1 - power), 1e-12) / n_reps),
        "alarmed_before_change": early / n_reps,
        "delay_mean": float(d.mean()) if d.size else None,
        "delay_median": float(np.median(d)) if d.size else None,
        "delay_p90": float(np.quantile(d, 0.9)) if d.size else None,
        "delay_max": float(d.max()) if d.size else None,
        "first_alarm_metric_share": {m: c / n_reps for m, c in first_metric.items()},
    }
