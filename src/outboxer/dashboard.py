"""The dashboard at ``/``: one server-rendered page and a little JavaScript, no build step.

The page shows, per destination, the rows by status and the oldest pending message's age;
a chart of the publish rate and latency over the last minutes (``dashboard.js`` draws it
as inline SVG from ``/dashboard/series``); and the newest FAILED and ABANDONED messages
with their last error, and a requeue and a purge button each.

DESIGN: every value from the database goes through ``html.escape`` (a last error is broker
or network text, hostile more often than not), and the page's Content-Security-Policy runs
no script but ``/dashboard.js``, so text that slipped through would still not run. The
requeue and purge buttons send the operator's token as a Bearer header with a JSON body (the API's
browser rules: JSON only, same origin); the page keeps the token in ``sessionStorage``
(this tab, until it closes), never in a URL, a cookie or the page itself.
"""

from __future__ import annotations

import html
import importlib.resources
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from outboxer.message import Status
from outboxer.stores import DestinationStatus

#: The statuses as columns, in the order a message goes through them.
COLUMNS = (
    Status.PENDING.value,
    Status.PROCESSING.value,
    Status.FAILED.value,
    Status.ABANDONED.value,
    Status.PUBLISHED.value,
)
#: Statuses an operator can requeue from the page.
PROBLEM_STATUSES = (Status.FAILED.value, Status.ABANDONED.value)
#: How many problem messages the page lists.
PROBLEMS_SHOWN = 20
#: Seconds between two points of the chart, and how many points it keeps (15 minutes).
SAMPLE_SECONDS = 10.0
SAMPLES_KEPT = 90

#: Where the page may load from and send to: itself only; no inline script or style.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def asset(name: str) -> bytes:
    """``dashboard.js`` or ``dashboard.css``, shipped beside this module."""
    return importlib.resources.files("outboxer").joinpath(name).read_bytes()


# ----- the chart's numbers ---------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """Cumulative numbers per destination at one moment."""

    at: float
    #: Messages published so far (a counter, or the PUBLISHED rows).
    published: Mapping[str, float]
    #: The publish latency histogram's sum and count so far, where a relay feeds it.
    latency: Mapping[str, tuple[float, float]]


class History:
    """The last ``SAMPLES_KEPT`` samples; the chart's points are the differences between them."""

    def __init__(self, interval: float = SAMPLE_SECONDS, kept: int = SAMPLES_KEPT) -> None:
        self.interval = interval
        self.samples: deque[Sample] = deque(maxlen=kept + 1)

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)

    def series(self) -> dict[str, Any]:
        """Per destination, the publish rate (messages/s) and mean latency (s) per interval.

        A rate below zero (PUBLISHED rows deleted by retention between two samples) shows as
        zero; an interval without a confirmed message has no latency (null).
        """
        points = []
        pairs = zip(list(self.samples)[:-1], list(self.samples)[1:], strict=True)
        for before, after in pairs:
            elapsed = after.at - before.at
            if elapsed <= 0:
                continue
            destinations: dict[str, dict[str, float | None]] = {}
            for name in sorted(set(after.published) | set(after.latency)):
                published = after.published.get(name, 0.0) - before.published.get(name, 0.0)
                total, count = after.latency.get(name, (0.0, 0.0))
                total_before, count_before = before.latency.get(name, (0.0, 0.0))
                confirmed = count - count_before
                destinations[name] = {
                    "rate": max(published, 0.0) / elapsed,
                    "latency": (total - total_before) / confirmed if confirmed > 0 else None,
                }
            points.append({"at": after.at, "destinations": destinations})
        return {"interval_seconds": self.interval, "points": points}


# ----- the page ----------------------------------------------------------------------------------


def _text(value: object) -> str:
    """``value`` as HTML text: escaped, quotes included (it may land in an attribute)."""
    return html.escape("" if value is None else str(value), quote=True)


def format_age(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "-"
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _count_class(status: str, count: int) -> str:
    return "count problem" if count and status in PROBLEM_STATUSES else "count"


def newest_problems(rows: Iterable[Mapping[str, Any]], shown: int = PROBLEMS_SHOWN) -> list[Any]:
    """The ``shown`` rows last changed (updated_at), newest first: the rows of several
    databases, each database's already newest first (Store.list_messages), merged."""

    def changed(row: Mapping[str, Any]) -> float:
        moment = row.get("updated_at")
        if isinstance(moment, datetime):
            aware = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
            return aware.timestamp()
        # Unix seconds: rows handed in by other code (every store now gives datetimes).
        if isinstance(moment, int | float):
            return float(moment)
        return -math.inf

    # Stable: rows changed at the same moment keep their store's order (the later seq first).
    return sorted(rows, key=changed, reverse=True)[:shown]


def _count_cell(entry: DestinationStatus, status: str) -> str:
    count = entry.counts.get(status, 0)
    if status == Status.PUBLISHED.value and entry.published_estimated:
        # A big table's PUBLISHED rows are estimated (Store.status); the cell says so.
        return (
            f'<td class="{_count_class(status, count)} estimated" data-status="{_text(status)}" '
            f'title="an estimate">≈ {count}</td>'
        )
    return f'<td class="{_count_class(status, count)}" data-status="{_text(status)}">{count}</td>'


def _counts_table(statuses: Sequence[DestinationStatus]) -> str:
    head = "".join(f"<th>{_text(status)}</th>" for status in COLUMNS)
    rows = []
    for entry in sorted(statuses, key=lambda entry: entry.destination):
        cells = "".join(_count_cell(entry, status) for status in COLUMNS)
        rows.append(
            f'<tr data-destination="{_text(entry.destination)}">'
            f"<th>{_text(entry.destination)}</th>{cells}"
            f'<td class="age">{_text(format_age(entry.oldest_pending_age))}</td></tr>'
        )
    body = "".join(rows) or (f'<tr><td colspan="{len(COLUMNS) + 2}">The outbox is empty.</td></tr>')
    return (
        '<table id="counts"><thead><tr><th>destination</th>'
        f"{head}<th>oldest pending</th></tr></thead><tbody>{body}</tbody></table>"
    )


def _problems_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return '<p id="no-problems">No FAILED or ABANDONED message.</p>'
    lines = []
    for row in rows:
        changed = row.get("updated_at")
        # Unix seconds: rows handed in by other code (every store now gives datetimes).
        if isinstance(changed, int | float):
            changed = datetime.fromtimestamp(changed, UTC)
        when = changed.isoformat(sep=" ", timespec="seconds") if changed else ""
        # A relay of several databases tags each row with its database (outboxer.http).
        database = row.get("database")
        shown = f"{database}/{row.get('destination')}" if database else row.get("destination")
        database_attribute = f' data-database="{_text(database)}"' if database else ""
        lines.append(
            f'<tr data-id="{_text(row.get("id"))}">'
            f'<td class="id">{_text(row.get("id"))}</td>'
            f"<td>{_text(shown)}</td>"
            f"<td>{_text(row.get('topic'))}</td>"
            f'<td class="status">{_text(row.get("status"))}</td>'
            f"<td>{_text(row.get('attempts'))}</td>"
            f"<td>{_text(when)}</td>"
            f'<td class="error">{_text(row.get("last_error"))}</td>'
            '<td><button type="button" class="requeue"'
            f' data-id="{_text(row.get("id"))}"'
            f' data-destination="{_text(row.get("destination"))}"{database_attribute}'
            f' data-status="{_text(row.get("status"))}">requeue</button>'
            ' <button type="button" class="purge"'
            f' data-id="{_text(row.get("id"))}"'
            f' data-destination="{_text(row.get("destination"))}"{database_attribute}'
            f' data-status="{_text(row.get("status"))}">purge</button></td></tr>'
        )
    return (
        '<table id="problems"><thead><tr><th>id</th><th>destination</th><th>topic</th>'
        "<th>status</th><th>attempts</th><th>last change</th><th>last error</th><th></th>"
        f"</tr></thead><tbody>{''.join(lines)}</tbody></table>"
    )


def render_page(
    statuses: Sequence[DestinationStatus] | None,
    problems: Sequence[Mapping[str, Any]],
    *,
    relay: str | None,
    token_required: bool,
    sample_seconds: float = SAMPLE_SECONDS,
    now: float | None = None,
) -> str:
    """The dashboard's HTML. ``statuses`` None: the database did not answer."""
    generated = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    counts = (
        _counts_table(statuses)
        if statuses is not None
        else '<p class="down">The database did not answer the status query.</p>'
    )
    token_note = (
        "Requeue and purge need the API's token: it stays in this browser tab (sessionStorage)."
        if token_required
        else "This API takes requeues and purges from local clients without a token."
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>outboxer</title>
<link rel="stylesheet" href="/dashboard.css">
<script src="/dashboard.js" defer></script>
</head>
<body>
<header>
<h1>outboxer</h1>
<p>relay: <span id="relay">{_text(relay or "not in this process")}</span>
· generated <time>{_text(generated.isoformat(sep=" ", timespec="seconds"))}</time></p>
</header>
<main>
<section>
<h2>Messages by destination</h2>
{counts}
</section>
<section>
<h2>Publish rate and latency</h2>
<p class="legend">messages per second (solid) and mean commit-to-confirm latency in seconds
(dashed), per {sample_seconds:g} s, over the last {SAMPLES_KEPT * sample_seconds / 60:g}
minutes</p>
<svg id="chart" viewBox="0 0 640 200" role="img" aria-label="publish rate and latency"></svg>
<ul id="chart-legend"></ul>
</section>
<section>
<h2>Newest FAILED and ABANDONED messages</h2>
<p><label>API token <input type="password" id="token" autocomplete="off"
size="40"></label> <span class="note">{_text(token_note)}</span></p>
<p id="requeue-result" role="status"></p>
{_problems_table(problems)}
</section>
</main>
</body>
</html>
"""


__all__ = [
    "CONTENT_SECURITY_POLICY",
    "PAGE_HEADERS",
    "SAMPLE_SECONDS",
    "History",
    "Sample",
    "asset",
    "format_age",
    "newest_problems",
    "render_page",
]
