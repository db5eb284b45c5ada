"""The webhook receiver's fetch of a claim-checked payload is bounded by its
``object_store_timeout`` (as ``outboxer consume``'s, setting claim_check_read_timeout): the
receiver had no such setting, so a hung store held a request, and its session, for the
consumer's default 30 s. A timed-out fetch is a 503 the relay retries; nothing applied."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from outboxer.brokers.webhook import WebhookPublisher
from outboxer.claimcheck import ClaimCheck, FileObjectStore
from outboxer.consumer import Delivery
from outboxer.receivers.webhook import WebhookReceiver
from outboxer.testing import make_message


class HangingStore(FileObjectStore):
    """Its reads block until ``release`` is set (a dead NFS server's never answer)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.release = threading.Event()

    def get(self, name: str) -> bytes:
        self.release.wait(30)
        return super().get(name)

    def get_at_most(self, name: str, max_size: int) -> bytes:
        self.release.wait(30)
        return super().get_at_most(name, max_size)


async def test_a_hung_claim_check_read_is_a_503_after_object_store_timeout(
    sqlite_url: str, tmp_path: Path
) -> None:
    store = HangingStore(tmp_path / "objects")
    message = ClaimCheck(store, threshold=10).offload(
        make_message("t", {"n": 1, "x": "y" * 50}, key="k1")
    )
    headers = {
        name.lower(): value
        for name, value in WebhookPublisher("http://127.0.0.1:9/").request_headers(message).items()
    }
    seen: list[Any] = []

    def handler(delivery: Delivery, conn: Any) -> None:
        seen.append(delivery.payload)

    receiver = WebhookReceiver(
        db=sqlite_url,
        group="hooks",
        handler=handler,
        secret=None,
        object_store=store,
        object_store_timeout=0.3,
    )
    assert receiver.consumer.object_store_timeout == 0.3
    try:
        began = time.monotonic()
        status, body, extra = await receiver.handle(headers, message.payload)
        took = time.monotonic() - began
        assert status == 503 and "retry-after" in extra, body
        assert took < 5, took
        assert seen == []
        store.release.set()
        status, body, _ = await receiver.handle(headers, message.payload)
        assert (status, body) == (200, {"result": "applied"})
        assert seen == [{"n": 1, "x": "y" * 50}]
    finally:
        store.release.set()
        await receiver.close()
