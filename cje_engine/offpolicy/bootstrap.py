"""Calibration-aware cluster bootstrap of one target (standalone use; the engine's pipeline runs its own,
chunked bootstrap over every policy from one prompt draw).

Prompts are resampled, the caller's ``refit`` callable refits the reward calibrator on each
replicate, and the weight stabiliser is refitted too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from cje_engine.data.frame import fold_of
from cje_engine.errors import CJEInputError
from cje_engine.offpolicy.inputs import FreshData, LoggedData, Rewards
from cje_engine.offpolicy.target import OffPolicyConfig, check_stack, compute_estimates, evaluate_target


#: ``refit(logged_idx, fresh_idx) -> Rewards``: refit the reward calibrator on the replicate
#: (rows ``logged_idx`` of the logged data, with repeats) and return the rewards of exactly those
#: rows, in that order (and of ``fresh_idx`` for fresh draws, or ``None`` without fresh draws).
RefitFn = Callable[[np.ndarray, "np.ndarray | None"], Rewards]


@dataclass(frozen=True)
class BootstrapResult:
    """Replicate estimates per estimator and percentile intervals."""

    point: Mapping[str, float]
    replicates: Mapping[str, np.ndarray] = field(repr=False)
    n_boot: int
    seed: int
    level: float
    stack_candidates: tuple[str, ...] = ()

    def se(self, name: str) -> float:
        """Standard deviation of the finite replicates of estimator ``name`` (NaN with fewer than two)."""
        r = self.replicates[name]
        r = r[np.isfinite(r)]
        return float(np.std(r, ddof=1)) if r.shape[0] > 1 else float("nan")

    def ci(self, name: str) -> tuple[float, float]:
        """Percentile interval of the replicate estimates."""
        r = self.replicates[name]
        r = r[np.isfinite(r)]
        a = (1 - self.level) / 2
        return (float(np.quantile(r, a)), float(np.quantile(r, 1 - a)))


def bootstrap_target(logged: LoggedData, refit: RefitFn, fresh: FreshData | None = None, *,
                     n_boot: int = 2000, seed: int = 0, config: OffPolicyConfig | None = None) -> BootstrapResult:
    """Calibration-aware cluster bootstrap of every estimator for one target.

    Each replicate draws prompts with replacement (the union of logged and fresh prompts), takes
    all their logged rows and fresh draws (a prompt drawn twice contributes two clusters, both in
    the prompt's own fold), calls ``refit`` to refit the reward calibrator on the replicate, refits
    SIMCal and the IF stack weights (over the candidates chosen on the full data by
    `evaluate_target`), and records every estimate. Same seed, same numbers.
    """
    config = config or OffPolicyConfig()
    check_stack(config)
    if n_boot < 2:
        raise CJEInputError(f"n_boot must be at least 2, got {n_boot}")
    n = logged.n
    m = fresh.n if fresh is not None else None
    all_l = np.arange(n)
    point_rw = _call_refit(refit, all_l, np.arange(m) if m is not None else None, n, m)
    folds = fold_of(logged.prompt_ids, config.n_folds)
    report = evaluate_target(logged, point_rw, fresh, config=config)
    point = report.estimates
    prompts = np.unique(np.concatenate([logged.prompt_ids] + ([fresh.prompt_ids] if fresh is not None else [])))
    g = prompts.shape[0]
    code_l = np.searchsorted(prompts, logged.prompt_ids)
    code_f = np.searchsorted(prompts, fresh.prompt_ids) if fresh is not None else None
    rng = np.random.default_rng(seed)
    reps: dict[str, list[float]] = {k: [] for k in point}

    def expand(codes: np.ndarray, mult: np.ndarray, big: int) -> tuple[np.ndarray, np.ndarray]:
        r = mult[codes]
        idx = np.repeat(np.arange(codes.shape[0]), r)
        starts = np.cumsum(r) - r
        copy = np.arange(idx.shape[0]) - np.repeat(starts, r)
        return idx, codes[idx] * big + copy

    for _ in range(n_boot):
        mult = np.bincount(rng.integers(0, g, size=g), minlength=g)
        big = int(mult.max()) + 1
        li, lc = expand(code_l, mult, big)
        if li.shape[0] == 0:
            for k in reps:
                reps[k].append(np.nan)
            continue
        fi, fc = (expand(code_f, mult, big) if code_f is not None else (None, None))
        if fi is not None and fi.shape[0] == 0:
            for k in reps:
                reps[k].append(np.nan)
            continue
        rw = _call_refit(refit, li, fi, li.shape[0], fi.shape[0] if fi is not None else None)
        ests, _, _ = compute_estimates(logged.log_w[li], logged.scores[li], folds[li], lc, rw, fc, config,
                                        report.stack_candidates)
        for k in reps:
            reps[k].append(ests[k].value if k in ests else np.nan)
    return BootstrapResult({k: v.value for k, v in point.items()},
                           {k: np.asarray(v) for k, v in reps.items()}, n_boot, seed, config.level,
                           report.stack_candidates)


def _call_refit(refit: RefitFn, li: np.ndarray, fi: np.ndarray | None, n: int, m: int | None) -> Rewards:
    out = refit(li, fi)
    if not isinstance(out, Rewards):
        raise CJEInputError(f"refit must return a Rewards object, got {type(out).__name__}")
    return out.checked(n, m)
