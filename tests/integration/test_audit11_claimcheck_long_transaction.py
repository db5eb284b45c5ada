"""The orphan sweep against the real PostgreSQL outbox while an enqueuing transaction is
still open for longer than the grace period: its object is kept, and the row it commits
later still fetches; once it has ended, orphans are swept as before."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import psycopg

from outboxer import Outbox
from outboxer.claimcheck import HEADER_CLAIM_CHECK, ClaimCheck, FileObjectStore, fetch_payload
from outboxer.payload_admin import payload_table

BIG = {"blob": "x" * 10_000}


def age(store: FileObjectStore, name: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(store.directory / name, (then, then))


def test_the_sweep_keeps_the_object_of_a_transaction_open_longer_than_the_grace(
    pg_url: str, tmp_path: Path
) -> None:
    store = FileObjectStore(tmp_path / "claims")
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=1000))
    long_running = psycopg.connect(pg_url)
    try:
        message = outbox.enqueue(long_running, "report.ready", BIG)  # transaction left open
        [name] = [stored.name for stored in store.list_objects()]
        # The put came 2 s ago; the sweep's grace is 1 s: by the clock alone it is an orphan.
        age(store, name, 2)
        with payload_table(pg_url) as table:
            assert table.sweep(store, grace=1.0) == 0
        assert [stored.name for stored in store.list_objects()] == [name]
        long_running.commit()
    finally:
        long_running.close()

    reader = psycopg.connect(pg_url)
    try:
        (headers,) = reader.execute(
            "SELECT headers FROM outboxer.outbox WHERE id = %s", (message.id,)
        ).fetchone()  # type: ignore[misc]
    finally:
        reader.close()
    assert headers[HEADER_CLAIM_CHECK] == name
    stored = replace(message, payload=b"", headers=headers)
    assert fetch_payload(stored, store).payload == message.payload

    # No transaction open any more: the orphan of a rolled-back enqueue is still swept.
    conn = psycopg.connect(pg_url)
    try:
        outbox.enqueue(conn, "report.ready", BIG)
        conn.rollback()
    finally:
        conn.close()
    [orphan] = [stored.name for stored in store.list_objects() if stored.name != name]
    age(store, orphan, 7200)
    with payload_table(pg_url) as table:
        assert table.sweep(store, grace=3600) == 1
    assert [stored.name for stored in store.list_objects()] == [name]
