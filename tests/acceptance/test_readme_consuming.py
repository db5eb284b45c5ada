"""The README's consumer example, as written, against PostgreSQL and RabbitMQ."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aio_pika
import aiormq
import psycopg

import outboxer
from tests.acceptance.test_consume_e2e import ROOT
from tests.services import require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"


def example() -> str:
    readme = (ROOT / "README.md").read_text("utf-8")
    section = readme[readme.index("## Consuming") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None
    return match.group(1)


def start(script: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(script)], stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


async def queue_exists(name: str) -> bool:
    connection = await aio_pika.connect(AMQP)
    try:
        await (await connection.channel()).declare_queue(name, passive=True)
        return True
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    finally:
        await connection.close()


async def test_the_readme_consumer_example_runs_as_written(pg_url: str, tmp_path: Path) -> None:
    require("rabbitmq")
    exchange, group = f"readme-{uuid.uuid4().hex[:8]}", f"shipping-{uuid.uuid4().hex[:8]}"
    broker = f"{AMQP}?exchange={exchange}"
    code = example()
    for literal, value in (
        ('"postgresql://localhost/shipping"', repr(pg_url)),
        ('"amqp://guest:guest@localhost/"', repr(broker)),
        ('group="shipping"', f"group={group!r}"),
    ):
        assert literal in code
        code = code.replace(literal, value)
    script = tmp_path / "events.py"
    script.write_text(code)
    with psycopg.connect(pg_url) as conn:
        conn.execute("CREATE TABLE shipments (order_id integer, customer text)")
    process = start(script, tmp_path / "log")
    try:
        deadline = time.monotonic() + 30
        while not await queue_exists(group):
            assert time.monotonic() < deadline and process.poll() is None, (
                tmp_path / "log"
            ).read_text()
            await asyncio.sleep(0.1)
        with psycopg.connect(pg_url) as conn:
            for order, customer in ((1, "alice"), (2, "bob"), (3, "alice")):
                outboxer.enqueue(conn, "order.placed", {"order_id": order}, key=customer)
        settings = outboxer.load_settings({"db": pg_url, "broker": broker}, environ={})
        await outboxer.Relay.from_settings(settings).drain()
        with psycopg.connect(pg_url) as conn:
            while conn.execute("SELECT count(*) FROM shipments").fetchone() != (3,):
                assert time.monotonic() < deadline, (tmp_path / "log").read_text()
                await asyncio.sleep(0.1)
            shipped = conn.execute("SELECT order_id, customer FROM shipments ORDER BY 1").fetchall()
        assert shipped == [(1, "alice"), (2, "bob"), (3, "alice")]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, (tmp_path / "log").read_text()
        connection = await aio_pika.connect(AMQP)
        channel = await connection.channel()
        await channel.queue_delete(group)
        await channel.exchange_delete(exchange)
        await connection.close()
