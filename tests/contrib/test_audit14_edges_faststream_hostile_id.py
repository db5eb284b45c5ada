"""A hostile message id reaching the FastStream inbox middleware is logged bounded and escaped.

The id comes off the wire from any producer. The middleware's PayloadError (logged by
FastStream with its traceback) used to carry the whole id: a megabyte of it per delivery,
its newlines forging log lines once a plain formatter wrote them. Real RabbitMQ and
PostgreSQL; caplog sees what FastStream logs."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from faststream import AckPolicy, StreamMessage
from faststream.rabbit import RabbitBroker, RabbitQueue
from sqlalchemy.ext.asyncio import create_async_engine

from outboxer.contrib.faststream import InboxConnection, InboxMiddleware
from outboxer.errors import PayloadError
from tests.contrib.helpers import sqlalchemy_url
from tests.rabbit import AMQP_URL
from tests.services import require

#: A header frame must fit in RabbitMQ's frame_max (128 KiB): the megabyte id travels in the
#: body and a ``message_id=`` reader takes it from there, as an application's own may.
HOSTILE_ID = "not-a-uuid\n2026-01-01 ERROR forged line \x1b[31mred\x00" + "x" * 1_000_000


class PayloadErrorSeen(logging.Handler):
    """Wakes the test once FastStream logged the middleware's PayloadError."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and isinstance(record.exc_info[1], PayloadError):
            self.seen.set()


@pytest.fixture
async def service(pg_url: str) -> AsyncIterator[tuple[RabbitBroker, str, PayloadErrorSeen]]:
    require("rabbitmq")
    engine = create_async_engine(sqlalchemy_url(pg_url, asynchronous=True))
    queue = f"audit14-edges-{uuid.uuid4().hex[:10]}"

    def id_from_body(message: StreamMessage[Any]) -> object:
        return message.body.decode()

    broker = RabbitBroker(
        AMQP_URL,
        # FastStream's own "faststream" logger does not propagate: caplog sees this one.
        logger=logging.getLogger("audit14.faststream"),
        middlewares=[InboxMiddleware("audit14-edges", engine.begin, message_id=id_from_body)],
    )
    handled: list[str] = []

    @broker.subscriber(RabbitQueue(queue, auto_delete=True), ack_policy=AckPolicy.NACK_ON_ERROR)
    async def handle(body: str, conn: InboxConnection) -> None:
        handled.append(body)

    watcher = PayloadErrorSeen()
    logging.getLogger().addHandler(watcher)
    await broker.start()
    try:
        yield broker, queue, watcher
        assert handled == []
    finally:
        logging.getLogger().removeHandler(watcher)
        await broker.stop()
        await engine.dispose()


async def test_a_hostile_id_is_logged_bounded_and_escaped(
    service: tuple[RabbitBroker, str, PayloadErrorSeen], caplog: pytest.LogCaptureFixture
) -> None:
    broker, queue, watcher = service
    caplog.set_level(logging.INFO)
    await broker.publish(HOSTILE_ID.encode(), queue)
    await asyncio.wait_for(watcher.seen.wait(), 8)
    formatter = logging.Formatter("%(levelname)s %(name)s %(message)s")
    records = [record for record in caplog.records if record.exc_info or "id" in record.message]
    assert records, "nothing was logged about the rejected message"
    for record in records:
        line = formatter.format(record)
        error = record.exc_info[1] if record.exc_info else None
        shown = str(error) if error is not None else record.getMessage()
        assert len(shown) < 300, f"{record.name} logged {len(shown)} characters of the id"
        for raw in ("\n", "\x1b", "\x00"):
            assert raw not in shown, f"{record.name} logged a raw {raw!r}"
        # The formatted line (traceback included) stays a few screens, not a megabyte.
        assert len(line) < 20_000, f"{record.name} wrote a {len(line)}-character record"
