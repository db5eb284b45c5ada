"""`outboxer stream-relay`'s own settings, declared on the relay's mechanism (outboxer.config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from outboxer.config import StreamSettings, load_stream_settings, settings_table
from outboxer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_stream_relay_table_is_the_declarations_table() -> None:
    readme = (ROOT / "README.md").read_text("utf-8")
    start, end = (
        "<!-- stream relay settings table: start -->\n",
        "<!-- stream relay settings table: end -->",
    )
    table = readme.split(start, 1)[1].split(end, 1)[0]
    assert table == settings_table(StreamSettings), "rewrite it with scripts/settings-table"


def test_flags_beat_variables_beat_the_stream_relay_table(tmp_path: Path) -> None:
    config = tmp_path / "outboxer.toml"
    config.write_text(
        'db = "postgresql://h/app"\nbroker = "memory://b"\nmax_attempts = 3\nbatch_size = 9\n'
        '[stream_relay]\nmode = "wal"\ndestination = "file"\nbatch_size = 7\n'
        'poll_interval = "1s"\nslot_prefix = "app"\n'
    )
    settings, own = load_stream_settings(
        {"backoff_base": "2s"},
        {"destination": "flag"},
        environ={"OUTBOXER_STREAM_POLL_INTERVAL": "50ms", "OUTBOXER_POLL_INTERVAL": "9s"},
        config_file=str(config),
    )
    assert (settings.max_attempts, settings.backoff_base) == (3, 2.0)
    # The table relay's batch_size and poll_interval are other settings: not these.
    assert (settings.batch_size, settings.poll_interval) == (9, 9.0)
    assert own == StreamSettings(
        mode="wal", destination="flag", slot_prefix="app", batch_size=7, poll_interval=0.05
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "queue"}, "mode must be one of log, wal"),
        ({"mode": "wal", "retention_days": 3}, "retention_days is for mode log"),
        ({"mode": "log", "create_slot": True}, "create_slot is for mode wal"),
        ({"batch_size": 0}, "between 1 and 10000"),
        ({"poll_interval": "0s"}, "greater than zero"),
    ],
)
def test_bad_stream_settings_are_config_errors(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_stream_settings({}, values, environ={})


def test_an_unknown_key_of_the_stream_relay_table_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "outboxer.toml"
    config.write_text('[stream_relay]\nmod = "log"\n')
    with pytest.raises(ConfigError, match="mod"):
        load_stream_settings({}, {}, environ={}, config_file=str(config))


def test_no_mode_is_a_config_error_naming_its_three_places() -> None:
    _, own = load_stream_settings({}, {}, environ={})
    with pytest.raises(
        ConfigError, match=r"--mode log.*OUTBOXER_STREAM_MODE.*\[stream_relay\] mode"
    ):
        own.require_mode()
