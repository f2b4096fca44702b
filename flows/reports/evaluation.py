"""Self-contained HTML report and terminal summary table for a CJE result.

The input is the plain result dict of ``docs/result-schema.md`` (``EvaluationResult.to_dict()`` or the
``result.json`` written by ``cje evaluate``). Two renderers:

- :func:`render_report` returns one HTML page with inline CSS and inline SVG drawn here (no scripts,
  no fonts, no network), so it can be mailed, archived or opened offline;
- :func:`format_table` returns a fixed-width text table for the terminal.

Both honour the level gate: a policy whose ``level_claim`` is ``"refused"`` is shown as "refused",
never with its (ranking-only) estimate or interval. Every user-supplied string is HTML-escaped.

Run ``python -m flows.reports.evaluation result.json [-o report.html] [--drift drift.json]`` to render a file.
"""
from __future__ import annotations

import argparse
import html
import json
import logging
import math
import sys
from pathlib import Path
from statistics import NormalDist
from typing import Any, Iterable, Sequence

from cje_engine.errors import CJEInputError
from cje_engine.result import validate_result

logger = logging.getLogger(__name__)

__all__ = ["render_report", "format_table", "main"]

# Okabe-Ito palette (colour-blind safe) plus neutral greys.
BLUE = "#0072B2"
SKY = "#56B4E9"
ORANGE = "#E69F00"
GREEN = "#009E73"
VERMILLION = "#D55E00"
PURPLE = "#CC79A7"
INK = "#1f2328"
MUTED = "#59636e"
GREY = "#9aa1a9"
GRID = "#e4e7eb"
FONT = ('system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", "Noto Sans", '
        '"Liberation Sans", "DejaVu Sans", Arial, sans-serif')

VERDICT_STYLE = {  # verdict -> (symbol, label, colour)
    "pass": ("\u2713", "pass", GREEN),
    "fail": ("\u2717", "fail", VERMILLION),
    "inconclusive": ("?", "inconclusive", "#B07800"),
    "not_run": ("\u2013", "not run", "#6b7280"),
}
LEVEL_CLAIMS = ("ok", "refused")
SCHEMA_VERSION = 1


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def _esc(value: Any) -> str:
    """HTML/XML-escape any value (quotes included)."""
    return html.escape(str(value), quote=True)


def _num(value: Any) -> float | None:
    """A finite float, or None for null, NaN, infinities, booleans and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _fmt(value: Any, digits: int = 3) -> str:
    v = _num(value)
    if v is None:
        return "n/a"
    text = f"{v:.{digits}f}"
    return "0." + "0" * digits if text == "-0." + "0" * digits else text


def _signed(value: Any, digits: int = 3) -> str:
    v = _num(value)
    if v is None:
        return "n/a"
    text = _fmt(v, digits)
    return text if text.startswith("-") or text == _fmt(0.0, digits) else "+" + text


def _pair(ci: Any) -> tuple[float, float] | None:
    if not isinstance(ci, (list, tuple)) or len(ci) != 2:
        return None
    lo, hi = _num(ci[0]), _num(ci[1])
    return None if lo is None or hi is None else (lo, hi)


def _fmt_ci(ci: Any, digits: int = 3) -> str:
    pair = _pair(ci)
    return "n/a" if pair is None else f"[{_fmt(pair[0], digits)}, {_fmt(pair[1], digits)}]"


def _fmt_p(p: Any) -> str:
    v = _num(p)
    if v is None:
        return "n/a"
    if v < 0.001:
        return "<0.001"
    return f"{v:.3f}"


def _pct(value: Any) -> str:
    v = _num(value)
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _name_cell(name: Any) -> str:
    """Escaped name with line-break opportunities after underscores (for table cells)."""
    return _esc(name).replace("_", "_<wbr>")


def _short(name: str, limit: int = 28) -> str:
    """Shorten a long label for a chart (the full name goes into a tooltip)."""
    return name if len(name) <= limit else name[: limit - 1] + "\u2026"


def _alpha(result: dict) -> float:
    for section in ("inference", "config"):
        a = _num((result.get(section) or {}).get("alpha"))
        if a is not None and 0 < a < 1:
            return a
    return 0.05


def _conf_label(alpha: float) -> str:
    return f"{100 * (1 - alpha):g}%"


def _z(alpha: float) -> float:
    return NormalDist().inv_cdf(1 - alpha / 2)


def _is_refused(pol: dict) -> bool:
    return pol.get("level_claim") == "refused"


def _audit(pol: dict) -> dict:
    audit = pol.get("audit")
    return audit if isinstance(audit, dict) else {}


def _verdict(pol: dict) -> str:
    verdict = _audit(pol).get("verdict")
    return verdict if verdict in VERDICT_STYLE else "not_run"


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def _check_result(result: Any) -> None:
    """Raise CJEInputError when the result dict cannot be rendered honestly (the engine's rules;
    partial hand-made results render too)."""
    validate_result(result, partial=True)


def _policy_order(result: dict) -> list[str]:
    """Policies in ranking order when a ranking is given, else in the order of the dict."""
    policies = result["policies"]
    order: list[str] = []
    for entry in result.get("ranking") or []:
        name = entry.get("policy") if isinstance(entry, dict) else None
        if name in policies and name not in order:
            order.append(name)
    order.extend(name for name in policies if name not in order)
    return order


def _check_drift(drift: Any) -> dict:
    """Validate the drift dict (see :func:`render_report`) and fill in defaults."""
    if not isinstance(drift, dict):
        raise CJEInputError(f"expected a dict, got {type(drift).__name__}", source="drift")
    periods = drift.get("periods")
    if not isinstance(periods, list) or not periods:
        raise CJEInputError("expected a non-empty list of period labels", source="drift",
                            column="periods")
    n = len(periods)

    def series(key: str, required: bool) -> list[float | None] | None:
        values = drift.get(key)
        if values is None and not required:
            return None
        if not isinstance(values, list) or len(values) != n:
            raise CJEInputError(f"expected a list of {n} numbers (one per period) or nulls",
                                source="drift", column=key)
        for i, v in enumerate(values):
            if v is not None and _num(v) is None:
                raise CJEInputError(f"expected a finite number or null, got {v!r}",
                                    source="drift", column=key, row=i)
        return [_num(v) for v in values]

    out = {
        "periods": [str(p) for p in periods],
        "kendall_tau": series("kendall_tau", True),
        "residual_shift": series("residual_shift", False),
        "residual_shift_ci": None,
        "alarms": None,
        "n_anchors": drift.get("n_anchors"),
        "method": drift.get("method"),
    }
    for key, default in (("tau_threshold", 0.8), ("shift_threshold", 0.05)):
        value = drift.get(key, default)
        if _num(value) is None:
            raise CJEInputError(f"expected a finite number, got {value!r}", source="drift",
                                column=key)
        out[key] = float(value)
    cis = drift.get("residual_shift_ci")
    if cis is not None:
        if not isinstance(cis, list) or len(cis) != n:
            raise CJEInputError(f"expected a list of {n} [low, high] pairs or nulls",
                                source="drift", column="residual_shift_ci")
        for i, ci in enumerate(cis):
            if ci is not None and _pair(ci) is None:
                raise CJEInputError(f"expected [low, high] or null, got {ci!r}", source="drift",
                                    column="residual_shift_ci", row=i)
        out["residual_shift_ci"] = [_pair(ci) for ci in cis]
    alarms = drift.get("alarms")
    if alarms is not None:
        if not isinstance(alarms, list) or len(alarms) != n or \
                not all(isinstance(a, bool) for a in alarms):
            raise CJEInputError(f"expected a list of {n} booleans", source="drift", column="alarms")
        out["alarms"] = list(alarms)
    else:
        tau, shift, thr_t, thr_s = (out["kendall_tau"], out["residual_shift"],
                                    out["tau_threshold"], out["shift_threshold"])
        out["alarms"] = [
            (tau[i] is not None and tau[i] < thr_t)
            or (shift is not None and shift[i] is not None and abs(shift[i]) > thr_s)
            for i in range(n)]
    return out


# --------------------------------------------------------------------------------------------
# SVG primitives
# --------------------------------------------------------------------------------------------
def _r(v: float) -> str:
    """Compact coordinate."""
    return f"{v:.1f}".rstrip("0").rstrip(".") if math.isfinite(v) else "0"


def _attrs(attrs: dict[str, Any]) -> str:
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{_esc(_r(v) if isinstance(v, float) else v)}"'
                   for k, v in attrs.items() if v is not None)


def _el(tag: str, content: str | None = None, **attrs: Any) -> str:
    if content is None:
        return f"<{tag}{_attrs(attrs)}/>"
    return f"<{tag}{_attrs(attrs)}>{content}</{tag}>"


def _text(x: float, y: float, s: Any, **attrs: Any) -> str:
    return _el("text", _esc(s), x=float(x), y=float(y), **attrs)


def _line(x1: float, y1: float, x2: float, y2: float, **attrs: Any) -> str:
    return _el("line", x1=float(x1), y1=float(y1), x2=float(x2), y2=float(y2), **attrs)


def _svg(width: int, height: int, body: Iterable[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" role="img" aria-label="{_esc(label)}" '
            f'class="chart" font-family="{_esc(FONT)}" font-size="12">'
            f"<title>{_esc(label)}</title>{''.join(body)}</svg>")


class _Lin:
    """Linear map from a data domain to pixel range."""

    def __init__(self, d0: float, d1: float, r0: float, r1: float) -> None:
        if d1 == d0:
            d0, d1 = d0 - 0.5, d1 + 0.5
        self.d0, self.d1, self.r0, self.r1 = d0, d1, r0, r1

    def __call__(self, v: float) -> float:
        return self.r0 + (v - self.d0) / (self.d1 - self.d0) * (self.r1 - self.r0)


def _ticks(lo: float, hi: float, target: int = 6) -> tuple[float, float, list[float], int]:
    """Nice tick positions covering [lo, hi]; returns (lo', hi', ticks, decimals)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = 0.0, 1.0
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    raw = (hi - lo) / max(target - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * 0.999)
    start = math.floor(lo / step + 1e-9) * step
    stop = math.ceil(hi / step - 1e-9) * step
    count = int(round((stop - start) / step))
    ticks = [start + i * step for i in range(count + 1)]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if abs(step / mag - 2.5) < 1e-9:
        decimals += 1
    return start, stop, ticks, decimals


def _tick_label(t: float, decimals: int) -> str:
    text = f"{t:.{decimals}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def _x_axis(sx: _Lin, ticks: Sequence[float], decimals: int, y: float, top: float,
            label: str | None = None, grid: bool = True) -> list[str]:
    out = []
    for t in ticks:
        x = sx(t)
        if grid:
            out.append(_line(x, top, x, y, stroke=GRID, stroke_width="1"))
        out.append(_line(x, y, x, y + 5, stroke=MUTED, stroke_width="1"))
        out.append(_text(x, y + 18, _tick_label(t, decimals), text_anchor="middle", fill=MUTED,
                         font_size="11"))
    out.append(_line(sx(ticks[0]), y, sx(ticks[-1]), y, stroke=MUTED, stroke_width="1"))
    if label:
        out.append(_text((sx(ticks[0]) + sx(ticks[-1])) / 2, y + 36, label, text_anchor="middle",
                         fill=INK, font_size="12"))
    return out


def _y_axis(sy: _Lin, ticks: Sequence[float], decimals: int, x: float, right: float,
            label: str | None = None, grid: bool = True) -> list[str]:
    out = []
    for t in ticks:
        y = sy(t)
        if grid:
            out.append(_line(x, y, right, y, stroke=GRID, stroke_width="1"))
        out.append(_line(x - 5, y, x, y, stroke=MUTED, stroke_width="1"))
        out.append(_text(x - 8, y + 4, _tick_label(t, decimals), text_anchor="end", fill=MUTED,
                         font_size="11"))
    out.append(_line(x, sy(ticks[0]), x, sy(ticks[-1]), stroke=MUTED, stroke_width="1"))
    if label:
        cy = (sy(ticks[0]) + sy(ticks[-1])) / 2
        out.append(_el("text", _esc(label), x=float(x - 46), y=float(cy), text_anchor="middle",
                       fill=INK, font_size="12", transform=f"rotate(-90 {_r(x - 46)} {_r(cy)})"))
    return out


def _diamond(x: float, y: float, r: float, **attrs: Any) -> str:
    pts = f"{_r(x)},{_r(y - r)} {_r(x + r)},{_r(y)} {_r(x)},{_r(y + r)} {_r(x - r)},{_r(y)}"
    return _el("polygon", points=pts, **attrs)


def _cross(x: float, y: float, r: float, colour: str) -> str:
    return (_line(x - r, y - r, x + r, y + r, stroke=colour, stroke_width="2")
            + _line(x - r, y + r, x + r, y - r, stroke=colour, stroke_width="2"))


def _legend(items: Sequence[tuple[str, str]], x: float, y: float, gap: float = 26) -> list[str]:
    """Horizontal legend; items are (marker svg at (0, 0), label)."""
    out, cx = [], x
    for marker, label in items:
        out.append(f'<g transform="translate({_r(cx)},{_r(y)})">{marker}</g>')
        out.append(_text(cx + 14, y + 4, label, fill=INK, font_size="12"))
        cx += 14 + 6.6 * len(label) + gap
    return out


# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------
def _forest_svg(result: dict, order: list[str], alpha: float) -> str:
    pols = result["policies"]
    width, left, right_cols = 1040, 250, 300
    x0, x1 = left, width - right_cols
    top, row_h = 78, 44
    height = top + row_h * len(order) + 56
    values: list[float] = []
    for name in order:
        p = pols[name]
        values += [v for v in (_num(p.get("estimate")), _num(p.get("raw_judge_mean")),
                               _num(p.get("oracle_mean"))) if v is not None]
        if (ci := _pair(p.get("ci"))) is not None:
            values += list(ci)
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    pad = 0.04 * (hi - lo or 1.0)
    lo, hi, ticks, dec = _ticks(lo - pad, hi + pad)
    sx = _Lin(lo, hi, x0 + 8, x1 - 8)
    conf = _conf_label(alpha)
    body = _legend([
        (_line(-9, 0, 9, 0, stroke=BLUE, stroke_width="2.5")
         + _el("circle", cx=0.0, cy=0.0, r="5", fill=BLUE), f"calibrated estimate, {conf} CI"),
        (_line(-9, 0, 9, 0, stroke=GREY, stroke_width="2", stroke_dasharray="3 3")
         + _el("circle", cx=0.0, cy=0.0, r="5", fill="#fff", stroke=GREY, stroke_width="2"),
         "refused: ranking only, not a level"),
        (_diamond(0, 0, 5.5, fill=ORANGE, stroke="#8a5d00", stroke_width="0.8"), "raw judge mean"),
        (_cross(0, 0, 4, INK), "oracle mean of own labels"),
    ], x0 - 230, 20)
    header_y = top - 12
    body.append(_text(x0 - 14, header_y, "policy", text_anchor="end", fill=MUTED, font_size="11",
                      font_weight="600"))
    body.append(_text(x1 + 18, header_y, f"estimate  [{conf} CI]", fill=MUTED, font_size="11",
                      font_weight="600"))
    body.append(_text(width - 8, header_y, "audit", text_anchor="end", fill=MUTED,
                      font_size="11", font_weight="600"))
    axis_y = top + row_h * len(order) + 6
    for i, _ in enumerate(order):
        if i % 2 == 0:
            body.append(_el("rect", x=4.0, y=float(top + i * row_h), width=float(width - 8),
                            height=float(row_h), fill="#f6f8fa"))
    body += _x_axis(sx, ticks, dec, axis_y, top, "value on the oracle (label) scale")
    for i, name in enumerate(order):
        p = pols[name]
        cy = top + i * row_h + row_h / 2
        refused = _is_refused(p)
        sub = p.get("basis_code") or ""
        n_lab = p.get("n_labelled")
        sub = " \u00b7 ".join(s for s in (str(sub).replace("_", "-"),
                                          f"{n_lab} own labels" if n_lab is not None else "") if s)
        body.append(_el("text", _el("title", _esc(name)) + _esc(_short(name, 26)), x=float(x0 - 14),
                        y=float(cy - 2), text_anchor="end", fill=INK, font_size="13",
                        font_weight="600"))
        body.append(_text(x0 - 14, cy + 13, sub, text_anchor="end", fill=MUTED, font_size="10.5"))
        est, ci = _num(p.get("estimate")), _pair(p.get("ci"))
        colour = GREY if refused else BLUE
        if ci is not None:
            dash = "4 3" if refused else None
            sw = "2" if refused else "2.5"
            body.append(_line(sx(ci[0]), cy, sx(ci[1]), cy, stroke=colour, stroke_width=sw,
                              stroke_dasharray=dash))
            for v in ci:
                body.append(_line(sx(v), cy - 5, sx(v), cy + 5, stroke=colour, stroke_width=sw))
        raw = _num(p.get("raw_judge_mean"))
        if raw is not None:
            body.append(_diamond(sx(raw), cy, 5.5, fill=ORANGE, stroke="#8a5d00",
                                 stroke_width="0.8"))
        orc = _num(p.get("oracle_mean"))
        if orc is not None:
            body.append(_cross(sx(orc), cy, 4, INK))
        if est is not None:
            if refused:
                body.append(_el("circle", cx=sx(est), cy=float(cy), r="5.5", fill="#fff",
                                stroke=GREY, stroke_width="2"))
            else:
                body.append(_el("circle", cx=sx(est), cy=float(cy), r="5.5", fill=BLUE,
                                stroke="#fff", stroke_width="1"))
        if refused:
            body.append(_text(x1 + 18, cy + 4, "refused", fill=MUTED, font_style="italic",
                              font_size="13", font_weight="600"))
        else:
            body.append(_el("text", _el("tspan", _esc(_fmt(est)), font_weight="600")
                            + _el("tspan", _esc("  " + _fmt_ci(ci)), fill=MUTED),
                            x=float(x1 + 18), y=float(cy + 4), font_size="13",
                            font_variant_numeric="tabular-nums"))
        sym, label, vcol = VERDICT_STYLE[_verdict(p)]
        body.append(_text(width - 8, cy + 4, f"{sym} {label}", text_anchor="end", fill=vcol,
                          font_size="12", font_weight="600"))
    return _svg(width, height, body, "Forest plot of policy estimates with confidence intervals")


def _calibration_svg(cal: dict, config: dict) -> str:
    width, height = 1040, 420
    curve = cal.get("curve") or {}
    points = cal.get("points") or {}
    cs = [_num(v) for v in curve.get("score") or []]
    cf = [_num(v) for v in curve.get("fitted") or []]
    ps = [_num(v) for v in points.get("score") or []]
    pl = [_num(v) for v in points.get("label") or []]
    curve_xy = [(s, f) for s, f in zip(cs, cf) if s is not None and f is not None]
    pts = [(s, y) for s, y in zip(ps, pl) if s is not None and y is not None]
    score_scale = _pair(config.get("score_scale"))
    label_scale = _pair(config.get("label_scale"))
    xs = [s for s, _ in curve_xy + pts] + (list(score_scale) if score_scale else [])
    ys = [y for _, y in curve_xy + pts] + (list(label_scale) if label_scale else [])
    xlo, xhi, xt, xd = _ticks(min(xs, default=0.0), max(xs, default=1.0))
    ylo, yhi, yt, yd = _ticks(min(ys, default=0.0), max(ys, default=1.0))
    # left panel: curve + points
    L, T, W, H = 80, 46, 420, 300
    sx, sy = _Lin(xlo, xhi, L, L + W), _Lin(ylo, yhi, T + H, T)
    body = [_text(L, 24, "Calibration curve f(judge score) over the labelled points", fill=INK,
                  font_size="13", font_weight="600")]
    lr = _pair(cal.get("label_range"))
    if lr is not None:
        for a, b in ((xlo, lr[0]), (lr[1], xhi)):
            if b - a > 1e-12:
                body.append(_el("rect", x=sx(a), y=float(T), width=sx(b) - sx(a), height=float(H),
                                fill="#eef0f3"))
        if lr[0] - xlo > (xhi - xlo) * 0.08:
            body.append(_text((sx(xlo) + sx(lr[0])) / 2, T + 14, "no labels", text_anchor="middle",
                              fill=MUTED, font_size="10.5"))
    body += _x_axis(sx, xt, xd, T + H, T, "judge score")
    body += _y_axis(sy, yt, yd, L, L + W, "oracle label")
    lo_d, hi_d = max(xlo, ylo), min(xhi, yhi)
    if hi_d > lo_d:
        body.append(_line(sx(lo_d), sy(lo_d), sx(hi_d), sy(hi_d), stroke=GREY, stroke_width="1.2",
                          stroke_dasharray="5 4"))
    for i, (s, y) in enumerate(pts):
        jitter = ((i * 0.6180339887) % 1.0 - 0.5) * 7.0  # deterministic, breaks over-plotting
        px = min(max(sx(s) + jitter, L + 3), L + W - 3)
        body.append(_el("circle", cx=px, cy=sy(y), r="2.8", fill=SKY,
                        fill_opacity="0.45", stroke="none"))
    if curve_xy:
        path = " ".join(f"{_r(sx(s))},{_r(sy(f))}" for s, f in sorted(curve_xy))
        body.append(_el("polyline", points=path, fill="none", stroke=BLUE, stroke_width="2.5",
                        stroke_linejoin="round"))
    body += _legend([
        (_el("circle", cx=0.0, cy=0.0, r="3.5", fill=SKY, fill_opacity="0.6"), "labelled point"),
        (_line(-9, 0, 9, 0, stroke=BLUE, stroke_width="2.5"), "fitted calibration"),
        (_line(-9, 0, 9, 0, stroke=GREY, stroke_width="1.2", stroke_dasharray="5 4"), "identity"),
    ], L + 6, T + H + 58, gap=18)
    # right panel: reliability diagram
    L2 = 600
    W2 = 380
    rel = [b for b in cal.get("reliability") or [] if isinstance(b, dict)
           and _num(b.get("mean_predicted")) is not None and _num(b.get("mean_label")) is not None]
    sx2, sy2 = _Lin(ylo, yhi, L2, L2 + W2), _Lin(ylo, yhi, T + H, T)
    body.append(_text(L2, 24, "Reliability diagram (binned by calibrated prediction)", fill=INK,
                      font_size="13", font_weight="600"))
    body += _x_axis(sx2, yt, yd, T + H, T, "mean calibrated prediction")
    body += _y_axis(sy2, yt, yd, L2, L2 + W2, "mean oracle label")
    body.append(_line(sx2(ylo), sy2(ylo), sx2(yhi), sy2(yhi), stroke=GREY, stroke_width="1.2",
                      stroke_dasharray="5 4"))
    n_max = max((_num(b.get("n")) or 0 for b in rel), default=1) or 1
    for b in rel:
        mp, ml = float(b["mean_predicted"]), float(b["mean_label"])
        n = _num(b.get("n")) or 0
        radius = 3 + 11 * math.sqrt(n / n_max)
        body.append(_line(sx2(mp), sy2(mp), sx2(mp), sy2(ml), stroke=VERMILLION, stroke_width="1.5"))
        body.append(_el("circle", _el("title", _esc(
            f"bin [{_fmt(b.get('lo'), 2)}, {_fmt(b.get('hi'), 2)}): n={b.get('n')}, "
            f"predicted {_fmt(mp)}, observed {_fmt(ml)}")), cx=sx2(mp), cy=sy2(ml), r=radius,
            fill=BLUE, fill_opacity="0.55", stroke=BLUE, stroke_width="1"))
    body += _legend([
        (_el("circle", cx=0.0, cy=0.0, r="5", fill=BLUE, fill_opacity="0.55"), "bin (area \u221d n)"),
        (_line(0, -7, 0, 7, stroke=VERMILLION, stroke_width="1.5"), "gap to identity"),
    ], L2 + 6, T + H + 58, gap=18)
    return _svg(width, height, body, "Calibration curve and reliability diagram")


def _audit_svg(name: str, audit: dict, alpha: float) -> str:
    width, height = 500, 250
    L, T, W, H = 64, 14, 420, 170
    z = _z(alpha)
    deciles = [d for d in audit.get("deciles") or [] if isinstance(d, dict)
               and _num(d.get("mean_residual")) is not None]
    margin = _num(audit.get("margin"))
    overall = _num(audit.get("residual_mean"))
    overall_ci = _pair(audit.get("ci_adjusted")) or _pair(audit.get("ci"))
    cats: list[tuple[str, str, float, float | None, float | None, bool]] = []
    for d in deciles:
        m, se = float(d["mean_residual"]), _num(d.get("se"))
        lo_hi = (m - z * se, m + z * se) if se is not None else None
        cats.append((f"{_fmt(d.get('lo'), 2)}\u2013{_fmt(d.get('hi'), 2)}",
                     f"n={d.get('n', '?')}", m, lo_hi[0] if lo_hi else None,
                     lo_hi[1] if lo_hi else None, False))
    if overall is not None:
        cats.append(("all", f"n={audit.get('n_labels', '?')}", overall,
                     overall_ci[0] if overall_ci else None, overall_ci[1] if overall_ci else None,
                     True))
    vals = [0.0] + [v for c in cats for v in (c[2], c[3], c[4]) if v is not None]
    if margin is not None:
        vals += [-1.3 * margin, 1.3 * margin]
    ylo, yhi, yt, yd = _ticks(min(vals), max(vals), 5)
    sy = _Lin(ylo, yhi, T + H, T)
    body: list[str] = []
    if margin is not None:
        body.append(_el("rect", x=float(L), y=sy(min(margin, yhi)), width=float(W),
                        height=sy(max(-margin, ylo)) - sy(min(margin, yhi)), fill=GREEN,
                        fill_opacity="0.13"))
    body += _y_axis(sy, yt, yd, L, L + W, "mean residual")
    if margin is not None:
        for m in (margin, -margin):
            if ylo <= m <= yhi:
                body.append(_line(L, sy(m), L + W, sy(m), stroke=GREEN, stroke_width="1",
                                  stroke_dasharray="4 3"))
    body.append(_line(L, sy(0), L + W, sy(0), stroke=INK, stroke_width="1"))
    body.append(_line(L, T + H, L + W, T + H, stroke=MUTED, stroke_width="1"))
    n = max(len(cats), 1)
    band = W / n
    rotate = n > 7
    verdict_colour = VERDICT_STYLE.get(audit.get("verdict"), VERDICT_STYLE["not_run"])[2]
    for i, (label, count, m, lo, hi, is_all) in enumerate(cats):
        cx = L + band * (i + 0.5)
        colour = verdict_colour if is_all else BLUE
        if is_all and i > 0:
            body.append(_line(L + band * i, T, L + band * i, T + H, stroke=GREY, stroke_width="1",
                              stroke_dasharray="2 3"))
        if lo is not None and hi is not None:
            body.append(_line(cx, sy(lo), cx, sy(hi), stroke=colour, stroke_width="2"))
            for v in (lo, hi):
                body.append(_line(cx - 4, sy(v), cx + 4, sy(v), stroke=colour, stroke_width="2"))
        shape = (_diamond(cx, sy(m), 6, fill=colour) if is_all else
                 _el("circle", cx=float(cx), cy=sy(m), r="4.5", fill=colour))
        body.append(shape)
        ty = T + H + 16
        if rotate:
            body.append(_el("text", _esc(label), x=float(cx), y=float(ty), text_anchor="end",
                            fill=MUTED, font_size="10",
                            transform=f"rotate(-35 {_r(cx)} {_r(ty)})"))
        else:
            body.append(_text(cx, ty, label, text_anchor="middle", fill=MUTED, font_size="10.5",
                              font_weight="600" if is_all else None))
            body.append(_text(cx, ty + 14, count, text_anchor="middle", fill=MUTED,
                              font_size="10"))
    body.append(_text(L + W / 2, height - 8, "judge-score bin (residual = oracle \u2212 calibrated)",
                      text_anchor="middle", fill=INK, font_size="11.5"))
    return _svg(width, height, body, f"Audit residuals by score bin for {name}")


def _pairwise(result: dict) -> tuple[list[str], list[list[float | None]], list[list[int]]]:
    """Win matrix as (policies, P(row better), sig) with sig in {1 row better, -1 worse, 0}."""
    policies = result["policies"]
    diffs: dict[tuple[str, str], tuple[float | None, float | None, bool]] = {}
    for c in result.get("comparisons") or []:
        if not isinstance(c, dict) or c.get("a") not in policies or c.get("b") not in policies:
            continue
        d, pa, sig = _num(c.get("diff")), _num(c.get("prob_a_better")), bool(c.get("significant"))
        diffs[(c["a"], c["b"])] = (d, pa, sig)
        diffs[(c["b"], c["a"])] = (-d if d is not None else None,
                                   1 - pa if pa is not None else None, sig)
    wm = result.get("win_matrix") if isinstance(result.get("win_matrix"), dict) else {}
    names = [n for n in wm.get("policies") or [] if n in policies] or _policy_order(result)
    idx = {n: i for i, n in enumerate(wm.get("policies") or [])}
    prob_m, sig_m = wm.get("prob_row_better"), wm.get("significant")
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
            if i == j:
                continue
            d, pa, s = diffs.get((a, b), (None, None, False))
            p = _num(cell(prob_m, a, b))
            p = p if p is not None else pa
            prob[i][j] = p
            # the matrix may mark a pair symmetrically (1 both ways), directionally (1 in the
            # winner's row only) or with signs (+1 / -1): any mark makes the pair significant
            here, there = _num(cell(sig_m, a, b)), _num(cell(sig_m, b, a))
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


def _win_svg(result: dict) -> str:
    names, prob, sig = _pairwise(result)
    pols = result["policies"]
    k = len(names)
    cell = 64 if k <= 6 else max(30, int(420 / k))
    left, top = 240, 150
    width = max(left + cell * k + 30, left + 360)
    height = top + cell * k + 110
    body: list[str] = []
    for j, b in enumerate(names):
        cx, ty = left + cell * (j + 0.5), top - 10
        label = _short(b, 24) + (" (refused)" if _is_refused(pols[b]) else "")
        body.append(_el("text", _el("title", _esc(b)) + _esc(label), x=float(cx), y=float(ty),
                        fill=INK, font_size="12", transform=f"rotate(-40 {_r(cx)} {_r(ty)})"))
    for i, a in enumerate(names):
        cy = top + cell * (i + 0.5)
        label = _short(a, 26) + (" (refused)" if _is_refused(pols[a]) else "")
        body.append(_el("text", _el("title", _esc(a)) + _esc(label), x=float(left - 10),
                        y=float(cy + 4), text_anchor="end", fill=INK, font_size="12"))
        for j in range(k):
            x, y = left + cell * j, top + cell * i
            if i == j:
                body.append(_el("rect", x=float(x), y=float(y), width=float(cell),
                                height=float(cell), fill="#d9dde2", stroke="#fff"))
                continue
            p = prob[i][j]
            fill = _puor(p) if p is not None else "#ffffff"
            verdict = ("significantly " + ("better" if sig[i][j] > 0 else "worse")
                       if sig[i][j] else "not significant")
            tip = f"{a} vs {names[j]}: P(row better) = {_fmt(p, 2)}; {verdict}"
            body.append(_el("rect", _el("title", _esc(tip)), x=float(x), y=float(y),
                            width=float(cell), height=float(cell), fill=fill, stroke="#fff",
                            stroke_width="2"))
            dark = p is not None and abs(p - 0.5) > 0.3
            tc = "#fff" if dark else INK
            symbol = "\u25b2" if sig[i][j] > 0 else "\u25bc" if sig[i][j] < 0 else ""
            if symbol:
                body.append(_text(x + cell / 2, y + cell / 2 - 4, symbol, text_anchor="middle",
                                  fill=tc, font_size="14"))
            body.append(_text(x + cell / 2, y + cell / 2 + (13 if symbol else 4), _fmt(p, 2),
                              text_anchor="middle", fill=tc, font_size="11",
                              font_variant_numeric="tabular-nums"))
    ly = top + cell * k + 30
    body.append(_text(left, ly - 8, "P(row policy better than column policy)", fill=INK,
                      font_size="11.5"))
    for s in range(11):
        body.append(_el("rect", x=float(left + s * 22), y=float(ly), width="22", height="12",
                        fill=_puor(s / 10)))
    for s, lab in ((0, "0"), (5, "0.5"), (10, "1")):
        body.append(_text(left + s * 22 + 11, ly + 26, lab, text_anchor="middle", fill=MUTED,
                          font_size="10.5"))
    method = str((result.get("multiplicity") or {}).get("method") or
                 (result.get("config") or {}).get("multiplicity") or "adjusted").upper()
    body.append(_text(left, ly + 50, f"\u25b2 row significantly better ({method}-adjusted)",
                      fill=INK, font_size="11.5"))
    body.append(_text(left, ly + 68, "\u25bc row significantly worse \u00b7 no symbol: not significant",
                      fill=INK, font_size="11.5"))
    return _svg(width, height, body, "Pairwise win matrix with adjusted significance")


def _drift_svg(d: dict) -> str:
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
    sx = _Lin(-0.5, n - 0.5, L, L + W)
    body: list[str] = []
    top = 30
    for kind, series in panels:
        T, H = top, ph
        vals = [v for v in series if v is not None]
        if kind == "tau":
            thr = d["tau_threshold"]
            title = f"Kendall \u03c4-b, reference vs current judge scores (alarm below {_fmt(thr, 2)})"
            ylo, yhi, yt, yd = _ticks(min(vals + [thr]) - 0.02, max(vals + [1.0]), 5)
            yhi = min(yhi, 1.0) if max(vals + [thr]) <= 1.0 else yhi
            yt = [t for t in yt if t <= yhi + 1e-12]
        else:
            thr = d["shift_threshold"]
            title = f"Mean residual shift on labelled anchors (alarm beyond \u00b1{_fmt(thr, 2)})"
            cis = d["residual_shift_ci"] or [None] * n
            extra = [v for ci in cis if ci for v in ci]
            ylo, yhi, yt, yd = _ticks(min(vals + extra + [-1.3 * thr]),
                                      max(vals + extra + [1.3 * thr]), 5)
        sy = _Lin(ylo, yhi, T + H, T)
        body.append(_text(L, T - 12, title, fill=INK, font_size="13", font_weight="600"))
        if kind == "tau":
            body.append(_el("rect", x=float(L), y=sy(thr), width=float(W),
                            height=sy(ylo) - sy(thr), fill=VERMILLION, fill_opacity="0.08"))
        else:
            body.append(_el("rect", x=float(L), y=sy(thr), width=float(W),
                            height=sy(-thr) - sy(thr), fill=GREEN, fill_opacity="0.12"))
            body.append(_line(L, sy(0), L + W, sy(0), stroke=INK, stroke_width="1"))
        body += _y_axis(sy, yt, yd, L, L + W, "\u03c4-b" if kind == "tau" else "shift")
        for t in ([thr] if kind == "tau" else [thr, -thr]):
            body.append(_line(L, sy(t), L + W, sy(t), stroke=VERMILLION, stroke_width="1.2",
                              stroke_dasharray="6 4"))
        body.append(_line(L, T + H, L + W, T + H, stroke=MUTED, stroke_width="1"))
        for i, p in enumerate(periods):
            x, ty = sx(i), T + H + 16
            body.append(_line(x, T + H, x, T + H + 4, stroke=MUTED))
            if rotate:
                body.append(_el("text", _esc(p), x=float(x), y=float(ty), text_anchor="end",
                                fill=MUTED, font_size="10.5",
                                transform=f"rotate(-40 {_r(x)} {_r(ty)})"))
            else:
                body.append(_text(x, ty, p, text_anchor="middle", fill=MUTED, font_size="10.5"))
        if kind == "shift" and d["residual_shift_ci"]:
            for i, ci in enumerate(d["residual_shift_ci"]):
                if ci is not None:
                    body.append(_line(sx(i), sy(ci[0]), sx(i), sy(ci[1]), stroke=BLUE,
                                      stroke_width="1.5"))
        segs: list[list[str]] = [[]]
        for i, v in enumerate(series):
            if v is None:
                segs.append([])
            else:
                segs[-1].append(f"{_r(sx(i))},{_r(sy(v))}")
        for seg in segs:
            if len(seg) > 1:
                body.append(_el("polyline", points=" ".join(seg), fill="none", stroke=BLUE,
                                stroke_width="2"))
        for i, v in enumerate(series):
            if v is None:
                continue
            own_alarm = (v < thr) if kind == "tau" else abs(v) > thr
            if d["alarms"][i] and own_alarm:
                body.append(_diamond(sx(i), sy(v), 7, fill=VERMILLION, stroke="#fff"))
            else:
                body.append(_el("circle", cx=sx(i), cy=sy(v), r="4", fill=BLUE, stroke="#fff"))
        top += ph + xlab_h + 30
    body += _legend([(_el("circle", cx=0.0, cy=0.0, r="4", fill=BLUE), "period"),
                     (_diamond(0, 0, 6, fill=VERMILLION), "alarm"),
                     (_line(-9, 0, 9, 0, stroke=VERMILLION, stroke_dasharray="6 4"),
                      "alarm threshold")], L + W - 300, 12, gap=24)
    return _svg(width, height, body, "Judge drift timeline")


# --------------------------------------------------------------------------------------------
# HTML pieces
# --------------------------------------------------------------------------------------------
def _badge(verdict: str) -> str:
    sym, label, _ = VERDICT_STYLE.get(verdict, VERDICT_STYLE["not_run"])
    return f'<span class="badge v-{_esc(verdict)}">{_esc(sym)} {_esc(label)}</span>'


def _claim_badge(pol: dict) -> str:
    if _is_refused(pol):
        return ('<span class="badge refused" title="level claim refused: ranked only, no level '
                'may be quoted">refused</span>')
    return '<span class="badge ok">quotable</span>'


def _join_names(names: Sequence[str]) -> str:
    parts = [f"<b>{_esc(n)}</b>" for n in names]
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _strip_winner_prefix(reason: Any) -> str:
    """Drop a leading "no clear winner:" from the engine's reason (the report says it already)."""
    text = str(reason).strip() if reason else ""
    low = text.lower()
    if low.startswith("no clear winner"):
        text = text[len("no clear winner"):].lstrip(" :;,\u2014-")
    return text


def _summary_html(result: dict, order: list[str], alpha: float, drift: dict | None) -> str:
    pols = result["policies"]
    conf = _conf_label(alpha)
    items: list[tuple[str, str]] = []
    quotable = [n for n in order if not _is_refused(pols[n])]
    refused = [n for n in order if _is_refused(pols[n])]
    if quotable:
        lines = []
        for n in quotable:
            p = pols[n]
            ci = _pair(p.get("ci"))
            ci_txt = f" ({conf} CI {_fmt(ci[0])}\u2013{_fmt(ci[1])})" if ci else ""
            note = ""
            if p.get("transport") == "unaudited" or _verdict(p) == "not_run":
                note = " <span class='note'>unaudited: rests on the assumption that the " \
                       "calibration transports</span>"
            elif _verdict(p) == "inconclusive":
                note = " <span class='note'>audit inconclusive</span>"
            lines.append(f"<li><b>{_esc(n)}</b>: <span class='num'>{_esc(_fmt(p.get('estimate')))}"
                         f"</span>{_esc(ci_txt)}{note}</li>")
        items.append(("ok", f"<p>Levels that can be quoted (oracle scale):</p><ul>{''.join(lines)}</ul>"))
    else:
        items.append(("bad", "<p>No policy has a quotable level.</p>"))
    if refused:
        lines = []
        for n in refused:
            reasons = [str(r) for r in pols[n].get("refusal_reasons") or []] or [
                "no reason given by the engine"]
            lines.append(f"<li><b>{_esc(n)}</b>: {'; '.join(_esc(r) for r in reasons)}</li>")
        items.append(("bad", "<p>Level claims <b>refused</b> (ranked only; do not quote a level):"
                             f"</p><ul>{''.join(lines)}</ul>"))
    best = result.get("best_policy")
    reason = _strip_winner_prefix(result.get("best_policy_reason"))
    reason_txt = f" \u2014 {_esc(reason)}" if reason else ""
    if best is not None:
        items.append(("ok", f"<p>Best policy: <b>{_esc(best)}</b>{reason_txt}</p>"))
    else:
        items.append(("warn", f"<p><b>No clear winner</b>{reason_txt}</p>"))
    failed = [n for n in order if _verdict(pols[n]) == "fail"]
    inconclusive = [n for n in order if _verdict(pols[n]) == "inconclusive"]
    not_run = [n for n in order if _verdict(pols[n]) == "not_run"]
    passed = [n for n in order if _verdict(pols[n]) == "pass"]
    audit_parts = []
    if failed:
        details = []
        for n in failed:
            a = _audit(pols[n])
            details.append(f"<b>{_esc(n)}</b> (mean residual {_esc(_signed(a.get('residual_mean')))}"
                           f" on {_esc(a.get('n_labels', '?'))} labels)")
        audit_parts.append("Transport audit <b>failed</b> for " + ", ".join(details) +
                           ": the calibration learned elsewhere does not hold for "
                           + ("this policy." if len(failed) == 1 else "these policies."))
    if inconclusive:
        details = []
        for n in inconclusive:
            extra = _audit(pols[n]).get("extra_labels_needed")
            details.append(f"<b>{_esc(n)}</b>" + (f" (about {_esc(extra)} more labels needed)"
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
    ra = result.get("rank_agreement") if isinstance(result.get("rank_agreement"), dict) else {}
    tau = _num(ra.get("kendall_tau_b_raw_vs_calibrated"))
    raw_order = [str(x) for x in ra.get("raw_order") or []]
    cal_order = [str(x) for x in ra.get("calibrated_order") or []]
    if tau is not None or raw_order:
        tau_txt = f"Kendall \u03c4-b = {_fmt(tau, 2)}" if tau is not None else "\u03c4 not given"
        if raw_order and raw_order == cal_order or (tau is not None and tau >= 0.999):
            items.append(("ok", f"<p>The raw judge and the calibrated estimates rank the policies "
                                f"the same way ({_esc(tau_txt)}).</p>"))
        else:
            orders = ""
            if raw_order and cal_order:
                orders = (" Raw judge order: " + " &gt; ".join(_esc(n) for n in raw_order)
                          + "; calibrated order: " + " &gt; ".join(_esc(n) for n in cal_order) + ".")
            items.append(("warn", f"<p>The raw judge ranking <b>disagrees</b> with the calibrated "
                                  f"ranking ({_esc(tau_txt)}).{orders}</p>"))
    if drift is not None:
        alarms = [p for p, a in zip(drift["periods"], drift["alarms"]) if a]
        if alarms:
            items.append(("bad", "<p>Judge drift <b>alarm</b> in period(s) "
                                 + ", ".join(_esc(p) for p in alarms) + ".</p>"))
        else:
            items.append(("ok", f"<p>No judge drift alarm over {len(drift['periods'])} "
                                "period(s).</p>"))
    warnings = [str(w) for w in result.get("warnings") or []]
    if warnings:
        items.append(("warn", f"<p>{len(warnings)} engine warning(s); see "
                              "<a href='#warnings'>Warnings</a>.</p>"))
    body = "".join(f'<div class="item {kind}">{content}</div>' for kind, content in items)
    return f'<section id="summary" class="summary"><h2>Summary</h2>{body}</section>'


def _policy_table(result: dict, order: list[str], alpha: float) -> str:
    pols = result["policies"]
    conf = _conf_label(alpha)
    head = ("<tr><th>policy</th><th class='r'>estimate</th>"
            f"<th class='r'>{conf} CI</th><th class='r'>SE</th><th>basis</th>"
            "<th>audit</th><th class='r'>raw judge</th><th class='r'>oracle mean</th>"
            "<th class='r'>labels / rows</th>"
            "<th class='r' title='share of the variance due to calibration'>calib. var.</th>"
            "<th>support</th></tr>")
    rows = []
    for n in order:
        p = pols[n]
        refused = _is_refused(p)
        sup = p.get("support") if isinstance(p.get("support"), dict) else {}
        sup_txt = ("limited" if sup.get("limited") else "ok") if sup else "n/a"
        sup_tip = (f"{_pct(sup.get('share_outside_range'))} of scores outside the labelled range, "
                   f"{_pct(sup.get('share_thin'))} in thinly labelled regions") if sup else ""
        if refused:
            est = f"<td class='c' colspan='3'>{_claim_badge(p)}</td>"
        else:
            est = (f"<td class='r num'><b>{_esc(_fmt(p.get('estimate')))}</b></td>"
                   f"<td class='r num'>{_esc(_fmt_ci(p.get('ci')))}</td>"
                   f"<td class='r num'>{_esc(_fmt(p.get('se')))}</td>")
        tr_cls = " class='is-refused'" if refused else ""
        rows.append(
            f"<tr{tr_cls}><td class='name'>{_name_cell(n)}</td>"
            f"{est}"
            f"<td title='{_esc(p.get('basis') or '')}'>{_esc(p.get('basis_code') or 'n/a')}</td>"
            f"<td title='transport: {_esc(p.get('transport') or 'n/a')}'>{_badge(_verdict(p))}</td>"
            f"<td class='r num'>{_esc(_fmt(p.get('raw_judge_mean')))}</td>"
            f"<td class='r num'>{_esc(_fmt(p.get('oracle_mean')))}</td>"
            f"<td class='r num'>{_esc(p.get('n_labelled', 'n/a'))} / "
            f"{_esc(p.get('n_rows', 'n/a'))}</td>"
            f"<td class='r num'>{_esc(_pct(p.get('variance_share_calibration')))}</td>"
            f"<td title='{_esc(sup_tip)}'>{_esc(sup_txt)}</td></tr>")
    bases = []
    for n in order:
        p = pols[n]
        if p.get("basis"):
            bases.append(f"<li><b>{_esc(n)}</b>: {_esc(p['basis'])}</li>")
    basis_list = f"<ul class='bases'>{''.join(bases)}</ul>" if bases else ""
    return (f"<div class='scroll'><table class='data'><thead>{head}</thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>{basis_list}")


def _estimator_table(result: dict, order: list[str], alpha: float) -> str:
    """Plug-in vs augmented numbers for quotable policies (refused ones stay hidden)."""
    pols = result["policies"]
    conf = _conf_label(alpha)
    rows = []
    for n in order:
        p = pols[n]
        if _is_refused(p):
            rows.append(f"<tr class='is-refused'><td class='name'>{_name_cell(n)}</td>"
                        "<td class='r refused-cell' colspan='4'>refused</td></tr>")
            continue
        cells = []
        for key in ("plug_in", "augmented"):
            part = p.get(key) if isinstance(p.get(key), dict) else None
            if part is None:
                cells.append("<td class='r muted' colspan='2'>not available</td>")
            else:
                cells.append(f"<td class='r num'>{_esc(_fmt(part.get('estimate')))}</td>"
                             f"<td class='r num'>{_esc(_fmt_ci(part.get('ci')))}</td>")
        rows.append(f"<tr><td class='name'>{_name_cell(n)}</td>{''.join(cells)}</tr>")
    return ("<div class='scroll'><table class='data'><thead><tr><th>policy</th>"
            f"<th class='r'>plug-in</th><th class='r'>{conf} CI</th><th class='r'>augmented</th>"
            f"<th class='r'>{conf} CI</th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>")


def _audit_section(result: dict, order: list[str], alpha: float) -> str:
    pols = result["policies"]
    panels = []
    rows = []
    adj = (result.get("config") or {}).get("audit_adjustment")
    for n in order:
        a = _audit(pols[n])
        verdict = _verdict(pols[n])
        extra = a.get("extra_labels_needed")
        extra_txt = "\u2013" if extra is None else str(extra)
        rows.append(
            f"<tr><td class='name'>{_name_cell(n)}</td><td>{_badge(verdict)}</td>"
            f"<td class='r num'>{_esc(a.get('n_labels', 'n/a'))}</td>"
            f"<td class='r num'>{_esc(_signed(a.get('residual_mean')))}</td>"
            f"<td class='r num'>{_esc(_fmt_ci(a.get('ci_adjusted') or a.get('ci')))}</td>"
            f"<td class='r num'>{_esc(_fmt_p(a.get('p_adjusted')))}</td>"
            f"<td>{_esc(a.get('calibrator') or 'n/a')}</td>"
            f"<td class='r num'>{_esc(extra_txt)}</td>"
            f"<td class='reason'>{_esc(a.get('reason') or '')}</td></tr>")
        has_data = any(isinstance(d, dict) and _num(d.get("mean_residual")) is not None
                       for d in a.get("deciles") or []) or _num(a.get("residual_mean")) is not None
        if verdict != "not_run" and has_data:
            caption = (f"mean residual {_signed(a.get('residual_mean'))}, adjusted CI "
                       f"{_fmt_ci(a.get('ci_adjusted') or a.get('ci'))} on {a.get('n_labels', '?')} "
                       f"labels; margin \u00b1{_fmt(a.get('margin'), 2)}")
            panels.append(f"<figure class='panel'><figcaption><b>{_esc(n)}</b> {_badge(verdict)}"
                          f"<span class='cap'>{_esc(caption)}</span></figcaption>"
                          f"{_audit_svg(n, a, alpha)}</figure>")
    not_audited = [n for n in order if _verdict(pols[n]) == "not_run"]
    note = (f"<p class='note'>Not audited (no own labels): {_join_names(not_audited)}.</p>"
            if not_audited else "")
    grid = (f"<div class='panels'>{''.join(panels)}</div>" if panels
            else "<p class='muted'>No policy has audit residuals to show.</p>")
    head = ("<tr><th>policy</th><th>verdict</th><th class='r'>labels</th>"
            "<th class='r'>mean residual</th>"
            "<th class='r'>adjusted CI</th><th class='r'>adj. p</th>"
            "<th>calibrator</th><th class='r'>more labels</th><th>reason</th></tr>")
    adj_txt = f" ({_esc(str(adj).title())} over audited policies)" if adj else ""
    return (f"<p class='lead'>Residual = oracle label \u2212 calibrated score on each policy's own "
            f"labelled rows, with a calibrator not trained on those rows. Points: bin means with "
            f"{_conf_label(alpha)} intervals; diamond: overall mean with its adjusted CI{adj_txt}; "
            f"green band: the practical margin. Compensating errors across bins can cancel in the "
            f"overall mean. Each panel has its own vertical scale.</p>{grid}{note}"
            f"<div class='scroll'><table class='data'><thead>{head}</thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def _pair_note(c: dict, involves: bool) -> str:
    """Note of a comparison: not estimable (with the reason; no number is shown) or relative only."""
    if c.get("reported") is False:
        return f"not estimable: {c.get('not_estimable') or 'a policy of the pair is not estimable'}"
    return "relative only (refused policy)" if involves else ""


def _comparisons_table(result: dict, alpha: float) -> str:
    rows = []
    pols = result["policies"]
    conf = _conf_label(alpha)
    for c in result.get("comparisons") or []:
        if not isinstance(c, dict):
            continue
        a, b = str(c.get("a")), str(c.get("b"))
        involves = bool(c.get("involves_refused")) or any(
            _is_refused(pols[x]) for x in (a, b) if x in pols)
        sig = bool(c.get("significant"))
        sig_txt = "<span class='sig'>\u2713 yes</span>" if sig else ("n/a" if c.get("reported") is False else "no")
        rows.append(
            f"<tr><td class='name'>{_name_cell(a)}</td><td class='name'>{_name_cell(b)}</td>"
            f"<td class='r num'>{_esc(_signed(c.get('diff')))}</td>"
            f"<td class='r num'>{_esc(_fmt_ci(c.get('ci')))}</td>"
            f"<td class='r num'>{_esc(_fmt_p(c.get('p_value')))}</td>"
            f"<td class='r num'>{_esc(_fmt_p(c.get('p_adjusted')))}</td>"
            f"<td class='c'>{sig_txt}</td>"
            f"<td class='r num'>{_esc(_fmt(c.get('prob_a_better'), 2))}</td>"
            f"<td class='note'>{_esc(_pair_note(c, involves))}</td></tr>")
    if not rows:
        return "<p class='muted'>No pairwise comparisons in this result.</p>"
    mult = result.get("multiplicity") or {}
    method = str(mult.get("method") or (result.get("config") or {}).get("multiplicity") or "")
    caption = (f"{len(rows)} comparisons; p-values adjusted by {_esc(method.upper() or 'n/a')} at "
               f"\u03b1 = {_esc(_fmt(mult.get('alpha', alpha), 2))}.")
    return (f"<p class='lead'>{caption} Differences are a \u2212 b on the oracle scale; comparisons "
            f"involving a refused policy are relative claims only.</p><div class='scroll'>"
            "<table class='data'><thead><tr><th>a</th><th>b</th><th class='r'>diff (a\u2212b)</th>"
            f"<th class='r'>{conf} CI</th><th class='r'>p</th><th class='r'>adj. p</th>"
            "<th class='c'>significant</th><th class='r'>P(a better)</th><th></th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def _calibration_section(result: dict) -> str:
    cal = result.get("calibration") if isinstance(result.get("calibration"), dict) else {}
    config = result.get("config") if isinstance(result.get("config"), dict) else {}
    if not cal:
        return "<p class='muted'>No calibration information in this result.</p>"
    sel = cal.get("selection") if isinstance(cal.get("selection"), dict) else {}
    facts = [f"mode used: <b>{_esc(cal.get('mode') or 'n/a')}</b>"]
    if sel:
        facts.append(f"requested: {_esc(sel.get('requested') or 'n/a')}")
        rmse = sel.get("oof_rmse") if isinstance(sel.get("oof_rmse"), dict) else {}
        if rmse:
            facts.append("out-of-fold RMSE: " + ", ".join(
                f"{_esc(k)} {_esc(_fmt(v))}" for k, v in rmse.items()))
    facts.append(f"trained on {_esc(cal.get('n_train', 'n/a'))} labels")
    lr = _pair(cal.get("label_range"))
    if lr:
        facts.append(f"labelled judge-score range [{_fmt(lr[0], 2)}, {_fmt(lr[1], 2)}]")
    reason = f"<p class='note'>Selection: {_esc(sel.get('reason'))}</p>" if sel.get("reason") else ""
    two_stage = ("<p class='note'>Two-stage calibration: the curve is drawn at the median of the "
                 "covariates.</p>" if cal.get("mode") == "two_stage" else "")
    row_list = []
    for b in cal.get("reliability") or []:
        if not isinstance(b, dict):
            continue
        mp, ml = _num(b.get("mean_predicted")), _num(b.get("mean_label"))
        gap = _signed(ml - mp) if mp is not None and ml is not None else "n/a"
        row_list.append(
            f"<tr><td class='num'>[{_esc(_fmt(b.get('lo'), 2))}, {_esc(_fmt(b.get('hi'), 2))})</td>"
            f"<td class='r num'>{_esc(b.get('n', 'n/a'))}</td>"
            f"<td class='r num'>{_esc(_fmt(mp))}</td><td class='r num'>{_esc(_fmt(ml))}</td>"
            f"<td class='r num'>{_esc(gap)}</td></tr>")
    rel_rows = "".join(row_list)
    rel_table = ("<table class='data compact'><thead><tr><th>prediction bin</th><th class='r'>n</th>"
                 "<th class='r'>mean predicted</th><th class='r'>mean label</th>"
                 "<th class='r'>label \u2212 predicted</th></tr></thead>"
                 f"<tbody>{rel_rows}</tbody></table>") if rel_rows else ""
    sep = " \u00b7 "
    return (f"<p class='facts'>{sep.join(facts)}</p>{reason}{two_stage}"
            f"<div class='figure'>{_calibration_svg(cal, config)}</div>{rel_table}")


def _drift_section(d: dict) -> str:
    extra = []
    if d.get("n_anchors") is not None:
        extra.append(f"{_esc(d['n_anchors'])} anchor pairs")
    if d.get("method"):
        extra.append(_esc(d["method"]))
    row_list = []
    for i, p in enumerate(d["periods"]):
        alarm = d["alarms"][i]
        shift = _signed(d["residual_shift"][i]) if d["residual_shift"] else "n/a"
        row_list.append(
            f"<tr{' class=alarm' if alarm else ''}><td>{_esc(p)}</td>"
            f"<td class='r num'>{_esc(_fmt(d['kendall_tau'][i]))}</td>"
            f"<td class='r num'>{_esc(shift)}</td>"
            f"<td>{'<b>alarm</b>' if alarm else 'ok'}</td></tr>")
    rows = "".join(row_list)
    return (f"<section id='drift'><h2>Judge drift</h2><p class='lead'>Anchor set re-scored every "
            f"period{(' (' + '; '.join(extra) + ')') if extra else ''}. Alarm when Kendall "
            f"\u03c4-b drops below {_esc(_fmt(d['tau_threshold'], 2))} or the mean residual shifts "
            f"by more than \u00b1{_esc(_fmt(d['shift_threshold'], 2))}"
            f" (or as flagged by the monitor that produced the alarms).</p>"
            f"<div class='figure'>{_drift_svg(d)}</div><table class='data compact'><thead><tr>"
            "<th>period</th><th class='r'>\u03c4-b</th><th class='r'>residual shift</th>"
            f"<th>status</th></tr></thead><tbody>{rows}</tbody></table></section>")


def _footer(result: dict) -> str:
    config = result.get("config") if isinstance(result.get("config"), dict) else {}
    inference = result.get("inference") if isinstance(result.get("inference"), dict) else {}
    seed = config.get("seed", inference.get("seed"))
    items = "".join(f"<div><dt>{_esc(k)}</dt><dd>{_esc(json.dumps(v, default=str))}</dd></div>"
                    for k, v in config.items())
    inf = " \u00b7 ".join(f"{_esc(k)}={_esc(v)}" for k, v in inference.items())
    return (f"<footer id='footer'><h2>Configuration</h2><dl class='config'>{items}</dl>"
            f"<p>Inference: {inf or 'n/a'}</p><p class='stamp'>seed <b>{_esc(seed)}</b> \u00b7 "
            f"engine version <b>{_esc(result.get('engine_version', 'unknown'))}</b> \u00b7 result "
            f"schema v{_esc(result.get('schema_version', '?'))} \u00b7 self-contained report "
            "(no external resources)</p></footer>")


CSS = """
:root{--ink:#1f2328;--muted:#59636e;--line:#d8dee4;--bg:#f4f6f8;--card:#fff;--blue:#0072B2;
--green:#009E73;--verm:#D55E00;--amber:#B07800}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);font:15px/1.5 FONT;
-webkit-font-smoothing:antialiased}
main{max-width:1180px;margin:0 auto;padding:28px 24px 40px}
header.top{margin-bottom:18px}
header.top h1{font-size:26px;margin:0 0 4px;letter-spacing:-.01em}
header.top .meta{color:var(--muted);font-size:14px}
section,footer{background:var(--card);border:1px solid var(--line);border-radius:10px;
padding:20px 24px;margin:0 0 18px}
h2{font-size:18px;margin:0 0 12px;letter-spacing:-.005em}
h3{font-size:15px;margin:20px 0 4px}
p{margin:6px 0}
.lead{color:var(--muted);font-size:14px;max-width:900px}
.summary .item{border-left:4px solid var(--line);padding:6px 12px;margin:8px 0;background:#fafbfc;
border-radius:0 6px 6px 0}
.summary .item ul{margin:4px 0 2px;padding-left:20px}
.summary .ok{border-left-color:var(--green)}
.summary .warn{border-left-color:#E69F00}
.summary .bad{border-left-color:var(--verm)}
.note{color:var(--muted);font-size:13px}
.muted{color:var(--muted)}
.num{font-variant-numeric:tabular-nums}
.figure{overflow-x:auto}
svg.chart{display:block;max-width:100%;height:auto}
table.data{border-collapse:collapse;width:100%;font-size:13px;margin:10px 0}
table.data.compact{width:auto;min-width:420px}
table.data th{text-align:left;font-weight:600;color:var(--muted);border-bottom:2px solid var(--line);
padding:6px 8px;white-space:nowrap}
table.data td{border-bottom:1px solid #eaeef2;padding:6px 8px;vertical-align:top}
table.data tbody tr:hover{background:#f6f8fa}
table.data .r{text-align:right}
table.data .c{text-align:center}
td.name{font-weight:600;overflow-wrap:break-word}
td.num,th{white-space:nowrap}
td.reason{color:var(--muted);min-width:220px}
tr.is-refused td{background:#fafafa}
td.refused-cell{color:var(--muted);font-style:italic;text-align:center}
tr.alarm td{background:#fdf0e8}
.scroll{overflow-x:auto}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;
white-space:nowrap;border:1px solid transparent}
.badge.ok{background:#e3f4ee;color:#00664a;border-color:#b5e2d2}
.badge.refused{background:#eceef1;color:#4b5259;border:1px dashed #8d949c}
.v-pass{background:#e3f4ee;color:#00664a}
.v-fail{background:#fbe6da;color:#9a3d00}
.v-inconclusive{background:#fdf3d9;color:#7a5400}
.v-not_run{background:#eceef1;color:#4b5259}
.sig{color:#3f1f80;font-weight:600}
.panels{display:grid;grid-template-columns:repeat(auto-fill,minmax(500px,1fr));gap:14px;margin:12px 0}
figure.panel{margin:0;border:1px solid #eaeef2;border-radius:8px;padding:10px 10px 4px}
figure.panel figcaption{font-size:14px}
figure.panel .cap{display:block;color:var(--muted);font-size:12.5px;margin-top:2px}
.facts{font-size:14px}
ul.bases{font-size:13px;color:var(--muted);margin:6px 0 0;padding-left:20px}
dl.config{display:grid;grid-template-columns:repeat(auto-fill,minmax(250px,1fr));gap:4px 18px;
margin:0 0 10px;font-size:13px}
dl.config div{display:flex;justify-content:space-between;gap:8px;border-bottom:1px dotted #e1e4e8;
padding:2px 0}
dl.config dt{color:var(--muted)}
dl.config dd{margin:0;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;
font-size:12px;text-align:right;word-break:break-all}
footer p{font-size:13px;color:var(--muted)}
footer .stamp{color:var(--ink)}
a{color:var(--blue)}
@media print{body{background:#fff}section,footer{break-inside:avoid;border-color:#ccc}}
""".replace("FONT", FONT)


def render_report(result: dict, *, title: str | None = None, drift: dict | None = None) -> str:
    """Render a result dict as one self-contained HTML page.

    Parameters
    ----------
    result : dict
        The result dict of ``docs/result-schema.md`` (schema version 1).
    title : str, optional
        Page title; defaults to "CJE evaluation report". Escaped like every user string.
    drift : dict, optional
        Judge-drift timeline from re-scoring an anchor set every period; adds a "Judge drift"
        section and a summary line. Accepted format (lists have one entry per period)::

            {
              "periods": ["2025-01", "2025-02", ...],   # required, labels in time order
              "kendall_tau": [0.97, 0.95, ...],         # required, tau-b reference vs current (null = missing)
              "tau_threshold": 0.8,                     # optional, alarm when tau < this (default 0.8)
              "residual_shift": [0.0, 0.01, ...],       # optional, change in mean residual on labelled anchors
              "residual_shift_ci": [[lo, hi], ...],     # optional, interval per period (null = none)
              "shift_threshold": 0.05,                  # optional, alarm when |shift| > this (default 0.05)
              "alarms": [false, true, ...],             # optional, alarms from an external monitor (e.g. a
                                                        # confidence sequence); overrides the thresholds
              "n_anchors": 200, "method": "..."         # optional, shown in the section text
            }

    Returns
    -------
    str
        The HTML document: inline CSS and SVG only, no scripts, no external resources.

    Raises
    ------
    CJEInputError
        When ``result`` or ``drift`` does not follow the format (the error names the field).
    """
    _check_result(result)
    drift_data = _check_drift(drift) if drift is not None else None
    alpha = _alpha(result)
    order = _policy_order(result)
    page_title = title if title is not None else "CJE evaluation report"
    data = result.get("data") if isinstance(result.get("data"), dict) else {}
    cal = result.get("calibration") if isinstance(result.get("calibration"), dict) else {}
    inference = result.get("inference") if isinstance(result.get("inference"), dict) else {}
    meta = [f"{len(order)} policies"]
    if data.get("n_rows") is not None:
        meta.append(f"{data['n_rows']} rows")
    if data.get("n_prompts") is not None:
        meta.append(f"{data['n_prompts']} prompts")
    if data.get("n_labelled") is not None:
        meta.append(f"{data['n_labelled']} oracle labels"
                    + (f" ({data['n_calibration_labels']} calibrate)"
                       if data.get("n_calibration_labels") is not None else ""))
    if cal.get("mode"):
        meta.append(f"{cal['mode']} calibration")
    if inference.get("method"):
        nb = inference.get("n_bootstrap")
        meta.append(f"{inference['method']} inference"
                    + (f" ({nb} replicates)" if inference["method"] == "bootstrap" and nb else ""))
    warnings = [str(w) for w in result.get("warnings") or []]
    warn_html = ("<ul>" + "".join(f"<li>{_esc(w)}</li>" for w in warnings) + "</ul>"
                 if warnings else "<p class='muted'>No warnings.</p>")
    conf = _conf_label(alpha)
    sep = " \u00b7 "
    parts = [
        "<!DOCTYPE html>",
        "<html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{_esc(page_title)}</title><style>{CSS}</style></head><body><main>",
        f"<header class='top'><h1>{_esc(page_title)}</h1>"
        f"<div class='meta'>{_esc(sep.join(meta))}</div></header>",
        _summary_html(result, order, alpha, drift_data),
        "<section id='estimates'><h2>Policy estimates</h2>"
        f"<p class='lead'>Calibrated values on the oracle scale with {conf} intervals that include "
        "the calibration's uncertainty. Refused policies are drawn hollow and dashed: their "
        "interval is computed for ranking only and is not a level. Raw judge means (orange) show "
        "how far the uncalibrated judge is off.</p>"
        f"<div class='figure'>{_forest_svg(result, order, alpha)}</div>"
        f"{_policy_table(result, order, alpha)}"
        "<h3>Plug-in vs augmented</h3>"
        f"{_estimator_table(result, order, alpha)}</section>",
        f"<section id='calibration'><h2>Calibration</h2>{_calibration_section(result)}</section>",
        f"<section id='audit'><h2>Transport audit</h2>{_audit_section(result, order, alpha)}"
        "</section>",
        "<section id='comparisons'><h2>Pairwise comparisons</h2>"
        f"<div class='figure'>{_win_svg(result)}</div>{_comparisons_table(result, alpha)}"
        "</section>",
    ]
    if drift_data is not None:
        parts.append(_drift_section(drift_data))
    parts.append(f"<section id='warnings'><h2>Warnings</h2>{warn_html}</section>")
    parts.append(_footer(result))
    parts.append("</main></body></html>")
    logger.debug("rendered report for %d policies", len(order))
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# terminal table
# --------------------------------------------------------------------------------------------
def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_table(result: dict) -> str:
    """Fixed-width text summary of a result dict for the terminal.

    One row per policy (estimate, CI, level claim, basis, audit verdict, raw judge mean, oracle
    mean; refused levels read "refused"), then the pairwise comparisons with adjusted p-values and
    the best-policy line.

    Raises
    ------
    CJEInputError
        When ``result`` does not follow ``docs/result-schema.md``.
    """
    _check_result(result)
    alpha = _alpha(result)
    conf = _conf_label(alpha)
    pols = result["policies"]
    order = _policy_order(result)
    rows = []
    for n in order:
        p = pols[n]
        refused = _is_refused(p)
        rows.append([
            n,
            "refused" if refused else _fmt(p.get("estimate")),
            "refused" if refused else _fmt_ci(p.get("ci")),
            str(p.get("level_claim")),
            str(p.get("basis_code") or "n/a"),
            VERDICT_STYLE[_verdict(p)][1],
            _fmt(p.get("raw_judge_mean")),
            _fmt(p.get("oracle_mean")),
        ])
    lines = ["Policy estimates (oracle scale)"]
    lines += _table(["policy", "estimate", f"{conf} CI", "level", "basis", "audit", "raw judge",
                     "oracle mean"], rows, right={1, 2, 6, 7})
    comps = [c for c in result.get("comparisons") or [] if isinstance(c, dict)]
    mult = result.get("multiplicity") or {}
    method = str(mult.get("method") or (result.get("config") or {}).get("multiplicity") or "n/a")
    lines.append("")
    if comps:
        lines.append(f"Pairwise comparisons (a - b; p adjusted by {method.upper()}, "
                     f"alpha {_fmt(mult.get('alpha', alpha), 2)})")
        crow = []
        any_refused = False
        for c in comps:
            a, b = str(c.get("a")), str(c.get("b"))
            involves = bool(c.get("involves_refused")) or any(
                _is_refused(pols[x]) for x in (a, b) if x in pols)
            any_refused |= involves
            crow.append([a, b, _signed(c.get("diff")), _fmt_ci(c.get("ci")),
                         _fmt_p(c.get("p_value")), _fmt_p(c.get("p_adjusted")),
                         "yes" if c.get("significant") else ("n/a" if c.get("reported") is False else "no"),
                         _fmt(c.get("prob_a_better"), 2),
                         "not estimable" if c.get("reported") is False else ("*" if involves else "")])
        lines += _table(["a", "b", "diff", f"{conf} CI", "p", "p adj", "sig", "P(a better)", ""],
                        crow, right={2, 3, 4, 5, 7})
        if any_refused:
            lines.append("* involves a refused policy: relative comparison only, no level implied")
        for c in comps:
            if c.get("reported") is False:
                lines.append(f"not estimable: {c.get('a')} - {c.get('b')}: {c.get('not_estimable')}")
    else:
        lines.append("Pairwise comparisons: none")
    lines.append("")
    best = result.get("best_policy")
    if best is not None:
        reason = str(result.get("best_policy_reason") or "")
        lines.append(f"Best policy: {best}" + (f" ({reason})" if reason else ""))
    else:
        reason = _strip_winner_prefix(result.get("best_policy_reason"))
        lines.append("Best policy: none, no clear winner" + (f" ({reason})" if reason else ""))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: render ``result.json`` to HTML and print the terminal table."""
    parser = argparse.ArgumentParser(prog="python -m flows.reports.evaluation", description=main.__doc__)
    parser.add_argument("result", type=Path, help="result.json written by cje evaluate")
    parser.add_argument("-o", "--output", type=Path, help="HTML file to write")
    parser.add_argument("--title", help="report title")
    parser.add_argument("--drift", type=Path, help="drift JSON (format: see render_report)")
    args = parser.parse_args(argv)

    def load(path: Path) -> Any:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CJEInputError(f"cannot read JSON: {exc}", source=str(path)) from exc

    result = load(args.result)
    drift = load(args.drift) if args.drift else None
    sys.stdout.write(format_table(result) + "\n")
    if args.output:
        args.output.write_text(render_report(result, title=args.title, drift=drift),
                               encoding="utf-8")
        logger.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":  # pragma: no cover
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main())
