"""Broker URL options (review of the check of unknown and repeated names).

- Redis and Kafka took a name given twice without a word: redis-py's own parsing keeps the
  first value, outboxer's the last (``stream_prefix=a&stream_prefix=b`` published under
  ``b``); librdkafka got the last (``acks=1&acks=all`` passed the check of ``acks``).
- The check of repeated names counted each name with ``list.count``: quadratic, 0.5 s for
  8,000 names, 13 s for 40,000 (publisher and receiver alike).
- The message listed every unknown or repeated name: 71 kB for 8,000 of them.
"""

from __future__ import annotations

import time

import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.nats import NatsPublisher
from outboxer.errors import ConfigError
from outboxer.receivers import create_receiver

REPEATED = [
    "redis://127.0.0.1:6379/0?stream_prefix=a&stream_prefix=b",
    "rediss://127.0.0.1:6379/0?socket_timeout=1&socket_timeout=2",
    "redis://127.0.0.1:6379/0?claim_idle=1&claim_idle=2&maxlen=5",
    "kafka://127.0.0.1:9092?acks=1&acks=all",
    "kafka://127.0.0.1:9092?linger.ms=5&linger.ms=50",
]


@pytest.mark.parametrize("url", REPEATED)
def test_an_option_given_twice_is_refused_on_redis_and_kafka(url: str) -> None:
    with pytest.raises(ConfigError, match="more than once"):
        create_publisher(url)


def test_the_consumers_option_given_twice_on_redis_is_refused_by_its_receiver_too() -> None:
    with pytest.raises(ConfigError, match="'socket_timeout' given more than once"):
        create_receiver(
            "redis://127.0.0.1:6379/0?claim_idle=5&socket_timeout=1&socket_timeout=2",
            group="g",
            topics=["t"],
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda url: create_publisher(url),
        lambda url: create_receiver(url, group="g", topics=["t"]),
    ],
    ids=["publisher", "receiver"],
)
def test_thousands_of_repeated_names_are_refused_at_once(make: object) -> None:
    url = "nats://127.0.0.1:4222?" + "&".join(["durable=x"] * 40_000)
    began = time.perf_counter()
    with pytest.raises(ConfigError, match="'durable' given more than once"):
        make(url)  # type: ignore[operator]
    assert time.perf_counter() - began < 1.5  # before: 13 s


#: Every query option of the NATS publisher: 13.
NATS_OPTIONS = sorted(NatsPublisher.url_options)


@pytest.mark.parametrize(
    ("query", "more"),
    [
        ("&".join(f"x{i}=1" for i in range(5_000)), "and 4990 more"),
        ("&".join(f"{name}=1&{name}=2" for name in NATS_OPTIONS), "and 3 more"),
    ],
    ids=["unknown", "repeated"],
)
def test_the_message_lists_ten_names_and_counts_the_rest(query: str, more: str) -> None:
    with pytest.raises(ConfigError) as caught:
        create_publisher("nats://127.0.0.1:4222?" + query)
    message = str(caught.value)
    assert more in message, message
    assert len(message) < 1_500, len(message)  # before: 44 kB for the 5,000 unknown
