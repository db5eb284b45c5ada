"""The claim-check sweep's ``referenced`` query reads an index, not the whole outbox table.

It runs once per page of up to 1,000 objects at every cleanup; on a table with a long
PUBLISHED history a sequential scan there costs a pass over every row per page.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest

from outboxer.claimcheck import ObjectName, object_name
from outboxer.payload_admin import PayloadTable
from outboxer.stores.sqlfiles import to_pyformat

ROWS = 30_000


def fill(url: str) -> list[str]:
    """ROWS PUBLISHED rows, one in 20 claim-checked; the names of those claim-checked."""
    with psycopg.connect(url) as conn:
        conn.execute(
            """
            INSERT INTO outboxer.outbox (id, topic, payload, content_type, headers, status)
            SELECT gen_random_uuid(), 't', '', 'application/json',
                   CASE WHEN g %% 20 = 0
                        THEN jsonb_build_object('outboxer-claim-check',
                                                'x.' || md5(g::text), 'traceparent', md5(g::text))
                        ELSE jsonb_build_object('traceparent', md5(g::text)) END,
                   'PUBLISHED'
            FROM generate_series(1, %s) AS g
            """,
            (ROWS,),
        )
        conn.execute("ANALYZE outboxer.outbox")
        return [
            row[0]
            for row in conn.execute(
                "SELECT headers->>'outboxer-claim-check' FROM outboxer.outbox "
                "WHERE headers ? 'outboxer-claim-check' LIMIT 10"
            )
        ]


def plan(url: str, names: list[str]) -> Any:
    with psycopg.connect(url) as conn:
        table = PayloadTable(conn, "postgres")
        sql = to_pyformat(table._sql["referenced"])
        [(explained,)] = conn.execute(f"EXPLAIN (FORMAT JSON) {sql}", {"names": names})
        return explained


def scans(node: Any) -> list[tuple[str, str | None]]:
    found = [(node["Node Type"], node.get("Relation Name"))]
    for child in node.get("Plans", []):
        found += scans(child)
    return found


def seq_scans_of_tables_with_rows(conn: psycopg.Connection[Any], plan: Any) -> list[str | None]:
    """The relations ``plan`` (EXPLAIN's JSON) reads with a Seq Scan, leaving out those with no
    rows (a partition still empty, the days to come, is scanned for free)."""
    return [
        relation
        for kind, relation in scans(plan)
        if kind == "Seq Scan"
        and conn.execute(
            "SELECT reltuples > 0 FROM pg_class WHERE oid = to_regclass(%s)",
            (f"outboxer.{relation}",),
        ).fetchone()[0]
    ]


@pytest.mark.parametrize("layout", ["pg_url", "pg_partitioned_url"])
def test_the_sweeps_referenced_query_uses_an_index(
    layout: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(layout)
    present = fill(url)
    names = present + [object_name(uuid.uuid4(), "default") for _ in range(990)]
    explained = plan(url, names)
    with psycopg.connect(url) as conn:
        scanned = seq_scans_of_tables_with_rows(conn, explained[0]["Plan"])
    assert scanned == [], json.dumps(scans(explained[0]["Plan"]))

    # And it still answers right.
    with psycopg.connect(url) as conn:
        table = PayloadTable(conn, "postgres")
        parsed = [ObjectName(name, "", "") for name in names]
        assert sorted(table.referenced(parsed)) == sorted(present)


def test_the_sweeps_referenced_query_uses_an_index_on_sqlite(sqlite_url: str) -> None:
    import sqlite3

    from outboxer.stores.sqlite import sqlite_path

    conn = sqlite3.connect(sqlite_path(sqlite_url))
    try:
        conn.execute(
            """
            WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 5000)
            INSERT INTO outbox (id, topic, payload, content_type, headers, status)
            SELECT lower(hex(randomblob(16))), 't', x'', 'application/json',
                   CASE WHEN n % 20 = 0
                        THEN json_object('outboxer-claim-check', 'x.' || n)
                        ELSE json_object('traceparent', 'p' || n) END,
                   'PUBLISHED'
            FROM g
            """
        )
        conn.commit()
        table = PayloadTable(conn, "sqlite")
        names = ["x.20", "x.40"] + [object_name(uuid.uuid4(), "default") for _ in range(998)]
        sql = table._sql["referenced"]
        plan = [
            row[3]
            for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", {"names": json.dumps(names)})
        ]
        assert any("claim_check_idx" in step for step in plan), plan
        assert not any(step.startswith("SCAN outbox") for step in plan), plan
        parsed = [ObjectName(name, "", "") for name in names]
        assert sorted(table.referenced(parsed)) == ["x.20", "x.40"]
    finally:
        conn.close()
