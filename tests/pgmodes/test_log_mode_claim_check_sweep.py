"""The claim-check orphan sweep on PostgreSQL counts the log mode's rows as references."""

from __future__ import annotations

from pathlib import Path

import psycopg

from outboxer.claimcheck import HEADER_CLAIM_CHECK, ClaimCheck, FileObjectStore, fetch_payload
from outboxer.enqueue import Outbox
from outboxer.message import Message
from outboxer.payload_admin import payload_table
from outboxer.stores.pglog import PgLog


async def test_the_sweep_keeps_the_objects_of_log_mode_rows(pg_url: str, tmp_path: Path) -> None:
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    store = FileObjectStore(tmp_path / "claims")
    outbox = Outbox(mode="log", claim_check=ClaimCheck(store, threshold=100))
    with psycopg.connect(pg_url) as conn:
        kept = outbox.enqueue(conn, "orders", {"blob": "x" * 500})
        conn.commit()
        rolled_back = outbox.enqueue(conn, "orders", {"blob": "y" * 500})
        conn.rollback()
        (headers,) = conn.execute(
            "SELECT headers FROM outboxer.outbox_log WHERE id = %s", (kept.id,)
        ).fetchone()
    assert len(list(store.list_objects())) == 2

    with payload_table(pg_url) as table:
        # grace=0: every object is old enough, as each is once the grace has passed.
        assert table.sweep(store, grace=0) == 1

    # The rolled-back enqueue's object is gone; the committed log row's object stays.
    (left,) = [stored.name for stored in store.list_objects()]
    assert left == headers[HEADER_CLAIM_CHECK]
    assert not left.startswith(str(rolled_back.id))
    reference = Message(id=kept.id, topic="orders", payload=b"", headers=headers)
    assert fetch_payload(reference, store).payload == kept.payload


def test_the_sweep_works_without_log_mode_tables(pg_url: str, tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "claims")
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=100))
    with psycopg.connect(pg_url) as conn:
        outbox.enqueue(conn, "orders", {"blob": "x" * 500})
        conn.commit()
        outbox.enqueue(conn, "orders", {"blob": "y" * 500})
        conn.rollback()
    with payload_table(pg_url) as table:
        assert table.sweep(store, grace=0) == 1
        assert table.sweep(store, grace=0) == 0
    assert len(list(store.list_objects())) == 1
