from __future__ import annotations

from pathlib import Path

import pytest

from outboxer import ConfigError, load_settings
from outboxer.config import parse_duration


def test_flags_beat_environment_beat_file(tmp_path: Path) -> None:
    config = tmp_path / "outboxer.toml"
    config.write_text(
        'db = "sqlite:///file.db"\nbatch_size = 10\nmax_attempts = 4\npoll_interval = "2s"\n'
        'broker = "memory://file"\n'
    )
    settings = load_settings(
        {"batch_size": "30"},
        config_file=config,
        environ={"OUTBOXER_BATCH_SIZE": "20", "OUTBOXER_MAX_ATTEMPTS": "7"},
    )
    assert (settings.batch_size, settings.max_attempts, settings.poll_interval) == (30, 7, 2.0)
    assert settings.db == "sqlite:///file.db"
    assert settings.destinations["default"].broker == "memory://file"


def test_defaults_are_documented_values() -> None:
    settings = load_settings({}, environ={})
    assert (
        settings.batch_size,
        settings.lock_timeout,
        settings.max_attempts,
        settings.poll_interval,
    ) == (500, 60.0, 10, 1.0)
    assert settings.published_retention == 7 * 86400 and settings.abandoned_retention == 30 * 86400


def test_destinations_from_a_file(tmp_path: Path) -> None:
    config = tmp_path / "o.toml"
    config.write_text("""
[destinations.internal]
broker = "amqp://guest:guest@localhost/"
[destinations.partner]
broker = "https://partner.example/hook"
envelope = "stripped"
routes = { "order.placed" = "/orders" }
options = { secret = "s3cret" }
""")
    settings = load_settings({"broker": "memory://x"}, config_file=config, environ={})
    assert set(settings.destinations) == {"internal", "partner", "default"}
    partner = settings.destinations["partner"]
    assert partner.envelope == "stripped" and partner.routes == {"order.placed": "/orders"}
    assert partner.options == {"secret": "s3cret"}


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(5, 5.0), ("250ms", 0.25), ("30s", 30.0), ("5m", 300.0), ("7d", 604800.0), ("1.5h", 5400.0)],
)
def test_durations(value: object, seconds: float) -> None:
    assert parse_duration(value, "x") == seconds


@pytest.mark.parametrize(
    ("flags", "environ", "fragment"),
    [
        ({"batch_size": "0"}, {}, "--batch-size"),
        ({"batch_size": "many"}, {}, "whole number"),
        ({}, {"OUTBOXER_LOCK_TIMEOUT": "-3"}, "OUTBOXER_LOCK_TIMEOUT"),
        ({}, {"OUTBOXER_POLL_INTERVAL": "0"}, "greater than zero"),
        ({"backoff_jitter": "2"}, {}, "--backoff-jitter"),
        ({"db": "not a url"}, {}, "URL"),
        ({"abandoned_blocks_key": "maybe"}, {}, "true or false"),
        ({"backoff_base": "10", "backoff_max": "5"}, {}, "cap"),
    ],
)
def test_bad_values_are_config_errors_naming_their_source(
    flags: dict[str, str], environ: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_settings(flags, environ=environ)


def test_bad_files_are_config_errors(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("batch_size = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings({}, config_file=broken, environ={})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("bach_size = 3\n")
    with pytest.raises(ConfigError, match="unknown settings"):
        load_settings({}, config_file=unknown, environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_settings({}, config_file=tmp_path / "missing.toml", environ={})
    nobroker = tmp_path / "nobroker.toml"
    nobroker.write_text("[destinations.x]\nenvelope = 'full'\n")
    with pytest.raises(ConfigError, match="needs a broker"):
        load_settings({}, config_file=nobroker, environ={})
