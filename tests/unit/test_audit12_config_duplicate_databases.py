"""A relay's databases that are one outbox table under two names (same server, database,
schema and table, whatever the URLs' spelling) are refused at load time, naming both; two
tables or schemas of one database stay two outboxes."""

from __future__ import annotations

from pathlib import Path

import pytest

from outboxer import ConfigError, load_settings


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "outboxer.toml"
    path.write_text(text)
    return path


def databases_file(tmp_path: Path, first: str, second: str, extra: str = "") -> Path:
    return toml(
        tmp_path,
        f'broker = "memory://x"\n[databases.orders]\nurl = "{first}"\n'
        f'[databases.billing]\nurl = "{second}"\n{extra}',
    )


SAME = [
    # scheme family, default port, query options, user and password do not matter
    ("postgresql://127.0.0.1/test", "postgres://127.0.0.1:5432/test?application_name=x"),
    ("postgresql://u:s3cret@DB.example/test", "postgresql+asyncpg://other@db.example:5432/test"),
    ("postgresql://[::1]/test", "postgresql+psycopg://[::1]:5432/test?sslmode=disable"),
    ("postgresql:///test?host=/run/pg", "postgresql://%2Frun%2Fpg/test"),
    ("mysql://root@127.0.0.1/test", "mariadb+pymysql://app:s3cret@127.0.0.1:3306/test"),
    ("sqlite:///one.db", "sqlite+aiosqlite:///./sub/../one.db"),
]


@pytest.mark.parametrize(("first", "second"), SAME)
def test_one_outbox_under_two_names_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str, second: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        load_settings({}, config_file=databases_file(tmp_path, first, second), environ={})
    message = str(raised.value)
    assert "'orders' and 'billing'" in message
    assert "same outbox" in message
    assert "s3cret" not in message  # no password of either URL


def test_the_same_url_twice_in_a_repeated_db_flag_or_the_variable_is_refused() -> None:
    with pytest.raises(ConfigError, match="'db1' and 'db2' are the same outbox"):
        load_settings(
            {"db": ["postgresql://127.0.0.1/test", "postgres://127.0.0.1:5432/test"]},
            environ={},
        )
    with pytest.raises(ConfigError, match="'a' and 'b' are the same outbox"):
        load_settings(
            {}, environ={"OUTBOXER_DB": "a=mysql://h/test b=mysql://H:3306/test?connect_timeout=5"}
        )


def test_a_per_database_table_or_schema_that_makes_two_the_same_is_refused(
    tmp_path: Path,
) -> None:
    # billing names the table the process's default gives orders
    path = databases_file(
        tmp_path,
        "postgresql://h/app",
        "postgresql://h/app",
        'schema = "outboxer"\ntable = "outbox"\n',
    )
    with pytest.raises(ConfigError, match="'orders' and 'billing' are the same outbox"):
        load_settings({}, config_file=path, environ={})
    # --database picks one: the file itself is still wrong, and said so.
    with pytest.raises(ConfigError, match="same outbox"):
        load_settings({"database": "orders"}, config_file=path, environ={})


DIFFERENT = [
    ("postgresql://h/app", "postgresql://h/app2"),
    ("postgresql://h/app", "postgresql://h:5433/app"),
    ("postgresql://h/app", "postgresql://other/app"),
    # not resolved at load time: localhost and 127.0.0.1 are compared as written
    ("postgresql://localhost/app", "postgresql://127.0.0.1/app"),
    ("postgresql://h/app", "mysql://h/app"),
    ("sqlite:///a.db", "sqlite:///b.db"),
    ("sqlite:///:memory:", "sqlite:///:memory:"),  # each connection's own database
]


@pytest.mark.parametrize(("first", "second"), DIFFERENT)
def test_different_outboxes_stay_allowed(tmp_path: Path, first: str, second: str) -> None:
    settings = load_settings({}, config_file=databases_file(tmp_path, first, second), environ={})
    assert list(settings.databases) == ["orders", "billing"]


@pytest.mark.parametrize(
    "extra",
    ['table = "billing_outbox"\n', 'schema = "billing"\n'],
    ids=["another table", "another schema"],
)
def test_another_table_or_schema_of_one_database_is_another_outbox(
    tmp_path: Path, extra: str
) -> None:
    path = databases_file(tmp_path, "postgresql://h/app", "postgres://h:5432/app", extra)
    settings = load_settings({}, config_file=path, environ={})
    assert list(settings.databases) == ["orders", "billing"]


def test_mysql_has_no_schemas_so_another_schema_is_the_same_table(tmp_path: Path) -> None:
    path = databases_file(tmp_path, "mysql://h/app", "mysql://h/app", 'schema = "billing"\n')
    with pytest.raises(ConfigError, match="same outbox"):
        load_settings({}, config_file=path, environ={})
