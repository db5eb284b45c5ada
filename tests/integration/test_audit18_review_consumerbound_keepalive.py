"""The bounds set on the consumer's psycopg connections must not cut a handler's statement
that is slow on a server that is alive: the handler's statements are ``handler_timeout``'s.

libpq's ``tcp_user_timeout`` (set to about ``statement_timeout`` with the keepalives) also
ends a connection whose data stays unsent because the peer's receive window is closed
(tcp(7): "or buffered data may remain untransmitted (due to zero window size)"): a server
that stops reading while it waits, as a handler's COPY does when a row waits for another
transaction's lock, had its connection reset by the client's kernel once the bound passed
(measured: 2.5 s after the COPY began with a 2 s timeout) and the batch became an outage,
tried again and again. The keepalives alone tell a dead peer (their probes go only when
nothing is in flight, and an alive server's kernel answers them), never a slow one.

The fault: a transaction of the test holds a row of the table the handler copies into,
uncommitted, for longer than the bound; then it rolls back."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import psycopg

from outboxer.consumer_db import DaemonThreadPool, PsycopgSession, Result
from outboxer.receivers.base import Delivery
from tests.relaying import until

#: The consumer's bound, lowered: libpq's keepalives (and before, tcp_user_timeout) follow
#: it, in whole seconds, 2 at least.
BOUND = 1.0
#: How long the COPY waits for the lock: past the 2 s the kernel allowed before.
LOCKED_FOR = 3.5
#: Rows copied, 1 kB each: more than the socket buffers hold both ends (tcp_rmem's
#: maximum here is 32 MB), so that the client has data it cannot send while the server
#: waits.
ROWS = 60_000
PAD = "p" * 1000


def _copying_backend_waits(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE 'COPY%'"
        ).fetchone()
    return bool(row and row[0])


async def test_a_handlers_copy_waiting_on_a_lock_longer_than_the_bound_is_not_cut_off(
    pg_url: str,
) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE copied (k INT PRIMARY KEY, pad TEXT NOT NULL)")
    holder = psycopg.connect(pg_url)
    holder.execute("INSERT INTO copied VALUES (0, 'held')")  # the COPY's first row waits on it
    pool = DaemonThreadPool(1, thread_name_prefix="audit18-keepalive")
    session = PsycopgSession(pg_url, "outboxer", pool)
    session.statement_timeout = BOUND
    copied = threading.Event()

    def handler(delivery: Delivery, conn: Any) -> None:
        with conn.cursor() as cursor, cursor.copy("COPY copied (k, pad) FROM STDIN") as copy:
            for k in range(ROWS):
                copy.write_row((k, PAD))
        copied.set()

    async def release() -> None:
        await until(lambda: _copying_backend_waits(pg_url), "the COPY waits for the row", 8)
        # Not a synchronisation: how long the server stays busy is what is under test.
        await asyncio.sleep(LOCKED_FOR)
        holder.rollback()

    releasing = asyncio.create_task(release())
    delivery = Delivery(
        id=uuid.uuid4(),
        topic="t",
        key=None,
        headers={},
        payload={},
        body=b"{}",
        content_type="application/json",
    )
    try:
        await session.open()
        results = await session.apply("g", [delivery], handler, hold_keys=False)
        await releasing
    finally:
        releasing.cancel()
        holder.close()
        await session.close()
        pool.shutdown(wait=False)
    assert results == [Result.APPLIED]
    assert copied.is_set()
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT count(*) FROM copied").fetchone()
    assert row == (ROWS,)
