"""A replay of claim-checked rows against an object store that stops answering (an S3
endpoint that accepts connections and never answers) ends with ReplayError within
``claim_check_read_timeout``, writing nothing; before, it waited on the store inside its
transaction, its locks held (and, on SQLite, the database's write lock) for ever."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from outboxer import Outbox, Relay, admin, load_settings
from outboxer.admin import MessageFilter
from outboxer.claimcheck import ClaimCheck, FileObjectStore
from outboxer.errors import ReplayError
from outboxer.stores import create_store
from tests.integration.test_admin_replay_payload import connect_sync
from tests.s3 import CREDENTIALS, silent_listener


@pytest.fixture(params=["sqlite_url", "pg_url"])
def db_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    return url


async def test_a_replay_whose_store_hangs_fails_within_the_read_timeout(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outbox = Outbox(claim_check=ClaimCheck(FileObjectStore(tmp_path / "claims"), threshold=100))
    conn = connect_sync(db_url)
    try:
        for n in range(3):
            outbox.enqueue(conn, "t", {"blob": "x" * 400, "n": n}, key="k")
        conn.commit()
    finally:
        conn.close()
    published = load_settings(
        {"db": db_url, "broker": f"memory://replay-{uuid.uuid4().hex[:8]}", "exit_when_idle": True}
    )
    await Relay.from_settings(published).run()
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(f"AWS_{name.upper()}", value)
    with silent_listener() as endpoint:
        settings = load_settings(
            {
                "db": db_url,
                "claim_check_store": f"s3://bucket/claims?endpoint_url=http://{endpoint}"
                "&region=us-east-1",
                "claim_check_read_timeout": 0.5,
            }
        )
        copier = admin.copier_from_settings(settings)
        began = time.monotonic()
        try:
            async with create_store(db_url) as store:
                with pytest.raises(ReplayError, match=r"did not answer within 0\.5 s"):
                    await asyncio.wait_for(
                        admin.replay(store, MessageFilter(), everything=True, copier=copier), 8
                    )
                took = time.monotonic() - began
                counts = await store.count_matching(MessageFilter())
        finally:
            copier.close()
    assert took < 3, took
    assert counts == {"default": {"PUBLISHED": 3}}, "no copy written"
