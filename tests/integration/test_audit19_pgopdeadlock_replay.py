"""PostgreSQL, both layouts: a replay that the server chooses as a deadlock's victim is tried
again whole, and its copier still copies each original once.

A replay holds its originals FOR SHARE as its cursor reads them, in seq order, page after
page, inserting each page's copies. A transaction that locks those rows in another order (an
operator's session, a purge walking another index) deadlocks with it, and PostgreSQL fails
the one whose wait began first: the replay, here. The operator saw `outboxer:
DeadlockDetectedError: deadlock detected ...` (exit 1), or a 503 from the HTTP API, and
nothing was copied. Tried again, the transaction must not redo what it did outside the
database: the first try had put a claim-check object for the copy of the first page, and
counted the shredded subject's original it left out; a try that copied again would put a new
object (the first left to the sweep) and report that original twice.

The deadlock is made for real, as in test_audit18_deadlock_pg_retry (whose helper runs it):
an operator's transaction holds the last original, the replay (a page being one original)
copies the first two and waits for it, then the operator asks for the second.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import psycopg
import pytest

from outboxer import Outbox, admin
from outboxer.admin import HEADER_REPLAY_OF, MessageFilter, ReplayCopier
from outboxer.claimcheck import HEADER_CLAIM_CHECK, ClaimCheck
from outboxer.crypto import FileSubjectKeys, KeyRing, generate_key
from tests.integration.test_audit18_deadlock_mysql_replay import CountingStore
from tests.integration.test_audit18_deadlock_pg_retry import _deadlock

K1 = generate_key()
LOCK_ROW = "SELECT 1 FROM outboxer.outbox WHERE id = $1 FOR UPDATE"


@pytest.fixture(params=["pg_url", "pg_partitioned_url"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(request.param))


async def test_a_replay_chosen_as_a_deadlocks_victim_is_tried_again_copying_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outboxer.store")
    objects = CountingStore(tmp_path / "claims")
    ring = KeyRing({"k1": K1}, subjects=FileSubjectKeys(tmp_path / "subjects"))
    checked = Outbox(claim_check=ClaimCheck(objects, threshold=10))
    with psycopg.connect(url) as writer:
        shredded = Outbox(encryption=ring).enqueue(writer, "t", {"n": 0}, subject="alice")
        first = checked.enqueue(writer, "t", {"n": 1, "pad": "x" * 40})
        last = checked.enqueue(writer, "t", {"n": 2, "pad": "x" * 40})
        writer.execute("UPDATE outboxer.outbox SET status = 'PUBLISHED'")
    assert ring.shred("alice")
    assert objects.puts == 2
    monkeypatch.setattr(admin, "REPLAY_PAGE", 1)  # each copy is inserted before the next read

    result = await _deadlock(
        url,
        (LOCK_ROW, (last.id,)),
        # `first`, which the replay holds FOR SHARE, its copy inserted: a deadlock.
        (LOCK_ROW, (first.id,)),
        lambda store: admin.replay(
            store, MessageFilter(), everything=True, copier=ReplayCopier(ring, objects)
        ),
    )

    records = [r.getMessage() for r in caplog.records]
    assert "PostgreSQL: a replay chosen as a deadlock's victim; trying it again" in records
    assert (result.count, result.shredded) == (2, 1), "the shredded original counted once"
    assert objects.puts == 4, "each original copied, and its object put, once"
    with psycopg.connect(url) as check:
        copies = [
            row[0]
            for row in check.execute(
                "SELECT headers FROM outboxer.outbox WHERE status = 'PENDING' ORDER BY seq"
            )
        ]
    headers = [h if isinstance(h, dict) else json.loads(h) for h in copies]
    assert [h[HEADER_REPLAY_OF] for h in headers] == [str(first.id), str(last.id)]
    assert str(shredded.id) not in {h[HEADER_REPLAY_OF] for h in headers}
    stored = {o.name for o in objects.list_objects()}
    assert {h[HEADER_CLAIM_CHECK] for h in headers} <= stored
    assert len(stored) == 4, "no object left behind for a copy that was rolled back"
