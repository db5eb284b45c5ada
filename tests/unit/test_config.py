from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from outboxer import ConfigError, Relay, create_publisher, create_store, load_settings
from outboxer.cli import build_parser
from outboxer.config import (
    Pairs,
    Settings,
    Text,
    TextList,
    Whole,
    add_flags,
    declarations,
    declared_values,
    file_table,
    flags_from_args,
    parse_duration,
    read_config_file,
    setting,
    settings_table,
)


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
        ({"backoff_base": "10", "backoff_max": "5"}, {}, "backoff_max"),
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


# ----- one declaration per setting --------------------------------------------------------


def test_every_setting_but_the_tables_is_declared_once_with_its_derived_names() -> None:
    declared = {d.name: d for d in declarations(Settings)}
    fields = {item.name for item in dataclasses.fields(Settings)}
    assert set(declared) == fields - {"destinations", "databases"}
    batch = declared["batch_size"]
    assert (batch.flag, batch.env, batch.key, batch.default) == (
        "--batch-size",
        "OUTBOXER_BATCH_SIZE",
        "batch_size",
        500,
    )
    assert declared["published_retention"].shown_default == "7d"
    assert declared["relay_id"].shown_default == "host:pid:random"


def test_the_cli_flags_and_their_help_come_from_the_declarations() -> None:
    parser = build_parser()
    relay = parser.parse_args(["relay", "--batch-size", "30", "--exit-when-idle"])
    assert flags_from_args(relay, Settings) == {"batch_size": "30", "exit_when_idle": True}
    help_text = " ".join(_subparser(parser, "relay").format_help().split())
    for declared in declarations(Settings):
        if "relay" in declared.commands:
            assert declared.flag in help_text
            assert declared.env in help_text
    assert "rows claimed per batch (1 to 10000; default 500; env OUTBOXER_BATCH_SIZE)" in help_text
    cleanup = " ".join(_subparser(parser, "cleanup").format_help().split())
    assert "--inbox-retention" in cleanup and "--batch-size" not in cleanup


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    chosen: argparse.ArgumentParser = commands.choices[name]
    return chosen


def test_the_readme_settings_table_is_the_declarations_table() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text("utf-8")
    start, end = "<!-- settings table: start -->\n", "<!-- settings table: end -->"
    assert start in readme and end in readme
    table = readme.split(start, 1)[1].split(end, 1)[0]
    assert table == settings_table(), "rewrite it with scripts/settings-table"


def test_settings_built_in_python_pass_the_same_checks() -> None:
    with pytest.raises(ConfigError, match="batch_size must be between 1 and 10000"):
        Settings(batch_size=0)
    with pytest.raises(ConfigError, match="lock_timeout must be a finite duration"):
        Settings(lock_timeout=math.nan)
    settings = Settings(broker="memory://py", poll_interval=0.5)
    assert settings.destinations["default"].broker == "memory://py"
    assert settings.poll_interval == 0.5


def test_the_busy_poll_is_a_short_duration() -> None:
    assert Settings().busy_poll_interval == 0.003
    settings = load_settings(
        {"broker": "memory://busy"}, environ={"OUTBOXER_BUSY_POLL_INTERVAL": "5ms"}
    )
    assert settings.busy_poll_interval == 0.005
    for wrong, fragment in (("0.5ms", "at least 1ms"), ("2s", "at most 1s"), ("0", "greater")):
        with pytest.raises(ConfigError, match=f"busy-poll-interval must be .*{fragment}"):
            load_settings({"broker": "memory://busy", "busy_poll_interval": wrong}, environ={})


def test_an_unknown_flag_name_is_an_error_not_ignored() -> None:
    with pytest.raises(ConfigError, match=r"unknown settings \['batchsize'\]"):
        load_settings({"batchsize": 3}, environ={})


# ----- numbers, durations and names: ASCII, finite and bounded ----------------------------


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        ({"lock_timeout": "nan"}, "--lock-timeout must be a duration"),
        ({"lock_timeout": "inf"}, "--lock-timeout must be a duration"),
        ({"lock_timeout": "1e400"}, "--lock-timeout must be a duration"),
        ({"lock_timeout": "1" * 400}, "--lock-timeout must be a finite duration"),
        ({"lock_timeout": math.nan}, "--lock-timeout must be a finite duration"),
        ({"lock_timeout": math.inf}, "--lock-timeout must be a finite duration"),
        ({"lock_timeout": 10**400}, "--lock-timeout must be a finite duration"),
        ({"lock_timeout": "31d"}, "--lock-timeout must be at most 30d"),
        # A lease shorter than a publish is lost while its batch is still being published.
        ({"lock_timeout": "100ms"}, "--lock-timeout must be at least 500ms"),
        # Below a millisecond a poll spins a core: a typo, not a setting.
        ({"poll_interval": "0.001ms"}, "--poll-interval must be at least 1ms"),
        ({"publish_timeout": 0.0001}, "--publish-timeout must be at least 1ms"),
        ({"backoff_base": "0.5ms"}, "--backoff-base must be at least 1ms"),
        ({"backoff_max": "100000000000000000000"}, "--backoff-max must be at most 30d"),
        ({"backoff_max": 1e20}, "--backoff-max must be at most 30d"),
        ({"poll_interval": "²"}, "--poll-interval must be a duration"),
        ({"published_retention": "3651d"}, "--published-retention must be at most 3650d"),
        ({"batch_size": "٣"}, "--batch-size must be a whole number"),
        ({"batch_size": "1" * 5000}, "--batch-size must be a whole number"),
        ({"backoff_multiplier": "nan"}, "--backoff-multiplier must be a number"),
        ({"backoff_multiplier": math.inf}, "--backoff-multiplier must be a finite number"),
        ({"backoff_jitter": "0x1"}, "--backoff-jitter must be a number"),
        ({"http": "127.0.0.1:²"}, "--http must be HOST:PORT"),
        ({"http": "127.0.0.1:٨٠"}, "--http must be HOST:PORT"),
        ({"table": "outbox\n"}, "--table: table name 'outbox\\n'"),
        ({"schema": "s; DROP TABLE x"}, "--schema: schema name"),
        ({"relay_id": "r" * 201}, "--relay-id must be printable text of at most 200"),
        ({"relay_id": "a\nb"}, "--relay-id must be printable text"),
    ],
)
def test_non_finite_absurd_and_non_ascii_values_are_refused(
    flags: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_settings(flags, environ={})


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("30d", 30 * 86400.0), (" 2.5s ", 2.5), (3600, 3600.0), ("0.001", 0.001), ("1ms", 0.001)],
)
def test_bounded_durations_still_take_every_documented_form(value: object, seconds: float) -> None:
    assert load_settings({"poll_interval": value}, environ={}).poll_interval == seconds


def test_a_table_name_ending_in_a_newline_is_refused_by_the_store_too() -> None:
    with pytest.raises(ConfigError, match="table name"):
        create_store("sqlite:///unused.db", table="outbox\n")


# ----- URLs with ports that are no ports ----------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        ({"db": "postgresql://h:abc/db"}, "--db: the port 'abc'"),
        ({"db": "postgresql://u:pw@h:5432,h2:x/db"}, "--db: the port 'x'"),
        ({"db": "mysql://h:٣٣٠٦/db"}, "--db: the port '٣٣٠٦'"),
        ({"db": "postgresql://[::1]:port/db"}, "--db: the port 'port'"),
        ({"broker": "amqp://h:99999/"}, "--broker: the port '99999'"),
        ({"broker": "amqp://[::1/"}, "--broker is not a valid URL"),
    ],
)
def test_a_url_whose_port_is_not_a_port_is_a_config_error(
    flags: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_settings(flags, environ={})


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:p@h1:5432,h2:5433/db",
        "postgresql://[::1]:5432/db",
        "postgresql:///db?host=/var/run/postgresql",
        "sqlite:////abs/path.db",
        "amqp://guest:gu:est@h:5672/",
    ],
)
def test_urls_with_good_ports_or_none_pass(url: str) -> None:
    assert load_settings({"db": url}, environ={}).db == url


def test_the_port_check_keeps_the_password_out_of_the_message() -> None:
    with pytest.raises(ConfigError) as error:
        load_settings({"db": "postgresql://app:port-secret-1@h:abc/db"}, environ={})
    assert "port-secret-1" not in str(error.value)


def test_registries_check_ports_for_library_callers() -> None:
    with pytest.raises(ConfigError, match="port '99999'"):
        create_publisher("amqp://h:99999/")
    with pytest.raises(ConfigError, match="port 'abc'"):
        create_store("postgresql://h:abc/db")


# ----- destination options ------------------------------------------------------------------


def test_an_unknown_destination_option_names_the_known_ones(tmp_path: Path) -> None:
    config = tmp_path / "o.toml"
    config.write_text(
        'db = "sqlite:///x.db"\n[destinations.x]\nbroker = "amqp://h/"\noptions = { nope = 1 }\n'
    )
    settings = load_settings({}, config_file=config, environ={})
    with pytest.raises(ConfigError) as error:
        Relay.from_settings(settings)
    message = str(error.value)
    assert "unknown option(s) nope" in message
    assert "connect_timeout" in message and "exchange" in message


def test_a_publisher_without_options_says_so() -> None:
    with pytest.raises(ConfigError, match="known: none"):
        create_publisher("memory://x", nope=1)


@pytest.mark.parametrize("name", ["routes", "publish_timeout", "url"])
def test_relay_keywords_are_no_destination_options(tmp_path: Path, name: str) -> None:
    config = tmp_path / "o.toml"
    config.write_text(f'[destinations.x]\nbroker = "memory://"\noptions = {{ {name} = 1 }}\n')
    with pytest.raises(ConfigError, match=f"{name} cannot be an option"):
        load_settings({}, config_file=config, environ={})


# ----- files: encoding, kind, and TOML types -----------------------------------------------


def test_a_file_that_is_not_utf8_or_not_a_file_is_a_config_error(tmp_path: Path) -> None:
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'db = "sqlite:///caf\xe9.db"\n')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_settings({}, config_file=latin, environ={})
    with pytest.raises(ConfigError, match="is a directory"):
        load_settings({}, config_file=tmp_path, environ={})
    with pytest.raises(ConfigError, match="is a directory"):
        load_settings({}, environ={"OUTBOXER_CONFIG": str(tmp_path)})


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("outboxer = 1\n", "outboxer must be a table ([outboxer]) of settings, not an integer"),
        ('outboxer = "x"\n', "outboxer must be a table ([outboxer]) of settings, not a string"),
        ("destinations = 1\n", "destinations must be a table of named destinations"),
        ("destinations = [1]\n", "not an array"),
        ("[destinations]\nx = 1\n", "destination 'x' must be a table with a broker URL"),
        ("[destinations.x]\nbroker = 1\n", "broker must be a URL string, not an integer"),
        ('[destinations.x]\nbroker = "memory://"\nenvelope = 1\n', "envelope must be"),
        ('[destinations.x]\nbroker = "memory://"\nroutes = { a = 1 }\n', "routes must map"),
        ('[destinations.x]\nbroker = "memory://"\noptions = [1]\n', "options must be a table"),
        ("db = 1\n", "db must be a URL"),
        ('db = "sqlite:///x.db"\nbroker = 1\n', "broker must be a URL"),
        ("schema = 1\n", "schema must be a string"),
        ("relay_id = 1\n", "relay_id must be a non-empty string"),
        ("batch_size = true\n", "batch_size must be a whole number, not a boolean"),
        ("batch_size = 2.5\n", "batch_size must be a whole number"),
        ("batch_size = [1]\n", "batch_size must be a whole number"),
        ("lock_timeout = nan\n", "lock_timeout must be a finite duration"),
        ("lock_timeout = inf\n", "lock_timeout must be a finite duration"),
        ("lock_timeout = 1e400\n", "lock_timeout must be a finite duration"),
        ("lock_timeout = 2024-01-01\n", "lock_timeout must be a duration"),
        ("backoff_max = 1e20\n", "backoff_max must be at most 30d"),
        ("exit_when_idle = 1\n", "exit_when_idle must be true or false"),
        ("http = 8080\n", "http must be HOST:PORT"),
        ("http_token = 12345678901234567\n", "http_token must be a string"),
    ],
)
def test_wrong_toml_types_are_config_errors_naming_the_key(
    tmp_path: Path, text: str, fragment: str
) -> None:
    config = tmp_path / "o.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_settings({}, config_file=config, environ={})


# ----- the HTTP token -------------------------------------------------------------------------


def test_an_empty_token_variable_is_an_error_not_no_token() -> None:
    with pytest.raises(ConfigError, match="OUTBOXER_HTTP_TOKEN is set but empty"):
        load_settings({}, environ={"OUTBOXER_HTTP_TOKEN": ""})
    # So is every other empty variable (tests/unit/test_audit7_config_boundary_options.py).
    with pytest.raises(ConfigError, match="OUTBOXER_DB is set but empty"):
        load_settings({}, environ={"OUTBOXER_DB": ""})


@pytest.mark.parametrize("token", ["t0ken", "fifteen-chars-x", " padded-token-0123456789 "])
def test_a_short_or_padded_token_is_refused_without_echoing_it(token: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOXER_HTTP_TOKEN") as error:
        load_settings({}, environ={"OUTBOXER_HTTP_TOKEN": token})
    assert token.strip() not in str(error.value)


def test_a_sixteen_character_token_is_enough() -> None:
    token = "0123456789abcdef"
    assert load_settings({}, environ={"OUTBOXER_HTTP_TOKEN": token}).http_token == token


# ----- yes/no ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        *[("1", True), (" TRUE ", True), ("Yes", True), ("on", True), (True, True)],
        *[("0", False), ("false", False), (" No", False), ("OFF", False), (False, False)],
    ],
)
def test_yes_no_settings(value: str | bool, expected: bool) -> None:
    assert load_settings({"abandoned_blocks_key": value}, environ={}).abandoned_blocks_key is (
        expected
    )


@pytest.mark.parametrize("value", ["", "maybe", "2", "y", "t", 1])
def test_yes_no_settings_refuse_anything_else(value: object) -> None:
    with pytest.raises(ConfigError, match="--abandoned-blocks-key must be true or false"):
        load_settings({"abandoned_blocks_key": value}, environ={})


# ----- another command's settings on the same mechanism ------------------------------------


@dataclasses.dataclass(frozen=True)
class _ConsumeSettings:
    group: str = setting("workers", kind=Text(50), help="consumer group", commands=("consume",))
    prefetch: int = setting(
        10, kind=Whole(1, 1000), help="unacked deliveries", commands=("consume",)
    )
    topics: tuple[str, ...] | None = setting(
        kind=TextList(),
        help="topic patterns",
        commands=("consume",),
        repeatable=True,
        flag="--topic",
    )
    options: Mapping[str, str] | None = setting(
        kind=Pairs(),
        help="receiver options",
        commands=("consume",),
        repeatable=True,
        flag="--option",
        env="OUTBOXER_CONSUMER_OPTIONS",
    )


def test_another_dataclass_declared_with_setting_gets_flags_variables_and_a_table(
    tmp_path: Path,
) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, _ConsumeSettings, "consume")
    args = parser.parse_args(["--prefetch", "20", "--topic", "a.*", "--topic", "b.x,c"])
    config = tmp_path / "outboxer.toml"
    config.write_text(
        'db = "sqlite:///x.db"\n[consumer]\ngroup = "from-file"\nprefetch = 5\n'
        'options = { queue_type = "quorum" }\n'
    )
    file_values, origin = read_config_file(config, {})
    assert load_settings({}, config_file=config, environ={}).db == "sqlite:///x.db"
    values = declared_values(
        _ConsumeSettings,
        flags_from_args(args, _ConsumeSettings),
        {"OUTBOXER_GROUP": "from-env"},
        file_table(file_values, "consumer", origin),
        f"{origin} [consumer]",
    )
    assert _ConsumeSettings(**values) == _ConsumeSettings(
        group="from-env", prefetch=20, topics=("a.*", "b.x", "c"), options={"queue_type": "quorum"}
    )
    options = declared_values(
        _ConsumeSettings, {}, {"OUTBOXER_CONSUMER_OPTIONS": "a=1, b=2"}, {}, None
    )["options"]
    assert options == {"a": "1", "b": "2"}
    help_text = " ".join(parser.format_help().split())
    assert "unacked deliveries (1 to 1000; default 10; env OUTBOXER_PREFETCH)" in help_text
    assert "--topic TEXT topic patterns" in help_text
    assert "| `prefetch` | `--prefetch` | `OUTBOXER_PREFETCH` | 10 | 1 to 1000 | consume |" in (
        settings_table(_ConsumeSettings)
    )
    with pytest.raises(ConfigError, match=r"x\.toml \[consumer\]: prefetch must be between"):
        declared_values(_ConsumeSettings, {}, {}, {"prefetch": 0}, "x.toml [consumer]")
    with pytest.raises(ConfigError, match=r"consumer must be a table \(\[consumer\]\)"):
        file_table({"consumer": 1}, "consumer", "x.toml")
    with pytest.raises(ConfigError, match="--option needs NAME=VALUE"):
        declared_values(_ConsumeSettings, {"options": ["novalue"]}, {}, {}, None)
