"""`outboxer consume`'s own settings, declared on the relay's mechanism (outboxer.config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from outboxer.config import settings_table
from outboxer.consume_cli import ConsumerSettings, load_consume_settings
from outboxer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_consumer_table_is_the_declarations_table() -> None:
    readme = (ROOT / "README.md").read_text("utf-8")
    start, end = (
        "<!-- consumer settings table: start -->\n",
        "<!-- consumer settings table: end -->",
    )
    table = readme.split(start, 1)[1].split(end, 1)[0]
    assert table == settings_table(ConsumerSettings), "rewrite it with scripts/settings-table"


def test_flags_beat_variables_beat_the_consumer_table(tmp_path: Path) -> None:
    config = tmp_path / "outboxer.toml"
    config.write_text(
        'db = "sqlite:///x.db"\nbroker = "memory://b"\nmax_attempts = 3\n'
        '[consumer]\ngroup = "file"\nbatch = 7\ntopics = ["a", "b"]\noptions = { queue = "q" }\n'
    )
    settings, own = load_consume_settings(
        {"backoff_base": "2s"},
        {"group": "flag"},
        environ={"OUTBOXER_CONSUMER_BATCH": "9", "OUTBOXER_CONSUMER_NAME": "pod-1"},
        config_file=str(config),
    )
    assert (settings.db, settings.max_attempts, settings.backoff_base) == ("sqlite:///x.db", 3, 2.0)
    assert settings.destinations["default"].broker == "memory://b"
    assert own == ConsumerSettings(
        group="flag", topics=("a", "b"), batch=9, name="pod-1", options={"queue": "q"}
    )
    with pytest.raises(ConfigError, match=r"\[consumer\]: batch must be between 1 and 10000"):
        config.write_text("[consumer]\nbatch = 0\n")
        load_consume_settings({}, {}, environ={}, config_file=str(config))
    with pytest.raises(ConfigError, match="no group: pass --group"):
        ConsumerSettings().require("group")


def test_the_consumer_and_the_relay_read_their_shutdown_timeouts_from_their_own_variables() -> None:
    # One variable for both used to set the relay's 20 s grace and the consumer's 30 s at once.
    settings, own = load_consume_settings(
        {},
        {"group": "g"},
        environ={"OUTBOXER_SHUTDOWN_TIMEOUT": "5s", "OUTBOXER_CONSUMER_SHUTDOWN_TIMEOUT": "45s"},
    )
    assert (settings.shutdown_timeout, own.shutdown_timeout) == (5.0, 45.0)
    _, own = load_consume_settings({}, {"group": "g"}, environ={"OUTBOXER_SHUTDOWN_TIMEOUT": "5s"})
    assert own.shutdown_timeout == 30.0


@pytest.mark.parametrize("value", ["0.5ms", "0.0001"])
def test_a_consumer_interval_below_a_millisecond_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="--shutdown-timeout must be at least 1ms"):
        load_consume_settings({}, {"group": "g", "shutdown_timeout": value}, environ={})
