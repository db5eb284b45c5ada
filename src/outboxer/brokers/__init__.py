"""Publishers, one module per broker, chosen by URL scheme and imported lazily."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from outboxer.brokers.base import Outcome, OutcomeKind, Publisher
from outboxer.config import PASSED_BY_THE_RELAY, check_url
from outboxer.errors import ConfigError, MissingDependencyError
from outboxer.redact import redact_url

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


def publisher_class(url: str) -> type[Publisher]:
    check_url(url, "broker URL")
    scheme = urlsplit(url).scheme.lower()
    if scheme not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise ConfigError(
            f"unknown broker URL scheme {scheme!r} in {redact_url(url)!r}; known: {known}"
        )
    cls: type[Publisher] = adapter_class(REGISTRY[scheme], f"{scheme}:// publisher")
    return cls


def adapter_class(entry: tuple[str, str, str | None, str | None], what: str) -> Any:
    """The class a registry entry names, importing its driver first (a missing one names
    the extra to install); the receivers' registry (outboxer.receivers) uses it too."""
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


def publisher_options(cls: type[Publisher]) -> frozenset[str] | None:
    """The options ``cls`` takes as keywords (a destination's ``options``); None: any."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return None
    names = frozenset(parameter.name for parameter in parameters)
    return names - PASSED_BY_THE_RELAY - {"self", "url"}


def check_options(url: str, cls: type[Publisher], options: Mapping[str, Any]) -> None:
    """ConfigError naming the known options when ``options`` holds one ``cls`` does not take
    (the constructor would raise a TypeError)."""
    known = publisher_options(cls)
    if known is None:
        return
    if unknown := sorted(set(options) - known):
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)} for the broker {redact_url(url)!r}; "
            f"known: {', '.join(sorted(known)) or 'none'}"
        )


def create_publisher(url: str, **options: Any) -> Publisher:
    """A publisher for ``url`` (its scheme picks the adapter), not yet connected."""
    cls = publisher_class(url)
    check_options(url, cls, {k: v for k, v in options.items() if k not in PASSED_BY_THE_RELAY})
    return cls(url, **options)


__all__ = [
    "REGISTRY",
    "Outcome",
    "OutcomeKind",
    "Publisher",
    "check_options",
    "create_publisher",
    "publisher_class",
    "publisher_options",
]
