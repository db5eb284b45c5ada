"""The FastStream inbox middleware on the real RabbitMQ and PostgreSQL: the relay's messages are
applied once, copies are acknowledged unapplied, a failed handler rolls back with its claim."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from faststream import AckPolicy, StreamMessage
from faststream.rabbit import ExchangeType, RabbitBroker, RabbitExchange, RabbitQueue, RabbitRouter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

import outboxer
from outboxer.contrib.faststream import InboxConnection, InboxMiddleware, outboxer_message_id
from tests.contrib.helpers import sqlalchemy_url
from tests.rabbit import AMQP_URL
from tests.services import require


@dataclass
class Shipping:
    """A shipping service on FastStream: one subscriber behind the inbox middleware."""

    engine: AsyncEngine
    exchange: RabbitExchange
    broker: RabbitBroker
    calls: list[dict[str, Any]] = field(default_factory=list)
    fail_once: set[int] = field(default_factory=set)
    #: The body of every delivery the middleware looked at, in order.
    seen: list[bytes] = field(default_factory=list)
    done: dict[int, asyncio.Event] = field(default_factory=dict)

    def handled(self, order_id: int) -> asyncio.Event:
        """Set once the transaction that applied ``order_id`` committed."""
        return self.done.setdefault(order_id, asyncio.Event())


@pytest.fixture
async def shipping(pg_url: str) -> AsyncIterator[Shipping]:
    require("rabbitmq")
    engine = create_async_engine(sqlalchemy_url(pg_url, asynchronous=True))
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE shipments (order_id int NOT NULL)"))
    name = f"test-{uuid.uuid4().hex[:10]}"
    exchange = RabbitExchange(name, type=ExchangeType.TOPIC, durable=True)
    broker = RabbitBroker(AMQP_URL)
    service = Shipping(engine, exchange, broker)

    def message_id(message: StreamMessage[Any]) -> object:
        service.seen.append(message.body)
        return outboxer_message_id(message)

    @contextlib.asynccontextmanager
    async def transaction() -> AsyncIterator[AsyncConnection]:
        applied: list[int] = []
        async with engine.begin() as conn:
            conn.info["orders"] = applied
            yield conn
        for order_id in applied:  # committed: now the test may look
            service.handled(order_id).set()

    middleware = InboxMiddleware("shipping", transaction, message_id=message_id)
    router = RabbitRouter(middlewares=[middleware])

    @router.subscriber(
        RabbitQueue(name, auto_delete=True, routing_key="order.*"),
        exchange,
        ack_policy=AckPolicy.NACK_ON_ERROR,
    )
    async def ship(order: dict[str, Any], conn: InboxConnection) -> None:
        assert isinstance(conn, AsyncConnection)
        await conn.execute(text("INSERT INTO shipments VALUES (:id)"), {"id": order["id"]})
        service.calls.append(order)
        if order["id"] in service.fail_once:
            service.fail_once.discard(order["id"])
            raise RuntimeError("the warehouse is not answering: roll back, deliver again")
        conn.info["orders"].append(order["id"])

    broker.include_router(router)
    await broker.start()
    try:
        yield service
    finally:
        await broker.stop()
        await engine.dispose()
        import aio_pika

        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            await (await connection.channel()).exchange_delete(name)


async def relay_once(pg_url: str, exchange: str) -> None:
    settings = outboxer.load_settings(
        {"db": pg_url, "broker": f"{AMQP_URL}?exchange={exchange}", "exit_when_idle": True}
    )
    await outboxer.Relay.from_settings(settings).run()


def enqueue_orders(pg_url: str, *order_ids: int) -> list[outboxer.Message]:
    with psycopg.connect(pg_url) as conn:
        return [
            outboxer.enqueue(conn, "order.placed", {"id": n}, key=f"order-{n}") for n in order_ids
        ]


async def shipments(engine: AsyncEngine) -> list[int]:
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT order_id FROM shipments ORDER BY order_id"))
        return [row[0] for row in rows]


async def publish_copy(service: Shipping, order_id: int, message_id: object | None) -> None:
    """What a broker's redelivery or a relay's second publish looks like to the consumer."""
    headers = {"outboxer-id": str(message_id)} if message_id is not None else {}
    await service.broker.publish(
        json.dumps({"id": order_id}).encode(),
        exchange=service.exchange,
        routing_key="order.placed",
        headers=headers,
        content_type="application/json",
    )


async def test_relayed_messages_apply_once_and_copies_are_skipped(
    pg_url: str, shipping: Shipping
) -> None:
    first, second = enqueue_orders(pg_url, 1, 2)
    await relay_once(pg_url, shipping.exchange.name)
    for order_id in (1, 2):  # two keys: the relay may publish them in either order
        await asyncio.wait_for(shipping.handled(order_id).wait(), 20)
    await publish_copy(shipping, 1, first.id)  # a duplicate delivery
    await publish_copy(shipping, 2, second.id)
    await publish_copy(shipping, 3, uuid.uuid4())  # behind the copies in the one queue
    await asyncio.wait_for(shipping.handled(3).wait(), 20)
    assert sorted(call["id"] for call in shipping.calls) == [1, 2, 3], "the copies never ran"
    assert await shipments(shipping.engine) == [1, 2, 3]
    with psycopg.connect(pg_url) as conn:
        recorded = conn.execute("SELECT message_id FROM outboxer.inbox").fetchall()
    assert {row[0] for row in recorded} >= {first.id, second.id}


async def test_a_failed_handler_rolls_back_its_writes_and_its_claim(
    pg_url: str, shipping: Shipping
) -> None:
    shipping.fail_once.add(1)
    [message] = enqueue_orders(pg_url, 1)
    await relay_once(pg_url, shipping.exchange.name)
    await asyncio.wait_for(shipping.handled(1).wait(), 20)  # NACK_ON_ERROR: delivered again
    assert [call["id"] for call in shipping.calls] == [1, 1]
    assert await shipments(shipping.engine) == [1], "the failed attempt's insert rolled back"
    with psycopg.connect(pg_url) as conn:
        [(recorded,)] = conn.execute("SELECT message_id FROM outboxer.inbox").fetchall()
    assert recorded == message.id


async def test_a_message_without_an_outbox_id_is_rejected(pg_url: str, shipping: Shipping) -> None:
    await publish_copy(shipping, 7, None)
    await publish_copy(shipping, 8, "not-a-uuid")
    await publish_copy(shipping, 9, uuid.uuid4())
    await asyncio.wait_for(shipping.handled(9).wait(), 20)
    await publish_copy(shipping, 10, uuid.uuid4())  # time for a requeued one to come back
    await asyncio.wait_for(shipping.handled(10).wait(), 20)
    assert [call["id"] for call in shipping.calls] == [9, 10]
    assert [json.loads(body)["id"] for body in shipping.seen] == [7, 8, 9, 10], (
        "rejected, not requeued, although the policy is NACK_ON_ERROR"
    )


def test_consumer_name_is_checked_where_the_middleware_is_built() -> None:
    with pytest.raises(outboxer.PayloadError):
        InboxMiddleware("", lambda: None)  # type: ignore[arg-type, return-value]
