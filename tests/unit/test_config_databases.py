"""Several databases in the settings: ``[databases.NAME]`` tables, a repeated ``--db``,
``--database``, and what each database's relay gets (Settings.database_settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from outboxer import ConfigError, load_settings
from outboxer.cli import build_parser
from outboxer.config import DatabaseSettings, Settings, flags_from_args


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "outboxer.toml"
    path.write_text(text)
    return path


FILE = """
broker = "memory://shared"
batch_size = 100
schema = "outboxer"

[databases.orders]
url = "postgresql://relay:s3cret-pw@db1/orders"
batch_size = 50
poll_interval = "250ms"

[databases.billing]
url = "sqlite:///billing.db"
table = "billing_outbox"

[databases.billing.destinations.partner]
broker = "https://partner.example/hooks"
envelope = "stripped"
"""


def test_each_database_gets_the_process_settings_with_its_own_in_place(tmp_path: Path) -> None:
    settings = load_settings(
        {"concurrency": "2", "batch_size": "300"}, config_file=toml(tmp_path, FILE), environ={}
    )
    assert settings.db is None and list(settings.databases) == ["orders", "billing"]
    assert settings.several_databases
    own = settings.database_settings()
    orders, billing = own["orders"], own["billing"]
    assert orders.db == "postgresql://relay:s3cret-pw@db1/orders" and orders.database == "orders"
    # The database's own value beats the process's, from a flag too.
    assert (orders.batch_size, orders.poll_interval, orders.concurrency) == (50, 0.25, 2)
    assert (orders.schema, orders.table) == ("outboxer", "outbox")
    assert list(orders.destinations) == ["default"], "the process's destinations"
    assert orders.destinations["default"].broker == "memory://shared"
    assert (billing.batch_size, billing.table) == (300, "billing_outbox"), "the flag, then"
    assert list(billing.destinations) == ["partner"], "its own replace the process's"
    assert billing.destinations["partner"].envelope == "stripped"
    assert not orders.several_databases and orders.require_db() == orders.db
    assert "s3cret-pw" not in repr(settings), "database URLs are masked in reprs"


def test_a_command_of_one_database_asks_which_one(tmp_path: Path) -> None:
    settings = load_settings({}, config_file=toml(tmp_path, FILE), environ={})
    with pytest.raises(ConfigError, match=r"2 are configured \(orders, billing\).*--database"):
        settings.require_db()
    picked = load_settings({"database": "billing"}, config_file=toml(tmp_path, FILE), environ={})
    assert picked.db == "sqlite:///billing.db" and picked.table == "billing_outbox"
    assert not picked.several_databases and picked.database_name == "billing"
    from_env = load_settings(
        {}, config_file=toml(tmp_path, FILE), environ={"OUTBOXER_DATABASE": "orders"}
    )
    assert from_env.batch_size == 50
    with pytest.raises(ConfigError, match=r"--database 'shipping' is none of .*orders, billing"):
        load_settings({"database": "shipping"}, config_file=toml(tmp_path, FILE), environ={})


def test_a_repeated_db_flag_names_its_databases_by_place_or_as_given() -> None:
    settings = load_settings(
        {"db": ["sqlite:///a.db", "sqlite:///b.db", "main=postgresql://h/app"]}, environ={}
    )
    assert {name: db.url for name, db in settings.databases.items()} == {
        "db1": "sqlite:///a.db",
        "db2": "sqlite:///b.db",
        "main": "postgresql://h/app",
    }
    one_named = load_settings({"db": ["main=sqlite:///a.db"]}, environ={})
    assert list(one_named.databases) == ["main"], "a name makes it a named database"
    with pytest.raises(ConfigError, match="two databases are named 'db2'"):
        load_settings({"db": ["db2=sqlite:///a.db", "sqlite:///b.db"]}, environ={})
    with pytest.raises(ConfigError, match="--db db2 must be a URL"):
        load_settings({"db": ["sqlite:///a.db", "nonsense"]}, environ={})


def test_one_db_flag_is_the_single_database_of_old() -> None:
    args = build_parser().parse_args(["relay", "--db", "sqlite:///a.db"])
    settings = load_settings(flags_from_args(args, Settings), environ={})
    assert settings.db == "sqlite:///a.db" and settings.databases == {}
    assert settings.database_name == "default" and not settings.several_databases
    assert settings.database_settings() == {"default": settings}
    args = build_parser().parse_args(["relay", "--db", "sqlite:///a.db", "--db", "sqlite:///b"])
    assert list(load_settings(flags_from_args(args, Settings), environ={}).databases) == [
        "db1",
        "db2",
    ]


def test_db_flags_name_the_databases_and_the_file_tables_add_their_overrides(
    tmp_path: Path,
) -> None:
    # The file holds no secret: the URL comes with the flag.
    path = toml(
        tmp_path, '[databases.orders]\nbatch_size = 7\n[databases.unused]\nurl = "sqlite:///u"\n'
    )
    settings = load_settings(
        {"db": ["zeta=sqlite:///z.db", "orders=sqlite:///o.db"]}, config_file=path, environ={}
    )
    assert list(settings.databases) == ["zeta", "orders"], "the flags say which, in order"
    assert settings.for_database("orders").batch_size == 7
    with pytest.raises(ConfigError, match="database 'orders' needs a url"):
        load_settings({}, config_file=path, environ={})


def test_one_db_from_the_flag_or_the_environment_replaces_the_files_databases(
    tmp_path: Path,
) -> None:
    path = toml(tmp_path, FILE)
    flag = load_settings({"db": "sqlite:///one.db"}, config_file=path, environ={})
    env = load_settings({}, config_file=path, environ={"OUTBOXER_DB": "sqlite:///one.db"})
    for settings in (flag, env):
        assert settings.db == "sqlite:///one.db" and not settings.databases


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('db = "sqlite:///a"\n[databases.x]\nurl = "sqlite:///b"\n', "not both"),
        ("databases = 3\n", "databases must be a table of named databases"),
        ("[databases.x]\nurl = 5\n", "database 'x': url must be a URL"),
        ('[databases.x]\nurl = "sqlite:///b"\nrelay_id = "r"\n', r"unknown keys \['relay_id'\]"),
        ('[databases.x]\nurl = "sqlite:///b"\nbatch_size = 0\n', "batch_size must be between"),
        ('[databases."a b"]\nurl = "sqlite:///b"\n', "a database name starts with a letter"),
        ('[databases.x]\nurl = "sqlite:///b"\n[databases.x.destinations.d]\n', "needs a broker"),
    ],
)
def test_bad_database_tables_are_clear_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings({}, config_file=toml(tmp_path, text), environ={})


def test_a_named_url_is_for_the_repeated_flag_and_the_environment_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="db: NAME=URL names a database of the"):
        load_settings({}, config_file=toml(tmp_path, 'db = "main=sqlite:///a.db"\n'), environ={})


def test_the_environment_names_databases_as_a_repeated_db_flag_does(tmp_path: Path) -> None:
    env = {"OUTBOXER_DB": " orders=postgresql://relay:pw@h/orders\n billing=sqlite:///b.db "}
    settings = load_settings({}, environ=env)
    assert {name: db.url for name, db in settings.databases.items()} == {
        "orders": "postgresql://relay:pw@h/orders",
        "billing": "sqlite:///b.db",
    }
    assert settings.db is None and settings.several_databases
    by_place = load_settings({}, environ={"OUTBOXER_DB": "sqlite:///a.db sqlite:///b.db"})
    assert list(by_place.databases) == ["db1", "db2"]
    one_named = load_settings({}, environ={"OUTBOXER_DB": "main=sqlite:///a.db"})
    assert list(one_named.databases) == ["main"], "a name makes it a named database"
    one_url = load_settings({}, environ={"OUTBOXER_DB": " sqlite:///a.db "})
    assert not one_url.databases, "one plain URL is the single database of old"
    # Stronger than the file, whose tables still add their overrides to the names given.
    path = toml(tmp_path, FILE)
    from_env = load_settings({}, config_file=path, environ={"OUTBOXER_DB": "orders=sqlite:///o"})
    assert list(from_env.databases) == ["orders"]
    assert from_env.for_database("orders").batch_size == 50
    assert from_env.for_database("orders").db == "sqlite:///o"
    # Weaker than the flags.
    flags = load_settings({"db": ["x=sqlite:///x"]}, environ={"OUTBOXER_DB": "y=sqlite:///y"})
    assert list(flags.databases) == ["x"]
    one_flag = load_settings({"db": "sqlite:///x"}, environ={"OUTBOXER_DB": "y=sqlite:///y"})
    assert one_flag.db == "sqlite:///x" and not one_flag.databases
    with pytest.raises(ConfigError, match="OUTBOXER_DB: two databases are named 'a'"):
        load_settings({}, environ={"OUTBOXER_DB": "a=sqlite:///a a=sqlite:///b"})
    with pytest.raises(ConfigError, match="OUTBOXER_DB b must be a URL"):
        load_settings({}, environ={"OUTBOXER_DB": "a=sqlite:///a b=nonsense"})


def test_settings_built_in_python_check_their_databases() -> None:
    with pytest.raises(ConfigError, match="not both"):
        Settings(db="sqlite:///a", databases={"x": DatabaseSettings("x", "sqlite:///b")})
    with pytest.raises(ConfigError, match="relay_id is not a setting of one database"):
        DatabaseSettings("x", "sqlite:///b", {"relay_id": "r"})
    with pytest.raises(ConfigError, match="batch_size must be between"):
        DatabaseSettings("x", "sqlite:///b", {"batch_size": -1})
    settings = Settings(
        broker="memory://", databases={"x": DatabaseSettings("x", "sqlite:///b", {"table": "t"})}
    )
    assert settings.for_database("x").table == "t"
    with pytest.raises(ConfigError, match="no database 'y'"):
        settings.for_database("y")
