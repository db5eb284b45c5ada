"""RabbitMQPublisher audit: headers AMQP cannot carry as they are, against the real RabbitMQ.

A header name over a field table's 128 bytes used to be cut by pamqp (the message went out
with a header renamed, two such headers merged into one), and properties over the
connection's frame_max made RabbitMQ close the whole connection (501 FRAME_ERROR) on every
attempt. Both are now refused for good before anything is written.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import aio_pika
import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.rabbitmq import RabbitMQPublisher
from outboxer.stores.base import parse_headers
from outboxer.testing import make_message
from tests.integration.test_broker_rabbitmq import URL, QueueConsumer, header_text
from tests.services import require


@pytest.fixture
async def exchange() -> AsyncIterator[str]:
    require("rabbitmq")
    name = f"audit-{uuid.uuid4().hex[:10]}"
    yield name
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        await channel.exchange_delete(name)


@pytest.fixture(params=["waves", "per-message"])
def write_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(RabbitMQPublisher, "_wave_writes", request.param == "waves")
    return str(request.param)


async def test_header_name_over_128_bytes_is_refused_not_renamed(
    exchange: str, write_path: str
) -> None:
    publisher = RabbitMQPublisher(f"{URL}?exchange={exchange}", publish_timeout=10.0)
    await publisher.connect()
    consumer = await QueueConsumer.start(exchange, "#")
    try:
        long_a, long_b = "h" * 129 + "A", "h" * 129 + "B"
        cut = make_message("audit.h", {"n": 1}, headers={long_a: "1", long_b: "2"})
        kept = {"h" * 128: "kept", "nul": "a\x00b", "é" * 64: "😀\x01"}  # 128 bytes each
        fine = make_message("audit.h", {"n": 2}, headers=kept)
        outcomes = await publisher.publish_batch([cut, fine])
        assert outcomes[0].kind is OutcomeKind.FAILED, outcomes[0]
        assert not outcomes[0].retryable
        assert "128 bytes" in (outcomes[0].error or "")
        assert outcomes[1].kind is OutcomeKind.PUBLISHED, outcomes[1]
        got = await consumer.messages(2, timeout=3.0)
        assert [str(m.message_id) for m in got] == [str(fine.id)]
        assert {k: header_text(got[0].headers[k]) for k in kept} == kept
    finally:
        await consumer.close()
        await publisher.close()


async def test_headers_over_frame_max_are_refused_without_closing_the_connection(
    exchange: str, write_path: str
) -> None:
    publisher = RabbitMQPublisher(f"{URL}?exchange={exchange}", publish_timeout=10.0)
    await publisher.connect()
    consumer = await QueueConsumer.start(exchange, "#")
    try:
        generation = publisher._generation
        # 200 kB of headers: over RabbitMQ's default frame_max of 128 KiB.
        huge = make_message("audit.f", {"n": 1}, headers={"big": "v" * 200_000})
        others = [make_message("audit.f", {"n": n}) for n in range(2, 5)]
        outcomes = await publisher.publish_batch([huge, *others])
        assert outcomes[0].kind is OutcomeKind.FAILED, outcomes[0]
        assert not outcomes[0].retryable, outcomes[0]
        assert "frame_max" in (outcomes[0].error or "")
        assert [o.kind for o in outcomes[1:]] == [OutcomeKind.PUBLISHED] * 3
        # Nothing reached RabbitMQ that made it close the connection: no reconnect.
        assert publisher._generation == generation
        assert publisher.connected and not publisher._connection_lost()
        got = await consumer.ids_until({str(m.id) for m in others}, timeout=5.0)
        assert got == {str(m.id) for m in others}
        # A body far over frame_max is still split into body frames and goes through.
        large = make_message("audit.f", {"blob": "x" * 500_000})
        assert (await publisher.publish_batch([large]))[0].kind is OutcomeKind.PUBLISHED
        assert publisher._generation == generation
    finally:
        await consumer.close()
        await publisher.close()


async def test_a_lone_surrogate_in_a_header_fails_only_its_message(
    exchange: str, write_path: str
) -> None:
    # What a row's headers JSON may hold (the store reads it with json.loads).
    value = parse_headers('{"a": "\\ud800"}')
    name = parse_headers('{"\\udc80": "v"}')
    publisher = RabbitMQPublisher(f"{URL}?exchange={exchange}", publish_timeout=10.0)
    await publisher.connect()
    consumer = await QueueConsumer.start(exchange, "#")
    try:
        bad = [
            make_message("audit.s", {"n": 1}, headers=value),
            make_message("audit.s", {"n": 2}, headers=name),
        ]
        good = [make_message("audit.s", {"n": 3}, key="k"), make_message("audit.s", {"n": 4})]
        outcomes = await publisher.publish_batch([*bad, *good])
        for outcome in outcomes[:2]:
            assert outcome.kind is OutcomeKind.FAILED, outcome
            assert not outcome.retryable, outcome
            assert "\\ud800" in (outcome.error or "") or "\\udc80" in (outcome.error or "")
        assert [o.kind for o in outcomes[2:]] == [OutcomeKind.PUBLISHED] * 2, outcomes
        assert await consumer.ids_until({str(m.id) for m in good}) == {str(m.id) for m in good}
    finally:
        await consumer.close()
        await publisher.close()


async def test_nacked_and_returned_messages_amid_a_wave_count_as_failed(
    exchange: str, write_path: str
) -> None:
    """A queue that rejects publishes when full (x-overflow reject-publish, length 0) makes
    RabbitMQ nack; a routing key no queue is bound for is returned (mandatory). Neither is
    ever counted as published, and the messages around them are."""
    publisher = RabbitMQPublisher(f"{URL}?exchange={exchange}", publish_timeout=10.0)
    await publisher.connect()
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        full = await channel.declare_queue(
            exclusive=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
        )
        await full.bind(exchange, "nack.#")
        kept = await channel.declare_queue(exclusive=True)
        await kept.bind(exchange, "ok.#")
        topics = ["ok.a", "nack.a", "ok.b", "nobody.a", "nack.b", "ok.c"] * 4
        messages = [make_message(topic, {"n": n}) for n, topic in enumerate(topics)]
        outcomes = await publisher.publish_batch(messages)
        for message, outcome in zip(messages, outcomes, strict=True):
            if message.topic.startswith("ok."):
                assert outcome.published, (message.topic, outcome)
            else:
                assert outcome.kind is OutcomeKind.FAILED, (message.topic, outcome)
                assert outcome.retryable
                expected = "did not take" if message.topic.startswith("nack.") else "unroutable"
                assert expected in (outcome.error or ""), (message.topic, outcome)
        assert publisher._generation == 1  # no channel or connection was lost over it
    finally:
        await connection.close()
        await publisher.close()
