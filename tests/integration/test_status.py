"""Status on a big table, against the real PostgreSQL, MariaDB and SQLite: the unfinished rows
counted exactly through the status index, the PUBLISHED ones estimated and flagged, and no
status or list query reading the published history (the plans say so)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest

import outboxer
from outboxer.stores import Failure, Store, create_store
from outboxer.stores.base import EXACT_STATUS_ROWS
from outboxer.stores.sqlfiles import queries, render, strip_comments, to_numbered, to_pyformat
from outboxer.stores.sqlite import sqlite_path
from tests.conftest import mysql_connect

#: PUBLISHED rows of a first attempt written in front of the real ones: more than a store
#: counts row by row, so status estimates them. ``default`` then ``partner``, in two runs.
HISTORY = {"default": 20_000, "partner": 10_000}
#: PUBLISHED rows of ``default`` that needed a second attempt: counted exactly.
RETRIED = 30
assert sum(HISTORY.values()) > EXACT_STATUS_ROWS

_COLUMNS = (
    "id, destination, topic, {key}, payload, content_type, status, attempts, created_at, "
    "updated_at, published_at"
)


def _history_sql(dialect: str) -> list[str]:
    """INSERTs of HISTORY and RETRIED rows, all PUBLISHED, older than anything enqueued."""
    total = sum(HISTORY.values()) + RETRIED
    first_partner = HISTORY["default"] + RETRIED

    def row(n: str, dest: str, attempts: str, ago: str) -> str:
        return f"{n}, {dest}, 't', NULL, {{payload}}, 'application/json', 'PUBLISHED', {attempts}, {ago}"

    destination = f"CASE WHEN n < {first_partner} THEN 'default' ELSE 'partner' END"
    attempts = f"CASE WHEN n < {RETRIED} THEN 2 ELSE 0 END"
    if dialect == "postgres":
        ago = "now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'"
        values = row("CAST(lpad(to_hex(n + 1), 32, '0') AS uuid)", destination, attempts, ago)
        return [
            f"INSERT INTO outboxer.outbox ({_COLUMNS.format(key='key')}) SELECT "
            + values.format(payload="'\\x7b7d'::bytea")
            + f" FROM generate_series(0, {total - 1}) AS n"
        ]
    if dialect == "mysql":
        ago = ", ".join(["UTC_TIMESTAMP(6) - INTERVAL 1 DAY"] * 3)
        digits = " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10))
        values = row(
            "CONCAT('00000000-0000-0000-0000-', LPAD(HEX(n + 1), 12, '0'))",
            destination,
            attempts,
            ago,
        )
        return [
            f"INSERT INTO outbox ({_COLUMNS.format(key='`key`')}) SELECT "
            + values.format(payload="'{}'")
            + f" FROM (SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d AS n "
            f"FROM ({digits}) a, ({digits}) b, ({digits}) c, ({digits}) e, ({digits}) f) AS g "
            f"WHERE n < {total} ORDER BY n"  # seqs in the order of n, as on the others
        ]
    ago = ", ".join(["(julianday('now') - 2440587.5) * 86400.0 - 86400"] * 3)
    values = row("printf('%032x', n + 1)", destination, attempts, ago)
    return [
        f"WITH RECURSIVE g(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM g WHERE n < {total - 1}) "
        f"INSERT INTO outbox ({_COLUMNS.format(key='key')}) SELECT "
        + values.format(payload="x'7b7d'")
        + " FROM g"
    ]


def connect_sync(url: str) -> Any:
    if url.startswith("sqlite"):
        return sqlite3.connect(sqlite_path(url))
    if url.startswith("mysql"):
        return mysql_connect(url)
    import psycopg

    return psycopg.connect(url)


def execute(url: str, *statements: str, autocommit: bool = False) -> None:
    conn = connect_sync(url)
    try:
        if autocommit:
            conn.autocommit = True
        for statement in statements:
            conn.cursor().execute(statement)
        conn.commit()
    finally:
        conn.close()


def dialect_of(url: str) -> str:
    return (
        "sqlite" if url.startswith("sqlite") else "mysql" if url.startswith("mysql") else "postgres"
    )


def write_history(url: str) -> None:
    execute(url, *_history_sql(dialect_of(url)))


def analyze(url: str) -> None:
    """What autovacuum does to a table that grew (PostgreSQL); a no-op elsewhere."""
    if dialect_of(url) == "postgres":
        execute(url, "VACUUM (ANALYZE) outboxer.outbox", autocommit=True)


def enqueue(url: str, count: int, start: int = 0) -> None:
    conn = connect_sync(url)
    try:
        for n in range(start, start + count):
            outboxer.enqueue(conn, "order.placed", {"n": n}, key=f"k{n}")
        conn.commit()
    finally:
        conn.close()


@pytest.fixture(params=["postgres", "mysql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = {"sqlite": "sqlite_url", "postgres": "pg_url", "mysql": "mysql_url"}[request.param]
    return str(request.getfixturevalue(fixture))


def without_published(counts: dict[str, int]) -> dict[str, int]:
    return {status: n for status, n in counts.items() if status != "PUBLISHED"}


def near(estimate: int, truth: int, tolerance: float) -> bool:
    return abs(estimate - truth) <= tolerance * truth


async def test_a_big_table_counts_unfinished_rows_exactly_and_estimates_published(
    db_url: str,
) -> None:
    write_history(db_url)
    enqueue(db_url, 10)
    async with create_store(db_url) as store:
        claimed = await store.claim("default", "relay-test", 4, 60.0, False)
        seqs = [m.stored_seq for m in claimed]
        await store.settle(
            "default",
            claimed.lease,
            [],
            [Failure(seqs[0], "later", 60.0, False), Failure(seqs[1], "never", 0.0, True)],
            [],
            5,
        )  # seqs[2:] stay in flight
        analyze(db_url)
        default, partner = await store.status()
        assert (default.destination, partner.destination) == ("default", "partner")
        assert default.published_estimated and partner.published_estimated
        assert without_published(default.counts) == {
            "PENDING": 6,
            "PROCESSING": 2,
            "FAILED": 1,
            "ABANDONED": 1,
        }
        assert without_published(partner.counts) == {}
        assert default.retried == RETRIED + 2, "exact: the retried PUBLISHED rows are indexed"
        assert default.oldest_pending_age is not None and partner.oldest_pending_age is None
        # ANALYZE read every row (PostgreSQL); one seq drawn in each slice of 30, the runs
        # of one destination far longer (MySQL, SQLite): off by one slice at most.
        published = HISTORY["default"] + RETRIED
        assert near(default.counts["PUBLISHED"], published, 0.01), default.counts
        assert near(partner.counts["PUBLISHED"], HISTORY["partner"], 0.01), partner.counts
        report = await store.status_report()
        assert [entry["published_estimated"] for entry in report["destinations"]] == [True, True]

        # The backlog moves; nothing analyses the table again: the exact counts follow.
        enqueue(db_url, 3, start=10)
        await store.settle("default", claimed.lease, seqs[2:], [], [], 5)
        default, _ = await store.status()
        assert without_published(default.counts) == {"PENDING": 9, "FAILED": 1, "ABANDONED": 1}
        assert default.retried == RETRIED + 2
        assert near(default.counts["PUBLISHED"], published + 2, 0.02), default.counts

        # The same table counted row by row: the same exact counts, the PUBLISHED ones too.
        store.exact_status_rows = 10**9
        default, partner = await store.status()
        assert without_published(default.counts) == {"PENDING": 9, "FAILED": 1, "ABANDONED": 1}
        assert (default.counts["PUBLISHED"], partner.counts) == (
            published + 2,
            {"PUBLISHED": HISTORY["partner"]},
        )
        assert not default.published_estimated and not partner.published_estimated


async def test_newest_changes_first_through_the_published_history(db_url: str) -> None:
    write_history(db_url)
    enqueue(db_url, 3)
    async with create_store(db_url) as store:
        claimed = await store.claim("default", "relay-test", 1, 60.0, False)
        await store.settle("default", claimed.lease, [claimed[0].stored_seq], [], [], 5)
        analyze(db_url)
        rows = await store.list_messages(["PUBLISHED", "PENDING"], 4)
        assert [row["status"] for row in rows] == ["PUBLISHED", "PENDING", "PENDING", "PUBLISHED"]
        assert str(rows[0]["id"]) == str(claimed[0].id), "published just now"
        history = await store.list_messages(["PUBLISHED"], 3)
        # The history's rows changed at the same moment: the later seq first.
        assert [int(str(row["seq"])) for row in history[1:]] == sorted(
            (int(str(row["seq"])) for row in history[1:]), reverse=True
        )
        assert int(str(history[1]["seq"])) == sum(HISTORY.values()) + RETRIED


# ----- the plans: no statement of status or list reads the published history ----------------


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def _pg_outbox_scans(url: str, name: str, *, generic: bool) -> list[tuple[str, str | None]]:
    """(node type, index) of every node of the plan of query ``name`` that reads the outbox."""
    import psycopg

    from outboxer.stores.postgres import PostgresStore

    sql, names = to_numbered(render(queries("postgres")[name], PostgresStore(url).tokens()))
    values = {"statuses": "'{FAILED,ABANDONED,PUBLISHED}'", "limit": "50"}
    arguments = f"({', '.join(values[n] for n in names)})" if names else ""
    with psycopg.connect(url) as conn:
        if generic:  # the plan asyncpg's prepared statements may settle on
            conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE status_query AS {sql}")
        row = conn.execute(f"EXPLAIN (FORMAT JSON) EXECUTE status_query{arguments}").fetchone()
    assert row is not None
    [explained] = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return [
        (node["Node Type"], node.get("Index Name"))
        for node in _plan_nodes(explained["Plan"])
        if node.get("Relation Name") == "outbox"
    ]


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_postgres_status_and_list_plans_scan_no_published_history(
    pg_url: str, generic: bool
) -> None:
    write_history(pg_url)
    enqueue(pg_url, 10)
    analyze(pg_url)  # statistics and a visibility map, as autovacuum leaves them

    tally = _pg_outbox_scans(pg_url, "counts_tally", generic=generic)
    assert tally == [("Index Only Scan", "outbox_status_idx")], tally
    assert _pg_outbox_scans(pg_url, "status_stats", generic=generic) == []
    listed = _pg_outbox_scans(pg_url, "list", generic=generic)
    assert {node for node, _ in listed} == {"Index Scan"}, listed
    assert {index for _, index in listed} == {"outbox_status_idx", "outbox_finished_idx"}
    # The control: the row-by-row count of a small table does read the whole table.
    assert ("Seq Scan", None) in _pg_outbox_scans(pg_url, "counts", generic=generic)


def test_mysql_status_and_list_plans_read_index_ranges(mysql_url: str) -> None:
    import pymysql.cursors

    from outboxer.stores.mysql import MySQLStore, expand_lists

    write_history(mysql_url)
    enqueue(mysql_url, 10)
    tokens = MySQLStore(mysql_url).tokens()
    sql = {
        name: to_pyformat(strip_comments(render(text, tokens)))
        for name, text in queries("mysql").items()
    }
    conn = mysql_connect(mysql_url)
    try:
        cursor = conn.cursor(pymysql.cursors.DictCursor)

        def explain(name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
            text, args = expand_lists(sql[name], params)
            cursor.execute("EXPLAIN " + text, args)
            return [row for row in cursor.fetchall() if row["table"] == "outbox"]

        [tally] = explain("counts_tally", {})
        assert (tally["key"], tally["type"]) == ("status_idx", "range"), tally
        assert "Using index" in tally["Extra"], "covered: no row is read"
        listed = explain("list", {"statuses": ["FAILED", "PUBLISHED"], "limit": 50})
        read = [row for row in listed if row["key"] is not None]
        assert {row["key"] for row in read} == {"finished_idx"}, listed
        assert not any("filesort" in (row["Extra"] or "") for row in read), "index order"
        sampled = explain("sample_published", {"seqs": [1, 500, 29_000]})
        assert [row["key"] for row in sampled] == ["PRIMARY"], sampled
    finally:
        conn.close()


def test_sqlite_status_and_list_plans_search_indexes(sqlite_url: str) -> None:
    from outboxer.stores.sqlite import SqliteStore

    write_history(sqlite_url)
    tokens = SqliteStore(sqlite_url).tokens()
    sql = {name: render(text, tokens) for name, text in queries("sqlite").items()}
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    try:

        def plan(name: str, params: dict[str, Any]) -> list[str]:
            return [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql[name], params)]

        assert "SCAN outbox USING COVERING INDEX outbox_status_idx" in plan(
            "counts_tally", {"now": 0.0}
        )
        wanted = {f"list_{status.lower()}": True for status in outboxer.Status}
        listed = plan("list", {**wanted, "limit": 50})
        assert not any(step.startswith("SCAN outbox") for step in listed), listed
        assert sum("USING INDEX outbox_status_idx" in step for step in listed) == 4
        assert sum("USING INDEX outbox_finished_idx" in step for step in listed) == 1
        assert not any(step.startswith("SCAN outbox") for step in plan("seq_range", {}))
        cleanup = plan("cleanup", {"status": "PUBLISHED", "now": 0.0, "retention": 0, "limit": 9})
        assert not any(step.startswith("SCAN outbox") for step in cleanup), cleanup
    finally:
        conn.close()


async def test_a_table_never_analysed_is_counted_row_by_row(pg_url: str) -> None:
    """No statistics yet (a new table): nothing to estimate from, so every count is exact."""
    store: Store = create_store(pg_url)
    store.exact_status_rows = 0
    async with store:
        enqueue(pg_url, 2)
        [entry] = await store.status()
        assert entry.counts == {"PENDING": 2} and not entry.published_estimated


def test_the_status_command_says_which_count_is_an_estimate(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from outboxer.cli import main as cli_main

    write_history(sqlite_url)
    enqueue(sqlite_url, 2)
    assert cli_main(["status", "--db", sqlite_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    published = [line.split() for line in lines if line.strip().startswith("PUBLISHED")]
    assert [words[-1] for words in published] == ["(estimated)", "(estimated)"], lines
    pending = [line.split() for line in lines if "PENDING" in line]
    assert pending == [["PENDING", "2"], ["PENDING", "0"]], "default, then partner: exact"
    assert cli_main(["status", "--db", sqlite_url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [entry["published_estimated"] for entry in report["destinations"]] == [True, True]
    assert report["destinations"][0]["counts"]["PENDING"] == 2
