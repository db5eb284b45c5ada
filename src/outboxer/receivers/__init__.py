"""Receivers, the consumer side of each broker: one module per broker, chosen by URL scheme
and imported lazily (a missing driver names the extra to install)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from outboxer.brokers import adapter_class
from outboxer.errors import ConfigError
from outboxer.receivers.base import Delivery, Incoming, MalformedMessage, Receiver

#: URL scheme -> (module, class, extra to install, import that must succeed).
REGISTRY: dict[str, tuple[str, str, str | None, str | None]] = {
    "memory": ("outboxer.receivers.memory", "MemoryReceiver", None, None),
    "file": ("outboxer.receivers.file", "FileReceiver", None, None),
    "amqp": ("outboxer.receivers.rabbitmq", "RabbitMQReceiver", "rabbitmq", "aio_pika"),
    "amqps": ("outboxer.receivers.rabbitmq", "RabbitMQReceiver", "rabbitmq", "aio_pika"),
    "redis": ("outboxer.receivers.redis", "RedisReceiver", "redis", "redis"),
    "rediss": ("outboxer.receivers.redis", "RedisReceiver", "redis", "redis"),
    "nats": ("outboxer.receivers.nats", "NatsReceiver", "nats", "nats"),
    "kafka": ("outboxer.receivers.kafka", "KafkaReceiver", "kafka", "confluent_kafka"),
    "mqtt": ("outboxer.receivers.mqtt", "MqttReceiver", "mqtt", "aiomqtt"),
    "mqtts": ("outboxer.receivers.mqtt", "MqttReceiver", "mqtt", "aiomqtt"),
}


def receiver_class(url: str) -> type[Receiver]:
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        raise ConfigError(
            "webhooks are received by an ASGI app, not by `outboxer consume`: mount "
            "outboxer.receivers.webhook.WebhookReceiver in your web server"
        )
    if scheme not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise ConfigError(
            f"no receiver for broker URL scheme {scheme!r} in {url!r}; known: {known}"
        )
    cls: type[Receiver] = adapter_class(REGISTRY[scheme], f"{scheme}:// receiver")
    return cls


def create_receiver(url: str, **options: Any) -> Receiver:
    """A receiver for ``url`` (its scheme picks the adapter), not yet connected."""
    return receiver_class(url)(url, **options)


__all__ = [
    "REGISTRY",
    "Delivery",
    "Incoming",
    "MalformedMessage",
    "Receiver",
    "create_receiver",
    "receiver_class",
]
