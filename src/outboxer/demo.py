"""``outboxer demo``: the pattern end to end, with nothing to install or start.

An order service writes orders to SQLite and enqueues an event in the same
transaction; one order fails half-way and rolls back. The relay then publishes
to a JSON-lines file (the "broker"), and the shipping consumer (``outboxer.Consumer``
with the ``file://`` receiver) applies each event once through the inbox, although
one event is delivered twice.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

from outboxer.config import Settings, load_settings
from outboxer.consumer import Consumer, Delivery
from outboxer.enqueue import enqueue
from outboxer.relay import Relay


def _say(text: str = "") -> None:
    print(text, flush=True)


def _place_order(
    conn: sqlite3.Connection, order_id: int, customer: str, total: float, fail: bool = False
) -> None:
    with conn:  # one transaction: the order row and its event commit or roll back together
        conn.execute(
            "INSERT INTO orders (id, customer, total) VALUES (?, ?, ?)", (order_id, customer, total)
        )
        enqueue(
            conn,
            "order.placed",
            {"order_id": order_id, "customer": customer, "total": total},
            key=customer,
            headers={"source": "demo"},
        )
        if fail:
            raise RuntimeError("payment service timed out")


def run_demo(directory: str) -> int:
    folder = Path(directory).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    db_path, events_path = folder / "demo.db", folder / "events.jsonl"
    offsets = folder / "events.jsonl.shipping.offset"
    for stale in (db_path, events_path, offsets, folder / "demo.db-wal", folder / "demo.db-shm"):
        stale.unlink(missing_ok=True)
    db_url, broker_url = f"sqlite:///{db_path}", f"file://{events_path}"

    _say(f"outboxer demo: database {db_path}\n               broker   {events_path}\n")
    settings = load_settings({"db": db_url, "broker": broker_url, "poll_interval": 0.1}, environ={})
    asyncio.run(_apply_schema(settings))

    conn = sqlite3.connect(db_path)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT, total REAL)")
    conn.execute("CREATE TABLE shipments (order_id INTEGER NOT NULL)")
    conn.commit()
    _say("1. The order service writes an order and its event in one transaction:")
    for order_id, customer, total in ((1, "alice", 30.0), (2, "bob", 12.5), (3, "alice", 7.25)):
        _place_order(conn, order_id, customer, total)
        _say(f"   order {order_id} for {customer}: committed with its order.placed event")
    try:
        _place_order(conn, 4, "carol", 99.0, fail=True)
    except RuntimeError as exc:
        _say(f"   order 4 for carol: {exc} -> rolled back, and its event with it")
    orders = conn.execute("SELECT count(*) FROM orders").fetchone()[0]
    pending = conn.execute("SELECT count(*) FROM outbox WHERE status = 'PENDING'").fetchone()[0]
    _say(f"   orders in the table: {orders}; events waiting in the outbox: {pending}\n")

    _say("2. The relay claims the batch, publishes it and waits for the broker's confirmation:")
    stats = asyncio.run(Relay.from_settings(settings).drain())
    _say(f"   published {stats.published}, failed {stats.failed}\n")

    _say("3. The shipping consumer applies each event once (outboxer.Consumer: inbox + handler")
    _say("   in one transaction, ack after commit; alice's in order):")
    with events_path.open("a", encoding="utf-8") as broker:  # at least once: a redelivery
        broker.write(events_path.read_text("utf-8").splitlines(keepends=True)[0])

    def ship(event: Delivery, shipping_db: sqlite3.Connection) -> None:
        shipping_db.execute(
            "INSERT INTO shipments (order_id) VALUES (?)", (event.payload["order_id"],)
        )
        _say(f"   {event.id}  {event.topic}  key={event.key}  {json.dumps(event.payload)}")

    consumer = Consumer(
        db=db_url,
        broker=broker_url,
        group="shipping",
        handler=ship,
        concurrency=1,
        exit_when_idle=True,
    )
    consumed = asyncio.run(consumer.run_async())
    _say(f"   the first event came twice: {consumed.duplicates} duplicate skipped by the inbox")
    shipments = conn.execute("SELECT count(*) FROM shipments").fetchone()[0]
    _say(f"   shipments created: {shipments} (one per order, despite the duplicate)")

    rows = conn.execute("SELECT status, count(*) FROM outbox GROUP BY status").fetchall()
    conn.close()
    _say(f"\n4. The outbox now: {dict(rows)}. Run it again and nothing is sent twice.")
    again = asyncio.run(Relay.from_settings(settings).drain())
    _say(f"   second relay run published {again.published}.\n")
    _say("Next: point --db at PostgreSQL and --broker at RabbitMQ (see README.md).")
    return 0


async def _apply_schema(settings: Settings) -> None:
    from outboxer.stores import create_store

    async with create_store(settings.require_db()) as store:
        await store.apply_schema()
