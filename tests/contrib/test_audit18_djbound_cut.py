"""How ``DjangoSession``'s watchdog cuts off the driver connection under Django's, whichever
driver Django runs on (the stalled-network runs are test_audit18_djbound_stalled_db.py):
SQLite's statement interrupted from another thread; a connection already closed never cut
(its socket's number may be another socket's by then); and the driver options that bound
the connect of the session's own thread's connection, where OPTIONS does not set them.

No Django settings needed: the functions take the driver's connection, or an object with
a Django connection's attributes.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from types import SimpleNamespace
from typing import Any

import psycopg
import psycopg2  # type: ignore[import-untyped]
import pytest

from outboxer.contrib.django.consumer import _bound_connects, _cut_driver
from tests.conftest import mysql_connect


def test_a_sqlite_statement_is_interrupted_from_another_thread(tmp_path: Any) -> None:
    conn = sqlite3.connect(tmp_path / "db.sqlite", check_same_thread=False)
    failed: list[BaseException] = []
    running = threading.Event()  # set from inside the statement, by SQLite's progress handler
    conn.set_progress_handler(lambda: running.set(), 1000)

    def endless() -> None:
        try:
            conn.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                "SELECT count(*) FROM n"
            ).fetchone()
        except sqlite3.OperationalError as exc:
            failed.append(exc)

    thread = threading.Thread(target=endless, daemon=True)
    thread.start()
    assert running.wait(5)
    began = time.monotonic()
    assert _cut_driver(conn, None)
    thread.join(5)
    assert not thread.is_alive(), "the statement was not interrupted"
    assert time.monotonic() - began < 1.0
    assert "interrupted" in str(failed[0])
    conn.close()
    assert not _cut_driver(conn, None)  # closed: nothing to interrupt


def test_closed_connections_are_never_cut(pg_url: str, mysql_url: str) -> None:
    """A closed driver connection gives no socket to shut down, whatever descriptor was
    read while it was open: that number may belong to another socket by now."""
    pg2 = psycopg2.connect(pg_url)
    descriptor = pg2.fileno()
    pg2.close()
    assert not _cut_driver(pg2, descriptor)

    pg3 = psycopg.connect(pg_url)
    pg3.close()
    assert not _cut_driver(pg3, None)

    my = mysql_connect(mysql_url)
    my.close()
    assert not _cut_driver(my, None)


def test_an_open_psycopg2_connection_is_cut_by_its_descriptor(pg_url: str) -> None:
    conn = psycopg2.connect(pg_url)
    try:
        assert _cut_driver(conn, conn.fileno())
        with pytest.raises(psycopg2.OperationalError), conn.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        conn.close()
    assert not _cut_driver(conn, None)  # psycopg2 without a descriptor read: not cut


def _wrapper(vendor: str, options: dict[str, Any], database: str = "pymysql") -> Any:
    """What ``_bound_connects`` reads of a Django connection."""
    return SimpleNamespace(
        vendor=vendor,
        Database=SimpleNamespace(__name__=database),
        settings_dict={"NAME": "db", "OPTIONS": options},
    )


def test_the_connect_is_bounded_with_the_driver_s_options_the_settings_do_not_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    shared = {"sslmode": "prefer"}
    pg = _wrapper("postgresql", shared)
    assert _bound_connects(pg, 0.5) == {"connect_timeout": 2}  # libpq's floor: 2 s
    assert pg.settings_dict["OPTIONS"] == {"sslmode": "prefer", "connect_timeout": 2}
    assert shared == {"sslmode": "prefer"}, "the settings other threads share changed"
    assert _bound_connects(_wrapper("postgresql", {}), 60) == {"connect_timeout": 60}
    assert _bound_connects(_wrapper("postgresql", {"connect_timeout": 7}), 60) == {}
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "9")  # passed on: psycopg 3.1.0 reads no other
    assert _bound_connects(_wrapper("postgresql", {}), 60) == {"connect_timeout": "9"}
    assert _bound_connects(_wrapper("postgresql", {"connect_timeout": 7}), 60) == {}

    assert _bound_connects(_wrapper("mysql", {}), 60) == {
        "connect_timeout": 10.0,  # PyMySQL's, the TCP connect only
        "read_timeout": 60,
        "write_timeout": 60,
    }
    assert _bound_connects(_wrapper("mysql", {"read_timeout": 5}), 0.5) == {
        "connect_timeout": 0.5,
        "write_timeout": 0.5,
    }
    assert _bound_connects(_wrapper("mysql", {}, database="MySQLdb"), 0.5) == {
        "connect_timeout": 1  # mysqlclient: whole seconds; no read_timeout, kept for good
    }
    assert _bound_connects(_wrapper("sqlite", {}), 0.5) == {}
