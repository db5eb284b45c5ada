"""The claim-check sweep's question to the log mode's table (``<table>_log``) reads an index,
not every row the log retains: it runs once per page of up to 1,000 objects at every
cleanup, and was a sequential scan of each partition per page."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg

from outboxer.claimcheck import ObjectName, object_name
from outboxer.payload_admin import PayloadTable
from outboxer.stores.pglog import PgLog
from tests.integration.test_audit12_ccretain_sweep_index import (
    scans,
    seq_scans_of_tables_with_rows,
)

ROWS = 30_000


class _Explaining:
    """A psycopg connection whose statements on the log are EXPLAINed before they run."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.plans: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    def cursor(self) -> Any:
        cursor = self.conn.cursor()
        plans = self.plans

        class Cursor:
            def __getattr__(self, name: str) -> Any:
                return getattr(cursor, name)

            def execute(self, sql: str, params: Any = None) -> Any:
                if "outbox_log" in sql and sql.lstrip().upper().startswith("SELECT HEADERS"):
                    explain = self_conn.cursor()
                    explain.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
                    plans.append(explain.fetchone()[0])
                return cursor.execute(sql, params)

        self_conn = self.conn
        return Cursor()


async def test_the_sweeps_question_to_the_log_uses_an_index(pg_url: str) -> None:
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    with psycopg.connect(pg_url) as conn:
        conn.execute(
            """
            INSERT INTO outboxer.outbox_log (order_xid, id, topic, payload, content_type, headers)
            SELECT pg_current_xact_id(), gen_random_uuid(), 't', '', 'application/json',
                   CASE WHEN g %% 20 = 0
                        THEN jsonb_build_object('outboxer-claim-check',
                                                'x.' || md5(g::text), 'traceparent', md5(g::text))
                        ELSE jsonb_build_object('traceparent', md5(g::text)) END
            FROM generate_series(1, %s) AS g
            """,
            (ROWS,),
        )
        conn.execute("ANALYZE outboxer.outbox_log")
        present = [
            row[0]
            for row in conn.execute(
                "SELECT headers->>'outboxer-claim-check' FROM outboxer.outbox_log "
                "WHERE headers ? 'outboxer-claim-check' LIMIT 10"
            )
        ]
        conn.commit()
    names = present + [object_name(uuid.uuid4(), "default") for _ in range(990)]

    with psycopg.connect(pg_url) as conn:
        explaining = _Explaining(conn)
        table = PayloadTable(explaining, "postgres")
        found = table.referenced([ObjectName(name, "", "") for name in names])
        # And it still answers right.
        assert sorted(found) == sorted(present)
        [plan] = explaining.plans
        scanned = seq_scans_of_tables_with_rows(conn, plan[0]["Plan"])
    assert scanned == [], json.dumps(scans(plan[0]["Plan"]))
