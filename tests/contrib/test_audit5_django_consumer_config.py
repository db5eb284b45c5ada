"""The Django consumer, audit round 5, on the real MariaDB and SQLite: a deadlock a handler
catches on MySQL, and ``manage.py outboxer_consume --database ALIAS`` with a configured
``OUTBOXER["db"]``.

Django runs in subprocesses (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from tests.conftest import mysql_connect
from tests.contrib.test_audit5_contrib_django import run_django

DEADLOCK = """
    import asyncio
    import threading
    import time
    import uuid

    import django
    django.setup()
    from django.db import OperationalError

    from outboxer.brokers.memory import memory_broker
    from outboxer.consumer import Consumer
    from outboxer.contrib.django.consumer import django_sessions
    from outboxer.retry import Backoff
    from outboxer.testing import make_message
    from tests.conftest import mysql_connect

    url = "{url}"
    # Another transaction holding counter 2; heavier than the consumer's (InnoDB picks the
    # lighter one as the deadlock's victim), so that the consumer's is rolled back.
    other = mysql_connect(url)
    other_thread_id = other.thread_id()
    with other.cursor() as cursor:
        cursor.executemany("INSERT INTO ballast VALUES (%s)", [(i,) for i in range(300)])
        cursor.execute("UPDATE counters SET v = v + 1 WHERE id = 2")
    go = threading.Event()

    def other_transaction():
        go.wait(10)
        with other.cursor() as cursor:
            cursor.execute("UPDATE counters SET v = v + 1 WHERE id = 1")  # waits: deadlock
        other.commit()

    waiter = threading.Thread(target=other_transaction)
    waiter.start()
    deadlocks = []

    def handler(message, connection):
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO applied (message_id, n) VALUES (%s, %s)",
                (str(message.id), message.payload["n"]),
            )
            if message.payload["n"] != 1 or deadlocks:
                return
            cursor.execute("UPDATE counters SET v = v + 1 WHERE id = 1")
            go.set()
            watcher = mysql_connect(url, autocommit=True)
            with watcher.cursor() as watching:
                for _ in range(500):  # until the other transaction waits for counter 1
                    watching.execute(
                        "SELECT count(*) FROM information_schema.INNODB_TRX "
                        "WHERE trx_mysql_thread_id = %s AND trx_state = 'LOCK WAIT'",
                        (other_thread_id,),
                    )
                    if watching.fetchone()[0]:
                        break
                    time.sleep(0.01)
            watcher.close()
            try:
                cursor.execute("UPDATE counters SET v = v + 1 WHERE id = 2")
            except OperationalError as exc:
                assert exc.args[0] == 1213, exc  # deadlock: this transaction was rolled back
                deadlocks.append(exc)
                # "Retry the statement": it runs in a new transaction.
                cursor.execute("UPDATE counters SET v = v + 1 WHERE id = 2")
                cursor.execute(
                    "INSERT INTO applied (message_id, n) VALUES (%s, %s)",
                    (str(message.id), message.payload["n"]),
                )

    broker = f"audit5-{{uuid.uuid4().hex[:8]}}"
    # Two keys: one batch, message 0 applied first (sorted by id), then message 1.
    memory_broker(broker).messages.extend(
        [make_message("t", {{"n": n}}, key=f"k{{n}}") for n in range(2)]
    )
    consumer = Consumer(
        db=url,
        broker=f"memory://{{broker}}",
        group="g",
        handler=handler,
        concurrency=1,
        exit_when_idle=True,
        backoff=Backoff(base=0.05, multiplier=2, cap=0.2, jitter=0),
        sessions=django_sessions("default", "outboxer"),
    )
    try:
        stats = asyncio.run(consumer.run_async())
    finally:
        go.set()
        waiter.join(10)
        other.close()
    print(len(deadlocks), stats.applied)
"""


def test_django_consumer_on_mysql_a_handler_retrying_after_a_deadlock_loses_no_message(
    mysql_url: str,
) -> None:
    """A deadlock rolls back the whole transaction and the next statement begins a new one:
    before, the Django session committed that one and the batch was acked, message 0's
    write and both inbox claims rolled back (the core MySQL session's inbox_kept check)."""
    setup = mysql_connect(mysql_url, autocommit=True)
    with setup.cursor() as cursor:
        cursor.execute("CREATE TABLE applied (message_id CHAR(36) PRIMARY KEY, n INT NOT NULL)")
        cursor.execute("CREATE TABLE counters (id INT PRIMARY KEY, v INT NOT NULL)")
        cursor.execute("INSERT INTO counters VALUES (1, 0), (2, 0)")
        cursor.execute("CREATE TABLE ballast (id INT PRIMARY KEY)")
    setup.close()
    output = run_django(DEADLOCK.format(url=mysql_url), mysql_url)
    assert output.split() == ["1", "2"], output  # one deadlock met, both applied
    check = mysql_connect(mysql_url)
    with check.cursor() as cursor:
        cursor.execute("SELECT n FROM applied ORDER BY n")
        applied = [row[0] for row in cursor.fetchall()]
        cursor.execute("SELECT count(*) FROM inbox WHERE consumer = 'g'")
        claimed = cursor.fetchone()[0]
    check.close()
    assert applied == [0, 1]  # message 0 was lost: rolled back by the deadlock, then acked
    assert claimed == 2


OTHER_ALIAS = """
    import django
    from django.conf import settings
    import tests.contrib.django_project.settings as project

    values = {{name: getattr(project, name) for name in dir(project) if name.isupper()}}
    values["DATABASES"] = {{
        "default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": "{outbox}"}},
        "inbox": {{"ENGINE": "django.db.backends.sqlite3", "NAME": "{inbox}"}},
    }}
    # The outbox's database, as the relay takes it: no inbox there.
    values["OUTBOXER"] = {{"db": "sqlite:///{outbox}", "broker": "memory://audit5-alias"}}
    settings.configure(**values)
    django.setup()
    from django.core.management import call_command

    call_command(
        "outboxer_consume", "--database", "inbox", "--group", "g", "--exit-when-idle",
        "tests.contrib.django_project.shop.handlers:ship",
    )
    from outboxer.contrib.django import conf

    print(conf.settings_with(database="inbox").db.rsplit("/", 1)[1])
"""


def test_outboxer_consume_database_checks_the_schema_of_that_alias(
    sqlite_url: str, tmp_path: Path
) -> None:
    """``--database inbox`` names the database of the inbox; before, the start-up schema
    check ran on ``OUTBOXER["db"]`` (the outbox's database, without an inbox) and the
    command failed (or passed there while the alias had no inbox)."""
    inbox = sqlite_url.removeprefix("sqlite:///")
    outbox = tmp_path / "outbox-only.db"
    sqlite3.connect(outbox).close()  # a database without outboxer's consumer tables
    output = run_django(OTHER_ALIAS.format(outbox=outbox, inbox=inbox), sqlite_url)
    lines = output.strip().splitlines()
    assert lines[-1] == Path(inbox).name, output
    assert "consumer g: applied 0" in output, json.dumps(output)


IMPLICIT_COMMIT = """
    import asyncio
    import uuid

    import django
    django.setup()

    from outboxer.brokers.memory import memory_broker
    from outboxer.consumer import Consumer
    from outboxer.contrib.django.consumer import django_sessions
    from outboxer.retry import Backoff
    from outboxer.testing import make_message

    failed = []

    def handler(message, connection):
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO applied (message_id, n) VALUES (%s, %s)",
                (str(message.id), message.payload["n"]),
            )
            if message.payload["n"] == 0:
                # DDL: MySQL commits the transaction first, the batch's claims with it.
                cursor.execute("CREATE TABLE IF NOT EXISTS ddl_probe (id INT)")
            elif not failed:
                failed.append(1)
                raise RuntimeError("the first attempt fails")

    broker = f"audit5-{{uuid.uuid4().hex[:8]}}"
    # Two keys: one batch, message 0 applied first (sorted by id), then message 1.
    memory_broker(broker).messages.extend(
        [make_message("t", {{"n": n}}, key=f"k{{n}}") for n in range(2)]
    )
    consumer = Consumer(
        db="{url}",
        broker=f"memory://{{broker}}",
        group="g",
        handler=handler,
        concurrency=1,
        exit_when_idle=True,
        backoff=Backoff(base=0.05, multiplier=2, cap=0.2, jitter=0),
        sessions=django_sessions("default", "outboxer"),
    )
    stats = asyncio.run(consumer.run_async())
    print(stats.applied, stats.duplicates)
"""


def test_django_consumer_on_mysql_a_handler_whose_ddl_commits_loses_no_later_message(
    mysql_url: str,
) -> None:
    """MySQL commits before DDL. The batch's inbox claims were all made first: before, they
    committed with the DDL, the next message's handler failed, and its redelivery was taken
    for a duplicate and skipped, never applied. Claimed one by one, and the runner told that
    its transaction ended (as the core MySQL session does), it is applied on its retry."""
    setup = mysql_connect(mysql_url, autocommit=True)
    with setup.cursor() as cursor:
        cursor.execute("CREATE TABLE applied (message_id CHAR(36) PRIMARY KEY, n INT NOT NULL)")
    setup.close()
    run_django(IMPLICIT_COMMIT.format(url=mysql_url), mysql_url)
    check = mysql_connect(mysql_url)
    with check.cursor() as cursor:
        cursor.execute("SELECT n FROM applied ORDER BY n")
        applied = [row[0] for row in cursor.fetchall()]
    check.close()
    assert applied == [0, 1]  # message 1 was lost: its claim committed with message 0's DDL
