"""The store's ``requeue`` (the Django admin's "Requeue" action runs it) makes ABANDONED or
FAILED rows PENDING and nothing else, whatever statuses its caller passes, on the real
PostgreSQL, MariaDB and SQLite: a PROCESSING row a relay holds must stay held (made
PENDING, a second relay would publish it while the first still is), and a PUBLISHED row
must not be sent again."""

from __future__ import annotations

import outboxer
from tests.relaying import db, enqueue, rows  # noqa: F401 -- db is a fixture


async def test_requeue_changes_only_abandoned_or_failed_rows_whatever_it_is_asked(
    db: str,  # noqa: F811 -- the fixture
) -> None:
    enqueue(db, ("t", "k"), ("t", "k2"))
    async with outboxer.create_store(db) as store:
        held = await store.claim("default", "relay-a", 1, 60.0, False)
        [in_flight] = list(held)
        done = await store.claim("default", "relay-a", 1, 60.0, False)
        await store.settle("default", done.lease, [m.stored_seq for m in done], [], [], 5)

        asked = ["PENDING", "PROCESSING", "PUBLISHED", "FAILED", "ABANDONED"]
        assert await store.requeue(["default"], asked, None) == 0

        statuses = {str(row["id"]): row["status"] for row in await rows(db)}
        assert statuses[str(in_flight.id)] == "PROCESSING", "the relay still holds it"
        assert sorted(statuses.values()) == ["PROCESSING", "PUBLISHED"]
        # The holder's settle still lands: its lease was left alone.
        settled = await store.settle("default", held.lease, [in_flight.stored_seq], [], [], 5)
        assert settled.published == 1
