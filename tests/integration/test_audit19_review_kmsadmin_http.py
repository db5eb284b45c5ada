"""POST /messages/replay against a key ring's source (a KMS) that stops answering, request
after request: the API keeps one ring that fetches for its lifetime, so the cap of calls
left running per ring (crypto.MAX_ABANDONED_FETCHES) bounds the threads it leaves, and a
key fetched once is not fetched again per request.

Before, the copier's ring was built per request (``payload_admin.keyring(settings)``): the
cap, per ring, never applied, and each request against a silent KMS left one more thread
waiting on it for ever (eight requests, eight threads), each one also asking the KMS again
for the current key it had fetched the request before.

Rings built from the settings hold their keys and never fetch: the API is given the
fetching ring as an application embedding it would (``payload_admin.keyring`` replaced,
here by a factory returning a new ring per call, as the audit19 kmsadmin tests do).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from outboxer import payload_admin
from outboxer.config import load_settings
from outboxer.crypto import MAX_ABANDONED_FETCHES
from outboxer.http import HttpApi, HttpServer
from outboxer.stores import create_store
from tests.integration.test_audit19_kmsadmin_http import published
from tests.unit.test_audit19_kmsadmin_sync_fetch import SilentKms, fetch_threads
from tests.waiting import wait_for

TIMEOUT = 0.3
REQUESTS = MAX_ABANDONED_FETCHES + 3


@pytest.fixture
def kms(monkeypatch: pytest.MonkeyPatch) -> Iterator[SilentKms]:
    source = SilentKms(silent={"k1"})
    monkeypatch.setattr(payload_admin, "keyring", lambda settings: source.ring("k2"))
    yield source
    source.answer.set()
    wait_for(lambda: fetch_threads() == 0, 5, "key fetch threads did not end")


async def test_repeated_replays_against_a_silent_kms_leave_at_most_the_rings_cap_of_threads(
    sqlite_url: str, kms: SilentKms
) -> None:
    published(sqlite_url)
    settings = load_settings({"db": sqlite_url, "claim_check_read_timeout": TIMEOUT}, environ={})
    server = await HttpServer(HttpApi(create_store(sqlite_url), settings), "127.0.0.1", 0).start()
    codes: list[int] = []
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            for _ in range(REQUESTS):
                response = await client.post("/messages/replay", json={"keys": ["k"]})
                codes.append(response.status_code)
        left = fetch_threads()
    finally:
        kms.answer.set()
        await server.close()

    assert codes == [503] * REQUESTS, codes
    assert left <= MAX_ABANDONED_FETCHES, f"{left} KMS calls left running by {REQUESTS} requests"
    assert kms.calls.count("k2") == 1, f"the current key fetched per request: {kms.calls}"
