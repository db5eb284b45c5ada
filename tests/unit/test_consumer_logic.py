"""The consumer runner's logic on SQLite and the in-process broker (``memory://``): order per
key under concurrency, batches, retries, dead letters, malformed messages, decoding."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import uuid
from typing import Any

import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery, load_handler
from outboxer.errors import ConfigError
from outboxer.message import Message
from outboxer.receivers.base import Watermark, decode
from outboxer.receivers.memory import group_state
from outboxer.retry import Backoff
from outboxer.testing import make_message

FAST = Backoff(base=0.01, multiplier=2, cap=0.05, jitter=0)


@pytest.fixture
def broker() -> str:
    name = f"unit-{uuid.uuid4().hex[:8]}"
    memory_broker(name).clear()
    return name


@pytest.fixture
def db(sqlite_url: str) -> str:
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        conn.execute(
            "CREATE TABLE applied (position INTEGER PRIMARY KEY, id TEXT, key TEXT, n INT)"
        )
    return sqlite_url


def applied(db: str) -> list[tuple[str, str | None, int]]:
    with sqlite3.connect(db.removeprefix("sqlite:///")) as conn:
        return conn.execute("SELECT id, key, n FROM applied ORDER BY position").fetchall()


def dead_letters(db: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db.removeprefix("sqlite:///")) as conn:
        return conn.execute(
            "SELECT key, error, attempts, held FROM dead_letters ORDER BY seq"
        ).fetchall()


def record(message: Delivery, conn: sqlite3.Connection) -> None:
    conn.execute(
        "INSERT INTO applied (id, key, n) VALUES (?, ?, ?)",
        (str(message.id), message.key, message.payload["n"]),
    )


def publish(broker: str, *messages: Message) -> None:
    memory_broker(broker).messages.extend(messages)


def consume(db: str, broker: str, handler: Any = record, **options: Any) -> Any:
    options.setdefault("backoff", FAST)
    consumer = Consumer(
        db=db,
        broker=f"memory://{broker}",
        group="g",
        handler=handler,
        exit_when_idle=True,
        **options,
    )
    return consumer, asyncio.run(consumer.run_async())


def test_each_key_in_delivery_order_while_keys_run_in_parallel(db: str, broker: str) -> None:
    publish(broker, *(make_message("t", {"n": n}, key=f"k{n % 7}") for n in range(300)))
    publish(broker, *(make_message("t", {"n": n}) for n in range(300, 330)))  # keyless

    def jittery(message: Delivery, conn: sqlite3.Connection) -> None:
        if random.random() < 0.2:
            import time

            time.sleep(0.002)
        record(message, conn)

    _, stats = consume(db, broker, jittery, concurrency=4, batch=5)
    rows = applied(db)
    assert stats.applied == len(rows) == 330
    for key in {f"k{k}" for k in range(7)}:
        numbers = [n for _, k, n in rows if k == key]
        assert numbers == sorted(numbers) and len(numbers) in (42, 43)
    assert stats.transactions < 330  # batches of different keys shared transactions


def test_a_redelivery_is_acked_without_calling_the_handler(db: str, broker: str) -> None:
    message = make_message("t", {"n": 1}, key="k")
    publish(broker, message, make_message("t", {"n": 2}, key="k"), message)
    calls: list[int] = []

    def counting(delivery: Delivery, conn: sqlite3.Connection) -> None:
        calls.append(delivery.payload["n"])
        record(delivery, conn)

    _, stats = consume(db, broker, counting)
    assert calls == [1, 2]
    assert (stats.applied, stats.duplicates) == (2, 1)
    assert group_state(broker, "g").acked == {0, 1, 2}


def test_a_failing_message_holds_its_key_only(db: str, broker: str) -> None:
    publish(broker, *(make_message("t", {"n": n}, key=f"k{n % 2}") for n in range(6)))
    seen: list[int] = []

    def flaky(delivery: Delivery, conn: sqlite3.Connection) -> None:
        if delivery.payload["n"] == 0 and delivery.attempt < 3:
            raise RuntimeError("not yet")
        seen.append(delivery.payload["n"])
        record(delivery, conn)

    _, stats = consume(db, broker, flaky, backoff=Backoff(0.2, 1, 0.2, 0))
    assert [n for _, k, n in applied(db) if k == "k0"] == [0, 2, 4]
    # k1 went on while k0's head waited for its retries.
    assert seen.index(5) < seen.index(0)
    assert (stats.failed, stats.applied) == (2, 6)


def test_an_innocent_message_is_not_charged_for_a_batch_mate(db: str, broker: str) -> None:
    publish(broker, *(make_message("t", {"n": n}, key=f"k{n}") for n in range(8)))
    attempts: dict[int, list[int]] = {}

    def one_bad(delivery: Delivery, conn: sqlite3.Connection) -> None:
        attempts.setdefault(delivery.payload["n"], []).append(delivery.attempt)
        record(delivery, conn)
        if delivery.payload["n"] == 3:
            raise RuntimeError("bad")

    _, stats = consume(db, broker, one_bad, concurrency=1, batch=8, max_attempts=2)
    assert all(set(seen) == {1} for n, seen in attempts.items() if n != 3)
    assert attempts[3] == [1, 2]
    assert sorted(n for _, _, n in applied(db)) == [0, 1, 2, 4, 5, 6, 7]
    assert dead_letters(db) == [("k3", "RuntimeError: bad", 2, 0)]
    assert (stats.applied, stats.dead_lettered) == (7, 1)


def test_an_unreadable_message_is_a_dead_letter_at_once(db: str, broker: str) -> None:
    bad = Message(id=uuid.uuid4(), topic="t", payload=b"{not json", key="k")
    publish(broker, bad, make_message("t", {"n": 1}, key="k"))
    _, stats = consume(db, broker)
    [letter] = dead_letters(db)
    assert letter[0] == "k" and letter[1].startswith("payload is not the JSON") and letter[2] == 0
    assert [n for _, _, n in applied(db)] == [1]
    assert (stats.malformed, stats.dead_lettered) == (1, 1)


def test_async_handlers_need_postgresql(db: str, broker: str) -> None:
    async def handler(message: Delivery, conn: Any) -> None:
        return None

    with pytest.raises(ConfigError, match="async handlers run on PostgreSQL"):
        Consumer(db=db, broker=f"memory://{broker}", group="g", handler=handler)


def test_load_handler_names_what_is_wrong() -> None:
    assert load_handler("tests.consumer_handlers:record").__name__ == "record"
    with pytest.raises(ConfigError, match="module:function"):
        load_handler("tests.consumer_handlers")
    with pytest.raises(ConfigError, match="cannot import"):
        load_handler("no_such_module_here:f")
    with pytest.raises(ConfigError, match="has no"):
        load_handler("tests.consumer_handlers:nothing")


def test_decode_reads_the_envelope_and_keeps_user_headers() -> None:
    message = make_message("orders", {"a": 1}, key="k", headers={"trace": "x"})
    incoming = decode(message.envelope_headers(), message.payload)
    delivery = incoming.delivery
    assert incoming.malformed is None
    assert (delivery.id, delivery.topic, delivery.key) == (message.id, "orders", "k")
    assert delivery.payload == {"a": 1} and delivery.headers == {"trace": "x"}
    assert decode({}, b"x").malformed == "no message id: not published by outboxer?"
    text = decode({"outboxer-id": str(uuid.uuid4()), "content-type": "text/plain"}, "é".encode())
    assert text.delivery.payload == "é" and text.delivery.key is None


def test_watermark_moves_over_contiguous_positions_only() -> None:
    marks = Watermark(10)
    assert not marks.complete(11)
    assert marks.complete(10) and marks.next == 12
    assert not marks.complete(5)


def test_held_count_is_bounded_by_prefetch(db: str, broker: str) -> None:
    publish(broker, *(make_message("t", {"n": n}, key="one") for n in range(50)))
    peak = 0
    consumer_box: list[Consumer] = []

    def watch(delivery: Delivery, conn: sqlite3.Connection) -> None:
        nonlocal peak
        peak = max(peak, consumer_box[0].in_flight)
        record(delivery, conn)

    consumer = Consumer(
        db=db,
        broker=f"memory://{broker}",
        group="g",
        handler=watch,
        prefetch=7,
        exit_when_idle=True,
    )
    consumer_box.append(consumer)
    asyncio.run(consumer.run_async())
    assert 1 <= peak <= 7
    assert len(applied(db)) == 50


def test_a_broker_outage_reconnects_and_redelivers_what_was_not_acked(db: str, broker: str) -> None:
    publish(broker, *(make_message("t", {"n": n}, key=f"k{n % 3}") for n in range(40)))
    memory = memory_broker(broker)

    def flaky_broker(delivery: Delivery, conn: sqlite3.Connection) -> None:
        record(delivery, conn)
        if delivery.payload["n"] == 10 and memory.available:
            memory.available = False  # the broker goes away mid-run, then comes back

    async def main() -> Any:
        consumer = Consumer(
            db=db, broker=f"memory://{broker}", group="g", handler=flaky_broker, concurrency=1
        )
        task = asyncio.create_task(consumer.run_async())
        while consumer.stats.broker_errors == 0:
            await asyncio.sleep(0.01)
        memory.available = True
        while len({row[0] for row in applied(db)}) < 40:
            await asyncio.sleep(0.01)
        consumer.stop()
        return await task

    stats = asyncio.run(main())
    rows = applied(db)
    assert len(rows) == len({row[0] for row in rows}) == 40  # none twice
    assert stats.broker_errors >= 1 and stats.failed == 0
    state = group_state(broker, "g")
    assert not state.unacked


def test_encrypted_and_claim_checked_payloads_reach_the_handler_as_plaintext(
    db: str, broker: str, tmp_path: Any
) -> None:
    import dataclasses
    import os

    from outboxer.claimcheck import ClaimCheck, FileObjectStore
    from outboxer.crypto import KeyRing, encrypt_message

    keyring = KeyRing({"k1": os.urandom(32)})
    store = FileObjectStore(tmp_path / "objects")
    sealed = encrypt_message(make_message("t", {"n": 1}, key="a"), keyring)
    offloaded = ClaimCheck(store, threshold=10).offload(make_message("t", {"n": 2, "x": "y" * 50}))
    both = ClaimCheck(store, threshold=10).offload(
        encrypt_message(make_message("t", {"n": 3, "x": "z" * 50}), keyring)
    )
    tampered = encrypt_message(make_message("t", {"n": 4}, key="b"), keyring)
    tampered = dataclasses.replace(tampered, payload=tampered.payload[:-1] + b"\x00")
    publish(broker, sealed, offloaded, both, tampered)
    seen: list[Delivery] = []

    def keep(delivery: Delivery, conn: sqlite3.Connection) -> None:
        seen.append(delivery)
        record(delivery, conn)

    _, stats = consume(db, broker, keep, keyring=keyring, object_store=store)
    assert sorted(d.payload["n"] for d in seen) == [1, 2, 3]
    assert all(d.content_type == "application/json" for d in seen)
    assert all(not any(h.startswith("outboxer-") for h in d.headers) for d in seen)
    [letter] = dead_letters(db)
    assert letter[0] == "b" and letter[1].startswith("DecryptionError") and letter[2] == 0
    assert (stats.applied, stats.dead_lettered, stats.malformed) == (3, 1, 1)


def test_an_encrypted_message_s_dead_letter_stays_encrypted_and_replays_decrypted(
    db: str, broker: str
) -> None:
    """Encryption at rest holds in the dead-letter table too: a message the handler keeps
    failing is stored as it arrived (ciphertext, its key-id header), not as the plaintext
    the handler saw; a replay decrypts it again."""
    import os

    from outboxer.crypto import KeyRing, encrypt_message

    keyring = KeyRing({"k1": os.urandom(32)})
    secret = "card-4111-1111-1111-1111"
    sealed = encrypt_message(make_message("t", {"n": 1, "card": secret}, key="a"), keyring)
    publish(broker, sealed)

    def fails(delivery: Delivery, conn: sqlite3.Connection) -> None:
        assert delivery.payload["card"] == secret  # the handler sees plaintext
        raise RuntimeError("downstream refused")

    _, stats = consume(db, broker, fails, keyring=keyring, max_attempts=2)
    assert stats.dead_lettered == 1
    with sqlite3.connect(db.removeprefix("sqlite:///")) as conn:
        [(payload, headers, content_type)] = conn.execute(
            "SELECT payload, headers, content_type FROM dead_letters"
        ).fetchall()
    assert secret.encode() not in bytes(payload) and bytes(payload) == sealed.payload
    assert secret not in headers and "outboxer-key-id" in headers.lower()
    assert content_type == sealed.content_type
    replayed = Consumer(
        db=db, broker=None, group="g", handler=record, keyring=keyring, backoff=FAST
    )
    assert asyncio.run(replayed.replay_dead_letters())["replayed"] == 1
    assert applied(db) == [(str(sealed.id), "a", 1)]


def test_an_unreadable_message_waits_for_the_earlier_ones_of_its_key(db: str, broker: str) -> None:
    """Dead-lettered at once but in its key's turn: ahead of an earlier message of its key
    still retrying, its dead letter would (with abandoned_blocks_key) hold that earlier
    message back behind a later one, and a replay would apply them out of order."""
    first = make_message("t", {"n": 1}, key="k")
    bad = Message(id=uuid.uuid4(), topic="t", payload=b"{not json", key="k")
    publish(broker, first, bad)

    def once_refused(delivery: Delivery, conn: sqlite3.Connection) -> None:
        if delivery.attempt == 1:
            raise RuntimeError("not yet")
        record(delivery, conn)

    _, stats = consume(db, broker, once_refused, abandoned_blocks_key=True, max_attempts=3)
    assert [(key, n) for _, key, n in applied(db)] == [("k", 1)], "applied, not held"
    [letter] = dead_letters(db)
    assert letter[0] == "k" and letter[1].startswith("payload is not the JSON")
    assert (stats.applied, stats.malformed, stats.dead_lettered) == (1, 1, 1)


def test_a_connection_lost_right_after_each_connect_is_retried_with_backoff(db: str) -> None:
    """A broker that drops every connection at once (a frame the client cannot read, an
    overloaded proxy) was reconnected to in a hot loop: 2,929 connects in 20 s. Losses in a
    row back off as connect failures do."""
    from outboxer.receivers.memory import MemoryReceiver

    class DropsEachConnection(MemoryReceiver):
        connects = 0

        async def _connect(self) -> None:
            DropsEachConnection.connects += 1

        async def _receive(self, limit: int, timeout: float) -> list[Any]:
            raise ConnectionResetError("dropped right after the connect")

    async def main() -> int:
        receiver = DropsEachConnection(f"memory://{uuid.uuid4().hex}", group="g")
        consumer = Consumer(db=db, broker=receiver, group="g", handler=record)
        task = asyncio.create_task(consumer.run_async())
        await asyncio.sleep(1.5)
        consumer.stop()
        await asyncio.wait_for(task, 10)
        return consumer.stats.broker_errors

    losses = asyncio.run(main())
    # 0.2 s, 0.4 s, 0.8 s (±25 %) between the second and later attempts: a handful in 1.5 s.
    assert 2 <= DropsEachConnection.connects <= 8, DropsEachConnection.connects
    assert losses == DropsEachConnection.connects


def test_json_nested_too_deep_is_a_malformed_message_not_a_recursion_error() -> None:
    """json.loads raises RecursionError, no ValueError: out of a receiver's receive it read as
    a lost connection, and the same message came first again after every reconnect."""
    from outboxer.receivers.base import MalformedMessage, decode_payload

    with pytest.raises(MalformedMessage, match="nested too deep"):
        decode_payload(b"[" * 100_000 + b"]" * 100_000, "application/json")
    assert decode_payload(b"[[1]]", "application/json") == [[1]]
