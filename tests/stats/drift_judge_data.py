"""An independent generator of judge re-scorings, written apart from `cje_engine.simulate.drift`.

It mimics the judge data of the checks in issue 17 rather than our simulator's model: scores on
0-100 in steps of 5, skewed to the top (mean about 72, a third of the scores at 90-100), a
test-retest Kendall tau of about 0.60, four responses per prompt (passed as clusters), 2% glitch
scores (uniform over the 21 values), and optionally noise shared within a prompt.

World: prompt difficulty ``a_p ~ N(0, 0.8)``, response quality ``q = a_p + N(0, 0.6)``, response
length lognormal and independent of quality ("long" = above the median). One scoring:
``100 * Phi(0.9 + 0.9 (q + e))`` rounded to a multiple of 5, ``e`` the judge's noise (sd
``noise``; a share ``shared`` of its variance drawn once per prompt per scoring).

Half of the anchors carry an oracle label ``Phi(q + N(0, 0.3))``; `calibration` fits an isotonic
oracle-on-score curve on a fresh panel of the same world (never on the anchors).

Judge updates (`Scoring`): ``shift`` points added; ``long_bonus`` added to long and subtracted
from short responses (the length-preferring update); ``compress`` shrinks scores towards 50.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from scipy import optimize, special

from cje_engine.drift.monitor import DriftMonitor


@dataclass(frozen=True)
class Scoring:
    """A judge version: additive shift, length preference and compression on the 0-100 scale."""

    shift: float = 0.0
    long_bonus: float = 0.0
    compress: float = 0.0


class JudgePanel:
    """Anchors of ``n_prompts`` prompts with ``per_prompt`` responses each, and their scorings."""

    def __init__(self, rng: np.random.Generator, *, n_prompts: int = 50, per_prompt: int = 4,
                 noise: float = 0.48, shared: float = 0.0, glitch: float = 0.02) -> None:
        self.rng = rng
        self.prompt = np.repeat(np.arange(n_prompts), per_prompt)
        n = self.prompt.shape[0]
        self.quality = rng.normal(0.0, 0.8, n_prompts)[self.prompt] + rng.normal(0.0, 0.6, n)
        length = rng.lognormal(6.0, 0.5, n)
        self.long = length > np.median(length)
        self.noise, self.shared, self.glitch = noise, shared, glitch
        self.ids = pd.Index([f"q{p:03d}-r{i % per_prompt}" for i, p in enumerate(self.prompt)], name="anchor_id")
        self.n_prompts, self.per_prompt = n_prompts, per_prompt
        oracle = 0.5 * special.erfc(-(self.quality + rng.normal(0.0, 0.3, n)) / math.sqrt(2.0))
        self.labels = pd.Series(np.where(rng.random(n) < 0.5, oracle, np.nan), index=self.ids)

    def calibration(self, n_prompts: int = 500) -> Callable[[np.ndarray], np.ndarray]:
        """Isotonic oracle-on-score curve fitted on an independent panel scored by the base judge."""
        other = JudgePanel(self.rng, n_prompts=n_prompts, per_prompt=self.per_prompt, noise=self.noise,
                           shared=self.shared, glitch=self.glitch)
        s = other.score().to_numpy()
        y = 0.5 * special.erfc(-(other.quality + self.rng.normal(0.0, 0.3, s.shape[0])) / math.sqrt(2.0))
        xs, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
        fitted = optimize.isotonic_regression(np.bincount(inv, weights=y) / counts, weights=counts.astype(float)).x

        def calibrate(v: np.ndarray) -> np.ndarray:
            return np.interp(np.asarray(v, dtype=float), xs, fitted)

        return calibrate

    @property
    def clusters(self) -> pd.Series:
        return pd.Series([f"q{p:03d}" for p in self.prompt], index=self.ids, dtype=object)

    def score(self, judge: Scoring = Scoring()) -> pd.Series:
        """One scoring of every anchor (fresh noise) as a Series by anchor id."""
        rng, n = self.rng, self.prompt.shape[0]
        e = math.sqrt(1 - self.shared) * rng.standard_normal(n)
        if self.shared > 0:
            e = e + math.sqrt(self.shared) * rng.standard_normal(self.n_prompts)[self.prompt]
        s = 100.0 * 0.5 * special.erfc(-(0.9 + 0.9 * (self.quality + self.noise * e)) / math.sqrt(2.0))
        s = 50.0 + (1.0 - judge.compress) * (s - 50.0) + judge.shift
        s = s + np.where(self.long, judge.long_bonus, -judge.long_bonus)
        s = np.clip(np.round(s / 5.0) * 5.0, 0.0, 100.0)
        bad = rng.random(n) < self.glitch
        s[bad] = 5.0 * rng.integers(0, 21, int(bad.sum()))
        return pd.Series(s, index=self.ids)


#: Judge updates of the scenarios on the 0-100 scale (``slow``: the shift per look).
SCENARIO_JUDGES: dict[str, Scoring] = {
    "none": Scoring(),
    "shift": Scoring(shift=5.0),
    "length": Scoring(long_bonus=10.0),
    "compress": Scoring(compress=0.3),
    "slow": Scoring(shift=0.5),
}


class PanelWorld:
    """One monitored anchor set of this generator: reference, replicate and the judge of each look.

    ``scenario`` takes over at look ``change_at`` (``slow``: the shift grows by 0.5 per look from
    there). ``pass_clusters=False`` hides the prompts from the monitor.
    """

    def __init__(self, seed: int | np.random.SeedSequence, scenario: str = "none", *, change_at: int = 1,
                 shared: float = 0.0, pass_clusters: bool = True, with_labels: bool = True,
                 judge: Scoring | None = None, **panel: Any) -> None:
        self.panel = JudgePanel(np.random.default_rng(seed), shared=shared, **panel)
        self.scenario, self.change_at = scenario, change_at
        self.judge = SCENARIO_JUDGES[scenario] if judge is None else judge
        self.reference = self.panel.score()
        self.replicate = self.panel.score()
        self.clusters = self.panel.clusters if pass_clusters else None
        self.labels = self.panel.labels if with_labels else None
        self.calibrate = self.panel.calibration() if with_labels else None

    def look(self, t: int) -> pd.Series:
        """Scores of look ``t`` (1-based)."""
        if t < self.change_at:
            return self.panel.score()
        if self.scenario == "slow":
            return self.panel.score(Scoring(shift=self.judge.shift * (t - self.change_at + 1)))
        return self.panel.score(self.judge)


def first_alarms(world: Any, n_looks: int, monitor_kwargs: dict[str, Any] | None = None) -> dict[str, int | None]:
    """Run a `DriftMonitor` over ``n_looks`` looks of a world; first alarm look of each metric.

    ``world`` has ``reference``, ``replicate``, ``clusters``, ``labels``, ``calibrate`` and
    ``look(t)`` (`PanelWorld`, or the benchmark's wrapper of `cje_engine.simulate.drift`).
    """
    mon = DriftMonitor(**(monitor_kwargs or {}))
    for t in range(1, n_looks + 1):
        mon.update(world.reference, world.look(t), world.labels, world.calibrate,
                   reference_replicate=world.replicate, clusters=world.clusters)
    return dict(mon.first_alarm_)
