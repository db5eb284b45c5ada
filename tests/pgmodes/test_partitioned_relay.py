"""The real ``outboxer relay`` on a partitioned outbox whose partitions come and go under it:
racing writers, a relay killed with SIGKILL mid-batch, nothing lost, per-key order kept."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import outboxer
from outboxer.stores.postgres import PostgresStore
from tests.conftest import _admin_execute, _pg_url
from tests.rabbit import RabbitConsumer

WRITERS = 4
TRANSACTIONS = 90
KEYS = [f"k{n}" for n in range(8)]
#: Two-second partitions, one range ahead, retention of two seconds: while the writers
#: write, the relays' upkeep makes partitions, moves rows that arrived before their
#: partition out of the default one, and drops published partitions, all under the claims.
PARTITION_SECONDS = 2.0


@pytest.fixture
def fast_partitions_url() -> Iterator[str]:
    name = f"outboxer_t_{uuid.uuid4().hex[:12]}"
    _admin_execute(f"CREATE DATABASE {name}")
    url = _pg_url(name)

    async def apply() -> None:
        async with PostgresStore(url) as store:
            await store.apply_schema(
                partitioned=True, partition_interval=PARTITION_SECONDS, partitions_ahead=1
            )

    asyncio.run(apply())
    yield url
    _admin_execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def spawn_relay(db: str, broker: str, relay_id: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "outboxer.cli", "relay"),
            *("--db", db, "--broker", broker, "--relay-id", relay_id),
            *("--batch-size", "40", "--lock-timeout", "3", "--poll-interval", "0.2"),
            *("--concurrency", "2", "--cleanup-interval", "1", "--published-retention", "2"),
            *("--partitions-ahead", "1"),
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


def write(url: str, writer: int) -> list[tuple[str, int, str]]:
    """Commit TRANSACTIONS transactions of one to three messages on shared keys; return
    (key, seq, id) of each message committed. Keys in sorted order in a transaction, as
    the README asks of separate enqueue calls, so writers never deadlock."""
    committed: list[tuple[str, int, str]] = []
    with psycopg.connect(url) as conn:
        for n in range(TRANSACTIONS):
            keys = sorted({KEYS[(writer * 3 + n + i) % len(KEYS)] for i in range(1 + n % 3)})
            batch = []
            for key in keys:
                message = outboxer.enqueue(
                    conn, "order.placed", {"key": key, "writer": writer, "n": n}, key=key
                )
                row = conn.execute(
                    "SELECT currval(pg_get_serial_sequence('outboxer.outbox', 'seq'))"
                ).fetchone()
                assert row is not None
                batch.append((key, int(row[0]), str(message.id)))
            conn.commit()
            committed += batch
            time.sleep(0.08)  # about 8 s of writing: partitions come and go meanwhile
    return committed


def in_flight(url: str, relay_id: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {
            str(row[0])
            for row in conn.execute(
                "SELECT id FROM outboxer.outbox WHERE status = 'PROCESSING' AND locked_by = %s",
                (relay_id,),
            )
        }


@pytest.mark.timeout(180)
async def test_sigkill_and_racing_writers_while_partitions_come_and_go(
    fast_partitions_url: str, rabbit_consumer: RabbitConsumer, tmp_path: Path
) -> None:
    url, broker = fast_partitions_url, rabbit_consumer.broker_url
    log = tmp_path / "relays.log"
    victim = spawn_relay(url, broker, "relay-victim", log)
    survivor = spawn_relay(url, broker, "relay-survivor", log)
    restarted = None
    try:
        writers = asyncio.gather(*(asyncio.to_thread(write, url, w) for w in range(WRITERS)))
        expected = WRITERS * sum(1 + n % 3 for n in range(TRANSACTIONS))
        await rabbit_consumer.wait_for(expected // 4, timeout=60, distinct=True)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        held = in_flight(url, "relay-victim")
        restarted = spawn_relay(url, broker, "relay-restarted", log)
        committed = [item for batch in await writers for item in batch]
        assert len(committed) == expected
        delivered = await rabbit_consumer.wait_for(len(committed), timeout=90, distinct=True)
        for process in (survivor, restarted):
            process.send_signal(signal.SIGTERM)
        assert survivor.wait(30) == 0 and restarted.wait(30) == 0, log.read_text()[-3000:]
    finally:
        for process in (victim, survivor, restarted):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()

    ids = [d.message_id for d in delivered]
    assert set(ids) == {message_id for _, _, message_id in committed}, "nothing lost"
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert duplicates <= held, "only messages in flight at the kill may arrive twice"
    seq_of = {message_id: seq for _, seq, message_id in committed}
    first_seen: dict[str, list[int]] = {}
    for item in delivered:
        key = json.loads(item.body)["key"]
        if seq_of[item.message_id] not in first_seen.get(key, []):
            first_seen.setdefault(key, []).append(seq_of[item.message_id])
    for key, seqs in first_seen.items():
        assert seqs == sorted(seqs), f"{key} reached the broker out of commit order"
    text = log.read_text()
    assert "created partition" in text and "dropped partition" in text, text[-3000:]
    assert "Traceback" not in text and "cleanup failed" not in text, text[-3000:]
