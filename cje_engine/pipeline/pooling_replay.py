"""Robust pooling repeated inside every bootstrap replicate (issue 9, the pooled design's coverage).

Robust pooling (`cje_engine.pipeline.calibration.fit_calibration`) chooses, from the data, which
calibration sources train the calibrator. A bootstrap that refits the calibrator on the full data's
final source set in every replicate treats that choice as fixed and misses its variance: with 50
labels a policy pooled from seven policies, a clean source is excluded in ~3.5% of datasets, exactly
when the labels make it look extreme, and the six transported policies' intervals then cover 0.62
(benchmarks/RESULTS.md, "Issue 9: coverage at 25% labels"). The replay makes every replicate run
the same selection on its own resample:

1. start from the sources the full data started from, less the *decisive* exclusions: a source
   whose full-data |z| exceeded the Holm critical value of its round by `DECISIVE_Z_MARGIN` or
   more (the replicate's z of a source is about the full data's +- 1, so it fails in every
   replicate up to a probability below Phi(-6) ~ 1e-9; the adversary sits at |z| ~ 10-30);
2. compute the replicate's statistics with that set (`replicate_view`, the one refit it always
   did), whose columns hold each source's own out-of-fold residual mean (augmented - plug-in);
3. test the sources as the full data did (two-sided z with the full-data SE of the same source set,
   Holm over the sources, the most extreme failing one leaves), and repeat 2-3 with the smaller set
   until none fails or the rest cannot be cross-fitted.

The SE of a source's residual mean is taken from the full-data fit of the same source set (the
studentisation is held fixed; the SE's own sampling error is second order). The calibration mode
stays the one chosen on the full data. Opt-in (``pooling_bootstrap="rerun"``; the default keeps the
full data's sources): one Holm test on <= K numbers per replicate, plus one more refit in the
replicates whose selection differs from the start set, 1.3-2.1x the replicate's CPU in a pooled
design (a bootstrap of a pre-test over-selects: ~20% of replicates against 3.5% of datasets), and a
prepared state that ships whole to Ray workers (RESULTS.md, "Issue 9: coverage at 25% labels").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cje_engine.data.frame import EvalData
from cje_engine.direct.estimators import (Design, cell_fits, bootstrap_view, calibration_plan, make_design,
                                          replicate_view, row_cells)
from cje_engine.errors import CJEInputError
from cje_engine.inference.distributions import norm_isf
from cje_engine.pipeline.calibration import Fit, failing_source, source_audits

#: How far beyond the Holm critical value of its round a full-data exclusion must lie to be taken
#: as certain in every replicate (the z of a source varies by about 1 across replicates).
DECISIVE_Z_MARGIN = 6.0


def decisive(record: dict, alpha: float, margin: float = DECISIVE_Z_MARGIN) -> bool:
    """Is a full-data exclusion (a `fit_calibration` record) certain to recur in every replicate?

    The Holm critical value of the round is the largest: the Bonferroni one over the round's family.
    """
    z = abs(record["residual_mean"]) / record["se"] if record["se"] > 0 else np.inf
    crit = float(norm_isf(alpha / (2 * max(int(record["family_size"]), 1))))
    return bool(z >= crit + margin)


@dataclass
class PoolingReplay:
    """What a replicate needs to run robust pooling again (picklable; caches are rebuilt per process)."""

    data: EvalData
    mode: str
    alpha: float
    start: tuple[int, ...]  # policy codes of the sources every replicate starts from
    final: tuple[int, ...]  # the full data's final sources (the prepared design's)
    _designs: dict = field(default_factory=dict, repr=False)
    _se: dict = field(default_factory=dict, repr=False)
    _rows: list = field(default_factory=list, repr=False)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _designs={}, _se={}, _rows=[])

    def design(self, sources: tuple[int, ...]) -> Design:
        """The cross-fit design of ``sources`` (cached; raises `CJEInputError` if it cannot be cross-fitted)."""
        if sources not in self._designs:
            if not self._rows:
                self._rows.append(row_cells(self.data, self.mode))
            names = tuple(self.data.policies[k] for k in sources)
            try:
                self._designs[sources] = make_design(self.data, self.mode, names, self._rows[0])
            except CJEInputError:
                self._designs[sources] = None
        d = self._designs[sources]
        if d is None:
            raise CJEInputError(f"calibration sources {sources} cannot be cross-fitted")
        return d

    def source_se(self, sources: tuple[int, ...]) -> np.ndarray:
        """Full-data SE of every source's residual mean under the fit of ``sources`` (NaN elsewhere)."""
        if sources not in self._se:
            design = self.design(sources)
            F_all, f_cal, full, models = cell_fits(calibration_plan(design), np.ones(design.cal_rows.size),
                                                    with_models=False)
            self._se[sources] = source_audits(Fit(design, F_all, f_cal, full, models))[1]
        return self._se[sources]

    def replicate(self, prompt_w: np.ndarray) -> np.ndarray:
        """One replicate's 2K statistics with the pooling selection run on the resample."""
        K = len(self.data.policies)
        sources = self.start
        stats = replicate_view(bootstrap_view(self.design(sources)), prompt_w)
        while np.all(np.isfinite(stats[:K])):
            is_source = np.isin(np.arange(K), sources)
            bad = failing_source(stats[K:] - stats[:K], self.source_se(sources), is_source, self.alpha)
            if bad is None:
                break
            rest = tuple(k for k in sources if k != bad[0])
            try:
                design = self.design(rest)
            except CJEInputError:  # the rest cannot be cross-fitted: the full data keeps the source too
                break
            sources = rest
            stats = replicate_view(bootstrap_view(design), prompt_w)
        return stats


def build_replay(data: EvalData, opts, design: Design, excluded: list[dict]) -> PoolingReplay | None:
    """The replay of the full data's robust pooling, or None when there is nothing to repeat.

    Nothing to repeat: fewer than two sources left once the decisive exclusions are taken out (one
    source cannot be tested against the others), e.g. ``calibration_policies=["base"]``.
    """
    labelled = np.unique(data.policy[data.labelled])
    if opts.calibration_policies is None:
        initial = [int(k) for k in labelled]
    else:
        initial = [data.policies.index(p) for p in opts.calibration_policies if p in data.policies]
    certain = {data.policies.index(e["policy"]) for e in excluded if decisive(e, opts.alpha)}
    start = tuple(k for k in initial if k not in certain and k in set(labelled.tolist()))
    final = tuple(int(k) for k in np.unique(data.policy[design.cal_rows]))
    if len(start) < 2:
        return None
    replay = PoolingReplay(data, design.mode, float(opts.alpha), start, final)
    replay._designs[final] = design  # the prepared design (its caches are reused in this process)
    try:
        replay.design(start)
    except CJEInputError:  # cannot happen for the full data's own first round; kept for safety
        return None
    return replay
