"""A long-running stream relay keeps no per-key state for dead letters it will never hold.

Without ``abandoned_blocks_key`` (the default) a dead letter holds nothing back, yet the
relay added the key of every dead letter to its in-memory set of held keys, and nothing
ever took one out (only a check under ``abandoned_blocks_key`` prunes it). With a key per
order or per event (UUIDs) and a destination that refuses a topic for good, every message
of that topic became a dead letter and the set grew with each, for the life of the process.
Log mode against the shared PostgreSQL.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest

from outboxer import streamrelay
from outboxer.brokers.memory import MemoryPublisher
from outboxer.enqueue import Outbox
from outboxer.errors import PublishError
from outboxer.message import Message
from outboxer.stores.pglog import PgLog
from outboxer.streamrelay import replay_dead_letters
from outboxer.streamtesting import VISIBLE, running_stream_relay, wait_until
from tests.pgmodes.test_log_mode import LogHarness

MESSAGES = 200


async def test_dead_letters_without_abandoned_blocks_key_leave_no_held_keys(pg_url: str) -> None:
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    harness = LogHarness(pg_url, Outbox(mode="log"))
    with psycopg.connect(pg_url) as conn:
        for n in range(MESSAGES):
            harness.outbox.enqueue(conn, "orders", {"n": n}, key=str(uuid.uuid4()))

    def refuse(message: Message) -> BaseException | None:
        return PublishError("no such topic", retryable=False)

    async with running_stream_relay(harness, "default", fail=refuse, batch_size=100) as (
        _,
        relay,
    ):
        assert await wait_until(lambda: relay.stats.dead_lettered == MESSAGES, VISIBLE)
        assert relay.stats.held == 0
        # Nothing is held back without abandoned_blocks_key: nothing to remember per key.
        assert len(relay._held_keys) == 0


async def test_held_keys_replayed_elsewhere_are_forgotten(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``abandoned_blocks_key`` a key is forgotten only when a later message of it comes
    and the table has no dead letter of it any more: with a key per order, never. Replayed
    or purged by the CLI, every dead letter's key stayed in the relay's memory for good."""
    monkeypatch.setattr(streamrelay, "HELD_KEYS_RELOAD", 50, raising=False)
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    harness = LogHarness(pg_url, Outbox(mode="log"))
    with psycopg.connect(pg_url) as conn:
        for n in range(MESSAGES):
            harness.outbox.enqueue(conn, "orders", {"n": n}, key=str(uuid.uuid4()))
    refusing = {"on": True}

    def refuse(message: Message) -> BaseException | None:
        return PublishError("no such topic", retryable=False) if refusing["on"] else None

    async with running_stream_relay(  # one round: the relay has read no held key back yet
        harness, "default", fail=refuse, batch_size=MESSAGES, abandoned_blocks_key=True
    ) as (broker, relay):
        assert await wait_until(lambda: relay.stats.dead_lettered == MESSAGES, VISIBLE)
        refusing["on"] = False
        replayer = harness.source("default")
        await replayer.attach()  # beside the running relay, as the CLI does
        try:
            counts = await replay_dead_letters(
                replayer, MemoryPublisher(f"memory://{broker.name}"), abandoned_blocks_key=True
            )
        finally:
            await replayer.close()
        assert counts.replayed == MESSAGES
        with psycopg.connect(pg_url) as conn:  # one message of a new key, after the replay
            harness.outbox.enqueue(conn, "orders", {"n": MESSAGES}, key=str(uuid.uuid4()))
        assert await wait_until(lambda: len(broker.messages) == MESSAGES + 1, VISIBLE)
        assert len(relay._held_keys) <= 50
