"""The HTML report: one self-contained file (inline SVG and CSS, no script, nothing fetched),
so it opens offline and can be mailed as it is. Every text is escaped."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import date
from html import escape
from typing import Any

WIDTH, HEIGHT = 720, 220
LEFT, RIGHT, TOP, BOTTOM = 52, 8, 28, 24
BAR_SERIES = (
    ("delivered", "#2e7d32"),
    ("dead_tokens", "#8d8d8d"),
    ("failed", "#c62828"),
    ("not sent", "#f9a825"),
)
LINE_SERIES = (
    ("latency_p50_ms", "p50", "#1565c0"),
    ("latency_p95_ms", "p95", "#ef6c00"),
    ("latency_p99_ms", "p99", "#c62828"),
)


def _svg(
    title: str, legend: Sequence[tuple[str, str]], body: str, peak: float, unit: str = ""
) -> str:
    plot_height = HEIGHT - TOP - BOTTOM
    keys = "".join(
        f'<rect x="{LEFT + i * 120}" y="6" width="10" height="10" fill="{colour}"/>'
        f'<text x="{LEFT + i * 120 + 14}" y="15" font-size="11">{escape(label)}</text>'
        for i, (label, colour) in enumerate(legend)
    )
    axis = (
        f'<line x1="{LEFT - 2}" y1="{TOP + plot_height}" x2="{WIDTH - RIGHT}" '
        f'y2="{TOP + plot_height}" stroke="currentColor" stroke-width="0.5"/>'
        f'<text x="{LEFT - 6}" y="{TOP + 4}" font-size="10" text-anchor="end">'
        f"{escape(f'{peak:g}{unit}')}</text>"
        f'<text x="{LEFT - 6}" y="{TOP + plot_height}" font-size="10" text-anchor="end">0</text>'
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="100%" '
        f'style="max-width:{WIDTH}px" role="img" aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>{keys}{axis}{body}</svg>"
    )


def _day_labels(days: Sequence[date], slot: float) -> str:
    step = max(1, len(days) // 8)
    return "".join(
        f'<text x="{LEFT + i * slot + slot / 2:.1f}" y="{HEIGHT - 8}" font-size="10" '
        f'text-anchor="middle">{day:%m-%d}</text>'
        for i, day in enumerate(days)
        if i % step == 0 or i == len(days) - 1
    )


def bar_chart(days: Sequence[date], totals: dict[date, dict[str, Any]]) -> str:
    """Pushes per day, stacked: delivered, dead token, failed, and publishes not sent."""
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_width / max(len(days), 1)
    bar = max(slot * 0.75, 1.0)

    def stack(row: dict[str, Any]) -> list[int]:
        not_sent = max(0, row.get("publishes_received", 0) - row.get("pushes_sent", 0))
        return [row.get("delivered", 0), row.get("dead_tokens", 0), row.get("failed", 0), not_sent]

    peak = max((sum(stack(totals.get(day, {}))) for day in days), default=0) or 1
    parts = []
    for i, day in enumerate(days):
        row = totals.get(day, {})
        x, y = LEFT + i * slot + (slot - bar) / 2, float(TOP + plot_height)
        for value, (_, colour) in zip(stack(row), BAR_SERIES, strict=True):
            if value:
                height = plot_height * value / peak
                y -= height
                parts.append(
                    f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" '
                    f'height="{height:.1f}" fill="{colour}"/>'
                )
        tip = (
            f"{day}: {row.get('publishes_received', 0)} received, "
            f"{row.get('pushes_sent', 0)} sent, {row.get('delivered', 0)} delivered, "
            f"{row.get('dead_tokens', 0)} dead, {row.get('failed', 0)} failed"
        )
        parts.append(
            f'<rect x="{x:.1f}" y="{TOP}" width="{bar:.1f}" height="{plot_height}" '
            f'fill="transparent"><title>{escape(tip)}</title></rect>'
        )
    legend = [(label.replace("_", " "), colour) for label, colour in BAR_SERIES]
    return _svg("Pushes per day", legend, "".join(parts) + _day_labels(days, slot), peak)


def line_chart(days: Sequence[date], totals: dict[date, dict[str, Any]]) -> str:
    """Latency publish -> provider answer per day: p50, p95, p99 (ms)."""
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_width / max(len(days), 1)
    values = [totals.get(day, {}).get(key) for day in days for key, _, _ in LINE_SERIES]
    peak = max((v for v in values if v is not None), default=0) or 1
    body = []
    for key, label, colour in LINE_SERIES:
        points = [
            (LEFT + i * slot + slot / 2, TOP + plot_height * (1 - value / peak))
            for i, day in enumerate(days)
            if (value := totals.get(day, {}).get(key)) is not None
        ]
        if points:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            body.append(
                f'<polyline points="{path}" fill="none" stroke="{colour}" '
                f'stroke-width="1.5"><title>{escape(label)}</title></polyline>'
            )
    legend = [(label, colour) for _, label, colour in LINE_SERIES]
    return _svg(
        "Latency (ms)", legend, "".join(body) + _day_labels(days, slot), round(peak, 1), " ms"
    )


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(_cell(v))}</td>" for v in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 1 else f"{value:.1f}"
    return str(value)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


STYLE = (
    "body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}"
    "table{border-collapse:collapse;margin:8px 0 24px}"
    "th,td{border-bottom:1px solid #ddd;padding:3px 8px;text-align:right}"
    "th:first-child,td:first-child{text-align:left}h2{margin-top:32px}"
)


def render(
    *,
    since: date,
    until: date,
    days: Sequence[date],
    usage_rows: Sequence[dict[str, Any]],
    registration_rows: Sequence[dict[str, Any]],
    domain_rows: Sequence[dict[str, Any]],
    error_rows: Sequence[dict[str, Any]],
    anomaly_rows: Sequence[dict[str, Any]],
    unifiedpush_rows: Sequence[dict[str, Any]] = (),
) -> str:
    """The whole page; rows are the collected report rows with tenant and app names."""
    totals = {row["day"]: row for row in usage_rows if row["level"] == "all"}
    per_tenant: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in usage_rows:
        if row["level"] == "tenant":
            for key in (
                "publishes_received",
                "pushes_sent",
                "delivered",
                "dead_tokens",
                "failed",
                "rate_limited",
                "coalesced",
            ):
                per_tenant[row["tenant_name"]][key] += row[key] or 0
    tenant_table = _table(
        [
            "tenant",
            "publishes received",
            "pushes sent",
            "delivered",
            "dead tokens",
            "failed",
            "rate-limited",
            "coalesced",
            "success rate",
        ],
        [
            [
                name,
                t["publishes_received"],
                t["pushes_sent"],
                t["delivered"],
                t["dead_tokens"],
                t["failed"],
                t["rate_limited"],
                t["coalesced"],
                _percent(t["delivered"] / t["pushes_sent"] if t["pushes_sent"] else None),
            ]
            for name, t in sorted(per_tenant.items())
        ],
    )
    per_provider: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in usage_rows:
        if row["level"] == "provider":
            for key in ("publishes_received", "pushes_sent", "delivered", "failed"):
                per_provider[(row["tenant_name"], row["provider"])][key] += row[key] or 0
            per_provider[(row["tenant_name"], row["provider"])]["bytes_relayed"] += (
                row.get("bytes_relayed") or 0
            )
    provider_table = _table(
        ["tenant", "provider", "received", "sent", "delivered", "failed", "bytes relayed"],
        [
            [
                tenant,
                provider or "(none)",
                t["publishes_received"],
                t["pushes_sent"],
                t["delivered"],
                t["failed"],
                t["bytes_relayed"],
            ]
            for (tenant, provider), t in sorted(per_provider.items())
        ],
    )
    up: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    up_columns = (
        "received",
        "delivered",
        "expired",
        "revoked",
        "replaced",
        "withdrawn",
        "dropped",
        "bytes_relayed",
    )
    for row in unifiedpush_rows:
        for key in up_columns:
            up[(row["tenant_name"], row["component_name"])][key] += row[key] or 0
    up_table = _table(
        ["tenant", "component", *(name.replace("_", " ") for name in up_columns)],
        [[*key, *(t[name] for name in up_columns)] for key, t in sorted(up.items())],
    )
    last = max((row["day"] for row in registration_rows), default=None)
    registrations = _table(
        ["tenant", "app", "provider", "active", "new", "renewed", "died", "removed"],
        [
            [
                r["tenant_name"],
                r["app_name"],
                r["provider"],
                r["active"],
                r["new"],
                r["renewed"],
                r["died"],
                r["removed"],
            ]
            for r in registration_rows
            if r["day"] == last
        ],
    )
    domains = _table(
        [
            "day",
            "tenant",
            "domain",
            "publishes",
            "pushes",
            "failed",
            "failure rate",
            "rank (volume)",
            "rank (failure rate)",
        ],
        [
            [
                r["day"],
                r["tenant_name"],
                r["publishing_domain"],
                r["publishes_received"],
                r["pushes_sent"],
                r["failed"],
                _percent(r["failure_rate"]),
                r["rank_by_volume"],
                r["rank_by_failure_rate"],
            ]
            for r in sorted(
                domain_rows,
                key=lambda r: (r["day"], r["tenant_name"], r["rank_by_volume"] or 10**9),
            )
        ],
    )
    errors: dict[tuple[str, str, str, str], int] = defaultdict(int)
    for r in error_rows:
        errors[(r["tenant_name"], r["provider"], r["outcome"], r["error_code"])] += r["count"]
    error_table = _table(
        ["tenant", "provider", "outcome", "error code", "pushes"],
        [[*key, count] for key, count in sorted(errors.items(), key=lambda kv: -kv[1])],
    )
    anomaly_table = _table(
        ["day", "scope", "tenant", "app", "domain", "what moved"],
        [
            [
                r["day"],
                r["scope"],
                r["tenant_name"],
                r["app_name"],
                r["publishing_domain"],
                r["detail"],
            ]
            for r in anomaly_rows
        ],
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>Push relay report {since} &ndash; {until}</title>"
        f"<style>{STYLE}</style></head><body>"
        f"<h1>Push relay report {since} &ndash; {until}</h1>"
        "<p>Counts per UTC day. Latency: publish received → provider answer, delivered pushes "
        "only (approximate percentiles, see docs/reports.md).</p>"
        f"<h2>Pushes per day</h2>{bar_chart(days, totals)}"
        f"<h2>Latency</h2>{line_chart(days, totals)}"
        f"<h2>Usage per tenant</h2>{tenant_table}"
        f"<h2>Usage per tenant and provider</h2>{provider_table}"
        "<h2>UnifiedPush per component</h2>"
        f"{up_table if unifiedpush_rows else '<p>None.</p>'}"
        f"<h2>Registrations on {last or '-'}</h2>{registrations}"
        f"<h2>Top publishing domains</h2>{domains}"
        f"<h2>Provider error codes</h2>{error_table}"
        f"<h2>Anomalies</h2>{anomaly_table if anomaly_rows else '<p>None.</p>'}"
        "</body></html>"
    )
