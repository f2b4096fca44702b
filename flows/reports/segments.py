"""The report's segment section (issue 28): where each policy wins and loses against the baseline, segment by
segment, and whether the judge's calibration holds in each segment.

Reads the typed ``segments`` block of the result (`cje_engine.result.segments.SegmentsResult`); renders

- a heatmap (an HTML table, so it reflows on a phone) of ``policy - baseline`` per segment x policy: colour by
  the difference, **verified** cells with a solid frame and a check mark, **assumes transport** cells hatched
  and in italics (named so), cells with **too few** rows or labels blank with the reason;
- a drill-down table, one row per segment x policy: level, shown interval, claim, own labels, rows, the cell's
  audit, the difference with the baseline with its interval and adjusted p;
- the omnibus calibration test (segments and score deciles, clustered) per policy and over all labels;
- a reliability diagram per policy (calibrated prediction against the oracle label, by decile).

Every cell carries ``data-segment`` / ``data-policy`` / ``data-claim`` so that tests and tools can read them.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from cje_engine.result.model import EvaluationModel
from cje_engine.result.segments import (OTHER, ReliabilityDiagram, SegmentCell, SegmentComparison, SegmentsResult)
from flows.reports.common import (BLUE, GREY, INK, MUTED, VERMILLION, VERDICT_STYLE, as_number, as_pair, conf_label,
                                  esc, fmt, fmt_ci, fmt_p, name_cell, scale_text, signed)
from flows.reports.svg import (LinearScale, el, nice_ticks, svg_doc, svg_line, svg_text, x_axis, y_axis)

__all__ = ["segments_of", "segments_section", "heatmap_table", "drilldown_table", "reliability_svg", "SEGMENT_CSS",
           "segment_brief", "brief_lines", "brief_rows"]

#: Styles of the segment section (appended to the report's CSS).
SEGMENT_CSS = """
table.heat{border-collapse:separate;border-spacing:3px;font-size:13px;margin:8px 0}
table.heat th{font-weight:600;color:var(--muted);padding:4px 6px;text-align:center;white-space:normal;
overflow-wrap:break-word;max-width:9em}
table.heat th.seg{text-align:left;max-width:11em;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
table.heat td{min-width:5.2em;height:2.6em;padding:3px 6px;text-align:center;border-radius:5px;
font-variant-numeric:tabular-nums;line-height:1.2}
table.heat td.verified{border:2px solid #1f2328}
table.heat td.assumes_transport{border:2px dashed #6b7280;font-style:italic;
background-image:repeating-linear-gradient(135deg,rgba(89,99,110,.22) 0 2px,rgba(255,255,255,0) 2px 7px)}
table.heat td.too_few{background:#fff;border:1px dotted #b8bfc6;color:var(--muted);font-size:11.5px;
min-width:7em;max-width:11em;white-space:normal}
table.heat td.base{background:#f4f6f8;color:var(--muted);font-size:12px}
table.heat td .mark{font-size:11px;display:block;color:#3d444d}
table.heat td.assumes_transport b,table.heat td.assumes_transport .v,table.heat td.assumes_transport .mark{
background:rgba(255,255,255,.85);border-radius:3px;padding:0 3px}
table.heat td.assumes_transport .mark{display:table;margin:2px auto 0}
table.heat td.sig b{font-weight:700}
.heat-legend{display:flex;flex-wrap:wrap;gap:6px 14px;font-size:12.5px;color:var(--muted);margin:4px 0 8px}
.heat-legend span.sw{display:inline-block;width:2.2em;height:1.2em;border-radius:4px;vertical-align:middle;
margin-right:4px}
.panels.rel{grid-template-columns:repeat(auto-fill,minmax(min(100%,330px),1fr))}
table.data.drill td{white-space:nowrap}
table.data.drill td.why{white-space:normal;min-width:9em;max-width:16em}
table.data.drill td.why small{color:var(--muted)}
tr.seg-first td{border-top:2px solid var(--line)}
@media (max-width:640px){
main{padding:14px 10px 24px}
section,footer{padding:14px 12px}
table.heat{border-spacing:2px;font-size:12.5px}
table.heat td{min-width:4.4em;padding:2px 3px}
table.heat td.too_few{min-width:4.4em;font-size:11px}
table.heat th{padding:2px 3px;max-width:6.5em}
table.heat th.seg{max-width:5.5em}
table.data.cards thead{display:none}
table.data.cards,table.data.cards tbody{display:block}
table.data.cards tr{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:1px 12px;padding:6px 0;
border-bottom:1px solid #eaeef2}
table.data.cards tr.seg-first{border-top:2px solid var(--line)}
table.data.cards td{display:block;border:0;padding:1px 0;white-space:normal;text-align:left;min-width:0;max-width:none}
table.data.cards td[data-label]::before{content:attr(data-label) ": ";color:var(--muted);font-size:12px}
table.data.cards td.name{font-weight:600;font-size:14px}
table.data.cards td:empty{display:none}
}
"""


def segments_of(m: EvaluationModel | dict) -> SegmentsResult | None:
    """The result's segment block, typed (None when the evaluation was not segmented)."""
    block = getattr(m, "segments", None) if not isinstance(m, dict) else m.get("segments")
    if block is None or isinstance(block, SegmentsResult):
        return block
    if isinstance(block, dict):
        return SegmentsResult.model_validate(block)
    return SegmentsResult.model_validate(block.model_dump() if hasattr(block, "model_dump") else block)


def shown_segments(seg: SegmentsResult) -> list[str]:
    """Segments with rows of their own in the tables: shown ones in the result's order, then ``other``."""
    names = [s.name for s in seg.segments if s.status != "pooled" and s.name != OTHER]
    if any(s.name == OTHER for s in seg.segments):
        names.append(OTHER)
    return names


def _policies(seg: SegmentsResult) -> list[str]:
    """The compared policies (not the baseline), in the order of their first cell."""
    out: list[str] = []
    for c in seg.cells:
        if c.policy != seg.baseline and c.policy not in out:
            out.append(c.policy)
    return out


def _mix(a: str, b: str, t: float) -> str:
    """Colour ``t`` of the way from ``a`` to ``b`` (hex ``#rrggbb``)."""
    pa_, pb = [int(a[i:i + 2], 16) for i in (1, 3, 5)], [int(b[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(pa_, pb))


def diff_colour(diff: float | None, scale: float) -> str:
    """Diverging fill of a difference: blue when the policy is better than the baseline, vermillion when worse
    (colour-blind safe), white at 0; saturation by ``|diff| / scale`` (capped at 85%)."""
    if diff is None or not math.isfinite(diff) or scale <= 0:
        return "#ffffff"
    t = min(abs(diff) / scale, 1.0) * 0.85
    return _mix("#ffffff", BLUE if diff > 0 else VERMILLION, t)


def _no_number_reason(seg: SegmentsResult, segment: str, policy: str) -> tuple[str, str]:
    """(label, reason) of a heatmap cell without a number: ``too few`` (the segment's sizes) or ``no level`` with
    the reason of the policy's or the baseline's cell (e.g. limited calibration support)."""
    for name in (policy, seg.baseline):
        cell = _cell(seg, segment, name)
        if cell is not None and cell.claim_kind == "too_few":
            return "too few", cell.reason or f"too few: {_sizes(seg, segment, name)}"
    for name in (policy, seg.baseline):
        cell = _cell(seg, segment, name)
        if cell is not None and as_number(cell.estimate) is None:
            return "no level", f"{name}: {cell.reason or 'no level in this segment'}"
    info = next((s for s in seg.segments if s.name == segment), None)
    if info is not None:
        return "too few", (f"too few: {info.n_rows} rows, {info.n_labels} labels (needs {seg.min_rows} rows a policy, "
                           f"{seg.min_labels} labels)")
    return "too few", "too few rows or labels"


def _cell(seg: SegmentsResult, segment: str, policy: str) -> SegmentCell | None:
    return next((c for c in seg.cells if c.segment == segment and c.policy == policy), None)


def _comparison(seg: SegmentsResult, segment: str, policy: str) -> SegmentComparison | None:
    return next((c for c in seg.comparisons if c.segment == segment and c.policy == policy), None)


def heatmap_table(seg: SegmentsResult) -> str:
    """The segment x policy heatmap of ``policy - baseline`` (an HTML table; see the module docstring)."""
    pols = _policies(seg)
    rows_ = shown_segments(seg)
    diffs = [abs(c.diff) for c in seg.comparisons if c.claim_kind != "too_few" and as_number(c.diff) is not None]
    scale = max(diffs, default=0.0) or 1.0
    head = ("<tr><th class='seg'>segment</th>"
            f"<th title='the baseline: its level in the segment'>{name_cell(seg.baseline)}<br><small>baseline"
            "</small></th>" + "".join(f"<th>{name_cell(p)}</th>" for p in pols) + "</tr>")
    body = []
    for s in rows_:
        base = _cell(seg, s, seg.baseline)
        if base is not None and base.claim_kind != "too_few" and as_number(base.estimate) is not None:
            base_td = (f"<td class='base' data-segment='{esc(s)}' data-policy='{esc(seg.baseline)}' "
                       f"data-claim='{esc(base.claim_kind)}' title='baseline level ({esc(base.claim_kind)})'>"
                       f"{esc(fmt(base.estimate))}</td>")
        else:
            base_td = (f"<td class='base' data-segment='{esc(s)}' data-policy='{esc(seg.baseline)}' "
                       "data-claim='too_few'>\u2013</td>")
        tds = [base_td]
        for p in pols:
            c = _comparison(seg, s, p)
            kind = c.claim_kind if c is not None else "too_few"
            attrs = f"data-segment='{esc(s)}' data-policy='{esc(p)}' data-claim='{esc(kind)}'"
            if kind == "too_few" or c is None or as_number(c.diff) is None:
                word, why = _no_number_reason(seg, s, p)
                mark = _sizes(seg, s, p) if word == "too few" else _short_reason(why.split(": ", 1)[-1], 24)
                tds.append(f"<td class='too_few' {attrs} data-reason='{esc(why)}' title='{esc(why)}'>"
                           f"{esc(word)}<span class='mark'>{esc(mark)}</span></td>")
                continue
            sig = bool(c.significant)
            arrow = ("\u25b2 " if c.better else "\u25bc " if c.worse else "")
            mark = "\u2713 verified" if kind == "verified" else "assumes transport"
            ci = as_pair(c.ci_fcr) or as_pair(c.ci)
            tip = (f"{p} - {seg.baseline} in {s}: {signed(c.diff)} {fmt_ci(ci)}; adjusted p {fmt_p(c.p_adjusted)}"
                   f"; {mark}" + ("" if kind == "verified" else " (not verified by the segment's own labels)"))
            value = (f"<b>{esc(arrow + signed(c.diff))}</b>" if sig else
                     f"<span class='v'>{esc(signed(c.diff))}</span>")
            tds.append(f"<td class='{esc(kind)}{' sig' if sig else ''}' {attrs} data-significant='{str(sig).lower()}'"
                       f" data-diff='{esc(signed(c.diff))}' style='background-color:{diff_colour(c.diff, scale)}' "
                       f"title='{esc(tip)}'>{value}<span class='mark'>{esc(mark)}</span></td>")
        label = s
        body.append(f"<tr><th class='seg' scope='row' title='{esc(label)}'>{esc(label)}</th>{''.join(tds)}</tr>")
    legend = (
        "<div class='heat-legend'>"
        f"<span><span class='sw' style='background:{diff_colour(scale, scale)}'></span>better than the baseline</span>"
        f"<span><span class='sw' style='background:{diff_colour(-scale, scale)}'></span>worse</span>"
        "<span><b>\u25b2/\u25bc bold</b>: significant after the family's adjustment</span>"
        "<span><span class='sw' style='border:2px solid #1f2328'></span>\u2713 verified by the segment's own labels"
        "</span><span><span class='sw' style='border:2px dashed #6b7280;background:repeating-linear-gradient(135deg,"
        "rgba(89,99,110,.22) 0 2px,#fff 2px 7px)'></span><i>assumes transport</i> (hatched: not verified)</span>"
        "<span><span class='sw' style='border:1px dotted #b8bfc6'></span>too few rows or labels, or no level: no number "
        "(the reason in the cell)</span>"
        "</div>")
    return (f"{legend}<div class='scroll'><table class='heat' data-baseline='{esc(seg.baseline)}'>"
            f"<thead>{head}</thead><tbody>{''.join(body)}</tbody></table></div>")


def _sizes(seg: SegmentsResult, segment: str, policy: str) -> str:
    """A too-few cell's own sizes, e.g. ``14 rows, 2 labels``."""
    cell = _cell(seg, segment, policy)
    if cell is not None:
        return f"{cell.n_rows} rows, {cell.n_labels} labels"
    info = next((x for x in seg.segments if x.name == segment), None)
    return f"{info.n_rows} rows, {info.n_labels} labels" if info is not None else "no rows"


def _short_reason(why: str, limit: int = 40) -> str:
    """The first clause of a reason (at most ``limit`` characters), for the cell itself (the full one is its
    tooltip)."""
    text = why.split(";")[0].split("(")[0].strip()
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def _claim_cell(c: SegmentCell) -> str:
    """The claim of a cell, with the reason it is not verified (short; the full reason in the tooltip)."""
    word = {"verified": "\u2713 verified", "assumes_transport": "assumes transport", "too_few": "too few"}[c.claim_kind]
    if c.claim_kind == "verified" or not c.reason:
        return f"<td data-label='claim'>{esc(word)}</td>"
    short = _short_reason(c.reason.removeprefix("assumes transport: "))
    return (f"<td class='why' data-label='claim' title='{esc(c.reason)}'>{esc(word)}<br><small>{esc(short)}</small>"
            "</td>")


def drilldown_table(seg: SegmentsResult, alpha: float) -> str:
    """One row per segment x policy: level, shown interval, claim, labels / rows, audit (with its adjusted p),
    the difference with the baseline, its interval and adjusted p."""
    ec = seg.error_control
    lvl = as_number(ec.level_interval_level)
    lvl_txt = f"{100 * lvl:.4g}%" if lvl is not None else conf_label(alpha)
    head = ("<tr><th>segment</th><th>policy</th><th class='r'>level</th>"
            f"<th class='r' title='false coverage rate controlled over the shown levels'>interval ({esc(lvl_txt)})</th>"
            "<th>claim</th><th class='r'>labels / rows</th>"
            "<th title='transport audit on the cell&#39;s own labels; p adjusted by Holm over the audited cells'>"
            "audit (p adj.)</th>"
            f"<th class='r'>vs {esc(seg.baseline)}</th><th class='r' title='Benjamini-Yekutieli (FCR) interval when "
            f"claimed, else the marginal one'>interval</th><th class='r'>p adj. ({esc(ec.claims_method)})</th></tr>")
    rows = []
    order = [seg.baseline] + _policies(seg)
    for s in shown_segments(seg):
        first = True
        for p in order:
            c = _cell(seg, s, p)
            if c is None:
                continue
            comp = _comparison(seg, s, p) if p != seg.baseline else None
            a = c.audit
            sym, label, _ = VERDICT_STYLE.get(a.verdict, VERDICT_STYLE["not_run"])
            if c.claim_kind == "too_few" or as_number(c.estimate) is None:
                level = "<td class='r muted' colspan='2' data-label='level'>none</td>"
            else:
                num = esc(fmt(c.estimate))
                eb = (f"<br><small class='muted' title='partially pooled across the policy&#39;s segments (empirical "
                      f"Bayes, robust EBCI; shrinkage {fmt(c.pooled.shrinkage, 2)})'>EB {esc(fmt(c.pooled.estimate))}"
                      "</small>" if c.pooled is not None else "")
                eb_ci = (f"<br><small class='muted'>{esc(fmt_ci(c.pooled.ci))}</small>" if c.pooled is not None else "")
                level = (f"<td class='r num' data-label='level'>{num if c.claim_kind == 'verified' else f'<i>{num}</i>'}"
                         f"{eb}</td><td class='r num' data-label='interval'>{esc(fmt_ci(c.ci))}{eb_ci}</td>")
            if comp is None or comp.claim_kind == "too_few" or as_number(comp.diff) is None:
                vs = ("<td class='r muted'>baseline</td><td></td><td></td>" if p == seg.baseline
                      else f"<td class='r muted' colspan='3' data-label='vs {esc(seg.baseline)}'>not compared</td>")
            else:
                ci = as_pair(comp.ci_fcr) or as_pair(comp.ci)
                star = " sig" if comp.significant else ""
                vs = (f"<td class='r num{star}' data-label='vs {esc(seg.baseline)}'>{esc(signed(comp.diff))}</td>"
                      f"<td class='r num' data-label='interval'>{esc(fmt_ci(ci))}</td>"
                      f"<td class='r num{star}' data-label='p adj.'>{esc(fmt_p(comp.p_adjusted))}</td>")
            cls = " class='seg-first'" if first else ""
            first = False
            audit_p = f" <small class='num'>{esc(fmt_p(a.p_adjusted))}</small>" if a.p_adjusted is not None else ""
            rows.append(
                f"<tr{cls} data-segment='{esc(s)}' data-policy='{esc(p)}' data-claim='{esc(c.claim_kind)}' "
                f"data-audit='{esc(a.verdict)}'><td class='name'>{name_cell(s)}</td><td class='name'>{name_cell(p)}</td>"
                f"{level}{_claim_cell(c)}<td class='r num' data-label='labels / rows'>{c.n_labels} / {c.n_rows}</td>"
                f"<td data-label='audit'><span class='badge v-{esc(a.verdict)}'>{esc(sym)} {esc(label)}</span>{audit_p}"
                f"</td>{vs}</tr>")
    return (f"<div class='scroll'><table class='data drill cards'><thead>{head}</thead><tbody>{''.join(rows)}</tbody>"
            "</table></div>")


def omnibus_table(seg: SegmentsResult) -> str:
    """The omnibus calibration tests (mean residual of every segment and score decile = 0, clustered)."""
    if not seg.omnibus:
        return ""
    rows = []
    for t in seg.omnibus:
        verdict = "fail" if t.reject else ("pass" if t.reject is False else "not_run")
        sym, label, _ = VERDICT_STYLE[verdict]
        worst = max(t.components, key=lambda c: abs(c.mean_residual) / (c.se or math.inf) if c.se else 0.0,
                    default=None)
        where = (f"{worst.kind} {worst.name}: {signed(worst.mean_residual)}" if worst is not None else "")
        rows.append(f"<tr data-policy='{esc(t.policy)}' data-reject='{str(bool(t.reject)).lower()}'>"
                    f"<td class='name'>{esc('all labels' if t.policy == '*' else t.policy)}</td>"
                    f"<td><span class='badge v-{verdict}'>{esc(sym)} {esc('off somewhere' if t.reject else label)}"
                    f"</span></td><td class='r num' data-label='\u03c7\u00b2'>{esc(fmt(t.statistic, 1))} on {t.df} df</td>"
                    f"<td class='r num' data-label='p'>{esc(fmt_p(t.p_value))}</td><td class='r num' "
                    f"data-label='pooled audit p'>{esc(fmt_p(t.pooled_p_value))}</td><td class='r num' "
                    f"data-label='labels / prompts'>{t.n_labels} / {t.n_clusters}</td><td data-label='largest'>"
                    f"{esc(where)}</td></tr>")
    return ("<div class='scroll'><table class='data cards'><thead><tr><th>labels of</th><th>omnibus</th>"
            "<th class='r'>\u03c7\u00b2</th><th class='r'>p</th><th class='r' title='the plain pooled audit: blind to "
            "errors that cancel'>pooled audit p</th><th class='r'>labels / prompts</th><th>largest deviation</th>"
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")


def reliability_svg(diagram: ReliabilityDiagram, label_scale: tuple[float, float] | None, alpha: float) -> str:
    """One policy's reliability diagram: mean oracle label against mean calibrated prediction per decile, with
    ``1 - alpha`` bars (clustered SE) and the identity line. Drawn about as wide as it is shown (330 px)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(1 - alpha / 2)
    W, H, L, T, R, B = 340, 300, 52, 30, 12, 48
    pts = [b for b in diagram.bins if math.isfinite(b.mean_predicted) and math.isfinite(b.mean_label)]
    vals = [v for b in pts for v in (b.mean_predicted, b.mean_label)] + list(label_scale or ())
    lo, hi, ticks, dec = nice_ticks(min(vals, default=0.0), max(vals, default=1.0), 5)
    sx, sy = LinearScale(lo, hi, L, W - R), LinearScale(lo, hi, H - B, T)
    body = [svg_text(L, 18, diagram.policy, fill=INK, font_size="13", font_weight="600")]
    body += x_axis(sx, ticks, dec, H - B, T, "mean calibrated prediction")
    body += y_axis(sy, ticks, dec, L, W - R, None)
    body.append(svg_text(L + 4, T + 12, "mean oracle label", fill=MUTED, font_size="11"))
    body.append(svg_line(sx(lo), sy(lo), sx(hi), sy(hi), stroke=GREY, stroke_width="1.2", stroke_dasharray="5 4"))
    n_max = max((b.n for b in pts), default=1) or 1
    for b in pts:
        x, y = sx(b.mean_predicted), sy(b.mean_label)
        inner = el("title", esc(f"{diagram.policy}: predictions {fmt(b.lo, 2)}-{fmt(b.hi, 2)}, n={b.n}, predicted "
                                f"{fmt(b.mean_predicted)}, observed {fmt(b.mean_label)}"
                                + (f" \u00b1 {fmt(z * b.se)}" if b.se else "")))
        if b.se:
            inner += svg_line(x, sy(b.mean_label - z * b.se), x, sy(b.mean_label + z * b.se), stroke=VERMILLION,
                              stroke_width="1.5")
        inner += el("circle", cx=x, cy=y, r=2.5 + 5 * math.sqrt(b.n / n_max), fill=BLUE, fill_opacity="0.6",
                    stroke=BLUE, stroke_width="1")
        body.append(el("g", inner, class_="rel-bin", data_policy=diagram.policy))
    if not pts:
        body.append(svg_text(W / 2, H / 2, "no labelled rows", text_anchor="middle", fill=MUTED, font_size="12"))
    return svg_doc(W, H, body, f"Reliability diagram of {diagram.policy}")


def _pooled_note(seg: SegmentsResult) -> str:
    other = next((s for s in seg.segments if s.name == OTHER), None)
    pooled = [s.name for s in seg.segments if s.status == "pooled"]
    if not pooled and other is None:
        return ""
    members = ", ".join(esc(n) for n in (other.members if other and other.members else pooled))
    status = (" It is itself below the minimums, so it has no level." if other is not None
              and other.status == "too_few" else "")
    return (f"<p class='note'>Segments below {seg.min_rows} rows a policy or {seg.min_labels} labels are pooled "
            f"into <b>other</b>: {members or 'none'}.{status}</p>")


def segments_section(m: EvaluationModel, alpha: float, label_scale: Sequence[float] | None = None) -> str:
    """The report's ``<section id='segments'>`` (empty string when the result has no segments)."""
    seg = segments_of(m)
    if seg is None:
        return ""
    ec = seg.error_control
    cols = " x ".join(esc(c) for c in seg.columns)
    claims = ("Benjamini-Hochberg (false discovery rate)" if ec.claims_method == "bh" else "Holm (family-wise error)")
    cmp_lvl = as_number(ec.comparison_interval_level)
    lvl = as_number(ec.level_interval_level)
    lead = (f"<p class='lead'>Each policy against <b>{esc(seg.baseline)}</b> within each segment of <b>{cols}</b>, "
            f"on the oracle scale. Claims over the {ec.n_comparisons} segment x policy comparisons are controlled by "
            f"{esc(claims)} at \u03b1 = {fmt(ec.alpha, 2)}: {ec.n_selected} claimed. Intervals shown control the "
            f"false coverage rate: levels at {esc(f'{100 * lvl:.4g}%' if lvl is not None else 'n/a')} "
            f"({ec.n_shown} of {ec.n_cells} cells shown), claimed differences at "
            f"{esc(f'{100 * cmp_lvl:.4g}%' if cmp_lvl is not None else 'n/a (none claimed)')} "
            f"(Benjamini-Yekutieli).</p>")
    recal = seg.recalibration
    recal_txt = (f"<p class='note'>Recalibration by segment: <b>{'applied' if recal.applied else 'not applied'}"
                 f"</b> ({esc(recal.reason)}; mode {esc(recal.mode)}).</p>")
    scale = tuple(label_scale) if label_scale is not None and len(label_scale) == 2 else None
    panels = "".join(f"<figure class='panel'><div class='figure'>{reliability_svg(d, scale, alpha)}</div></figure>"
                     for d in seg.reliability)
    worse = sorted({f"{c.policy} in {c.segment}" for c in seg.comparisons if c.worse})
    worse_txt = (f"<div class='summary'><div class='item bad'><p>Worse than {esc(seg.baseline)} (significant after "
                 f"the adjustment): {esc('; '.join(worse))}</p></div></div>" if worse else "")
    return (
        "<section id='segments'><h2>Segments</h2>" + lead + worse_txt
        + "<h3>Difference with the baseline, segment x policy</h3>" + heatmap_table(seg) + _pooled_note(seg)
        + "<h3>Drill-down</h3>" + drilldown_table(seg, alpha)
        + "<h3>Calibration by segment</h3><p class='lead'>Omnibus test that the mean residual (oracle label - "
          "calibrated prediction) is zero in every segment and every score decile at once (prompt-clustered): it "
          "catches errors that cancel in the pooled audit.</p>" + omnibus_table(seg) + recal_txt
        + (f"<h3>Reliability by policy</h3><p class='lead'>Labelled rows binned by decile of the calibrated "
           f"prediction (on the label scale {esc(scale_text(scale))}); bars: {conf_label(alpha)} clustered "
           f"intervals; dashed: identity.</p><div class='panels rel'>{panels}</div>" if panels else "")
        + "</section>")


# --------------------------------------------------------------------------------------------- brief
#: Findings listed by name in a brief (the rest are counted: "and N more").
BRIEF_LIMIT = 5


def segment_brief(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """The short segment summary of a result (None when it has no segments): what the Prefect artifacts and
    the index and trend pages show beside the policies.

    Reads the plain result dict (a published result.json), so a result written by an older version reads too.

    Returns
    -------
    dict or None
        ``columns``, ``baseline``, ``alpha``, ``claims_method``, ``n_comparisons``; ``claims``: the comparisons
        significant after the family's adjustment (``segment``, ``policy``, ``direction`` better/worse,
        ``diff``, ``ci`` (the FCR interval), ``claim_kind``, ``p_adjusted``; losses first); ``audits_failing``:
        the segment x policy cells whose audit fails (``segment``, ``policy``, ``residual_mean``,
        ``p_adjusted`` by Holm over the audited cells); ``omnibus``: the test over all labels (``reject``,
        ``p_value``, ``statistic``, ``df``) or None; ``omnibus_failing``: policies whose own omnibus test fails.
    """
    seg = result.get("segments") if isinstance(result, Mapping) else None
    if not isinstance(seg, Mapping):
        return None
    err = seg.get("error_control") if isinstance(seg.get("error_control"), Mapping) else {}
    claims = []
    for c in seg.get("comparisons") or []:
        if not (c.get("better") or c.get("worse")):
            continue
        claims.append({"segment": str(c.get("segment")), "policy": str(c.get("policy")),
                       "direction": "worse" if c.get("worse") else "better", "diff": as_number(c.get("diff")),
                       "ci": list(as_pair(c.get("ci_fcr")) or as_pair(c.get("ci")) or ()) or None,
                       "claim_kind": c.get("claim_kind"), "p_adjusted": as_number(c.get("p_adjusted"))})
    claims.sort(key=lambda c: (c["direction"] != "worse", c["p_adjusted"] if c["p_adjusted"] is not None else 1.0))
    failing = [{"segment": str(c.get("segment")), "policy": str(c.get("policy")),
                "residual_mean": as_number((c.get("audit") or {}).get("residual_mean")),
                "p_adjusted": as_number((c.get("audit") or {}).get("p_adjusted"))}
               for c in seg.get("cells") or [] if (c.get("audit") or {}).get("verdict") == "fail"]
    tests = [t for t in seg.get("omnibus") or [] if isinstance(t, Mapping)]
    overall = next((t for t in tests if t.get("policy") == "*"), None)
    omnibus = None if overall is None else {
        "reject": overall.get("reject"), "p_value": as_number(overall.get("p_value")),
        "statistic": as_number(overall.get("statistic")), "df": overall.get("df")}
    return {"columns": [str(c) for c in seg.get("columns") or []], "baseline": seg.get("baseline"),
            "alpha": as_number(err.get("alpha")), "claims_method": err.get("claims_method"),
            "n_comparisons": err.get("n_comparisons"), "claims": claims, "audits_failing": failing,
            "omnibus": omnibus,
            "omnibus_failing": [str(t.get("policy")) for t in tests if t.get("policy") != "*" and t.get("reject")]}


def _listed(items: Sequence[str]) -> str:
    """Up to `BRIEF_LIMIT` items joined, then "and N more"."""
    head = ", ".join(items[:BRIEF_LIMIT])
    return head + (f" and {len(items) - BRIEF_LIMIT} more" if len(items) > BRIEF_LIMIT else "")


def brief_lines(brief: Mapping[str, Any]) -> dict[str, str]:
    """The brief (`segment_brief`) as plain-text lines ``title``, ``claims``, ``audits`` and ``omnibus``: the
    same words on the Prefect artifact, the index card and the trend page."""
    method = {"bh": "Benjamini-Hochberg", "holm": "Holm"}.get(str(brief.get("claims_method")), "adjusted")
    claims = [f"{c['policy']} {c['direction'].upper()} in {c['segment']} ({signed(c['diff'])} {fmt_ci(c['ci'])}"
              f"{', assumes transport' if c['claim_kind'] == 'assumes_transport' else ''})" for c in brief["claims"]]
    audits = [f"{a['policy']} in {a['segment']}" for a in brief["audits_failing"]]
    om = brief.get("omnibus")
    if om is None or om.get("reject") is None:
        omnibus = "calibration by segment and score decile: not run"
    else:
        omnibus = (f"calibration by segment and score decile: {'FAILS' if om['reject'] else 'passes'} "
                   f"(omnibus p {fmt_p(om['p_value'])}, {om['df']} df)")
        if brief.get("omnibus_failing"):
            omnibus += f"; fails for {_listed(brief['omnibus_failing'])}"
    n = brief.get("n_comparisons") or 0
    return {"title": f"Segments by {' / '.join(brief['columns'])} (against {brief.get('baseline')})",
            "claims": (f"claims against {brief.get('baseline')} ({method} over {n} comparisons): "
                       + (_listed(claims) if claims else "none")),
            "audits": "audits failing by segment: " + (_listed(audits) if audits else "none"),
            "omnibus": omnibus}


def brief_rows(brief: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The brief as table rows (the Prefect table artifact): each claim, each failing audit, the omnibus test."""
    rows = [{"segment": c["segment"], "policy": c["policy"], "finding": f"{c['direction']} than {brief.get('baseline')}",
             "difference": signed(c["diff"]), "interval": fmt_ci(c["ci"]), "claim": c["claim_kind"],
             "p_adjusted": fmt_p(c["p_adjusted"])} for c in brief["claims"]]
    rows += [{"segment": a["segment"], "policy": a["policy"], "finding": "audit fails",
              "difference": signed(a["residual_mean"]), "interval": "", "claim": "mean residual",
              "p_adjusted": fmt_p(a["p_adjusted"])} for a in brief["audits_failing"]]
    om = brief.get("omnibus")
    if om is not None:
        verdict = "not run" if om.get("reject") is None else ("fails" if om["reject"] else "passes")
        rows.append({"segment": "all segments", "policy": "all labels", "finding": f"omnibus calibration test {verdict}",
                     "difference": "", "interval": "", "claim": f"{om.get('df')} df", "p_adjusted": fmt_p(om.get("p_value"))})
    return rows
