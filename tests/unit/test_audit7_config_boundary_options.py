"""Broker and receiver options checked at the boundary, when the adapter is built.

Durations take the settings' syntax (``250ms``, ``30s``, ``5m``) and are refused when they
cannot work (nan, inf, negative, zero); every bad value is a ConfigError naming the option,
never an error inside the relay at connect or publish. Empty ``OUTBOXER_*`` variables and
``backoff_base > backoff_max`` are errors naming the variable or the settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from outboxer.brokers import create_publisher
from outboxer.config import load_settings
from outboxer.errors import ConfigError
from outboxer.receivers import create_receiver

NATS = "nats://127.0.0.1:4222"
REDIS = "redis://127.0.0.1:6379/0"
MQTT = "mqtt://127.0.0.1:1883"


def receiver(url: str, **options: Any) -> Any:
    return create_receiver(url, group="g", topics=["t"], **options)


# ----- durations: the settings' syntax --------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "attribute", "seconds"),
    [
        (lambda: receiver(REDIS, claim_idle="90s"), "claim_idle", 90.0),
        (lambda: receiver(REDIS, claim_idle="250ms"), "claim_idle", 0.25),
        (lambda: receiver(f"{REDIS}?claim_idle=2m"), "claim_idle", 120.0),
        (lambda: receiver(NATS, ack_wait="1m"), "ack_wait", 60.0),
        (lambda: receiver(NATS, ack_wait=45), "ack_wait", 45.0),
        (lambda: receiver(MQTT, session_expiry="1d"), "session_expiry", 86_400),
        (lambda: create_publisher(f"{NATS}?duplicate_window=2m"), "duplicate_window", 120.0),
        (lambda: create_publisher(f"{NATS}?connect_timeout=500ms"), "connect_timeout", 0.5),
        (lambda: create_publisher("amqp://g:g@h/?connect_timeout=3s"), "connect_timeout", 3.0),
        (lambda: create_publisher("kafka://h:9092?connect_timeout=1m"), "connect_timeout", 60.0),
        (lambda: create_publisher("http://h/hook?timeout=2500ms"), "timeout", 2.5),
        (lambda: create_publisher(f"{MQTT}?keepalive=2m"), "keepalive", 120),
    ],
)
def test_duration_options_take_the_settings_syntax(
    build: Any, attribute: str, seconds: float
) -> None:
    assert getattr(build(), attribute) == seconds


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0", "0s", "soon", "5 parsecs", "1e400"])
@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda v: receiver(REDIS, claim_idle=v), "redis option claim_idle"),
        (lambda v: receiver(NATS, ack_wait=v), "nats option ack_wait"),
        (lambda v: receiver(MQTT, session_expiry=v), "mqtt option session_expiry"),
        (
            lambda v: create_publisher(f"{NATS}?duplicate_window={v}"),
            "nats option duplicate_window",
        ),
        (lambda v: create_publisher(f"{NATS}?connect_timeout={v}"), "nats option connect_timeout"),
        (lambda v: create_publisher(f"amqp://h/?connect_timeout={v}"), "rabbitmq option"),
        (lambda v: create_publisher(f"kafka://h:9092?connect_timeout={v}"), "kafka option"),
        (lambda v: create_publisher(f"http://h/hook?timeout={v}"), "webhook option timeout"),
        (lambda v: create_publisher(f"{MQTT}?keepalive={v}"), "mqtt option keepalive"),
    ],
)
def test_a_duration_that_cannot_work_is_refused_naming_the_option(
    build: Any, name: str, value: str
) -> None:
    with pytest.raises(ConfigError, match=name):
        build(value)


@pytest.mark.parametrize(
    ("build", "name"),
    [
        # MQTT carries both in whole seconds; the keepalive in two bytes.
        (lambda: receiver(MQTT, session_expiry="1.5s"), "mqtt option session_expiry"),
        (lambda: create_publisher(f"{MQTT}?keepalive=1.5"), "mqtt option keepalive"),
        (lambda: create_publisher(f"{MQTT}?keepalive=70000"), "mqtt option keepalive"),
        (lambda: create_publisher(f"{MQTT}?max_inflight=70000"), "mqtt option max_inflight"),
        (lambda: create_publisher(f"{MQTT}?max_inflight=-1"), "mqtt option max_inflight"),
        (lambda: create_publisher(f"{REDIS}?maxlen=1_000"), "redis option maxlen"),
        (lambda: create_publisher(f"{REDIS}?maxlen=0"), "redis option maxlen"),
        (lambda: create_publisher(f"{REDIS}?maxlen={2**63}"), "redis option maxlen"),
        (lambda: create_publisher("file:///tmp/x.jsonl?fsync=maybe"), "fsync"),
    ],
)
def test_other_options_out_of_range_are_refused_naming_the_option(build: Any, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        build()


def test_file_fsync_takes_every_spelling_of_no() -> None:
    assert create_publisher("file:///tmp/x.jsonl?fsync=off").fsync is False
    assert create_publisher("file:///tmp/x.jsonl?fsync=yes").fsync is True


# ----- NATS subjects ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topic", "why"),
    [
        ("orders..created", "empty token"),
        ("orders.", "empty token"),
        ("orders created", "white space"),
        ("orders.>.eu", "only be the last"),
    ],
)
def test_an_invalid_consumer_subject_says_so_not_a_stream_conflict(topic: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"not a valid NATS subject: .*{why}"):
        create_receiver(NATS, group="g", topics=[topic])


def test_valid_consumer_subjects_and_wildcards_pass() -> None:
    built = create_receiver(NATS, group="g", topics=["orders.*.eu", "audit.>", "a*b"])
    assert built.topics == ["orders.*.eu", "audit.>", "a*b"]


@pytest.mark.parametrize(
    ("query", "why"),
    [
        ("subject_prefix=app..", "empty token"),
        ("subject_prefix=app.*.", "no wildcards"),
        ("subject_prefix=app%20x.", "white space"),
        ("subjects=app..x", "empty token"),
        ("subjects=app.>.x", "only be the last"),
    ],
)
def test_an_invalid_publisher_subject_is_refused_at_build(query: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"nats option .*NATS subject.*{why}"):
        create_publisher(f"{NATS}?{query}")


def test_a_route_to_an_invalid_subject_is_refused_at_build() -> None:
    with pytest.raises(ConfigError, match=r"route for topic 'orders'.*wildcards"):
        create_publisher(f"{NATS}?subject_prefix=app.", routes={"orders": "orders.>"})


# ----- settings -----------------------------------------------------------------------------


def test_backoff_base_above_backoff_max_names_both_settings() -> None:
    with pytest.raises(
        ConfigError, match=r"backoff_base \(1m\) must be at most backoff_max \(30s\)"
    ):
        load_settings({"backoff_base": "1m", "backoff_max": "30s"}, environ={})


@pytest.mark.parametrize(
    "variable", ["OUTBOXER_LOCK_TIMEOUT", "OUTBOXER_BATCH_SIZE", "OUTBOXER_DB", "OUTBOXER_BROKER"]
)
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_environment_variable_is_an_error_naming_it(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{variable} is set but empty"):
        load_settings({}, environ={variable: value})


def test_an_empty_config_variable_is_an_error_not_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outboxer.toml").write_text("batch_size = 7\n")
    with pytest.raises(ConfigError, match="OUTBOXER_CONFIG is set but empty"):
        load_settings({}, environ={"OUTBOXER_CONFIG": ""})
    # A flag still wins over the variable.
    given = load_settings(
        {}, environ={"OUTBOXER_CONFIG": ""}, config_file=tmp_path / "outboxer.toml"
    )
    assert given.batch_size == 7
