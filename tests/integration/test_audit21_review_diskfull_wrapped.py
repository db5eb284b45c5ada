"""A handler that meets the full disk and raises an error of its own in its place: in an
``except`` block without ``from`` (the database's error its ``__context__`` only), or with
``raise ... from None``. The attempt failed on the full database whatever the handler made of
it (on PostgreSQL the transaction is aborted besides): an outage as the bare error is, no
attempt counted, never dead-lettered for it.

Before, only ``__cause__`` was followed: such a handler's message was charged each try and
dead-lettered (max_attempts=2: every message of the outage), never applied.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.receivers.memory import group_state
from tests.chaos.servers import PrivatePostgres
from tests.diskfull import (  # noqa: F401 -- diskfull_postgres: a fixture
    diskfull_postgres,
    pg_database_on_tmpfs,
)
from tests.integration.test_audit21_diskfull_consumer import (
    PG_APPLIED,
    check_applied,
    messages,
    pg_applied,
    pg_dead_letters,
    ride_out,
)


class ApplyError(Exception):
    """A handler's own error."""


def implicit(message: Delivery, conn: Any) -> None:
    try:
        conn.execute(
            "INSERT INTO applied (message_id, k, n, pad) VALUES (%s, %s, %s, %s)",
            (str(message.id), message.key, message.payload["n"], message.payload["pad"]),
        )
    except psycopg.Error as exc:
        raise ApplyError(f"could not apply {message.id}: {exc}")  # noqa: B904 -- the point


def suppressed(message: Delivery, conn: Any) -> None:
    try:
        conn.execute(
            "INSERT INTO applied (message_id, k, n, pad) VALUES (%s, %s, %s, %s)",
            (str(message.id), message.key, message.payload["n"], message.payload["pad"]),
        )
    except psycopg.Error:
        raise ApplyError(f"could not apply {message.id}") from None


@pytest.mark.parametrize("handler", [implicit, suppressed], ids=["context", "from-None"])
async def test_audit21_review_a_wrapped_full_disk_error_is_an_outage(
    diskfull_postgres: PrivatePostgres,  # noqa: F811 -- the fixture
    handler: Any,
) -> None:
    with pg_database_on_tmpfs(diskfull_postgres) as (url, ballast):
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(PG_APPLIED)
        name = f"diskfull-{uuid.uuid4().hex[:8]}"
        broker = memory_broker(name)
        acked = group_state(name, "g").acked
        consumer = Consumer(
            db=url,
            broker=f"memory://{name}",
            group="g",
            handler=handler,
            concurrency=2,
            max_attempts=2,
        )
        sent = messages(pad="x" * 5000)
        await ride_out(consumer, broker, acked, ballast, sent, warm=True)
        check_applied(pg_applied(url), sent, warmups=1)
        assert pg_dead_letters(url) == 0
