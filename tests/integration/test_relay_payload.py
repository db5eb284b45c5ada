"""The relay with encrypted and claim-checked rows, on the real PostgreSQL and RabbitMQ: it
decrypts for one destination and forwards for another, a missing key abandons that message
while the relay keeps publishing, and retention removes claim-check objects."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import psycopg
import pytest

from outboxer import Outbox, Relay, load_settings
from outboxer.claimcheck import ClaimCheck, FileObjectStore, fetch_payload
from outboxer.crypto import KeyRing, decrypt, generate_key
from outboxer.message import Message
from outboxer.relay import cleanup
from outboxer.testing import eventually
from tests.rabbit import Delivered, RabbitConsumer
from tests.services import require

K1, K9 = generate_key(), generate_key()


def rows(pg_url: str) -> dict[tuple[str, str], tuple[str, int, str | None]]:
    with psycopg.connect(pg_url) as conn:
        found = conn.execute(
            "SELECT topic, destination, status, attempts, last_error FROM outboxer.outbox"
        ).fetchall()
    return {
        (topic, dest): (status, attempts, error) for topic, dest, status, attempts, error in found
    }


def as_message(delivered: Delivered) -> Message:
    headers = {name: str(value) for name, value in delivered.headers.items()}
    return Message(
        id=uuid.UUID(delivered.message_id),
        topic=delivered.routing_key,
        payload=delivered.body,
        headers=headers,
        content_type=delivered.content_type or "",
    )


@pytest.fixture
async def partner() -> object:
    require("rabbitmq")
    consumer = await RabbitConsumer().start()
    yield consumer
    await consumer.stop()


async def test_decrypt_for_one_destination_forward_for_another_and_a_missing_key_abandons_alone(
    pg_url: str, rabbit_consumer: RabbitConsumer, partner: RabbitConsumer, tmp_path: Path
) -> None:
    config = tmp_path / "outboxer.toml"
    config.write_text(f"""
db = "{pg_url}"
poll_interval = 0.1
backoff_base = 0.1
backoff_max = 0.2

[destinations.internal]
broker = "{rabbit_consumer.broker_url}"

[destinations.partner]
broker = "{partner.broker_url}"
payload = "forward"
""")
    ring = KeyRing({"k1": K1})
    outbox = Outbox(destinations=("internal", "partner"), encryption=ring)
    lost = Outbox(destinations=("internal", "partner"), encryption=KeyRing({"k9": K9}))
    with psycopg.connect(pg_url) as conn:
        outbox.enqueue(conn, "first", {"n": 1}, key="a")
        lost.enqueue(conn, "unreadable", {"n": 2}, key="b")
        outbox.enqueue(conn, "third", {"n": 3}, key="c")
    settings = load_settings(
        {}, config_file=config, environ={"OUTBOXER_ENCRYPTION_KEYS": f"k1={K1}"}
    )
    relay = Relay.from_settings(settings)
    task = asyncio.create_task(relay.run())
    try:
        await rabbit_consumer.wait_for(2)
        await partner.wait_for(3)

        async def unreadable_abandoned() -> bool:
            return rows(pg_url)[("unreadable", "internal")][0] == "ABANDONED"

        await eventually(unreadable_abandoned, timeout=20)
        _, attempts, error = rows(pg_url)[("unreadable", "internal")]
        assert attempts == 1, "a key error is permanent: no retries"
        assert error is not None and "no key 'k9'" in error

        # The relay keeps publishing after it.
        with psycopg.connect(pg_url) as conn:
            outbox.enqueue(conn, "fourth", {"n": 4}, key="b")
        await rabbit_consumer.wait_for(3)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)

    internal = {d.routing_key: d for d in rabbit_consumer.received}
    assert sorted(internal) == ["first", "fourth", "third"]
    for topic, n in (("first", 1), ("third", 3), ("fourth", 4)):
        assert json.loads(internal[topic].body) == {"n": n}, "plaintext for internal"
        assert "outboxer-key-id" not in internal[topic].headers
    forwarded = {d.routing_key: as_message(d) for d in partner.received}
    assert forwarded["first"].headers["outboxer-destination"] == "partner"
    assert b'"n"' not in forwarded["first"].payload, "ciphertext for partner"
    assert json.loads(decrypt(forwarded["first"], ring).payload) == {"n": 1}
    assert forwarded["unreadable"].headers["outboxer-key-id"] == "k9", "forwarded as stored"
    assert rows(pg_url)[("unreadable", "partner")][0] == "PUBLISHED"


async def test_retention_deletes_the_claim_check_objects_with_their_rows(
    pg_url: str, rabbit_consumer: RabbitConsumer, tmp_path: Path
) -> None:
    claims = tmp_path / "claims"
    store = FileObjectStore(claims)
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=100))
    with psycopg.connect(pg_url) as conn:
        sent = [outbox.enqueue(conn, "big", {"blob": "x" * 500, "n": n}) for n in range(3)]
    environ = {
        "OUTBOXER_DB": pg_url,
        "OUTBOXER_BROKER": rabbit_consumer.broker_url,
        "OUTBOXER_CLAIM_CHECK_STORE": f"file://{claims}",
        "OUTBOXER_PUBLISHED_RETENTION": "0",
        "OUTBOXER_CLAIM_CHECK_SWEEP_GRACE": "0",
        "OUTBOXER_EXIT_WHEN_IDLE": "true",
    }
    settings = load_settings({}, environ=environ)
    await Relay.from_settings(settings).run()
    delivered = await rabbit_consumer.wait_for(3)
    references = [as_message(d) for d in delivered]
    assert all(m.payload == b"" for m in references), "published as references"
    assert sorted(json.loads(fetch_payload(m, store).payload)["n"] for m in references) == [0, 1, 2]

    relay = Relay.from_settings(settings)
    await relay.store.connect()
    try:
        assert await cleanup(relay.store, settings) >= 3
    finally:
        await relay.store.close()
    assert list(store.list_objects()) == [], "the objects went with their rows"
    assert len(sent) == 3
