"""Django's consumer sessions (``django_sessions``) when the database answers read-only: a
failover that leaves the old primary up and fenced (see
tests/integration/test_audit20_failover_consumer.py and test_audit20_myreadonly_consumer.py
for the runner's own sessions, which 08bbb8f taught to take the answer for a lost
connection; Django's were left as they were).

Before, the inbox claim's refusal (PostgreSQL's SQLSTATE 25006, MySQL's 1290) reached the
runner as Django's error, and Django's connection still answered ``is_usable()`` there
(reads succeed): not lost, so each message was charged its attempts on the old server, then
its dead letter was refused there too, retried for ever; nothing applied on the new
primary. A handler's write that met MariaDB's fence after its message's claim was charged to
it (with ``max_attempts=1``: a dead letter). Now both are the database's: the session is
opened anew (a new connection, the writable host), no attempt counted.

Django runs in a subprocess: its settings are configured once a process.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import psycopg

import outboxer
from tests.contrib.test_django import ROOT
from tests.failover import primary_and_standby
from tests.integration.test_audit20_myreadonly_failover import PASSWORD, primary_and_replica, sql

DB = "outboxer_failover_django"

_COMMON = """
import asyncio, json, sys, time, uuid

import django
from django.conf import settings

settings.configure(DATABASES={"default": DATABASE}, INSTALLED_APPS=[], USE_TZ=True)
django.setup()

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer
from outboxer.contrib.django.consumer import django_sessions
from outboxer.receivers.memory import group_state
from outboxer.retry import Backoff
from outboxer.testing import make_message

calls = []


def consumer_for(handler, max_attempts):
    name = "dj-" + uuid.uuid4().hex[:8]
    consumer = Consumer(
        db=URL, broker="memory://" + name, group="g", handler=handler,
        sessions=django_sessions("default", "outboxer"), max_attempts=max_attempts,
        backoff=Backoff(0.05, 2.0, 0.1, 0.0),
    )
    return consumer, memory_broker(name), group_state(name, "g").acked


async def until(check, seconds):
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
"""

PG_SCRIPT = (
    textwrap.dedent(
        """
    import sys
    from pathlib import Path
    BASE, PRIMARY, STANDBY, NAME = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    URL = (
        f"postgresql://postgres@127.0.0.1:{PRIMARY},127.0.0.1:{STANDBY}/{NAME}"
        "?target_session_attrs=read-write"
    )
    DATABASE = {
        "ENGINE": "django.db.backends.postgresql", "NAME": NAME, "USER": "postgres",
        "HOST": "127.0.0.1,127.0.0.1", "PORT": f"{PRIMARY},{STANDBY}",
        "OPTIONS": {"target_session_attrs": "read-write"},
    }
    """
    )
    + _COMMON
    + textwrap.dedent(
        """
    from tests.failover import Pair

    pair = Pair(Path(BASE), PRIMARY, STANDBY)


    def handler(delivery, connection):
        calls.append(str(delivery.id))
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO applied (message_id) VALUES (%s)", [str(delivery.id)])


    async def main():
        consumer, broker, acked = consumer_for(handler, 2)
        run = asyncio.create_task(consumer.run_async())
        out = {}
        try:
            broker.messages.append(make_message("t", {"n": 1}))
            out["before"] = await until(lambda: len(acked) == 1, 10)
            pair.caught_up(NAME)
            pair.fence()
            pair.promote()
            broker.messages.append(make_message("t", {"n": 2}))
            out["after"] = await until(lambda: len(acked) == 2 or consumer.stats.dead_lettered, 4)
        finally:
            consumer.stop()
            await asyncio.wait_for(run, 10)
        out["failed"] = consumer.stats.failed
        out["dead_lettered"] = consumer.stats.dead_lettered
        out["database_errors"] = consumer.stats.database_errors
        return out


    print("RESULT " + json.dumps(asyncio.run(main())))
    """
    )
)

MY_SCRIPT = (
    textwrap.dedent(
        """
    import sys
    PORT, PASSWORD = int(sys.argv[1]), sys.argv[2]
    URL = f"mysql://app:{PASSWORD}@127.0.0.1:{PORT}/test"
    DATABASE = {
        "ENGINE": "django.db.backends.mysql", "NAME": "test", "USER": "app", "PASSWORD": PASSWORD,
        "HOST": "127.0.0.1", "PORT": str(PORT),
    }
    import pymysql
    pymysql.install_as_MySQLdb()
    """
    )
    + _COMMON
    + textwrap.dedent(
        """
    from tests.integration.test_audit20_myreadonly_failover import sql

    fenced = []


    def handler(delivery, connection):
        calls.append(str(delivery.id))
        if delivery.payload["kind"] == "fence" and not fenced:
            fenced.append(str(delivery.id))
            sql(PORT, "SET GLOBAL read_only = ON")  # after this message's inbox claim
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO applied (id) VALUES (%s)", [str(delivery.id)])


    async def main():
        consumer, broker, acked = consumer_for(handler, 1)
        run = asyncio.create_task(consumer.run_async())
        out = {}
        try:
            # The inbox claim refused: read-only before the message comes.
            sql(PORT, "SET GLOBAL read_only = ON")
            broker.messages.append(make_message("t", {"kind": "claim"}))
            out["claim_refused"] = await until(
                lambda: consumer.stats.database_errors >= 2 or consumer.stats.failed, 3
            )
            sql(PORT, "SET GLOBAL read_only = OFF")
            out["claimed"] = await until(lambda: len(acked) == 1 or consumer.stats.failed, 3)
            # The handler's write refused: fenced between its inbox claim and that write.
            broker.messages.append(make_message("t", {"kind": "fence"}))
            out["fence_seen"] = await until(
                lambda: (fenced and consumer.stats.database_errors >= 4)
                or consumer.stats.failed,
                3,
            )
            sql(PORT, "SET GLOBAL read_only = OFF")
            out["fenced_applied"] = await until(
                lambda: len(acked) == 2 or consumer.stats.dead_lettered, 3
            )
        finally:
            sql(PORT, "SET GLOBAL read_only = OFF")
            consumer.stop()
            await asyncio.wait_for(run, 10)
        out["failed"] = consumer.stats.failed
        out["dead_lettered"] = consumer.stats.dead_lettered
        return out


    print("RESULT " + json.dumps(asyncio.run(main())))
    """
    )
)


def _run(script: str, *args: object) -> dict[str, Any]:
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, f"{result.stdout}\n{result.stderr}"
    out: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return out


def test_django_postgresql_consumer_applies_on_the_new_primary_after_the_fence() -> None:
    with primary_and_standby(DB) as pair:

        async def schema() -> None:
            async with outboxer.create_store(pair.url(DB)) as store:
                await store.apply_schema()

        asyncio.run(schema())
        with psycopg.connect(pair.url(DB), autocommit=True) as conn:
            conn.execute("CREATE TABLE applied (message_id uuid PRIMARY KEY)")
        out = _run(PG_SCRIPT, pair.base, pair.primary_port, pair.standby_port, DB)
        with psycopg.connect(pair.standby_url(DB), autocommit=True) as conn:
            applied = conn.execute("SELECT count(*) FROM applied").fetchone()
    assert out["before"], out
    assert out["after"], f"the message after the fence was not applied: {out}"
    assert applied == (2,)
    assert out["failed"] == 0 and out["dead_lettered"] == 0, out
    assert out["database_errors"] >= 1, out


def test_django_mysql_consumer_counts_no_attempt_for_a_read_only_server() -> None:
    with primary_and_replica() as pair:
        sql(pair.old, "CREATE TABLE applied (id CHAR(36) PRIMARY KEY)")
        out = _run(MY_SCRIPT, pair.old, PASSWORD)
        applied = sql(pair.old, "SELECT count(*) FROM applied")
        letters = sql(pair.old, "SELECT message_id, error FROM dead_letters")
    assert out["claim_refused"] and out["claimed"], f"the refused claim: {out}"
    assert out["fence_seen"] and out["fenced_applied"], f"the fenced handler: {out}"
    assert letters == [], letters
    assert applied == [(2,)]
    assert out["failed"] == 0 and out["dead_lettered"] == 0, out
