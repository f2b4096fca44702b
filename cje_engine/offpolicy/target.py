"""Per-target off-policy evaluation: estimates, diagnostics and gated verdicts for one target.

`evaluate_target` adds the diagnostics (ESS before/after stabilisation, max-weight share, 99.5th
percentile weight, Hill tail index, TTC, Bhattacharyya affinity of judge scores, the CLE floor,
DR orthogonality) and the gates (TTC >= 0.70 for logs-only, ESS/n >= 0.30), each failing gate
giving a refused or downgraded claim with a plain-language reason and a recommendation.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from cje_engine.data.frame import fold_of
from cje_engine.errors import CJEInputError
from cje_engine.offpolicy.diagnostics import (
    Diagnostics,
    Orthogonality,
    cle_floor,
    dr_orthogonality,
    judge_score_affinity,
    target_typical_coverage,
)
from cje_engine.offpolicy.estimators import (
    ALL_ESTIMATORS,
    DEFAULT_STACK,
    Estimate,
    StackedEstimate,
    estimate_direct,
    estimate_dr,
    estimate_ips,
    estimate_snips,
    estimate_weighted,
    stack_estimates,
)
from cje_engine.offpolicy.gates import OffPolicyGates, Verdict, gate_verdicts
from cje_engine.offpolicy.inputs import FreshData, LoggedData, Rewards
from cje_engine.offpolicy.weights import (
    SIMCal,
    ess_fraction,
    hill_tail_index,
    log_mean_weight,
    max_weight_share,
    mean_one_weights,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffPolicyConfig:
    """Options of `evaluate_target` / `bootstrap_target`.

    rho, n_folds, projection, simcal_stack_by: SIMCal (see `cje_engine.offpolicy.weights.SIMCal`);
    ttc_mass: target mass of the target-typical region (0.9);
    stack: candidates for IF stacking (those available are used; ``()`` disables stacking);
    level: CI level; gates: `OffPolicyGates`.
    """

    rho: float = 1.0
    n_folds: int = 5
    projection: str = "exact"
    simcal_stack_by: str = "mse"
    ttc_mass: float = 0.9
    stack: tuple[str, ...] = DEFAULT_STACK
    level: float = 0.95
    gates: OffPolicyGates = field(default_factory=OffPolicyGates)


@dataclass(frozen=True)
class TargetReport:
    """Estimates, diagnostics and verdicts for one target."""

    target: str
    estimates: Mapping[str, Estimate]
    diagnostics: Diagnostics
    verdicts: Mapping[str, Verdict]
    level: float = 0.95
    stack_candidates: tuple[str, ...] = ()
    #: estimator -> (weights on logged rows, weights on fresh draws or None): each estimate is, to
    #: first order in the reward calibrator, ``sum a_i R_i`` (`cje_engine.offpolicy.influence`)
    reward_weights: Mapping[str, tuple[np.ndarray, np.ndarray | None]] = field(default_factory=dict, repr=False)

    @property
    def logs_only_verdict(self) -> Verdict:
        """Verdict on the headline logs-only estimate (calibrated IPS)."""
        return self.verdicts["calibrated_ips"]

    def to_dict(self) -> dict:
        """The report as JSON data (non-finite numbers become None)."""
        def num(x: float) -> float | None:
            return float(x) if np.isfinite(x) else None

        d = self.diagnostics
        diag = {k: (num(v) if isinstance(v, float) else v) for k, v in d.__dict__.items()
                if k not in ("orthogonality", "simcal_coef")}
        diag["ess_uplift"] = num(d.ess_uplift)
        diag["simcal_coef"] = dict(d.simcal_coef)
        if d.orthogonality is not None:
            diag["dr_orthogonality"] = {"mean": d.orthogonality.mean, "se": d.orthogonality.se,
                                        "ci": list(d.orthogonality.ci)}
        ests = {}
        for k, e in self.estimates.items():
            lo, hi = e.ci(self.level)
            ests[k] = {"value": num(e.value), "se": num(e.se), "ci": [num(lo), num(hi)]}
            if isinstance(e, StackedEstimate):
                ests[k]["coef"] = dict(e.coef)
        verdicts = {k: {"claim": v.claim, "reasons": list(v.reasons), "recommendation": v.recommendation}
                    for k, v in self.verdicts.items()}
        return {"target": self.target, "estimates": ests, "diagnostics": diag, "verdicts": verdicts,
                "stack_candidates": list(self.stack_candidates)}


def compute_estimates(log_w: np.ndarray, scores: np.ndarray, folds: np.ndarray, clusters: np.ndarray,
                       rw: Rewards, fresh_clusters: np.ndarray | None, config: OffPolicyConfig,
                       stack_names: Sequence[str] = ()) -> tuple[dict[str, Estimate], SIMCal, SIMCal | None]:
    """Every off-policy estimator of one target from its log-weights, rewards and folds (with the SIMCal fits)."""
    W = mean_one_weights(log_w)
    R = rw.logged

    def simcal(y: np.ndarray) -> SIMCal:
        return SIMCal(rho=config.rho, n_folds=config.n_folds, projection=config.projection,
                      stack_by=config.simcal_stack_by).fit(log_w, scores, y=y, folds=folds, clusters=clusters)

    cal = simcal(R)
    ests: dict[str, Estimate] = {
        "ips": estimate_ips(log_w, R, clusters),
        "snips": estimate_snips(W, R, clusters),
        "calibrated_ips": estimate_weighted("calibrated_ips", cal.weights_, cal.influence_weights_, R, clusters),
    }
    cal_dr = None
    if rw.fresh is not None:
        assert rw.q_logged is not None and rw.q_fresh is not None and fresh_clusters is not None
        # MSE stacking ignores the outcome, so the IPS fit serves DR too; IF-variance stacking
        # stacks on the DR residuals instead.
        cal_dr = cal if config.simcal_stack_by == "mse" else simcal(R - rw.q_logged)
        ests["dr"] = estimate_dr(cal_dr.weights_, cal_dr.influence_weights_, R, rw.q_logged, rw.q_fresh,
                                 clusters, fresh_clusters)
        ests["direct"] = estimate_direct(rw.fresh, fresh_clusters)
    cands = [ests[k] for k in stack_names if k in ests and np.isfinite(ests[k].value)]
    if cands:
        ests["stacked"] = stack_estimates(cands)
    return ests, cal, cal_dr


def _stack_candidates(ests: Mapping[str, Estimate], pre: Mapping[str, Verdict], config: OffPolicyConfig
                      ) -> tuple[str, ...]:
    """Configured candidates that exist and are finite, leaving out refused ones (unless all are):
    IF variances of estimators with degenerate weights are themselves unreliable, and a stack
    trusting them would lean on exactly the estimates the gates refuse."""
    avail = [k for k in config.stack if k in ests and np.isfinite(ests[k].value) and np.isfinite(ests[k].se)]
    kept = [k for k in avail if pre[k].claim != "refused"]
    return tuple(kept or avail)


def check_stack(config: OffPolicyConfig) -> None:
    """Raise `CJEInputError` for a stacking candidate that is not a known estimator."""
    unknown = [k for k in config.stack if k not in ALL_ESTIMATORS]
    if unknown:
        raise CJEInputError(f"unknown stacking candidate {unknown[0]!r}; expected some of {', '.join(ALL_ESTIMATORS)}")


def evaluate_target(logged: LoggedData, rewards: Rewards, fresh: FreshData | None = None, *,
                    target: str = "target", config: OffPolicyConfig | None = None) -> TargetReport:
    """Estimates, diagnostics and gated verdicts for one target policy.

    Parameters
    ----------
    logged : the logger's responses with log-probabilities under the logger and this target
    rewards : calibrated rewards (and optionally the DR outcome model), see `Rewards`
    fresh : fresh draws from the target (enables DR, Direct, and fresh-draw TTC/affinity references)
    target : name used in messages
    """
    config = config or OffPolicyConfig()
    check_stack(config)
    rw = rewards.checked(logged.n, fresh.n if fresh is not None else None)
    folds = fold_of(logged.prompt_ids, config.n_folds)
    fresh_ids = fresh.prompt_ids if fresh is not None else None
    ests, cal, cal_dr = compute_estimates(logged.log_w, logged.scores, folds, logged.prompt_ids, rw, fresh_ids,
                                           config)
    W = cal.raw_weights_
    ttc = target_typical_coverage(
        logged.logger_logprob, logged.target_logprob, mass=config.ttc_mass, lengths=logged.lengths,
        fresh_target_logprob=fresh.target_logprob if fresh is not None else None,
        fresh_lengths=fresh.lengths if fresh is not None else None)
    cle = cle_floor(W, rw.logged, ttc)
    if fresh is not None:
        aff = judge_score_affinity(logged.scores, target_scores=fresh.scores)
        aff_ref = "fresh"
    else:
        aff = judge_score_affinity(logged.scores, weights=W)
        aff_ref = "weighted-logs"
    finite_lw = logged.log_w[np.isfinite(logged.log_w)]
    orth = None
    if cal_dr is not None:
        assert rw.q_logged is not None
        orth = dr_orthogonality(cal_dr.weights_, cal_dr.influence_weights_, rw.logged, rw.q_logged,
                                logged.prompt_ids, config.level)
    diag = Diagnostics(
        n=logged.n,
        ess_raw=ess_fraction(W),
        ess_stabilised=ess_fraction(cal.weights_),
        max_share_raw=max_weight_share(W),
        max_share_stabilised=max_weight_share(cal.weights_),
        q995_raw=float(np.quantile(W, 0.995)),
        q995_stabilised=float(np.quantile(cal.weights_, 0.995)),
        hill_index=hill_tail_index(logged.log_w),
        log_mean_weight=log_mean_weight(logged.log_w),
        log10_weight_span=float((finite_lw.max() - finite_lw.min()) / np.log(10)),
        ttc=ttc.ttc,
        ttc_alpha=ttc.alpha,
        ttc_reference=ttc.reference + ("/per-token" if ttc.per_token else "/total"),
        cle_factor=cle.factor,
        cle_floor_se=cle.floor_se,
        affinity=aff,
        affinity_reference=aff_ref,
        simcal_alpha=cal.alpha_,
        simcal_coef=dict(zip(cal.candidate_names_, map(float, cal.stack_coef_))),
        simcal_projection=cal.projection_,
        orthogonality=orth,
    )
    stack_names = _stack_candidates(ests, gate_verdicts(ests, diag, config.gates, target), config)
    if stack_names:
        ests["stacked"] = stack_estimates([ests[k] for k in stack_names])
    verdicts = gate_verdicts(ests, diag, config.gates, target)
    for name, v in verdicts.items():
        if v.claim != "level":
            logger.info("target %s, %s: %s (%s)", target, name, v.claim, "; ".join(v.reasons))
    return TargetReport(target, ests, diag, verdicts, config.level, stack_names,
                        _reward_weights(ests, logged.log_w, cal, None if fresh is None else fresh.n))


def _reward_weights(ests: Mapping[str, Estimate], log_w: np.ndarray, cal: SIMCal, m: int | None
                    ) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """First-order weights of each estimate on the calibrated rewards (see `TargetReport.reward_weights`)."""
    W = mean_one_weights(log_w)
    n = W.shape[0]
    lmw = log_mean_weight(log_w)
    scale = float(np.exp(lmw)) if lmw <= 709.0 else float("inf")
    none_f = None if m is None else np.zeros(m)
    out: dict[str, tuple[np.ndarray, np.ndarray | None]] = {
        "ips": (scale * W / n, none_f), "snips": (W / W.sum(), none_f),
        "calibrated_ips": (cal.weights_ / n, none_f)}
    if m is not None:
        out["dr"] = (np.zeros(n), np.full(m, 1.0 / m))
        out["direct"] = (np.zeros(n), np.full(m, 1.0 / m))
    st = ests.get("stacked")
    if isinstance(st, StackedEstimate):
        lw = sum(b * out[k][0] for k, b in st.coef.items())
        fw = None if m is None else sum(b * out[k][1] for k, b in st.coef.items())
        out["stacked"] = (np.asarray(lw, dtype=float), None if fw is None else np.asarray(fw, dtype=float))
    return {k: v for k, v in out.items() if k in ests}
