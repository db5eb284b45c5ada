"""Durations in broker and database URLs (``connect_timeout``, NATS ``duplicate_window``)
are finite, positive and bounded, refused as ConfigErrors naming the option, as Kafka's and
the webhook's are. ``float()`` took ``nan`` and ``inf``: against the real services a NATS
``duplicate_window=inf`` or a ``connect_timeout=nan`` failed every connect as if NATS were
down (the relay backed off for good), MySQL's ``connect_timeout=nan`` read as "Can't connect
to MySQL server" and ``abc`` as a bare ValueError, and ``inf`` waited for ever on a host that
drops packets."""

from __future__ import annotations

import uuid

import pytest

import outboxer
from outboxer.brokers.nats import NatsPublisher
from outboxer.brokers.rabbitmq import RabbitMQPublisher
from outboxer.errors import ConfigError
from outboxer.stores.mysql import mysql_connect_args

BAD = ["nan", "inf", "-inf", "-1", "0", "1e400", "abc", "٣"]


@pytest.mark.parametrize("value", BAD)
def test_url_durations_must_be_finite_positive_seconds(value: str) -> None:
    with pytest.raises(ConfigError, match="connect_timeout"):
        RabbitMQPublisher(f"amqp://guest:guest@127.0.0.1/?connect_timeout={value}")
    with pytest.raises(ConfigError, match="connect_timeout"):
        NatsPublisher(f"nats://127.0.0.1:4222?connect_timeout={value}")
    with pytest.raises(ConfigError, match="duplicate_window"):
        NatsPublisher(f"nats://127.0.0.1:4222?duplicate_window={value}")
    with pytest.raises(ConfigError, match="connect_timeout"):
        mysql_connect_args(f"mysql://root@127.0.0.1/test?connect_timeout={value}")


def test_python_arguments_are_checked_too() -> None:
    with pytest.raises(ConfigError, match="connect_timeout"):
        RabbitMQPublisher("amqp://guest:guest@127.0.0.1/", connect_timeout=float("inf"))
    with pytest.raises(ConfigError, match="duplicate_window"):
        NatsPublisher("nats://127.0.0.1:4222", duplicate_window=float("nan"))


async def test_nats_stream_with_a_good_duplicate_window_is_created() -> None:
    name = f"AUDIT5_{uuid.uuid4().hex[:8]}"
    url = (
        f"nats://127.0.0.1:4222?stream={name}&subjects={name}.>&create_stream=true"
        "&duplicate_window=30&connect_timeout=2.5"
    )
    publisher = NatsPublisher(url)
    assert (publisher.duplicate_window, publisher.connect_timeout) == (30.0, 2.5)
    await publisher.connect()
    try:
        assert publisher._js is not None
        info = await publisher._js.stream_info(name)
        assert info.config.duplicate_window == 30.0
        await publisher._js.delete_stream(name)
    finally:
        await publisher.close()


async def test_rabbitmq_with_a_good_connect_timeout_connects() -> None:
    publisher = RabbitMQPublisher("amqp://guest:guest@127.0.0.1/?connect_timeout=2.5")
    assert publisher.connect_timeout == 2.5
    await publisher.connect()
    await publisher.close()


async def test_mysql_store_with_a_bad_or_good_connect_timeout(mysql_url: str) -> None:
    with pytest.raises(ConfigError, match="connect_timeout"):
        outboxer.create_store(f"{mysql_url}?connect_timeout=nan")
    async with outboxer.create_store(f"{mysql_url}?connect_timeout=2.5") as store:
        assert await store.status() == []
