"""The store contract of operators' changes: purge, replay and requeue by filter.

:class:`StoreAdminContract` is :class:`~outboxer.testing.StoreContract` plus these tests;
a store's test class subclasses it (with the same ``url`` fixture, ``connect_sync`` and
``shift_sql``) to run both against its real database.

This module imports pytest, so import it only from tests.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outboxer import admin
from outboxer.admin import HEADER_REPLAY_OF, MessageFilter, ReplayCopier
from outboxer.errors import AdminRequestError, ReplayError
from outboxer.message import Message
from outboxer.stores.base import Failure
from outboxer.testing import StoreContract


class StoreAdminContract(StoreContract):
    """Purge, replay and requeue by filter, and their dry runs' counts, on a real database."""

    # ----- helpers ------------------------------------------------------------------------

    def enqueue_to(
        self, url: str, destination: str, *items: tuple[str, str | None]
    ) -> list[Message]:
        """Commit one message per (topic, key) for ``destination``, in one transaction."""
        from outboxer.enqueue import Outbox

        outbox = Outbox(destinations=(destination,))
        conn = self.connect_sync(url)
        try:
            sent = [
                outbox.enqueue(conn, topic, {"n": n, "to": destination}, key=key)
                for n, (topic, key) in enumerate(items)
            ]
            conn.commit()
        finally:
            conn.close()
        return sent

    async def publish(self, store: Any, destination: str = "default") -> list[Message]:
        """Claim every due row of ``destination`` and settle them PUBLISHED."""
        claim = await store.claim(destination, "relay-a", 1000, 60.0, False)
        await store.settle(destination, claim.lease, [m.stored_seq for m in claim], [], [], 5)
        return list(claim)

    async def abandon(self, store: Any, *errors: str) -> list[Message]:
        """Claim one due row per error (default destination) and abandon it with that error."""
        claim = await store.claim("default", "relay-a", len(errors), 60.0, False)
        failures = [Failure(m.stored_seq, e, 0.0, True) for m, e in zip(claim, errors, strict=True)]
        await store.settle("default", claim.lease, [], failures, [], 5)
        return list(claim)

    def statuses_by_id(self, url: str) -> dict[str, str]:
        return {str(row["id"]): row["status"] for row in self.rows(url)}

    # ----- the filter ---------------------------------------------------------------------

    async def test_admin_filter_matches_by_every_criterion(self, url: str, store: Any) -> None:
        """Each criterion alone, then together (AND), counted as a dry run counts."""
        old = self.enqueue(url, ("order.placed", "k1"), ("order.paid", "k2"))
        self.execute(url, self.shift_sql("created_at", 3600))
        boundary = datetime.now(UTC) - timedelta(minutes=30)
        new = self.enqueue(
            url, ("order.placed", "k1"), ("order.placed", None), ("order.paid", "k3")
        )
        partner = self.enqueue_to(url, "partner", ("order.placed", "k1"))
        abandoned = await self.abandon(
            store, "HTTP 503: Timeout", "50% off_peak quota", "a timeout"
        )
        assert [m.id for m in abandoned] == [old[0].id, old[1].id, new[0].id]

        async def count(**criteria: Any) -> int:
            counts = await store.count_matching(MessageFilter(**criteria))
            return sum(n for by_status in counts.values() for n in by_status.values())

        assert await count() == 6
        assert await count(ids=(new[1].id, partner[0].id, uuid.uuid4())) == 2
        assert await count(topics=("order.paid",)) == 2
        assert await count(keys=("k1",)) == 3
        assert await count(keys=("k1", "k3")) == 4
        assert await count(destinations=("partner",)) == 1
        assert await count(statuses=("ABANDONED",)) == 3
        assert await count(statuses=("PENDING", "PUBLISHED")) == 3
        assert await count(older_than=1800.0) == 2
        assert await count(older_than=7200.0) == 0
        assert await count(created_before=boundary) == 2
        assert await count(created_after=boundary) == 4
        assert await count(error="Timeout") == 1, "case-sensitive"
        assert await count(error="50% off_") == 1, "% and _ are text, not wildcards"
        assert await count(error="0% of") == 1
        assert await count(error="timeout") == 1
        assert await count(keys=("k1",), statuses=("PENDING",), destinations=("default",)) == 0
        assert await count(keys=("k1",), statuses=("PENDING",)) == 1
        assert await count(topics=("order.placed",), created_after=boundary) == 3
        by_destination = await store.count_matching(MessageFilter(keys=("k1",)))
        assert by_destination == {"default": {"ABANDONED": 2}, "partner": {"PENDING": 1}}

    # ----- purge --------------------------------------------------------------------------

    async def test_purge_deletes_what_matches_and_never_a_processing_row(
        self, url: str, store: Any
    ) -> None:
        self.enqueue(url, ("t", "a"), ("t", "b"))
        await self.publish(store)
        self.enqueue(url, ("t", "c"))
        await self.abandon(store, "no")
        in_flight = self.enqueue(url, ("t", "d"))
        claim = await self.claim(store)
        assert [m.id for m in claim] == [in_flight[0].id]
        waiting = self.enqueue(url, ("other", "e"))
        every_status = tuple(admin.ALL_STATUSES)
        # The store's own invariant, whatever the filter asks for: PROCESSING stays.
        assert await store.purge(MessageFilter(statuses=every_status, topics=("t",))) == 3
        assert self.statuses_by_id(url) == {
            str(in_flight[0].id): "PROCESSING",
            str(waiting[0].id): "PENDING",
        }
        result = await self.settle(store, claim, [claim[0].stored_seq])
        assert result.published == 1, "the relay settles its row as if nothing happened"
        assert await store.purge(MessageFilter(ids=(in_flight[0].id,))) == 1
        assert await store.purge(MessageFilter(destinations=("partner",))) == 0
        assert list(self.statuses_by_id(url)) == [str(waiting[0].id)]

    async def test_purge_through_admin_counts_first_and_refuses_what_it_must(
        self, url: str, store: Any
    ) -> None:
        self.enqueue(url, ("t", "a"), ("t", "b"), ("t", "c"))
        await self.abandon(store, "gone")
        await self.claim(store, limit=1)
        dry = await admin.purge(store, MessageFilter(topics=("t",)), dry_run=True)
        assert (dry.count, dry.held) == (2, 1), "ABANDONED and PENDING; the PROCESSING one held"
        assert dry.by_destination == {"default": {"ABANDONED": 1, "PENDING": 1}}
        assert len(self.rows(url)) == 3, "a dry run changes nothing"
        with pytest.raises(AdminRequestError, match="needs a filter"):
            await admin.purge(store, MessageFilter())
        with pytest.raises(AdminRequestError, match="PROCESSING messages cannot be purged"):
            await admin.purge(store, MessageFilter(statuses=("PROCESSING", "ABANDONED")))
        assert len(self.rows(url)) == 3
        done = await admin.purge(store, MessageFilter(topics=("t",)))
        assert done.count == 2 and [r["status"] for r in self.rows(url)] == ["PROCESSING"]

    # ----- requeue ------------------------------------------------------------------------

    async def test_requeue_matching_by_topic_and_error_text(self, url: str, store: Any) -> None:
        sent = self.enqueue(url, ("a", "k1"), ("a", "k2"), ("b", "k3"), ("a", "k4"))
        await self.abandon(store, "broker timeout", "rejected", "broker timeout")
        claim = await self.claim(store)
        await self.settle(store, claim, failed=[Failure(claim[0].stored_seq, "timeout", 60, False)])
        result = await admin.requeue(
            store, MessageFilter(topics=("a",), error="timeout"), destinations=["default"]
        )
        assert result.count == 1, "ABANDONED only by default: not the FAILED row"
        assert self.statuses_by_id(url) == {
            str(sent[0].id): "PENDING",
            str(sent[1].id): "ABANDONED",
            str(sent[2].id): "ABANDONED",
            str(sent[3].id): "FAILED",
        }
        dry = await admin.requeue(
            store,
            MessageFilter(error="timeout", statuses=("ABANDONED", "FAILED")),
            destinations=["default"],
            dry_run=True,
        )
        assert dry.by_destination == {"default": {"ABANDONED": 1, "FAILED": 1}}
        assert await store.requeue_matching(MessageFilter(statuses=("PUBLISHED", "PENDING"))) == 0
        assert await store.requeue_matching(MessageFilter(error="timeout")) == 2
        rows = {str(row["id"]): row for row in self.rows(url)}
        assert rows[str(sent[3].id)]["attempts"] == 0, "attempts reset"
        assert [m.id for m in await self.claim(store, "relay-b")] == [
            sent[0].id,
            sent[2].id,
            sent[3].id,
        ], "due now, in order"

    # ----- replay -------------------------------------------------------------------------

    async def test_replay_copies_published_rows_in_order_as_new_pending_rows(
        self, url: str, store: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(admin, "REPLAY_PAGE", 2)  # several pages in one transaction
        originals = self.enqueue(
            url, ("t", "k1"), ("t", "k2"), ("t", "k1"), ("t", None), ("t", "k1"), ("u", "k1")
        )
        await self.publish(store)
        unpublished = self.enqueue(url, ("t", "k1"))
        dry = await admin.replay(store, MessageFilter(topics=("t",)), to="partner", dry_run=True)
        assert (dry.count, dry.by_destination) == (5, {"default": {"PUBLISHED": 5}})
        result = await admin.replay(store, MessageFilter(topics=("t",)), to="partner")
        assert result.count == 5
        copies = await store.claim("partner", "relay-b", 100, 60.0, False)
        expected = [m for m in originals if m.topic == "t"]
        assert [c.headers[HEADER_REPLAY_OF] for c in copies] == [str(m.id) for m in expected]
        for copy, original in zip(copies, expected, strict=True):
            assert copy.id != original.id and copy.destination == "partner"
            assert (copy.topic, copy.key, copy.payload, copy.content_type) == (
                original.topic,
                original.key,
                original.payload,
                original.content_type,
            )
            assert copy.attempts == 0
        assert [c.stored_seq for c in copies] == sorted(c.stored_seq for c in copies)
        rows = self.statuses_by_id(url)
        assert [rows[str(m.id)] for m in originals] == ["PUBLISHED"] * 6, "originals untouched"
        assert rows[str(unpublished[0].id)] == "PENDING"
        again = await admin.replay(store, MessageFilter(ids=(originals[5].id,)))
        assert again.count == 1 and again.to is None
        waiting, own = await self.claim(store, "relay-c")
        assert waiting.id == unpublished[0].id
        assert own.destination == "default", "to its original's destination"
        assert own.headers[HEADER_REPLAY_OF] == str(originals[5].id)

    async def test_replay_takes_its_keys_lock_after_a_writer_of_them(
        self, url: str, store: Any
    ) -> None:
        """A replay copying key k waits for an open transaction that writes k, so its copies
        come after that row: for each key, seq order stays commit order."""
        [original] = self.enqueue(url, ("t", "k"))
        await self.publish(store)
        writer = self.connect_sync(url)
        try:
            from outboxer.enqueue import enqueue

            written = enqueue(writer, "t", {"late": True}, key="k")
            replaying = asyncio.create_task(admin.replay(store, MessageFilter(keys=("k",))))
            await asyncio.sleep(0.5)
            assert not replaying.done(), "the replay waits for the writer of k"
            writer.commit()
        finally:
            writer.close()
        assert (await asyncio.wait_for(replaying, 30)).count == 1
        claimed = await self.claim(store)
        assert [m.id for m in claimed[:1]] == [written.id], "the writer's row first"
        assert claimed[1].headers[HEADER_REPLAY_OF] == str(original.id)

    async def test_a_replay_whose_copy_fails_writes_nothing(
        self, url: str, store: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(admin, "REPLAY_PAGE", 1)  # the first copy is inserted, then
        sent = self.enqueue(url, ("t", "a"), ("t", "b"))
        await self.publish(store)

        class Refusing(ReplayCopier):
            def copy(self, original: Message) -> Message:
                if original.id == sent[1].id:
                    raise ReplayError("no")
                return super().copy(original)

        with pytest.raises(ReplayError):
            await admin.replay(store, MessageFilter(topics=("t",)), copier=Refusing())
        assert len(self.rows(url)) == 2, "the first copy rolled back with the transaction"
        assert (await admin.replay(store, MessageFilter(ids=(sent[0].id,)))).count == 1
        assert len(self.rows(url)) == 3, "and the store goes on"

    async def test_replay_refuses_a_destination_no_relay_serves(self, url: str, store: Any) -> None:
        self.enqueue(url, ("t", "a"))
        await self.publish(store)
        with pytest.raises(AdminRequestError, match="'partner' is not configured"):
            await admin.replay(
                store, MessageFilter(topics=("t",)), to="partner", known_destinations=["default"]
            )
        with pytest.raises(AdminRequestError, match="replay needs a filter"):
            await admin.replay(store, MessageFilter())
        assert (await admin.replay(store, MessageFilter(), everything=True)).count == 1
