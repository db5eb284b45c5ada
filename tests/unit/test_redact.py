"""Secrets never reach a log line, an error message, a repr or an API answer."""

from __future__ import annotations

import logging

import pytest

from outboxer.brokers import create_publisher
from outboxer.config import DestinationSettings, Settings, load_settings
from outboxer.errors import ConfigError
from outboxer.redact import (
    MASK,
    get_logger,
    redact_text,
    redact_url,
    register_secret,
)
from outboxer.stores import create_store


@pytest.mark.parametrize(
    ("url", "secret", "kept"),
    [
        ("amqp://guest:s3cr3t-pass@host:5672/", "s3cr3t-pass", "guest"),
        ("nats://TOKEN-abc123@127.0.0.1:4222", "TOKEN-abc123", "127.0.0.1:4222"),
        ("https://hooks.example/x?api_key=K-123456&topic=a", "K-123456", "topic=a"),
        ("https://fn.example/api?code=azure-code-999", "azure-code-999", "fn.example"),
        ("kafka://h:9092?sasl_password=pw-99999999", "pw-99999999", "h:9092"),
        ("redis://:redispass@127.0.0.1:6379/0", "redispass", "127.0.0.1:6379"),
        ("https://h/x?X-Amz-Signature=abcdef0123", "abcdef0123", "https://h/x"),
        ("https://h/cb#access_token=frag-secret", "frag-secret", "https://h/cb"),
    ],
)
def test_redact_url_hides_every_kind_of_credential(url: str, secret: str, kept: str) -> None:
    shown = redact_url(url)
    assert secret not in shown
    assert kept in shown
    assert MASK in shown


@pytest.mark.parametrize(
    ("url", "secret", "kept"),
    [
        # urlsplit ends the host at the first '/', '?' or '#', inside the password.
        ("postgresql://app:Ab/cd+ef==@db:5432/app", "Ab/cd+ef==", "@db:5432/app"),
        ("postgresql://app:Ab?cd@db/app", "Ab?cd", "@db/app"),
        ("postgresql://app:Ab#cd@db/app", "Ab#cd", "@db/app"),
        ("postgresql://app:12/34@db/app?password=zz", "12/34", "@db/app"),
        ("nats://tok/en-9@host:4222", "tok/en-9", "@host:4222"),
    ],
)
def test_a_password_with_an_unencoded_slash_question_mark_or_hash_is_hidden(
    url: str, secret: str, kept: str
) -> None:
    for shown in (redact_url(url), redact_text(f"cannot connect to {url}: refused")):
        assert secret not in shown
        assert secret.split("/")[0].split("?")[0].split("#")[0] not in shown.split("://")[1][:8]
        assert kept in shown
    assert "zz" not in redact_url("postgresql://app:12/34@db/app?password=zz")


def test_an_at_sign_in_a_plain_url_s_query_is_only_data() -> None:
    assert redact_url("https://hooks.example/n?to=a@b.c") == "https://hooks.example/n?to=a@b.c"


def test_a_db_url_with_an_unencoded_slash_in_its_password_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as error:
        load_settings({"db": "postgresql://app:Xy/zw-pass+9==@db:5432/app"}, environ={})
    message = str(error.value)
    assert "Xy" not in message and "zw-pass" not in message
    assert "percent-encode" in message


def test_a_user_name_without_password_stays_visible_outside_token_schemes() -> None:
    assert redact_url("amqp://reporting@host/") == "amqp://reporting@host/"


def test_redact_text_finds_urls_inside_driver_messages() -> None:
    text = "cannot connect to 'amqp://u:hunter2@10.0.0.1/vh' (Connection refused), retrying"
    shown = redact_text(text)
    assert "hunter2" not in shown
    assert "Connection refused" in shown


def test_a_mistyped_scheme_does_not_print_the_password() -> None:
    with pytest.raises(ConfigError) as store_error:
        create_store("postgersql://app:db-password-1@db/app")
    with pytest.raises(ConfigError) as broker_error:
        create_publisher("amqq://app:broker-password-1@mq/")
    assert "db-password-1" not in str(store_error.value)
    assert "broker-password-1" not in str(broker_error.value)
    assert "postgersql" in str(store_error.value)


def test_settings_repr_holds_no_url_secret_nor_webhook_secret_nor_token() -> None:
    settings = Settings(
        db="postgresql://app:repr-db-pass@db/app",
        destinations={
            "partner": DestinationSettings(
                "partner",
                "https://partner.example/hook?token=repr-query-token",
                options={"secret": "repr-signing-secret", "timeout": 5},
            )
        },
        http_token="repr-http-token-0123456789",
    )
    shown = repr(settings)
    for secret in ("repr-db-pass", "repr-query-token", "repr-signing-secret", "repr-http-token"):
        assert secret not in shown
    assert "partner.example" in shown
    assert "'timeout': 5" in shown


def test_a_bad_db_url_in_settings_is_reported_without_its_password() -> None:
    with pytest.raises(ConfigError) as error:
        load_settings({"db": "app:bad-url-password@db/app"}, environ={})
    assert "bad-url-password" not in str(error.value)


def test_outboxer_loggers_mask_urls_and_registered_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    register_secret("registered-signing-secret-42")
    logger = get_logger("outboxer.test-redaction")
    with caplog.at_level(logging.INFO, logger="outboxer.test-redaction"):
        logger.info("connect to %s failed", "nats://nats-token-777@127.0.0.1:4222")
        logger.warning("receiver echoed %r", "sig=registered-signing-secret-42")
        try:
            raise RuntimeError("amqp://u:trace-pass-31@h/ refused")
        except RuntimeError:
            logger.exception("publish failed")
    text = caplog.text
    assert "nats-token-777" not in text
    assert "registered-signing-secret-42" not in text
    assert "trace-pass-31" not in text
    assert "publish failed" in text


def test_a_publisher_registers_its_url_secrets_for_every_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = create_publisher("memory://u:memory-url-password@localhost/")
    assert "memory-url-password" not in publisher.safe_url
    logger = get_logger("outboxer.test-redaction")
    with caplog.at_level(logging.INFO, logger="outboxer.test-redaction"):
        logger.info("a driver said: auth failed for password memory-url-password")
    assert "memory-url-password" not in caplog.text


def test_health_problems_show_an_outage_without_the_nats_token() -> None:
    from outboxer.relay import Relay

    relay = Relay(create_store("sqlite:///unused.db"), {"default": create_publisher("memory://")})
    relay._outage("broker default", "unreachable (cannot connect to nats://health-tok-5@h:4222)")
    (problem,) = relay.health_problems()[:1]
    assert "health-tok-5" not in problem
    assert "h:4222" in problem


def test_an_mqtt_url_without_a_host_is_refused_without_its_password() -> None:
    with pytest.raises(ConfigError) as error:
        create_publisher("mqtt://user:mqtt-pass-123@/topic")
    assert "mqtt-pass-123" not in str(error.value) and "needs a host" in str(error.value)
