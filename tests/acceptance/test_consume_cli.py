"""`outboxer consume` and `outboxer dead-letters` as commands: settings from flags, the
environment and the settings file; dead letters listed, replayed and purged; metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import psycopg
import pytest

import outboxer
from tests.acceptance.test_cli import OUTBOXER, cli
from tests.acceptance.test_consume_e2e import ROOT, spawn
from tests.consumer_handlers import APPLIED_DDL
from tests.services import free_port, require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.fixture
async def exchange() -> AsyncIterator[str]:
    require("rabbitmq")
    name = f"cli-{uuid.uuid4().hex[:8]}"
    yield name
    connection = await aio_pika.connect(AMQP)
    channel = await connection.channel()
    await channel.queue_delete(f"g-{name}")
    await channel.exchange_delete(name)
    await connection.close()


def consume(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return command("consume", *args, env=env)


def command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`outboxer ARGS` in the repository (where the test handlers import from)."""
    return subprocess.run(
        [*OUTBOXER, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def rows(db: str, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(db) as conn:
        return conn.execute(sql).fetchall()


async def publish(db: str, broker: str, count: int) -> None:
    with psycopg.connect(db) as conn:
        conn.execute(APPLIED_DDL)
        outboxer.enqueue_many(
            conn, [{"topic": "cli.t", "payload": {"n": n}, "key": "k"} for n in range(count)]
        )
    settings = outboxer.load_settings({"db": db, "broker": broker}, environ={})
    await outboxer.Relay.from_settings(settings).drain()


async def test_dead_letters_are_listed_replayed_and_purged(
    pg_url: str, exchange: str, tmp_path: Path
) -> None:
    broker = f"{AMQP}?exchange={exchange}"
    group = f"g-{exchange}"
    # Settings from the file ([consumer] table) and the environment; the handler as an argument.
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'db = "{pg_url}"\nbroker = "{broker}"\nmax_attempts = 2\nbackoff_base = 0.05\n'
        f'[consumer]\ngroup = "{group}"\ntopics = ["cli.*"]\n'
    )
    env = {"OUTBOXER_CONFIG": str(config), "OUTBOXER_CONSUMER_BATCH": "4"}
    # Declares and binds the group's queue, finds nothing and exits.
    first = consume("--exit-when-idle", "tests.consumer_handlers:fail_on_zero", env=env)
    assert first.returncode == 0, first.stderr
    await publish(pg_url, broker, 3)
    done = consume("--exit-when-idle", "tests.consumer_handlers:fail_on_zero", env=env)
    assert done.returncode == 0, done.stderr
    assert "is a dead letter after 2 attempt(s): RuntimeError: n is zero" in done.stderr
    assert sorted(r[0] for r in rows(pg_url, "SELECT n FROM applied")) == [1, 2]

    listed = cli("dead-letters", "list", "--db", pg_url, "--json")
    [letter] = json.loads(listed.stdout)
    assert (letter["consumer"], letter["attempts"], letter["error"]) == (
        group,
        2,
        "RuntimeError: n is zero",
    )
    assert json.loads(letter["payload"]) == {"n": 0}

    still = cli(
        "dead-letters", "replay", "--db", pg_url, "--group", group,
        "tests.consumer_handlers:fail_on_zero",
    )  # fmt: skip
    assert still.returncode == 1 and "failed 1" in still.stdout
    fixed = command(
        "dead-letters", "replay", "--db", pg_url, "--group", group,
        "tests.consumer_handlers:fail_on_zero", env={"CONSUMER_TEST_FIXED": "1"},
    )  # fmt: skip
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.strip() == "replayed 1, duplicates 0, failed 0, skipped 0"
    assert sorted(r[0] for r in rows(pg_url, "SELECT n FROM applied")) == [0, 1, 2]
    assert cli("dead-letters", "list", "--db", pg_url).stdout.strip() == "no dead letters"

    # Purge needs to be told what: an id or --all.
    with psycopg.connect(pg_url) as conn:
        conn.execute(
            "INSERT INTO outboxer.dead_letters (consumer, message_id, topic, content_type, "
            "payload, error, attempts) VALUES (%s, %s, 't', 'text/plain', 'x', 'e', 1)",
            (group, uuid.uuid4()),
        )
    vague = cli("dead-letters", "purge", "--db", pg_url, "--group", group)
    assert vague.returncode == 2 and "--id ID" in vague.stderr
    purged = cli("dead-letters", "purge", "--db", pg_url, "--group", group, "--all")
    assert purged.stdout.strip() == "purged 1 dead letter(s)"


def test_usage_errors_exit_2(pg_url: str) -> None:
    no_group = consume("--db", pg_url, "--broker", "memory://x", "tests.consumer_handlers:record")
    assert no_group.returncode == 2 and "no group" in no_group.stderr
    bad_handler = consume("--db", pg_url, "--broker", "memory://x", "--group", "g", "nomodule")
    assert bad_handler.returncode == 2 and "module:function" in bad_handler.stderr
    bad_batch = consume(
        "--db", pg_url, "--broker", "memory://x", "--group", "g", "--batch", "0",
        "tests.consumer_handlers:record",
    )  # fmt: skip
    assert bad_batch.returncode == 2 and "--batch" in bad_batch.stderr
    webhook = consume(
        "--db", pg_url, "--broker", "https://x/y", "--group", "g", "tests.consumer_handlers:record"
    )
    assert webhook.returncode == 2 and "ASGI" in webhook.stderr


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return str(answer.read().decode())


async def test_metrics_endpoint_counts_per_group(
    pg_url: str, exchange: str, tmp_path: Path
) -> None:
    broker = f"{AMQP}?exchange={exchange}"
    group = f"g-{exchange}"
    port = free_port()
    process = spawn(
        ["consume", "--db", pg_url, "--broker", broker, "--group", group, "--topic", "cli.*",
         "--http", f"127.0.0.1:{port}", "tests.consumer_handlers:record"],
        tmp_path / "log",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "receiving from" not in (tmp_path / "log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "log").read_text()
            await asyncio.sleep(0.1)
        await publish(pg_url, broker, 5)
        while rows(pg_url, "SELECT count(*) FROM applied") != [(5,)]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        text = await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics")
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    assert f'outboxer_consumer_applied_total{{group="{group}"}} 5.0' in text
    assert f'outboxer_consumer_acked_total{{group="{group}"}} 5.0' in text
    assert f'outboxer_consumer_dead_lettered_total{{group="{group}"}} 0.0' in text
    assert f'outboxer_consumer_in_flight{{group="{group}"}} 0.0' in text
    assert "outboxer_consumer_handler_seconds_total" in text
