"""Off-policy candidates' result entries: the headline estimate, its gated claim, basis, audit and detail.

`target_entry` is the logs-only/hybrid counterpart of Direct's `cje_engine.pipeline.policies.summarize_direct`:
same fields, plus ``claim``, ``recommendation``, ``direct`` and the ``offpolicy`` block; it gives the candidate's
protocol (assumes-transport) level. `claimed_entry` then applies Direct's verified-claim rule
(`cje_engine.pipeline.policies.level_choice`): the reported level is the verified one from the fresh draws'
own labels, or none, and the protocol's level is kept in ``assumed`` (docs/statistics.md, "Off-policy modes").
"""
from __future__ import annotations

from typing import Any

import numpy as np

from cje_engine.inference.distributions import norm_ppf
from cje_engine.offpolicy.gates import OffPolicyGates
from cje_engine.offpolicy.target import TargetReport
from cje_engine.offpolicy.weights import mean_one_weights
from cje_engine.inference.comparisons import claim_kind
from cje_engine.pipeline.policies import level_choice, protocol_claim, support_checks, unverified_relative

#: Estimators that use the candidate's fresh draws (their validity also rests on Direct's checks).
USES_FRESH = ("dr", "direct", "stacked")

LABELS = {"ips": "IPS (raw importance weights)", "snips": "SNIPS (self-normalised importance weights)",
          "calibrated_ips": "calibrated IPS (SIMCal-stabilised importance weights)",
          "dr": "calibrated DR (fresh draws plus weighted residuals of the logs)",
          "direct": "Direct (mean calibrated reward of the fresh draws)",
          "stacked": "IF-stacked combination"}


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None


def _boot_summary(r: np.ndarray, alpha: float, scale: tuple[float, float] | None) -> dict:
    fin = r[np.isfinite(r)]
    if fin.size < 2:
        return {"se": None, "ci": None, "n_finite": int(fin.size)}
    lo, hi = np.percentile(fin, [50 * alpha, 100 - 50 * alpha])
    if scale is not None:
        lo, hi = float(np.clip(lo, *scale)), float(np.clip(hi, *scale))
    return {"se": float(np.std(fin, ddof=1)), "ci": [float(lo), float(hi)], "n_finite": int(fin.size)}


def _not_run_audit(t: str, margin: float) -> dict:
    return {"verdict": "not_run", "n_labels": 0, "margin": margin, "family_size": 0,
            "reason": f"no oracle labels on responses of '{t}' itself: the judge calibration learned on the logger is "
                      "assumed to transport to it (untested)",
            "residual_mean": None, "se": None, "ci": None, "ci_adjusted": None, "p_value": None,
            "p_adjusted": None, "extra_labels_needed": None, "calibrator": "borrowed", "deciles": []}


def _estimator_table(prep: Any, t: str, off: np.ndarray | None, se_total: dict[str, float]) -> dict[str, dict]:
    """Every estimator of candidate ``t``: influence-function and bootstrap routes, and its gate claim.

    ``se_if``/``ci_if`` are the influence-function route with the first-order calibration term
    (``se_total``: `cje_engine.offpolicy.influence`); ``se``/``ci`` the reported route: bootstrap
    percentiles, or the influence-function route when ``off`` is None (``inference="analytic"``).
    """
    rep = prep.reports[t]
    alpha = prep.options.engine.alpha
    z = float(norm_ppf(1 - alpha / 2))
    col = {key: j for j, key in enumerate(prep.layout)}
    ests: dict[str, dict] = {}
    for k, e in rep.estimates.items():
        v, se_a = _num(e.value), _num(se_total.get(k))
        ci_a = [v - z * se_a, v + z * se_a] if v is not None and se_a is not None else [None, None]
        if off is not None:
            b = _boot_summary(off[:, col[(t, k)]], alpha, None)  # raw IPS can leave the label scale: no clipping
        else:
            b = {"se": se_a, "ci": ci_a if se_a is not None else None, "n_finite": 0}
        ests[k] = {"value": v, "se_if": se_a, "ci_if": ci_a,
                   "se": b["se"], "ci": b["ci"], "n_replicates_finite": b["n_finite"],
                   "claim": rep.verdicts[k].claim}
        if hasattr(e, "coef"):
            ests[k]["coef"] = {c: float(v) for c, v in e.coef.items()}
    return ests


def _transport_refusal(t: str, audit: dict, dpol: dict | None) -> tuple[str, str]:
    """(reason, recommendation) when the candidate's own labels fail the transport audit."""
    reason = (f"the transport audit on {audit['n_labels']} own labels of '{t}' failed ({audit['reason']}): "
              "the calibration learned on the logger does not hold for this policy, so every calibrated "
              "off-policy estimate of it is biased")
    if dpol is not None and dpol["level_claim"] == "ok" and dpol["basis_code"] == "recalibrated":
        lo, hi = dpol["ci"]
        return reason, (f"use the Direct estimate recalibrated on its own {dpol['n_labelled']} labels "
                        f"({dpol['estimate']:.3f}, CI {lo:.3f} to {hi:.3f}; run with mode='direct')")
    return reason, (f"label more fresh draws of '{t}' with the oracle and use Direct (mode='direct'), "
                    "which recalibrates on a policy's own labels")


def _claim(prep: Any, t: str, head: dict, audit: dict, dpol: dict | None, support: dict, warnings: list[str]
           ) -> tuple[str, list[str], str | None, tuple[str, str | None]]:
    """The candidate's claim (level, downgraded, refused), refusal reasons, recommendation and relative
    status (docs/statistics.md: an overlap refusal or a failed transport audit drops the candidate
    from comparisons and the ranking; a refusal inherited from Direct keeps Direct's status)."""
    opts = prep.options
    rep = prep.reports[t]
    name = prep.headline[t]
    verdict = rep.verdicts[name]
    reasons: list[str] = []
    claim = verdict.claim
    recommendation = verdict.recommendation
    relative: tuple[str, str | None] = ("ok", None)
    if claim == "refused" or (claim == "downgraded" and opts.downgraded == "refused"):
        reasons.extend(verdict.reasons)
        claim = "refused"
        dg = rep.diagnostics
        relative = ("not_estimable", f"overlap refusal of the {name} estimate (TTC {dg.ttc:.2f}, stabilised ESS "
                                     f"{dg.ess_stabilised:.0%})")
    if audit["verdict"] == "fail":
        claim = "refused"
        relative = ("not_estimable", "transport audit failed; off-policy estimates cannot be recalibrated")
        reason, recommendation = _transport_refusal(t, audit, dpol)
        reasons.append(reason)
    if dpol is None and support["limited"]:
        # the support rule on the calibrated rewards of a logs-only target (docs/statistics.md)
        reasons.append(f"limited calibration support: {support['share_thin']:.0%} of the {name} estimate's weight "
                       "on the logged rewards lies on judge scores where calibration labels are thin or absent")
        if claim != "refused":
            claim = "refused"
            relative = ("rank_only", "limited calibration support: rank-only, conservative intervals")
            recommendation = (f"label logged responses whose judge scores resemble those of '{t}' (the thinly "
                              "supported range), or collect its fresh draws and use Direct")
    if audit["verdict"] == "inconclusive" and claim != "refused":
        warnings.append(f"{t}: the {name} estimate uses the calibration learned on the logger; the transport audit on "
                        f"{audit['n_labels']} own labels of '{t}' is inconclusive ({audit['reason']}), so this level "
                        "and comparisons with it rest on that calibration transporting (Direct, mode='direct', uses "
                        "the own labels instead)")
    if dpol is not None and name in USES_FRESH and dpol["level_claim"] == "refused" and dpol["basis_code"] == "plug_in":
        coef = head.get("coef", {})
        if name != "stacked" or coef.get("direct", 0) + coef.get("dr", 0) > 1e-6:
            claim = "refused"
            reasons.extend(f"Direct on the fresh draws: {r}" for r in dpol["refusal_reasons"])
            if relative[0] == "ok":
                relative = (dpol.get("relative_claim") or "not_estimable", dpol.get("relative_reason"))
            if recommendation is None or verdict.claim == "level":
                recommendation = (f"label a sample of the fresh draws of '{t}' with the oracle so the calibration "
                                  "covers its judge scores, then use Direct (mode='direct'), which recalibrates on "
                                  "a policy's own labels")
    if claim == "refused":
        if recommendation is None:
            recommendation = verdict.recommendation or (
                f"collect fresh draws of '{t}' and evaluate them with Direct (mode='direct')")
        reasons.append(f"recommendation: {recommendation}")
    elif claim == "downgraded":
        warnings.append(f"{t}: the {name} estimate's claim is downgraded (its interval may be unreliable): "
                        + "; ".join(verdict.reasons))
    return claim, reasons, recommendation, relative


def _raw_judge(prep: Any, t: str) -> tuple[float, str]:
    fresh = prep.fresh[t]
    if fresh is not None:
        return float(np.mean(fresh.scores)), "mean judge score of the fresh draws"
    w = mean_one_weights(prep.logged[t].log_w)
    return (float(np.sum(w * prep.logged[t].scores) / np.sum(w)),
            "importance-weighted (self-normalised) mean judge score of the logs")


def target_support(prep: Any, t: str, direct_policies: dict) -> dict:
    """Calibration support of candidate ``t``: Direct's check of its fresh draws (hybrid) or, for a
    logs-only target, the logged judge scores weighted by the headline estimate's weights on the
    calibrated rewards (the target's reweighted score distribution; `support_checks`)."""
    if prep.fresh[t] is not None:
        return direct_policies[t]["support"]
    a_logged = prep.reports[t].reward_weights[prep.headline[t]][0]
    sup = support_checks(prep.direct.design, prep.direct.options, [prep.direct.design.data.score[prep.logged_rows]],
                         [a_logged])[0]
    sup["rule"] += f"; shares weighted by the {prep.headline[t]} estimate's weights on the logged rewards"
    return sup


def uses_direct_level(prep: Any, t: str, direct_policies: dict) -> bool:
    """Hybrid: a candidate whose own labels fail the transport audit and allow a recalibration takes
    Direct's level path (its recalibrated level from the fresh draws and own labels), as in Direct."""
    dpol = direct_policies.get(t) if prep.fresh[t] is not None else None
    return dpol is not None and dpol["audit"]["verdict"] == "fail" and dpol["basis_code"] == "recalibrated"


def _direct_level(entry: dict, dpol: dict, t: str) -> dict:
    """The entry of a candidate on Direct's level path: Direct's recalibrated level and its claims;
    the off-policy estimates stay in the ``offpolicy`` block for reference only."""
    out = dict(entry)
    for k in ("estimate", "se", "ci", "ci_method", "selective", "level_claim", "refusal_reasons", "basis_code",
              "augmented",
              "variance_share_calibration", "variance_components", "se_analytic", "se_bootstrap",
              "relative_claim", "relative_reason"):
        out[k] = dpol.get(k)
    out["claim"] = "level" if dpol["level_claim"] == "ok" else "refused"
    out["recommendation"] = None
    out["basis"] = (f"hybrid, Direct's level path: the transport audit on {dpol['n_labelled']} own labels of '{t}' "
                    "failed, so the off-policy estimates (which rest on the logger's calibration) are not used; "
                    + dpol["basis"])
    out["offpolicy"] = {**entry["offpolicy"], "estimator": "direct_recalibrated"}
    return out


def target_entry(prep: Any, t: str, off: np.ndarray | None, direct_policies: dict, warnings: list[str],
                 variance: dict, se_total: dict[str, float]) -> dict:
    """The result entry of off-policy candidate ``t``.

    Parameters
    ----------
    prep : `cje_engine.pipeline.offpolicy.OffPolicyPrepared`
    off : the off-policy replicates (columns in ``prep.layout`` order), None for the analytic route
    direct_policies : Direct's entries of the design policies (the logger, and fresh draws)
    variance : ``{"variance_components": ..., "variance_share_calibration": ...}`` of the headline
    se_total : estimator -> influence-function SE including the first-order calibration term
    """
    eng = prep.options.engine
    name = prep.headline[t]
    ests = _estimator_table(prep, t, off, se_total)
    head = ests[name]
    dpol = direct_policies.get(t) if prep.fresh[t] is not None else None
    audit = dpol["audit"] if dpol is not None else _not_run_audit(
        t, eng.audit_margin_in())
    support = target_support(prep, t, direct_policies)
    direct_path = uses_direct_level(prep, t, direct_policies)
    claim, reasons, recommendation, relative = _claim(prep, t, head, audit, dpol, support,
                                                      [] if direct_path else warnings)
    rep = prep.reports[t]
    fresh = prep.fresh[t]
    n_fresh = 0 if fresh is None else fresh.n
    n_logged = prep.data.n_logged
    raw_judge, raw_judge_basis = _raw_judge(prep, t)
    where = "logs-only" if fresh is None else "hybrid"
    basis = (f"{where}: {LABELS[name]} of '{t}' from {n_logged} logged responses of '{prep.data.logger}'"
             + (f" and {n_fresh} fresh draws" if n_fresh else "")
             + "; rewards = the judge calibration learned on the labelled rows")
    if name == "stacked" and "coef" in head:
        basis += " (weights " + ", ".join(f"{k} {v:.2f}" for k, v in head["coef"].items()) + ")"
    ci = head["ci"]
    if ci is not None:  # the headline interval is clipped to the label scale, as Direct's
        ci = [float(np.clip(ci[0], *eng.label_scale)), float(np.clip(ci[1], *eng.label_scale))]
    entry = {
        "estimate": head["value"], "se": head["se"], "ci": ci,
        "level_claim": "refused" if claim == "refused" else "ok", "refusal_reasons": reasons,
        "claim": "refused" if claim == "refused" else claim,
        "recommendation": recommendation if claim != "level" else None,
        "basis": basis, "basis_code": f"{where}/{name}",
        "transport": "audited" if audit["verdict"] != "not_run" else "unaudited",
        "plug_in": ({k: dpol["plug_in"][k] for k in ("estimate", "se", "ci")} if dpol is not None else None),
        "augmented": None,
        "raw_judge_mean": raw_judge, "raw_judge_basis": raw_judge_basis,
        "oracle_mean": dpol["oracle_mean"] if dpol is not None else None,
        "oracle_only": dpol.get("oracle_only") if dpol is not None else None,
        "n_rows": n_logged + n_fresh, "n_logged": n_logged, "n_fresh": n_fresh,
        "n_labelled": 0 if dpol is None else int(dpol["n_labelled"]),
        "variance_share_calibration": variance["variance_share_calibration"],
        "variance_components": variance["variance_components"],
        "se_analytic": head["se_if"], "se_bootstrap": head["se"] if off is not None else None,
        "support": support,
        "audit": audit,
        "relative_claim": relative[0], "relative_reason": relative[1],
        "direct": ({k: dpol[k] for k in ("estimate", "se", "ci", "level_claim", "refusal_reasons", "basis_code")}
                   if dpol is not None else None),
        "offpolicy": {
            "estimator": name, "estimates": ests,
            "diagnostics": rep.to_dict()["diagnostics"],
            "verdicts": {k: {"claim": v.claim, "reasons": list(v.reasons), "recommendation": v.recommendation}
                         for k, v in rep.verdicts.items()},
            "gate_checks": gate_checks(rep, prep.options.gates),
            "stack_candidates": list(rep.stack_candidates),
        },
    }
    return _direct_level(entry, dpol, t) if direct_path else entry


#: The fields of an `AssumedLevel` (the protocol's level kept beside the reported one).
ASSUMED_FIELDS = ("estimate", "se", "ci", "ci_method", "basis_code", "basis", "level_claim", "refusal_reasons")


def protocol_view(dpol: dict, relative: tuple[str, str | None]) -> dict:
    """Direct's entry of a design policy with its protocol's (assumes-transport) level in the reported fields.

    The off-policy candidate entries are built on the protocol's levels (`target_entry`); Direct's verified
    level is applied on top of them by `claimed_entry`. ``relative``: the protocol level's relative status
    (`cje_engine.pipeline.policies.DirectSummaries.assumed_relative`). Under a non-default ``level_estimator``
    the view equals the entry.
    """
    a = dpol.get("assumed")
    if a is None:
        return dpol
    out = dict(dpol)
    out.update({k: a.get(k) for k in ASSUMED_FIELDS})
    out["relative_claim"], out["relative_reason"] = relative
    return out


def _recommend_verification(t: str, dpol: dict | None, min_labels: int) -> str:
    if dpol is None:
        return (f"collect fresh draws of '{t}' and label at least {min_labels} of them with the oracle (hybrid or "
                "Direct): its own labels verify a level; or declare trust_transport for it")
    need = (dpol.get("labels_to_verify") or {}).get("n_labels", min_labels)
    return (f"label {need} more fresh draws of '{t}' with the oracle (labels_to_verify): its own labels verify a "
            "level; or declare trust_transport for it")


def claimed_entry(entry: dict, t: str, dpol: dict | None, verified_mode: bool, trusted: bool,
                  min_labels: int) -> tuple[dict, str]:
    """Candidate ``t``'s entry under the verified-claim rule of every mode (`level_choice`).

    Parameters
    ----------
    entry : the candidate's protocol entry (`target_entry`): the gated off-policy headline, or Direct's
        recalibrated level after a failed audit
    dpol : Direct's reported entry of the candidate's fresh draws (hybrid), or None (no fresh draws)
    verified_mode, trusted, min_labels : the engine's ``level_estimator == "verified"``,
        ``trusts(t)`` and ``min_labels``

    Returns
    -------
    (dict, str)
        The entry and the choice: ``"verified"`` (Direct's verified level of the fresh draws is reported, its
        column in the comparisons), ``"unverified"`` (estimate null, ``level_claim: assumes_transport``) or
        ``"protocol"`` (the protocol's level: refused, trusted, or a non-default estimator). The protocol's level
        is in ``assumed`` in every case.
    """
    out = dict(entry)
    out["assumed"] = {k: entry.get(k) for k in ASSUMED_FIELDS}
    if dpol is not None:  # Direct's reported entry of the fresh draws (what mode='direct' reports)
        out["direct"] = {k: dpol[k] for k in ("estimate", "se", "ci", "level_claim", "refusal_reasons", "basis_code")}
    has_verified = dpol is not None and dpol.get("basis_code") == "power_tuned"
    n_own = int(entry.get("n_labelled") or 0)
    choice = level_choice(verified_mode, has_verified, False, entry["level_claim"] == "refused", trusted)
    if choice == "verified":
        for k in ("estimate", "se", "ci", "ci_method", "selective", "level_claim", "refusal_reasons", "basis_code",
                  "verified", "augmented", "variance_share_calibration", "variance_components", "se_analytic",
                  "se_bootstrap", "relative_claim", "relative_reason"):
            out[k] = dpol.get(k)
        out["basis"] = f"hybrid, Direct on the fresh draws of '{t}': {dpol['basis']}"
        out["claim"], out["recommendation"] = "level", None
        return out, choice
    out["labels_to_verify"] = dpol.get("labels_to_verify") if dpol is not None and verified_mode else None
    if choice == "unverified":
        out.update(estimate=None, se=None, ci=None, ci_method=None, selective=None, level_claim="assumes_transport",
                   refusal_reasons=[], se_analytic=None, se_bootstrap=None,
                   basis=f"assumes transport: {entry['basis']}",
                   recommendation=_recommend_verification(t, dpol, min_labels))
        rel = unverified_relative(n_own, min_labels)
        out["relative_claim"], out["relative_reason"] = rel[0], (
            rel[1] if dpol is not None else f"no verified level (no fresh draws of '{t}' to label)")
        return out, choice
    claim, basis, rel = protocol_claim(verified_mode, entry["level_claim"], claim_kind(entry["basis_code"])
                                       == "assumes_transport", trusted, entry["basis"],
                                       (entry["relative_claim"], entry["relative_reason"]), n_own, min_labels,
                                       what=f"its {entry['offpolicy']['estimator']} estimate")
    out["level_claim"], out["basis"] = claim, basis
    out["relative_claim"], out["relative_reason"] = rel
    return out, choice


def gate_checks(rep: TargetReport, gates: OffPolicyGates) -> list[dict]:
    """The result's gate checks of one target: each gate's value, threshold, pass flag and what it applies to.

    Parameters
    ----------
    rep : TargetReport
        The target's report (its diagnostics are read).
    gates : OffPolicyGates
        The thresholds.

    Returns
    -------
    list of dict
        One entry per gate (``ttc``, ``ess_raw``, ``ess_stabilised``, ...).
    """
    d = rep.diagnostics
    return [
        {"gate": "ttc", "value": _num(d.ttc), "threshold": gates.min_ttc, "passed": bool(d.ttc >= gates.min_ttc),
         "applies_to": "ips, snips, calibrated_ips (refused); dr (downgraded)"},
        {"gate": "ess_raw", "value": _num(d.ess_raw), "threshold": gates.min_ess_fraction,
         "passed": bool(d.ess_raw >= gates.min_ess_fraction), "applies_to": "ips, snips (refused)"},
        {"gate": "ess_stabilised", "value": _num(d.ess_stabilised), "threshold": gates.min_ess_fraction,
         "passed": bool(d.ess_stabilised >= gates.min_ess_fraction),
         "applies_to": "calibrated_ips (refused); dr (downgraded)"},
        {"gate": "tail_index", "value": _num(d.hill_index), "threshold": gates.min_tail_index,
         "passed": bool(not np.isfinite(d.hill_index) or d.hill_index >= gates.min_tail_index),
         "applies_to": "ips, snips (downgraded)"},
    ]
