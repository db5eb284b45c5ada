"""Relay throughput with encryption at rest on vs off (target: on >= 0.8 x off).

    .venv/bin/python bench/encryption.py [--messages 20000] [--runs 3] [--broker rabbitmq|memory]

Two backlogs of the same ~300-byte messages (bench/harness.py's), one enqueued in plaintext,
one through ``Outbox(encryption=…)`` (AES-256-GCM, one key). Each run drains a fresh clone
of each with an in-process relay (``exit_when_idle``; the encrypted one decrypts every
message before publishing, ``payload = "decrypt"``), off and on alternating, and times it
from start to exit, with the relay's CPU time (it runs in this process): on a shared box
the CPU per message is the steadier figure. Prints the median, min and max of each rate and of their ratio; a
sample of the broker's messages is checked to be plaintext, so "on" did decrypt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from typing import Any

import psycopg

from brokers import RabbitSink
from harness import Databases, backlog_items, log
from outboxer import Outbox, Relay, Settings
from outboxer.brokers.memory import memory_broker
from outboxer.crypto import KeyRing, generate_key

KEYS = f"bench={generate_key()}"
#: CPU seconds of this process (the relay runs in it) of each drain measured, in order.
CPU: list[float] = []


def fill(url: str, count: int, outbox: Outbox, chunk: int = 1000) -> None:
    items = backlog_items(count, keys=1000)
    with psycopg.connect(url) as conn:
        while part := [item for _, item in zip(range(chunk), items, strict=False)]:
            outbox.enqueue_many(conn, part)
            conn.commit()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) outboxer.outbox")
        conn.execute("CHECKPOINT")


async def drain(db: str, broker: str, encrypted: bool) -> float:
    """Seconds the relay takes to publish the whole backlog."""
    settings = Settings(
        db=db,
        broker=broker,
        exit_when_idle=True,
        batch_size=500,
        encryption_keys=KEYS if encrypted else None,
    )
    relay = Relay.from_settings(settings)
    started, cpu_started = time.perf_counter(), time.process_time()
    stats = await relay.run()
    seconds = time.perf_counter() - started
    CPU.append(time.process_time() - cpu_started)
    # Each loop's first connect counts as one; more means the broker came back meanwhile.
    if stats.failed or stats.store_errors or stats.broker_reconnects > settings.concurrency:
        # A service went away meanwhile (other suites restart them): not a measurement.
        raise Disturbed(
            f"failed {stats.failed}, store errors {stats.store_errors}, "
            f"broker reconnects {stats.broker_reconnects}"
        )
    return seconds


class Disturbed(Exception):
    """The measurement saw an outage; it is taken again."""


async def measure(
    databases: Databases, template: str, label: str, broker: str, encrypted: bool
) -> float:
    """Seconds to drain a fresh clone of ``template``; taken again (up to 3 times) when a
    service went away meanwhile."""
    for attempt in range(3):
        clone = databases.clone(template, label)
        sink: Any = None
        try:
            if broker == "rabbitmq":
                sink = await RabbitSink().open()
                url = sink.url
            else:
                memory_broker(label).clear()
                url = f"memory://{label}"
            seconds = await drain(clone, url, encrypted)
            if broker == "memory":
                check_plaintext([m.payload for m in memory_broker(label).messages[:50]])
                memory_broker(label).clear()
            return seconds
        except Exception as exc:  # a broker restart shows as any error: taken again
            if attempt == 2:
                raise
            log(f"{label}: disturbed ({type(exc).__name__}: {exc}); taking it again")
            await asyncio.sleep(5)
        finally:
            if sink is not None:
                with contextlib.suppress(Exception):  # the broker may be the one that went
                    await sink.close()
            databases.drop(clone)
    raise AssertionError("unreachable: the third attempt returns or raises")


def check_plaintext(payloads: list[bytes]) -> None:
    for payload in payloads:
        assert "order_id" in json.loads(payload), "the broker got something else than plaintext"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--broker", choices=("rabbitmq", "memory"), default="rabbitmq")
    args = parser.parse_args()
    databases = Databases()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu_per_1000: dict[str, list[float]] = {"off": [], "on": []}
    try:
        log(f"filling two backlogs of {args.messages} messages")
        plain = databases.empty("plain")
        fill(plain, args.messages, Outbox())
        encrypted = databases.empty("encrypted")
        fill(encrypted, args.messages, Outbox(encryption=KeyRing.from_text(KEYS)))
        for run in range(args.runs):
            for mode, template in (("off", plain), ("on", encrypted)):
                seconds = await measure(
                    databases, template, f"{mode}{run}", args.broker, encrypted=mode == "on"
                )
                rates[mode].append(args.messages / seconds)
                cpu_per_1000[mode].append(CPU[-1] / args.messages * 1000)
                log(f"run {run + 1} encryption {mode}: {args.messages / seconds:,.0f} msg/s")
    finally:
        databases.drop_all()
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    cpu_ratios = [on / off for on, off in zip(cpu_per_1000["on"], cpu_per_1000["off"], strict=True)]
    print(f"relay throughput, {args.messages} messages of ~300 B, {args.broker}, {args.runs} runs")
    print("figure                         median        min        max")
    for name, values, unit in (
        ("encryption.off.rate", rates["off"], "msg/s"),
        ("encryption.on.rate", rates["on"], "msg/s"),
        ("encryption.on_over_off", ratios, "x"),
        ("encryption.off.cpu_per_1000", cpu_per_1000["off"], "CPU s"),
        ("encryption.on.cpu_per_1000", cpu_per_1000["on"], "CPU s"),
        ("encryption.cpu_on_over_off", cpu_ratios, "x"),
    ):
        print(
            f"{name:<26} {statistics.median(values):>10,.2f} {min(values):>10,.2f} "
            f"{max(values):>10,.2f} {unit}"
        )
    verdict = "pass" if statistics.median(ratios) >= 0.8 else "FAIL"
    print(f"target encryption.on_over_off >= 0.8: {verdict}")


if __name__ == "__main__":
    asyncio.run(main())
