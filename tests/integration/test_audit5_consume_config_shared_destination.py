"""`outboxer consume` with a settings file shared with the relay, on the real brokers.

The relay's default destination names where it publishes through publisher options
(``[destinations.default] options = { exchange = "orders" }``, a stream or subject prefix,
a topic prefix). Before, the consumer passed them to its receiver as receiver options and
stopped ("RabbitMQReceiver: unknown options ['exchange']"); dropping them instead would
have bound the consumer to another exchange (stream, subject), where nothing arrives. The
receiver's publisher-side parsing reads them now, as the relay's publisher does.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from outboxer.brokers import create_publisher
from outboxer.consume_cli import build_consumer, load_consume_settings
from outboxer.errors import ConfigError
from outboxer.testing import make_message
from tests.services import require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"
REDIS = "redis://127.0.0.1:6379/0"
NATS = "nats://127.0.0.1:4222"
MQTT = "mqtt://127.0.0.1:1883"


async def _delete_rabbit(exchange: str, queue: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(AMQP)
    channel = await connection.channel()
    await channel.queue_delete(queue)
    await channel.exchange_delete(exchange)
    await connection.close()


async def _delete_redis(stream: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS)
    await client.delete(stream)
    await client.aclose()


async def _delete_nats(stream: str) -> None:
    import nats

    nc = await nats.connect(NATS)
    await nc.jetstream().delete_stream(stream)
    await nc.close()


def _case(broker: str, tag: str) -> tuple[str, str, str, Callable[[str], Awaitable[None]]]:
    """(service, broker URL, the destination's options as TOML, cleanup(group))."""
    if broker == "rabbitmq":
        exchange = f"orders-{tag}"
        return broker, AMQP, f'{{ exchange = "{exchange}" }}', lambda g: _delete_rabbit(exchange, g)
    if broker == "redis":
        prefix = f"orders-{tag}:"
        return (
            broker,
            REDIS,
            f'{{ stream_prefix = "{prefix}" }}',
            lambda g: _delete_redis(prefix + "t"),
        )
    if broker == "nats":
        stream = f"ORDERS_{tag}"
        options = (
            f'{{ stream = "{stream}", create_stream = true, subjects = "o{tag}.>", '
            f'subject_prefix = "o{tag}." }}'
        )
        return broker, NATS, options, lambda g: _delete_nats(stream)

    async def nothing(group: str) -> None:
        return None

    return "mosquitto", MQTT, f'{{ topic_prefix = "o{tag}/" }}', nothing


@pytest.mark.parametrize("broker", ["rabbitmq", "redis", "nats", "mqtt"])
async def test_the_relays_destination_options_reach_the_consumers_receiver(
    broker: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    service, url, options, cleanup = _case(broker, tag)
    require(service)
    group = f"g-{tag}"
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'db = "sqlite:///{tmp_path}/never-opened.db"\n'
        f'[destinations.default]\nbroker = "{url}"\noptions = {options}\n'
        f'[consumer]\ngroup = "{group}"\ntopics = ["t"]\nname = "c-{tag}"\n'
        'handler = "tests.consumer_handlers:record"\n'
        + ("options = { session_expiry = 60 }\n" if broker == "mqtt" else "")
    )
    settings, own = load_consume_settings({}, {}, environ={}, config_file=str(config))
    consumer = build_consumer(settings, own)  # before: ConfigError "unknown options"
    receiver = consumer.receiver
    # The relay, from the same file.
    publisher = create_publisher(url, **settings.destinations["default"].options)
    await receiver.connect()
    try:
        await publisher.connect()
        message = make_message("t", {"n": 1}, key="k")
        outcomes = await publisher.publish_batch([message])
        assert [outcome.kind.name for outcome in outcomes] == ["PUBLISHED"], outcomes
        received = []
        for _ in range(20):  # up to 10 s in all; the first arrival ends the wait
            received += await receiver.receive(10, 0.5)
            if received:
                break
        assert [incoming.delivery.id for incoming in received] == [message.id]
        await receiver.ack(received)
    finally:
        await publisher.close()
        await receiver.close()
        await cleanup(group)


def test_a_destination_option_neither_publisher_nor_receiver_takes_is_named(
    tmp_path: Path,
) -> None:
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'db = "sqlite:///{tmp_path}/never-opened.db"\n'
        f'[destinations.default]\nbroker = "{AMQP}"\n'
        'options = { exchnage = "orders", queue_type = "quorum" }\n'
        '[consumer]\ngroup = "g"\nhandler = "tests.consumer_handlers:record"\n'
    )
    settings, own = load_consume_settings({}, {}, environ={}, config_file=str(config))
    with pytest.raises(ConfigError) as error:
        build_consumer(settings, own)
    text = str(error.value)
    assert "['exchnage', 'queue_type']" in text and "guest@" not in text, text
    assert "queue_type: the consumer's own" in text, text


def test_kafka_config_of_the_destination_reaches_the_consumers_client(tmp_path: Path) -> None:
    # Kafka's credentials and TLS live in the destination's config (never connected here).
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'db = "sqlite:///{tmp_path}/never-opened.db"\n'
        '[destinations.default]\nbroker = "kafka://127.0.0.1:1"\n'
        'options = { config = { "security.protocol" = "SASL_PLAINTEXT", '
        '"sasl.mechanism" = "PLAIN", "sasl.username" = "u", "sasl.password" = "pw" } }\n'
        '[consumer]\ngroup = "g"\ntopics = ["t"]\nhandler = "tests.consumer_handlers:record"\n'
    )
    settings, own = load_consume_settings({}, {}, environ={}, config_file=str(config))
    receiver = build_consumer(settings, own).receiver
    assert receiver.publisher is not None
    kafka_config = getattr(receiver.publisher, "config", {})
    assert kafka_config.get("sasl.username") == "u", kafka_config
    asyncio.run(receiver.close())


def test_a_publisher_option_among_the_consumers_options_is_the_publishers(tmp_path: Path) -> None:
    """As in the URL's query, where both kinds mix: ``--option exchange=…`` names the
    exchange (over the destination's), instead of "unknown options ['exchange']"."""
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'db = "sqlite:///{tmp_path}/never-opened.db"\n'
        f'[destinations.default]\nbroker = "{AMQP}"\noptions = {{ exchange = "orders" }}\n'
        '[consumer]\ngroup = "g"\nhandler = "tests.consumer_handlers:record"\n'
        'options = { exchange = "orders-eu", queue_type = "quorum" }\n'
    )
    settings, own = load_consume_settings({}, {}, environ={}, config_file=str(config))
    receiver = build_consumer(settings, own).receiver
    assert getattr(receiver.publisher, "exchange", None) == "orders-eu"
    assert getattr(receiver, "queue_type", None) == "quorum"
    with pytest.raises(ConfigError, match=r"unknown options \['exchnage'\].*exchange"):
        load = load_consume_settings({}, {}, environ={}, config_file=str(config))
        build_consumer(load[0], load[1], broker_options={"exchnage": "x"})


def test_the_consumers_kafka_config_adds_to_the_destinations(tmp_path: Path) -> None:
    # Replaced, the destination's credentials were gone: an authentication failure the
    # consumer would take for an outage.
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'db = "sqlite:///{tmp_path}/never-opened.db"\n'
        '[destinations.default]\nbroker = "kafka://127.0.0.1:1"\n'
        'options = { config = { "sasl.username" = "u", "sasl.password" = "pw" } }\n'
        '[consumer]\ngroup = "g"\ntopics = ["t"]\nhandler = "tests.consumer_handlers:record"\n'
        'options = { config = { "session.timeout.ms" = 10000 } }\n'
    )
    settings, own = load_consume_settings({}, {}, environ={}, config_file=str(config))
    receiver = build_consumer(settings, own).receiver
    kafka_config = getattr(receiver, "config", {})
    assert kafka_config.get("sasl.username") == "u", kafka_config
    assert kafka_config.get("session.timeout.ms") == 10000, kafka_config
    asyncio.run(receiver.close())
