"""The README followed literally by a newcomer: its commands, run as written, against the real
services, and what they answer compared with what the README says they answer."""

from __future__ import annotations

import asyncio
import re
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import psycopg
import pytest

import outboxer
from tests.acceptance.test_cli import OUTBOXER, cli
from tests.acceptance.test_consume_e2e import ROOT
from tests.acceptance.test_http_cli import free_port, published_count, request, wait_until
from tests.services import require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"


def readme_section(start: str, end: str) -> str:
    readme = (ROOT / "README.md").read_text("utf-8")
    begin = readme.index(start)
    return readme[begin : readme.index(end, begin)]


def blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, re.DOTALL)


def command(block: str, program: str) -> list[str]:
    """The words of the line of ``block`` that runs ``program``, without its comment."""
    for line in block.splitlines():
        if line.startswith(program + " "):
            return line.partition("#")[0].split()[1:]
    raise AssertionError(f"no `{program}` line in {block!r}")


def substitute(words: list[str], replacements: dict[str, str]) -> list[str]:
    """``words`` with the README's URLs replaced by the test's: every URL must be a known one."""
    unknown = [word for word in words if "://" in word and word not in replacements]
    assert not unknown, unknown
    return [replacements.get(word, word) for word in words]


async def bind_queue(exchange: str, queue: str) -> None:
    connection = await aio_pika.connect(AMQP)
    try:
        channel = await connection.channel()
        events = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        await (await channel.declare_queue(queue, durable=True)).bind(events, "#")
    finally:
        await connection.close()


async def take_one(queue: str) -> aio_pika.abc.AbstractIncomingMessage | None:
    connection = await aio_pika.connect(AMQP)
    try:
        channel = await connection.channel()
        found = await (await channel.declare_queue(queue, durable=True)).get(fail=False)
        if found is not None:
            await found.ack()
        return found
    finally:
        await connection.close()


async def delete_broker_objects(exchange: str, queue: str) -> None:
    connection = await aio_pika.connect(AMQP)
    try:
        channel = await connection.channel()
        await channel.queue_delete(queue)
        await channel.exchange_delete(exchange)
    finally:
        await connection.close()


def test_the_five_minute_path_as_written_publishes_once_a_queue_is_bound(
    pg_url: str, tmp_path: Path
) -> None:
    """The README's "five minutes" section, command by command. The relay publishes with
    `mandatory`, so until a queue is bound to the exchange the message is refused as
    unroutable and retried: the section must say so, or a newcomer's first relay run ends
    with a FAILED row and a warning they were not told about."""
    require("rabbitmq")
    section = readme_section("## Use it in five minutes", "## The write path")
    shell, python = blocks(section, "sh"), blocks(section, "python")
    exchange, queue = f"docs-h-{uuid.uuid4().hex[:8]}", f"docs-h-{uuid.uuid4().hex[:8]}"
    broker = f"{AMQP}?exchange={exchange}"
    urls = {"postgresql://localhost/app": pg_url, "amqp://guest:guest@localhost/": broker}

    schema = cli(*substitute(command(shell[0], "outboxer"), urls))
    assert schema.returncode == 0, schema.stderr

    with psycopg.connect(pg_url) as conn:
        conn.execute("CREATE TABLE orders (id integer PRIMARY KEY, total float)")
    script = tmp_path / "five_minutes.py"
    script.write_text(python[0].replace('"postgresql://localhost/app"', repr(pg_url)))
    wrote = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert wrote.returncode == 0, wrote.stderr
    message_id = uuid.UUID(wrote.stdout.strip())

    relay = [*substitute(command(shell[1], "outboxer"), urls), "--exit-when-idle"]
    try:
        first = cli(*relay)
        assert first.returncode == 0, first.stderr
        with psycopg.connect(pg_url) as conn:
            status, error = conn.execute(
                "SELECT status, last_error FROM outboxer.outbox WHERE id = %s", (message_id,)
            ).fetchone() or (None, None)
        assert status == "FAILED" and "NO_ROUTE" in error, (status, error)
        assert "NO_ROUTE" in section, "the five-minute section does not warn about unroutable"

        asyncio.run(bind_queue(exchange, queue))
        requeued = cli("requeue", "--db", pg_url, "--status", "FAILED")
        assert requeued.returncode == 0 and "requeued 1 " in requeued.stdout, requeued
        second = cli(*relay)
        assert second.returncode == 0, second.stderr
        with psycopg.connect(pg_url) as conn:
            row = conn.execute(
                "SELECT status FROM outboxer.outbox WHERE id = %s", (message_id,)
            ).fetchone()
        assert row == ("PUBLISHED",)
        delivered = asyncio.run(take_one(queue))
        assert delivered is not None
        # "print(message.id)  # a UUIDv7, also the AMQP message_id the consumer sees"
        assert delivered.message_id == str(message_id) and message_id.version == 7
        assert delivered.routing_key == "order.placed"
        assert delivered.headers["outboxer-key"] == "customer-7"
        assert delivered.headers["traceparent"] == "00-ab-01"
    finally:
        asyncio.run(delete_broker_objects(exchange, queue))


def documented_metrics(text: str) -> set[str]:
    """Metric names a README paragraph gives: full names, and `…_suffix` shorthands, read
    against every `_`-boundary prefix of the full name before them."""
    names: set[str] = set()
    last = ""
    for token in re.findall(r"(outboxer_[a-z_]+|…_[a-z_]+)", text):
        if token.startswith("…_"):
            cuts = [i for i, char in enumerate(last) if char == "_"]
            names.update(last[: cut + 1] + token[2:] for cut in cuts)
        else:
            names.add(token)
            last = token
    return names


def served_metrics(exposition: str) -> set[str]:
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            # prometheus_client's `_created` gauges belong to the histogram they follow
            if name.startswith("outboxer_") and not name.endswith("_created"):
                names.add(name)
    return names


@pytest.fixture
def relay_process() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_readme_names_every_metric_a_relay_serves(
    sqlite_url: str, tmp_path: Path, relay_process: list[subprocess.Popen[bytes]]
) -> None:
    """`outboxer relay --http` serves its counters; the README's metrics paragraph is where an
    operator looks a name up before writing an alert on it."""
    database = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    with database:
        outboxer.enqueue(database, "order.placed", {"id": 1}, key="k")
    database.close()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "relay.log"
    relay_process.append(
        subprocess.Popen(
            [
                *OUTBOXER,
                "relay",
                "--db",
                sqlite_url,
                "--broker",
                f"file://{tmp_path / 'events.jsonl'}",
                "--http",
                f"127.0.0.1:{port}",
            ],
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
        )
    )
    wait_until(lambda: published_count(base) >= 1, "the relay published the message")
    status, exposition = request(base + "/metrics")
    assert status == 200
    relay_process[0].send_signal(signal.SIGTERM)
    assert relay_process[0].wait(30) == 0, log.read_text()

    paragraph = readme_section("Metrics: counters of this relay process", "```yaml")
    undocumented = served_metrics(exposition) - documented_metrics(paragraph)
    assert not undocumented, f"served but not in the README: {sorted(undocumented)}"


def test_exit_when_idle_exits_with_nothing_due_while_the_broker_is_down(
    sqlite_url: str, tmp_path: Path
) -> None:
    """README: "`--exit-when-idle`: publish what is due, then exit (scripts, tests, cron)".
    With nothing due there is nothing to publish, whatever the broker's state: a cron job
    that never ends stacks one relay per run."""
    port = free_port()  # nothing listens on it
    log = tmp_path / "relay.log"
    with log.open("ab") as sink:
        relay = subprocess.Popen(
            [
                *OUTBOXER,
                "relay",
                "--db",
                sqlite_url,
                "--broker",
                f"amqp://guest:guest@127.0.0.1:{port}/",
                "--exit-when-idle",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        code = relay.wait(20)
    except subprocess.TimeoutExpired:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
        code = None
    assert code == 0, log.read_text()


def test_a_duplicate_message_id_aborts_a_postgresql_transaction_unless_in_a_savepoint(
    pg_url: str,
) -> None:
    """`DuplicateMessageError` comes from the INSERT, unlike `PayloadError`, which comes before
    any SQL: on PostgreSQL the caller's transaction is then aborted, and the README must not
    leave a newcomer to find out from `InFailedSqlTransaction` later in their request."""
    section = readme_section("## The write path", "## Payload protection")
    assert "DuplicateMessageError" in section and "aborts your transaction" in section
    message_id = uuid.uuid4()
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue(conn, "t", {}, message_id=message_id)
    with psycopg.connect(pg_url) as conn:
        conn.execute("CREATE TABLE orders (id integer)")
        conn.execute("INSERT INTO orders VALUES (1)")
        with pytest.raises(outboxer.DuplicateMessageError), conn.transaction():
            outboxer.enqueue(conn, "t", {}, message_id=message_id)
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (1,)
        with pytest.raises(outboxer.DuplicateMessageError):
            outboxer.enqueue(conn, "t", {}, message_id=message_id)
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            conn.execute("SELECT 1")
        conn.rollback()


def test_a_concurrent_inbox_claim_on_sqlite_waits_only_the_busy_timeout(sqlite_url: str) -> None:
    """README, the inbox: the second delivery "waits … until the first transaction ends". On
    SQLite it waits on the write lock for the connection's busy timeout only, and says so."""
    section = readme_section("## The inbox", "## Consuming")
    assert "database is locked" in section
    path = sqlite_url.removeprefix("sqlite:///")
    first, second = sqlite3.connect(path), sqlite3.connect(path, timeout=0.2)
    try:
        message_id = uuid.uuid4()
        assert outboxer.Inbox().claim(first, "shipping", message_id)
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            outboxer.Inbox().claim(second, "shipping", message_id)
        second.rollback()
        first.commit()
        assert not outboxer.Inbox().claim(second, "shipping", message_id)
    finally:
        first.close()
        second.close()


def test_a_redis_entry_has_the_fields_the_readme_lists(sqlite_url: str) -> None:
    """README, Redis Streams: "fields `id`, `topic`, …": a consumer written against that list
    must find every field the relay writes, and no listed field missing."""
    require("redis")
    import redis

    prefix = f"docs-h-{uuid.uuid4().hex[:8]}."
    database = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    with database:
        outboxer.enqueue(database, "order.placed", {"id": 1}, key="k", headers={"h": "v"})
    database.close()
    relayed = cli(
        "relay",
        "--db",
        sqlite_url,
        "--broker",
        f"redis://127.0.0.1:6379/0?stream_prefix={prefix}",
        "--exit-when-idle",
    )
    assert relayed.returncode == 0, relayed.stderr
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        entries = client.xrange(prefix + "order.placed")
    finally:
        client.delete(prefix + "order.placed")
        client.close()
    assert len(entries) == 1
    written = {field.decode() for field in entries[0][1]}
    section = readme_section("**Redis Streams** (", "**NATS JetStream**")
    listed = set(re.findall(r"`([a-z_]+)`", section.partition("fields ")[2].partition(".")[0]))
    assert written == listed, (written, listed)


NUMBERS = {"Three": 3, "Four": 4, "Five": 5, "Six": 6}


def test_the_postgresql_columns_and_partial_indexes_are_the_readmes(pg_url: str) -> None:
    """README, PostgreSQL: "A row holds `seq` … ; the primary key is …", then how many partial
    indexes keep the queries small: the table `schema apply` made must match both."""
    section = readme_section("A row holds `seq`", "How order per key survives")
    listed = re.findall(r"`([a-z_]+)`", section.partition("; the primary key")[0])
    counted = re.search(r"(\w+) partial indexes", section)
    assert counted is not None
    with psycopg.connect(pg_url) as conn:
        columns = [
            name
            for (name,) in conn.execute(
                "SELECT column_name FROM information_schema.columns"
                " WHERE table_schema = 'outboxer' AND table_name = 'outbox'"
                " ORDER BY ordinal_position"
            )
        ]
        (partial,) = conn.execute(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'outboxer'"
            " AND tablename = 'outbox' AND indexdef LIKE '% WHERE %'"
        ).fetchone() or (None,)
    assert listed == columns
    assert NUMBERS.get(counted.group(1)) == partial, (counted.group(0), partial)


def test_an_unreachable_webhook_burns_no_attempts(sqlite_url: str, tmp_path: Path) -> None:
    """README, the relay: "Database or broker outages never end the relay …: While the broker
    is known to be down it claims nothing, so no attempts are burned". With the defaults a
    webhook receiver down for ~8.5 minutes would otherwise lose (abandon) every message."""
    database = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    with database:
        message = outboxer.enqueue(database, "order.placed", {"id": 1}, key="k")
    database.close()
    port = free_port()  # nothing listens on it: connection refused
    log = tmp_path / "relay.log"
    with log.open("ab") as sink:
        relay = subprocess.Popen(
            [
                *OUTBOXER,
                "relay",
                "--db",
                sqlite_url,
                "--broker",
                f"http://127.0.0.1:{port}/hooks",
                "--max-attempts",
                "3",
                "--backoff-base",
                "1ms",
                "--backoff-max",
                "1ms",
                "--exit-when-idle",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        relay.wait(4)  # ~30 claims' worth of backoff (1 ms) if the outage cost attempts
    except subprocess.TimeoutExpired:  # waiting for the broker, as an outage should
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
    database = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    try:
        row = database.execute(
            "SELECT status, attempts FROM outbox WHERE id = ?", (str(message.id),)
        ).fetchone()
    finally:
        database.close()
    assert row is not None and tuple(row) == ("PENDING", 0), (row, log.read_text()[-2000:])
