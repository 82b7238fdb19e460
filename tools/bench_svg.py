"""The bench's plots, written as SVG by hand: no plotting library in the bench's dependencies.

Two kinds of panel, laid out in a grid of one file (``write``):
- ``LinePanel``: series of (x, y) points, for the soak's curves over time;
- ``RangePanel``: per group (a concurrency) and series (an arm), a point with a
  low-high whisker, for the bench's side-by-side figures and their spread.

Rules: every number shown comes from the report given (nothing computed here but
the axes); the output is plain SVG 1.1 text, deterministic for the same input,
readable in a browser and in the docs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
PANEL_W, PANEL_H = 420, 260
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 62, 12, 28, 42


@dataclass
class LinePanel:
    title: str
    x_label: str
    y_label: str
    series: list[tuple[str, list[float], list[float]]] = field(default_factory=list)  # (name, xs, ys)
    marks: list[tuple[float, str]] = field(default_factory=list)  # vertical lines: (x, label)


@dataclass
class RangePanel:
    title: str
    y_label: str
    groups: list[str]  # x positions, in order (e.g. "c=32")
    # (series name, per group: (value, low, high) or None)
    series: list[tuple[str, list[tuple[float, float, float] | None]]] = field(default_factory=list)
    reference: float | None = None  # a horizontal line (e.g. 1.0 for a ratio)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * step:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.3g}"


class _Frame:
    """One panel's plot area and its data-to-pixel mapping."""

    def __init__(self, ox: float, oy: float, x_range: tuple[float, float], y_range: tuple[float, float]) -> None:
        self.left, self.top = ox + MARGIN_L, oy + MARGIN_T
        self.w, self.h = PANEL_W - MARGIN_L - MARGIN_R, PANEL_H - MARGIN_T - MARGIN_B
        self.x0, self.x1 = x_range
        self.y0, self.y1 = y_range

    def x(self, v: float) -> float:
        return self.left + (v - self.x0) / ((self.x1 - self.x0) or 1.0) * self.w

    def y(self, v: float) -> float:
        return self.top + self.h - (v - self.y0) / ((self.y1 - self.y0) or 1.0) * self.h


def _axes(out: list[str], f: _Frame, title: str, x_label: str, y_label: str, x_ticks, y_ticks) -> None:
    out.append(f'<text x="{f.left + f.w / 2:.1f}" y="{f.top - 10:.1f}" text-anchor="middle" '
               f'font-weight="bold">{escape(title)}</text>')
    out.append(f'<rect x="{f.left:.1f}" y="{f.top:.1f}" width="{f.w:.1f}" height="{f.h:.1f}" '
               'fill="none" stroke="#888"/>')
    for v, label in y_ticks:
        y = f.y(v)
        out.append(f'<line x1="{f.left:.1f}" y1="{y:.1f}" x2="{f.left + f.w:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{f.left - 4:.1f}" y="{y + 4:.1f}" text-anchor="end">{escape(label)}</text>')
    for v, label in x_ticks:
        x = f.x(v)
        out.append(f'<text x="{x:.1f}" y="{f.top + f.h + 14:.1f}" text-anchor="middle">{escape(label)}</text>')
    out.append(f'<text x="{f.left + f.w / 2:.1f}" y="{f.top + f.h + 32:.1f}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    cy = f.top + f.h / 2
    out.append(f'<text x="{f.left - 48:.1f}" y="{cy:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 {f.left - 48:.1f} {cy:.1f})">{escape(y_label)}</text>')


def _legend(out: list[str], f: _Frame, names: list[str], below: bool = False) -> None:
    """Inside the plot's top-left corner, or in one row under it (where a range panel's points
    would otherwise be hidden)."""
    x = f.left + 6
    for i, name in enumerate(names):
        color = PALETTE[i % len(PALETTE)]
        if below:
            y = f.top + f.h + 32
        else:
            x, y = f.left + 6, f.top + 12 + i * 13
        out.append(f'<rect x="{x:.1f}" y="{y - 8:.1f}" width="9" height="9" fill="{color}"/>')
        out.append(f'<text x="{x + 13:.1f}" y="{y:.1f}">{escape(name)}</text>')
        if below:
            x += 22 + 6.5 * len(name)


def _line_panel(out: list[str], p: LinePanel, ox: float, oy: float) -> None:
    xs = [x for _, sx, _ in p.series for x in sx] + [x for x, _ in p.marks]
    ys = [y for _, _, sy in p.series for y in sy]
    x_range = (min(xs, default=0.0), max(xs, default=1.0))
    y_lo, y_hi = min(ys, default=0.0), max(ys, default=1.0)
    y_lo = min(0.0, y_lo)  # from zero: flat is flat, not a magnified wobble
    y_hi = y_hi * 1.1 if y_hi > 0 else 1.0
    yt = _ticks(y_lo, y_hi)
    f = _Frame(ox, oy, x_range, (y_lo, max(y_hi, yt[-1])))
    _axes(out, f, p.title, p.x_label, p.y_label, [(v, _fmt(v)) for v in _ticks(*x_range)],
          [(v, _fmt(v)) for v in yt])
    for x, label in p.marks:
        out.append(f'<line x1="{f.x(x):.1f}" y1="{f.top:.1f}" x2="{f.x(x):.1f}" y2="{f.top + f.h:.1f}" '
                   'stroke="#999" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{f.x(x) + 3:.1f}" y="{f.top + f.h - 4:.1f}" fill="#666">{escape(label)}</text>')
    for i, (_, sx, sy) in enumerate(p.series):
        points = " ".join(f"{f.x(x):.1f},{f.y(y):.1f}" for x, y in zip(sx, sy))
        out.append(f'<polyline points="{points}" fill="none" stroke="{PALETTE[i % len(PALETTE)]}" '
                   'stroke-width="1.5"/>')
    if len(p.series) > 1:
        _legend(out, f, [name for name, _, _ in p.series])


def _range_panel(out: list[str], p: RangePanel, ox: float, oy: float) -> None:
    values = [v for _, per in p.series for item in per if item is not None for v in item]
    if p.reference is not None:
        values.append(p.reference)
    y_lo, y_hi = min(values, default=0.0), max(values, default=1.0)
    y_lo = min(0.0, y_lo)
    y_hi = y_hi * 1.1 if y_hi > 0 else 1.0
    yt = _ticks(y_lo, y_hi)
    groups = len(p.groups)
    f = _Frame(ox, oy, (-0.5, groups - 0.5), (y_lo, max(y_hi, yt[-1])))
    _axes(out, f, p.title, "", p.y_label, [(i, g) for i, g in enumerate(p.groups)], [(v, _fmt(v)) for v in yt])
    if p.reference is not None:
        y = f.y(p.reference)
        out.append(f'<line x1="{f.left:.1f}" y1="{y:.1f}" x2="{f.left + f.w:.1f}" y2="{y:.1f}" '
                   'stroke="#999" stroke-dasharray="4 3"/>')
    n = max(1, len(p.series))
    for i, (_, per) in enumerate(p.series):
        color = PALETTE[i % len(PALETTE)]
        for g, item in enumerate(per):
            if item is None:
                continue
            value, low, high = item
            x = f.x(g - 0.3 + 0.6 * (i + 0.5) / n)
            out.append(f'<line x1="{x:.1f}" y1="{f.y(low):.1f}" x2="{x:.1f}" y2="{f.y(high):.1f}" '
                       f'stroke="{color}" stroke-width="1.5"/>')
            out.append(f'<circle cx="{x:.1f}" cy="{f.y(value):.1f}" r="3.5" fill="{color}"/>')
    _legend(out, f, [name for name, _ in p.series], below=True)


def render(panels: list[LinePanel | RangePanel], title: str, columns: int = 2, note: str = "") -> str:
    rows = math.ceil(len(panels) / columns) if panels else 1
    head = 30 + (16 if note else 0)
    width, height = PANEL_W * min(columns, max(1, len(panels))), head + PANEL_H * rows
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    if note:
        out.append(f'<text x="10" y="38" fill="#555">{escape(note)}</text>')
    for k, panel in enumerate(panels):
        ox, oy = (k % columns) * PANEL_W, head + (k // columns) * PANEL_H
        if isinstance(panel, LinePanel):
            _line_panel(out, panel, ox, oy)
        else:
            _range_panel(out, panel, ox, oy)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write(path: Path, panels: list[LinePanel | RangePanel], title: str, columns: int = 2, note: str = "") -> None:
    Path(path).write_text(render(panels, title, columns, note))
