"""`outboxer consume` stopped (SIGTERM) while a handler hangs: the process exits within
``shutdown_timeout`` (plus a short grace), exit 1, an ERROR line naming the message whose
handler did not return; that message is not in the inbox (its transaction never committed)
and the next run applies it once. A second SIGTERM ends the wait at once.

The handlers are here: the CLI imports them (``tests.integration.test_audit8_g_shutdown_hang``)
from the repository's root.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import psycopg
import pytest

import outboxer
from outboxer.consumer import Delivery
from tests.consumer_handlers import APPLIED_DDL
from tests.services import require

OUTBOXER = [sys.executable, "-m", "outboxer.cli"]
ROOT = Path(__file__).resolve().parents[2]
AMQP = "amqp://guest:guest@127.0.0.1:5672/"
HANDLERS = "tests.integration.test_audit8_g_shutdown_hang"
#: How long after the bound the process may take: cancelled handlers unwinding, the
#: connections closing, the interpreter ending.
GRACE = 3.0


def _record(message: Delivery, conn: Any) -> None:
    conn.execute(
        "INSERT INTO applied (message_id, key, n, attempt) VALUES (%s, %s, %s, %s)",
        (message.id, message.key, message.payload["n"], message.attempt),
    )


def _hangs(message: Delivery) -> bool:
    if message.payload["n"] != 0 or "HANG_FILE" not in os.environ:
        return False
    Path(os.environ["HANG_FILE"]).write_text(str(message.id))
    return True


def hang(message: Delivery, conn: Any) -> None:
    """Sync: writes its row, then (message 0, HANG_FILE set) never returns."""
    _record(message, conn)
    if _hangs(message):
        threading.Event().wait()  # a network call that never answers


async def _record_async(message: Delivery, conn: Any) -> None:
    await conn.execute(
        "INSERT INTO applied (message_id, key, n, attempt) VALUES ($1, $2, $3, $4)",
        message.id,
        message.key,
        message.payload["n"],
        message.attempt,
    )


async def hang_async(message: Delivery, conn: Any) -> None:
    """Async: writes its row, then (message 0, HANG_FILE set) awaits what never completes."""
    await _record_async(message, conn)
    if _hangs(message):
        await asyncio.Event().wait()


async def hang_stubborn(message: Delivery, conn: Any) -> None:
    """Async, and deaf to cancellation: only the process's exit ends it."""
    await _record_async(message, conn)
    if _hangs(message):
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)


@pytest.fixture
async def exchange() -> AsyncIterator[str]:
    require("rabbitmq")
    name = f"a8g-{uuid.uuid4().hex[:8]}"
    yield name
    connection = await aio_pika.connect(AMQP)
    channel = await connection.channel()
    await channel.queue_delete(f"g-{name}")
    await channel.exchange_delete(name)
    await connection.close()


def _consume(
    db: str, exchange: str, handler: str, log: Path, *, bound: str = "1s", env: dict[str, str]
) -> subprocess.Popen[bytes]:
    args = [
        "consume",
        "--shutdown-timeout",
        bound,
        "--db",
        db,
        "--broker",
        f"{AMQP}?exchange={exchange}",
        "--group",
        f"g-{exchange}",
        "--topic",
        "a8g.*",
        # Message 1 on the other worker: applied while message 0 hangs.
        "--concurrency",
        "2",
        "--batch",
        "1",
        f"{HANDLERS}:{handler}",
    ]
    return subprocess.Popen(
        [*OUTBOXER, *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, **env},
    )


async def _until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _publish(db: str, exchange: str) -> list[str]:
    with psycopg.connect(db) as conn:
        ids = outboxer.enqueue_many(
            conn, [{"topic": "a8g.t", "payload": {"n": n}, "key": f"k{n}"} for n in range(2)]
        )
    settings = outboxer.load_settings(
        {"db": db, "broker": f"{AMQP}?exchange={exchange}"}, environ={}
    )
    await outboxer.Relay.from_settings(settings).drain()
    return [str(message.id) for message in ids]


def _rows(db: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db) as conn:
        return conn.execute(sql).fetchall()


async def _hang_then_stop(
    pg_url: str, exchange: str, handler: str, tmp_path: Path, *, signals: int = 1
) -> tuple[int, float, str, str]:
    """Run ``handler`` until message 0 hangs, SIGTERM it (``signals`` times); the exit code,
    the seconds from the first SIGTERM to the exit, the log, message 0's id."""
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    log, ready = tmp_path / "consume.log", tmp_path / "hanging"
    process = _consume(pg_url, exchange, handler, log, env={"HANG_FILE": str(ready)})
    try:
        await _until(lambda: b"receiving from" in log.read_bytes(), 15, "the consumer to start")
        ids = await _publish(pg_url, exchange)
        await _until(ready.exists, 15, "the handler to hang")
        await _until(lambda: len(_rows(pg_url, "SELECT 1 FROM outboxer.inbox")) >= 1, 5, "n=1")
        process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        for _ in range(signals - 1):
            await asyncio.sleep(0.1)
            process.send_signal(signal.SIGTERM)
        while process.poll() is None and time.monotonic() - stopped < 15:
            await asyncio.sleep(0.02)
        took = time.monotonic() - stopped
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    assert ready.read_text() == ids[0]
    return process.returncode, took, log.read_text(), ids[0]


def _not_committed(pg_url: str, hung: str) -> None:
    """Message 0 is not in the inbox, nor its handler's row: its transaction rolled back;
    message 1, on the other worker, committed."""
    inbox = [str(r[0]) for r in _rows(pg_url, "SELECT message_id FROM outboxer.inbox")]
    assert hung not in inbox and len(inbox) == 1
    assert sorted(r[0] for r in _rows(pg_url, "SELECT n FROM applied")) == [1]


def _applied_once_by_the_next_run(pg_url: str, exchange: str, handler: str, hung: str) -> None:
    _not_committed(pg_url, hung)
    again = subprocess.run(
        [
            *OUTBOXER,
            "consume",
            "--db",
            pg_url,
            "--broker",
            f"{AMQP}?exchange={exchange}",
            "--group",
            f"g-{exchange}",
            "--topic",
            "a8g.*",
            "--exit-when-idle",
            f"{HANDLERS}:{handler}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "HANG_FILE"},
    )
    assert again.returncode == 0, again.stderr
    assert sorted(r[0] for r in _rows(pg_url, "SELECT n FROM applied")) == [0, 1]
    assert hung in [str(r[0]) for r in _rows(pg_url, "SELECT message_id FROM outboxer.inbox")]


async def test_a_hung_sync_handler_ends_within_the_bound(
    pg_url: str, exchange: str, tmp_path: Path
) -> None:
    code, took, log, hung = await _hang_then_stop(pg_url, exchange, "hang", tmp_path)
    assert took < 1 + GRACE, (took, log)
    assert code == 1, log
    [line] = [line for line in log.splitlines() if "ERROR" in line]
    assert "ERROR" in line and hung in line, line
    _applied_once_by_the_next_run(pg_url, exchange, "hang", hung)


async def test_a_hung_async_handler_is_cancelled_at_the_bound(
    pg_url: str, exchange: str, tmp_path: Path
) -> None:
    code, took, log, hung = await _hang_then_stop(pg_url, exchange, "hang_async", tmp_path)
    assert took < 1 + GRACE, (took, log)
    assert code == 1, log
    [line] = [line for line in log.splitlines() if "ERROR" in line]
    assert "ERROR" in line and hung in line, line
    _not_committed(pg_url, hung)


async def test_an_async_handler_deaf_to_cancellation_still_ends(
    pg_url: str, exchange: str, tmp_path: Path
) -> None:
    code, took, log, hung = await _hang_then_stop(pg_url, exchange, "hang_stubborn", tmp_path)
    assert took < 1 + GRACE, (took, log)
    assert code == 1, log
    _not_committed(pg_url, hung)


async def test_a_second_sigterm_ends_the_wait_at_once(
    pg_url: str, exchange: str, tmp_path: Path
) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    log, ready = tmp_path / "consume.log", tmp_path / "hanging"
    # A long bound: only the second SIGTERM can end the process this soon.
    process = _consume(
        pg_url,
        exchange,
        "hang",
        log,
        bound="60s",
        env={"HANG_FILE": str(ready)},
    )
    try:
        await _until(lambda: b"receiving from" in log.read_bytes(), 15, "the consumer to start")
        ids = await _publish(pg_url, exchange)
        await _until(ready.exists, 15, "the handler to hang")
        process.send_signal(signal.SIGTERM)
        await _until(lambda: b"stopping" in log.read_bytes(), 5, "the first SIGTERM")
        process.send_signal(signal.SIGTERM)
        forced = time.monotonic()
        while process.poll() is None and time.monotonic() - forced < 15:
            await asyncio.sleep(0.02)
        took = time.monotonic() - forced
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    text = log.read_text()
    assert took < GRACE, (took, text)
    assert process.returncode == 1, text
    [line] = [line for line in text.splitlines() if "ERROR" in line]
    assert "ERROR" in line and ids[0] in line, line
    _not_committed(pg_url, ids[0])


def hang_django(message: Delivery, connection: Any) -> None:
    """``manage.py outboxer_consume``'s: on Django's connection, then as ``hang``."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    if _hangs(message):
        threading.Event().wait()


def _django_consume(topic: str, broker: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "django", "outboxer_consume",
         "--settings=tests.contrib.django_project.settings", "--broker", broker,
         "--group", f"g-{topic}", "--topic", topic, "--shutdown-timeout", "1s",
         f"{HANDLERS}:hang_django"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


async def test_django_s_consume_command_ends_within_the_bound(pg_url: str, tmp_path: Path) -> None:
    import redis

    require("redis")
    broker = "redis://127.0.0.1:6379/0"
    topic = f"a8g-django-{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url) as conn:
        [message] = outboxer.enqueue_many(conn, [{"topic": topic, "payload": {"n": 0}}])
    settings = outboxer.load_settings({"db": pg_url, "broker": broker}, environ={})
    await outboxer.Relay.from_settings(settings).drain()
    ready = tmp_path / "hanging"
    env = {
        **os.environ,
        "OUTBOXER_TEST_DJANGO_DB": pg_url,
        "PYTHONPATH": str(ROOT),
        "HANG_FILE": str(ready),
    }
    process = _django_consume(topic, broker, env)
    try:
        await _until(ready.exists, 30, "the handler to hang")
        process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        while process.poll() is None and time.monotonic() - stopped < 15:
            await asyncio.sleep(0.02)
        took = time.monotonic() - stopped
    finally:
        if process.poll() is None:
            process.kill()
        output, _ = process.communicate(timeout=30)
        with redis.Redis.from_url(broker) as client:
            client.delete(topic)
    assert took < 1 + GRACE, (took, output)
    assert process.returncode == 1, output
    # Django's logging: the record's text only (ERROR, as the logger's level says).
    [line] = [line for line in output.splitlines() if "did not return" in line]
    assert str(message.id) in line, line
    assert _rows(pg_url, "SELECT message_id FROM outboxer.inbox") == []
