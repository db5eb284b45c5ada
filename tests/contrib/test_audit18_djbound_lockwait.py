"""PostgreSQL under Django's consumer session: the inbox claim of a redelivered message that
waits for another consumer's row lock (its handler still running) is cut off after the
session's ``statement_timeout``, an outage, as on the runner's own connections
(test_audit18_review_consumerbound_lockwait.py). PostgreSQL does not see the client of a
backend waiting for a lock go: the session's next connection ends the one it cut off
(``pg_terminate_backend``, by pid and backend_start), so at most the retry in progress and
the one just cut off wait, not one more each outage. The message is applied once the
holder lets go, no attempt charged.

Before, the worker waited in the claim for as long as the holder ran: no outage reported.

Django runs in a subprocess (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.contrib.test_django import ROOT, SETTINGS

BOUND = 0.5
#: How long the old code is watched waiting for ever before the run gives up on it.
GIVE_UP = 3.0

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys, time

    import django
    django.setup()
    import psycopg

    from outboxer.brokers.memory import memory_broker
    from outboxer.consumer import Consumer
    from outboxer.contrib.django.consumer import django_sessions
    from outboxer.receivers.memory import group_state
    from outboxer.testing import make_message

    URL, BOUND, GIVE_UP = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    message = make_message("t", {"n": 1})
    memory_broker("djlock").messages.append(message)
    # The first consumer's claim, not committed: its handler still runs.
    holder = psycopg.connect(URL)
    holder.execute(
        "INSERT INTO outboxer.inbox (consumer, message_id) VALUES ('g', %s)", (message.id,)
    )
    calls = []

    def handler(delivery, conn):
        calls.append(str(delivery.id))

    def waiting():
        with psycopg.connect(URL, autocommit=True) as conn:
            return len(conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            ).fetchall())

    consumer = Consumer(
        db=URL, broker="memory://djlock", group="g", handler=handler,
        sessions=django_sessions("default", "outboxer"),
    )
    consumer.statement_timeout = BOUND
    acked = group_state("djlock", "g").acked

    async def until(check, seconds):
        deadline = time.monotonic() + seconds
        while not check():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def main():
        out = {"most": 0}

        def outages(count):
            out["most"] = max(out["most"], waiting())
            return consumer.stats.database_errors >= count

        run = asyncio.create_task(consumer.run_async())
        try:
            out["first_outage"] = await until(lambda: outages(1), GIVE_UP)
            if out["first_outage"]:
                out["three_outages"] = await until(lambda: outages(3), 6)
                out["ended"] = await until(lambda: waiting() <= 1, 3)
            out["called_while_held"] = bool(calls)
            holder.rollback()  # the first consumer's handler failed: the message is to apply
            out["acked"] = await until(lambda: len(acked) == 1, 8)
        finally:
            holder.rollback()
            consumer.stop()
            await asyncio.wait_for(run, 10)
        out["calls"] = len(calls)
        out["failed"] = consumer.stats.failed
        out["dead_lettered"] = consumer.stats.dead_lettered
        return out

    print("RESULT " + json.dumps(asyncio.run(main())))
    holder.close()
    """
)


def test_a_claim_cut_off_on_a_lock_leaves_no_backend_piling_up(pg_url: str) -> None:
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = dict(
        os.environ,
        PYTHONPATH=path,
        DJANGO_SETTINGS_MODULE=SETTINGS,
        OUTBOXER_TEST_DJANGO_DB=pg_url,
    )
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, pg_url, str(BOUND), str(GIVE_UP)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, f"{result.stdout}\n{result.stderr}"
    out: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["first_outage"], f"no outage within {GIVE_UP}s: the claim waited on the lock"
    assert out["three_outages"]
    # The claim in progress, and at most the one just cut off before the reconnect ended
    # it (without it: one more each outage).
    assert out["most"] <= 2, out["most"]
    assert out["ended"], "the cut-off claims' backends still wait"
    assert not out["called_while_held"]
    assert out["acked"], "the message was not applied once the holder let go"
    assert out["calls"] == 1
    assert out["failed"] == 0 and out["dead_lettered"] == 0


@pytest.fixture(autouse=True)
def _no_pgconnect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
