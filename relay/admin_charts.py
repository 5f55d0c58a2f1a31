"""Charts for the admin as inline SVG made on the server: no script, no asset from elsewhere,
so the admin works fully offline."""

from __future__ import annotations

from collections.abc import Sequence

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from relay.services.usage import DayCounts

WIDTH, HEIGHT = 720, 220
LEFT, RIGHT, TOP, BOTTOM = 44, 8, 28, 24
# (label, colour) from the bottom of a bar up; "other" is still retrying or otherwise ended.
SERIES = (
    ("delivered", "#2e7d32"),
    ("dead token", "#8d8d8d"),
    ("failed", "#c62828"),
    ("other", "#f9a825"),
)


def _n(value: float) -> str:
    return f"{value:.1f}"


def _stack(entry: DayCounts) -> tuple[int, int, int, int]:
    counts = entry.counts
    other = max(0, counts.received - counts.delivered - counts.dead - counts.failed)
    return counts.delivered, counts.dead, counts.failed, other


def daily_chart(days: Sequence[DayCounts], *, title: str = "Pushes per day") -> SafeString:
    """Stacked bars, one per day: delivered, dead token, failed (hover a bar for numbers)."""
    peak = max((entry.counts.received for entry in days), default=0) or 1
    plot_width = WIDTH - LEFT - RIGHT
    plot_height = HEIGHT - TOP - BOTTOM
    slot = plot_width / max(len(days), 1)
    bar = max(slot * 0.75, 1.0)
    parts: list[SafeString] = []
    for index, entry in enumerate(days):
        x = LEFT + index * slot + (slot - bar) / 2
        y = float(TOP + plot_height)
        counts = entry.counts
        tooltip = (
            f"{entry.day:%Y-%m-%d}: {counts.received} received, {counts.delivered} delivered, "
            f"{counts.dead} dead, {counts.failed} failed"
        )
        rects: list[SafeString] = []
        for value, (_, colour) in zip(_stack(entry), SERIES, strict=True):
            if not value:
                continue
            height = plot_height * value / peak
            y -= height
            rects.append(
                format_html(
                    '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"/>',
                    _n(x),
                    _n(y),
                    _n(bar),
                    _n(height),
                    colour,
                )
            )
        # An invisible full-height rect carries the tooltip for empty days too.
        rects.append(
            format_html(
                '<rect x="{}" y="{}" width="{}" height="{}" fill="transparent">'
                "<title>{}</title></rect>",
                _n(x),
                TOP,
                _n(bar),
                plot_height,
                tooltip,
            )
        )
        parts.append(format_html('<g class="day">{}</g>', mark_safe("".join(rects))))
        if index % 5 == 0 or index == len(days) - 1:
            parts.append(
                format_html(
                    '<text x="{}" y="{}" font-size="10" text-anchor="middle">{}</text>',
                    _n(x + bar / 2),
                    HEIGHT - 8,
                    f"{entry.day:%m-%d}",
                )
            )
    axis = format_html(
        '<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="currentColor" stroke-width="0.5"/>'
        '<text x="{}" y="{}" font-size="10" text-anchor="end">{}</text>'
        '<text x="{}" y="{}" font-size="10" text-anchor="end">0</text>',
        LEFT - 2,
        TOP + plot_height,
        WIDTH - RIGHT,
        TOP + plot_height,
        LEFT - 6,
        TOP + 4,
        peak if peak > 1 or any(e.counts.received for e in days) else 0,
        LEFT - 6,
        TOP + plot_height,
    )
    legend = format_html_join(
        "",
        '<rect x="{}" y="6" width="10" height="10" fill="{}"/>'
        '<text x="{}" y="15" font-size="11">{}</text>',
        (
            (LEFT + index * 110, colour, LEFT + index * 110 + 14, label)
            for index, (label, colour) in enumerate(SERIES)
        ),
    )
    total = sum(entry.counts.received for entry in days)
    return format_html(
        '<svg class="relay-chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {} {}" '
        'width="100%" style="max-width:{}px" role="img" aria-label="{}">'
        "<title>{}</title>{}{}{}</svg>",
        WIDTH,
        HEIGHT,
        WIDTH,
        f"{title}: {total} pushes in {len(days)} days",
        title,
        legend,
        axis,
        mark_safe("".join(parts)),
    )
