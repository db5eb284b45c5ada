"""MySQL's and MariaDB's errno 28 (ENOSPC) in ER_GET_ERRNO (1030) and ER_ERROR_ON_WRITE (1026)
is read from the error's text. Any "28" in it was taken for it: ``Got error 128 "Out of
memory in engine"`` (HA_ERR_OUT_OF_MEM), a file named ``...28...`` whose write failed for
another reason; each an outage then, no attempt counted, retried for ever. Now only the
errno the server's formats give (MariaDB 10.11's errmsg.sys, MySQL 8's) counts.
"""

from __future__ import annotations

import pymysql
import pytest

from outboxer.consumer_db import BatchFailed, PyMySQLSession


def error(number: int, text: str) -> pymysql.err.OperationalError:
    return pymysql.err.OperationalError(number, text)


FULL = [
    (1030, 'Got error 28 "No space left on device" from storage engine InnoDB'),
    (1026, "Error writing file './test/t.MYD' (errno: 28 \"No space left on device\")"),
    (1030, "Got error 28 - 'No space left on device' from storage engine"),  # MySQL 8
    (1026, "Error writing file '/tmp/MYfd=42' (errno: 28 - No space left on device)"),
    (1114, "The table 'inbox' is full"),
]
NOT_FULL = [
    (1030, 'Got error 128 "Out of memory in engine" from storage engine InnoDB'),
    (1030, 'Got error 228 "Unknown error 228" from storage engine InnoDB'),
    (1026, "Error writing file './db28/t28.MYD' (errno: 5 \"Input/output error\")"),
    (1026, "Error writing file '/tmp/28' (errno: 13 \"Permission denied\")"),
]


@pytest.mark.parametrize(("number", "text"), FULL)
def test_audit21_review_mysql_enospc_is_a_full_database(number: int, text: str) -> None:
    session = PyMySQLSession("mysql://u@127.0.0.1/test", "test", executor=None)  # type: ignore[arg-type]
    assert session.database_full(BatchFailed("statement", error(number, text)))


@pytest.mark.parametrize(("number", "text"), NOT_FULL)
def test_audit21_review_another_mysql_errno_is_not(number: int, text: str) -> None:
    session = PyMySQLSession("mysql://u@127.0.0.1/test", "test", executor=None)  # type: ignore[arg-type]
    assert not session.database_full(BatchFailed("statement", error(number, text)))
