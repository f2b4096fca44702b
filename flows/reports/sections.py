"""HTML sections of the evaluation report (summary, tables, audit, comparisons, calibration, drift, footer)."""
from __future__ import annotations

import json
from typing import Any, Sequence

from cje_engine.result.model import (AssumedClaims, AssumedLevel, Audit, Calibration, Comparison, Decile,
                                     EvaluationModel, LabelsToVerify, Multiplicity, PolicyResult, RankAgreement,
                                     ReliabilityBin, Selection, StatSummary, Support)
from flows.reports.charts import audit_svg, calibration_svg, drift_svg
from flows.reports.common import (VERDICT_STYLE, as_number, as_pair, conf_label, esc, fmt, fmt_ci, fmt_p, is_refused,
                                  name_cell, not_estimable_reason, pct, rank_text, same_scale, scale_text, scales_of,
                                  signed, verdict_of)

# --------------------------------------------------------------------------------------------
# HTML pieces
# --------------------------------------------------------------------------------------------
def _badge(verdict: str) -> str:
    sym, label, _ = VERDICT_STYLE.get(verdict, VERDICT_STYLE["not_run"])
    return f'<span class="badge v-{esc(verdict)}">{esc(sym)} {esc(label)}</span>'


def _claim_badge(pol: dict | PolicyResult) -> str:
    if is_refused(pol):
        return ('<span class="badge refused" title="level claim refused: ranked only, no level '
                'may be quoted">refused</span>')
    return '<span class="badge ok">quotable</span>'


def _join_names(names: Sequence[str]) -> str:
    parts = [f"<b>{esc(n)}</b>" for n in names]
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def strip_winner_prefix(reason: Any) -> str:
    """Drop a leading "no clear winner:" from the engine's reason (the report says it already)."""
    text = str(reason).strip() if reason else ""
    low = text.lower()
    if low.startswith("no clear winner"):
        text = text[len("no clear winner"):].lstrip(" :;,\u2014-")
    return text


def summary_html(m: EvaluationModel, order: list[str], alpha: float, drift: dict | None) -> str:
    """The summary section: quotable, assumed and refused levels, best policy, audits, rank agreement, drift."""
    pols = m.policies
    conf = conf_label(alpha)
    items: list[tuple[str, str]] = []
    assumed = [n for n in order if pols[n].level_claim == "assumes_transport"]
    quotable = [n for n in order if not is_refused(pols[n]) and n not in assumed]
    refused = [n for n in order if is_refused(pols[n])]
    if quotable:
        lines = []
        for n in quotable:
            p = pols[n]
            ci = as_pair(p.ci)
            ci_txt = f" ({conf} CI {fmt(ci[0])}\u2013{fmt(ci[1])})" if ci else ""
            note = ""
            if p.transport == "unaudited" or verdict_of(p) == "not_run":
                note = " <span class='note'>unaudited: rests on the assumption that the " \
                       "calibration transports</span>"
            elif verdict_of(p) == "inconclusive":
                note = " <span class='note'>audit inconclusive</span>"
            lines.append(f"<li><b>{esc(n)}</b>: <span class='num'>{esc(fmt(p.estimate))}"
                         f"</span>{esc(ci_txt)}{note}</li>")
        items.append(("ok", f"<p><b>Verified</b> levels that can be quoted (oracle scale; own labels correct "
                            f"them, no transport assumed):</p><ul>{''.join(lines)}</ul>"))
    else:
        items.append(("bad", "<p>No policy has a verified level.</p>"))
    if assumed:
        lines = []
        for n in assumed:
            p = pols[n]
            a = p.assumed if isinstance(p.assumed, AssumedLevel) else None
            ci = as_pair(a.ci if a else None)
            ci_txt = f" ({conf} CI {fmt(ci[0])}\u2013{fmt(ci[1])})" if ci else ""
            ltv = p.labels_to_verify if isinstance(p.labels_to_verify, LabelsToVerify) else None
            need = (f"; about {ltv.n_labels} more own labels would verify it"
                    if ltv is not None and isinstance(ltv.n_labels, int) and ltv.n_labels > 0 else
                    f"; {p.recommendation}" if ltv is None and p.recommendation else "")  # logs-only: fresh draws
            lines.append(f"<li><b>{esc(n)}</b>: <span class='num'>{esc(fmt(a.estimate if a else None))}</span>"
                         f"{esc(ci_txt)} <span class='note'>assumes transport{esc(need)}</span></li>")
        items.append(("warn", "<p><b>Assumes transport</b> (not verified: the calibrated plug-in, or the off-policy "
                              "estimate, rests on the calibration transporting to the policy; not used for the best "
                              "policy or a gate):"
                              f"</p><ul>{''.join(lines)}</ul>"))
    if refused:
        lines = []
        for n in refused:
            reasons = [str(r) for r in pols[n].refusal_reasons or []] or [
                "no reason given by the engine"]
            lines.append(f"<li><b>{esc(n)}</b>: {'; '.join(esc(r) for r in reasons)}</li>")
        items.append(("bad", "<p>Level claims <b>refused</b> (ranked only; do not quote a level):"
                             f"</p><ul>{''.join(lines)}</ul>"))
    best = m.best_policy
    reason = strip_winner_prefix(m.best_policy_reason)
    reason_txt = f" \u2014 {esc(reason)}" if reason else ""
    if best is not None:
        items.append(("ok", f"<p>Best policy: <b>{esc(best)}</b>{reason_txt}</p>"))
    else:
        items.append(("warn", f"<p><b>No clear winner</b>{reason_txt}</p>"))
    assumed_claims = m.assumes_transport
    if isinstance(assumed_claims, AssumedClaims):
        a_best = assumed_claims.best_policy
        a_reason = strip_winner_prefix(assumed_claims.best_policy_reason)
        items.append(("warn", "<p><b>Assuming transport</b> (the paper's protocol, not verified): best policy "
                              f"<b>{esc(a_best or 'none')}</b>" + (f" \u2014 {esc(a_reason)}" if a_reason else "")
                              + ". Not the basis of the best policy or a gate.</p>"))
    failed = [n for n in order if verdict_of(pols[n]) == "fail"]
    inconclusive = [n for n in order if verdict_of(pols[n]) == "inconclusive"]
    not_run = [n for n in order if verdict_of(pols[n]) == "not_run"]
    passed = [n for n in order if verdict_of(pols[n]) == "pass"]
    audit_parts = []
    if failed:
        details = []
        for n in failed:
            a = pols[n].audit if isinstance(pols[n].audit, Audit) else None
            details.append(f"<b>{esc(n)}</b> (mean residual {esc(signed(a.residual_mean if a else None))}"
                           f" on {esc('?' if a is None or a.n_labels is None else a.n_labels)} labels)")
        audit_parts.append("Transport audit <b>failed</b> for " + ", ".join(details) +
                           ": the calibration learned elsewhere does not hold for "
                           + ("this policy." if len(failed) == 1 else "these policies."))
    if inconclusive:
        details = []
        for n in inconclusive:
            a = pols[n].audit if isinstance(pols[n].audit, Audit) else None
            extra = a.extra_labels_needed if a else None
            details.append(f"<b>{esc(n)}</b>" + (f" (about {esc(extra)} more labels needed)"
                                                 if extra is not None else ""))
        audit_parts.append("Audit inconclusive for " + ", ".join(details) + ".")
    if not_run:
        audit_parts.append("Not audited (no oracle labels of their own): " + _join_names(not_run)
                           + ".")
    if passed:
        audit_parts.append("Audit passed for " + _join_names(passed) + ".")
    if audit_parts:
        kind = "bad" if failed else ("warn" if inconclusive or not_run else "ok")
        items.append((kind, "<p>" + " ".join(audit_parts) + "</p>"))
    ra = m.rank_agreement if isinstance(m.rank_agreement, RankAgreement) else None
    tau = as_number(ra.kendall_tau_b_raw_vs_calibrated) if ra else None
    raw_order = [str(x) for x in (ra.raw_order if ra else None) or []]
    cal_order = [str(x) for x in (ra.calibrated_order if ra else None) or []]
    if tau is not None or raw_order:
        tau_txt = f"Kendall \u03c4-b = {fmt(tau, 2)}" if tau is not None else "\u03c4 not given"
        if raw_order and raw_order == cal_order or (tau is not None and tau >= 0.999):
            items.append(("ok", f"<p>The raw judge and the calibrated estimates rank the policies "
                                f"the same way ({esc(tau_txt)}).</p>"))
        else:
            orders = ""
            if raw_order and cal_order:
                orders = (" Raw judge order: " + " &gt; ".join(esc(n) for n in raw_order)
                          + "; calibrated order: " + " &gt; ".join(esc(n) for n in cal_order) + ".")
            items.append(("warn", f"<p>The raw judge ranking <b>disagrees</b> with the calibrated "
                                  f"ranking ({esc(tau_txt)}).{orders}</p>"))
    if drift is not None:
        alarms = [p for p, a in zip(drift["periods"], drift["alarms"]) if a]
        if alarms:
            items.append(("bad", "<p>Judge drift <b>alarm</b> in period(s) "
                                 + ", ".join(esc(p) for p in alarms) + ".</p>"))
        else:
            items.append(("ok", f"<p>No judge drift alarm over {len(drift['periods'])} "
                                "period(s).</p>"))
    warnings = [str(w) for w in m.warnings or []]
    if warnings:
        items.append(("warn", f"<p>{len(warnings)} engine warning(s); see "
                              "<a href='#warnings'>Warnings</a>.</p>"))
    body = "".join(f'<div class="item {kind}">{content}</div>' for kind, content in items)
    return f'<section id="summary" class="summary"><h2>Summary</h2>{body}</section>'


def _raw_header(result: Any) -> str:
    """The raw judge column is on the judge's scale; say so when that is not the label scale."""
    if same_scale(result):
        return "raw judge"
    return f"raw judge ({esc(scale_text(scales_of(result)[0]))})"


def _claim_word(p: PolicyResult) -> str:
    """verified, assumes transport, refused (off-policy levels: ok)."""
    claim = str(p.level_claim)
    if claim == "ok":
        return "verified" if p.verified is not None else "ok"
    return "assumes transport" if claim == "assumes_transport" else claim


def _or_na(value: Any) -> Any:
    return "n/a" if value is None else value


def policy_table(m: EvaluationModel, order: list[str], alpha: float) -> str:
    """The policy estimates table of the report (typed result, `flows.reports.common.result_model`)."""
    pols = m.policies
    conf = conf_label(alpha)
    head = ("<tr><th class='r' title='1 + the policies significantly better; a range (1-3) when the comparisons "
            "leave it open'>rank</th><th>policy</th><th class='r'>estimate</th>"
            f"<th class='r'>{conf} CI</th><th class='r'>SE</th><th>claim / basis</th>"
            f"<th>audit</th><th class='r'>{_raw_header(m)}</th><th class='r'>oracle mean</th>"
            "<th class='r'>labels / rows</th>"
            "<th class='r' title='share of the variance due to calibration'>calib. var.</th>"
            "<th>support</th></tr>")
    rows = []
    for n in order:
        p = pols[n]
        refused = is_refused(p)
        sup = p.support if isinstance(p.support, Support) else None
        sup_txt = ("limited" if sup.limited else "ok") if sup else "n/a"
        sup_tip = (f"{pct(sup.share_outside_range)} of scores outside the labelled range, "
                   f"{pct(sup.share_thin)} in thinly labelled regions") if sup else ""
        if refused:
            est = f"<td class='c' colspan='3'>{_claim_badge(p)}</td>"
        elif p.level_claim == "assumes_transport" and p.estimate is None:
            a = p.assumed if isinstance(p.assumed, AssumedLevel) else None
            est = (f"<td class='c' colspan='3' title='not verified by the policy&#39;s own labels'>assumes transport: "
                   f"<span class='num'>{esc(fmt(a.estimate if a else None))} {esc(fmt_ci(a.ci if a else None))}"
                   "</span></td>")
        else:
            est = (f"<td class='r num'><b>{esc(fmt(p.estimate))}</b></td>"
                   f"<td class='r num'>{esc(fmt_ci(p.ci))}</td>"
                   f"<td class='r num'>{esc(fmt(p.se))}</td>")
        tr_cls = " class='is-refused'" if refused else ""
        rows.append(
            f"<tr{tr_cls}><td class='r num rank'>{esc(rank_text(m, n))}</td>"
            f"<td class='name'>{name_cell(n)}</td>"
            f"{est}"
            f"<td title='{esc(p.basis or '')}'>{esc(_claim_word(p))}<br>"
            f"<small>{esc(p.basis_code or 'n/a')}</small></td>"
            f"<td title='transport: {esc(p.transport or 'n/a')}'>{_badge(verdict_of(p))}</td>"
            f"<td class='r num'>{esc(fmt(p.raw_judge_mean))}</td>"
            f"<td class='r num'>{esc(fmt(p.oracle_mean))}</td>"
            f"<td class='r num'>{esc(_or_na(p.n_labelled))} / "
            f"{esc(_or_na(p.n_rows))}</td>"
            f"<td class='r num'>{esc(pct(p.variance_share_calibration))}</td>"
            f"<td title='{esc(sup_tip)}'>{esc(sup_txt)}</td></tr>")
    bases = []
    for n in order:
        p = pols[n]
        if p.basis:
            bases.append(f"<li><b>{esc(n)}</b>: {esc(p.basis)}</li>")
    basis_list = f"<ul class='bases'>{''.join(bases)}</ul>" if bases else ""
    return (f"<div class='scroll'><table class='data'><thead>{head}</thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>{basis_list}")


def estimator_table(m: EvaluationModel, order: list[str], alpha: float) -> str:
    """Plug-in vs augmented numbers for quotable policies (refused ones stay hidden)."""
    pols = m.policies
    conf = conf_label(alpha)
    rows = []
    for n in order:
        p = pols[n]
        if is_refused(p):
            rows.append(f"<tr class='is-refused'><td class='name'>{name_cell(n)}</td>"
                        "<td class='r refused-cell' colspan='4'>refused</td></tr>")
            continue
        cells = []
        for part in (p.plug_in, p.augmented):
            if not isinstance(part, StatSummary):
                cells.append("<td class='r muted' colspan='2'>not available</td>")
            else:
                cells.append(f"<td class='r num'>{esc(fmt(part.estimate))}</td>"
                             f"<td class='r num'>{esc(fmt_ci(part.ci))}</td>")
        rows.append(f"<tr><td class='name'>{name_cell(n)}</td>{''.join(cells)}</tr>")
    return ("<div class='scroll'><table class='data'><thead><tr><th>policy</th>"
            f"<th class='r'>plug-in</th><th class='r'>{conf} CI</th><th class='r'>augmented</th>"
            f"<th class='r'>{conf} CI</th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>")

def audit_section(m: EvaluationModel, order: list[str], alpha: float) -> str:
    """The transport audit section: one panel per audited policy and the audit table (typed result)."""
    pols = m.policies
    panels = []
    rows = []
    adj = (m.config if isinstance(m.config, dict) else {}).get("audit_adjustment")
    for n in order:
        a = pols[n].audit if isinstance(pols[n].audit, Audit) else Audit.model_construct(
            **{f: None for f in Audit.model_fields})
        verdict = verdict_of(pols[n])
        extra = a.extra_labels_needed
        extra_txt = "\u2013" if extra is None else str(extra)
        rows.append(
            f"<tr><td class='name'>{name_cell(n)}</td><td>{_badge(verdict)}</td>"
            f"<td class='r num'>{esc(_or_na(a.n_labels))}</td>"
            f"<td class='r num'>{esc(signed(a.residual_mean))}</td>"
            f"<td class='r num'>{esc(fmt_ci(a.ci_adjusted or a.ci))}</td>"
            f"<td class='r num'>{esc(fmt_p(a.p_adjusted))}</td>"
            f"<td>{esc(a.calibrator or 'n/a')}</td>"
            f"<td class='r num'>{esc(extra_txt)}</td>"
            f"<td class='reason'>{esc(a.reason or '')}</td></tr>")
        has_data = any(isinstance(d, Decile) and as_number(d.mean_residual) is not None
                       for d in a.deciles or []) or as_number(a.residual_mean) is not None
        if verdict != "not_run" and has_data:
            caption = (f"mean residual {signed(a.residual_mean)}, adjusted CI "
                       f"{fmt_ci(a.ci_adjusted or a.ci)} on {'?' if a.n_labels is None else a.n_labels} "
                       f"labels; margin \u00b1{fmt(a.margin, 2)}")
            panels.append(f"<figure class='panel'><figcaption><b>{esc(n)}</b> {_badge(verdict)}"
                          f"<span class='cap'>{esc(caption)}</span></figcaption>"
                          f"{audit_svg(n, a, alpha)}</figure>")
    not_audited = [n for n in order if verdict_of(pols[n]) == "not_run"]
    note = (f"<p class='note'>Not audited (no own labels): {_join_names(not_audited)}.</p>"
            if not_audited else "")
    grid = (f"<div class='panels'>{''.join(panels)}</div>" if panels
            else "<p class='muted'>No policy has audit residuals to show.</p>")
    head = ("<tr><th>policy</th><th>verdict</th><th class='r'>labels</th>"
            "<th class='r'>mean residual</th>"
            "<th class='r'>adjusted CI</th><th class='r'>adj. p</th>"
            "<th>calibrator</th><th class='r'>more labels</th><th>reason</th></tr>")
    adj_txt = f" ({esc(str(adj).title())} over audited policies)" if adj else ""
    return (f"<p class='lead'>Residual = oracle label \u2212 calibrated score on each policy's own "
            f"labelled rows, with a calibrator not trained on those rows. Points: bin means with "
            f"{conf_label(alpha)} intervals; diamond: overall mean with its adjusted CI{adj_txt}; "
            f"green band: the practical margin. Compensating errors across bins can cancel in the "
            f"overall mean. Each panel has its own vertical scale.</p>{grid}{note}"
            f"<div class='scroll'><table class='data'><thead>{head}</thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def comparisons_table(m: EvaluationModel, alpha: float) -> str:
    """The pairwise comparisons table of the report (typed result)."""
    rows = []
    pols = m.policies
    conf = conf_label(alpha)
    comps = [c for c in m.comparisons or [] if isinstance(c, Comparison)]
    for c in comps:
        a, b = str(c.a), str(c.b)
        involves = bool(c.involves_refused) or any(is_refused(pols[x]) for x in (a, b) if x in pols)
        why = not_estimable_reason(c)
        if why is not None:
            rows.append(f"<tr class='is-refused not-estimable'><td class='name'>{name_cell(a)}</td>"
                        f"<td class='name'>{name_cell(b)}</td><td class='refused-cell' colspan='6'>not estimable: "
                        f"{esc(why)}</td><td></td></tr>")
            continue
        sig = bool(c.significant)
        sig_txt = "<span class='sig'>\u2713 yes</span>" if sig else "no"
        rows.append(
            f"<tr><td class='name'>{name_cell(a)}</td><td class='name'>{name_cell(b)}</td>"
            f"<td class='r num'>{esc(signed(c.diff))}</td>"
            f"<td class='r num'>{esc(fmt_ci(c.ci))}</td>"
            f"<td class='r num'>{esc(fmt_p(c.p_value))}</td>"
            f"<td class='r num'>{esc(fmt_p(c.p_adjusted))}</td>"
            f"<td class='c'>{sig_txt}</td>"
            f"<td class='r num'>{esc(fmt(c.prob_a_better, 2))}</td>"
            f"<td class='note'>{'relative only (refused policy)' if involves else ''}</td></tr>")
    if not rows:
        return "<p class='muted'>No pairwise comparisons in this result.</p>"
    mult = m.multiplicity if isinstance(m.multiplicity, Multiplicity) else None
    config = m.config if isinstance(m.config, dict) else {}
    method = str((mult.method if mult else None) or config.get("multiplicity") or "")
    n_ne = sum(1 for c in comps if not_estimable_reason(c))
    caption = (f"{len(rows) - n_ne} comparisons reported"
               + (f", {n_ne} not estimable" if n_ne else "")
               + f"; p-values adjusted by {esc(method.upper() or 'n/a')} at "
               f"\u03b1 = {esc(fmt(mult.alpha if mult is not None and mult.alpha is not None else alpha, 2))}.")
    return (f"<p class='lead'>{caption} Differences are a \u2212 b on the oracle scale; comparisons "
            f"involving a refused policy are relative claims only.</p><div class='scroll'>"
            "<table class='data'><thead><tr><th>a</th><th>b</th><th class='r'>diff (a\u2212b)</th>"
            f"<th class='r'>{conf} CI</th><th class='r'>p</th><th class='r'>adj. p</th>"
            "<th class='c'>significant</th><th class='r'>P(a better)</th><th></th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def _uses_covariates(mode: str | None) -> bool:
    """Does the calibration mode ``mode`` read covariates (the registry's entry says; unknown: no)?"""
    from cje_engine.calibration import registry
    from cje_engine.errors import CJEInputError

    try:
        return bool(mode) and registry.get(mode).uses_covariates
    except CJEInputError:  # a result written by a mode this build does not know
        return False

def calibration_section(m: EvaluationModel) -> str:
    """The calibration section: mode, selection, training labels, curve and reliability (typed result)."""
    cal = m.calibration if isinstance(m.calibration, Calibration) else None
    config = m.config if isinstance(m.config, dict) else {}
    if cal is None or all(v is None for v in cal.__dict__.values()):  # absent, or given as {}
        return "<p class='muted'>No calibration information in this result.</p>"
    sel = cal.selection if isinstance(cal.selection, Selection) else None
    sel = None if sel is None or all(v is None for v in sel.__dict__.values()) else sel
    facts = [f"mode used: <b>{esc(cal.mode or 'n/a')}</b>"]
    if sel:
        facts.append(f"requested: {esc(sel.requested or 'n/a')}")
        rmse = sel.oof_rmse if isinstance(sel.oof_rmse, dict) else {}
        if rmse:
            facts.append("out-of-fold RMSE: " + ", ".join(
                f"{esc(k)} {esc(fmt(v))}" for k, v in rmse.items()))
    facts.append(f"trained on {esc(_or_na(cal.n_train))} labels")
    lr = as_pair(cal.label_range)
    if lr:
        facts.append(f"labelled judge-score range [{fmt(lr[0], 2)}, {fmt(lr[1], 2)}]")
    reason = f"<p class='note'>Selection: {esc(sel.reason)}</p>" if sel and sel.reason else ""
    two_stage = ("<p class='note'>Calibration with covariates: the curve is drawn at the median of the "
                 "covariates.</p>" if _uses_covariates(cal.mode) else "")
    row_list = []
    for b in cal.reliability or []:
        if not isinstance(b, ReliabilityBin):
            continue
        mp, ml = as_number(b.mean_predicted), as_number(b.mean_label)
        gap = signed(ml - mp) if mp is not None and ml is not None else "n/a"
        row_list.append(
            f"<tr><td class='num'>[{esc(fmt(b.lo, 2))}, {esc(fmt(b.hi, 2))})</td>"
            f"<td class='r num'>{esc(_or_na(b.n))}</td>"
            f"<td class='r num'>{esc(fmt(mp))}</td><td class='r num'>{esc(fmt(ml))}</td>"
            f"<td class='r num'>{esc(gap)}</td></tr>")
    rel_rows = "".join(row_list)
    rel_table = ("<div class='scroll'><table class='data compact'><thead><tr><th>prediction bin</th>"
                 "<th class='r'>n</th><th class='r'>mean predicted</th><th class='r'>mean label</th>"
                 "<th class='r'>label \u2212 predicted</th></tr></thead>"
                 f"<tbody>{rel_rows}</tbody></table></div>") if rel_rows else ""
    sep = " \u00b7 "
    return (f"<p class='facts'>{sep.join(facts)}</p>{reason}{two_stage}"
            f"<div class='figure'>{calibration_svg(cal, config)}</div>{rel_table}")


def drift_section(d: dict) -> str:
    """The report's judge-drift section (series chart and its facts)."""
    extra = []
    if d.get("n_anchors") is not None:
        extra.append(f"{esc(d['n_anchors'])} anchor pairs")
    if d.get("method"):
        extra.append(esc(d["method"]))
    row_list = []
    for i, p in enumerate(d["periods"]):
        alarm = d["alarms"][i]
        shift = signed(d["residual_shift"][i]) if d["residual_shift"] else "n/a"
        row_list.append(
            f"<tr{' class=alarm' if alarm else ''}><td>{esc(p)}</td>"
            f"<td class='r num'>{esc(fmt(d['kendall_tau'][i]))}</td>"
            f"<td class='r num'>{esc(shift)}</td>"
            f"<td>{'<b>alarm</b>' if alarm else 'ok'}</td></tr>")
    rows = "".join(row_list)
    return (f"<section id='drift'><h2>Judge drift</h2><p class='lead'>Anchor set re-scored every "
            f"period{(' (' + '; '.join(extra) + ')') if extra else ''}. Alarm when Kendall "
            f"\u03c4-b drops below {esc(fmt(d['tau_threshold'], 2))} or the mean residual shifts "
            f"by more than \u00b1{esc(fmt(d['shift_threshold'], 2))}"
            f" (or as flagged by the monitor that produced the alarms).</p>"
            f"<div class='figure'>{drift_svg(d)}</div><div class='scroll'><table class='data compact'><thead><tr>"
            "<th>period</th><th class='r'>\u03c4-b</th><th class='r'>residual shift</th>"
            f"<th>status</th></tr></thead><tbody>{rows}</tbody></table></div></section>")


def report_footer(result: dict) -> str:
    """The report's footer: engine and code versions, seed and options."""
    config = result.get("config") if isinstance(result.get("config"), dict) else {}
    inference = result.get("inference") if isinstance(result.get("inference"), dict) else {}
    seed = config.get("seed", inference.get("seed"))
    items = "".join(f"<div><dt>{esc(k)}</dt><dd>{esc(json.dumps(v, default=str))}</dd></div>"
                    for k, v in config.items())
    inf = " \u00b7 ".join(f"{esc(k)}={esc(v)}" for k, v in inference.items())
    return (f"<footer id='footer'><h2>Configuration</h2><dl class='config'>{items}</dl>"
            f"<p>Inference: {inf or 'n/a'}</p><p class='stamp'>seed <b>{esc(seed)}</b> \u00b7 "
            f"engine version <b>{esc(result.get('engine_version', 'unknown'))}</b> \u00b7 result "
            f"schema v{esc(result.get('schema_version', '?'))} \u00b7 self-contained report "
            "(no external resources)</p></footer>")



# --------------------------------------------------------------------------------------------
# context of a published run (previous run, links, linked drift monitors)
# --------------------------------------------------------------------------------------------
def _window_text(window: Any) -> str:
    """``2025-01-01_2025-01-07`` -> ``2025-01-01..2025-01-07``; a one-day window -> its date."""
    a, _, b = str(window).partition("_")
    return a if not b or a == b else f"{a}..{b}"


def context_meta(ctx: dict) -> str:
    """Generated-at time and links, under the page title."""
    links = [f"<a href='{esc(ctx['result_href'])}'>result.json</a>"] if ctx.get("result_href") else []
    prev = ctx.get("previous")
    if prev and prev.get("href"):
        links.append(f"<a href='{esc(prev['href'])}' rel='prev'>previous run ({esc(_window_text(prev['window']))})</a>")
    if ctx.get("trend_href"):
        links.append(f"<a href='{esc(ctx['trend_href'])}'>trend</a>")
    if ctx.get("index_href"):
        links.append(f"<a href='{esc(ctx['index_href'])}'>all evaluations</a>")
    when = f"generated {esc(ctx['generated_at'])}" if ctx.get("generated_at") else ""
    sep = " \u00b7 "
    return f"<div class='meta links'>{sep.join(([when] if when else []) + links)}</div>"


def changed_section(ctx: dict) -> str:
    """What changed since the previous run (levels, claims, audits, best policy)."""
    prev = ctx.get("previous")
    if prev is None:
        return ("<section id='changed'><h2>What changed since the previous run</h2>"
                "<p class='muted'>First published run of this evaluation.</p></section>")
    rows, notes = [], []
    for ch in ctx.get("changes") or []:
        if ch.get("policy") is None:
            notes += ch.get("notes") or []
            continue
        before = "refused" if ch.get("claim_before") == "refused" else fmt(ch.get("before"))
        after = "refused" if ch.get("claim_after") == "refused" else fmt(ch.get("after"))
        diff = signed(ch.get("diff")) if ch.get("diff") is not None else "n/a"
        rows.append(f"<tr><td class='name'>{name_cell(ch['policy'])}</td><td class='r num'>{esc(before)}</td>"
                    f"<td class='r num'>{esc(after)}</td><td class='r num'><b>{esc(diff)}</b></td>"
                    f"<td>{esc('; '.join(ch.get('notes') or []))}</td></tr>")
    note_html = "".join(f"<div class='item warn'><p>{esc(n)}</p></div>" for n in notes)
    return ("<section id='changed' class='summary'><h2>What changed since the previous run</h2>"
            f"<p class='lead'>Compared with run {esc(prev.get('run_key'))} of window "
            f"{esc(_window_text(prev.get('window')))} (published {esc(str(prev.get('published_at'))[:19].replace('T', ' '))}"
            " UTC). Differences are not tests; the trend page tests "
            f"changes with error rates held over all windows.</p>{note_html}"
            "<div class='scroll'><table class='data compact'><thead><tr><th>policy</th><th class='r'>before</th>"
            "<th class='r'>now</th><th class='r'>change</th><th>what moved</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div></section>")
