"""SVG primitives for the report charts: elements, linear scales, nice ticks, axes, markers, legends.

Everything returns SVG text; every string that reaches the markup is escaped.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from flows.reports.common import FONT, GRID, INK, MUTED, esc

# --------------------------------------------------------------------------------------------
# SVG primitives
# --------------------------------------------------------------------------------------------
def coord(v: float) -> str:
    """Compact coordinate."""
    return f"{v:.1f}".rstrip("0").rstrip(".") if math.isfinite(v) else "0"


def _attrs(attrs: dict[str, Any]) -> str:
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{esc(coord(v) if isinstance(v, float) else v)}"'
                   for k, v in attrs.items() if v is not None)


def el(tag: str, content: str | None = None, **attrs: Any) -> str:
    """One SVG/XML element, ``<tag attrs/>`` or ``<tag attrs>content</tag>``: attribute values escaped,
    ``_`` in their names written ``-``."""
    if content is None:
        return f"<{tag}{_attrs(attrs)}/>"
    return f"<{tag}{_attrs(attrs)}>{content}</{tag}>"


def svg_text(x: float, y: float, s: Any, **attrs: Any) -> str:
    """An SVG ``<text>`` at ``(x, y)`` holding the escaped ``s``."""
    return el("text", esc(s), x=float(x), y=float(y), **attrs)


def svg_line(x1: float, y1: float, x2: float, y2: float, **attrs: Any) -> str:
    """An SVG ``<line>`` from ``(x1, y1)`` to ``(x2, y2)``."""
    return el("line", x1=float(x1), y1=float(y1), x2=float(x2), y2=float(y2), **attrs)


def svg_doc(width: int, height: int, body: Iterable[str], label: str) -> str:
    """A complete, self-contained ``<svg>`` of ``width`` x ``height`` with ``body``, titled and labelled ``label``."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" role="img" aria-label="{esc(label)}" '
            f'class="chart" font-family="{esc(FONT)}" font-size="12">'
            f"<title>{esc(label)}</title>{''.join(body)}</svg>")


class LinearScale:
    """Linear map from a data domain to pixel range."""

    def __init__(self, d0: float, d1: float, r0: float, r1: float) -> None:
        if d1 == d0:
            d0, d1 = d0 - 0.5, d1 + 0.5
        self.d0, self.d1, self.r0, self.r1 = d0, d1, r0, r1

    def __call__(self, v: float) -> float:
        return self.r0 + (v - self.d0) / (self.d1 - self.d0) * (self.r1 - self.r0)


def nice_ticks(lo: float, hi: float, target: int = 6) -> tuple[float, float, list[float], int]:
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


def x_axis(sx: LinearScale, ticks: Sequence[float], decimals: int, y: float, top: float,
           label: str | None = None, grid: bool = True) -> list[str]:
    """The SVG parts of a horizontal axis at ``y``: ticks, their labels with ``decimals`` decimals, grid lines
    up to ``top`` (``grid``) and the axis ``label``."""
    out = []
    for t in ticks:
        x = sx(t)
        if grid:
            out.append(svg_line(x, top, x, y, stroke=GRID, stroke_width="1"))
        out.append(svg_line(x, y, x, y + 5, stroke=MUTED, stroke_width="1"))
        out.append(svg_text(x, y + 18, _tick_label(t, decimals), text_anchor="middle", fill=MUTED,
                            font_size="11"))
    out.append(svg_line(sx(ticks[0]), y, sx(ticks[-1]), y, stroke=MUTED, stroke_width="1"))
    if label:
        out.append(svg_text((sx(ticks[0]) + sx(ticks[-1])) / 2, y + 36, label, text_anchor="middle",
                            fill=INK, font_size="12"))
    return out


def y_axis(sy: LinearScale, ticks: Sequence[float], decimals: int, x: float, right: float,
           label: str | None = None, grid: bool = True) -> list[str]:
    """The SVG parts of a vertical axis at ``x``: ticks, their labels with ``decimals`` decimals, grid lines
    to ``right`` (``grid``) and the axis ``label``."""
    out = []
    for t in ticks:
        y = sy(t)
        if grid:
            out.append(svg_line(x, y, right, y, stroke=GRID, stroke_width="1"))
        out.append(svg_line(x - 5, y, x, y, stroke=MUTED, stroke_width="1"))
        out.append(svg_text(x - 8, y + 4, _tick_label(t, decimals), text_anchor="end", fill=MUTED,
                            font_size="11"))
    out.append(svg_line(x, sy(ticks[0]), x, sy(ticks[-1]), stroke=MUTED, stroke_width="1"))
    if label:
        cy = (sy(ticks[0]) + sy(ticks[-1])) / 2
        out.append(el("text", esc(label), x=float(x - 46), y=float(cy), text_anchor="middle",
                      fill=INK, font_size="12", transform=f"rotate(-90 {coord(x - 46)} {coord(cy)})"))
    return out


def svg_polylines(points: Sequence[tuple[float, float] | None], **attrs: Any) -> list[str]:
    """One ``<polyline>`` per run of consecutive points; ``None`` breaks the line (a missing value),
    and a run of a single point draws nothing (its marker shows it)."""
    runs: list[list[str]] = [[]]
    for pt in points:
        if pt is None:
            runs.append([])
        else:
            runs[-1].append(f"{coord(pt[0])},{coord(pt[1])}")
    return [el("polyline", points=" ".join(run), fill="none", **attrs) for run in runs if len(run) > 1]


def svg_diamond(x: float, y: float, r: float, **attrs: Any) -> str:
    """A diamond marker (SVG ``<polygon>``) of half-width ``r`` centred at ``(x, y)``."""
    pts = f"{coord(x)},{coord(y - r)} {coord(x + r)},{coord(y)} {coord(x)},{coord(y + r)} {coord(x - r)},{coord(y)}"
    return el("polygon", points=pts, **attrs)


def svg_cross(x: float, y: float, r: float, colour: str) -> str:
    """A cross marker (two SVG lines) of half-width ``r`` centred at ``(x, y)`` in ``colour``."""
    return (svg_line(x - r, y - r, x + r, y + r, stroke=colour, stroke_width="2")
            + svg_line(x - r, y + r, x + r, y - r, stroke=colour, stroke_width="2"))


def svg_legend(items: Sequence[tuple[str, str]], x: float, y: float, gap: float = 26) -> list[str]:
    """Horizontal legend; items are (marker svg at (0, 0), label)."""
    out, cx = [], x
    for marker, label in items:
        out.append(f'<g transform="translate({coord(cx)},{coord(y)})">{marker}</g>')
        out.append(svg_text(cx + 14, y + 4, label, fill=INK, font_size="12"))
        cx += 14 + 6.6 * len(label) + gap
    return out


