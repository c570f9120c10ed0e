"""A line chart as inline SVG, rendered on the server: the dashboard needs no JS library or CDN."""

from __future__ import annotations

import math
from html import escape

from llmqueue.metrics.dashboard import Series

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2")
WIDTH, HEIGHT, PAD = 640, 200, 40


def _nice_max(value: float) -> float:
    """A round axis top at or above `value` (1, 2, 5 × a power of ten)."""
    if value <= 0:
        return 1.0
    scale = 10.0 ** math.floor(math.log10(value))
    return next(step * scale for step in (1, 2, 5, 10) if step * scale >= value)


def line_chart(title: str, unit: str, series: list[Series], minutes: tuple[int, int]) -> str:
    """Minutes on x (the last hour), values on y from 0; one polyline and legend entry per
    series; a series with no point is listed as "no data"."""
    first, last = minutes
    span = max(1, last - first)
    top = _nice_max(max((v for s in series for _, v in s.points), default=0.0))

    def x(minute: int) -> float:
        return PAD + (minute - first) / span * (WIDTH - 2 * PAD)

    def y(value: float) -> float:
        return HEIGHT - PAD + -(value / top) * (HEIGHT - 2 * PAD)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{escape(title)}" '
        f'width="{WIDTH}" height="{HEIGHT + 20 * len(series)}" class="llmqueue-chart">',
        f'<text x="{PAD}" y="16" font-weight="bold">{escape(title)}</text>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" '
        'stroke="#999"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="#999"/>',
        f'<text x="4" y="{PAD + 4}" font-size="11">{top:g} {escape(unit)}</text>',
        f'<text x="4" y="{HEIGHT - PAD + 4}" font-size="11">0</text>',
        f'<text x="{PAD}" y="{HEIGHT - PAD + 16}" font-size="11">−60 min</text>',
        f'<text x="{WIDTH - PAD - 24}" y="{HEIGHT - PAD + 16}" font-size="11">now</text>',
    ]
    for index, s in enumerate(series):
        colour = COLOURS[index % len(COLOURS)]
        if s.points:
            coords = " ".join(f"{x(m):.1f},{y(v):.1f}" for m, v in s.points)
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{coords}" '
                f'data-series="{escape(s.label)}"/>'
            )
            # A dot per minute: a lone sample (a fresh history) shows too.
            parts += [
                f'<circle cx="{x(m):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colour}"/>'
                for m, v in s.points
            ]
        legend_y = HEIGHT + 14 + 20 * index
        note = "" if s.points else " (no data)"
        parts.append(f'<rect x="{PAD}" y="{legend_y - 9}" width="10" height="10" fill="{colour}"/>')
        parts.append(
            f'<text x="{PAD + 16}" y="{legend_y}" font-size="12">{escape(s.label)}{note}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)
