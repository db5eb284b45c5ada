"""Settings whose URL is mistyped must be refused without echoing the credentials in it."""

from __future__ import annotations

import pytest

from outboxer.config import DestinationSettings, Pairs, Settings, load_settings
from outboxer.errors import ConfigError
from outboxer.redact import redact_text, redact_url


@pytest.mark.parametrize(
    ("flags", "environ", "secret"),
    [
        # "://" mistyped: the value is no URL, yet its password or query key is a secret.
        ({"db": "postgres:/app:audit-pw-slash-1@db/app"}, {}, "audit-pw-slash-1"),
        ({"db": "postgresql//app:audit-pw-colon-2@db/app"}, {}, "audit-pw-colon-2"),
        (
            {"claim_check_store": "s3//bucket/p?aws_secret_access_key=audit-s3-key-3"},
            {},
            "audit-s3-key-3",
        ),
        # The "@host" forgotten: the password reads as a port, and the error showed it.
        ({"broker": "amqp://guest:audit-pw-port-4"}, {}, "audit-pw-port-4"),
        ({"broker": "redis://:audit-pw-port-5"}, {}, "audit-pw-port-5"),
        # OUTBOXER_DB separates databases by white space: a password with a space is cut
        # in two, its first half read as the port of db1.
        ({}, {"OUTBOXER_DB": "postgresql://u:auditpw6 second-half@h/db"}, "auditpw6"),
    ],
)
def test_a_mistyped_url_is_refused_without_its_secret(
    flags: dict[str, object], environ: dict[str, str], secret: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load_settings(flags, environ=environ, config_file="/dev/null")
    assert secret not in str(error.value)
    assert "second-half" not in str(error.value)


def test_a_non_numeric_port_is_masked_in_logged_urls() -> None:
    # A driver's message about "amqp://guest:PASSWORD" (no host) logs the password as a port.
    assert "audit-pw-port-7" not in redact_url("amqp://guest:audit-pw-port-7")
    assert "audit-pw-port-8" not in redact_text("cannot connect to redis://:audit-pw-port-8 now")
    # A numeric port is no secret, and stays for debugging.
    assert redact_url("amqp://guest:pw@mq:5672/") == "amqp://guest:***@mq:5672/"
    assert redact_url("amqp://mq:5672/") == "amqp://mq:5672/"


def test_the_error_still_says_which_setting_and_what_is_wrong() -> None:
    with pytest.raises(ConfigError) as error:
        Settings(db="postgres:/app:audit-pw-9@db/app")
    assert "db must be a URL" in str(error.value)
    assert "postgres:/app:***@db/app" in str(error.value)
    with pytest.raises(ConfigError) as port_error:
        Settings(broker="amqp://guest:audit-pw-10")
    assert "broker" in str(port_error.value)
    assert "port" in str(port_error.value)


def test_secrets_nested_in_destination_options_stay_out_of_repr_and_logs() -> None:
    """Kafka takes librdkafka's settings as ``options = { config = { ... } }``: the
    ``sasl.password`` inside was printed by repr() and unmasked in log lines."""
    settings = Settings(
        destinations={
            "events": DestinationSettings(
                "events",
                "kafka://broker:9092",
                options={
                    "config": {"sasl.password": "nested-sasl-pw-1", "linger.ms": 5},
                    "proxy": "http://proxyuser:nested-proxy-pw-2@proxy:3128",
                },
            )
        }
    )
    shown = repr(settings)
    assert "nested-sasl-pw-1" not in shown
    assert "nested-proxy-pw-2" not in shown
    assert "'linger.ms': 5" in shown and "proxy:3128" in shown
    # A library's error that echoes them is masked too (they were registered).
    logged = redact_text("SASL authentication failed with password nested-sasl-pw-1")
    assert "nested-sasl-pw-1" not in logged
    assert "nested-proxy-pw-2" not in redact_text("proxy refused nested-proxy-pw-2")


def test_receiver_options_with_secret_names_stay_out_of_repr_and_logs() -> None:
    """``outboxer consume --option sasl_password=…`` (or ``[consumer] options``): the
    consumer's settings printed it in repr(), and log lines echoing it were not masked."""
    from outboxer.consume_cli import ConsumerSettings

    for given in (
        ["sasl_password=opt-secret-pw-1", "ack_wait=30"],  # flags
        {"sasl_password": "opt-secret-pw-1", "ack_wait": 30},  # the file's table
    ):
        # As declared_values reads the flag, the variable or the table.
        settings = ConsumerSettings(options=Pairs().parse(given, "--option"))
        assert settings.options is not None
        assert settings.options["sasl_password"] == "opt-secret-pw-1"  # the value is intact
        shown = repr(settings)
        assert "opt-secret-pw-1" not in shown
        assert "ack_wait" in shown
    assert "opt-secret-pw-1" not in redact_text("login failed for password opt-secret-pw-1")
