"""Fixed-width terminal tables for a CJE result."""
from __future__ import annotations

from typing import Any, Sequence

from cje_engine.result.model import (AssumedClaims, AssumedLevel, BaselineComparison, Comparison, EvaluationModel,
                                     Multiplicity, PolicyResult)
from flows.reports.common import (VERDICT_STYLE, alpha_of, conf_label, fmt, fmt_ci, fmt_p, is_refused,
                                  not_estimable_reason, policy_order, rank_text, result_model, safe_str, same_scale,
                                  scale_text, scales_of, signed, verdict_of)
from flows.reports.sections import strip_winner_prefix

__all__ = ["format_table", "format_segment_table", "text_table"]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Lines of a plain-text table: a header, a rule and the rows, columns padded to their widest cell.

    Parameters
    ----------
    headers : sequence of str
    rows : sequence of sequences of str
    right : set of int
        Indices of the right-aligned (numeric) columns.
    """
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_table(result: Any) -> str:
    """Fixed-width text summary of a result for the terminal.

    ``result``: the result dict (``result.json``; hand-made partial ones too), an `EvaluationResult` or its
    `EvaluationModel`; read through the typed model (`flows.reports.common.result_model`).
    One row per policy, highest estimate first (rank as the comparisons support it, `rank_text`;
    estimate, CI, level claim, basis, audit verdict, raw judge mean on the judge's
    own scale, oracle mean; refused levels read "refused"), then the pairwise comparisons with adjusted
    p-values ("not estimable: <reason>" where the engine reported none) and the best-policy line. User
    strings are escaped for the terminal (control characters, ANSI escapes, bidirectional overrides).

    Raises
    ------
    CJEInputError
        When ``result`` does not follow ``docs/result-schema.md``.
    """
    m = result_model(result)
    alpha = alpha_of(m)
    conf = conf_label(alpha)
    pols = m.policies
    order = policy_order(m)
    rows = []
    for n in order:
        p = pols[n]
        refused = is_refused(p)
        assumed = p.assumed if isinstance(p.assumed, AssumedLevel) else None
        rows.append([
            rank_text(m, n),
            safe_str(n),
            "refused" if refused else fmt(p.estimate) if p.estimate is not None else "-",
            "refused" if refused else fmt_ci(p.ci) if p.ci else "",
            claim_text(p),
            safe_str(p.basis_code or "n/a"),
            VERDICT_STYLE[verdict_of(p)][1],
            (fmt(assumed.estimate) if assumed.level_claim != "refused" else "refused") if assumed else "",
            fmt(p.raw_judge_mean),
            fmt(p.oracle_mean),
        ])
    lines = ["Policy estimates (oracle scale)"]
    raw_head = "raw judge" if same_scale(m) else f"raw judge ({scale_text(scales_of(m)[0])})"
    lines += text_table(["rank", "policy", "estimate", f"{conf} CI", "claim", "basis", "audit", "assumes transport",
                     raw_head, "oracle mean"], rows, right={2, 3, 7, 8, 9})
    if any(pols[n].level_claim == "assumes_transport" for n in order):
        lines.append("claim 'assumes transport': no verified level; the level shown (a calibrated plug-in, or an "
                     "off-policy estimate: importance-weighted, DR or stacked) rests on the calibration transporting "
                     "to the policy, which its labels did not verify (labels_to_verify in the result)")
    if any("-" in r[0] and r[0] != "-" for r in rows):
        lines.append("rank: 1 + policies significantly better; a range (1-3) when the comparisons leave it open")
    lines.append("")
    lines += _comparison_lines(m, conf, alpha)
    lines.append("")
    best = m.best_policy
    if best is not None:
        reason = safe_str(m.best_policy_reason or "")
        lines.append(f"Best policy: {safe_str(best)}" + (f" ({reason})" if reason else ""))
    else:
        reason = safe_str(strip_winner_prefix(m.best_policy_reason))
        lines.append("Best policy: none, no clear winner" + (f" ({reason})" if reason else ""))
    lines += _baseline_lines(m, conf)
    assumed_claims = m.assumes_transport
    if isinstance(assumed_claims, AssumedClaims):
        best = assumed_claims.best_policy
        lines.append("Assuming transport (the paper's protocol, not verified): best policy "
                     + (safe_str(best) if best else "none")
                     + f" ({safe_str(strip_winner_prefix(assumed_claims.best_policy_reason))})")
    return "\n".join(lines)


def _comparison_lines(m: EvaluationModel, conf: str, alpha: float) -> list[str]:
    """The pairwise comparisons block of the table (a - b, CI, p, adjusted p, significance, claim)."""
    pols = m.policies
    comps = [c for c in m.comparisons or [] if isinstance(c, Comparison)]
    mult = m.multiplicity if isinstance(m.multiplicity, Multiplicity) else None
    config = m.config if isinstance(m.config, dict) else {}
    method = str((mult.method if mult else None) or config.get("multiplicity") or "n/a")
    if not comps:
        return ["Pairwise comparisons: none"]
    mult_alpha = mult.alpha if mult is not None and mult.alpha is not None else alpha
    lines = [f"Pairwise comparisons (a - b; p adjusted by {method.upper()}, alpha {fmt(mult_alpha, 2)})"]
    crow = []
    any_refused = False
    for c in comps:
        a, b = str(c.a), str(c.b)
        why = not_estimable_reason(c)
        if why is not None:  # never a number: the engine threw it out (issue 16)
            crow.append([safe_str(a), safe_str(b), f"not estimable: {safe_str(why)}", "", "", "", "", "", "", ""])
            continue
        involves = bool(c.involves_refused) or any(is_refused(pols[x]) for x in (a, b) if x in pols)
        any_refused |= involves
        crow.append([safe_str(a), safe_str(b), signed(c.diff), fmt_ci(c.ci), fmt_p(c.p_value), fmt_p(c.p_adjusted),
                     "yes" if c.significant else "no", fmt(c.prob_a_better, 2),
                     "assumes transport" if c.claim_kind == "assumes_transport" else
                     "verified" if c.claim_kind == "verified" else "",
                     "*" if involves else ""])
    lines += text_table(["a", "b", "diff", f"{conf} CI", "p", "p adj", "sig", "P(a better)", "claim", ""],
                    crow, right={3, 4, 5, 7})
    if any_refused:
        lines.append("* involves a refused policy: relative comparison only, no level implied")
    return lines


def claim_text(p: PolicyResult) -> str:
    """How a policy's level claim reads for people: verified, assumes transport, refused (off-policy: ok)."""
    claim = str(p.level_claim)
    if claim == "ok" and p.verified is not None:
        return "verified"
    return {"assumes_transport": "assumes transport"}.get(claim, claim)


def _baseline_lines(m: EvaluationModel, conf: str) -> list[str]:
    rows = [c for c in m.baseline_comparisons or [] if isinstance(c, BaselineComparison)]
    if not rows:
        return []
    base = safe_str(rows[0].baseline)
    out = ["", f"Against the baseline {base} (simultaneous {conf} intervals, max-T)"]
    body = []
    for c in rows:
        if not c.reported:
            body.append([safe_str(c.policy), f"not estimable: {safe_str(c.not_estimable)}", "", "", ""])
            continue
        verdict = "better" if c.better else "worse" if c.worse else "non-inferior" if c.non_inferior else "undecided"
        body.append([safe_str(c.policy), signed(c.diff), fmt_ci(c.ci), verdict,
                     "assumes transport" if c.claim_kind == "assumes_transport" else "verified"])
    out += text_table(["policy", "diff", f"{conf} CI (simultaneous)", "verdict", "claim"], body, right={1, 2})
    return out


def format_segment_table(result: Any) -> str:
    """Fixed-width text table of a segmented result (``segment_by``): one row per segment x policy.

    Columns: segment, policy, rows, own labels, the printed level with its shown interval (at the false
    coverage rate level of ``segments.error_control``), the claim kind, the difference with the baseline
    (its interval when claimed), the claim (better / worse / no claim) and the cell's audit verdict. Cells
    of a segment with too few rows or labels print "too few" and no number. Then the omnibus calibration
    test over all labels and the error control in one line each. Empty string without segments.
    """
    m = result_model(result)
    seg = m.segments
    if seg is None:
        return ""
    ec = seg.error_control
    cmp = {(c.segment, c.policy): c for c in seg.comparisons}
    rows = []
    for c in seg.cells:
        k = cmp.get((c.segment, c.policy))
        level = "too few" if c.claim_kind == "too_few" else fmt(c.estimate) if c.estimate is not None else "-"
        ci = fmt_ci(c.ci) if c.ci else ""
        if k is None:
            diff, claim = ("baseline" if c.policy == seg.baseline else ""), ""
        elif k.diff is None:
            diff, claim = "-", ""
        else:
            diff = signed(k.diff) + (f" {fmt_ci(k.ci_fcr)}" if k.ci_fcr else "")
            claim = "better" if k.better else "WORSE" if k.worse else "no claim"
        kind = {"verified": "verified", "assumes_transport": "assumes transport", "too_few": "too few"}[c.claim_kind]
        rows.append([safe_str(c.segment), safe_str(c.policy), str(c.n_rows), str(c.n_labels), level, ci, kind, diff,
                     claim, c.audit.verdict])
    head = (f"segments by {', '.join(safe_str(x) for x in seg.columns)} (baseline {safe_str(seg.baseline)}; "
            f"levels shown at {ec.level_interval_level:.1%})")
    lines = [head, *text_table(["segment", "policy", "rows", "labels", "level", "interval", "claim kind",
                                f"vs {safe_str(seg.baseline)}", "claim", "audit"], rows, {2, 3, 4})]
    star = seg.omnibus[0] if seg.omnibus else None
    if star is not None:
        verdict = "FAILS" if star.reject else "passes"
        lines.append(f"calibration by segment and score decile: {verdict} (chi2 {fmt(star.statistic)}, df {star.df}, "
                     f"p {fmt_p(star.p_value)}; pooled mean residual p {fmt_p(star.pooled_p_value)})"
                     + ("; levels recalibrated with the segment as a covariate" if seg.recalibration.applied else ""))
    method = "Benjamini-Hochberg (FDR)" if ec.claims_method == "bh" else "Holm (FWER)"
    lines.append(f"claims: {ec.n_selected} of {ec.n_comparisons} comparisons, {method} at {ec.alpha:g}; claimed "
                 f"differences carry Benjamini-Yekutieli intervals"
                 + (f" at {ec.comparison_interval_level:.2%}" if ec.comparison_interval_level else ""))
    return "\n".join(lines)
