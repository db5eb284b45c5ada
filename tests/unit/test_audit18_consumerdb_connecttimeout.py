"""A driver's connect that gets no answer is the consumer's "cannot connect … no answer"
(NoAnswerError), whichever driver gave it up.

``consumer_db._timed_out`` knew a Python TimeoutError in the exception's chain and psycopg
3's ConnectionTimeout. psycopg2 raises libpq's connect_timeout as a plain OperationalError
("… failed: timeout expired"), and mysqlclient the handshake's read timeout as error 2013
("… reading initial communication packet', system error: 110"), both from C with nothing
under them: those were logged as a driver's error, not as a database that does not answer
(the Django consumer connects through them). A 2013 of a server that closes the connection
at once is no silence and stays the driver's error.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from outboxer.consumer_db import NoAnswerError, _no_answer_at_connect

#: The session's bound (statement_timeout), which the connect timeouts below stand for.
SESSION: Any = SimpleNamespace(statement_timeout=2.0)


def listener(on_accept: Callable[[socket.socket], None]) -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0), backlog=16)
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed at the end
            accepted.append(conn)
            on_accept(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
    server.close()
    thread.join(5)
    for conn in accepted:
        conn.close()


@pytest.fixture
def silent() -> Iterator[int]:
    """A port whose server accepts and never says a word."""
    yield from listener(lambda conn: None)


@pytest.fixture
def slamming() -> Iterator[int]:
    """A port whose server accepts and closes at once."""
    yield from listener(lambda conn: conn.close())


def test_psycopg2_connect_timeout_is_no_answer(silent: int) -> None:
    import psycopg2

    def connect() -> Any:
        return psycopg2.connect(
            host="127.0.0.1", port=silent, dbname="x", user="x", connect_timeout=2
        )

    with pytest.raises(NoAnswerError, match=r"cannot connect .* no answer") as caught:
        _no_answer_at_connect(SESSION, connect)
    assert isinstance(caught.value.__cause__, psycopg2.OperationalError)
    assert "timeout expired" in str(caught.value.__cause__)


def test_mysqlclient_handshake_timeout_is_no_answer(silent: int) -> None:
    import MySQLdb

    def connect() -> Any:
        return MySQLdb.connect(host="127.0.0.1", port=silent, user="x", connect_timeout=1)

    with pytest.raises(NoAnswerError, match=r"cannot connect .* no answer") as caught:
        _no_answer_at_connect(SESSION, connect)
    cause = caught.value.__cause__
    assert isinstance(cause, MySQLdb.OperationalError) and cause.args[0] == 2013


def test_pymysql_handshake_read_timeout_is_no_answer(silent: int) -> None:
    import pymysql

    def connect() -> Any:
        return pymysql.connect(
            host="127.0.0.1", port=silent, user="x", connect_timeout=1, read_timeout=0.5
        )

    with pytest.raises(NoAnswerError, match=r"cannot connect .* no answer") as caught:
        _no_answer_at_connect(SESSION, connect)
    cause = caught.value.__cause__
    assert isinstance(cause, pymysql.err.OperationalError) and cause.args[0] == 2013


def test_a_server_that_closes_at_once_is_the_drivers_error(slamming: int) -> None:
    import MySQLdb
    import pymysql

    with pytest.raises(MySQLdb.OperationalError) as mysqlclient:
        _no_answer_at_connect(
            SESSION,
            lambda: MySQLdb.connect(host="127.0.0.1", port=slamming, user="x", connect_timeout=1),
        )
    assert mysqlclient.value.args[0] == 2013
    with pytest.raises(pymysql.err.OperationalError) as pure:
        _no_answer_at_connect(
            SESSION,
            lambda: pymysql.connect(
                host="127.0.0.1", port=slamming, user="x", connect_timeout=1, read_timeout=0.5
            ),
        )
    assert pure.value.args[0] == 2013
