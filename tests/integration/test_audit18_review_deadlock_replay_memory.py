"""MariaDB: a replay keeps no more than a page of copies in memory while nothing fails.

A replay reads its originals a page at a time (admin.REPLAY_PAGE), so that its memory is a
page's, however much history it copies. The deadlock retry (7ba6309) kept every copy made,
payload and all, for the whole replay (``made``, so that a try after a deadlock could insert
the same copies again): a replay of a large history held all of its copies' payloads until
it committed, deadlock or not. Only what must not be done twice needs keeping across tries: a
copy whose claim-check object was put, and an original the copier left out (a shredded
subject's, counted once). A plain copy is made again on the next try, if there is one.

The copier here holds a reference to each payload it makes; from the copier's next call but
one, the store must hold none of an earlier page's (the page just written is still bound).
"""

from __future__ import annotations

import gc
import sys
import uuid
from collections.abc import Sequence

import pytest

from outboxer import Outbox, admin
from outboxer.admin import HEADER_REPLAY_OF, MessageFilter
from outboxer.message import Message
from outboxer.stores import create_store
from tests.conftest import mysql_connect

ORIGINALS = 8


class PlainCopier:
    """Copies each original with a payload of its own, and notes how many references to the
    payloads of pages before the last one anybody else still holds."""

    def __init__(self) -> None:
        self.pages: list[list[bytes]] = []
        self.held_behind: list[int] = []

    def __call__(self, originals: Sequence[Message]) -> list[Message]:
        gc.collect()
        held = 0
        for page in self.pages[:-1]:
            # Each page also holds a payload the store never saw: the references counted
            # the same way that are the copier's own.
            own = sys.getrefcount(page[0])
            held += sum(sys.getrefcount(page[n]) - own for n in range(1, len(page)))
        self.held_behind.append(held)
        copies = [
            Message(
                id=uuid.uuid4(),
                topic=original.topic,
                payload=b"copy %d " % (original.seq or 0) + bytes(4096),
                key=original.key,
                headers={HEADER_REPLAY_OF: str(original.id)},
                content_type=original.content_type,
                destination=original.destination,
            )
            for original in originals
        ]
        self.pages.append([b"control" + bytes(4096), *(copy.payload for copy in copies)])
        return copies


async def test_a_replay_keeps_no_earlier_pages_copies(
    mysql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = mysql_connect(mysql_url)
    try:
        outbox = Outbox()
        for n in range(ORIGINALS):
            outbox.enqueue(writer, "t", {"n": n})
        writer.cursor().execute("UPDATE outbox SET status = 'PUBLISHED'")
        writer.commit()
    finally:
        writer.close()
    monkeypatch.setattr(admin, "REPLAY_PAGE", 1)

    copier = PlainCopier()
    async with create_store(mysql_url) as store:
        count = await store.replay(admin.replay_filter(MessageFilter(), everything=True), copier)

    assert count == ORIGINALS
    assert len(copier.held_behind) == ORIGINALS
    assert copier.held_behind == [0] * ORIGINALS, (
        "the store still held the copies of pages it had written (references per call: "
        f"{copier.held_behind}): a replay's memory grew with its history, not its page"
    )
