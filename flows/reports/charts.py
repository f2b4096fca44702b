"""The report's figures: forest plot, calibration curve and reliability diagram, audit residuals,
win matrix and the judge-drift timeline (inline SVG, no scripts)."""
from __future__ import annotations

import math
from typing import Any

from cje_engine.result.model import (Audit, Calibration, Comparison, Curve, Decile, EvaluationModel, Multiplicity,
                                     Points, ReliabilityBin, WinMatrix)
from flows.reports.common import (BLUE, GREEN, GREY, INK, MUTED, ORANGE, SKY, VERDICT_STYLE, VERMILLION, loose_model,
                                  as_number, as_pair, conf_label, esc, fmt, fmt_ci, is_refused, not_estimable_reason,
                                  policy_order, raw_on_label_scale, same_scale, scale_text, scales_of, short_label,
                                  verdict_of, z_of)
from flows.reports.svg import (LinearScale, coord, el, nice_ticks, svg_cross, svg_diamond, svg_doc, svg_legend,
                               svg_line, svg_polylines, svg_text, x_axis, y_axis)

# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------
def forest_svg(m: EvaluationModel, order: list[str], alpha: float) -> str:
    """Forest plot of the policies' estimates, intervals, raw judge and oracle means (typed result)."""
    pols = m.policies
    width, left, right_cols = 1040, 250, 300
    x0, x1 = left, width - right_cols
    top, row_h = 78, 44
    height = top + row_h * len(order) + 56
    values: list[float] = []
    for name in order:
        p = pols[name]
        values += [v for v in (as_number(p.estimate), raw_on_label_scale(m, p.raw_judge_mean),
                               as_number(p.oracle_mean)) if v is not None]
        if (ci := as_pair(p.ci)) is not None:
            values += list(ci)
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    pad = 0.04 * (hi - lo or 1.0)
    lo, hi, ticks, dec = nice_ticks(lo - pad, hi + pad)
    sx = LinearScale(lo, hi, x0 + 8, x1 - 8)
    conf = conf_label(alpha)
    body = svg_legend([
        (svg_line(-9, 0, 9, 0, stroke=BLUE, stroke_width="2.5")
         + el("circle", cx=0.0, cy=0.0, r="5", fill=BLUE), f"calibrated estimate, {conf} CI"),
        (svg_line(-9, 0, 9, 0, stroke=GREY, stroke_width="2", stroke_dasharray="3 3")
         + el("circle", cx=0.0, cy=0.0, r="5", fill="#fff", stroke=GREY, stroke_width="2"),
         "refused: ranking only, not a level"),
        (svg_diamond(0, 0, 5.5, fill=ORANGE, stroke="#8a5d00", stroke_width="0.8"), _raw_legend(m)),
        (svg_cross(0, 0, 4, INK), "oracle mean of own labels"),
    ], x0 - 230, 20)
    header_y = top - 12
    body.append(svg_text(x0 - 14, header_y, "policy", text_anchor="end", fill=MUTED, font_size="11",
                         font_weight="600"))
    body.append(svg_text(x1 + 18, header_y, f"estimate  [{conf} CI]", fill=MUTED, font_size="11",
                         font_weight="600"))
    body.append(svg_text(width - 8, header_y, "audit", text_anchor="end", fill=MUTED,
                         font_size="11", font_weight="600"))
    axis_y = top + row_h * len(order) + 6
    for i, _ in enumerate(order):
        if i % 2 == 0:
            body.append(el("rect", x=4.0, y=float(top + i * row_h), width=float(width - 8),
                           height=float(row_h), fill="#f6f8fa"))
    body += x_axis(sx, ticks, dec, axis_y, top, "value on the oracle (label) scale")
    for i, name in enumerate(order):
        p = pols[name]
        cy = top + i * row_h + row_h / 2
        refused = is_refused(p)
        sub = p.basis_code or ""
        n_lab = p.n_labelled
        sub = " \u00b7 ".join(s for s in (str(sub).replace("_", "-"),
                                          f"{n_lab} own labels" if n_lab is not None else "") if s)
        body.append(el("text", el("title", esc(name)) + esc(short_label(name, 26)), x=float(x0 - 14),
                       y=float(cy - 2), text_anchor="end", fill=INK, font_size="13",
                       font_weight="600"))
        body.append(svg_text(x0 - 14, cy + 13, sub, text_anchor="end", fill=MUTED, font_size="10.5"))
        est, ci = as_number(p.estimate), as_pair(p.ci)
        colour = GREY if refused else BLUE
        if ci is not None:
            dash = "4 3" if refused else None
            sw = "2" if refused else "2.5"
            body.append(svg_line(sx(ci[0]), cy, sx(ci[1]), cy, stroke=colour, stroke_width=sw,
                                 stroke_dasharray=dash))
            for v in ci:
                body.append(svg_line(sx(v), cy - 5, sx(v), cy + 5, stroke=colour, stroke_width=sw))
        raw = raw_on_label_scale(m, p.raw_judge_mean)
        if raw is not None:
            body.append(svg_diamond(sx(raw), cy, 5.5, fill=ORANGE, stroke="#8a5d00",
                                    stroke_width="0.8"))
        orc = as_number(p.oracle_mean)
        if orc is not None:
            body.append(svg_cross(sx(orc), cy, 4, INK))
        if est is not None:
            if refused:
                body.append(el("circle", cx=sx(est), cy=float(cy), r="5.5", fill="#fff",
                               stroke=GREY, stroke_width="2"))
            else:
                body.append(el("circle", cx=sx(est), cy=float(cy), r="5.5", fill=BLUE,
                               stroke="#fff", stroke_width="1"))
        if refused:
            body.append(svg_text(x1 + 18, cy + 4, "refused", fill=MUTED, font_style="italic",
                                 font_size="13", font_weight="600"))
        else:
            body.append(el("text", el("tspan", esc(fmt(est)), font_weight="600")
                           + el("tspan", esc("  " + fmt_ci(ci)), fill=MUTED),
                           x=float(x1 + 18), y=float(cy + 4), font_size="13",
                           font_variant_numeric="tabular-nums"))
        sym, label, vcol = VERDICT_STYLE[verdict_of(p)]
        body.append(svg_text(width - 8, cy + 4, f"{sym} {label}", text_anchor="end", fill=vcol,
                             font_size="12", font_weight="600"))
    return svg_doc(width, height, body, "Forest plot of policy estimates with confidence intervals")


def _raw_legend(result: Any) -> str:
    if same_scale(result):
        return "raw judge mean"
    score, label = scales_of(result)
    return f"raw judge mean, {scale_text(score)} read on {scale_text(label)}"


def calibration_svg(cal: Calibration, config: dict) -> str:
    """Calibration curve over the labelled points, and the reliability diagram (typed calibration block)."""
    width, height = 1040, 420
    curve = cal.curve if isinstance(cal.curve, Curve) else None
    points = cal.points if isinstance(cal.points, Points) else None
    cs = [as_number(v) for v in (curve.score if curve else None) or []]
    cf = [as_number(v) for v in (curve.fitted if curve else None) or []]
    ps = [as_number(v) for v in (points.score if points else None) or []]
    pl = [as_number(v) for v in (points.label if points else None) or []]
    curve_xy = [(s, f) for s, f in zip(cs, cf) if s is not None and f is not None]
    pts = [(s, y) for s, y in zip(ps, pl) if s is not None and y is not None]
    score_scale = as_pair(config.get("score_scale"))
    label_scale = as_pair(config.get("label_scale"))
    xs = [s for s, _ in curve_xy + pts] + (list(score_scale) if score_scale else [])
    ys = [y for _, y in curve_xy + pts] + (list(label_scale) if label_scale else [])
    xlo, xhi, xt, xd = nice_ticks(min(xs, default=0.0), max(xs, default=1.0))
    ylo, yhi, yt, yd = nice_ticks(min(ys, default=0.0), max(ys, default=1.0))
    # left panel: curve + points
    L, T, W, H = 80, 46, 420, 300
    sx, sy = LinearScale(xlo, xhi, L, L + W), LinearScale(ylo, yhi, T + H, T)
    body = [svg_text(L, 24, "Calibration curve f(judge score) over the labelled points", fill=INK,
                     font_size="13", font_weight="600")]
    lr = as_pair(cal.label_range)
    if lr is not None:
        for a, b in ((xlo, lr[0]), (lr[1], xhi)):
            if b - a > 1e-12:
                body.append(el("rect", x=sx(a), y=float(T), width=sx(b) - sx(a), height=float(H),
                               fill="#eef0f3"))
        if lr[0] - xlo > (xhi - xlo) * 0.08:
            body.append(svg_text((sx(xlo) + sx(lr[0])) / 2, T + 14, "no labels", text_anchor="middle",
                                 fill=MUTED, font_size="10.5"))
    body += x_axis(sx, xt, xd, T + H, T, f"judge score ({scale_text(score_scale or (0.0, 1.0))})")
    body += y_axis(sy, yt, yd, L, L + W, f"oracle label ({scale_text(label_scale or (0.0, 1.0))})")
    lo_d, hi_d = max(xlo, ylo), min(xhi, yhi)
    same = (score_scale or (0.0, 1.0)) == (label_scale or (0.0, 1.0))
    if same and hi_d > lo_d:  # an identity line only where score and label share one scale
        body.append(svg_line(sx(lo_d), sy(lo_d), sx(hi_d), sy(hi_d), stroke=GREY, stroke_width="1.2",
                             stroke_dasharray="5 4"))
    for i, (s, y) in enumerate(pts):
        jitter = ((i * 0.6180339887) % 1.0 - 0.5) * 7.0  # deterministic, breaks over-plotting
        px = min(max(sx(s) + jitter, L + 3), L + W - 3)
        body.append(el("circle", cx=px, cy=sy(y), r="2.8", fill=SKY,
                       fill_opacity="0.45", stroke="none"))
    if curve_xy:
        path = " ".join(f"{coord(sx(s))},{coord(sy(f))}" for s, f in sorted(curve_xy))
        body.append(el("polyline", points=path, fill="none", stroke=BLUE, stroke_width="2.5",
                       stroke_linejoin="round"))
    body += svg_legend([
        (el("circle", cx=0.0, cy=0.0, r="3.5", fill=SKY, fill_opacity="0.6"), "labelled point"),
        (svg_line(-9, 0, 9, 0, stroke=BLUE, stroke_width="2.5"), "fitted calibration"),
    ] + ([(svg_line(-9, 0, 9, 0, stroke=GREY, stroke_width="1.2", stroke_dasharray="5 4"), "identity")]
         if same else []), L + 6, T + H + 58, gap=18)
    # right panel: reliability diagram
    L2 = 600
    W2 = 380
    rel = [b for b in cal.reliability or [] if isinstance(b, ReliabilityBin)
           and as_number(b.mean_predicted) is not None and as_number(b.mean_label) is not None]
    sx2, sy2 = LinearScale(ylo, yhi, L2, L2 + W2), LinearScale(ylo, yhi, T + H, T)
    body.append(svg_text(L2, 24, "Reliability diagram (binned by calibrated prediction)", fill=INK,
                         font_size="13", font_weight="600"))
    body += x_axis(sx2, yt, yd, T + H, T, "mean calibrated prediction")
    body += y_axis(sy2, yt, yd, L2, L2 + W2, "mean oracle label")
    body.append(svg_line(sx2(ylo), sy2(ylo), sx2(yhi), sy2(yhi), stroke=GREY, stroke_width="1.2",
                         stroke_dasharray="5 4"))
    n_max = max((as_number(b.n) or 0 for b in rel), default=1) or 1
    for b in rel:
        mp, ml = float(b.mean_predicted), float(b.mean_label)
        n = as_number(b.n) or 0
        radius = 3 + 11 * math.sqrt(n / n_max)
        body.append(svg_line(sx2(mp), sy2(mp), sx2(mp), sy2(ml), stroke=VERMILLION, stroke_width="1.5"))
        body.append(el("circle", el("title", esc(
            f"bin [{fmt(b.lo, 2)}, {fmt(b.hi, 2)}): n={b.n}, "
            f"predicted {fmt(mp)}, observed {fmt(ml)}")), cx=sx2(mp), cy=sy2(ml), r=radius,
                       fill=BLUE, fill_opacity="0.55", stroke=BLUE, stroke_width="1"))
    body += svg_legend([
        (el("circle", cx=0.0, cy=0.0, r="5", fill=BLUE, fill_opacity="0.55"), "bin (area \u221d n)"),
        (svg_line(0, -7, 0, 7, stroke=VERMILLION, stroke_width="1.5"), "gap to identity"),
    ], L2 + 6, T + H + 58, gap=18)
    return svg_doc(width, height, body, "Calibration curve and reliability diagram")


def audit_svg(name: str, audit: Audit, alpha: float) -> str:
    """SVG of a policy's transport audit: mean residual by score decile with intervals at ``alpha``."""
    width, height = 500, 250
    L, T, W, H = 64, 14, 420, 170
    z = z_of(alpha)
    deciles = [d for d in audit.deciles or [] if isinstance(d, Decile) and as_number(d.mean_residual) is not None]
    margin = as_number(audit.margin)
    overall = as_number(audit.residual_mean)
    overall_ci = as_pair(audit.ci_adjusted) or as_pair(audit.ci)
    cats: list[tuple[str, str, float, float | None, float | None, bool]] = []
    for d in deciles:
        m, se = float(d.mean_residual), as_number(d.se)
        lo_hi = (m - z * se, m + z * se) if se is not None else None
        cats.append((f"{fmt(d.lo, 2)}\u2013{fmt(d.hi, 2)}",
                     f"n={'?' if d.n is None else d.n}", m, lo_hi[0] if lo_hi else None,
                     lo_hi[1] if lo_hi else None, False))
    if overall is not None:
        cats.append(("all", f"n={'?' if audit.n_labels is None else audit.n_labels}", overall,
                     overall_ci[0] if overall_ci else None, overall_ci[1] if overall_ci else None,
                     True))
    vals = [0.0] + [v for c in cats for v in (c[2], c[3], c[4]) if v is not None]
    if margin is not None:
        vals += [-1.3 * margin, 1.3 * margin]
    ylo, yhi, yt, yd = nice_ticks(min(vals), max(vals), 5)
    sy = LinearScale(ylo, yhi, T + H, T)
    body: list[str] = []
    if margin is not None:
        body.append(el("rect", x=float(L), y=sy(min(margin, yhi)), width=float(W),
                       height=sy(max(-margin, ylo)) - sy(min(margin, yhi)), fill=GREEN,
                       fill_opacity="0.13"))
    body += y_axis(sy, yt, yd, L, L + W, "mean residual")
    if margin is not None:
        for m in (margin, -margin):
            if ylo <= m <= yhi:
                body.append(svg_line(L, sy(m), L + W, sy(m), stroke=GREEN, stroke_width="1",
                                     stroke_dasharray="4 3"))
    body.append(svg_line(L, sy(0), L + W, sy(0), stroke=INK, stroke_width="1"))
    body.append(svg_line(L, T + H, L + W, T + H, stroke=MUTED, stroke_width="1"))
    n = max(len(cats), 1)
    band = W / n
    rotate = n > 7
    verdict_colour = VERDICT_STYLE.get(audit.verdict, VERDICT_STYLE["not_run"])[2]
    for i, (label, count, m, lo, hi, is_all) in enumerate(cats):
        cx = L + band * (i + 0.5)
        colour = verdict_colour if is_all else BLUE
        if is_all and i > 0:
            body.append(svg_line(L + band * i, T, L + band * i, T + H, stroke=GREY, stroke_width="1",
                                 stroke_dasharray="2 3"))
        if lo is not None and hi is not None:
            body.append(svg_line(cx, sy(lo), cx, sy(hi), stroke=colour, stroke_width="2"))
            for v in (lo, hi):
                body.append(svg_line(cx - 4, sy(v), cx + 4, sy(v), stroke=colour, stroke_width="2"))
        shape = (svg_diamond(cx, sy(m), 6, fill=colour) if is_all else
                 el("circle", cx=float(cx), cy=sy(m), r="4.5", fill=colour))
        body.append(shape)
        ty = T + H + 16
        if rotate:
            body.append(el("text", esc(label), x=float(cx), y=float(ty), text_anchor="end",
                           fill=MUTED, font_size="10",
                           transform=f"rotate(-35 {coord(cx)} {coord(ty)})"))
        else:
            body.append(svg_text(cx, ty, label, text_anchor="middle", fill=MUTED, font_size="10.5",
                                 font_weight="600" if is_all else None))
            body.append(svg_text(cx, ty + 14, count, text_anchor="middle", fill=MUTED,
                                 font_size="10"))
    body.append(svg_text(L + W / 2, height - 8, "judge-score bin (residual = oracle \u2212 calibrated)",
                         text_anchor="middle", fill=INK, font_size="11.5"))
    return svg_doc(width, height, body, f"Audit residuals by score bin for {name}")


def _pairwise(m: EvaluationModel) -> tuple[list[str], list[list[float | None]], list[list[int]]]:
    """Win matrix as (policies, P(row better), sig) with sig in {1 row better, -1 worse, 0} (typed result)."""
    policies = m.policies
    diffs: dict[tuple[str, str], tuple[float | None, float | None, bool]] = {}
    blank: set[tuple[str, str]] = set()
    for c in m.comparisons or []:
        if not isinstance(c, Comparison) or c.a not in policies or c.b not in policies:
            continue
        if not_estimable_reason(c) is not None:
            blank |= {(c.a, c.b), (c.b, c.a)}
            continue  # no number: the cell stays empty, whatever the win matrix says
        d, pa, sig = as_number(c.diff), as_number(c.prob_a_better), bool(c.significant)
        diffs[(c.a, c.b)] = (d, pa, sig)
        diffs[(c.b, c.a)] = (-d if d is not None else None,
                             1 - pa if pa is not None else None, sig)
    wm = m.win_matrix if isinstance(m.win_matrix, WinMatrix) else None
    wm_names = (wm.policies if wm else None) or []
    names = [n for n in wm_names if n in policies] or policy_order(m)
    idx = {n: i for i, n in enumerate(wm_names)}
    prob_m, sig_m = (wm.prob_row_better, wm.significant) if wm else (None, None)
    k = len(names)

    def cell(matrix: Any, r: str, c: str) -> Any:
        try:
            return matrix[idx[r]][idx[c]]
        except (TypeError, KeyError, IndexError):
            return None

    prob: list[list[float | None]] = [[None] * k for _ in range(k)]
    sig = [[0] * k for _ in range(k)]
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if i == j or (a, b) in blank:
                continue
            d, pa, s = diffs.get((a, b), (None, None, False))
            p = as_number(cell(prob_m, a, b))
            p = p if p is not None else pa
            prob[i][j] = p
            # the matrix may mark a pair symmetrically (1 both ways), directionally (1 in the
            # winner's row only) or with signs (+1 / -1): any mark makes the pair significant
            here, there = as_number(cell(sig_m, a, b)), as_number(cell(sig_m, b, a))
            if not (s or here or there):
                continue
            if d is not None:
                better = d > 0
            elif p is not None and p != 0.5:
                better = p > 0.5
            else:
                better = bool(here and here > 0 and not (there and there > 0))
            sig[i][j] = 1 if better else -1
    return names, prob, sig


def _puor(p: float) -> str:
    """Diverging PuOr colour (colour-blind safe): 0 -> orange, 0.5 -> white, 1 -> purple."""
    stops = [(0.0, (179, 88, 6)), (0.25, (241, 163, 64)), (0.5, (247, 247, 247)),
             (0.75, (153, 142, 195)), (1.0, (84, 39, 136))]
    p = min(max(p, 0.0), 1.0)
    for (a, ca), (b, cb) in zip(stops, stops[1:]):
        if p <= b:
            t = (p - a) / (b - a)
            rgb = [round(x + (y - x) * t) for x, y in zip(ca, cb)]
            return "#" + "".join(f"{c:02x}" for c in rgb)
    return "#542788"


def win_svg(result: Any) -> str:
    """The pairwise win matrix (a result dict, `EvaluationResult` or `EvaluationModel`)."""
    m = loose_model(result)
    names, prob, sig = _pairwise(m)
    pols = m.policies
    k = len(names)
    cell = 64 if k <= 6 else max(30, int(420 / k))
    left, top = 240, 150
    width = max(left + cell * k + 30, left + 360)
    height = top + cell * k + 110
    body: list[str] = []
    for j, b in enumerate(names):
        cx, ty = left + cell * (j + 0.5), top - 10
        label = short_label(b, 24) + (" (refused)" if is_refused(pols[b]) else "")
        body.append(el("text", el("title", esc(b)) + esc(label), x=float(cx), y=float(ty),
                       fill=INK, font_size="12", transform=f"rotate(-40 {coord(cx)} {coord(ty)})"))
    for i, a in enumerate(names):
        cy = top + cell * (i + 0.5)
        label = short_label(a, 26) + (" (refused)" if is_refused(pols[a]) else "")
        body.append(el("text", el("title", esc(a)) + esc(label), x=float(left - 10),
                       y=float(cy + 4), text_anchor="end", fill=INK, font_size="12"))
        for j in range(k):
            x, y = left + cell * j, top + cell * i
            if i == j:
                body.append(el("rect", x=float(x), y=float(y), width=float(cell),
                               height=float(cell), fill="#d9dde2", stroke="#fff"))
                continue
            p = prob[i][j]
            fill = _puor(p) if p is not None else "#ffffff"
            verdict = ("significantly " + ("better" if sig[i][j] > 0 else "worse")
                       if sig[i][j] else "not significant")
            tip = f"{a} vs {names[j]}: P(row better) = {fmt(p, 2)}; {verdict}"
            body.append(el("rect", el("title", esc(tip)), x=float(x), y=float(y),
                           width=float(cell), height=float(cell), fill=fill, stroke="#fff",
                           stroke_width="2"))
            dark = p is not None and abs(p - 0.5) > 0.3
            tc = "#fff" if dark else INK
            symbol = "\u25b2" if sig[i][j] > 0 else "\u25bc" if sig[i][j] < 0 else ""
            if symbol:
                body.append(svg_text(x + cell / 2, y + cell / 2 - 4, symbol, text_anchor="middle",
                                     fill=tc, font_size="14"))
            body.append(svg_text(x + cell / 2, y + cell / 2 + (13 if symbol else 4), fmt(p, 2),
                                 text_anchor="middle", fill=tc, font_size="11",
                                 font_variant_numeric="tabular-nums"))
    ly = top + cell * k + 30
    body.append(svg_text(left, ly - 8, "P(row policy better than column policy)", fill=INK,
                         font_size="11.5"))
    for s in range(11):
        body.append(el("rect", x=float(left + s * 22), y=float(ly), width="22", height="12",
                       fill=_puor(s / 10)))
    for s, lab in ((0, "0"), (5, "0.5"), (10, "1")):
        body.append(svg_text(left + s * 22 + 11, ly + 26, lab, text_anchor="middle", fill=MUTED,
                             font_size="10.5"))
    mult = m.multiplicity if isinstance(m.multiplicity, Multiplicity) else None
    config = m.config if isinstance(m.config, dict) else {}
    method = str((mult.method if mult else None) or config.get("multiplicity") or "adjusted").upper()
    body.append(svg_text(left, ly + 50, f"\u25b2 row significantly better ({method}-adjusted)",
                         fill=INK, font_size="11.5"))
    body.append(svg_text(left, ly + 68, "\u25bc row significantly worse \u00b7 no symbol: not significant",
                         fill=INK, font_size="11.5"))
    return svg_doc(width, height, body, "Pairwise win matrix with adjusted significance")


def drift_svg(d: dict) -> str:
    """SVG panels of a drift series (Kendall's tau and the other metrics per period)."""
    periods = d["periods"]
    n = len(periods)
    width = 1040
    panels = [("tau", d["kendall_tau"])]
    if d["residual_shift"] is not None:
        panels.append(("shift", d["residual_shift"]))
    ph, L, W = 190, 80, 900
    rotate = n > 10 or max(len(p) for p in periods) * n * 6.5 > W
    xlab_h = 70 if rotate else 40
    height = len(panels) * (ph + xlab_h + 30) + 10
    sx = LinearScale(-0.5, n - 0.5, L, L + W)
    body: list[str] = []
    top = 30
    for kind, series in panels:
        T, H = top, ph
        vals = [v for v in series if v is not None]
        if kind == "tau":
            thr = d["tau_threshold"]
            title = f"Kendall \u03c4-b, reference vs current judge scores (alarm below {fmt(thr, 2)})"
            ylo, yhi, yt, yd = nice_ticks(min(vals + [thr]) - 0.02, max(vals + [1.0]), 5)
            yhi = min(yhi, 1.0) if max(vals + [thr]) <= 1.0 else yhi
            yt = [t for t in yt if t <= yhi + 1e-12]
        else:
            thr = d["shift_threshold"]
            title = f"Mean residual shift on labelled anchors (alarm beyond \u00b1{fmt(thr, 2)})"
            cis = d["residual_shift_ci"] or [None] * n
            extra = [v for ci in cis if ci for v in ci]
            ylo, yhi, yt, yd = nice_ticks(min(vals + extra + [-1.3 * thr]),
                                          max(vals + extra + [1.3 * thr]), 5)
        sy = LinearScale(ylo, yhi, T + H, T)
        body.append(svg_text(L, T - 12, title, fill=INK, font_size="13", font_weight="600"))
        if kind == "tau":
            body.append(el("rect", x=float(L), y=sy(thr), width=float(W),
                           height=sy(ylo) - sy(thr), fill=VERMILLION, fill_opacity="0.08"))
        else:
            body.append(el("rect", x=float(L), y=sy(thr), width=float(W),
                           height=sy(-thr) - sy(thr), fill=GREEN, fill_opacity="0.12"))
            body.append(svg_line(L, sy(0), L + W, sy(0), stroke=INK, stroke_width="1"))
        body += y_axis(sy, yt, yd, L, L + W, "\u03c4-b" if kind == "tau" else "shift")
        for t in ([thr] if kind == "tau" else [thr, -thr]):
            body.append(svg_line(L, sy(t), L + W, sy(t), stroke=VERMILLION, stroke_width="1.2",
                                 stroke_dasharray="6 4"))
        body.append(svg_line(L, T + H, L + W, T + H, stroke=MUTED, stroke_width="1"))
        for i, p in enumerate(periods):
            x, ty = sx(i), T + H + 16
            body.append(svg_line(x, T + H, x, T + H + 4, stroke=MUTED))
            if rotate:
                body.append(el("text", esc(p), x=float(x), y=float(ty), text_anchor="end",
                               fill=MUTED, font_size="10.5",
                               transform=f"rotate(-40 {coord(x)} {coord(ty)})"))
            else:
                body.append(svg_text(x, ty, p, text_anchor="middle", fill=MUTED, font_size="10.5"))
        if kind == "shift" and d["residual_shift_ci"]:
            for i, ci in enumerate(d["residual_shift_ci"]):
                if ci is not None:
                    body.append(svg_line(sx(i), sy(ci[0]), sx(i), sy(ci[1]), stroke=BLUE,
                                         stroke_width="1.5"))
        body += svg_polylines([None if v is None else (sx(i), sy(v)) for i, v in enumerate(series)],
                              stroke=BLUE, stroke_width="2")
        for i, v in enumerate(series):
            if v is None:
                continue
            own_alarm = (v < thr) if kind == "tau" else abs(v) > thr
            if d["alarms"][i] and own_alarm:
                body.append(svg_diamond(sx(i), sy(v), 7, fill=VERMILLION, stroke="#fff"))
            else:
                body.append(el("circle", cx=sx(i), cy=sy(v), r="4", fill=BLUE, stroke="#fff"))
        top += ph + xlab_h + 30
    body += svg_legend([(el("circle", cx=0.0, cy=0.0, r="4", fill=BLUE), "period"),
                     (svg_diamond(0, 0, 6, fill=VERMILLION), "alarm"),
                     (svg_line(-9, 0, 9, 0, stroke=VERMILLION, stroke_dasharray="6 4"),
                      "alarm threshold")], L + W - 300, 12, gap=24)
    return svg_doc(width, height, body, "Judge drift timeline")


