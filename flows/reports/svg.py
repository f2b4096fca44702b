"""SVG primitives for the report charts: elements, linear scales, nice ticks, axes, markers, legends.

Everything returns SVG text; every string that reaches the markup is escaped.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from flows.reports.common import FONT, GRID, INK, MUTED, _esc

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


def _polylines(points: Sequence[tuple[float, float] | None], **attrs: Any) -> list[str]:
    """One ``<polyline>`` per run of consecutive points; ``None`` breaks the line (a missing value),
    and a run of a single point draws nothing (its marker shows it)."""
    runs: list[list[str]] = [[]]
    for pt in points:
        if pt is None:
            runs.append([])
        else:
            runs[-1].append(f"{_r(pt[0])},{_r(pt[1])}")
    return [_el("polyline", points=" ".join(run), fill="none", **attrs) for run in runs if len(run) > 1]


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


