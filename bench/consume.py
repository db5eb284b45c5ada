"""Consumer throughput per broker: outboxer.Consumer (receive, inbox claim, commit, ack)
beside the raw consume rate of the same client library (receive and ack, no database), over
the same backlog.

    .venv/bin/python bench/consume.py                    # every broker, 3 runs each
    .venv/bin/python bench/consume.py --quick            # small backlog, one run
    .venv/bin/python bench/consume.py --only rabbitmq,redis --messages 20000 --json c.json

Per broker and run: the backlog (``--messages`` over ``--keys`` keys, ~300-byte JSON
payloads) is published once through outboxer's publisher into four groups (queues bound to
one exchange, consumer groups of one stream or topic, durables of one stream). The raw
client drains one group. The Consumer, with its defaults (concurrency 4, batch 100), drains
the others:

- ``consumer``: a handler that writes nothing, so the figure is the runner's own work
  (receive, decode, the inbox claim, the commit in PostgreSQL with ``synchronous_commit =
  on``, the ack): what "consume + inbox + commit" costs beside the raw client. ``ratio`` =
  consumer / raw is the target figure.
- ``consumer_insert``: the README's kind of handler, a plain function doing one psycopg
  INSERT per message, run in the consumer's threads; ``ratio_insert`` = it / raw.
- ``consumer_async``: an async handler doing the same INSERT through asyncpg on the event
  loop; ``ratio_async`` = it / raw.

``db_control``: the handler's database share alone, the same INSERTs 100 to a transaction
on 4 asyncpg connections with no broker and no inbox; ``vs_ceiling`` = consumer_insert /
min(raw, db_control). ``cpu_us`` figures are the process's CPU time per message (raw loop,
runner alone, runner with the INSERT handler): everything here runs under one interpreter
lock, so the rates follow them. Rates run from the first message handled to the last one
acked (``raw``) or applied, so connecting is not timed. The table prints the median of the
runs with min and max; everything shares the machine's cores (``box_busy``, in cores, says
how busy it was during ``consumer_insert``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import outboxer
from harness import BoxMeter, Databases, Report, Target, log
from outboxer.brokers import create_publisher
from outboxer.message import Message, uuid7
from outboxer.receivers import create_receiver

BROKERS = ("rabbitmq", "redis", "nats", "kafka")
TARGETS = [
    Target("consume.rabbitmq.ratio", ">=", 0.5, "consumer >= 0.5 x raw consume, RabbitMQ"),
    Target("consume.redis.ratio", ">=", 0.5, "consumer >= 0.5 x raw consume, Redis Streams"),
]
AMQP = "amqp://guest:guest@127.0.0.1:5672/"
REDIS = "redis://127.0.0.1:6379/0"
NATS = "nats://127.0.0.1:4222"
PREFETCH = 800  # the Consumer's default prefetch at concurrency 4, batch 100

DDL = "CREATE TABLE applied (message_id uuid NOT NULL, key text, n integer NOT NULL)"


async def insert_async(message: outboxer.Delivery, conn: Any) -> None:
    await conn.execute(
        "INSERT INTO applied (message_id, key, n) VALUES ($1, $2, $3)",
        message.id,
        message.key,
        message.payload["n"],
    )


def record_only(message: outboxer.Delivery, conn: Any) -> None:
    """Writes nothing: what is measured is the runner's inbox claim and commit."""


def insert_sync(message: outboxer.Delivery, conn: Any) -> None:
    conn.execute(
        "INSERT INTO applied (message_id, key, n) VALUES (%s, %s, %s)",
        (message.id, message.key, message.payload["n"]),
    )


def backlog(topic: str, count: int, keys: int) -> list[Message]:
    filler = "x" * 270
    return [
        Message(
            id=uuid7(),
            topic=topic,
            payload=json.dumps({"n": n, "data": filler}, separators=(",", ":")).encode(),
            key=f"key-{n % keys}",
            headers={"traceparent": uuid.uuid4().hex},
        )
        for n in range(count)
    ]


class Side:
    """One broker: its URL for a run, how to drain a group raw, and how to clean up."""

    def __init__(self, broker: str) -> None:
        self.broker = broker
        self.tag = uuid.uuid4().hex[:8]
        self.topic = f"bench.{self.tag}" if broker != "kafka" else f"bench-{self.tag}"
        self.cluster: Any = None
        if broker == "rabbitmq":
            self.url = f"{AMQP}?exchange=bench-{self.tag}"
        elif broker == "redis":
            self.url = REDIS
        elif broker == "nats":
            self.url = f"{NATS}?stream=B{self.tag}&create_stream=true&subjects={self.topic}"
        else:
            self.cluster = _mock_kafka()
            self.url = (
                f"kafka://{self.cluster[1]}?session.timeout.ms=6000&heartbeat.interval.ms=500"
            )

    def receiver(self, group: str) -> Any:
        return create_receiver(self.url, group=group, topics=[self.topic], prefetch=PREFETCH)

    async def prepare(self, groups: list[str], messages: list[Message]) -> None:
        """Create every group's subscription, then publish the backlog once."""
        for group in groups:
            receiver = self.receiver(group)
            await receiver.connect()
            await receiver.close()
        async with create_publisher(self.url) as publisher:
            for start in range(0, len(messages), 500):
                outcomes = await publisher.publish_batch(messages[start : start + 500])
                assert all(o.published for o in outcomes), outcomes[:3]

    async def raw(self, group: str, count: int) -> Clock:
        """The client library alone: receive and ack ``count`` messages."""
        return await RAW[self.broker](self, group, count)

    async def cleanup(self, groups: list[str]) -> None:
        if self.broker == "rabbitmq":
            import aio_pika

            connection = await aio_pika.connect(AMQP)
            channel = await connection.channel()
            for group in groups:
                await channel.queue_delete(group)
            await channel.exchange_delete(f"bench-{self.tag}")
            await connection.close()
        elif self.broker == "redis":
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(REDIS)
            await client.delete(self.topic)
            await client.aclose()
        elif self.broker == "nats":
            import nats

            nc = await nats.connect(NATS)
            await nc.jetstream().delete_stream(f"B{self.tag}")
            await nc.close()
        else:
            self.cluster[0].close()


def _mock_kafka() -> tuple[Any, str]:
    """A librdkafka mock cluster, alive as long as its owner (no Kafka broker runs here)."""
    import logging

    from confluent_kafka import Producer

    quiet = logging.getLogger("bench.kafka")
    quiet.propagate = False
    owner = Producer({"bootstrap.servers": "mock", "test.mock.num.brokers": 1, "logger": quiet})
    brokers = owner.list_topics(timeout=10).brokers.values()
    return owner, ",".join(f"{b.host}:{b.port}" for b in brokers)


class Clock:
    """From the first message handled to the last: the rate over what came in between."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.first: float | None = None
        self.at_first = 0
        self.last = 0.0
        self.cpu_first = 0.0
        self.cpu_last = 0.0

    def tick(self, done: int) -> bool:
        now, cpu = time.perf_counter(), time.process_time()
        if self.first is None and done:
            self.first, self.at_first, self.cpu_first = now, done, cpu
        self.last, self.cpu_last = now, cpu
        return done >= self.count

    @property
    def rate(self) -> float:
        assert self.first is not None
        return (self.count - self.at_first) / max(self.last - self.first, 1e-9)

    @property
    def cpu_us(self) -> float:
        """The whole process's CPU time per message over the same span, in microseconds."""
        return (self.cpu_last - self.cpu_first) / max(self.count - self.at_first, 1) * 1e6


async def _raw_rabbitmq(side: Side, group: str, count: int) -> Clock:
    import aio_pika

    connection = await aio_pika.connect(AMQP)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=PREFETCH)
    queue = await channel.declare_queue(group, durable=True)
    clock, done, finished = Clock(count), 0, asyncio.Event()

    async def on_message(message: Any) -> None:
        nonlocal done
        json.loads(message.body)
        await message.ack()
        done += 1
        if clock.tick(done):
            finished.set()

    await queue.consume(on_message)
    await finished.wait()
    await connection.close()
    return clock


async def _raw_redis(side: Side, group: str, count: int) -> Clock:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS)
    clock, done = Clock(count), 0
    while not clock.tick(done):
        reply = await client.xreadgroup(group, "raw", {side.topic: ">"}, count=PREFETCH, block=1000)
        for _, entries in reply or []:
            for _, fields in entries:
                json.loads(fields[b"payload"])
            if entries:
                await client.xack(side.topic, group, *(entry_id for entry_id, _ in entries))
                done += len(entries)
    await client.aclose()
    return clock


async def _raw_nats(side: Side, group: str, count: int) -> Clock:
    import nats

    nc = await nats.connect(NATS)
    subscription = await nc.jetstream().pull_subscribe_bind(group, f"B{side.tag}")
    clock, done = Clock(count), 0
    while not clock.tick(done):
        try:
            messages = await subscription.fetch(PREFETCH, 1.0)
        except (TimeoutError, nats.errors.TimeoutError):
            continue
        for message in messages:
            json.loads(message.data)
            await message.ack()
        await nc.flush()
        done += len(messages)
    await nc.close()
    return clock


async def _raw_kafka(side: Side, group: str, count: int) -> Clock:
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": side.cluster[1],
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([side.topic])
    clock, done = Clock(count), 0
    while not clock.tick(done):
        messages = await asyncio.to_thread(consumer.consume, PREFETCH, 0.5)
        for message in messages:
            if message.error() is None:
                json.loads(message.value())
                done += 1
        if messages:
            consumer.commit(asynchronous=True)
    await asyncio.to_thread(consumer.close)
    return clock


RAW: dict[str, Callable[[Side, str, int], Awaitable[Clock]]] = {
    "rabbitmq": _raw_rabbitmq,
    "redis": _raw_redis,
    "nats": _raw_nats,
    "kafka": _raw_kafka,
}


async def db_control(db: str, count: int, keys: int) -> float:
    """The database's share alone: the handler's INSERT for each message, 100 to a transaction
    on 4 asyncpg connections (the Consumer's defaults), no broker, no inbox; messages/s."""
    import asyncpg

    messages = backlog("control", count, keys)
    batches = [messages[i : i + 100] for i in range(0, count, 100)]
    connections = [await asyncpg.connect(db) for _ in range(4)]

    async def work(conn: Any) -> None:
        while batches:
            batch = batches.pop()
            async with conn.transaction():
                for message in batch:
                    n = json.loads(message.payload)["n"]
                    await conn.execute(
                        "INSERT INTO applied (message_id, key, n) VALUES ($1, $2, $3)",
                        message.id,
                        message.key,
                        n,
                    )

    started = time.perf_counter()
    await asyncio.gather(*(work(conn) for conn in connections))
    elapsed = time.perf_counter() - started
    for conn in connections:
        await conn.close()
    return count / elapsed


async def consumer_rate(side: Side, group: str, db: str, count: int, handler: Any) -> Clock:
    consumer = outboxer.Consumer(
        db=db, broker=side.url, group=group, handler=handler, topics=[side.topic]
    )
    task = asyncio.create_task(consumer.run_async())
    clock = Clock(count)
    try:
        while not clock.tick(consumer.stats.applied + consumer.stats.duplicates):
            if task.done():
                task.result()
            await asyncio.sleep(0.005)
    finally:
        consumer.stop()
        await task
    with psycopg.connect(db) as conn:
        (claimed,) = conn.execute(
            "SELECT count(*) FROM outboxer.inbox WHERE consumer = %s", (group,)
        ).fetchone() or (0,)
        (rows,) = conn.execute("SELECT count(*) FROM applied").fetchone() or (0,)
    assert claimed == count, f"{claimed} inbox rows for {count} messages"
    assert rows in (0, count), f"{rows} rows for {count} messages"
    return clock


async def one_run(broker: str, count: int, keys: int, dbs: Databases, report: Report) -> None:
    side = Side(broker)
    raw_group, runner_group, sync_group, async_group = (
        f"{name}-{side.tag}" for name in ("raw", "runner", "sync", "cons")
    )
    groups = [raw_group, runner_group, sync_group, async_group]
    figure = f"consume.{broker}"
    try:
        await side.prepare(groups, backlog(side.topic, count, keys))
        raw = await side.raw(raw_group, count)
        report.add(f"{figure}.raw", "msg/s", raw.rate)
        db = dbs.empty("consume")
        with psycopg.connect(db) as conn:
            conn.execute(DDL)
        runner = await consumer_rate(side, runner_group, db, count, record_only)
        report.add(f"{figure}.consumer", "msg/s", runner.rate)
        report.add(f"{figure}.ratio", "x", runner.rate / raw.rate)
        meter = BoxMeter().start()
        inserting = await consumer_rate(side, sync_group, db, count, insert_sync)
        box = meter.stop()
        with psycopg.connect(db) as conn:
            conn.execute("TRUNCATE applied")
        control = await db_control(db, count, keys)
        report.add(f"{figure}.consumer_insert", "msg/s", inserting.rate)
        report.add(f"{figure}.ratio_insert", "x", inserting.rate / raw.rate)
        report.add(f"{figure}.db_control", "msg/s", control)
        report.add(f"{figure}.vs_ceiling", "x", inserting.rate / min(raw.rate, control))
        report.add(f"{figure}.box_busy", "cores", box["busy"])
        report.add(f"{figure}.box_postgres", "cores", box["postgres"])
        with psycopg.connect(db) as conn:
            conn.execute("TRUNCATE applied")
        on_loop = await consumer_rate(side, async_group, db, count, insert_async)
        report.add(f"{figure}.consumer_async", "msg/s", on_loop.rate)
        report.add(f"{figure}.ratio_async", "x", on_loop.rate / raw.rate)
        report.add(f"{figure}.cpu_us.raw", "us", raw.cpu_us)
        report.add(f"{figure}.cpu_us.consumer", "us", runner.cpu_us)
        report.add(f"{figure}.cpu_us.consumer_insert", "us", inserting.cpu_us)
        report.add(f"{figure}.cpu_us.consumer_async", "us", on_loop.cpu_us)
        log(
            f"{broker}: raw {raw.rate:,.0f} msg/s, consumer {runner.rate:,.0f} msg/s "
            f"({runner.rate / raw.rate:.2f} x), with an INSERT {inserting.rate:,.0f} msg/s "
            f"({inserting.rate / raw.rate:.2f} x), async INSERT {on_loop.rate:,.0f} msg/s"
        )
    finally:
        await side.cleanup(groups)


def table(report: Report) -> str:
    targets = {t.figure: t for t in TARGETS}
    lines = [f"{'figure':<34} {'median':>10} {'min':>10} {'max':>10}  {'unit':<6} target"]
    for name, figure in report.figures.items():
        goal = ""
        if name in targets:
            t = targets[name]
            goal = f"{t.op} {t.bound:g}  {'pass' if t.passed(figure.median) else 'FAIL'}"
        fmt = "{:,.0f}" if figure.unit in ("msg/s", "us") else "{:.2f}"
        values = (fmt.format(v) for v in (figure.median, figure.low, figure.high))
        lines.append(
            f"{name:<34} " + " ".join(f"{v:>10}" for v in values) + f"  {figure.unit:<6} {goal}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2,000 messages, one run")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", help=f"comma-separated brokers of {','.join(BROKERS)}")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.runs = 2_000, 1
    brokers = args.only.split(",") if args.only else list(BROKERS)
    report = Report()
    report.meta.update(
        {
            "messages": args.messages,
            "keys": args.keys,
            "runs": args.runs,
            "loadavg_start": os.getloadavg(),
        }
    )
    dbs = Databases()
    try:
        for run in range(args.runs):
            for broker in brokers:
                log(f"run {run + 1}/{args.runs}: {broker}")
                asyncio.run(one_run(broker, args.messages, args.keys, dbs, report))
    finally:
        dbs.drop_all()
    report.meta["loadavg_end"] = os.getloadavg()
    print(table(report))
    if args.json:
        figures = {name: figure.as_dict() for name, figure in report.figures.items()}
        Path(args.json).write_text(json.dumps({"meta": report.meta, "figures": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
