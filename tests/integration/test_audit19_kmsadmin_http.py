"""POST /messages/replay with a key ring that fetches its keys (``KeyRing.from_callable``, a
KMS): a KMS that stops answering is a 503 ``ServiceUnavailable`` within
``claim_check_read_timeout``, naming the key and the bound, nothing written, the API still
serving; a KMS that fails (an exception: retryable) is a 503 too, where a row that cannot
be copied stays a 409.

Before, the copier called ``ring.key(...)`` unbounded inside the replay's transaction: the
request (its worker thread, SQLite's write lock) waited for the KMS for ever; and a KMS
error was answered 409 ``Conflict`` ("retrying would not help").

Rings built from the settings hold their keys and never fetch: the API is given the
fetching ring as an application embedding it would (``payload_admin.keyring`` replaced).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from outboxer import Outbox, payload_admin
from outboxer.config import load_settings
from outboxer.crypto import KeyRing
from outboxer.http import HttpApi, HttpServer
from outboxer.stores import create_store
from outboxer.stores.sqlite import sqlite_path
from tests.integration.test_http_api import statuses
from tests.unit.test_audit19_kmsadmin_sync_fetch import KEY, SilentKms, fetch_threads
from tests.waiting import wait_for

TIMEOUT = 0.5
SLACK = 3.0


@pytest.fixture
def kms(monkeypatch: pytest.MonkeyPatch) -> Iterator[SilentKms]:
    source = SilentKms()
    monkeypatch.setattr(payload_admin, "keyring", lambda settings: source.ring("k2"))
    yield source
    source.answer.set()
    wait_for(lambda: fetch_threads() == 0, 5, "key fetch threads did not end")


def published(sqlite_url: str) -> None:
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    try:
        outbox = Outbox(encryption=KeyRing({"k1": KEY}))
        outbox.enqueue(conn, "t", {"n": 1}, key="k")
        conn.execute("UPDATE outbox SET status = 'PUBLISHED'")
        conn.commit()
    finally:
        conn.close()


async def replay(sqlite_url: str, kms: SilentKms) -> tuple[httpx.Response, float, int]:
    """The replay's answer, how long it took, and /health's status afterwards."""
    settings = load_settings({"db": sqlite_url, "claim_check_read_timeout": TIMEOUT}, environ={})
    server = await HttpServer(HttpApi(create_store(sqlite_url), settings), "127.0.0.1", 0).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT + SLACK) as client:
            began = time.monotonic()
            response = await client.post("/messages/replay", json={"keys": ["k"]})
            took = time.monotonic() - began
            health = await client.get("/health")
    finally:
        kms.answer.set()  # the old code's request still waits: let the server close
        await server.close()
    return response, took, health.status_code


async def test_a_replay_whose_kms_does_not_answer_is_a_503_within_the_bound(
    sqlite_url: str, kms: SilentKms
) -> None:
    published(sqlite_url)
    kms.silent = {"k1"}

    response, took, health = await replay(sqlite_url, kms)

    assert response.status_code == 503, response.text
    body: dict[str, Any] = response.json()
    assert body["type"] == "ServiceUnavailable"
    assert "cannot be replayed: " in body["error"]
    assert f"key 'k1': the keyring's source did not answer within {TIMEOUT:g} s" in body["error"]
    assert KEY.hex() not in response.text
    assert TIMEOUT <= took < TIMEOUT + SLACK, took
    assert health == 200, "the API still serves"
    async with create_store(sqlite_url) as store:
        assert await statuses(store) == {"PUBLISHED": 1}, "nothing written"


async def test_a_replay_whose_kms_fails_is_a_503_not_a_409(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, kms: SilentKms
) -> None:
    published(sqlite_url)

    def refusing(key_id: str) -> bytes:
        raise ConnectionError("kms.internal: connection refused")

    monkeypatch.setattr(
        payload_admin, "keyring", lambda settings: KeyRing.from_callable(refusing, "k2")
    )

    response, _, _ = await replay(sqlite_url, kms)

    assert response.status_code == 503, response.text
    body: dict[str, Any] = response.json()
    assert body["type"] == "ServiceUnavailable"
    assert "fetching key 'k2' failed" in body["error"]
    async with create_store(sqlite_url) as store:
        assert await statuses(store) == {"PUBLISHED": 1}, "nothing written"
