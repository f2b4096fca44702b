"""An independent generator of judge re-scorings, written apart from `cje_engine.simulate.drift`.

It mimics the judge data of the checks in issue 17 rather than our simulator's model: scores on
0-100 in steps of 5, skewed to the top (mean about 72, a third of the scores at 90-100), a
test-retest Kendall tau of about 0.60, four responses per prompt (passed as clusters), 2% glitch
scores (uniform over the 21 values), and optionally noise shared within a prompt.

World: prompt difficulty ``a_p ~ N(0, 0.8)``, response quality ``q = a_p + N(0, 0.6)``, response
length lognormal and independent of quality ("long" = above the median). One scoring:
``100 * Phi(0.9 + 0.9 (q + e))`` rounded to a multiple of 5, ``e`` the judge's noise (sd
``noise``; a share ``shared`` of its variance drawn once per prompt per scoring).

Judge updates (`Scoring`): ``shift`` points added; ``long_bonus`` added to long and subtracted
from short responses (the length-preferring update); ``compress`` shrinks scores towards 50.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import special


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
        self.n_prompts = n_prompts

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
