"""Publishers, one module per broker, chosen by URL scheme and imported lazily."""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import urlsplit

from outboxer.brokers.base import Outcome, OutcomeKind, Publisher
from outboxer.errors import ConfigError, MissingDependencyError

#: URL scheme -> (module, class, extra to install, import that must succeed).
REGISTRY: dict[str, tuple[str, str, str | None, str | None]] = {
    "memory": ("outboxer.brokers.memory", "MemoryPublisher", None, None),
    "file": ("outboxer.brokers.file", "FilePublisher", None, None),
    "stdout": ("outboxer.brokers.file", "StdoutPublisher", None, None),
    "amqp": ("outboxer.brokers.rabbitmq", "RabbitMQPublisher", "rabbitmq", "aio_pika"),
    "amqps": ("outboxer.brokers.rabbitmq", "RabbitMQPublisher", "rabbitmq", "aio_pika"),
    "kafka": ("outboxer.brokers.kafka", "KafkaPublisher", "kafka", "confluent_kafka"),
    "redis": ("outboxer.brokers.redis", "RedisPublisher", "redis", "redis"),
    "rediss": ("outboxer.brokers.redis", "RedisPublisher", "redis", "redis"),
    "nats": ("outboxer.brokers.nats", "NatsPublisher", "nats", "nats"),
    "mqtt": ("outboxer.brokers.mqtt", "MqttPublisher", "mqtt", "aiomqtt"),
    "mqtts": ("outboxer.brokers.mqtt", "MqttPublisher", "mqtt", "aiomqtt"),
    "http": ("outboxer.brokers.webhook", "WebhookPublisher", "webhook", "httpx"),
    "https": ("outboxer.brokers.webhook", "WebhookPublisher", "webhook", "httpx"),
}


def adapter_class(entry: tuple[str, str, str | None, str | None], what: str) -> Any:
    """The class a registry entry names, importing its driver first (a missing one names
    the extra to install)."""
    module_name, class_name, extra, requirement = entry
    if requirement is not None:
        try:
            importlib.import_module(requirement)
        except ImportError as exc:
            raise MissingDependencyError(requirement, extra or requirement) from exc
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"the {what} is not available in this version") from exc
    return getattr(module, class_name)


def publisher_class(url: str) -> type[Publisher]:
    scheme = urlsplit(url).scheme.lower()
    if scheme not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise ConfigError(f"unknown broker URL scheme {scheme!r} in {url!r}; known: {known}")
    cls: type[Publisher] = adapter_class(REGISTRY[scheme], f"{scheme}:// publisher")
    return cls


def create_publisher(url: str, **options: Any) -> Publisher:
    """A publisher for ``url`` (its scheme picks the adapter), not yet connected."""
    return publisher_class(url)(url, **options)


__all__ = ["REGISTRY", "Outcome", "OutcomeKind", "Publisher", "create_publisher", "publisher_class"]
