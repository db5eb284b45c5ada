"""Duration options in the settings' syntax reach the real brokers, and a NATS consumer
subject the stream does not capture is reported as that, not as a consumer conflict.

Before, ``ack_wait=1m`` or ``keepalive=90s`` were refused as "must be a number", and a
topic outside the stream's subjects read "consumer … exists with other settings: delete it
or set ack_wait to match".
"""

from __future__ import annotations

import uuid

import pytest

from outboxer.brokers import create_publisher
from outboxer.errors import ConfigError
from outboxer.receivers import create_receiver
from tests.services import require

NATS = "nats://127.0.0.1:4222"


async def _delete_stream(name: str) -> None:
    import nats

    nc = await nats.connect(NATS)
    try:
        await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


async def test_nats_ack_wait_as_a_duration_reaches_the_consumer() -> None:
    require("nats")
    tag = uuid.uuid4().hex[:8]
    url = f"{NATS}?stream=S{tag}&create_stream=true&subjects=t{tag}.>"
    receiver = create_receiver(url, group=f"g{tag}", topics=[f"t{tag}.x"], ack_wait="1m")
    try:
        await receiver.connect()
        assert receiver._js is not None
        info = await receiver._js.consumer_info(f"S{tag}", f"g{tag}")
        assert info.config.ack_wait == 60.0
    finally:
        await receiver.close()
        await _delete_stream(f"S{tag}")


async def test_nats_topic_outside_the_stream_is_named_as_such() -> None:
    require("nats")
    tag = uuid.uuid4().hex[:8]
    url = f"{NATS}?stream=S{tag}&create_stream=true&subjects=t{tag}.>"
    receiver = create_receiver(url, group=f"g{tag}", topics=[f"other{tag}.x"])
    try:
        with pytest.raises(ConfigError, match=f"not among the subjects of stream 'S{tag}'"):
            await receiver.connect()
    finally:
        await receiver.close()
        await _delete_stream(f"S{tag}")


async def test_redis_claim_idle_as_a_duration_connects() -> None:
    require("redis")
    tag = uuid.uuid4().hex[:8]
    receiver = create_receiver(
        f"redis://127.0.0.1:6379/0?stream_prefix=audit7-{tag}-",
        group="g",
        topics=["t"],
        claim_idle="1500ms",
    )
    try:
        await receiver.connect()
        assert receiver.claim_idle == 1.5
    finally:
        client = receiver._client
        if client is not None:
            await client.delete(f"audit7-{tag}-t")
        await receiver.close()


async def test_rabbitmq_connect_timeout_as_a_duration_connects() -> None:
    require("rabbitmq")
    publisher = create_publisher(
        "amqp://guest:guest@127.0.0.1:5672/?connect_timeout=5s&declare_exchange=false"
    )
    try:
        await publisher.connect()
        assert publisher.connect_timeout == 5.0
    finally:
        await publisher.close()


async def test_mqtt_keepalive_and_session_expiry_as_durations_connect() -> None:
    require("mosquitto")
    publisher = create_publisher("mqtt://127.0.0.1:1883?keepalive=90s")
    tag = uuid.uuid4().hex[:8]
    # A group of its own: the session (client id outboxer-<group>-…) outlives the test a minute.
    receiver = create_receiver(
        "mqtt://127.0.0.1:1883", group=f"g{tag}", topics=[f"audit7/{tag}"], session_expiry="1m"
    )
    try:
        await publisher.connect()
        await receiver.connect()
        assert (publisher.keepalive, receiver.session_expiry) == (90, 60)
    finally:
        await receiver.close()
        await publisher.close()
