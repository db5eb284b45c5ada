"""The consumer on Django's connection (``DjangoSession``, what ``manage.py outboxer_consume``
runs) on a database that stops answering (a black-holed network, a proxy that accepts and
forwards nothing): the runner's own round trips on Django's connection (the checks after
the handler, COMMIT, the connect) give up after the session's ``statement_timeout`` (a
minute by default, lowered here), the driver's connection under Django's cut off from
outside the call, as on the runner's own connections (test_audit18_consumerbound_*). The
batch is an outage: not acked, no attempt counted, applied again on a new connection once
the database answers, each message once, in key order.

Before, the worker waited in that round trip for ever (the session was not watched):
nothing reported, its messages and their keys held for good.

Django runs in a subprocess (tests/contrib/django_project): its settings are process-wide,
and the driver under Django's backend is chosen there (the project installs PyMySQL as
MySQLdb; the mysqlclient run undoes that, the psycopg2 run hides psycopg 3 from Django).
The fault: a proxy in front of the database (``tests/chaos/proxy.py``), in the subprocess,
that the handler stalls from its thread after its own write (``after-write``: the next
round trip is the COMMIT on PostgreSQL, the ``inbox_kept`` check on MySQL), or that stalls
right before the COMMIT goes out (``at-commit``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest

from tests.conftest import mysql_connect
from tests.contrib.test_django import ROOT, SETTINGS

#: The shortened bound on each round trip of the runner's own (a minute by default).
BOUND = 0.5
#: How long the old code is watched waiting for ever before the run gives up on it.
GIVE_UP = 3.0
#: Keys, and messages a key: applied in this order within each key.
KEYS, PER_KEY = 3, 3

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, logging, os, sys, threading, time
    from urllib.parse import urlsplit

    DRIVER, URL, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
    BOUND, GIVE_UP, KEYS, PER_KEY = float(sys.argv[4]), float(sys.argv[5]), 3, 3

    from tests.chaos.proxy import FaultProxy

    parts = urlsplit(URL)
    proxy = FaultProxy(parts.port).start()
    user = f"{parts.username}@" if parts.username else ""
    os.environ["OUTBOXER_TEST_DJANGO_DB"] = parts._replace(
        netloc=f"{user}127.0.0.1:{proxy.port}"
    ).geturl()

    if DRIVER == "mysqlclient":
        import MySQLdb
        from django.conf import settings
        settings.DATABASES  # the project's settings install PyMySQL as MySQLdb: undone
        sys.modules["MySQLdb"] = MySQLdb
    import django
    if DRIVER == "psycopg2":
        hidden = sys.modules.get("psycopg")
        sys.modules["psycopg"] = None  # Django's backend falls back on psycopg2
        django.setup()
        import django.db.backends.postgresql.base
        if hidden is not None:
            sys.modules["psycopg"] = hidden
        else:
            del sys.modules["psycopg"]
    else:
        django.setup()

    from django.db import connections

    from outboxer.brokers.memory import memory_broker
    from outboxer.consumer import Consumer
    from outboxer.contrib.django.consumer import DjangoSession, django_sessions
    from outboxer.receivers.memory import group_state
    from outboxer.testing import make_message

    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    logging.getLogger("outboxer").addHandler(Keep(logging.DEBUG))
    logging.getLogger("outboxer").setLevel(logging.DEBUG)

    messages = [
        make_message("t", {"n": n}, key=f"k{k}") for n in range(PER_KEY) for k in range(KEYS)
    ]
    memory_broker("djbound").messages.extend(messages)
    trigger = messages[KEYS + 1]  # key k1's second message
    pending = threading.Event()  # the trigger's handler wrote its row
    trigger_thread = []  # the thread it ran in: its session's
    stalled = threading.Event()
    calls = {}
    given = []  # the driver's connection the trigger's batch ran on

    def stall():
        if not stalled.is_set():
            stalled.set()
            proxy.stall()  # from here on the database answers nothing, either way

    def handler(message, conn):
        with conn.cursor() as cursor:
            cursor.execute(
                "INSERT INTO applied (message_id, k, n) VALUES (%s, %s, %s)",
                [str(message.id), message.key, message.payload["n"]],
            )
        calls[str(message.id)] = calls.get(str(message.id), 0) + 1
        if message.id == trigger.id and not given:
            given.append(conn.connection)
            trigger_thread.append(threading.current_thread())
            pending.set()
            if MODE == "after-write":
                stall()

    if MODE == "at-commit":
        refuse_aborted = DjangoSession._refuse_aborted

        def stalling(self):  # called inside atomic() right before its COMMIT
            refuse_aborted(self)
            if pending.is_set() and threading.current_thread() is trigger_thread[0]:
                stall()  # the trigger's COMMIT, not another worker's

        DjangoSession._refuse_aborted = stalling

    consumer = Consumer(
        db=URL,  # the schema check's: not through the proxy
        broker="memory://djbound",
        group="g",
        handler=handler,
        concurrency=2,
        batch=1,
        sessions=django_sessions("default", "outboxer"),
    )
    consumer.statement_timeout = BOUND
    acked = group_state("djbound", "g").acked
    index = messages.index(trigger)

    def threads():
        return sum(1 for t in threading.enumerate() if t.name.startswith("outboxer-default"))

    def closed(raw):
        if hasattr(raw, "open"):
            return not raw.open  # PyMySQL, mysqlclient
        return bool(raw.closed)  # psycopg 3, psycopg2

    async def until(check, seconds):
        deadline = time.monotonic() + seconds
        while not check():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def main():
        out = {"driver": connections["default"].Database.__name__}
        run = asyncio.create_task(consumer.run_async())
        try:
            out["stalled"] = await until(stalled.is_set, 8)
            began = time.monotonic()
            if await until(lambda: consumer.stats.database_errors >= 1, GIVE_UP):
                out["reported"] = time.monotonic() - began
                out["closed"] = await until(lambda: closed(given[0]), 3)
                # Reconnecting to the stalled database gives up too (the driver's connect
                # timeout), on no more threads.
                out["reconnect_gave_up"] = await until(
                    lambda: any(line.startswith("database unreachable") for line in logged), 4
                )
                out["threads"] = threads()
            out["acked_in_outage"] = index in acked
            proxy.resume()
            out["all_acked"] = await until(lambda: len(acked) == len(messages), 8)
        finally:
            proxy.resume()  # the old code's round trip is answered then, and its worker ends
            consumer.stop()
            await asyncio.wait_for(run, 10)
        await until(lambda: threads() == 0, 3)  # the sessions' threads end once closed
        out["threads_after"] = threads()
        out["stats"] = {
            name: getattr(consumer.stats, name)
            for name in ("applied", "duplicates", "failed", "dead_lettered", "database_errors")
        }
        out["calls"] = calls[str(trigger.id)]
        # PyMySQL's handshake bound is not kept for the handler's reads.
        out["read_timeout"] = getattr(given[0], "_read_timeout", "none kept")
        out["trigger"] = str(trigger.id)
        out["logged"] = logged
        return out

    out = asyncio.run(main())
    proxy.stop()
    print("RESULT " + json.dumps(out))
    """
)

DRIVERS = {"psycopg": "psycopg", "psycopg2": "psycopg2", "pymysql": "pymysql"}
DRIVERS["mysqlclient"] = "MySQLdb"


def _create_applied(mysql: bool, url: str) -> None:
    if mysql:
        conn = mysql_connect(url, autocommit=True)
        with conn.cursor() as cursor:
            cursor.execute(
                "CREATE TABLE applied (seq BIGINT AUTO_INCREMENT PRIMARY KEY, "
                "message_id CHAR(36) NOT NULL, k VARCHAR(20) NOT NULL, n INT NOT NULL)"
            )
        conn.close()
        return
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE applied (seq BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL, "
            "k TEXT NOT NULL, n INT NOT NULL)"
        )


def _applied(mysql: bool, url: str) -> list[tuple[str, str, int]]:
    """(message id, key, n) of each row the handlers committed, in commit order."""
    sql = "SELECT message_id, k, n FROM applied ORDER BY seq"
    if mysql:
        conn = mysql_connect(url)
        with conn.cursor() as cursor:
            cursor.execute(sql)
            rows = [tuple(row) for row in cursor.fetchall()]
        conn.close()
        return rows
    with psycopg.connect(url) as conn:
        return [tuple(row) for row in conn.execute(sql).fetchall()]


def _run(driver: str, url: str, mode: str) -> dict[str, Any]:
    """The script under Django on ``url`` through a proxy, ``driver`` under its backend."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = dict(os.environ, PYTHONPATH=path, DJANGO_SETTINGS_MODULE=SETTINGS)
    env.pop("PGCONNECT_TIMEOUT", None)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, driver, url, mode, str(BOUND), str(GIVE_UP)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, f"{result.stdout}\n{result.stderr}"
    out: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return out


def _check_outage(out: dict[str, Any], driver: str) -> None:
    print(driver, "reported after", out.get("reported"), *out["logged"], sep="\n")  # on failure
    assert out["driver"].startswith(DRIVERS[driver])  # the driver under test, not another
    assert out["stalled"], "the trigger's handler never ran"
    assert "reported" in out, (
        f"the stalled database was not reported within {GIVE_UP}s: the consumer waited for it"
    )
    assert out["reported"] < BOUND + 1.0, out["reported"]
    assert out["closed"], "the cut-off connection was not closed"
    assert out["reconnect_gave_up"], "the reconnect to the stalled database did not give up"
    assert out["threads"] <= 2, out["threads"]  # a thread a worker: the cut-off ones freed
    assert not out["acked_in_outage"], "the unapplied message was acked"
    assert out["all_acked"], "not every message was acked once the database answered"
    assert out["threads_after"] == 0, out["threads_after"]
    assert out["stats"]["failed"] == 0  # no attempt counted for the outage
    assert out["stats"]["dead_lettered"] == 0
    assert any(f"did not answer within {BOUND:g}s" in line for line in out["logged"])
    assert any(out["trigger"] in line and "reconnecting" in line for line in out["logged"])


def _check_applied_once(mysql: bool, url: str, out: dict[str, Any]) -> None:
    rows = _applied(mysql, url)
    assert len(rows) == KEYS * PER_KEY and len({row[0] for row in rows}) == len(rows)
    for k in range(KEYS):  # in each key's order
        assert [n for _, key, n in rows if key == f"k{k}"] == list(range(PER_KEY))
    assert out["stats"]["applied"] + out["stats"]["duplicates"] == KEYS * PER_KEY


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2", "pymysql", "mysqlclient"])
def test_a_stalled_database_is_an_outage_and_each_message_applies_once_after_it(
    driver: str, request: pytest.FixtureRequest
) -> None:
    mysql = driver in ("pymysql", "mysqlclient")
    url: str = request.getfixturevalue("mysql_url" if mysql else "pg_url")
    assert urlsplit(url).port
    _create_applied(mysql, url)

    out = _run(driver, url, "after-write")

    _check_outage(out, driver)
    _check_applied_once(mysql, url, out)
    # The other worker's batch, if it was in a round trip as the network stalled, was cut
    # off too: a duplicate more if that was its COMMIT. The trigger's own:
    assert out["read_timeout"] == (None if driver == "pymysql" else "none kept")
    if mysql:  # cut off before its COMMIT (the inbox_kept check): rolled back, applied again
        assert out["calls"] == 2
        assert any("(the inbox_kept statement)" in line for line in out["logged"])
    else:  # its COMMIT went out into the stall, reached the server once resumed: committed
        assert any("(COMMIT)" in line for line in out["logged"])
        assert out["calls"] == 1 and out["stats"]["duplicates"] >= 1


@pytest.mark.parametrize("driver", ["psycopg", "pymysql"])
def test_a_commit_whose_answer_is_lost_is_not_acked_and_applies_once(
    driver: str, request: pytest.FixtureRequest
) -> None:
    """The network stalls as the COMMIT goes out: the consumer cannot know whether it
    committed, so it acks nothing; the COMMIT reaches the server once the network is back
    (it did commit), and the next attempt finds the inbox claim: a duplicate, acked, the
    handler not run again."""
    mysql = driver == "pymysql"
    url: str = request.getfixturevalue("mysql_url" if mysql else "pg_url")
    _create_applied(mysql, url)

    out = _run(driver, url, "at-commit")

    _check_outage(out, driver)
    _check_applied_once(mysql, url, out)
    assert any("(COMMIT)" in line and "may have been applied" in line for line in out["logged"])
    # It had committed: the next attempt was the inbox's duplicate, the handler not run again.
    assert out["stats"]["duplicates"] >= 1
    assert out["calls"] == 1
