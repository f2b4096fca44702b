"""Gates: what may be claimed from each off-policy estimator, with plain-language reasons."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from cje_engine.offpolicy.diagnostics import Diagnostics
from cje_engine.offpolicy.estimators import LOGS_ONLY, Estimate, StackedEstimate


@dataclass(frozen=True)
class OffPolicyGates:
    """Gate thresholds (defaults from the paper, calibrated for n ~ 5k and MDE ~ 0.02).

    min_ttc: logs-only estimates are refused below it (DR is downgraded);
    min_ess_fraction: ESS/n of the weights an estimator uses; below it the variance is inflated
    more than 1/0.3 = 3.3x and the SE is unreliable (logs-only refused, DR downgraded);
    min_tail_index: raw IPS/SNIPS are downgraded when the Hill index of the weights is below it
    (infinite variance).
    """

    min_ttc: float = 0.70
    min_ess_fraction: float = 0.30
    min_tail_index: float = 2.0


@dataclass(frozen=True)
class Verdict:
    """What may be claimed from one estimator: ``"level"`` (a level claim with its CI),
    ``"downgraded"`` (report, but flag the CI as unreliable) or ``"refused"`` (no level claim)."""

    estimator: str
    claim: str
    reasons: tuple[str, ...] = ()
    recommendation: str | None = None


_RANK = {"level": 0, "downgraded": 1, "refused": 2}


def _recommendation(target: str, direct: Estimate | None) -> str:
    if direct is not None:
        lo, hi = direct.ci()
        return (f"use the Direct estimate from the fresh draws of '{target}' ({direct.value:.3f}, 95% CI "
                f"{lo:.3f} to {hi:.3f} before calibration uncertainty), which needs no overlap")
    return (f"collect fresh draws: generate responses from '{target}' on a sample of the prompts, score them "
            "with the same judge, and report the Direct estimate (mean calibrated reward of the fresh draws), "
            "which needs no overlap with the logger")


def gate_verdicts(estimates: Mapping[str, Estimate], diag: Diagnostics, gates: OffPolicyGates,
                  target: str) -> dict[str, Verdict]:
    """Apply the gates to every estimator (see `OffPolicyGates` and docs/offpolicy.md)."""
    direct = estimates.get("direct")
    rec = _recommendation(target, direct)
    n = diag.n
    out: dict[str, Verdict] = {}
    ttc_reason = (f"only {diag.ttc:.0%} of the logged responses are typical of '{target}' (target-typical "
                  f"coverage TTC {diag.ttc:.2f} < {gates.min_ttc:.2f}): the logger rarely writes what this target "
                  f"writes, so importance weighting has a precision floor (CLE factor {diag.cle_factor:.1f}x) that "
                  "no weight stabilisation removes")

    def ess_reason(ess: float, which: str) -> str:
        return (f"the {which} weights leave an effective sample of {ess:.0%} of the {n} logged responses (< "
                f"{gates.min_ess_fraction:.0%}): the variance is inflated more than "
                f"{1 / gates.min_ess_fraction:.1f}x and the standard error itself is unreliable")

    for name, est in estimates.items():
        reasons: list[str] = []
        claim = "level"
        if name in LOGS_ONLY or name == "dr":
            fail_claim = "refused" if name in LOGS_ONLY else "downgraded"
            if not np.isfinite(est.value) or not np.isfinite(est.se):
                claim = "refused"
                reasons.append("the raw importance weights overflow double precision (their mean is "
                               f"exp({diag.log_mean_weight:.0f})), so this estimate is meaningless")
            if diag.ttc < gates.min_ttc:
                claim = max(claim, fail_claim, key=_RANK.get)
                reasons.append(ttc_reason)
            ess = diag.ess_raw if name in ("ips", "snips") else diag.ess_stabilised
            if ess < gates.min_ess_fraction:
                claim = max(claim, fail_claim, key=_RANK.get)
                reasons.append(ess_reason(ess, "raw" if name in ("ips", "snips") else "stabilised"))
            if name in ("ips", "snips") and np.isfinite(diag.hill_index) and diag.hill_index < gates.min_tail_index:
                claim = max(claim, "downgraded", key=_RANK.get)
                reasons.append(f"the largest weights are heavy-tailed (Hill tail index {diag.hill_index:.2f} < "
                               f"{gates.min_tail_index:g}): the weights' variance may be infinite, so the standard "
                               "error is unreliable")
            if name == "dr" and reasons:
                reasons.append("DR stays consistent if its outcome model is right, but its weighted correction "
                               "adds noise rather than information here")
        out[name] = Verdict(name, claim, tuple(reasons), rec if claim != "level" else None)
    stacked = estimates.get("stacked")
    if isinstance(stacked, StackedEstimate):
        reasons, claim = [], "level"
        for comp, b in stacked.coef.items():
            v = out.get(comp)
            if v is None or b <= 1e-6 or v.claim == "level":
                continue
            comp_claim = v.claim if (v.claim == "downgraded" or b >= 0.05) else "downgraded"
            claim = max(claim, comp_claim, key=_RANK.get)
            reasons.append(f"puts weight {b:.2f} on '{comp}', whose claim is {v.claim}")
        out["stacked"] = Verdict("stacked", claim, tuple(reasons), rec if claim != "level" else None)
    return out
