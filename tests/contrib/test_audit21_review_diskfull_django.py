"""Django's consumer session on a SQLite database whose disk fills up (a real tmpfs filled by
a ballast file: tests/diskfull.py). Django wraps the driver's error (``django.db.utils``'s
OperationalError, the sqlite3 error its ``__cause__``); the runner's claim and the handler's
ORM-level write both meet it. An outage as on the runner's own connections: not acked, no
attempt counted, nothing dead-lettered, everything applied once space is back.

Django runs in a subprocess (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from tests.contrib.test_django import ROOT, SETTINGS
from tests.diskfull import Ballast, tmpfs

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys, time

    import django
    django.setup()

    from outboxer.brokers.memory import memory_broker
    from outboxer.consumer import Consumer
    from outboxer.contrib.django.consumer import django_sessions
    from outboxer.receivers.memory import group_state
    from outboxer.testing import make_message
    from tests.diskfull import Ballast
    from pathlib import Path

    URL, MOUNT = sys.argv[1], sys.argv[2]
    ballast = Ballast(Path(MOUNT))
    broker = memory_broker("djfull")
    acked = group_state("djfull", "g").acked

    def handler(delivery, conn):
        with conn.cursor() as cursor:
            cursor.execute(
                "INSERT INTO applied (message_id, k, n) VALUES (%s, %s, %s)",
                (str(delivery.id), delivery.key, delivery.payload["n"]),
            )

    consumer = Consumer(
        db=URL, broker="memory://djfull", group="g", handler=handler, max_attempts=2,
        concurrency=2, sessions=django_sessions("default", "outboxer"),
    )

    async def until(check, seconds):
        deadline = time.monotonic() + seconds
        while not check():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def main():
        out = {}
        run = asyncio.create_task(consumer.run_async())
        try:
            broker.messages.append(make_message("t", {"n": -1}, key="warm"))
            out["warm"] = await until(lambda: len(acked) == 1, 5)
            ballast.fill()
            sent = [make_message("t", {"n": n, "pad": "x" * 20000}, key=f"k{n % 3}")
                    for n in range(9)]
            broker.messages.extend(sent)
            out["met"] = await until(lambda: consumer.stats.database_errors >= 6, 5)
            out["acked_while_full"] = len(acked) - 1
            out["failed_while_full"] = consumer.stats.failed
            ballast.free()
            out["all"] = await until(lambda: len(acked) == 10, 8)
        finally:
            ballast.free()
            consumer.stop()
            await asyncio.wait_for(run, 10)
        out["stats"] = {k: v for k, v in vars(consumer.stats).items() if isinstance(v, int)}
        return out

    print("RESULT " + json.dumps(asyncio.run(main())))
    """
)


def test_audit21_review_django_sqlite_full_disk_is_an_outage(sqlite_template: Path) -> None:
    with tmpfs(16) as mount:
        path = mount / "consumer.db"
        shutil.copyfile(sqlite_template, path)
        with sqlite3.connect(path) as conn:
            conn.execute(
                "CREATE TABLE applied (seq INTEGER PRIMARY KEY, message_id TEXT NOT NULL, "
                "k TEXT, n INTEGER NOT NULL)"
            )
        conn.close()
        url = f"sqlite:///{path}"
        pythonpath = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
        env = dict(
            os.environ,
            PYTHONPATH=pythonpath,
            DJANGO_SETTINGS_MODULE=SETTINGS,
            OUTBOXER_TEST_DJANGO_DB=url,
        )
        try:
            result = subprocess.run(
                [sys.executable, "-c", SCRIPT, url, str(mount)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            Ballast(mount).free()
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        assert result.returncode == 0 and lines, f"{result.stdout}\n{result.stderr}"
        out: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
        print(out, result.stderr[-3000:])
        assert out["warm"]
        assert out["met"], out
        assert out["acked_while_full"] == 0, out
        assert out["failed_while_full"] == 0, out
        assert out["all"], out
        assert out["stats"]["failed"] == 0 and out["stats"]["dead_lettered"] == 0, out
        assert out["stats"]["database_full"] >= 6, out
