"""POST /messages/purge, /messages/replay and /messages/requeue with a filter, over real
HTTP, against the real PostgreSQL, SQLite and MariaDB stores."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from outboxer import Outbox
from outboxer.crypto import KeyRing, generate_key
from outboxer.stores import Failure, Store, create_store
from tests.integration.test_http_api import TOKEN, connect_sync, enqueue, serving, statuses


@pytest.fixture(params=["sqlite", "postgres", "mysql"])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = {"sqlite": "sqlite_url", "postgres": "pg_url", "mysql": "mysql_url"}[request.param]
    return str(request.getfixturevalue(fixture))


async def settle_next(store: Store, *, published: bool, error: str = "rejected") -> None:
    """Claim the next due row and publish it, or abandon it with ``error``."""
    claim = await store.claim("default", "relay-test", 1, 60.0, False)
    seqs = [m.stored_seq for m in claim]
    failed = [] if published else [Failure(seq, error, 0.0, True) for seq in seqs]
    await store.settle("default", claim.lease, seqs if published else [], failed, [], 10)


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


async def test_purge_replay_and_requeue_by_filter(db_url: str) -> None:
    enqueue(db_url, 4)  # keys k0 to k3
    async with create_store(db_url) as store:
        await settle_next(store, published=False)  # k0
        await settle_next(store, published=False, error="HTTP 503: Timeout")  # k1
        await settle_next(store, published=True)  # k2
        async with serving(db_url) as client:
            dry = ok(await client.post("/messages/purge", json={"keys": ["k0"], "dry_run": True}))
            assert dry == {
                "dry_run": True,
                "would_purge": 1,
                "by_destination": {"default": {"ABANDONED": 1}},
                "held": 0,
            }
            assert await statuses(store) == {"ABANDONED": 2, "PUBLISHED": 1, "PENDING": 1}
            purged = ok(await client.post("/messages/purge", json={"keys": ["k0"]}))
            assert purged == {"purged": 1}

            dry = ok(await client.post("/messages/replay", json={"keys": ["k2"], "dry_run": True}))
            assert (dry["would_replay"], dry["to"]) == (1, None)
            replayed = ok(await client.post("/messages/replay", json={"keys": ["k2"]}))
            assert replayed == {"replayed": 1, "to": None, "shredded": 0}

            body = {"error": "Timeout", "statuses": ["abandoned"]}
            dry = ok(await client.post("/messages/requeue", json={**body, "dry_run": True}))
            assert dry["would_requeue"] == 1
            assert ok(await client.post("/messages/requeue", json=body)) == {"requeued": 1}
            status = ok(await client.get("/status"))
        assert await statuses(store) == {"PUBLISHED": 1, "PENDING": 3}
        assert status["destinations"][0]["counts"] == {"PUBLISHED": 1, "PENDING": 3}
        claimed = await store.claim("default", "relay-test", 10, 60.0, False)
    assert [m.key for m in claimed] == ["k1", "k3", "k2"], "the copy is the newest row"
    assert claimed[2].headers["replay-of"] != str(claimed[2].id)


async def test_bad_admin_requests_are_400s_that_change_nothing(sqlite_url: str) -> None:
    enqueue(sqlite_url, 2)
    async with create_store(sqlite_url) as store:
        await settle_next(store, published=True)
        async with serving(sqlite_url) as client:
            for path, body, fragment in (
                ("purge", {}, "purge needs a filter"),
                ("purge", {"dry_run": True}, "purge needs a filter"),
                ("purge", {"statuses": ["PROCESSING"]}, "PROCESSING messages cannot be purged"),
                ("purge", {"all": True, "keys": ["k0"]}, "give it without a filter"),
                ("purge", {"all": "yes"}, "all must be true or false"),
                ("purge", {"keys": ["k0"], "dry_run": 1}, "dry_run must be true or false"),
                ("purge", {"key": ["k0"]}, "unknown field(s) key"),
                ("replay", {}, "replay needs a filter"),
                ("replay", {"statuses": ["PUBLISHED"]}, "unknown field(s) statuses"),
                ("replay", {"keys": ["k0"], "to": "partner"}, "'partner' is not configured"),
                ("replay", {"keys": ["k0"], "to": 5}, "the destination to replay to"),
                ("requeue", {"older_than": "soon"}, "older_than must be a duration"),
                (
                    "requeue",
                    {"created_after": "2024-05-02", "created_before": "2024-05-01"},
                    "must be earlier than created_before",
                ),
                ("requeue", {"created_after": "May 1st"}, "created_after must be an ISO 8601"),
                ("requeue", {"ids": ["not-a-uuid"]}, "ids must be message ids"),
                ("requeue", {"error": ""}, "error must be a non-empty string"),
                ("purge", [], "must be a JSON object"),
            ):
                response = await client.post(f"/messages/{path}", json=body)
                assert response.status_code == 400, (path, body, response.text)
                assert response.json()["type"] == "BadRequest"
                assert fragment in response.json()["error"], (path, body, response.text)
        assert await statuses(store) == {"PUBLISHED": 1, "PENDING": 1}


async def test_purge_and_replay_need_the_token_and_the_api_s_own_origin(sqlite_url: str) -> None:
    enqueue(sqlite_url, 1)
    async with create_store(sqlite_url) as store:
        await settle_next(store, published=True)
        body = {"keys": ["k0"]}
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        async with serving(sqlite_url, token=TOKEN) as client:
            refused = [
                await client.post(f"/messages/{path}", json=body, headers=headers)
                for path in ("purge", "replay")
                for headers in (
                    {},
                    {"Authorization": "Bearer wrong"},
                    {**bearer, "Origin": "http://evil.example"},
                    {**bearer, "Content-Type": "text/plain"},
                )
            ]
            assert await statuses(store) == {"PUBLISHED": 1}, "nothing changed"
            replayed = await client.post("/messages/replay", json=body, headers=bearer)
            own_origin = client.server.url  # type: ignore[attr-defined]
            purged = await client.post(
                "/messages/purge", json={"all": True}, headers={**bearer, "Origin": own_origin}
            )
        assert await statuses(store) == {}
    assert [r.status_code for r in refused] == [401, 401, 403, 415] * 2
    assert replayed.json()["replayed"] == 1
    assert purged.json() == {"purged": 2}


async def test_a_replay_the_api_cannot_protect_is_a_409_and_writes_nothing(
    sqlite_url: str,
) -> None:
    conn = connect_sync(sqlite_url)
    try:
        Outbox(encryption=KeyRing({"k1": generate_key()})).enqueue(conn, "t", {"n": 1}, key="k")
        conn.commit()
    finally:
        conn.close()
    async with create_store(sqlite_url) as store:
        await settle_next(store, published=True)
        async with serving(sqlite_url) as client:
            response = await client.post("/messages/replay", json={"keys": ["k"]})
        assert await statuses(store) == {"PUBLISHED": 1}
    assert response.status_code == 409
    assert response.json()["type"] == "Conflict"
    assert "is encrypted" in response.json()["error"]
