"""The relay's key fetch from a KMS (a callable key ring) is bounded.

``PayloadHandling.prepare`` ran ``asyncio.to_thread(keyring.key, key_id)`` with no bound: a
KMS that never answers held the relay's publish step for ever (no attempt recorded, no
other message published), and the default executor's thread kept ``asyncio.run`` (and the
relay process) from exiting. Now a fetch unanswered after ``key_fetch_timeout`` fails its
message retryably (an attempt and the error on the row), the next attempt fetches again,
and the abandoned fetch runs on in a daemon thread that nothing waits for.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.crypto import KeyRing, is_encrypted
from outboxer.payload_relay import PayloadHandling
from outboxer.stores.sqlite import sqlite_path

#: The bound here.
BOUND = 0.3
KEY = os.urandom(32)


def rows(sqlite_url: str) -> list[tuple[str, int, str | None]]:
    with sqlite3.connect(sqlite_path(sqlite_url)) as conn:
        found = conn.execute("SELECT status, attempts, last_error FROM outbox ORDER BY seq")
        return list(found.fetchall())


def enqueue_encrypted(sqlite_url: str, n: int) -> None:
    outbox = outboxer.Outbox(encryption=KeyRing({"k1": KEY}))
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    with conn:
        for i in range(n):
            outbox.enqueue(conn, "t", {"n": i}, key=f"key-{i}")
    conn.close()


async def test_a_kms_that_never_answers_fails_the_message_retryably_and_a_later_fetch_publishes(
    sqlite_url: str,
) -> None:
    hang = threading.Event()  # the first fetch waits for it; set only at the end
    calls: list[float] = []

    def kms(key_id: str) -> bytes | None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            hang.wait()
        return KEY if key_id == "k1" else None

    broker = memory_broker(f"audit18-kms-{uuid.uuid4().hex[:8]}")
    settings = load_settings(
        {
            "db": sqlite_url,
            "broker": f"memory://{broker.name}",
            "poll_interval": 0.05,
            # The retry due 1.5-2 s after the failure: the first drain must return (at
            # idle) before it. With 0.05 s, a loaded box's drain was still running when the
            # retry came due, and published all three within the first drain.
            "backoff_base": 2.0,
            "backoff_max": 2.0,
        },
        environ={},
    )
    ring = KeyRing.from_callable(kms, "k1")
    # Three messages of three keys, one key id: the unanswered fetch fails them all in
    # one bound, not one bound each.
    enqueue_encrypted(sqlite_url, 3)

    def relay() -> Relay:
        made = Relay.from_settings(settings)
        made.payloads["default"] = PayloadHandling(
            "default", "decrypt", ring, key_fetch_timeout=BOUND
        )
        return made

    try:
        started = time.monotonic()
        await asyncio.wait_for(relay().drain(), 5)
        took = time.monotonic() - started
        assert took < BOUND + 1.0, f"the first attempt took {took:.2f}s"
        failed = rows(sqlite_url)
        assert [(status, attempts) for status, attempts, _ in failed] == [("FAILED", 1)] * 3
        assert all(f"did not answer within {BOUND:g} s" in (error or "") for *_, error in failed)
        assert len(calls) == 1, "the batch's other messages waited out the bound again"
        assert broker.messages == []

        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:  # each drain returns at idle; the retry is due
            await asyncio.sleep(0.05)  # after its backoff
            await asyncio.wait_for(relay().drain(), 5)
            if [status for status, _, _ in rows(sqlite_url)] == ["PUBLISHED"] * 3:
                break
        assert [(status, attempts) for status, attempts, _ in rows(sqlite_url)] == [
            ("PUBLISHED", 1)
        ] * 3
        assert len(calls) == 2 and not hang.is_set(), "published while the first fetch hangs"
        assert sorted(m.payload for m in broker.messages) == [
            b'{"n":0}',
            b'{"n":1}',
            b'{"n":2}',
        ]
        assert not any(is_encrypted(m) for m in broker.messages)
    finally:
        hang.set()


def test_the_process_exits_while_a_fetch_still_hangs(sqlite_url: str, tmp_path: Path) -> None:
    """The relay, run by asyncio.run in a process of its own, records the failed attempt and
    returns; the process exits although the KMS call never returns."""
    enqueue_encrypted(sqlite_url, 1)
    script = tmp_path / "relay_once.py"
    script.write_text(
        textwrap.dedent(f"""
        import asyncio, sys, threading, time
        from outboxer import Relay, load_settings
        from outboxer.crypto import KeyRing
        from outboxer.payload_relay import PayloadHandling

        def kms(key_id):
            threading.Event().wait()  # a KMS that never answers

        async def main():
            relay = Relay.from_settings(load_settings(
                {{"db": {sqlite_url!r}, "broker": "memory://audit18-kms-exit"}}, environ={{}}))
            relay.payloads["default"] = PayloadHandling(
                "default", "decrypt", KeyRing.from_callable(kms, "k1"), key_fetch_timeout={BOUND})
            await relay.drain()

        asyncio.run(main())
        print("asyncio.run returned", flush=True)
        """)
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=8, check=False
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "asyncio.run returned" in done.stdout
    assert took < 6, f"the process took {took:.2f}s to exit"
    [(status, attempts, error)] = rows(sqlite_url)
    assert (status, attempts) == ("FAILED", 1)  # retried after its backoff
    assert f"did not answer within {BOUND:g} s" in (error or "")
