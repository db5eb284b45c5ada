"""``outboxer consume --statement-timeout`` bounds the consumer's own round trips on a
database that stops answering: the real command (a subprocess) reports the outage about
that long after the message that needed the database came, where its default (a minute)
reports nothing in that time. Before, the bound was an attribute only, the flag unknown.

The fault: a proxy in front of PostgreSQL (``tests/chaos/proxy.py``), stalled once the
consumer has started (its sessions open), before the message is published to Redis."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import redis

from tests.acceptance.test_cli import OUTBOXER
from tests.acceptance.test_consume_e2e import ROOT
from tests.chaos.proxy import FaultProxy
from tests.consumer_handlers import APPLIED_DDL
from tests.integration.test_audit16_redis_exit_when_idle import REDIS, publish
from tests.integration.test_audit18_consumerbound_stalled_db import _through_pg
from tests.relaying import until
from tests.services import require

BOUND = 0.5
#: Room past BOUND for the watchdog's tick (BOUND / 4), the log line and a loaded machine.
SLACK = 2.0
#: The consumer's start-up (imports, schema check, sessions opened), at most.
START = 20.0
#: Seconds for the message to be applied once the database answers again (the flag's case
#: waits out its outage backoff first: 0.2 s, then 0.4 s … as its reconnects are cut off).
APPLY = 5.0
#: What the consumer logs when a round trip of its own got no answer within BOUND.
NO_ANSWER = f"did not answer within {BOUND:g}s"


class _Lines:
    """A subprocess's output lines as they come, each with when it was read."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.seen: list[str] = []
        self._lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
        assert process.stdout is not None
        stdout = process.stdout

        def read() -> None:
            for line in stdout:
                self._lines.put((time.monotonic(), line))
            self._lines.put((time.monotonic(), None))

        threading.Thread(target=read, daemon=True).start()

    def first(self, text: str, deadline: float) -> float | None:
        """When the first line containing ``text`` came, or None if none by ``deadline``
        (time.monotonic()) or before the output ended."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                at, line = self._lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                return None
            self.seen.append(line)
            if text in line:
                return at
        return None


def _applied(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [row[0] for row in conn.execute("SELECT n FROM applied ORDER BY position")]


@contextmanager
def _consumer(db: str, stream: str, *flags: str) -> Iterator[_Lines]:
    process = subprocess.Popen(
        [
            *OUTBOXER,
            "consume",
            "--db",
            db,
            "--broker",
            REDIS,
            "--group",
            f"g-{stream}",
            "--topic",
            stream,
            "--concurrency",
            "1",
            *flags,
            "tests.consumer_handlers:record",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        yield _Lines(process)
    finally:
        process.kill()  # stalled on its database: nothing to shut down cleanly
        process.wait(10)
        assert process.stdout is not None
        process.stdout.close()


async def _no_answer_after(
    pg_url: str, proxy: FaultProxy, n: int, *flags: str
) -> tuple[float | None, str]:
    """Seconds from message ``n``'s publication (the database stalled since the consumer
    started) to the outage's report by ``outboxer consume FLAGS``, None if none came
    within BOUND + SLACK; and the command's output. Then the database answers again, and
    the message is applied: the consumer was waiting in that round trip, not gone."""
    stream = f"test-{uuid.uuid4().hex[:12]}"
    try:
        with _consumer(_through_pg(pg_url, proxy.port), stream, *flags) as lines:
            started = lines.first(f"consumer g-{stream} started", time.monotonic() + START)
            assert started is not None, "".join(lines.seen)
            proxy.stall()
            sent = time.monotonic()
            await publish(stream, range(n, n + 1))
            answered = lines.first(NO_ANSWER, sent + BOUND + SLACK)
            proxy.resume()
            await until(lambda: n in _applied(pg_url), "".join(lines.seen), APPLY)
    finally:
        client = redis.Redis.from_url(REDIS)
        client.delete(stream)
        client.close()
    return (None if answered is None else answered - sent), "".join(lines.seen)


async def test_the_flag_bounds_the_consumers_round_trips_on_a_stalled_database(
    pg_url: str, pg_proxy: FaultProxy
) -> None:
    require("redis")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(APPLIED_DDL)
    took, output = await _no_answer_after(pg_url, pg_proxy, 0, "--statement-timeout", f"{BOUND:g}")
    assert took is not None, output
    assert BOUND <= took < BOUND + SLACK, took
    # Without it the default bound (a minute) is still running: nothing reported yet.
    took, output = await _no_answer_after(pg_url, pg_proxy, 1)
    assert took is None, output
