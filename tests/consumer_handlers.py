"""Handlers that the consumer tests run, in this process or through `outboxer consume`.

Each writes one row per message it applies into ``applied`` (created by ``create_table``):
the message id, its key, the payload's ``n`` and the order of application (``position``).
A message applied twice would show as two rows.
"""

from __future__ import annotations

import os
import time
from typing import Any

from outboxer.consumer import Delivery

APPLIED_DDL = (
    "CREATE TABLE IF NOT EXISTS applied ("
    " position bigserial PRIMARY KEY, message_id uuid NOT NULL, key text, n integer NOT NULL,"
    " attempt integer NOT NULL)"
)
#: Seconds each handler call sleeps (env CONSUMER_TEST_SLEEP): room for a SIGKILL mid-handler.
SLEEP = float(os.environ.get("CONSUMER_TEST_SLEEP", "0"))


def record(message: Delivery, conn: Any) -> None:
    """Sync (psycopg) handler."""
    conn.execute(
        "INSERT INTO applied (message_id, key, n, attempt) VALUES (%s, %s, %s, %s)",
        (message.id, message.key, message.payload["n"], message.attempt),
    )
    if SLEEP:
        time.sleep(SLEEP)


async def record_async(message: Delivery, conn: Any) -> None:
    """Async (asyncpg) handler."""
    await conn.execute(
        "INSERT INTO applied (message_id, key, n, attempt) VALUES ($1, $2, $3, $4)",
        message.id,
        message.key,
        message.payload["n"],
        message.attempt,
    )


def fail_on_zero(message: Delivery, conn: Any) -> None:
    """Fails for ``n == 0`` until the environment says the bug is fixed."""
    if message.payload["n"] == 0 and not os.environ.get("CONSUMER_TEST_FIXED"):
        raise RuntimeError("n is zero")
    record(message, conn)


async def record_psycopg_async(message: Delivery, conn: Any) -> None:
    """Async handler on psycopg's AsyncConnection (async_driver="psycopg")."""
    await conn.execute(
        "INSERT INTO applied (message_id, key, n, attempt) VALUES (%s, %s, %s, %s)",
        (message.id, message.key, message.payload["n"], message.attempt),
    )
