"""The consumer (PyMySQL sessions) when MariaDB's fence (``SET GLOBAL read_only``) meets a
handler's write after its message's inbox claim, and the handler raises its own error from
the driver's 1290 (``raise ... from exc``, as a repository layer or SQLAlchemy does): the
database's failure (its server read-only now), no attempt counted, as for the driver's
error itself (test_audit20_myreadonly_consumer.py).

Before, the runner saw the handler's own error: ``_read_only_answer`` found the 1290 under
it and made the batch's failure the commit's, but the commit's failure was then judged by
the handler's error alone, which is no lost connection: charged to the message, and with
``max_attempts=1`` its dead letter, its handler never having failed for itself.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pymysql

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.testing import make_message
from tests.integration.test_audit20_myreadonly_consumer import (
    REDIS,
    _delete_stream,
    applied,
    dead_letters,
    pair,
)
from tests.integration.test_audit20_myreadonly_failover import Pair, sql
from tests.relaying import until

__all__ = ["pair"]  # the fixture: two private MariaDB servers behind a proxy


class RecordingFailed(RuntimeError):
    """A handler's own error, raised from the driver's."""


async def test_a_fenced_write_under_the_handlers_own_error_costs_no_attempt(pair: Pair) -> None:
    topic = f"audit20-rofw-{uuid.uuid4().hex[:10]}"
    fenced: list[str] = []

    def fence_then_write(delivery: Delivery, conn: Any) -> None:
        if not fenced:
            fenced.append(str(delivery.id))
            sql(pair.old, "SET GLOBAL read_only = ON")  # after this message's inbox claim
        try:
            with conn.cursor() as cursor:
                cursor.execute("INSERT INTO applied (id) VALUES (%s)", (str(delivery.id),))
        except pymysql.Error as exc:
            raise RecordingFailed(f"recording {delivery.id} failed") from exc

    consumer = Consumer(
        db=pair.url(),
        broker=REDIS,
        group=f"g-{uuid.uuid4().hex[:8]}",
        topics=[topic],
        handler=fence_then_write,
        concurrency=1,
        max_attempts=1,
    )
    running = asyncio.create_task(consumer.run_async())
    try:
        message = make_message(topic, {"n": 1})
        async with create_publisher(REDIS) as publisher:
            assert all(o.published for o in await publisher.publish_batch([message]))
        await until(lambda: bool(fenced), "the handler never ran", 10)
        await until(
            lambda: consumer.stats.database_errors >= 2 or consumer.stats.failed > 0,
            "neither an outage nor a failure",
            5,
        )
        sql(pair.old, "SET GLOBAL read_only = OFF")
        await until(
            lambda: applied(pair.old) == {str(message.id)} or bool(dead_letters(pair.old)),
            "the fenced message was neither applied nor dead-lettered",
            5,
        )
        assert dead_letters(pair.old) == [], "dead-lettered for the fence"
        assert applied(pair.old) == {str(message.id)}
        assert consumer.stats.failed == 0, consumer.stats
    finally:
        consumer.stop()
        await asyncio.wait_for(running, 20)
        await _delete_stream(topic)
