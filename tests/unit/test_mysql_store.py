"""The MySQL store's pure parts: URLs, list parameters, the registry, a missing driver."""

from __future__ import annotations

import sys

import pytest

from outboxer import ConfigError, MissingDependencyError
from outboxer.stores import create_store
from outboxer.stores.mysql import MySQLStore, expand_lists, mysql_connect_args


def test_url_gives_pymysql_arguments() -> None:
    assert mysql_connect_args("mysql://app:p%40ss@db.example:3307/orders?connect_timeout=5") == {
        "host": "db.example",
        "port": 3307,
        "user": "app",
        "password": "p@ss",
        "database": "orders",
        "charset": "utf8mb4",
        "connect_timeout": 5.0,
    }
    assert mysql_connect_args("mariadb://localhost/app")["port"] == 3306
    for bad in ("mysql://localhost/", "mysql://localhost/a/b", "mysql://localhost/app?ssl=1"):
        with pytest.raises(ConfigError):
            mysql_connect_args(bad)


def test_every_scheme_makes_a_mysql_store_in_the_urls_database() -> None:
    for scheme in ("mysql", "mysql+pymysql", "mysql+aiomysql", "mariadb"):
        store = create_store(f"{scheme}://root@127.0.0.1/app", schema="ignored", table="events")
        assert isinstance(store, MySQLStore)
        assert store.tokens()["outbox"] == "`events`" and store.tokens()["keys"] == "`events_keys`"
    assert "CREATE TABLE IF NOT EXISTS `events`" in store.schema_sql()


def test_list_parameters_expand_to_one_placeholder_each() -> None:
    sql, params = expand_lists("WHERE seq IN (%(seqs)s) AND d = %(d)s", {"seqs": [3, 5], "d": "x"})
    assert sql == "WHERE seq IN (%(seqs_0)s, %(seqs_1)s) AND d = %(d)s"
    assert params == {"seqs_0": 3, "seqs_1": 5, "d": "x"}
    with pytest.raises(ValueError, match="empty"):
        expand_lists("IN (%(seqs)s)", {"seqs": []})


async def test_missing_aiomysql_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aiomysql", None)
    with pytest.raises(MissingDependencyError, match=r"outboxer\[mysql\]"):
        await create_store("mysql://root@127.0.0.1/app").connect()
