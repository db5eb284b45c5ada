"""Broker URL query options: a name the adapter (or its driver) does not take is refused at
start, naming the closest known one. NATS, MQTT and RabbitMQ dropped an unknown name without
a word (a typo in ``subject_prefix`` published elsewhere); redis-py refused one only when it
connected (an outage, retried for ever). The consumer's own options are accepted on the
relay's side, so one URL serves both."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

import pytest

from outboxer.brokers import create_publisher
from outboxer.errors import ConfigError
from outboxer.receivers.kafka import KafkaReceiver
from outboxer.receivers.mqtt import MqttReceiver
from outboxer.receivers.nats import NatsReceiver
from outboxer.receivers.rabbitmq import RabbitMQReceiver
from outboxer.receivers.redis import RedisReceiver

TYPOS = [
    ("nats://127.0.0.1:4222?subjet_prefix=orders.", "subject_prefix"),
    ("nats://127.0.0.1:4222?strem=ORDERS", "stream"),
    ("mqtt://127.0.0.1:1883?topic_prefx=outbox/", "topic_prefix"),
    ("mqtts://127.0.0.1:8883?retian=true", "retain"),
    ("amqp://guest:guest@127.0.0.1:5672/?exchang=events", "exchange"),
    ("amqps://127.0.0.1/?hearbeat=5", "heartbeat"),
    ("redis://127.0.0.1:6379/0?stream_prefx=outbox:", "stream_prefix"),
    ("rediss://127.0.0.1:6379/0?socket_timout=5", "socket_timeout"),
]


@pytest.mark.parametrize(("url", "meant"), TYPOS)
def test_a_misspelt_option_is_refused_at_start_naming_the_one_meant(url: str, meant: str) -> None:
    typo = parse_qsl(urlsplit(url).query)[0][0]
    with pytest.raises(ConfigError) as caught:
        create_publisher(url)
    message = str(caught.value)
    assert repr(typo) in message
    assert f"did you mean {meant}?" in message


@pytest.mark.parametrize(
    "url",
    [
        "nats://127.0.0.1:4222?stream=A&stream=B",
        "mqtt://127.0.0.1:1883?topic_prefix=a/&topic_prefix=b/",
        "amqp://127.0.0.1/?exchange=a&exchange=b",
    ],
)
def test_an_option_given_twice_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="more than once"):
        create_publisher(url)


def test_the_message_masks_the_password() -> None:
    for url in (
        "amqp://guest:hunter2secret@127.0.0.1/?exchang=x",
        "nats://me:hunter2secret@127.0.0.1:4222?subjet_prefix=a.",
        "redis://:hunter2secret@127.0.0.1:6379/0?stream_prefx=a",
        "redis://:hunter2secret@127.0.0.1:6379/0?socket_timeout=soon",
    ):
        with pytest.raises(ConfigError) as caught:
            create_publisher(url)
        assert "hunter2secret" not in str(caught.value), url


def test_a_hostile_name_is_cut_short_in_the_message() -> None:
    with pytest.raises(ConfigError) as caught:
        create_publisher("nats://127.0.0.1:4222?" + "x" * 5000 + "=1")
    assert len(str(caught.value)) < 1000


def test_a_bad_redis_value_is_refused_at_start_not_at_connect() -> None:
    with pytest.raises(ConfigError, match="socket_timeout"):
        create_publisher("redis://127.0.0.1:6379/0?socket_timeout=soon")


@pytest.mark.parametrize(
    "url",
    [
        "nats://127.0.0.1:4222?subject_prefix=o.&stream=S&tls=false&connect_timeout=2",
        "mqtt://127.0.0.1:1883?topic_prefix=o/&retain=false&keepalive=30&max_inflight=10",
        "amqp://127.0.0.1/?exchange=e&heartbeat=5&name=relay&timeout=3&auth=plain",
        "redis://127.0.0.1:6379/0?stream_prefix=o:&maxlen=10&socket_timeout=3&client_name=r",
        "kafka://127.0.0.1:9092?linger.ms=5&connect_timeout=3",
    ],
)
def test_known_options_and_driver_options_are_taken(url: str) -> None:
    create_publisher(url)


RECEIVERS = [
    (NatsReceiver, "nats://127.0.0.1:4222?subject_prefix=o."),
    (MqttReceiver, "mqtt://127.0.0.1:1883?topic_prefix=o/"),
    (RabbitMQReceiver, "amqp://127.0.0.1/?exchange=e"),
    (RedisReceiver, "redis://127.0.0.1:6379/0?stream_prefix=o:"),
    (KafkaReceiver, "kafka://127.0.0.1:9092?linger.ms=5"),
]
#: A value each consumer option accepts, for the round trip through the receiver.
VALUES = {
    "ack_wait": "30",
    "durable": "orders",
    "client_id": "billing-1",
    "session_expiry": "60",
    "queue": "billing",
    "queue_type": "quorum",
    "single_active_consumer": "true",
    "claim_idle": "30",
    "offset_reset": "earliest",
    "suspect_window": "4",
}


@pytest.mark.parametrize(("receiver", "url"), RECEIVERS)
def test_the_consumers_url_serves_the_relay_too(receiver: type, url: str) -> None:
    """Each consumer option in the relay's URL: the relay's publisher takes it (and keeps it
    from its driver), and the consumer still reads it."""
    assert receiver.options, receiver
    ours = "&".join(f"{name}={VALUES[name]}" for name in receiver.options)
    shared = f"{url}&{ours}"
    publisher = create_publisher(shared)
    driver_url = getattr(publisher, "_driver_url", None)
    if driver_url is not None:
        assert not set(receiver.options) & {n for n, _ in parse_qsl(urlsplit(driver_url).query)}
    config = getattr(publisher, "config", None)
    if isinstance(config, dict):
        assert not set(receiver.options) & set(config)
    consumer = receiver(shared, group="billing", topics=["orders"])
    for name in receiver.options:
        assert str(consumer.settings[name]) == VALUES[name]


@pytest.mark.parametrize(("receiver", "url"), RECEIVERS)
def test_a_consumer_option_given_twice_is_refused(receiver: type, url: str) -> None:
    name = receiver.options[0]
    twice = f"{url}&{name}={VALUES[name]}&{name}={VALUES[name]}"
    with pytest.raises(ConfigError, match="more than once"):
        receiver(twice, group="billing", topics=["orders"])
