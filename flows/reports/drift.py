"""The drift monitor's HTML report: one self-contained page (inline CSS and SVG, no scripts).

`render_drift_report(history, state=...)` draws one timeline panel per metric over the looks,
with each look's fixed-sample interval and its alarm thresholds (every look spends its own share
of alpha, so the thresholds move), and a table of the looks. It shares the evaluation report's
formatting and SVG helpers (`flows.reports.common`, `flows.reports.svg`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from cje_engine.drift.monitor import METRICS
from cje_engine.errors import CJEInputError

from flows.reports.common import (BLUE, GREEN, GREY, GRID, INK, MUTED, PURPLE, SKY, VERMILLION, as_number, esc, fmt,
                                  name_cell, signed)
from flows.reports.evaluation import CSS  # the evaluation report's page style
from flows.reports.svg import (LinearScale, coord, nice_ticks, svg_diamond, svg_doc, svg_legend, svg_line,
                               svg_polylines, svg_text)

__all__ = ["render_drift_report"]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _fmt_p(p: Any) -> str:
    v = as_number(p)
    if v is None:
        return "n/a"
    return "<0.001" if v < 0.001 else f"{v:.3f}"


def _el(tag: str, content: str | None = None, **attrs: Any) -> str:
    a = "".join(f' {k.rstrip("_").replace("_", "-")}="{esc(coord(v) if isinstance(v, float) else v)}"'
                for k, v in attrs.items() if v is not None)
    return f"<{tag}{a}/>" if content is None else f"<{tag}{a}>{content}</{tag}>"




def _y_axis(sy: LinearScale, ticks: Sequence[float], decimals: int, x: float, right: float,
            label: str | None = None) -> list[str]:
    out = []
    for t in ticks:
        y = sy(t)
        text = f"{t:.{decimals}f}"
        text = text[1:] if text.startswith("-") and float(text) == 0 else text
        out.append(svg_line(x, y, right, y, stroke=GRID, stroke_width="1"))
        out.append(svg_line(x - 5, y, x, y, stroke=MUTED, stroke_width="1"))
        out.append(svg_text(x - 8, y + 4, text, text_anchor="end", fill=MUTED, font_size="11"))
    out.append(svg_line(x, sy(ticks[0]), x, sy(ticks[-1]), stroke=MUTED, stroke_width="1"))
    if label:
        cy = (sy(ticks[0]) + sy(ticks[-1])) / 2
        out.append(_el("text", esc(label), x=float(x - 46), y=float(cy), text_anchor="middle",
                       fill=INK, font_size="12", transform=f"rotate(-90 {coord(x - 46)} {coord(cy)})"))
    return out


# --------------------------------------------------------------------------------------------
# panels and page
# --------------------------------------------------------------------------------------------
def _threshold(m: dict) -> tuple[float | None, float | None]:
    """Alarm thresholds of a metric at its look, from its anytime interval.

    Two-sided: ``null -/+ half-width of ci_anytime``; one-sided (``alternative="less"``, the rank
    metric): ``null - (upper bound - estimate)`` below, none above.
    """
    ci = m.get("ci_anytime")
    null, est = m.get("null_value"), m.get("estimate")
    if not ci or null is None:
        return None, None
    if m.get("alternative") == "less":
        if ci[1] is None or est is None:
            return None, None
        return null - (ci[1] - est), None
    if ci[0] is None or ci[1] is None:
        return None, None
    half = (ci[1] - ci[0]) / 2.0
    return null - half, null + half


def _panel(xs: list[int], labels: list[str], series: dict, title: str, ylab: str, note: str,
           judge_changes: list[tuple[int, str]], width: int = 1040) -> str:
    """One timeline panel: estimate (line+dots), fixed-sample CIs, per-look alarm thresholds."""
    est, lo_ci, hi_ci = series["estimate"], series["ci_lo"], series["ci_hi"]
    thr_lo, thr_hi, alarm, base = series["thr_lo"], series["thr_hi"], series["alarm"], series.get("baseline")
    n = len(xs)
    L, W, T, H = 80, width - 80 - 40, 34, 190
    rotate = n > 12
    xlab_h = 62 if rotate else 34
    height = T + H + xlab_h + 8
    vals = [v for arr in (est, lo_ci, hi_ci, thr_lo, thr_hi, base or []) for v in arr if v is not None]
    if not vals:
        return ""
    vlo, vhi = min(vals), max(vals)
    pad = 0.06 * (vhi - vlo or 1.0)
    ylo, yhi, yt, yd = nice_ticks(vlo - pad, vhi + pad, 5)
    sx = LinearScale(-0.5, n - 0.5, L, L + W)
    sy = LinearScale(ylo, yhi, T + H, T)
    b: list[str] = [svg_text(L, T - 14, title, fill=INK, font_size="13", font_weight="600")]
    if note:
        b.append(svg_text(L + W, T - 14, note, fill=MUTED, font_size="11", text_anchor="end"))
    # no-alarm band between the thresholds of each look
    for i in range(n):
        if thr_lo[i] is not None and thr_hi[i] is not None:
            x0, x1 = sx(i - 0.5), sx(i + 0.5)
            b.append(_el("rect", x=x0, y=sy(min(thr_hi[i], yhi)), width=x1 - x0,
                             height=max(0.0, sy(max(thr_lo[i], ylo)) - sy(min(thr_hi[i], yhi))),
                             fill=GREEN, fill_opacity="0.09"))
    b += _y_axis(sy, yt, yd, L, L + W, ylab)
    for i, j in judge_changes:
        x = sx(i - 0.5)
        b.append(svg_line(x, T, x, T + H, stroke=PURPLE, stroke_width="1.2", stroke_dasharray="2 3"))
        b.append(svg_text(x + 4, T + 11, f"judge {j}", fill=PURPLE, font_size="10.5"))
    if base is not None:
        pts = [(i, v) for i, v in enumerate(base) if v is not None]
        if pts:
            b.append(_el("polyline", points=" ".join(f"{coord(sx(i))},{coord(sy(v))}" for i, v in pts),
                         fill="none", stroke=GREY, stroke_width="1.5", stroke_dasharray="4 3"))
    for arr in (thr_lo, thr_hi):  # stepped threshold lines (they widen as the budget per look shrinks)
        for i, v in enumerate(arr):
            if v is not None and ylo <= v <= yhi:
                b.append(svg_line(sx(i - 0.45), sy(v), sx(i + 0.45), sy(v), stroke=VERMILLION,
                                  stroke_width="1.6", stroke_dasharray="5 3"))
    for i in range(n):
        if lo_ci[i] is not None and hi_ci[i] is not None:
            b.append(svg_line(sx(i), sy(lo_ci[i]), sx(i), sy(hi_ci[i]), stroke=SKY, stroke_width="2"))
    b += svg_polylines([None if v is None else (sx(i), sy(v)) for i, v in enumerate(est)], stroke=BLUE,
                       stroke_width="2")
    for i, v in enumerate(est):
        if v is None:
            continue
        if alarm[i]:
            b.append(svg_diamond(sx(i), sy(v), 7, fill=VERMILLION, stroke="#fff"))
        else:
            b.append(_el("circle", cx=sx(i), cy=sy(v), r="4", fill=BLUE, stroke="#fff"))
    b.append(svg_line(L, T + H, L + W, T + H, stroke=MUTED, stroke_width="1"))
    step = max(1, math.ceil(n / 40))
    for i, lab in enumerate(labels):
        if i % step and i != n - 1:
            continue
        x, ty = sx(i), T + H + 16
        b.append(svg_line(x, T + H, x, T + H + 4, stroke=MUTED))
        if rotate:
            b.append(_el("text", esc(lab), x=float(x), y=float(ty), text_anchor="end", fill=MUTED,
                         font_size="10.5", transform=f"rotate(-40 {coord(x)} {coord(ty)})"))
        else:
            b.append(svg_text(x, ty, lab, text_anchor="middle", fill=MUTED, font_size="10.5"))
    return svg_doc(width, height, b, title)


def _series(history: list[dict], metric: str) -> dict:
    out: dict[str, list] = {k: [] for k in ("estimate", "ci_lo", "ci_hi", "thr_lo", "thr_hi", "alarm")}
    for lk in history:
        m = (lk.get("metrics") or {}).get(metric) or {}
        ci = m.get("ci") or [None, None]
        lo, hi = _threshold(m)
        out["estimate"].append(m.get("estimate"))
        out["ci_lo"].append(ci[0])
        out["ci_hi"].append(ci[1])
        out["thr_lo"].append(lo)
        out["thr_hi"].append(hi)
        out["alarm"].append(bool(m.get("alarm")))
    return out


def _tau_series(history: list[dict]) -> dict:
    """Agreement with the reference judge on the tau scale, thresholds around the baseline.

    Rank metric (``comparison="rank_change"``): the mean tau of the reference scorings with the
    recent looks, against the mean tau within them (the baseline, grey); the alarm threshold is
    the baseline plus the metric's threshold. Floor test: tau(reference, current) against the floor.
    """
    out: dict[str, list] = {k: [] for k in ("estimate", "ci_lo", "ci_hi", "thr_lo", "thr_hi", "alarm", "baseline")}
    for lk in history:
        m = (lk.get("metrics") or {}).get("tau_b") or {}
        d = m.get("detail") or {}
        lo, hi = _threshold(m)
        ci = d.get("tau_ci") or [None, None]
        tau, base = d.get("tau"), None
        if d.get("comparison") == "rank_change":
            base = d.get("tau_within")
            tau = d.get("tau_between")
            mci = m.get("ci") or [None, None]
            shift = None if base is None else base
            ci = [None if v is None or shift is None else shift + v for v in mci]
            lo = None if lo is None or shift is None else shift + lo
            hi = None
        elif d.get("comparison") == "tau_floor":
            base = m.get("null_value")
        out["estimate"].append(tau)
        out["ci_lo"].append(ci[0])
        out["ci_hi"].append(ci[1])
        out["thr_lo"].append(lo)
        out["thr_hi"].append(hi)
        out["alarm"].append(bool(m.get("alarm")))
        out["baseline"].append(base)
    return out


def _looks_table(history: list[dict]) -> str:
    """One row per look: tau-b, the rank change and the other metrics' estimates (alarms bold)."""
    rows = []
    for h in history:
        ms = h["metrics"]
        meta = h.get("meta") or {}

        def cell(m: str, digits: int = 3) -> str:
            d = ms.get(m) or {}
            v = d.get("estimate")
            if v is None:
                return "<td class='num r muted'>\u2013</td>"
            cls = " sig" if d.get("alarm") else ""
            return (f"<td class='num r{cls}' title='p={_fmt_p(d.get('p_value'))}, alpha spent="
                    f"{d.get('alpha_spent', 0):.2g}'>{signed(v, digits)}</td>")

        tdet = (ms.get("tau_b") or {}).get("detail") or {}
        rows.append(
            f"<tr class='{'alarm' if h.get('alarm') else ''}'><td class='num'>{esc(h['look'])}</td>"
            f"<td>{esc(meta.get('dt', ''))}</td><td>{name_cell(meta.get('judge_id', ''))}</td>"
            f"<td class='num r'>{esc(h.get('n_anchors'))}</td>"
            f"<td class='num r'>{fmt(tdet.get('tau'))}</td>{cell('tau_b')}{cell('residual_mean')}"
            f"{cell('calibration_loss', 4)}{cell('mean_shift')}"
            f"<td class='num r'>{fmt((ms.get('distribution') or {}).get('estimate'))}</td>"
            f"<td>{esc(', '.join(h.get('alarms') or []) or 'none')}</td></tr>")
    table = ("<div class='scroll'><table class='data'><thead><tr><th>look</th><th>date</th><th>judge</th>"
             "<th class='r'>anchors</th><th class='r'>\u03c4-b</th><th class='r'>rank change</th>"
             "<th class='r'>residual shift</th><th class='r'>\u0394 loss</th><th class='r'>mean shift</th>"
             "<th class='r'>KS</th><th>alarms</th></tr></thead><tbody>" + "".join(rows)
             + "</tbody></table></div><p class='note'>Bold purple values alarmed at that look; hover a value for "
             "its p-value and the alpha it was allowed to spend.</p>")
    return table


def _panels(history: list[dict], xs: list[int], labels: list[str], changes: list[tuple[int, str]]) -> list[str]:
    """The timeline panels: rank agreement, residual shift, calibration loss, mean shift."""
    panels = []
    tau = _tau_series(history)
    tau_note = ("mean tau of the reference scorings with the recent looks; grey: mean tau within them "
                "(no-drift value)" if any(v is not None for v in tau["baseline"])
                else "no baseline (replicate, window or floor): tau-b cannot alarm")
    panels.append(_panel(xs, labels, tau, "Kendall \u03c4-b agreement with the reference judge", "\u03c4-b",
                         tau_note, changes))
    for metric, title_, ylab, note in (
            ("residual_mean", "Mean residual shift on labelled anchors (oracle scale)", "shift",
             "below 0: the judge now scores higher; levels calibrated before would be biased up"),
            ("calibration_loss", "Calibration loss change, MSE current \u2212 reference", "\u0394 MSE",
             "above 0: the old calibration fits the judge's scores worse"),
            ("mean_shift", "Paired mean shift of judge scores", "shift", "current \u2212 reference, per anchor")):
        s = _series(history, metric)
        if any(v is not None for v in s["estimate"]):
            panels.append(_panel(xs, labels, s, title_, ylab, note, changes))
        else:
            why = ((history[-1]["metrics"].get(metric) or {}).get("note") or "not computed")
            panels.append(f"<p class='note'><b>{esc(title_)}</b>: not computed ({esc(why)}).</p>")
    return panels


_SEP = " \u00b7 "


def _checked_history(history: Sequence[dict]) -> list[dict]:
    """The looks (dicts only); `CJEInputError` when there is none or a look lacks its fields."""
    history = [h for h in history if isinstance(h, dict)]
    if not history:
        raise CJEInputError("no looks to report", source="drift history")
    for i, h in enumerate(history):
        if not isinstance(h.get("metrics"), dict) or "look" not in h:
            raise CJEInputError("each look needs 'look' and 'metrics' (DriftLook.to_dict())",
                                source="drift history", row=i)
    return history


def _judge_changes(history: list[dict], state: dict) -> list[tuple[int, str]]:
    """``(index, judge_id)`` of the looks whose judge differs from the previous look's (the first look:
    from the reference's)."""
    meta0 = history[0].get("meta") or {}
    judges = [(h.get("meta") or {}).get("judge_id") for h in history]
    ref_judge = (state.get("reference") or {}).get("judge_id") or meta0.get("reference_look", "/").split("/", 1)[-1]
    return [(i, j) for i, j in enumerate(judges) if j is not None and j != (judges[i - 1] if i else ref_judge)]


def _legend_svg(alpha: float) -> str:
    return svg_doc(1040, 26, svg_legend([
        (_el("circle", cx=0.0, cy=0.0, r="4", fill=BLUE), "estimate"),
        (svg_line(0, -7, 0, 7, stroke=SKY, stroke_width="2"), f"{100 * (1 - alpha):g}% interval (this look)"),
        (svg_line(-9, 0, 9, 0, stroke=VERMILLION, stroke_dasharray="5 3"), "alarm threshold (anytime)"),
        (_el("rect", x=-8.0, y=-6.0, width="16", height="12", fill=GREEN, fill_opacity="0.2"), "no alarm"),
        (svg_diamond(0, 0, 6, fill=VERMILLION), "alarm"),
        (svg_line(0, -7, 0, 7, stroke=PURPLE, stroke_dasharray="2 3"), "judge changed"),
    ], 84, 14, gap=22), "Legend")


def _status_html(history: list[dict], labels: list[str], alpha: float) -> str:
    """The status box: the metrics alarmed and since which look, or no alarm."""
    first_alarm = history[-1].get("first_alarm") or {}
    alarmed = {m: v for m, v in first_alarm.items() if v is not None}
    if not alarmed:
        return (f"<div class='item ok'><p>No drift alarm in {len(history)} look(s). Family-wise false-alarm "
                f"rate over all looks and metrics \u2264 {fmt(alpha, 2)}.</p></div>")
    look_label = {h["look"]: lab for h, lab in zip(history, labels)}
    first = min(alarmed.values())
    return (f"<div class='item bad'><p><b>Drift alarm</b> since look "
            f"{esc(look_label.get(first, first))}: "
            + ", ".join(f"{esc(m)} (first at look {v})" for m, v in sorted(alarmed.items(), key=lambda t: t[1]))
            + ". Fresh oracle labels on the anchors and on recent traffic are needed before levels "
            "calibrated with the old judge are trusted.</p></div>")


def _facts(history: list[dict], state: dict, cfg: dict, alpha: float) -> list[str]:
    """The header's facts: reference and replicate, anchors, alpha spending, calibration."""
    meta0, last = history[0].get("meta") or {}, history[-1]
    horizon = cfg.get("horizon")
    spending = ("alpha/(t(t+1)) per look (unbounded)" if horizon is None else f"alpha/{horizon} per look "
                f"(horizon {horizon} looks)")
    ref = state.get("reference") or {}
    repl = state.get("replicate") or {}
    cal = meta0.get("calibration") or (last.get("meta") or {}).get("calibration")
    return [
        f"reference look <b>{esc(ref.get('look_key') or meta0.get('reference_look'))}</b>",
        f"replicate <b>{esc(repl.get('look_key') or meta0.get('replicate_look') or 'none')}</b>",
        f"{esc(last.get('n_anchors'))} paired anchors, {esc(last.get('n_labelled'))} labelled",
        f"anchor set v{esc((last.get('meta') or {}).get('anchors_version'))}",
        f"alpha {fmt(alpha, 2)}, spent {esc(spending)}, split equally over "
        f"{len(METRICS)} metrics" if not cfg.get("weights") or len(set(cfg["weights"].values())) == 1
        else f"alpha {fmt(alpha, 2)}, spent {esc(spending)}, weights {esc(cfg['weights'])}",
        ("calibration: " + esc(f"{cal.get('evaluation')} {cal.get('window')} ({cal.get('mode')})")) if cal
        else ("calibration supplied by the caller" if (last["metrics"].get("residual_mean") or {}).get("estimate")
              is not None else "no calibration: residual metrics skipped"),
    ]


def render_drift_report(history: Sequence[dict], *, state: dict | None = None, title: str | None = None) -> str:
    """A self-contained HTML page (inline CSS and SVG) with the drift timeline of a monitor.

    Parameters
    ----------
    history : list of dict
        ``DriftLook.to_dict()`` of every look, in look order (`read_looks`).
    state : dict, optional
        The monitor's state (reference, replicate, monitor configuration) for the header.
    title : str, optional

    Panels: Kendall tau-b of reference vs current scores (with the reference's test-retest
    baseline), the mean residual shift on labelled anchors, the calibration-loss change and the
    paired mean score shift; each with the fixed-sample interval of the look (light bars) and the
    look's alarm thresholds (dashed: ``null -/+ t quantile(alpha spent) x SE``; they widen over
    looks as the per-look budget shrinks). Alarms are diamonds.
    """
    history = _checked_history(history)
    state = state or {}
    meta0, last = history[0].get("meta") or {}, history[-1]
    set_name = meta0.get("set_name") or state.get("set_name") or "?"
    monitor = meta0.get("monitor") or state.get("monitor_name") or set_name
    page_title = title or f"Judge drift: anchor set {set_name}"
    labels = [f"#{h['look']} {(h.get('meta') or {}).get('dt', '')}".strip() for h in history]
    cfg = (state.get("monitor") or {}).get("config") or {}
    alpha = last.get("alpha", cfg.get("alpha", 0.05))
    panels = _panels(history, list(range(len(history))), labels, _judge_changes(history, state))
    css = CSS + "\n.facts b{font-weight:600}\n.summary .item p{margin:4px 0}\n"
    parts = [
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{esc(page_title)}</title><style>{css}</style></head><body><main>",
        f"<header class='top'><h1>{esc(page_title)}</h1><div class='meta'>monitor "
        f"{esc(monitor)} \u00b7 {len(history)} look(s) \u00b7 latest "
        f"{esc((last.get('meta') or {}).get('dt', ''))} by judge {esc((last.get('meta') or {}).get('judge_id', ''))}"
        "</div></header>",
        f"<section class='summary' id='status'><h2>Status</h2>{_status_html(history, labels, alpha)}"
        f"<p class='facts'>{_SEP.join(_facts(history, state, cfg, alpha))}</p></section>",
        "<section id='timeline'><h2>Timeline</h2><p class='lead'>Each look compares the judge's current scores "
        "of the anchors with the reference scores, anchor by anchor. Alarms keep a family-wise error rate "
        f"\u2264 {fmt(alpha, 2)} over all looks and metrics: every look spends a fixed share of alpha "
        "(union bound), so its alarm thresholds (dashed) lie further out than a single test's and widen as "
        "looks accumulate. A value outside the green band alarms.</p>"
        f"<div class='figure'>{_legend_svg(alpha)}</div>" + "".join(f"<div class='figure'>{p}</div>" for p in panels)
        + "</section>",
        f"<section id='looks'><h2>Looks</h2>{_looks_table(history)}</section>",
        "<footer><p class='stamp'>Statistics: cje_engine.drift.monitor (docs/drift.md) \u00b7 report generated "
        f"{esc(datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))} \u00b7 self-contained "
        "(no external resources)</p></footer>",
        "</main></body></html>",
    ]
    return "\n".join(parts)
