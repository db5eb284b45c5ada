"""The dashboard's page and chart numbers (outboxer.dashboard), without a browser."""

from __future__ import annotations

import html.parser
from datetime import UTC, datetime, timedelta

import pytest

from outboxer.dashboard import History, Sample, format_age, newest_problems, render_page
from outboxer.stores import DestinationStatus

HOSTILE = "</td><script>alert(1)</script><img src=x onerror=alert(2)>\"'&"


class Elements(html.parser.HTMLParser):
    """The start tags of a page, and its text, as a browser's parser would read them."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(page: str) -> Elements:
    elements = Elements()
    elements.feed(page)
    return elements


def test_hostile_database_text_stays_text() -> None:
    row = {
        "id": HOSTILE,
        "destination": HOSTILE,
        "topic": HOSTILE,
        "status": "ABANDONED",
        "attempts": 3,
        "last_error": HOSTILE,
        "updated_at": datetime(2026, 1, 1, tzinfo=UTC),
    }
    page = render_page(
        [DestinationStatus(HOSTILE, {"PENDING": 1})], [row], relay=HOSTILE, token_required=True
    )
    elements = parse(page)
    assert [tag for tag, _ in elements.tags if tag in ("script", "img")] == ["script"], (
        "the one script is the page's own"
    )
    assert [attrs for tag, attrs in elements.tags if tag == "script"] == [
        {"src": "/dashboard.js", "defer": None}
    ]
    # The relay line, the counts row, and the id, destination, topic and error cells.
    assert sum(text.count(HOSTILE) for text in elements.text) == 6
    button = next(attrs for tag, attrs in elements.tags if tag == "button")
    assert button["data-id"] == HOSTILE and button["data-destination"] == HOSTILE


def test_counts_per_destination_with_every_status_and_the_pending_age() -> None:
    page = render_page(
        [
            DestinationStatus("partner", {"ABANDONED": 2}, oldest_pending_age=None),
            DestinationStatus("default", {"PENDING": 4, "PUBLISHED": 9}, oldest_pending_age=95.0),
        ],
        [],
        relay="ok",
        token_required=False,
    )
    cells = [attrs for tag, attrs in parse(page).tags if tag == "td"]
    assert [attrs["data-status"] for attrs in cells if "data-status" in attrs][:5] == [
        "PENDING",
        "PROCESSING",
        "FAILED",
        "ABANDONED",
        "PUBLISHED",
    ]
    assert page.index('data-destination="default"') < page.index('data-destination="partner"')
    assert 'class="count problem" data-status="ABANDONED">2<' in page
    assert 'class="count" data-status="FAILED">0<' in page
    assert '<td class="age">95 s</td>' in page and '<td class="age">-</td>' in page
    assert "No FAILED or ABANDONED message." in page


def test_an_estimated_published_count_is_marked() -> None:
    statuses = [DestinationStatus("default", {"PUBLISHED": 5_000_000}, published_estimated=True)]
    page = render_page(statuses, [], relay="ok", token_required=False)
    assert 'data-status="PUBLISHED" title="an estimate">≈ 5000000<' in page
    exact = render_page(
        [DestinationStatus("default", {"PUBLISHED": 7})], [], relay=None, token_required=False
    )
    assert 'class="count" data-status="PUBLISHED">7<' in exact


def test_a_problem_row_from_sqlite_shows_its_unix_time() -> None:
    row = {"id": "m-1", "status": "FAILED", "updated_at": 1_767_225_600.0, "last_error": "no"}
    page = render_page(
        [DestinationStatus("default", {"FAILED": 1})], [row], relay=None, token_required=False
    )
    assert "<td>2026-01-01 00:00:00+00:00</td>" in page


def test_a_database_that_does_not_answer_is_said_so() -> None:
    page = render_page(None, [], relay=None, token_required=False)
    assert "did not answer the status query" in page and 'id="counts"' not in page


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "-"), (-3.0, "0 s"), (59.4, "59 s"), (600.0, "10 min"), (5400.0, "90 min"),
     (7200.0, "2.0 h"), (259200.0, "3.0 d")],
)  # fmt: skip
def test_ages(seconds: float | None, text: str) -> None:
    assert format_age(seconds) == text


def test_newest_problems_of_several_databases_first() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [{"id": n, "updated_at": start + timedelta(minutes=n)} for n in range(30)]
    rows.append({"id": "naive", "updated_at": datetime(2026, 1, 2)})  # naive: UTC
    rows.append({"id": "unix", "updated_at": datetime(2026, 1, 3, tzinfo=UTC).timestamp()})
    assert [row["id"] for row in newest_problems(rows, 4)] == ["unix", "naive", 29, 28]


def test_the_chart_is_the_rate_and_mean_latency_between_samples() -> None:
    history = History(interval=10.0, kept=2)
    history.add(Sample(100.0, {"a": 5.0}, {}))
    history.add(Sample(110.0, {"a": 25.0, "b": 3.0}, {"a": (4.0, 10.0)}))
    history.add(Sample(120.0, {"a": 20.0, "b": 3.0}, {"a": (4.0, 10.0)}))  # retention deleted 5
    history.add(Sample(130.0, {"a": 30.0, "b": 3.0}, {"a": (7.0, 12.0)}))
    series = history.series()
    assert series["interval_seconds"] == 10.0
    assert [point["at"] for point in series["points"]] == [120.0, 130.0], "two intervals kept"
    assert series["points"][0]["destinations"] == {
        "a": {"rate": 0.0, "latency": None},
        "b": {"rate": 0.0, "latency": None},
    }
    assert series["points"][1]["destinations"]["a"] == {"rate": 1.0, "latency": 1.5}
