"""Relays at work while bulk writes lock the outbox table (PostgreSQL, RabbitMQ).

An ``enqueue_many`` of more keys than ``Outbox.max_key_locks`` holds the table lock until
it commits (queries.sql: table_lock): the relays' claims, settles and lease renewals wait
for it, and so do writers of single messages. Nothing may be lost or left PROCESSING, and
each key's messages must reach the consumer in the key's commit order.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from typing import Any

import psycopg

import outboxer
from outboxer import Relay, load_settings
from outboxer.enqueue import Outbox
from tests.rabbit import RabbitConsumer

KEYS = 400
BULK_ROUNDS = 3
SINGLES = 300


def _bulk_writer(url: str, errors: list[BaseException]) -> None:
    outbox = Outbox(max_key_locks=100)  # 400 keys a write: the table lock
    try:
        with psycopg.connect(url) as conn:
            for round_ in range(BULK_ROUNDS):
                outbox.enqueue_many(
                    conn,
                    [
                        {"topic": "t", "payload": {"writer": "bulk", "n": round_}, "key": f"k{k}"}
                        for k in range(KEYS)
                    ],
                )
                time.sleep(0.3)  # the transaction stays open: relays and writers wait
                conn.commit()
                time.sleep(0.1)
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def _single_writer(url: str, seed: int, errors: list[BaseException]) -> None:
    rnd = random.Random(seed)
    try:
        with psycopg.connect(url) as conn:
            for n in range(SINGLES):
                key = f"k{rnd.randrange(KEYS)}"
                outboxer.enqueue(conn, "t", {"writer": f"single-{seed}", "n": n}, key=key)
                conn.commit()
                time.sleep(0.002)
    except BaseException as exc:
        errors.append(exc)


async def test_relays_and_writers_around_bulk_writes_keep_every_message_in_key_order(
    pg_url: str, rabbit_consumer: RabbitConsumer
) -> None:
    relays = [
        Relay.from_settings(
            load_settings(
                {
                    "db": pg_url,
                    "broker": rabbit_consumer.broker_url,
                    "poll_interval": 0.2,
                    "batch_size": 50,
                    "concurrency": 2,
                    "relay_id": f"relay-{n}",
                },
                environ={},
            )
        )
        for n in range(2)
    ]
    running = [asyncio.create_task(relay.run()) for relay in relays]
    errors: list[BaseException] = []
    writers = [threading.Thread(target=_bulk_writer, args=(pg_url, errors))] + [
        threading.Thread(target=_single_writer, args=(pg_url, seed, errors)) for seed in (1, 2)
    ]
    for thread in writers:
        thread.start()
    while any(thread.is_alive() for thread in writers):
        await asyncio.sleep(0.05)
    assert errors == []
    total = BULK_ROUNDS * KEYS + 2 * SINGLES
    delivered = await rabbit_consumer.wait_for(total, timeout=60)
    for relay in relays:
        relay.stop()
    await asyncio.wait_for(asyncio.gather(*running), 30)

    with psycopg.connect(pg_url) as conn:
        stored = conn.execute(
            "SELECT id::text, key, status, convert_from(payload, 'UTF8') "
            "FROM outboxer.outbox ORDER BY seq"
        ).fetchall()
    assert len(stored) == total
    assert {status for _, _, status, _ in stored} == {"PUBLISHED"}, "none left PROCESSING"
    assert sorted(d.message_id for d in delivered) == sorted(i for i, _, _, _ in stored)

    def by_key(ids: list[tuple[str, str]]) -> dict[str, list[str]]:
        keyed: dict[str, list[str]] = {}
        for key, message_id in ids:
            keyed.setdefault(key, []).append(message_id)
        return keyed

    key_of = {i: key for i, key, _, _ in stored}
    in_seq_order = by_key([(key, i) for i, key, _, _ in stored])
    as_delivered = by_key([(key_of[d.message_id], d.message_id) for d in delivered])
    assert as_delivered == in_seq_order, "each key's messages delivered in seq order"
    # seq order is each key's commit order: every writer's own messages of a key ascend.
    payloads: dict[str, Any] = {i: json.loads(p) for i, _, _, p in stored}
    for ids in in_seq_order.values():
        seen: dict[str, int] = {}
        for message_id in ids:
            body = payloads[message_id]
            assert body["n"] > seen.get(body["writer"], -1), (body, seen)
            seen[body["writer"]] = body["n"]
