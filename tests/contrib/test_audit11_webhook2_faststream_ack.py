"""FastStream's AckMessage, NackMessage and RejectMessage raised in an inboxed handler.

AckMessage is the handler saying "done, acknowledge it": its writes and the inbox claim
used to roll back (the middleware's transaction saw an exception) before FastStream acked,
so the message was acknowledged, never applied and never delivered again. They commit now,
then FastStream acknowledges, and a copy is skipped. NackMessage and RejectMessage (and
SkipMessage) still roll back: the message is not done. FastStream's TestRabbitBroker (the
whole middleware stack, in process) and PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from faststream import AckPolicy
from faststream.exceptions import AckMessage, NackMessage, RejectMessage, SkipMessage
from faststream.rabbit import RabbitBroker, TestRabbitBroker
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outboxer.contrib.faststream import InboxConnection, InboxMiddleware
from tests.contrib.helpers import sqlalchemy_url


@pytest.fixture
async def engine(pg_url: str) -> AsyncIterator[AsyncEngine]:
    made = create_async_engine(sqlalchemy_url(pg_url, asynchronous=True))
    async with made.begin() as conn:
        await conn.execute(text("CREATE TABLE audit11_fs_shipments (order_id int NOT NULL)"))
    try:
        yield made
    finally:
        await made.dispose()


async def state(engine: AsyncEngine) -> tuple[list[int], list[str]]:
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT order_id FROM audit11_fs_shipments"))
        inbox = await conn.execute(
            text("SELECT message_id::text FROM outboxer.inbox WHERE consumer = 'shipping'")
        )
        return sorted(row[0] for row in rows), sorted(row[0] for row in inbox)


def service(
    engine: AsyncEngine, raises: dict[int, BaseException]
) -> tuple[RabbitBroker, list[int]]:
    calls: list[int] = []
    broker = RabbitBroker(middlewares=[InboxMiddleware("shipping", engine.begin)])

    @broker.subscriber("audit11-fs", ack_policy=AckPolicy.NACK_ON_ERROR)
    async def ship(order: dict[str, Any], conn: InboxConnection) -> None:
        calls.append(order["id"])
        await conn.execute(
            text("INSERT INTO audit11_fs_shipments VALUES (:id)"), {"id": order["id"]}
        )
        error = raises.pop(order["id"], None)
        if error is not None:
            raise error

    return broker, calls


async def publish(broker: RabbitBroker, order_id: int, message_id: str) -> None:
    with contextlib.suppress(Exception):  # TestBroker re-raises what the handler raised
        await broker.publish(
            json.dumps({"id": order_id}).encode(),
            "audit11-fs",
            headers={"outboxer-id": message_id},
            content_type="application/json",
        )


async def test_ack_message_commits_the_handlers_writes_and_the_claim(
    engine: AsyncEngine,
) -> None:
    broker, calls = service(engine, {1: AckMessage()})
    message_id = str(uuid.uuid4())
    async with TestRabbitBroker(broker) as test:
        await publish(test, 1, message_id)
        assert await state(engine) == ([1], [message_id])
        await publish(test, 1, message_id)  # a copy: the inbox has it, the handler is not run
    assert calls == [1]
    assert await state(engine) == ([1], [message_id])


@pytest.mark.parametrize("error", [NackMessage(), RejectMessage(), SkipMessage()])
async def test_nack_reject_and_skip_roll_back(engine: AsyncEngine, error: Exception) -> None:
    broker, calls = service(engine, {2: error})
    message_id = str(uuid.uuid4())
    async with TestRabbitBroker(broker) as test:
        await publish(test, 2, message_id)
        assert await state(engine) == ([], [])
        await publish(test, 2, message_id)  # the redelivery applies it
    assert calls == [2, 2]
    assert await state(engine) == ([2], [message_id])
