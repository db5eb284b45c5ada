"""A destination name with whitespace around it is refused wherever a name comes in: MySQL's
PAD SPACE collation took 'orders ' for 'orders' (the relay of 'orders' claimed the rows of
'orders '), the other databases did not (nobody claimed them)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import outboxer
from outboxer import ConfigError, load_settings
from outboxer.admin import AdminRequestError, check_destination
from outboxer.cli import main
from outboxer.config import DestinationSettings
from outboxer.contrib.events import record_event

PADDED = ["orders ", " orders", "orders\t", "\norders", "orders\u3000", " "]


@pytest.mark.parametrize("name", PADDED)
def test_an_outbox_refuses_a_padded_destination(name: str) -> None:
    with pytest.raises(ConfigError, match="whitespace"):
        outboxer.Outbox(destinations=("internal", name))


@pytest.mark.parametrize("name", PADDED)
def test_a_message_for_a_padded_destination_is_refused_before_any_sql(name: str) -> None:
    # No connection at all: the refusal comes before the driver is even looked at.
    outbox = outboxer.Outbox()
    with pytest.raises(ConfigError, match="whitespace"):
        outbox.enqueue(object(), "t", {}, destinations=[name])
    with pytest.raises(ConfigError, match="whitespace"):
        outbox.enqueue_many(object(), [{"topic": "t", "payload": {}, "destinations": [name]}])
    with pytest.raises(ConfigError, match="whitespace"):
        asyncio.run(outbox.enqueue_async(object(), "t", {}, destinations=[name]))
    with pytest.raises(ConfigError, match="whitespace"):
        asyncio.run(
            outbox.enqueue_many_async(
                object(), [{"topic": "t", "payload": {}, "destinations": [name]}]
            )
        )


def test_a_recorded_event_for_a_padded_destination_is_refused() -> None:
    class Entity:
        pass

    with pytest.raises(ConfigError, match="whitespace"):
        record_event(Entity(), "t", {}, destinations=["orders "])


@pytest.mark.parametrize("name", [*PADDED, ""])
def test_a_configured_destination_must_be_a_plain_name(name: str) -> None:
    with pytest.raises(ConfigError, match="destination"):
        DestinationSettings(name, "memory://")
    for plain in ("orders", "or ders", "commandes-\u00e9", "x" * 255):  # still accepted
        assert DestinationSettings(plain, "memory://").name == plain
        assert outboxer.Outbox(destinations=(plain,)).destinations == (plain,)
        assert check_destination(plain, None) == plain


def test_a_padded_destination_in_the_file_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "o.toml"
    config.write_text('[destinations."orders "]\nbroker = "memory://"\n')
    with pytest.raises(ConfigError, match="whitespace"):
        load_settings({}, config_file=config, environ={})


@pytest.mark.parametrize("name", PADDED)
def test_replay_to_a_padded_destination_is_refused(name: str) -> None:
    with pytest.raises(AdminRequestError, match="whitespace"):
        check_destination(name, None)
    with pytest.raises(AdminRequestError, match="whitespace"):
        check_destination(name, [name])


def test_the_cli_refuses_a_padded_destination(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'outbox.db'}"
    argv = ["enqueue", "--db", db, "--topic", "t", "--payload", "{}", "--destination", "orders "]
    assert main(argv) == 2
    assert "whitespace" in capsys.readouterr().err
    argv = ["replay", "--db", db, "--all", "--to", "orders "]
    assert main(argv) == 2
    assert "whitespace" in capsys.readouterr().err
