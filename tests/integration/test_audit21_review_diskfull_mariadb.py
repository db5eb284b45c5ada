"""A MariaDB consumer database whose disk fills up (tests/diskfull.py: a private mariadbd, the
test database's directory a ballast-filled tmpfs): what the server really answers is 1114
(ER_RECORD_FILE_FULL, "The table 'inbox' is full"), for the inbox claim and for a handler's
own write alike, and for a second or so after space comes back (InnoDB remembers). Taken
for an outage: not acked, no attempt counted, nothing dead-lettered, everything applied once
space is back.
"""

from __future__ import annotations

import uuid
from typing import Any

import pymysql
import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.receivers.memory import group_state
from tests.diskfull import (  # noqa: F401 -- diskfull_mariadb: a fixture
    Ballast,
    PrivateMariaDB,
    diskfull_mariadb,
    mariadb_database_on_tmpfs,
)
from tests.integration.test_audit21_diskfull_consumer import check_applied, messages, ride_out

APPLIED = (
    "CREATE TABLE applied (seq BIGINT AUTO_INCREMENT PRIMARY KEY, message_id CHAR(36) NOT "
    "NULL, k VARCHAR(20), n INT NOT NULL, pad VARCHAR(6000) NOT NULL) ENGINE=InnoDB"
)


def handler(message: Delivery, conn: Any) -> None:
    with conn.cursor() as cursor:
        cursor.execute(
            "INSERT INTO applied (message_id, k, n, pad) VALUES (%s, %s, %s, %s)",
            (str(message.id), message.key, message.payload["n"], message.payload.get("pad", "")),
        )


class TablesBallast(Ballast):
    """The ballast, then rows into each of ``tables`` until the server says it is full: a
    fresh InnoDB file has free pages of its own, which a ballast alone leaves usable."""

    def __init__(self, ballast: Ballast, server: PrivateMariaDB, url: str, *tables: str) -> None:
        super().__init__(ballast.path.parent)
        self.server = server
        self.database = url.rsplit("/", 1)[1]
        self.tables = tables

    def fill(self) -> int:
        written = super().fill()
        conn = pymysql.connect(
            host="127.0.0.1", port=self.server.port, user="root", database=self.database
        )
        try:
            for table in self.tables:
                statement = FILLERS[table]
                for _ in range(100_000):
                    try:
                        with conn.cursor() as cursor:
                            cursor.execute(statement, (str(uuid.uuid4()),))
                        conn.commit()
                    except pymysql.err.OperationalError as exc:
                        assert exc.args[0] == 1114, exc
                        conn.rollback()
                        break
                else:
                    raise AssertionError(f"{table} never full")
        finally:
            conn.close()
        return written


FILLERS = {
    "inbox": "INSERT INTO inbox (consumer, message_id) VALUES ('filler', %s)",
    "applied": "INSERT INTO applied (message_id, n, pad) VALUES (%s, -2, REPEAT('f', 5000))",
}


def rows(server: PrivateMariaDB, url: str) -> tuple[list[tuple[str, str, int]], int]:
    database = url.rsplit("/", 1)[1]
    applied = server.admin("SELECT message_id, k, n FROM applied ORDER BY seq", database)
    dead = server.admin("SELECT count(*) FROM dead_letters", database)
    return [(str(r[0]), str(r[1]), int(r[2])) for r in applied], int(dead[0][0])


@pytest.mark.parametrize("warm", [False, True], ids=["claims", "handler-writes"])
async def test_audit21_review_mariadb_full_disk_is_an_outage(
    diskfull_mariadb: PrivateMariaDB,  # noqa: F811 -- the fixture
    warm: bool,
) -> None:
    with mariadb_database_on_tmpfs(diskfull_mariadb) as (url, ballast):
        diskfull_mariadb.admin(APPLIED, url.rsplit("/", 1)[1])
        name = f"diskfull-{uuid.uuid4().hex[:8]}"
        broker = memory_broker(name)
        acked = group_state(name, "g").acked
        consumer = Consumer(
            db=url,
            broker=f"memory://{name}",
            group="g",
            handler=handler,
            concurrency=2,
            max_attempts=2,
        )
        sent = messages(pad="x" * 5000 if warm else "")
        tables = ("applied",) if warm else ("inbox",)
        full = TablesBallast(ballast, diskfull_mariadb, url, *tables)
        await ride_out(consumer, broker, acked, full, sent, warm=warm)
        applied, dead = rows(diskfull_mariadb, url)
        check_applied([row for row in applied if row[2] != -2], sent, warmups=int(warm))
        assert dead == 0
