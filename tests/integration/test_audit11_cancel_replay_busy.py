"""A dead-letter replay cut short (Ctrl-C) while its sync handler still runs in its thread
ends at once and commits nothing.

Its ``finally`` closed the session, and the close, submitted to the replay's one thread,
queued behind the handler: the cancelled replay waited for the handler however long it
took (with more threads, the close ran under it). The session is now left to its thread,
marked so that it never commits: the dead letter stays, to be replayed again.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import psycopg

from outboxer.consumer import Consumer, Delivery
from tests.integration.test_audit10_replaydl_reads import insert_letters, remaining
from tests.integration.test_consumer_handler_errors import (
    FAST,
    pg_db,  # noqa: F401 -- the fixture below asks for it
)


def test_a_replay_cancelled_during_a_sync_handler_ends_at_once_and_commits_nothing(
    pg_db: str,  # noqa: F811
) -> None:
    message_id = uuid.uuid4()
    insert_letters(pg_db, [("g", message_id, "k", 1)])
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def handler(message: Delivery, conn: Any) -> None:
        try:
            started.set()
            release.wait(30)
            conn.execute(
                "INSERT INTO applied (message_id, key, n, attempt) VALUES (%s, %s, %s, %s)",
                (str(message.id), message.key, message.payload["n"], message.attempt),
            )
        finally:
            finished.set()

    consumer = Consumer(
        db=pg_db, broker=None, group="g", handler=handler, backoff=FAST, concurrency=1
    )

    async def run() -> float:
        loop = asyncio.get_running_loop()
        replay = asyncio.create_task(consumer.replay_dead_letters())
        while not started.is_set():
            await asyncio.sleep(0.01)
        cancelled_at = loop.time()
        replay.cancel()
        await asyncio.wait_for(asyncio.gather(replay, return_exceptions=True), 10)
        return loop.time() - cancelled_at

    try:
        took = asyncio.run(run())
        assert not finished.is_set(), "the handler was still running when the replay ended"
        assert took < 1.0, f"the cancelled replay waited {took:.1f}s for its handler"
    finally:
        release.set()
    assert finished.wait(10)
    # The thread's transaction ends without a commit: the dead letter stays, nothing is
    # applied (read once no transaction is open, so an uncommitted change cannot hide).
    for _ in range(100):
        if not _open_transactions(pg_db):
            break
        threading.Event().wait(0.1)
    assert not _open_transactions(pg_db)
    assert remaining(pg_db, "g") == [(str(message_id), 1)]
    with psycopg.connect(pg_db) as conn:
        assert conn.execute("SELECT count(*) FROM applied").fetchone() == (0,)


def _open_transactions(db: str) -> int:
    with psycopg.connect(db) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
            "AND state <> 'idle'"
        ).fetchone()
    assert row is not None
    return int(row[0])
