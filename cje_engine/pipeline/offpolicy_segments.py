"""Segments of a logs-only or hybrid evaluation: every segment evaluated by the mode's own estimator.

Off-policy segments are prompt attributes (`cje_engine.data.offpolicy.prompt_segments`): a candidate's
responses are never seen, so only a column constant within a prompt segments them. A segment's cells are the
off-policy evaluation of the segment's rows alone (`cje_engine.pipeline.offpolicy.prepare_data` on
`OffPolicyData.subset`, then the same bootstrap and `finalize`): its own calibration on its labels, its own
importance weights, SIMCal, gates, stack and refusals, so a segment level is exactly what the mode prints for
those prompts. The family is then controlled as Direct's segments are (docs/segments.md): comparisons with the
baseline adjusted over every segment x policy (BH or Holm), Benjamini-Yekutieli intervals for the claimed ones
and for the shown levels, Holm over the per-cell audits; the omnibus calibration test and the reliability
diagrams read the run's own calibration (`cje_engine.pipeline.segments.omnibus_tests`).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.inference.multiplicity import adjust, holm
from cje_engine.inference.segments import by_interval_level, normal_interval
from cje_engine.pipeline.segments import omnibus_tests, plan_segments, reliability
from cje_engine.result.jsonable import jsonable
from cje_engine.result.segments import SegmentsResult

log = logging.getLogger(__name__)

#: Why an off-policy cell's level is never "verified" (shown as its reason).
ASSUMED = ("off-policy level ({estimator}): rests on the calibration transporting to the candidate's responses and "
           "on the weights' overlap in this segment")


def segment_results(prep: Any, group: np.ndarray, group_names: list[str], shown: set[str],
                    evaluate_data: Callable[[Any, Any], dict]) -> dict[str, Any]:
    """Each shown segment's off-policy result (a dict), or the one-line reason its evaluation was refused.

    ``evaluate_data(data, options)``: the mode's whole evaluation of loaded data (prepare, bootstrap, finalize;
    `cje_engine.pipeline.offpolicy.evaluate_data`), given by the caller so this module does not import it back.
    """
    opts = prep.options
    sub_opts = replace(opts, engine=replace(opts.engine, segment_by=()))
    out: dict[str, Any] = {}
    for g, name in enumerate(group_names):
        if name not in shown:
            continue
        data = replace(prep.data.subset(np.flatnonzero(group == g)), segment_values=None)
        try:
            out[name] = evaluate_data(data, sub_opts)
        except CJEInputError as exc:  # a segment the mode cannot evaluate: no level, the reason shown
            log.info("segment %s not evaluated: %s", name, exc)
            out[name] = str(exc)
    return out


def _cell(segment: str, policy: str, sub: Any, reason: str) -> dict:
    """One segment x policy cell from the segment's result (``sub``: a dict, or the refusal's reason)."""
    block = {"segment": segment, "policy": policy, "n_rows": 0, "n_prompts": 0, "n_labels": 0, "claim_kind": "too_few",
             "estimate": None, "se": None, "ci": None, "ci_marginal": None, "assumed_estimate": None, "plug_in": None,
             "reason": reason, "audit": {"verdict": "not_run", "n_labels": 0}}
    if not isinstance(sub, dict):
        block["reason"] = f"the segment's evaluation was refused: {sub}" if sub else reason
        return block
    q = (sub.get("policies") or {}).get(policy)
    if q is None:
        block["reason"] = "no rows of this policy in the segment"
        return block
    a = q.get("audit") or {}
    block.update(n_rows=int(q.get("n_rows") or 0), n_prompts=int(q.get("n_prompts") or 0),
                 n_labels=int(q.get("n_labelled") or 0),
                 audit={"verdict": a.get("verdict") or "not_run", "n_labels": int(a.get("n_labels") or 0),
                        "residual_mean": a.get("residual_mean"), "se": a.get("se"), "p_value": a.get("p_value")})
    assumed = q.get("assumed") or {}
    if q.get("level_claim") == "ok" and q.get("estimate") is not None:  # verified, as the whole run's rule says
        kind, level = "verified", q
    elif assumed.get("level_claim") == "ok" and assumed.get("estimate") is not None:
        kind, level = "assumes_transport", assumed
    else:
        block["reason"] = "; ".join(q.get("refusal_reasons") or assumed.get("refusal_reasons") or []) or "level refused"
        return block
    estimator = (sub.get("offpolicy") or {}).get("estimator", {}).get(policy) or "direct (on-policy logs)"
    block.update(claim_kind=kind, estimate=level["estimate"], se=level.get("se"), ci_marginal=level.get("ci"),
                 reason=None if kind == "verified" else ASSUMED.format(estimator=estimator))
    if kind == "verified" and assumed.get("estimate") is not None:
        block["assumed_estimate"] = assumed["estimate"]
    return block


def _comparison(segment: str, policy: str, baseline: str, sub: Any, cells: dict) -> dict:
    """``policy - baseline`` in one segment from the segment's own comparison (raw p-value, marginal interval)."""
    out = {"segment": segment, "policy": policy, "baseline": baseline, "claim_kind": "too_few", "diff": None,
           "se": None, "df": None, "ci": None, "ci_fcr": None, "p_value": None, "p_adjusted": None,
           "significant": None, "better": None, "worse": None}
    if not isinstance(sub, dict) or "too_few" in (cells[(segment, policy)]["claim_kind"],
                                                  cells[(segment, baseline)]["claim_kind"]):
        return out
    # the same kind of level on both sides: verified if both cells are, else both assumes-transport levels
    kind = "verified" if cells[(segment, policy)]["claim_kind"] == cells[(segment, baseline)]["claim_kind"] == \
        "verified" else "assumes_transport"
    pairs = sub.get("comparisons") if kind == "verified" else (sub.get("assumes_transport") or {}).get("comparisons")
    c = next((c for c in pairs or [] if {c.get("a"), c.get("b")} == {policy, baseline}), None)
    if c is None or c.get("p_value") is None or c.get("diff") is None:
        return out
    sign = 1.0 if c["a"] == policy else -1.0  # the comparison is a - b
    ci = c.get("ci")
    out.update(claim_kind=kind, diff=sign * c["diff"], se=c.get("se"), p_value=c["p_value"],
               ci=None if not ci else sorted([sign * ci[0], sign * ci[1]]))
    return out


def summarize_offpolicy_segments(prep: Any, result: dict, evaluate_data: Callable[[Any, Any], dict]) -> dict:
    """The ``segments`` block (`cje_engine.result.segments.SegmentsResult`) of an off-policy run.

    Parameters
    ----------
    prep : `cje_engine.pipeline.offpolicy.OffPolicyPrepared` with ``segments``
    result : the run's result dict (its policies, in order: the logger, then the candidates)
    evaluate_data : the mode's evaluation of loaded data, run on each shown segment's rows (`segment_results`)
    """
    eng = prep.options.engine
    alpha, d = eng.alpha, prep.direct.design.data
    policies = list(result["policies"])
    baseline = eng.baseline if eng.baseline in policies else prep.data.logger
    group, group_names, info = plan_segments(d.policy, prep.segments.code, d.labelled, len(d.policies),
                                             prep.segments.names, eng.segment_min_rows, eng.segment_min_labels)
    status = {i["name"]: i["status"] for i in info}
    subs = segment_results(prep, group, group_names, {n for n in group_names if status.get(n) == "shown"},
                           evaluate_data)
    too_few = "too few rows or labels (segment_min_rows / segment_min_labels)"
    cells = {(g, p): _cell(g, p, subs.get(g), too_few) for g in group_names for p in policies}
    out_cells = list(cells.values())
    n_cells, n_shown = len(out_cells), sum(c["estimate"] is not None for c in out_cells)
    lvl = by_interval_level(n_shown, n_cells, alpha) or 1 - alpha
    lo, hi = eng.label_scale
    for c in out_cells:
        if c["estimate"] is not None:
            c["ci"] = (c["ci_marginal"] if abs(lvl - (1 - alpha)) < 1e-12 or c["se"] is None else
                       [max(v, lo) if i == 0 else min(v, hi) for i, v in
                        enumerate(normal_interval(c["estimate"], c["se"], lvl))])
    audited = [c for c in out_cells if c["audit"].get("p_value") is not None]
    for c, q in zip(audited, holm(np.array([c["audit"]["p_value"] for c in audited], dtype=float))):
        c["audit"]["p_adjusted"] = float(q)
    comps = [_comparison(g, p, baseline, subs.get(g), cells) for g in group_names for p in policies if p != baseline]
    live = [c for c in comps if c["p_value"] is not None and np.isfinite(c["p_value"])]
    for c, q in zip(live, adjust(np.array([c["p_value"] for c in live], dtype=float), eng.segment_claims)):
        c.update(p_adjusted=float(q), significant=bool(q <= alpha))
        c.update(better=c["significant"] and c["diff"] > 0, worse=c["significant"] and c["diff"] < 0)
    R, m = sum(bool(c["significant"]) for c in live), len(live)
    cmp_level = by_interval_level(R, m, alpha)
    for c in live:
        if c["significant"] and c["se"] is not None:
            c["ci_fcr"] = normal_interval(c["diff"], c["se"], cmp_level)
    err = {"alpha": alpha, "claims_method": eng.segment_claims, "n_comparisons": m, "n_selected": R,
           "comparison_interval_method": "by_fcr", "comparison_interval_level": cmp_level, "n_cells": n_cells,
           "n_shown": n_shown, "level_interval_level": lvl, "audit_method": "holm",
           "omnibus": f"{prep.options.mode}: each segment evaluated on its own rows by the mode's estimator (its own "
                      "calibration, weights and gates); clustered Wald chi-square on the run's calibration residuals "
                      "by segment and by score decile, one test per policy with labels and one over all labels"}
    recal = {"applied": False, "reason": "off-policy segments: each segment is evaluated with a calibration fitted on "
                                         "its own labels; no segment covariate",
             "mode": str(prep.direct.selection.get("chosen")), "covariates": list(eng.covariates)}
    block = {"columns": list(prep.segments.columns), "baseline": baseline, "partial_pooling": None,
             "min_rows": eng.segment_min_rows, "min_labels": eng.segment_min_labels, "segments": info,
             "cells": out_cells, "comparisons": comps, "error_control": err,
             "omnibus": omnibus_tests(prep.direct, group, group_names), "recalibration": recal,
             "reliability": reliability(prep.direct)}
    return SegmentsResult.model_validate(jsonable(block)).model_dump(mode="json", exclude_none=False)
