"""MariaDB: a replay that InnoDB chooses as a deadlock's victim is tried again, and its copier
still copies each original once.

A replay holds its originals in share mode page after page, inserting each page's copies; a
transaction that locks those rows in another order (a purge scanning another index, an
operator's session) can deadlock with it, and InnoDB rolls back the lighter of the two, often
the replay: the operator's `replay` failed with "Deadlock found". The whole transaction was
rolled back, so trying it again is safe for the rows; but the copier had put a claim-check
object for each copy made, and a try that copied again would put new ones (the first try's
left to the sweep) and count a shredded original twice. The store now keeps a try's copies and
inserts the same ones on the next try: each original is copied, and its object put, once.

The deadlock is made for real, as in test_audit11_mysqldl_requeue_deadlock: a heavier
transaction (InnoDB rolls back the one that changed fewer rows) holds the second original,
the replay copies the first and waits for it, then the heavy one asks for the first.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from outboxer import Outbox, admin
from outboxer.admin import HEADER_REPLAY_OF, MessageFilter, ReplayCopier
from outboxer.claimcheck import HEADER_CLAIM_CHECK, ClaimCheck, FileObjectStore
from outboxer.stores import create_store
from tests.conftest import mysql_connect
from tests.integration.test_audit11_mysqldl_requeue_deadlock import _lock_waits


class CountingStore(FileObjectStore):
    """A file object store that counts its puts."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.puts = 0

    def put(self, name: str, data: bytes) -> None:
        self.puts += 1
        super().put(name, data)


async def test_a_replay_chosen_as_a_deadlocks_victim_is_tried_again_copying_once(
    mysql_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = CountingStore(tmp_path / "claims")
    writer = mysql_connect(mysql_url)
    try:
        outbox = Outbox(claim_check=ClaimCheck(objects, threshold=10))
        first = outbox.enqueue(writer, "t", {"n": 1, "pad": "x" * 40})
        second = outbox.enqueue(writer, "t", {"n": 2, "pad": "x" * 40})
        writer.cursor().execute("UPDATE outbox SET status = 'PUBLISHED'")
        writer.commit()
        with writer.cursor() as cursor:
            cursor.execute("SELECT id, seq FROM outbox")
            seqs = {row[0]: row[1] for row in cursor.fetchall()}
        writer.commit()
    finally:
        writer.close()
    assert objects.puts == 2
    monkeypatch.setattr(admin, "REPLAY_PAGE", 1)  # the first copy is inserted, then the next

    holder = mysql_connect(mysql_url)
    try:
        with holder.cursor() as cursor:
            # Heavier than the replay: InnoDB rolls back the transaction that changed fewer
            # rows, so the replay is the victim.
            cursor.execute("CREATE TABLE IF NOT EXISTS ballast (n INT)")
            holder.commit()
            cursor.execute("INSERT INTO ballast VALUES " + ",".join(["(1)"] * 2000))
            cursor.execute(
                "SELECT seq FROM outbox WHERE seq = %s FOR UPDATE", (seqs[str(second.id)],)
            )
        async with create_store(mysql_url) as store:
            replay = asyncio.create_task(
                admin.replay(
                    store,
                    MessageFilter(),
                    everything=True,
                    copier=ReplayCopier(object_store=objects),
                )
            )
            # The replay copied the first original and waits for the second.
            deadline = time.monotonic() + 10
            while not await asyncio.to_thread(_lock_waits, mysql_url):
                assert time.monotonic() < deadline, "the replay never waited for the row"
                assert not replay.done(), replay
                await asyncio.sleep(0.25)  # innodb_trx is refreshed at most every 0.1 s
            assert objects.puts == 3, "the first copy's object"
            with holder.cursor() as cursor:
                # The first original, which the replay holds in share mode: a deadlock.
                await asyncio.to_thread(
                    cursor.execute,
                    "SELECT seq FROM outbox WHERE seq = %s FOR UPDATE",
                    (seqs[str(first.id)],),
                )
            holder.rollback()
            result = await asyncio.wait_for(replay, 30)
    finally:
        holder.close()

    assert result.count == 2
    assert objects.puts == 4, "each original copied, and its object put, once"
    check = mysql_connect(mysql_url, autocommit=True)
    try:
        with check.cursor() as cursor:
            cursor.execute("SELECT headers FROM outbox WHERE status = 'PENDING' ORDER BY seq")
            copies = [row[0] for row in cursor.fetchall()]
    finally:
        check.close()
    headers = [json.loads(text) for text in copies]
    assert [h[HEADER_REPLAY_OF] for h in headers] == [str(first.id), str(second.id)]
    stored = {o.name for o in objects.list_objects()}
    assert {h[HEADER_CLAIM_CHECK] for h in headers} <= stored
    assert len(stored) == 4, "no object left behind for a copy that was rolled back"
