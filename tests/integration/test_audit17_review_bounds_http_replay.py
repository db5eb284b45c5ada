"""POST /messages/replay against a claim-check store that never answers (an S3 endpoint that
accepts connections and never answers): 503 ``ServiceUnavailable`` within
``claim_check_read_timeout``, as for a database that does not answer, the store named
with its secrets masked, nothing written, and the API still serving. Before: 409
``Conflict``, the answer for a row that cannot be copied (retrying would not help), where a
store that does not answer is the server's trouble and passes."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx

from outboxer import Outbox
from outboxer.claimcheck import ClaimCheck, FileObjectStore
from outboxer.config import load_settings
from outboxer.http import HttpApi, HttpServer
from outboxer.stores import create_store
from outboxer.stores.sqlite import sqlite_path
from tests.integration.test_http_api import statuses
from tests.s3 import CREDENTIALS, REGION, silent_listener


async def test_a_replay_whose_store_does_not_answer_is_a_503_naming_the_store_without_secrets(
    sqlite_url: str, tmp_path: Path
) -> None:
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    try:
        outbox = Outbox(claim_check=ClaimCheck(FileObjectStore(tmp_path / "claims"), threshold=10))
        outbox.enqueue(conn, "t", {"blob": "x" * 100}, key="k")
        conn.execute("UPDATE outbox SET status = 'PUBLISHED'")
        conn.commit()
    finally:
        conn.close()
    secret = CREDENTIALS["secret_access_key"]
    with silent_listener() as endpoint:
        hung = (
            f"s3://bucket/claims?endpoint_url=http://{endpoint}&region={REGION}"
            f"&access_key_id={CREDENTIALS['access_key_id']}&secret_access_key={secret}"
        )
        settings = load_settings(
            {"db": sqlite_url, "claim_check_store": hung, "claim_check_read_timeout": 0.5},
            environ={},
        )
        api = HttpApi(create_store(sqlite_url), settings)
        server = await HttpServer(api, "127.0.0.1", 0).start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
                began = time.monotonic()
                response = await client.post("/messages/replay", json={"keys": ["k"]})
                took = time.monotonic() - began
                health = await client.get("/health")
        finally:
            await server.close()
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["type"] == "ServiceUnavailable"
    assert "did not answer within 0.5 s" in body["error"]
    assert f"S3ObjectStore('s3://bucket/claims/' at http://{endpoint})" in body["error"]
    assert secret not in response.text
    assert took < 5, took
    assert health.status_code == 200, "the API still serves"
    async with create_store(sqlite_url) as store:
        assert await statuses(store) == {"PUBLISHED": 1}, "nothing written"
