"""The shipping service: FastStream on RabbitMQ. Each ``order.placed`` ships once: the inbox
middleware claims the message id in the same transaction as the shipment.

Run: ``SHIPPING_DB_URL=postgresql+asyncpg://… AMQP_URL=… EXCHANGE=… QUEUE=… python
shipping_service.py`` (run.py does). Prints ``shipping service ready`` once consuming.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.rabbit import ExchangeType, RabbitBroker, RabbitExchange, RabbitQueue, RabbitRouter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from outboxer.contrib.faststream import InboxConnection, InboxMiddleware

engine = create_async_engine(os.environ["SHIPPING_DB_URL"])
events = RabbitExchange(os.environ["EXCHANGE"], type=ExchangeType.TOPIC, durable=True)
router = RabbitRouter(middlewares=[InboxMiddleware("shipping", engine.begin)])


@router.subscriber(
    RabbitQueue(os.environ["QUEUE"], durable=True, routing_key="order.placed"),
    events,
    ack_policy=AckPolicy.NACK_ON_ERROR,  # a failed shipment rolls back and comes again
)
async def ship(order: dict[str, Any], conn: InboxConnection) -> None:
    # No unique key on order_id on purpose: only the inbox keeps an order from shipping twice.
    await conn.execute(
        text("INSERT INTO shipments (order_id, customer) VALUES (:id, :customer)"),
        {"id": order["id"], "customer": order["customer"]},
    )


broker = RabbitBroker(os.environ["AMQP_URL"])
broker.include_router(router)
app = FastStream(broker)


@app.after_startup
async def ready() -> None:
    print("shipping service ready", flush=True)


if __name__ == "__main__":
    # outboxer's INFO lines say when the inbox skipped a copy.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(app.run())
