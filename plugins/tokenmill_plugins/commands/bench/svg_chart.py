"""Line charts as standalone SVG, for benchmark reports that plot a series over time (``bench soak``).

No plotting library: a chart is a few panels stacked vertically, each with its
own y axis, sharing the x axis; each panel draws named series as polylines,
with a legend, "nice" tick values and optional vertical markers (the end of a
warm-up). The output opens in any browser.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")
_WIDTH, _PANEL_HEIGHT = 960, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 200, 36, 44  # margins around each panel's plot area


@dataclass
class Panel:
    """One chart panel: ``series`` maps a name to its (x, y) points."""

    title: str
    y_label: str
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    y_min: float | None = None  # None: from the data (and 0 when the data are all positive)


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """About ``count`` round tick values (steps of 1, 2 or 5 times a power of ten) covering [low, high]."""
    if not math.isfinite(low) or not math.isfinite(high):
        return [0.0]
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw_step = (high - low) / max(1, count - 1)
    magnitude = 10 ** math.floor(math.log10(raw_step))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw_step)
    first = math.floor(low / step) * step
    ticks = []
    value = first
    while value < high + step * 0.999:
        ticks.append(round(value, 10))
        value += step
    return ticks


def _format_tick(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:g}"


def line_chart_svg(
    panels: list[Panel], *, x_label: str, markers: Sequence[tuple[float, str]] = (), title: str = ""
) -> str:
    """The panels as one SVG document; ``markers`` are (x, label) vertical lines drawn on every panel."""
    xs = [x for panel in panels for points in panel.series.values() for x, _ in points] + [m[0] for m in markers]
    x_ticks = nice_ticks(min(xs, default=0.0), max(xs, default=1.0))
    x_low, x_high = x_ticks[0], x_ticks[-1]
    plot_width = _WIDTH - _LEFT - _RIGHT
    plot_height = _PANEL_HEIGHT - _TOP - _BOTTOM
    title_height = 28 if title else 0
    height = title_height + _PANEL_HEIGHT * len(panels)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" viewBox="0 0 {_WIDTH} {height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{_WIDTH}" height="{height}" fill="white"/>',
    ]
    if title:
        out.append(f'<text x="{_WIDTH / 2}" y="20" text-anchor="middle" font-size="15">{escape(title)}</text>')
    for index, panel in enumerate(panels):
        top = title_height + index * _PANEL_HEIGHT + _TOP
        ys = [y for points in panel.series.values() for _, y in points]
        low = panel.y_min if panel.y_min is not None else min(0.0, min(ys, default=0.0))
        y_ticks = nice_ticks(low, max(ys, default=1.0))
        y_low, y_high = y_ticks[0], y_ticks[-1]

        def sx(x: float) -> float:
            return _LEFT + (x - x_low) / ((x_high - x_low) or 1.0) * plot_width

        def sy(y: float, top: float = top, y_low: float = y_low, y_high: float = y_high) -> float:
            return top + plot_height - (y - y_low) / ((y_high - y_low) or 1.0) * plot_height

        out.append(f'<text x="{_LEFT}" y="{top - 10}" font-size="13">{escape(panel.title)}</text>')
        for tick in y_ticks:
            y = sy(tick)
            out.append(f'<line x1="{_LEFT}" x2="{_LEFT + plot_width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
            out.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_format_tick(tick)}</text>')
        for tick in x_ticks:
            x = sx(tick)
            bottom = top + plot_height
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}" stroke="#f0f0f0"/>')
            out.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_format_tick(tick)}</text>')
        out.append(
            f'<rect x="{_LEFT}" y="{top}" width="{plot_width}" height="{plot_height}" fill="none" stroke="#888"/>'
        )
        out.append(
            f'<text x="{_LEFT + plot_width / 2}" y="{top + plot_height + 34}" text-anchor="middle">'
            f"{escape(x_label)}</text>"
        )
        middle = top + plot_height / 2
        out.append(
            f'<text x="18" y="{middle}" text-anchor="middle" transform="rotate(-90 18 {middle})">'
            f"{escape(panel.y_label)}</text>"
        )
        for x_mark, label in markers:
            x = sx(x_mark)
            out.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + plot_height}" stroke="#555" '
                'stroke-dasharray="4 3"/>'
            )
            out.append(f'<text x="{x + 4:.1f}" y="{top + 12}" fill="#555">{escape(label)}</text>')
        for number, (name, points) in enumerate(panel.series.items()):
            colour = _COLOURS[number % len(_COLOURS)]
            if points:
                path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
                out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.6"/>')
            legend_y = top + 14 + 18 * number
            legend_x = _LEFT + plot_width + 12
            out.append(
                f'<line x1="{legend_x}" x2="{legend_x + 18}" y1="{legend_y - 4}" y2="{legend_y - 4}" '
                f'stroke="{colour}" stroke-width="3"/>'
            )
            out.append(f'<text x="{legend_x + 24}" y="{legend_y}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
