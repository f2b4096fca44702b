"""Text and SVG renderings of a budget plan (`cje_engine.planning.planner.plan_from_result` output).

`render_plan_text` is what `cje plan` prints; `render_plan_svg` draws four panels in one
self-contained SVG (no scripts, fonts or links): MDE vs oracle fraction for five n around the plan,
the iso-cost SE curve with the optimum and the pilot's fraction, the two shares along the same budget
line (crossing at the optimum, the under-labelled region shaded), and the recommended design.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from cje_engine.planning.model import VarianceComponents

# --------------------------------------------------------------------------------------
# rendering


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return f"{int(x):,}"
    x = float(x)
    if x != 0 and (abs(x) >= 1e6 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def _alloc_lines(title: str, a: Mapping[str, Any]) -> list[str]:
    lines = [title,
             f"  prompts per policy n   {a['n']:>10,}    judged responses {a['responses']:,}",
             f"  labels m               {a['m']:>10,}    oracle labels    {a['labels']:,}",
             f"  oracle fraction m/n    {a['oracle_fraction']:>10.1%}",
             f"  cost                   {_fmt(a['cost'], 6):>10}",
             f"  SE                     {_fmt(a['se']):>10}    MDE {_fmt(a['mde'])} "
             f"(alpha {a['alpha']:g}, power {a['power']:.0%})",
             f"  calibration share of variance {a['calibration_share']:.1%} vs oracle share of budget "
             f"{a['oracle_budget_share']:.1%}"]
    if a.get("binding"):
        lines.append(f"  binding constraint: {a['binding']}")
    return lines


def _units(plan: Mapping[str, Any]) -> str:
    """`` label units (2% of the label scale 1-5)`` for a plan that carries its label scale."""
    scale, mde = plan.get("label_scale"), plan.get("target_mde")
    if not scale or mde is None or float(scale[1]) <= float(scale[0]):
        return ""
    share = float(mde) / (float(scale[1]) - float(scale[0]))
    return f" label units ({share:.3g} of the label scale {float(scale[0]):g}-{float(scale[1]):g})"


def render_plan_text(plan: Mapping[str, Any]) -> str:
    """A plain-text report of a plan (terminal width ~100)."""
    p = plan
    c = p["components"]
    costs = p["costs"]
    L = [f"CJE budget plan for {p['target']}" + (f"  ({p['target_choice']})" if p.get("target_choice") else ""),
         "=" * 72,
         f"costs: c_S={_fmt(costs['c_S'])} per judged response, c_Y={_fmt(costs['c_Y'])} per oracle label "
         f"(ratio {costs['ratio']:g}); per unit of n {_fmt(costs['effective_c_S'])}, "
         f"of m {_fmt(costs['effective_c_Y'])}",
         f"variance model: Var = {_fmt(c['sigma2_eval'])} / n + {_fmt(c['sigma2_cal'])} / m   [{c['method']}]",
         f"variance-optimal oracle fraction (square-root law): {p['optimal_fraction']:.1%}", ""]
    if p.get("pilot"):
        pl = p["pilot"]
        d = pl["diagnostic"]
        state = ("UNDER-labelled" if d["under_labelled"] else "over-labelled" if d["over_labelled"] else "balanced")
        L += [f"pilot: n={_fmt(pl['n'])}, m={_fmt(pl['m'])} ({d['oracle_fraction']:.1%}), SE {_fmt(pl['se'])}, "
              f"MDE {_fmt(pl['mde'])}",
              f"  calibration share {d['calibration_share']:.1%} vs oracle budget share {d['oracle_budget_share']:.1%}"
              f" -> {state}; efficiency {d['efficiency']:.0%} of the same-cost optimum",
              f"  label request at this n: {pl['label_request']['labels']:,} labels "
              f"(SE {_fmt(pl['label_request']['se_before'])} -> {_fmt(pl['label_request']['se_after'])})", ""]
    if p.get("allocation_for_budget"):
        L += _alloc_lines(f"best design for budget {_fmt(p['allocation_for_budget']['cost'], 6)}"
                          if p.get("budget") is None else f"best design for budget {_fmt(p['budget'], 6)}",
                          p["allocation_for_budget"]) + [""]
    if p.get("allocation_for_mde"):
        L += _alloc_lines(f"cheapest design for MDE {_fmt(p['target_mde'])}{_units(p)}", p["allocation_for_mde"]) + [""]
    t = p["mde_table"]
    L.append("MDE by prompts per policy (rows) and oracle fraction (columns)")
    head = "n".rjust(10) + "".join(f"{f:>9.0%}" if f >= 0.1 or f == 0 else f"{f:>9.1%}" for f in t["oracle_fraction"])
    L.append(head)
    for i, n in enumerate(t["n"]):
        L.append(f"{n:>10,}" + "".join(f"{v:>9.4f}" for v in t["mde"][i]))
    L.append("")
    iso = p["iso_cost"]
    L.append(f"iso-cost trade-off at budget {_fmt(iso['budget'], 6)} (SE by oracle fraction)")
    fr = np.asarray(iso["oracle_fraction"])
    show = sorted({float(fr[np.argmin(np.abs(fr - f))]) for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)}
                  | {iso["optimum"]["oracle_fraction"]})
    L.append(f"{'fraction':>10}{'n':>12}{'m':>10}{'SE':>10}{'cal.share':>11}{'budget sh.':>11}")
    for f in show:
        j = int(np.argmin(np.abs(fr - f)))
        mark = "  <- optimum" if abs(f - iso["optimum"]["oracle_fraction"]) < 1e-12 else ""
        L.append(f"{fr[j]:>10.1%}{iso['n'][j]:>12,.0f}{iso['m'][j]:>10,.0f}{iso['se'][j]:>10.4f}"
                 f"{iso['calibration_share'][j]:>11.1%}{iso['oracle_budget_share'][j]:>11.1%}{mark}")
    if p.get("policies"):
        L += ["", "per policy and per difference (SE/MDE at the chosen design)",
              f"{'target':<44}{'opt.frac':>9}{'SE':>9}{'MDE':>9}  pilot"]
        rows = [(k, v) for k, v in p["policies"].items()] + [(f"{d['a']} - {d['b']}", d) for d in p["differences"]]
        for name, v in rows:
            flag = ""
            if "under_labelled" in v:
                flag = "under-labelled" if v["under_labelled"] else "ok"
            L.append(f"{name[:43]:<44}{v['optimal_fraction']:>9.1%}{v['se_at_plan']:>9.4f}{v['mde_at_plan']:>9.4f}"
                     f"  {flag}")
    if p.get("notes"):
        L += ["", "notes:"] + [f"  - {x}" for x in p["notes"]]
    return "\n".join(L) + "\n"


_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf")


class _Axes:
    """A panel with a log-x axis (oracle fraction) and a linear y axis, in SVG coordinates."""

    def __init__(self, x0: float, y0: float, w: float, h: float, xlim: tuple[float, float],
                 ylim: tuple[float, float]) -> None:
        self.x0, self.y0, self.w, self.h = x0, y0, w, h
        self.lx = (math.log10(xlim[0]), math.log10(xlim[1]))
        self.ylim = ylim

    def X(self, f: float) -> float:
        return self.x0 + (math.log10(f) - self.lx[0]) / (self.lx[1] - self.lx[0]) * self.w

    def Y(self, v: float) -> float:
        lo, hi = self.ylim
        return self.y0 + self.h - (v - lo) / (hi - lo) * self.h

    def path(self, xs: Sequence[float], ys: Sequence[float], color: str, width: float = 2.0,
             dash: str | None = None) -> str:
        pts = [(self.X(x), self.Y(y)) for x, y in zip(xs, ys) if x > 0 and math.isfinite(y)
               and self.ylim[0] - 1e-12 <= y <= self.ylim[1] * 1.0001]
        if len(pts) < 2:
            return ""
        d = "M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        return f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{width}"{extra}/>'


def _ticks(lo: float, hi: float, k: int = 5) -> list[float]:
    span = hi - lo
    raw = span / k
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = min((s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw), default=mag)
    start = math.ceil(lo / step) * step
    out = []
    v = start
    while v <= hi + 1e-12 * max(1.0, abs(hi)):
        out.append(round(v, 12))
        v += step
    return out


def _frame(ax: _Axes, title: str, ylabel: str, yfmt: Callable[[float], str]) -> list[str]:
    s = [f'<rect x="{ax.x0}" y="{ax.y0}" width="{ax.w}" height="{ax.h}" fill="#ffffff" stroke="#999"/>']
    for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0):
        if 10 ** ax.lx[0] * 0.999 <= f <= 10 ** ax.lx[1] * 1.001:
            x = ax.X(f)
            s.append(f'<line x1="{x:.1f}" y1="{ax.y0}" x2="{x:.1f}" y2="{ax.y0 + ax.h}" stroke="#eee"/>')
            s.append(f'<text x="{x:.1f}" y="{ax.y0 + ax.h + 15}" text-anchor="middle" class="tick">{f:.0%}</text>')
    for v in _ticks(*ax.ylim):
        y = ax.Y(v)
        s.append(f'<line x1="{ax.x0}" y1="{y:.1f}" x2="{ax.x0 + ax.w}" y2="{y:.1f}" stroke="#eee"/>')
        s.append(f'<text x="{ax.x0 - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{yfmt(v)}</text>')
    s.append(f'<text x="{ax.x0}" y="{ax.y0 - 10}" class="title">{html.escape(title)}</text>')
    s.append(f'<text x="{ax.x0 + ax.w / 2}" y="{ax.y0 + ax.h + 32}" text-anchor="middle" class="label">'
             f'oracle fraction m/n (log scale)</text>')
    s.append(f'<text transform="translate({ax.x0 - 48},{ax.y0 + ax.h / 2}) rotate(-90)" text-anchor="middle" '
             f'class="label">{html.escape(ylabel)}</text>')
    return s


@dataclass
class _Layout:
    """What every panel needs: the plan, the chosen design and the panel geometry."""

    p: Mapping[str, Any]
    comp: VarianceComponents
    k: float
    iso: Mapping[str, Any]
    opt: Mapping[str, Any]
    chosen: Mapping[str, Any]
    fr_iso: np.ndarray
    f_lo: float
    left: float
    x_r: float
    pw: float
    ph: float


def _panel_mde(g: _Layout) -> list[str]:
    out: list[str] = []
    p, k, chosen, f_lo, left, pw, ph, comp = g.p, g.k, g.chosen, g.f_lo, g.left, g.pw, g.ph, g.comp
    ns = list(p["mde_table"]["n"])[:5]
    fgrid = np.geomspace(f_lo, 1.0, 120)
    curves = []
    for n in ns:
        m = np.maximum(1.0, fgrid * n)
        curves.append(k * np.sqrt(comp.variance(np.full_like(fgrid, n), m)))
    ymax = float(max(np.max(c) for c in curves))
    ymin = float(min(np.min(c) for c in curves))
    top = min(ymax, 4 * max(ymin, 1e-12)) * 1.05
    if p.get("target_mde"):
        top = max(top, p["target_mde"] * 1.3)
    ax1 = _Axes(left, 80, pw, ph, (f_lo, 1.0), (0.0, top))
    yf = (lambda v: f"{v:.3g}")
    out += _frame(ax1, "MDE vs oracle fraction, by prompts per policy n", "MDE (label scale)", yf)
    for i, (n, cv) in enumerate(zip(ns, curves)):
        col = _PALETTE[i % len(_PALETTE)]
        out.append(ax1.path(fgrid, cv, col))
        ly = ax1.y0 + ax1.h - 12 - 15 * (len(ns) - 1 - i)
        out.append(f'<line x1="{ax1.x0 + 10}" y1="{ly - 4}" x2="{ax1.x0 + 28}" y2="{ly - 4}" '
                   f'stroke="{col}" stroke-width="2"/>')
        out.append(f'<text x="{ax1.x0 + 33}" y="{ly}" class="legend">n = {n:,}</text>')
    if p.get("target_mde"):
        y = ax1.Y(p["target_mde"])
        out.append(f'<line x1="{ax1.x0}" y1="{y:.1f}" x2="{ax1.x0 + ax1.w}" y2="{y:.1f}" stroke="#444" '
                   f'stroke-dasharray="6,4"/>')
        out.append(f'<text x="{ax1.x0 + 6}" y="{y - 5:.1f}" class="legend">target MDE {p["target_mde"]:g}</text>')
    if chosen["mde"] <= top and chosen["oracle_fraction"] >= f_lo:
        cx, cy_ = ax1.X(chosen["oracle_fraction"]), ax1.Y(chosen["mde"])
        out.append(f'<circle cx="{cx:.1f}" cy="{cy_:.1f}" r="5" fill="#111"/>')
        out.append(f'<text x="{cx - 8:.1f}" y="{cy_ + 16:.1f}" text-anchor="end" class="legend">plan: '
                   f'n={chosen["n"]:,}, m={chosen["m"]:,}</text>')
    return out


def _panel_iso(g: _Layout) -> list[str]:
    out: list[str] = []
    p, iso, opt, chosen, fr_iso, x_r, pw, ph = g.p, g.iso, g.opt, g.chosen, g.fr_iso, g.x_r, g.pw, g.ph
    yf = (lambda v: f"{v:.3g}")
    se = np.asarray(iso["se"])
    se_top = float(min(se.max(), 3 * opt["se"])) * 1.08
    se_bot = float(opt["se"]) * 0.8
    ax2 = _Axes(x_r, 80, pw, ph, (float(fr_iso.min()), 1.0), (se_bot, se_top))
    out += _frame(ax2, f"Iso-cost: SE at budget {iso['budget']:,.0f}", "SE", yf)
    out.append(ax2.path(fr_iso, se, _PALETTE[0], 2.5))
    ox, oy = ax2.X(opt["oracle_fraction"]), ax2.Y(opt["se"])
    out.append(f'<line x1="{ox:.1f}" y1="{ax2.y0}" x2="{ox:.1f}" y2="{ax2.y0 + ax2.h}" stroke="#d62728" '
               f'stroke-dasharray="4,3"/>')
    out.append(f'<circle cx="{ox:.1f}" cy="{oy:.1f}" r="6" fill="#d62728"/>')
    anchor = "start" if opt["oracle_fraction"] < 0.3 else "end"
    dx = 10 if anchor == "start" else -10
    out.append(f'<text x="{ox + dx:.1f}" y="{oy - 12:.1f}" text-anchor="{anchor}" class="legend">optimum '
               f'{opt["oracle_fraction"]:.1%}: n={opt["n"]:,.0f}, m={opt["m"]:,.0f}, SE {opt["se"]:.4f}</text>')
    if p.get("pilot"):
        pf = p["pilot"]["diagnostic"]["oracle_fraction"]
        if fr_iso.min() <= pf <= 1:
            x = ax2.X(pf)
            out.append(f'<line x1="{x:.1f}" y1="{ax2.y0}" x2="{x:.1f}" y2="{ax2.y0 + ax2.h}" stroke="#777" '
                       f'stroke-dasharray="2,3"/>')
            out.append(f'<text x="{x + 4:.1f}" y="{ax2.y0 + 14}" class="tick">pilot {pf:.0%}</text>')
    on_line = abs(chosen["cost"] - iso["budget"]) <= 1e-9 * max(1.0, iso["budget"])
    if on_line and fr_iso.min() <= chosen["oracle_fraction"]:
        cx, cy_ = ax2.X(chosen["oracle_fraction"]), ax2.Y(chosen["se"])
        out.append(f'<circle cx="{cx:.1f}" cy="{cy_:.1f}" r="4.5" fill="#111"/>')
        out.append(f'<text x="{cx:.1f}" y="{cy_ + 18:.1f}" text-anchor="middle" class="legend">plan</text>')
    return out


def _panel_shares(g: _Layout) -> list[str]:
    out: list[str] = []
    iso, opt, fr_iso, left, pw, ph = g.iso, g.opt, g.fr_iso, g.left, g.pw, g.ph
    ax3 = _Axes(left, 80 + ph + 80, pw, ph, (float(fr_iso.min()), 1.0), (0.0, 1.0))
    out += _frame(ax3, "Calibration share of variance vs oracle share of budget", "share", lambda v: f"{v:.0%}")
    x_opt = ax3.X(opt["oracle_fraction"])
    out.append(f'<rect x="{ax3.x0}" y="{ax3.y0}" width="{max(0.0, x_opt - ax3.x0):.1f}" height="{ax3.h}" '
               f'fill="#d62728" fill-opacity="0.06"/>')
    out.append(f'<text x="{ax3.x0 + 6}" y="{ax3.y0 + ax3.h - 8}" class="tick">under-labelled</text>')
    out.append(ax3.path(fr_iso, iso["calibration_share"], _PALETTE[1], 2.5))
    out.append(ax3.path(fr_iso, iso["oracle_budget_share"], _PALETTE[2], 2.5))
    share_opt = float(np.interp(math.log(opt["oracle_fraction"]), np.log(fr_iso), iso["oracle_budget_share"]))
    out.append(f'<circle cx="{x_opt:.1f}" cy="{ax3.Y(share_opt):.1f}" r="5" fill="#111"/>')
    for i, (lab, col) in enumerate((("calibration share of variance", _PALETTE[1]),
                                    ("oracle share of budget", _PALETTE[2]))):
        ly = ax3.y0 + 16 + 15 * i
        out.append(f'<line x1="{ax3.x0 + 8}" y1="{ly - 4}" x2="{ax3.x0 + 26}" y2="{ly - 4}" stroke="{col}" '
                   f'stroke-width="2.5"/>')
        out.append(f'<text x="{ax3.x0 + 31}" y="{ly}" class="legend">{lab}</text>')
    return out


def _panel_summary(g: _Layout) -> list[str]:
    out: list[str] = []
    p, chosen, x_r, pw, ph = g.p, g.chosen, g.x_r, g.pw, g.ph
    x4, y4 = x_r, 80 + ph + 80
    out.append(f'<rect x="{x4}" y="{y4}" width="{pw}" height="{ph}" fill="#ffffff" stroke="#999"/>')
    out.append(f'<text x="{x4 + 12}" y="{y4 + 22}" class="title">Recommended design</text>')
    lines = [f"prompts per policy n: {chosen['n']:,}  (judged responses {chosen['responses']:,})",
             f"labels m: {chosen['m']:,}  (oracle labels {chosen['labels']:,})",
             f"oracle fraction: {chosen['oracle_fraction']:.1%}",
             f"cost: {chosen['cost']:,.6g}",
             f"SE {chosen['se']:.4f}   MDE {chosen['mde']:.4f}",
             f"calibration share {chosen['calibration_share']:.0%} / budget share "
             f"{chosen['oracle_budget_share']:.0%}"]
    planned = p.get("planned_for") or [p["target"]]
    if len(planned) > 1:
        lines.append(f"sized for {len(planned)} targets; binding: {chosen.get('target', p['target'])}")
    if p.get("pilot"):
        d = p["pilot"]["diagnostic"]
        state = "under-labelled" if d["under_labelled"] else ("over-labelled" if d["over_labelled"] else "balanced")
        lines += ["", f"pilot: n={p['pilot']['n']:,.0f}, m={p['pilot']['m']:,.0f} "
                      f"({d['oracle_fraction']:.0%}): {state}",
                  f"pilot SE {p['pilot']['se']:.4f}; efficiency {d['efficiency']:.0%} of optimum"]
    for note in p.get("notes") or []:
        lines += ["", note[:70]]
    for i, line in enumerate(lines[:14]):
        out.append(f'<text x="{x4 + 12}" y="{y4 + 46 + 17 * i}" class="small">{html.escape(line)}</text>')
    return out


def render_plan_svg(plan: Mapping[str, Any], width: int = 900, height: int = 700) -> str:
    """A self-contained SVG: MDE vs oracle fraction for a few n, the iso-cost SE curve with the
    optimum, and the share diagnostic (calibration share of variance vs oracle share of budget)."""
    p = plan
    comp = VarianceComponents(**p["components"])
    k = p["mde_multiplier"]
    iso = p["iso_cost"]
    opt = iso["optimum"]
    chosen = p["allocation_for_budget"] or p["allocation_for_mde"]
    fr_iso = np.asarray(iso["oracle_fraction"])
    f_lo = float(min(fr_iso.min(), 0.01))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
           "<style>.title{font-size:14px;font-weight:bold;fill:#222}.tick{font-size:10px;fill:#555}"
           ".label{font-size:11px;fill:#333}"
           ".legend{font-size:11px;fill:#222;paint-order:stroke;stroke:#fff;stroke-width:3px}"
           ".small{font-size:11px;fill:#333}"
           "</style>",
           f'<rect width="{width}" height="{height}" fill="#fafafa"/>',
           f'<text x="20" y="26" style="font-size:17px;font-weight:bold;fill:#111">'
           f'CJE budget plan: {html.escape(str(p["target"]))}</text>',
           f'<text x="20" y="44" class="small">c_Y/c_S = {p["costs"]["ratio"]:g}; variance-optimal oracle fraction '
           f'{p["optimal_fraction"]:.1%}; MDE = {k:.2f} x SE (alpha {p["alpha"]:g}, power {p["power"]:.0%})</text>']
    left, gap, right = 75, 95, 25
    pw, ph = (width - left - gap - right) / 2, (height - 200) / 2
    x_r = left + pw + gap
    g = _Layout(p, comp, k, iso, opt, chosen, fr_iso, f_lo, left, x_r, pw, ph)
    out += _panel_mde(g) + _panel_iso(g) + _panel_shares(g) + _panel_summary(g)
    out.append("</svg>")
    return "\n".join(s for s in out if s) + "\n"
