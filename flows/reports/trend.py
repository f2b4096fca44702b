"""The service index (``results/index.html``) and one trend page per evaluation
(``results/<evaluation>/trend.html``): self-contained HTML (inline CSS and SVG, no scripts, no network).

Trend page: each policy's value and interval over windows (refused windows drawn as such), regression
alarms, audit verdicts and label counts over windows, drift alarms of linked monitors on the same time
axis, the changes of the latest window and the open label requests. Markers carry ``data-*`` attributes
(``data-policy``, ``data-window``) so that tests and tools can read them.
"""
from __future__ import annotations

import hashlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

from cje_engine.inference.changes import PolicyChanges

from flows.storage.objects import NotFoundError, Storage, StorageError
from flows.storage.publish import RESULTS

from flows.reports.common import (BLUE, GREEN, GREY, INK, MUTED, ORANGE, PURPLE, SKY, VERDICT_STYLE, VERMILLION, esc, fmt,
                                  fmt_ci, signed)
from flows.reports.evaluation import CSS
from flows.reports.segments import brief_lines
from flows.reports.history import (latest_per_window, linked_drift, open_label_requests, published_manifests,
                                   read_history, window_changes_of)
from flows.reports.svg import (LinearScale, coord, el, nice_ticks, svg_diamond, svg_doc, svg_legend, svg_line,
                               svg_polylines, svg_text, y_axis)

__all__ = ["render_index", "render_trend", "write_pages", "segments_trend_section", "segment_brief_html", "INDEX",
           "TREND", "ENTRY", "keep_entry", "kept_entry"]

log = logging.getLogger(__name__)

INDEX = "index.html"
TREND = "trend.html"

WIDTH, LEFT, RIGHT = 1040, 190, 24
DASH, DOT = "\u2013", " \u00b7 "
OK_BADGE = "<span class='badge ok'>ok</span>"
EXTRA_CSS = """
.chip{display:inline-block;margin:1px 6px 1px 0;padding:1px 8px;border-radius:10px;background:#eef3f8;
font-size:12.5px;white-space:nowrap}
.chip.refused{background:#eceef1;color:#4b5259;border:1px dashed #8d949c}
.chip.alarm{background:#fbe6da;color:#9a3d00;font-weight:600}
.kpis{display:flex;flex-wrap:wrap;gap:12px;margin:6px 0 2px}
.kpi{flex:1 1 180px;border:1px solid #eaeef2;border-radius:8px;padding:10px 14px;background:#fafbfc}
.kpi b{display:block;font-size:22px;letter-spacing:-.01em}
.kpi span{color:var(--muted);font-size:13px}
.kpi.bad{border-color:#f0c3a8;background:#fdf3ed}
td.cell{text-align:center;white-space:nowrap}
nav.crumbs{font-size:14px;margin-bottom:6px}
section.card h2{margin:0 0 4px;overflow-wrap:anywhere}
section.card p.facts{color:var(--muted);font-size:14px;margin:0 0 6px}
section.card p.status{margin:4px 0 8px}
table.data.values{width:auto;min-width:0;max-width:100%}
table.data.values td.name{overflow-wrap:anywhere;min-width:4em}
table.data.values .badge{white-space:normal}
p.links{margin:8px 0 0;font-size:14px;line-height:2}
p.links a{white-space:nowrap;padding:2px 0}
.figure.chartn{display:none}
.segbrief{margin:8px 0 2px;font-size:14px}
.segbrief p{margin:0;overflow-wrap:anywhere}
.segbrief ul{margin:2px 0 0;padding-left:18px}
.segbrief li{margin:2px 0;overflow-wrap:anywhere}
.segbrief li.bad{color:#9a3d00}
@media (max-width:640px){
main{padding:14px 10px 24px}
section,footer{padding:14px 12px}
header.top h1{font-size:21px}
table.data th,table.data td{padding:5px 5px}
table.data.compact{min-width:0}
td.reason{min-width:0}
.kpi{flex:1 1 140px}
.figure.chartw{display:none}
.figure.chartn{display:block}
}
"""



def _rect_marker(x: float, top: float, height: float) -> str:
    """The dashed box of a window without a quotable level (refused or unverified)."""
    return el("rect", x=x - 14, y=float(top), width="28", height=float(height), fill="#f6f7f9", stroke="#8d949c",
              stroke_dasharray="2 4")

def _page(title: str, subtitle: str, body: Sequence[str], crumbs: str = "") -> str:
    return "\n".join([
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{esc(title)}</title><style>{CSS}{EXTRA_CSS}</style></head><body><main>",
        crumbs,
        f"<header class='top'><h1>{esc(title)}</h1><div class='meta'>{esc(subtitle)}</div></header>",
        *body,
        "<footer><p class='stamp'>Self-contained page (no scripts, no external resources), rebuilt whenever what "
        f"it shows changes \u00b7 generated {esc(_now())}</p></footer>",
        "</main></body></html>"])


def _dash(v: Any) -> Any:
    return DASH if v is None else v


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _window_label(w: str) -> str:
    """``2025-01-01_2025-01-01`` -> ``2025-01-01``; ``a_b`` -> ``a..b``."""
    a, _, b = str(w).partition("_")
    return a if not b or a == b else f"{a}..{b}"


# --------------------------------------------------------------------------------------------- index
CLAIM_BADGE = {"ok": ("ok", "verified", "a verified level: the policy's own labels correct it"),
               "assumes_transport": ("v-inconclusive", "assumes transport",
                                     "not verified by the policy's own labels: the level rests on the calibration "
                                     "transporting to it (its assumes-transport value, in italics)"),
               "refused": ("refused", "refused", "level refused: no value is quotable")}


def _value_row(name: str, p: Mapping[str, Any], alarm: bool) -> str:
    """One policy of an index card: value, interval and claim (verified, assumes transport, refused)."""
    claim = str(p.get("level_claim") or "")
    cls, word, tip = CLAIM_BADGE.get(claim, ("", claim or "n/a", ""))
    est, ci, kind = p.get("estimate"), p.get("ci"), "level"
    if claim == "refused":
        est, ci, kind = None, None, "none"
    elif est is None and p.get("assumed"):
        est, ci, kind = p["assumed"].get("estimate"), p["assumed"].get("ci"), "assumed"
    value = esc(fmt(est)) if est is not None else DASH
    interval = esc(fmt_ci(ci)) if ci else DASH
    if kind == "assumed":
        value, interval = f"<i>{value}</i>", f"<i>{interval}</i>"
    badge = f"<span class='badge {cls}' title='{esc(tip)}'>{esc(word)}</span>"
    if alarm:
        badge += " <span class='badge v-fail'>regression</span>"
    pair = fmt_ci(ci) if ci else ""
    return (f"<tr data-policy='{esc(name)}' data-claim='{esc(claim)}' data-value='{esc(fmt(est)) if est is not None else ''}'"
            f" data-ci='{esc(pair)}' data-value-kind='{kind}'><td class='name'>{esc(name)}</td>"
            f"<td class='r num'><b>{value}</b></td><td class='r num'>{interval}</td><td>{badge}</td></tr>")


def segment_brief_html(brief: Mapping[str, Any] | None, when: str = "") -> str:
    """The short segment summary (`flows.reports.segments.segment_brief`) of an index card or a trend page:
    claims against the baseline, audits failing by segment, the omnibus test; ``""`` without segments."""
    if not brief:
        return ""
    text = brief_lines(brief)
    om = brief.get("omnibus") or {}
    omnibus = "not_run" if om.get("reject") is None else ("fail" if om["reject"] else "pass")
    bad = {"claims": any(c["direction"] == "worse" for c in brief["claims"]), "audits": bool(brief["audits_failing"]),
           "omnibus": omnibus == "fail" or bool(brief.get("omnibus_failing"))}
    items = "".join(f"<li data-brief='{k}' class='{'bad' if bad[k] else 'ok'}'>{esc(text[k])}</li>"
                    for k in ("claims", "audits", "omnibus"))
    return (f"<div class='segbrief' data-segment-claims='{len(brief['claims'])}' "
            f"data-segment-worse='{sum(c['direction'] == 'worse' for c in brief['claims'])}' "
            f"data-segment-audits-failing='{len(brief['audits_failing'])}' data-omnibus='{omnibus}'>"
            f"<p><b>{esc(text['title'])}</b>{esc(when)}</p><ul>{items}</ul></div>")


def _card(e: Mapping[str, Any]) -> str:
    """One evaluation of the index: its latest run's values with intervals and claims, status, links."""
    latest = e["latest"]
    name = str(e["evaluation"])
    alarmed = {p for p, ws in (e.get("alarms") or {}).items() if latest["window"] in ws}
    status = []
    if alarmed:
        status.append(f"<span class='badge v-fail'>regression: {esc(', '.join(sorted(alarmed)))}</span>")
    if e.get("drift_alarms"):
        status.append(f"<span class='badge v-fail'>drift alarm \u00d7{esc(e['drift_alarms'])}</span>")
    if e.get("open_requests"):
        status.append(f"<span class='badge v-inconclusive'>{esc(e['open_requests'])} label request(s)</span>")
    links = [f"<a href='{esc(name)}/trend.html'>trend</a>"]
    rk = latest.get("report_key")
    if rk:
        links.append(f"<a href='{esc(rk)}'>latest report</a>")
        links.append(f"<a href='{esc(rk.rsplit('/', 1)[0])}/result.json'>result.json</a>")
    published = str(latest.get("published_at") or "")[:19].replace("T", " ")
    facts = [f"latest window <b>{esc(_window_label(latest['window']))}</b>",
             f"published {esc(published or DASH)} UTC", f"best policy <b>{esc(latest.get('best_policy') or 'none')}</b>",
             f"{esc(e.get('n_windows', 0))} window(s) / {esc(e.get('n_runs', 0))} run(s)"]
    rows = "".join(_value_row(n, p, n in alarmed) for n, p in latest["policies"].items())
    conf = latest.get("confidence") or "95%"
    return (f"<section class='card' data-evaluation='{esc(name)}' data-open-requests='{esc(e.get('open_requests', 0))}' "
            f"data-drift-alarms='{esc(e.get('drift_alarms', 0))}' data-runs='{esc(e.get('n_runs', 0))}' "
            f"data-windows='{esc(e.get('n_windows', 0))}'>"
            f"<h2><a href='{esc(name)}/trend.html'>{esc(name)}</a></h2>"
            f"<p class='facts'>{DOT.join(facts)}</p>"
            f"<p class='status'>{''.join(status) or OK_BADGE}</p>"
            "<table class='data values'><thead><tr><th>policy</th><th class='r'>value</th>"
            f"<th class='r'>{esc(conf)} CI</th><th>claim</th></tr></thead><tbody>{rows}</tbody></table>"
            f"{segment_brief_html((latest.get('segments') or {}).get('brief'))}"
            f"<p class='links'>{DOT.join(links)}</p></section>")


def render_index(entries: Sequence[Mapping[str, Any]]) -> str:
    """The service index: every evaluation, its latest run's values with intervals and claims, its alarms.

    One card per evaluation (no wide table: it reads at 420 px as at 1280 px). A policy's value is its
    verified level, or, for an assumes-transport policy without one, its assumes-transport value (in
    italics, claim "assumes transport"); a refused policy has no value.

    Parameters
    ----------
    entries : list of dict
        Per evaluation: ``evaluation``, ``latest`` (a `flows.reports.history.run_summary` row), ``n_runs``,
        ``n_windows``, ``alarms`` (policy -> list of windows with a regression alarm), ``drift_alarms`` (count),
        ``open_requests`` (count).
    """
    cards = "".join(_card(e) for e in entries)
    body = [cards or "<section><p class='muted'>Nothing published yet.</p></section>"]
    if entries:
        body.insert(0, "<p class='lead'>The latest run of each evaluation: values on the oracle scale with their "
                       "intervals. <b>verified</b>: the policy's own labels correct its level; <b>assumes "
                       "transport</b>: its value (in italics) rests on the calibration transporting to it; "
                       "<b>refused</b>: no value.</p>")
    return _page("CJE results", f"{len(entries)} evaluation(s)", body)


# --------------------------------------------------------------------------------------------- trend
@dataclass(frozen=True)
class _Geom:
    """A chart's geometry: the wide one (desktop) or the narrow one shown below 640 px (phones), whose
    viewBox is about the width it is drawn at, so its labels stay >= 10 CSS px at 420 px."""

    width: int
    left: int
    right: int
    narrow: bool
    marker_class: str = ""  # appended to marker classes (the narrow copy's markers are not counted twice)

    def fs(self, size: float) -> str:
        """A font size: as given on the wide chart, at least 11.5 on the narrow one."""
        return f"{max(size, 11.5) if self.narrow else size:g}"

    def cls(self, name: str) -> str:
        return f"{name} {self.marker_class}" if self.marker_class else name

    def rotate(self, n: int) -> bool:
        return n > (3 if self.narrow else 8)


WIDE = _Geom(WIDTH, LEFT, RIGHT, False)
NARROW = _Geom(400, 62, 12, True, "m")


def _both(draw: Any, *args: Any) -> str:
    """A chart drawn wide and narrow; CSS shows one (``.chartw`` / ``.chartn``)."""
    return (f"<div class='figure chartw'>{draw(*args, WIDE)}</div>"
            f"<div class='figure chartn'>{draw(*args, NARROW)}</div>")


def _x_scale(n: int, g: _Geom = WIDE) -> LinearScale:
    return LinearScale(-0.5, n - 0.5, g.left, g.width - g.right)


def _x_labels(sx: LinearScale, windows: Sequence[str], y: float, g: _Geom = WIDE) -> list[str]:
    out = []
    rotate = g.rotate(len(windows))
    for i, w in enumerate(windows):
        lab = _window_label(w)
        if rotate:
            out.append(el("text", esc(lab), x=sx(i), y=float(y), text_anchor="end", fill=MUTED,
                          font_size=g.fs(10.5), transform=f"rotate(-35 {coord(sx(i))} {coord(y)})"))
        else:
            out.append(svg_text(sx(i), y, lab, text_anchor="middle", fill=MUTED, font_size=g.fs(11)))
    return out


def _panel_values(name: str, rows: Sequence[Mapping[str, Any]]) -> list[float]:
    vals: list[float] = []
    for r in rows:
        p = r["policies"].get(name) or {}
        shown = p if p.get("estimate") is not None or p.get("ci") else (p.get("assumed") or {})
        if shown.get("ci"):
            vals += list(shown["ci"])
        elif shown.get("estimate") is not None:
            vals.append(shown["estimate"])
    return vals


def _policy_panel(name: str, rows: Sequence[Mapping[str, Any]], ch: PolicyChanges | None, g: _Geom = WIDE) -> str:
    windows = [r["window"] for r in rows]
    sx = _x_scale(len(windows), g)
    T, H = (48, 150) if g.narrow else (30, 150)  # narrow: the baseline on a line of its own
    vals = _panel_values(name, rows)
    lo, hi, ticks, dec = nice_ticks(min(vals, default=0.0), max(vals, default=1.0), 5)
    sy = LinearScale(lo, hi, T + H, T)
    alarms = set(ch.alarms) if ch else set()
    base = f"baseline {_window_label(ch.baseline) if ch and ch.baseline else 'none'}"
    body = [svg_text(g.left if not g.narrow else 4, 18, name, fill=INK, font_size=g.fs(14), font_weight="600"),
            svg_text(4, 36, base, fill=MUTED, font_size=g.fs(11.5)) if g.narrow else
            svg_text(g.width - g.right, 18, base, text_anchor="end", fill=MUTED, font_size=g.fs(11.5))]
    axis = y_axis(sy, ticks, dec, g.left - 10, g.width - g.right, "" if g.narrow else "value")
    body += [a.replace('font-size="11"', f'font-size="{g.fs(11)}"') for a in axis]
    pts = []
    for i, r in enumerate(rows):
        p = r["policies"].get(name)
        x = sx(i)
        if p is None:
            body.append(svg_text(x, T + H / 2, "n/a" if g.narrow else "not evaluated", text_anchor="middle", fill=GREY,
                                 font_size=g.fs(10)))
            continue
        if p.get("level_claim") == "refused":
            body.append(el("g", el("title", esc(f"{_window_label(r['window'])}: refused - "
                                                + "; ".join(p.get("refusal_reasons") or [])))
                           + el("rect", x=x - 14, y=float(T), width="28", height=float(H), fill="#eceef1",
                                stroke="#8d949c", stroke_dasharray="3 3")
                           + svg_text(x, T + H / 2, "refused", text_anchor="middle", fill=MUTED, font_size=g.fs(10),
                                      font_style="italic",
                                      **({"transform": f"rotate(-90 {coord(x)} {coord(T + H / 2)})"}
                                         if g.narrow else {})),
                           class_=g.cls("refused-marker"), data_policy=name, data_window=r["window"]))
            pts.append(None)
            continue
        est, ci = p.get("estimate"), p.get("ci")
        assumed = p.get("assumed") if est is None and not ci else None
        if assumed:  # assumes transport, no quotable level: its assumed value drawn hollow, dashed interval
            a_est, a_ci = assumed.get("estimate"), assumed.get("ci")
            tip = f"{_window_label(r['window'])}: assumes transport {fmt(a_est)} {fmt_ci(a_ci)}"
            inner = el("title", esc(tip))
            if a_ci:
                inner += svg_line(x, sy(a_ci[0]), x, sy(a_ci[1]), stroke=SKY, stroke_width="2", stroke_dasharray="4 3")
            if a_est is not None:
                inner += el("circle", cx=x, cy=sy(a_est), r="5", fill="#fff", stroke=BLUE, stroke_width="1.5")
            body.append(el("g", inner, class_=g.cls("assumed-marker"), data_policy=name, data_window=r["window"]))
            pts.append(None)
            continue
        if p.get("level_claim") == "assumes_transport" and p.get("estimate") is None:
            body.append(el("g", el("title", esc(f"{_window_label(r['window'])}: no verified level (assumes "
                                                "transport; its own labels are too few)"))
                           + _rect_marker(x, T, H)
                           + svg_text(x, T + H / 2, "unverified", text_anchor="middle", fill=MUTED, font_size=g.fs(10),
                                      font_style="italic"),
                           class_=g.cls("unverified-marker"), data_policy=name, data_window=r["window"]))
            pts.append(None)
            continue
        if ci:
            body.append(svg_line(x, sy(ci[0]), x, sy(ci[1]), stroke=SKY, stroke_width="3", stroke_linecap="round"))
        if est is not None:
            pts.append((x, sy(est)))
            alarm = r["window"] in alarms
            tip = f"{_window_label(r['window'])}: {fmt(est)} {fmt_ci(ci)}"
            if alarm:
                body.append(el("g", el("title", esc(tip + " - regression alarm"))
                               + svg_diamond(x, sy(est), 8, fill=VERMILLION, stroke="#fff", stroke_width="1.5"),
                               class_=g.cls("alarm-marker"), data_policy=name, data_window=r["window"]))
            else:
                body.append(el("circle", el("title", esc(tip)), cx=x, cy=sy(est), r="5", fill=BLUE,
                               stroke="#fff", stroke_width="1.5", class_=g.cls("value-marker"), data_policy=name,
                               data_window=r["window"]))
        else:
            pts.append(None)
    lines = svg_polylines(pts, stroke=BLUE, stroke_width="1.6", stroke_opacity="0.6")
    body = body[:2] + lines + body[2:]
    body += _x_labels(sx, windows, T + H + 18, g)
    return svg_doc(g.width, T + H + ((86 if g.narrow else 48) if g.rotate(len(windows)) else 30), body,
                   f"Value of {name} over windows")


def _drift_strip(windows: Sequence[str], drift: Mapping[str, Sequence[Mapping[str, Any]]], g: _Geom = WIDE) -> str:
    sx = _x_scale(len(windows), g)
    rows_h = 44 if g.narrow else 30
    top = 48 if g.narrow else 34
    H = rows_h * max(len(drift), 1) + top
    if g.narrow:  # names above their rows (the left margin is too narrow for them)
        body = [svg_text(4, 16, "drift monitor", fill=MUTED, font_size=g.fs(11), font_weight="600")]
    else:
        body = [svg_text(g.left - 10, 16, "drift monitor", text_anchor="end", fill=MUTED, font_size="11",
                         font_weight="600")]
    for k, (mon, looks) in enumerate(sorted(drift.items())):
        y = top + k * rows_h
        if g.narrow:
            body.append(svg_text(4, y - 12, mon, fill=INK, font_size=g.fs(12)))
        else:
            body.append(svg_text(g.left - 10, y + 4, mon, text_anchor="end", fill=INK, font_size="12"))
        body.append(svg_line(g.left, y, g.width - g.right, y, stroke="#eaeef2", stroke_width="8",
                             stroke_linecap="round"))
        for lk in looks:
            i = _window_index(windows, lk.get("dt"))
            if i is None:
                continue
            tip = f"look {lk.get('look')} ({lk.get('dt')}): " + (
                "alarm on " + ", ".join(lk.get("alarms") or []) if lk.get("alarm") else "no alarm")
            if lk.get("alarm"):
                body.append(el("g", el("title", esc(tip)) + svg_diamond(sx(i), y, 8, fill=VERMILLION, stroke="#fff"),
                               class_=g.cls("drift-alarm"), data_monitor=mon, data_window=windows[i]))
            else:
                body.append(el("circle", el("title", esc(tip)), cx=sx(i), cy=float(y), r="5", fill=GREEN,
                               stroke="#fff", class_=g.cls("drift-look"), data_monitor=mon, data_window=windows[i]))
    return svg_doc(g.width, H, body, "Drift looks of linked monitors on the windows' time axis")


def _legend_svg(g: _Geom = WIDE) -> str:
    items = [
        (el("circle", cx=0.0, cy=0.0, r="5", fill=BLUE), "estimate"),
        (svg_line(0, -7, 0, 7, stroke=SKY, stroke_width="3"), "95% CI"),
        (svg_diamond(0, 0, 7, fill=VERMILLION), "regression alarm"),
        (el("rect", x=-8.0, y=-7.0, width="16", height="14", fill="#eceef1", stroke="#8d949c",
            stroke_dasharray="3 3"), "level refused (no value)"),
        (el("circle", cx=0.0, cy=0.0, r="5", fill="#fff", stroke=BLUE, stroke_width="1.5"),
         "assumes transport (not verified)"),
    ]
    if not g.narrow:
        return svg_doc(g.width, 26, svg_legend(items, g.left, 14, gap=26), "Legend")
    body = []
    for k, item in enumerate(items):  # one item a row
        body += [x.replace('font-size="12"', f'font-size="{g.fs(12)}"') for x in svg_legend([item], 12, 14 + 22 * k)]
    return svg_doc(g.width, 22 * len(items) + 6, body, "Legend")


#: Colours of the policies in the segment panels (Okabe-Ito, vermillion kept for alarms and losses).
SEGMENT_COLOURS = (BLUE, ORANGE, GREEN, PURPLE, SKY, "#6b7280")


def _segment_layout(rows: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[str], list[str]]:
    """(baseline, segments, compared policies) over the windows with segments: the latest window's order
    first, then segments and policies seen only in earlier windows."""
    baseline, segs, pols = None, [], []
    for r in reversed(rows):
        seg = r.get("segments")
        if not seg:
            continue
        baseline = baseline or seg.get("baseline")
        for name in list(seg.get("order") or []) + sorted(seg.get("diffs") or {}):
            if name not in segs:
                segs.append(name)
        for per in (seg.get("diffs") or {}).values():
            pols += [p for p in per if p not in pols]
    if "other" in segs:
        segs = [s for s in segs if s != "other"] + ["other"]
    return baseline, segs, pols


def _segment_panel(segment: str, rows: Sequence[Mapping[str, Any]], policies: Sequence[str], baseline: str,
                   g: _Geom = WIDE) -> str:
    """One segment over windows: each policy's difference with the baseline (filled: verified, hollow: assumes
    transport, a vermillion ring: significantly worse) with its interval; windows without a number say why."""
    windows = [r["window"] for r in rows]
    sx = _x_scale(len(windows), g)
    T, H = (56, 130) if g.narrow else (30, 130)  # narrow: the baseline on a line of its own
    vals = [0.0]
    for r in rows:
        for p in policies:
            d = (((r.get("segments") or {}).get("diffs") or {}).get(segment) or {}).get(p) or {}
            vals += list(d.get("ci") or []) + ([d["diff"]] if d.get("diff") is not None else [])
    lo, hi, ticks, dec = nice_ticks(min(vals), max(vals), 5)
    sy = LinearScale(lo, hi, T + H, T)
    title = segment if segment != "other" else "other (pooled small segments)"
    body = [svg_text(g.left if not g.narrow else 4, 18, title, fill=INK, font_size=g.fs(14), font_weight="600"),
            svg_text(4, 34, f"vs {baseline}", fill=MUTED, font_size=g.fs(11.5)) if g.narrow else
            svg_text(g.width - g.right, 18, f"difference with {baseline}", text_anchor="end", fill=MUTED,
                     font_size=g.fs(11.5))]
    axis = y_axis(sy, ticks, dec, g.left - 10, g.width - g.right, "" if g.narrow else "diff")
    body += [a.replace('font-size="11"', f'font-size="{g.fs(11)}"') for a in axis]
    body.append(svg_line(g.left, sy(0.0), g.width - g.right, sy(0.0), stroke=INK, stroke_width="1",
                         stroke_opacity="0.5"))
    k = max(len(policies), 1)
    for j, p in enumerate(policies):
        colour = SEGMENT_COLOURS[j % len(SEGMENT_COLOURS)]
        pts = []
        for i, r in enumerate(rows):
            x = sx(i) + (j - (k - 1) / 2) * (8 if g.narrow else 12)  # policies side by side within a window
            seg = r.get("segments")
            d = ((seg or {}).get("diffs") or {}).get(segment, {}).get(p) if seg else None
            if not d or d.get("diff") is None:
                why = ("not segmented" if not seg else "not in this window" if d is None else
                       ((seg.get("cells") or {}).get(segment, {}).get(p) or {}).get("reason") or "too few rows or labels")
                body.append(el("g", el("title", esc(f"{_window_label(r['window'])}, {p}: no number ({why})"))
                               + svg_text(x, T + H - 4, "\u00d7", text_anchor="middle", fill=GREY, font_size=g.fs(12)),
                               class_=g.cls("segment-gap"), data_segment=segment, data_policy=p,
                               data_window=r["window"]))
                pts.append(None)
                continue
            verified = d.get("claim") == "verified"
            tip = (f"{_window_label(r['window'])}, {p} - {baseline}: {signed(d['diff'])} {fmt_ci(d.get('ci'))} "
                   f"({'verified' if verified else 'assumes transport'}"
                   + ("; significantly worse" if d.get("worse") else "; significantly better" if d.get("better") else "")
                   + ")")
            inner = el("title", esc(tip))
            if d.get("ci"):
                inner += svg_line(x, sy(d["ci"][0]), x, sy(d["ci"][1]), stroke=colour, stroke_width="2",
                                  stroke_opacity="0.55", **({} if verified else {"stroke_dasharray": "3 3"}))
            if d.get("worse"):
                inner += el("circle", cx=x, cy=sy(d["diff"]), r="8.5", fill="none", stroke=VERMILLION,
                            stroke_width="2")
            inner += el("circle", cx=x, cy=sy(d["diff"]), r="4.5", fill=colour if verified else "#fff", stroke=colour,
                        stroke_width="1.6")
            body.append(el("g", inner, class_=g.cls("segment-marker"), data_segment=segment, data_policy=p,
                           data_window=r["window"], data_claim=d.get("claim") or "",
                           data_worse=str(bool(d.get("worse"))).lower()))
            pts.append((x, sy(d["diff"])))
        body = body[:2] + svg_polylines(pts, stroke=colour, stroke_width="1.4", stroke_opacity="0.6") + body[2:]
    body += _x_labels(sx, windows, T + H + 18, g)
    return svg_doc(g.width, T + H + ((86 if g.narrow else 48) if g.rotate(len(windows)) else 30), body,
                   f"Segment {segment}: difference with {baseline} over windows")


def _segment_legend(policies: Sequence[str], g: _Geom = WIDE) -> str:
    items = [(el("circle", cx=0.0, cy=0.0, r="5", fill=SEGMENT_COLOURS[j % len(SEGMENT_COLOURS)]), p)
             for j, p in enumerate(policies)]
    items += [(el("circle", cx=0.0, cy=0.0, r="5", fill="#fff", stroke=INK, stroke_width="1.5"),
               "assumes transport (hollow)"),
              (el("circle", cx=0.0, cy=0.0, r="7", fill="none", stroke=VERMILLION, stroke_width="2"),
               "significantly worse"),
              (svg_text(0, 4, "\u00d7", text_anchor="middle", fill=GREY), "too few: no number")]
    if not g.narrow:
        return svg_doc(g.width, 26, svg_legend(items, g.left, 14, gap=22), "Legend of the segment panels")
    body = []
    for k, item in enumerate(items):
        body += [x.replace('font-size="12"', f'font-size="{g.fs(12)}"') for x in svg_legend([item], 12, 14 + 22 * k)]
    return svg_doc(g.width, 22 * len(items) + 6, body, "Legend of the segment panels")


def segments_trend_section(rows: Sequence[Mapping[str, Any]]) -> str:
    """The trend page's ``<section id='segments'>``: one panel per segment over the windows (empty string when
    no window was segmented)."""
    baseline, segs, pols = _segment_layout(rows)
    if not segs or baseline is None:
        return ""
    cols = next((r["segments"].get("columns") for r in reversed(rows) if r.get("segments")), []) or []
    panels = "".join(_both(_segment_panel, s, rows, pols, baseline) for s in segs)
    return ("<section id='segments'><h2>Segments over windows</h2><p class='lead'>Per segment of "
            f"<b>{esc(' x '.join(cols))}</b>, each policy's difference with <b>{esc(baseline)}</b> in every window "
            "with its interval (false coverage rate controlled when claimed). Filled: verified by the segment's own "
            "labels; hollow with a dashed interval: assumes transport; \u00d7: too few rows or labels (no number)."
            f"</p>{_both(_segment_legend, pols)}{panels}</section>")


def _window_index(windows: Sequence[str], dt: Any) -> int | None:
    if not dt:
        return None
    hit = None
    for i, w in enumerate(windows):
        a, _, b = str(w).partition("_")
        if a <= str(dt) <= (b or a):
            hit = i
    return hit


def _grid(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    head = "".join(f"<th class='c'>{esc(_window_label(r['window']))}</th>" for r in rows)
    out = []
    for n in names:
        cells = []
        for r in rows:
            p = r["policies"].get(n)
            if p is None:
                cells.append("<td class='cell muted'>\u2013</td>")
                continue
            v = p.get("audit") if p.get("audit") in VERDICT_STYLE else "not_run"
            sym, label, _ = VERDICT_STYLE[v]
            cells.append(f"<td class='cell' data-policy='{esc(n)}' data-window='{esc(r['window'])}'>"
                         f"<span class='badge v-{esc(v)}' title='{esc(label)}'>{esc(sym)}</span> "
                         f"<span class='num'>{esc(_dash(p.get('n_labelled')))}</span></td>")
        out.append(f"<tr><td class='name'>{esc(n)}</td>{''.join(cells)}</tr>")
    total = "".join(f"<td class='cell num'>{esc(_dash(r.get('n_labels')))}</td>" for r in rows)
    out.append(f"<tr><td class='muted'>all labels</td>{total}</tr>")
    return (f"<div class='scroll'><table class='data'><thead><tr><th>policy</th>{head}</tr></thead>"
            f"<tbody>{''.join(out)}</tbody></table></div>")


def _changes_table(changes: Mapping[str, PolicyChanges], window: str) -> str:
    rows = []
    for n, pc in changes.items():
        if window not in pc.windows:
            continue
        i = pc.windows.index(window)
        for c in pc.tests_at(i):
            if c.status == "not_estimable":
                num = f"<td class='muted' colspan='2'>not estimable: {esc(c.reason)}</td>"
            else:
                num = (f"<td class='r num'>{esc(signed(c.diff))}</td>"
                       f"<td class='r num'>{esc(fmt_ci(c.ci_anytime))}</td>")
            cls = {"regression": "v-fail", "improvement": "v-pass", "undecided": "v-inconclusive"}.get(c.status,
                                                                                                    "v-not_run")
            extra = f" ({c.labels_needed} more labels would decide)" if c.labels_needed else ""
            what = f"mean of last {c.n_windows} windows" if c.kind == "pooled" else c.kind
            rows.append(f"<tr><td class='name'>{esc(n)}</td><td>{esc(what)} vs "
                        f"{esc(_window_label(c.ref))}</td>{num}<td><span class='badge {cls}'>{esc(c.status)}"
                        f"</span>{esc(extra)}</td><td class='r num'>{esc(f'{c.alpha_spent:.1e}')}</td></tr>")
    if not rows:
        return "<p class='muted'>No change can be computed yet (one window, or no estimable value).</p>"
    return ("<div class='scroll'><table class='data'><thead><tr><th>policy</th><th>change</th>"
            "<th class='r'>diff</th><th class='r'>anytime CI</th><th>status</th><th class='r'>\u03b1 spent</th>"
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")


def _runs_table(history: Sequence[Mapping[str, Any]]) -> str:
    """Every run, newest first; the window links to the run's report (first column: never scrolled away)."""
    rows = []
    for r in reversed(history):
        label = esc(_window_label(r["window"]))
        cell = f"<a href='../{esc(r['report_key'])}'>{label}</a>" if r.get("report_key") else label
        rows.append(f"<tr data-window='{esc(r['window'])}' data-run-key='{esc(r['run_key'])}'>"
                    f"<td class='num'>{cell}</td><td class='num'>{esc(r['run_key'])}</td>"
                    f"<td class='num'>{esc(str(r.get('published_at'))[:19])}</td>"
                    f"<td>{esc(r.get('best_policy') or 'none')}</td></tr>")
    return ("<p class='note'>The window links to the run's report.</p><div class='scroll'><table class='data compact'>"
            "<thead><tr><th>window (report)</th><th>run</th><th>published</th><th>best policy</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def _requests_table(requests: Sequence[Mapping[str, Any]]) -> str:
    if not requests:
        return "<p class='muted'>No open label requests.</p>"
    rows = "".join(f"<tr data-request-id='{esc(r.get('request_id'))}' data-status='{esc(r.get('status'))}'>"
                   f"<td class='num'>{esc(r.get('request_id'))}</td><td>{esc(r.get('scope'))}</td>"
                   f"<td class='r num'>{esc(r.get('n_labels'))}</td><td class='num'>{esc(r.get('deadline'))}</td>"
                   f"<td class='reason'>{esc('; '.join(str(x) for x in r.get('reasons') or []))}</td></tr>"
                   for r in requests)
    return ("<div class='scroll'><table class='data'><thead><tr><th>request</th><th>scope</th><th class='r'>labels"
            f"</th><th>deadline</th><th>why</th></tr></thead><tbody>{rows}</tbody></table></div>")


def render_trend(evaluation: str, windows: Sequence[Mapping[str, Any]], history: Sequence[Mapping[str, Any]],
                 changes: Mapping[str, PolicyChanges], drift: Mapping[str, Sequence[Mapping[str, Any]]],
                 requests: Sequence[Mapping[str, Any]]) -> str:
    """The trend page of one evaluation.

    Parameters
    ----------
    evaluation : str
    windows : list of dict
        The latest run of each window, in time order (`flows.reports.history.latest_per_window`).
    history : list of dict
        Every published run (`flows.reports.history.read_history`).
    changes : dict of str -> PolicyChanges
    drift : dict of monitor -> looks (`flows.reports.history.linked_drift`)
    requests : list of dict (`flows.reports.history.open_label_requests`)
    """
    names: list[str] = []
    for r in windows:
        names += [n for n in r["policies"] if n not in names]
    latest = windows[-1]
    alarm_now = sorted(n for n, pc in changes.items() if latest["window"] in pc.alarms)
    drift_alarms = sum(1 for looks in drift.values() for lk in looks if lk.get("alarm"))
    kpis = [("latest window", _window_label(latest["window"]), False),
            ("best policy", latest.get("best_policy") or "none", False),
            ("regression alarms now", ", ".join(alarm_now) or "none", bool(alarm_now)),
            ("drift alarms (all looks)", str(drift_alarms), bool(drift_alarms)),
            ("open label requests", str(len(requests)), bool(requests))]
    kpi_html = "".join(f"<div class='kpi{' bad' if bad else ''}' data-kpi='{esc(k)}'><span>{esc(k)}</span>"
                       f"<b>{esc(v)}</b></div>" for k, v, bad in kpis)
    legend = _both(_legend_svg)
    panels = "".join(_both(_policy_panel, n, windows, changes.get(n)) for n in names)
    drift_html = (_both(_drift_strip, [r["window"] for r in windows], drift) if drift else
                  "<p class='muted'>No drift monitor is linked to this evaluation (a monitor is linked when its "
                  "calibration comes from this evaluation's results).</p>")
    body = [
        f"<section id='status' class='summary'><h2>Status</h2><div class='kpis'>{kpi_html}</div>"
        f"{segment_brief_html((latest.get('segments') or {}).get('brief'), ', latest window')}</section>",
        "<section id='values'><h2>Policy values over windows</h2><p class='lead'>Calibrated values on the oracle "
        "scale with their intervals, one panel per policy on one time axis. A refused window has no value (its "
        "number is a ranking-only figure and is never drawn). Diamonds: regression alarms (a significant drop "
        "against the previous window or the baseline, with the false-alarm rate held over all windows by alpha "
        f"spending; see docs/monitoring.md).</p>{legend}{panels}</section>",
        segments_trend_section(windows),
        f"<section id='drift'><h2>Judge drift of linked monitors</h2>{drift_html}</section>",
        "<section id='changes'><h2>Changes in the latest window</h2>"
        f"{_changes_table(changes, latest['window'])}</section>",
        "<section id='audits'><h2>Audit verdicts and own labels over windows</h2>"
        f"{_grid(windows, names)}</section>",
        f"<section id='requests'><h2>Open label requests</h2>{_requests_table(requests)}</section>",
        f"<section id='runs'><h2>Runs</h2>{_runs_table(history)}</section>",
    ]
    crumbs = "<nav class='crumbs'><a href='../index.html'>\u2190 all evaluations</a></nav>"
    return _page(f"Trend: {evaluation}", f"{len(windows)} window(s), {len(history)} run(s)", body, crumbs)


# --------------------------------------------------------------------------------------------- writing
def evaluation_pages(st: Storage, evaluation: str, *, requests_st: Storage | None = None,
                     labels_st: Storage | None = None,
                     drift_st: Storage | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """The trend page of ``evaluation`` and its index entry, from what is published (None if nothing is).

    Label requests are read from ``requests_st`` (their status with the label store ``labels_st``, as
    ``cje requests status``; read only when there are requests) and drift looks from ``drift_st``; each
    defaults to ``st``.
    """
    history = read_history(st, evaluation)
    if not history:
        return None, None
    windows = latest_per_window(history)
    changes = window_changes_of(history)
    drift = linked_drift(drift_st or st, evaluation)
    requests = open_label_requests(requests_st or st, evaluation, labels_st or st)
    page = render_trend(evaluation, windows, history, changes, drift, requests)
    entry = {"evaluation": evaluation, "latest": windows[-1] if windows else history[-1], "n_runs": len(history),
             "n_windows": len(windows), "alarms": {n: pc.alarms for n, pc in changes.items()},
             "drift_alarms": sum(1 for looks in drift.values() for lk in looks if lk.get("alarm")),
             "open_requests": len(requests)}
    return page, entry


def write_pages(st: Storage, evaluation: str | None = None, *, requests_st: Storage | None = None,
                labels_st: Storage | None = None, drift_st: Storage | None = None) -> dict[str, str]:
    """Rebuild ``results/<evaluation>/trend.html`` (one evaluation, or all) and ``results/index.html``.

    Each page is one atomic object write (readers see the old or the new page). Returns page -> location.
    ``requests_st``, ``labels_st``, ``drift_st``: where ``evaluation``'s label requests, label store and
    drift looks live when not under ``st`` (`evaluation_pages`); the other evaluations read ``st``.

    Each evaluation's index entry is kept beside its trend page (`ENTRY`, written whenever it is computed): the index
    takes another evaluation's kept entry while its runs are the ones it was computed from (the manifests of one
    listing of the results, `flows.reports.history.published_manifests`) and its checksum holds, and computes it
    again otherwise (and keeps it). A publish then reads its own evaluation's history only, not every run of every
    evaluation (38 evaluations of one run each on radosgw: 9.9 s of wall and 1.35 s of CPU for the pages before,
    RESULTS.md, "Session 33"). The steps that change another part of an entry (label requests, drift looks)
    rebuild their own evaluation's pages (`flows.pipelines.pages.refresh_pages`).
    """
    written = {}
    entries = []
    published = published_manifests(st)
    others = [name for name in published if evaluation is not None and name != evaluation]
    with ThreadPoolExecutor(max_workers=ENTRY_READERS) as pool:  # one small read each, at the store's latency
        kept = dict(zip(others, pool.map(lambda name: kept_entry(st, name, published[name]), others)))
    for name, runs in published.items():
        mine = evaluation is None or name == evaluation
        entry = None if mine else kept[name]
        if entry is None:
            sources = (dict(requests_st=requests_st, labels_st=labels_st, drift_st=drift_st) if name == evaluation
                       else {})
            page, entry = evaluation_pages(st, name, **sources)
            if page is None:
                continue
            if mine:
                key = f"{RESULTS}/{name}/{TREND}"
                st.write_bytes(key, page.encode("utf-8"))
                written[key] = st.url(key)
            keep_entry(st, name, runs, entry)
        entries.append(entry)
    key = f"{RESULTS}/{INDEX}"
    st.write_bytes(key, render_index(entries).encode("utf-8"))
    written[key] = st.url(key)
    return written


#: An evaluation's index entry kept beside its trend page (`write_pages`).
ENTRY = "index-entry.json"
#: The kept entry's format: an entry of another version is computed again.
ENTRY_VERSION = 1
#: Kept entries read at once (threads: each read waits on the store).
ENTRY_READERS = 8


def _entry_body(runs: Sequence[tuple[str, int]], entry: Mapping[str, Any]) -> bytes:
    return json.dumps({"version": ENTRY_VERSION, "runs": [list(r) for r in runs], "entry": entry},
                      sort_keys=True, separators=(",", ":"), allow_nan=True).encode("utf-8")


def keep_entry(st: Storage, evaluation: str, runs: Sequence[tuple[str, int]], entry: Mapping[str, Any]) -> None:
    """Keep ``evaluation``'s index entry, computed from its runs' manifests ``runs``, with the SHA-256 of its body
    (an entry that does not serialize as JSON is not kept: it is computed at each rebuild, as before)."""
    try:
        body = _entry_body(runs, entry)
    except (TypeError, ValueError) as exc:
        log.warning("the index entry of %s is not kept (%s): computed at each rebuild", evaluation, exc)
        return
    st.write_bytes(f"{RESULTS}/{evaluation}/{ENTRY}",
                   json.dumps({"sha256": hashlib.sha256(body).hexdigest(), "body": body.decode("utf-8")}).encode())


def kept_entry(st: Storage, evaluation: str, runs: Sequence[tuple[str, int]]) -> dict[str, Any] | None:
    """``evaluation``'s kept index entry when it was computed from the runs ``runs`` (the manifests listed now), is
    of this `ENTRY_VERSION` and its checksum holds; else None (none kept, another version, runs published since,
    an unreadable or altered object: each logged, then computed again)."""
    key = f"{RESULTS}/{evaluation}/{ENTRY}"
    try:
        outer = json.loads(st.read_bytes(key))
        body = outer["body"].encode("utf-8")
    except NotFoundError:
        return None
    except (StorageError, ValueError, KeyError, TypeError, AttributeError, UnicodeError) as exc:
        log.warning("the kept index entry %s is unreadable (%s): computed again", st.url(key), exc)
        return None
    if hashlib.sha256(body).hexdigest() != outer.get("sha256"):
        log.warning("the kept index entry %s does not match its checksum: computed again", st.url(key))
        return None
    kept = json.loads(body)
    if kept.get("version") != ENTRY_VERSION or [tuple(r) for r in kept.get("runs", [])] != [tuple(r) for r in runs]:
        return None  # another format, or runs published (or removed) since it was computed
    return kept.get("entry")
