"""Retention and the claim-check sweep keep the object of a consumer's dead letter.

A large payload is claim-checked, relayed, dead-lettered by a consumer (whose database may
be another than the outbox's), and then retention deletes its PUBLISHED row and the sweep
runs past the grace. Replaying the dead letter must still read the payload: the consumer
holds the object in the store itself, and the replay (or a purge) releases the hold.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

import outboxer
from outboxer import load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.claimcheck import ClaimCheck, FileObjectStore, ObjectStore, S3ObjectStore
from outboxer.consumer import Consumer, ConsumerStats, Delivery
from outboxer.enqueue import Outbox
from outboxer.relay import cleanup
from outboxer.retry import Backoff
from tests.integration.test_http_api import connect_sync
from tests.relaying import relay
from tests.s3 import CREDENTIALS, REGION, s3_bucket, s3_client, s3_server  # noqa: F401

FAST = Backoff(base=0.01, multiplier=2, cap=0.05, jitter=0)
PAYLOAD = {"blob": "x" * 5000}


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'claims'}"
    endpoint = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return (
        f"s3://{bucket}/claims?endpoint_url={endpoint}&region={REGION}"
        f"&access_key_id={CREDENTIALS['access_key_id']}"
        f"&secret_access_key={CREDENTIALS['secret_access_key']}"
    )


def objects(store: ObjectStore) -> list[str]:
    return sorted(o.name for o in store.list_objects() if not o.name.startswith(".holds"))


def settings_of(outbox_db: str, broker: str, store_url: str) -> Any:
    return load_settings(
        {
            "db": outbox_db,
            "broker": broker,
            "claim_check_store": store_url,
            "published_retention": 0,
            "claim_check_sweep_grace": 0,
        },
        environ={},
    )


async def dead_lettered(
    outbox_db: str, consumer_db: str, store_url: str, group: str = "g"
) -> tuple[Any, str, ObjectStore]:
    """Enqueue a claim-checked message, relay it, and have ``group`` dead-letter it."""
    broker = f"memory://cc-{uuid.uuid4().hex[:8]}"
    memory_broker(broker.removeprefix("memory://")).clear()
    store = outboxer.claimcheck.create_object_store(store_url)
    conn = connect_sync(outbox_db)
    try:
        Outbox(claim_check=ClaimCheck(store, threshold=1024)).enqueue(conn, "t", PAYLOAD)
        conn.commit()
    finally:
        conn.close()
    [name] = objects(store)
    await relay(outbox_db, broker).drain()

    def fails(delivery: Delivery, conn: Any) -> None:
        raise RuntimeError("downstream refused")

    consumer = Consumer(
        db=consumer_db,
        broker=broker,
        group=group,
        handler=fails,
        exit_when_idle=True,
        max_attempts=1,
        backoff=FAST,
        object_store=store,
    )
    stats = await consumer.run_async()
    assert stats.dead_lettered == 1
    return settings_of(outbox_db, broker, store_url), name, store


async def retention(settings: Any) -> None:
    async with outboxer.create_store(settings.db) as outbox_store:
        deleted = await cleanup(outbox_store, settings)
    assert deleted == 1  # the PUBLISHED row went


def replayer(consumer_db: str, store: ObjectStore, seen: list[Delivery]) -> Consumer:
    def keep(delivery: Delivery, conn: Any) -> None:
        seen.append(delivery)

    return Consumer(
        db=consumer_db, broker=None, group="g", handler=keep, object_store=store, backoff=FAST
    )


@pytest.mark.parametrize("consumer_db", ["pg_url", "sqlite_url"])
def test_retention_keeps_a_dead_letters_object_until_it_is_replayed(
    pg_url: str, consumer_db: str, store_url: str, request: pytest.FixtureRequest
) -> None:
    # The consumer's database: the outbox's own, or another one (SQLite).
    asyncio.run(replayed(pg_url, request.getfixturevalue(consumer_db), store_url))


async def replayed(pg_url: str, consumer_url: str, store_url: str) -> None:
    settings, name, store = await dead_lettered(pg_url, consumer_url, store_url)
    await retention(settings)

    seen: list[Delivery] = []
    counts = await replayer(consumer_url, store, seen).replay_dead_letters()
    assert counts["replayed"] == 1, counts  # old code: failed 1, ObjectNotFoundError
    assert [d.payload for d in seen] == [PAYLOAD]
    assert objects(store) == [name]  # until the next sweep

    # Replayed: nothing needs the object any more, and the next sweep deletes it.
    assert store.held() == set()
    await retention_sweep(settings)
    assert objects(store) == []


async def retention_sweep(settings: Any) -> None:
    from outboxer import payload_admin

    await asyncio.to_thread(payload_admin.sweep_claim_checks, settings)


async def test_purging_the_dead_letter_releases_its_object(
    pg_url: str, sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outboxer.cli import main

    store_url = f"file://{tmp_path / 'claims'}"
    settings, name, store = await dead_lettered(pg_url, sqlite_url, store_url)
    await retention(settings)
    assert objects(store) == [name]
    code = await asyncio.to_thread(
        main,
        [
            "dead-letters",
            "purge",
            "--all",
            "--db",
            sqlite_url,
            "--group",
            "g",
            "--claim-check-store",
            store_url,
        ],
    )
    assert code == 0
    assert store.held() == set()
    await retention_sweep(settings)
    assert objects(store) == []


async def test_two_groups_hold_one_object_each_until_both_let_go(
    pg_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    store = FileObjectStore(tmp_path / "claims")
    settings, name, _ = await dead_lettered(pg_url, sqlite_url, f"file://{store.directory}")
    store.put_hold(name, "other")  # a second group's dead letter of the same message
    await retention(settings)
    counts = await replayer(sqlite_url, store, []).replay_dead_letters()
    assert counts["replayed"] == 1
    await retention_sweep(settings)
    assert objects(store) == [name]  # "other" still holds it
    store.delete_hold(name, "other")
    await retention_sweep(settings)
    assert objects(store) == []


def test_s3_holds_are_not_objects(s3_client: Any, s3_bucket: str) -> None:  # noqa: F811
    store = S3ObjectStore(s3_bucket, prefix="claims", client=s3_client)
    name = outboxer.claimcheck.object_name(uuid.uuid4(), "t")
    store.put(name, b"data")
    store.put_hold(name, "g")
    store.put_hold(name, "g")  # twice: no error
    assert store.held() == {name}
    assert outboxer.claimcheck.sweep_orphans(store, lambda names: [], grace=0) == 0
    assert [o.name for o in store.list_objects() if not o.name.startswith(".")] == [name]
    store.delete_hold(name, "g")
    assert store.held() == set()
    assert outboxer.claimcheck.sweep_orphans(store, lambda names: [], grace=0) == 1


def dead_letter_all(
    db: str, store: FileObjectStore, sent: list[Any], **options: Any
) -> ConsumerStats:
    """Consume ``sent`` from a memory broker with a handler that always fails and
    ``max_attempts=1``: each is dead-lettered at its first delivery."""
    broker = f"cc-{uuid.uuid4().hex[:8]}"
    memory_broker(broker).clear()
    memory_broker(broker).messages.extend(sent)

    def fails(delivery: Delivery, conn: Any) -> None:
        raise RuntimeError("downstream refused")

    consumer = Consumer(
        db=db,
        broker=f"memory://{broker}",
        group="g",
        handler=fails,
        exit_when_idle=True,
        max_attempts=1,
        backoff=FAST,
        object_store=store,
        **options,
    )
    return asyncio.run(consumer.run_async())


def test_messages_held_back_behind_a_dead_letter_are_held_too(
    sqlite_url: str, tmp_path: Path
) -> None:
    from outboxer.claimcheck import references
    from outboxer.testing import make_message

    store = FileObjectStore(tmp_path / "claims")
    claim = ClaimCheck(store, threshold=10)
    sent = [claim.offload(make_message("t", {"n": n, **PAYLOAD}, key="a")) for n in range(2)]
    stats = dead_letter_all(sqlite_url, store, sent, abandoned_blocks_key=True)
    assert (stats.dead_lettered, stats.held) == (2, 1)
    assert store.held() == set(references(sent))

    seen: list[Delivery] = []
    counts = asyncio.run(replayer(sqlite_url, store, seen).replay_dead_letters())
    assert counts["replayed"] == 2
    assert store.held() == set()


def test_the_hold_is_durable_before_the_dead_letter_is_written(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Hold first, dead letter second: a store that refuses the hold keeps the dead letter
    from being written (the message is not acked, and tried again), never the reverse."""
    import sqlite3

    from outboxer.testing import make_message

    path = sqlite_url.removeprefix("sqlite:///")
    letters_at_hold: list[int] = []

    class Flaky(FileObjectStore):
        def put_hold(self, name: str, holder: str) -> None:
            with sqlite3.connect(path) as conn:
                letters_at_hold.append(
                    conn.execute("SELECT count(*) FROM dead_letters").fetchone()[0]
                )
            if len(letters_at_hold) == 1:
                raise OSError("store unavailable")
            super().put_hold(name, holder)

    store = Flaky(tmp_path / "claims")
    sent = ClaimCheck(store, threshold=10).offload(make_message("t", PAYLOAD))
    stats = dead_letter_all(sqlite_url, store, [sent])
    assert stats.dead_lettered == 1
    assert letters_at_hold == [0, 0]  # neither attempt found the dead letter written first
    assert store.held() == {sent.headers["outboxer-claim-check"]}
