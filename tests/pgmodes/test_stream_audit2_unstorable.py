"""WAL outbox messages whose envelope holds text no dead-letter row can store: a NUL
(valid JSON ``\\u0000``, refused by PostgreSQL's text and jsonb) or a lone surrogate
(``\\ud800``, not encodable as UTF-8)."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import PublishError
from outboxer.message import Message
from outboxer.retry import Backoff
from outboxer.stores.pgwal import PgWal
from outboxer.streamtesting import numbers, running_stream_relay, stream_book, wait_until
from tests.pgmodes.test_wal_mode import WalHarness

VISIBLE = 15.0
FAST = Backoff(0.01, 2.0, 0.05, 0.0)


@pytest.fixture
async def harness(logical_url: str) -> WalHarness:
    prefix = logical_url.rsplit("/", 1)[1]
    result = WalHarness(logical_url, Outbox(mode="wal", destinations=("default",)), prefix)
    async with result.wal() as wal:
        assert isinstance(wal, PgWal)
        assert await wal.create_slot("default")
    return result


def _emit(url: str, head: str, payload: bytes = b'{"n": 0}') -> bytes:
    """A transactional message with the outbox's prefix, its envelope written by hand."""
    content = head.encode() + b"\n" + payload
    with psycopg.connect(url) as conn:
        conn.execute(
            "SELECT pg_logical_emit_message(true, 'outboxer:outboxer.outbox', %s)", (content,)
        )
    return content


def _enqueue(harness: WalHarness, n: int) -> None:
    with psycopg.connect(harness.url) as conn:
        harness.outbox.enqueue(conn, "orders", {"n": n}, key="k")


def _envelope(**fields: object) -> str:
    envelope = {
        "id": str(uuid.uuid4()),
        "topic": "orders",
        "key": "k",
        "content_type": "application/json",
        "headers": {},
        "destinations": ["default"],
        **fields,
    }
    # Escapes (\\u0000, \\ud800) as another writer would send them: valid JSON text.
    return json.dumps(envelope).replace("NUL", "\\u0000").replace("SURROGATE", "\\ud800")


async def test_unstorable_text_in_a_wal_envelope_is_a_dead_letter_not_a_crash(
    harness: WalHarness,
) -> None:
    """The dead letter of such a message could not be written: the driver's error (not an
    outage) stopped the relay, and at every restart it met the same message again (its
    failure row says it is dead), so the slot kept the WAL for ever. Unreadable envelopes
    already became dead letters; these were read as messages, or kept a surrogate in the
    dead letter's topic. Each is a dead letter, untried, its raw content kept."""
    _enqueue(harness, 1)
    unreadable = _emit(harness.url, _envelope(topic="badSURROGATE", key="kNUL", destinations=None))
    bad_key = _emit(harness.url, _envelope(key="kNUL"))
    bad_header = _emit(harness.url, _envelope(headers={"h": "vSURROGATE"}))
    bad_topic = _emit(harness.url, _envelope(topic="oNULrders"))
    _enqueue(harness, 2)

    def fail(message: Message) -> BaseException | None:
        # A broker that refuses them for good (as a real one would refuse a NUL or a
        # surrogate): their dead letters must then be written.
        text = f"{message.topic}{message.key}{dict(message.headers)}"
        if "\x00" in text or "\ud800" in text:
            return PublishError("unencodable", retryable=False)
        return None

    async with running_stream_relay(
        harness, "default", fail=fail, max_attempts=3, backoff=FAST
    ) as (
        broker,
        relay,
    ):
        assert await wait_until(lambda: numbers(broker.messages) == [1, 2], VISIBLE)
    assert relay.stats.dead_lettered == 4
    letters, failures = await stream_book(harness, "default")
    assert failures == {}
    assert [letter.message.payload for letter in letters] == [
        unreadable,
        bad_key,
        bad_header,
        bad_topic,
    ]
    for letter in letters:
        stored = f"{letter.message.topic}{letter.message.key}{dict(letter.message.headers)}"
        assert "\x00" not in stored and "\ud800" not in stored
