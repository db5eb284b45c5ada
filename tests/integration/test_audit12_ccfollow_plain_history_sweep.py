"""After ``outboxer schema migrate-partitioned`` the old table stays as ``<table>_plain``
with its PUBLISHED history (and copies of the rows moved), to be dropped by the operator once
past retention. The claim-check sweep never asked it: the first sweep after the move (the
relay's cleanup, ``outboxer claim-check sweep``) deleted the objects of every message
published before it, minutes old or not, which consumers still behind then failed to fetch
(ObjectNotFoundError, a dead letter that no replay can apply). The sweep now counts the
rows of ``<table>_plain`` while it exists.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg

from outboxer.claimcheck import HEADER_CLAIM_CHECK, ClaimCheck, FileObjectStore, fetch_payload
from outboxer.enqueue import Outbox
from outboxer.message import Message
from outboxer.payload_admin import payload_table
from outboxer.stores.postgres import PostgresStore


def test_the_sweep_keeps_the_objects_of_the_history_left_in_plain(
    pg_url: str, tmp_path: Path
) -> None:
    store = FileObjectStore(tmp_path / "claims")
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=100))
    with psycopg.connect(pg_url) as conn:
        published = outbox.enqueue(conn, "orders", {"blob": "p" * 500})
        pending = outbox.enqueue(conn, "orders", {"blob": "q" * 500})
        conn.execute(
            "UPDATE outboxer.outbox SET status = 'PUBLISHED' WHERE id = %s", (published.id,)
        )
        conn.commit()
        orphan = outbox.enqueue(conn, "orders", {"blob": "r" * 500})
        conn.rollback()
        headers = {
            row[0]: row[1]
            for row in conn.execute("SELECT id, headers FROM outboxer.outbox").fetchall()
        }
    assert len(list(store.list_objects())) == 3

    report = asyncio.run(PostgresStore(pg_url).migrate_to_partitioned())
    assert report.moved == 1  # the PENDING row; the PUBLISHED one stays in outbox_plain

    with payload_table(pg_url) as table:
        # grace=0: every object is old enough, as each is once the grace has passed.
        assert table.sweep(store, grace=0) == 1  # the rolled-back enqueue's, only

    left = {stored.name for stored in store.list_objects()}
    assert left == {
        headers[published.id][HEADER_CLAIM_CHECK],
        headers[pending.id][HEADER_CLAIM_CHECK],
    }
    assert not any(name.startswith(str(orphan.id)) for name in left)
    for sent in (published, pending):
        reference = Message(id=sent.id, topic="orders", payload=b"", headers=headers[sent.id])
        assert fetch_payload(reference, store).payload == sent.payload

    # Once the operator drops the history, its objects go at the next sweep (the moved
    # row's stays: the partitioned table refers to it).
    with psycopg.connect(pg_url) as conn:
        conn.execute("DROP TABLE outboxer.outbox_plain")
    with payload_table(pg_url) as table:
        assert table.sweep(store, grace=0) == 1
    assert {stored.name for stored in store.list_objects()} == {
        headers[pending.id][HEADER_CLAIM_CHECK]
    }


def test_the_sweep_asks_plains_index(pg_url: str) -> None:
    """The history table keeps migration 0011's index, renamed: the sweep's question to it
    is no scan of the whole history per page."""
    asyncio.run(PostgresStore(pg_url).migrate_to_partitioned())
    with psycopg.connect(pg_url) as conn:
        indexes = [
            row[0]
            for row in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE schemaname = 'outboxer' "
                "AND tablename = 'outbox_plain'"
            )
        ]
    assert "outbox_plain_claim_check_idx" in indexes, indexes
