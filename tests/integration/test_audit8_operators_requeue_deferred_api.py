"""The HTTP API's and the dashboard's requeue of a message whose key has a later message in
flight (abandoned_blocks_key off): the API says the message was deferred, and the button
says so instead of "no longer ABANDONED (changed since the page was loaded)"."""

from __future__ import annotations

import outboxer
from outboxer.stores.base import Failure
from tests.integration.test_http_api import serving
from tests.integration.test_http_audit_dashboard_buttons import press, shown_row
from tests.relaying import enqueue


async def test_requeue_of_a_message_whose_key_is_in_flight_is_answered_deferred(
    sqlite_url: str,
) -> None:
    enqueue(sqlite_url, ("t", "k"), ("t", "k"))
    async with outboxer.create_store(sqlite_url) as store, serving(sqlite_url) as client:
        first = await store.claim("default", "relay-a", 1, 60.0, False)
        [head] = list(first)
        await store.settle(
            "default", first.lease, [], [Failure(head.stored_seq, "refused", 0.0, True)], [], 5
        )
        second = await store.claim("default", "relay-b", 1, 60.0, False)
        assert len(list(second)) == 1
        row = await shown_row(client)

        dry = await client.post("/messages/requeue", json={"keys": ["k"], "dry_run": True})
        assert dry.json()["would_requeue"] == 0 and dry.json()["deferred"] == 1, dry.text
        shown = await press(str(client.base_url).rstrip("/"), "requeue", row)
        assert shown["status"] == "ABANDONED" and not shown["ok"], shown
        assert "in flight" in str(shown["result"]) and not shown["disabled"], shown
        answer = await client.post("/messages/requeue", json={"ids": [str(head.id)]})
        assert answer.json() == {"requeued": 0, "deferred": 1}, answer.text
