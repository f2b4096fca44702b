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

The calibration function ``f`` is an isotonic regression of oracle on reference-judge scores fitted
on an independent calibration sample (never on the anchors themselves).

Run ``python -m cje_engine.simulate.drift --reps 1000`` for the figures quoted in docs/drift.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
from scipy import special
from sklearn.isotonic import IsotonicRegression

from cje_engine.drift.monitor import METRICS, DriftMonitor
from cje_engine.errors import CJEInputError

logger = logging.getLogger(__name__)

SCENARIOS: tuple[str, ...] = ("none", "shift", "reorder", "remap")
#: Stated effect sizes of the detection figures in docs/drift.md.
DEFAULT_EFFECT: dict[str, float] = {"none": 0.0, "shift": 0.1, "reorder": 0.5, "remap": 45.0}


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

    @property
    def n(self) -> int:
        return int(self.quality.shape[0])

    def labels(self) -> pd.Series:
        """Oracle labels by anchor id (NaN where unlabelled)."""
        return pd.Series(np.where(self.labelled, self.oracle, np.nan), index=self.anchor_ids)


def _oracle(q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return _phi((q + 0.3 * rng.standard_normal(q.shape[0])) / math.sqrt(1.09))


def make_anchor_set(n_anchors: int = 200, label_fraction: float = 0.5, *, rng: np.random.Generator) -> AnchorSet:
    """Draw an anchor set; ``label_fraction`` of the anchors get an oracle label."""
    if n_anchors < 3:
        raise CJEInputError(f"n_anchors must be >= 3, got {n_anchors}")
    if not 0 <= label_fraction <= 1:
        raise CJEInputError(f"label_fraction must be in [0, 1], got {label_fraction}")
    q = rng.standard_normal(n_anchors)
    v = rng.standard_normal(n_anchors)
    labelled = np.zeros(n_anchors, dtype=bool)
    labelled[rng.choice(n_anchors, size=int(round(label_fraction * n_anchors)), replace=False)] = True
    ids = pd.Index([f"a{i:05d}" for i in range(n_anchors)], name="anchor_id")
    return AnchorSet(ids, q, v, _oracle(q, rng), labelled)


@dataclass(frozen=True)
class Judge:
    """A simulated judge (see the module docstring for the score model)."""

    quality_weight: float = 1.0
    nuisance_weight: float = 0.5
    noise_sd: float = 0.5
    shift: float = 0.0
    levels: int = 11
    order: np.ndarray | None = field(default=None, repr=False)

    @property
    def sd(self) -> float:
        return math.sqrt(self.quality_weight**2 + self.nuisance_weight**2 + self.noise_sd**2)

    def score_traits(self, q: np.ndarray, v: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self.order is not None:
            q, v = q[self.order], v[self.order]
        latent = self.quality_weight * q + self.nuisance_weight * v + self.noise_sd * rng.standard_normal(q.shape[0])
        u = np.clip(_phi(latent / self.sd) + self.shift, 0.0, 1.0)
        return np.round(u * (self.levels - 1)) / (self.levels - 1)

    def score(self, anchors: AnchorSet, rng: np.random.Generator) -> pd.Series:
        """One scoring of the anchors (fresh noise) as a Series by anchor id."""
        return pd.Series(self.score_traits(anchors.quality, anchors.nuisance, rng), index=anchors.anchor_ids)


def drifted_judge(
    scenario: str, reference: Judge, n_anchors: int, effect: float | None, rng: np.random.Generator
) -> Judge:
    """The judge after the update of a scenario (``effect=None``: `DEFAULT_EFFECT`)."""
    if scenario not in SCENARIOS:
        raise CJEInputError(f"unknown scenario {scenario!r}; known: {list(SCENARIOS)}")
    eff = DEFAULT_EFFECT[scenario] if effect is None else float(effect)
    if scenario == "none":
        return reference
    if scenario == "shift":
        return replace(reference, shift=reference.shift + eff)
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


def fit_calibration(judge: Judge, *, n: int = 2000, rng: np.random.Generator) -> IsotonicRegression:
    """Isotonic oracle-on-score calibration fitted on an independent sample scored by ``judge``."""
    q = rng.standard_normal(n)
    v = rng.standard_normal(n)
    s = judge.score_traits(q, v, rng)
    return IsotonicRegression(out_of_bounds="clip").fit(s, _oracle(q, rng))


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
        looks = [v for v in self.first_alarm.values() if v is not None]
        return min(looks) if looks else None

    @property
    def n_looks_run(self) -> int:
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
    seed: int | np.random.SeedSequence = 0,
) -> SimRun:
    """Run one `DriftMonitor` over ``n_looks`` scheduled looks of a scenario.

    The reference judge scores the anchors once (and once more as the replicate); looks
    ``1 .. change_at - 1`` re-score with the reference judge, looks from ``change_at`` on with
    the drifted judge.
    """
    if n_looks < 1 or change_at < 1:
        raise CJEInputError(f"n_looks and change_at must be >= 1, got {n_looks}, {change_at}")
    rng = np.random.default_rng(seed)
    anchors = make_anchor_set(n_anchors, label_fraction, rng=rng)
    ref_judge = Judge()
    new_judge = drifted_judge(scenario, ref_judge, n_anchors, effect, rng)
    calib = fit_calibration(ref_judge, rng=rng)
    # same values as calib.predict (linear interpolation between thresholds, flat outside)
    thresholds_x, thresholds_y = calib.X_thresholds_, calib.y_thresholds_

    def calibrate(s: np.ndarray) -> np.ndarray:
        return np.interp(s, thresholds_x, thresholds_y)
    reference = ref_judge.score(anchors, rng)
    replicate = ref_judge.score(anchors, rng) if with_replicate else None
    labels = anchors.labels() if with_labels else None
    mon = DriftMonitor(**(monitor_kwargs or {}))
    pv, sp = [], []
    for t in range(1, n_looks + 1):
        judge = ref_judge if t < change_at else new_judge
        current = judge.score(anchors, rng)
        look = mon.update(
            reference,
            current,
            labels,
            calibrate if with_labels else None,
            reference_replicate=replicate,
        )
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


def main(argv: list[str] | None = None) -> int:
    """Print the false-alarm and detection figures as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=1000, help="monitors per scenario")
    p.add_argument("--looks", type=int, default=50, help="scheduled looks for the false-alarm run")
    p.add_argument("--anchors", type=int, default=200)
    p.add_argument("--change-at", type=int, default=10, help="first drifted look in detection runs")
    p.add_argument("--within", type=int, default=5, help="detection window in looks")
    p.add_argument("--horizon", type=int, default=None, help="monitor horizon (default unbounded)")
    p.add_argument(
        "--effect", action="append", default=[], metavar="SCENARIO=VALUE",
        help="effect size of a scenario (repeatable), e.g. --effect shift=0.05",
    )
    p.add_argument("--skip-false-alarm", action="store_true", help="only run the detection studies")
    args = p.parse_args(argv)
    effects: dict[str, float] = {}
    for item in args.effect:
        name, _, value = item.partition("=")
        if name not in SCENARIOS[1:] or not value:
            p.error(f"--effect wants SCENARIO=VALUE with SCENARIO in {list(SCENARIOS[1:])}, got {item!r}")
        effects[name] = float(value)
    logging.basicConfig(level=logging.ERROR)
    mk = {"horizon": args.horizon} if args.horizon else {}
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "command": "python -m cje_engine.simulate.drift " + " ".join(argv if argv is not None else sys.argv[1:]),
        "false_alarm": None
        if args.skip_false_alarm
        else false_alarm_study(args.reps, n_looks=args.looks, n_anchors=args.anchors, monitor_kwargs=mk),
        "detection": [
            detection_study(
                s,
                args.reps,
                effect=effects.get(s),
                change_at=args.change_at,
                within=args.within,
                n_anchors=args.anchors,
                monitor_kwargs=mk,
            )
            for s in SCENARIOS[1:]
        ],
    }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
