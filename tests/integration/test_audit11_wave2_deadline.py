"""What remains of a wave after its deadline keeps the outcomes already known.

NATS: a PubAck that says "duplicate" is checked (``js.get_msg``) after the acks; with
JetStream slow to answer that request, the check ran into the base class's backstop at
``publish_timeout``, which failed the whole wave, the message confirmed plainly included.
Now the check is bounded by the time left: only the unchecked message fails, retryably.

RabbitMQ, one publish at a time (``_send_in_turn``, for aiormq releases without the
channel internals of whole-wave writes): the messages never written when the deadline
passed were reported as attempted timeouts; now they come back not attempted.

NATS, a refused connect: nats-py's error callback logged each try (twice per connect)
besides the relay's own line, which named only NoServersError.

The slow peer is the gate of test_audit11_wave_partial_timeout in front of the real broker.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid

import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.nats import NatsPublisher
from outboxer.brokers.rabbitmq import RabbitMQPublisher
from outboxer.testing import make_message
from tests.integration.test_audit11_wave_partial_timeout import (
    gate,
    gated_rabbitmq_publisher,
)
from tests.services import PORTS, require

PUBLISH_TIMEOUT = 1.5


def split_nats_client(buffer: bytes) -> int | None:
    """A NATS client operation: one line, plus the payload of PUB and HPUB."""
    end = buffer.find(b"\r\n")
    if end < 0:
        return None
    line = buffer[:end]
    if line.startswith((b"PUB ", b"HPUB ")):
        size = end + 2 + int(line.split()[-1]) + 2
        return size if len(buffer) >= size else None
    return end + 2


async def test_nats_slow_duplicate_check_fails_only_its_message() -> None:
    require("nats")
    tag = uuid.uuid4().hex[:8]
    stream, subject = f"AUDIT11_WAVE2_{tag}", f"audit11wave2{tag}"
    import nats

    nc = await nats.connect(f"nats://127.0.0.1:{PORTS['nats']}")
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[f"{subject}.>"])
    try:
        is_publish = lambda packet: packet.startswith((b"PUB ", b"HPUB "))  # noqa: E731
        # The client's side is gated: the wave's two publishes reach JetStream, the
        # duplicate check's request (and all after it) is held.
        async with gate(PORTS["nats"], split_nats_client, is_publish, downstream=False) as proxy:
            publisher = create_publisher(
                f"nats://127.0.0.1:{proxy.port}", publish_timeout=PUBLISH_TIMEOUT
            )
            assert isinstance(publisher, NatsPublisher)
            try:
                await publisher.connect()
                stored = make_message(f"{subject}.t")
                [first] = await publisher.publish_batch([stored])
                assert first.published, first
                fresh = make_message(f"{subject}.t")
                proxy.hold_after(2)
                started = asyncio.get_running_loop().time()
                again, new = await publisher.publish_batch([stored, fresh])
                elapsed = asyncio.get_running_loop().time() - started
                assert proxy.held, "the gate held nothing: the check was not slowed"
                assert new.kind is OutcomeKind.PUBLISHED, new
                assert again.kind is OutcomeKind.FAILED and again.retryable, again
                assert again.attempted, again
                assert "could not be read back" in (again.error or ""), again.error
                assert elapsed < PUBLISH_TIMEOUT, elapsed
            finally:
                await publisher.close()
        info = await js.stream_info(stream)
        assert info.state.messages == 2, info.state
    finally:
        await js.delete_stream(stream)
        await nc.close()


async def test_rabbitmq_in_turn_unwritten_messages_are_not_attempted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(RabbitMQPublisher, "_wave_writes", False)
    # The first publish reaches RabbitMQ and is confirmed; the second is written but held
    # (never confirmed); the third is never written, one at a time.
    async with gated_rabbitmq_publisher(PUBLISH_TIMEOUT) as (publisher, proxy):
        await publisher.connect()
        proxy.hold_after(1)
        started = asyncio.get_running_loop().time()
        first, second, third = await publisher.publish_batch(
            [make_message("wave", {"n": n}) for n in range(3)]
        )
        elapsed = asyncio.get_running_loop().time() - started
        assert proxy.held, "the gate held nothing: the wave was not slowed"
        assert first.kind is OutcomeKind.PUBLISHED, first
        assert second.kind is OutcomeKind.FAILED and second.attempted, second
        assert "did not confirm" in (second.error or ""), second.error
        assert third.kind is OutcomeKind.FAILED and third.retryable, third
        assert not third.attempted, third
        assert "not written" in (third.error or ""), third.error
        assert elapsed < PUBLISH_TIMEOUT, elapsed


async def test_nats_failed_connect_is_one_line_with_its_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """nats-py reported each try of a refused connect to the publisher's error callback,
    which logged it (twice per connect), on top of the relay's line, which named only
    NoServersError. Now the error raised names the cause and the callback is quiet."""
    from outboxer.errors import BrokerUnavailableError

    # Bound, not listening: connecting is refused, and no other process takes the port.
    with socket.socket() as reserved:
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
        publisher = create_publisher(
            f"nats://user:s3cret-nats-pw@127.0.0.1:{port}", publish_timeout=PUBLISH_TIMEOUT
        )
        with (
            caplog.at_level(logging.INFO, logger="outboxer.publisher.nats"),
            pytest.raises(BrokerUnavailableError) as raised,
        ):
            await publisher.connect()
    lines = [r for r in caplog.records if r.name == "outboxer.publisher.nats"]
    assert lines == [], [r.getMessage() for r in lines]
    assert "ConnectionRefusedError" in str(raised.value), raised.value
    assert "s3cret-nats-pw" not in str(raised.value), raised.value
