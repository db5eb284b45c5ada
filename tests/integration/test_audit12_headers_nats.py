"""User headers and keys over NATS JetStream, as enqueue accepted them: nats-py strips a
header value and turns its CR/LF into spaces, refuses a name that is not a token, and
JetStream obeys ``Nats-*`` headers; each must arrive byte-identical and change nothing."""

from __future__ import annotations

import uuid

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.headers import accepted_messages, assert_delivered_unchanged
from tests.services import require

NATS = "nats://127.0.0.1:4222"

CASES: list[tuple[dict[str, str], str | None]] = [
    ({"note": "a\r\nNats-Rollup: all"}, None),
    ({"padded": "  both ends  "}, None),
    ({"tabbed": "\tx\t"}, None),
    ({"sep": "zürich ✓ \u2028"}, None),
    ({"percent": "100%25 done"}, None),
    ({"with space": "v", "naïve": "n", "a:b": "c"}, None),
    ({"Nats-Expected-Last-Sequence": "999"}, None),
    ({"Nats-Msg-Id": "spoofed"}, None),
    ({"Nats-TTL": "1s"}, None),
    ({}, "  key with spaces "),
    ({}, "line\r\nbreak"),
]


async def test_hostile_headers_and_keys_arrive_as_enqueued() -> None:
    require("nats")
    import nats

    tag = uuid.uuid4().hex[:8]
    url = f"{NATS}?stream=S{tag}&create_stream=true&subjects=t{tag}.>"
    topic = f"t{tag}.x"
    receiver = create_receiver(url, group=f"g{tag}", topics=[topic])
    publisher = create_publisher(url)
    messages = accepted_messages(topic, CASES)
    try:
        await receiver.connect()
        await assert_delivered_unchanged(publisher, receiver, messages)
    finally:
        await receiver.close()
        nc = await nats.connect(NATS)
        await nc.jetstream().delete_stream(f"S{tag}")
        await nc.close()


def test_a_plain_header_still_travels_as_it_is() -> None:
    """Only what NATS cannot carry is escaped: other consumers keep reading plain headers."""
    from outboxer.brokers.nats import publish_headers

    message = make_message("t", {"n": 1}, key="k", headers={"trace": "abc", "X-Tenant": "7"})
    sent = publish_headers(message)
    assert sent["trace"] == "abc" and sent["X-Tenant"] == "7" and sent["outboxer-key"] == "k"
