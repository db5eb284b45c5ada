"""RabbitMQPublisher under a resource alarm, on a private RabbitMQ node (the shared one
must not be put under an alarm: every other test run publishes to it).

RabbitMQ answers a publish during a memory or disk alarm with ``connection.blocked`` and
stops reading the connection. Each wave then timed out and counted an attempt, so an alarm
that lasted through ``max_attempts`` waves (about a quarter of an hour with the default
backoff) abandoned messages the broker never refused. Now a wave whose confirms are still
missing on a blocked connection comes back as not attempted."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections.abc import Iterator

import aio_pika
import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.rabbitmq import RabbitMQPublisher
from outboxer.testing import make_message
from tests.chaos.servers import PrivateRabbitMQ


def ctl(server: PrivateRabbitMQ, *args: str) -> str:
    done = subprocess.run(
        [server.ctl_script, "-n", server.node, *args],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def alarms(server: PrivateRabbitMQ) -> str:
    return ctl(server, "eval", "rabbit_alarm:get_alarms().").strip()


@pytest.fixture
def disk_alarm(private_rabbitmq: PrivateRabbitMQ) -> Iterator[PrivateRabbitMQ]:
    """The private node; ``alarm_on`` raises a disk alarm on it, which this clears after."""
    yield private_rabbitmq
    alarm_off(private_rabbitmq)


def alarm_off(server: PrivateRabbitMQ) -> None:
    ctl(server, "set_disk_free_limit", "50MB")
    deadline = time.monotonic() + 60
    while alarms(server) != "[]":
        assert time.monotonic() < deadline, "the disk alarm did not clear"
        time.sleep(0.2)


def alarm_on(server: PrivateRabbitMQ) -> None:
    ctl(server, "set_disk_free_limit", "1000000GB")
    deadline = time.monotonic() + 60
    while "disk" not in alarms(server):
        assert time.monotonic() < deadline, "no disk alarm was raised"
        time.sleep(0.2)


async def test_waves_blocked_by_a_resource_alarm_are_not_attempted(
    disk_alarm: PrivateRabbitMQ,
) -> None:
    server = disk_alarm
    exchange = f"alarm-{uuid.uuid4().hex[:8]}"
    url = server.url(exchange)
    publisher = RabbitMQPublisher(url, publish_timeout=2.0)
    await publisher.connect()
    connection = await aio_pika.connect(url.split("?", 1)[0])
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(f"q-{exchange}", auto_delete=False)
        await queue.bind(exchange, "#")
        [first] = await publisher.publish_batch([make_message("a.b", {"n": 0})])
        assert first.published, first

        await asyncio.to_thread(alarm_on, server)
        blocked = [make_message("a.b", {"n": n}, key=f"k{n}") for n in range(1, 4)]
        outcomes = await publisher.publish_batch(blocked)
        for outcome in outcomes:
            assert outcome.kind is OutcomeKind.FAILED, outcome
            assert not outcome.attempted, outcome  # no attempt counted
            assert outcome.retryable
            assert "blocked" in (outcome.error or ""), outcome
        # Not a lost connection: RabbitMQ reads it again once the alarm is over, and
        # closing a blocked connection would wait for the close-ok that never comes.
        assert publisher.connected
        generation = publisher._generation
        # While the alarm lasts, the next waves are not even written.
        [again] = await publisher.publish_batch([make_message("a.b", {"n": 4})])
        assert again.kind is OutcomeKind.FAILED and not again.attempted, again
        assert "blocked" in (again.error or ""), again
    finally:
        await asyncio.to_thread(alarm_off, server)
    # Once the alarm is over, the same connection goes on, and what it held is delivered.
    try:
        [after] = await publisher.publish_batch([make_message("a.b", {"n": 5})])
        assert after.published, after
        assert publisher._generation == generation
        # The blocked wave's frames waited unread, then RabbitMQ read them: at least once.
        ids: set[str] = set()
        wanted = {str(m.id) for m in blocked}
        async with asyncio.timeout(10), queue.iterator() as messages:
            async for message in messages:
                await message.ack()
                ids.add(str(message.message_id))
                if wanted <= ids:
                    break
    finally:
        await connection.close()
    await publisher.close()
