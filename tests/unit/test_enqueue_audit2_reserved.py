"""The write path's boundary: names outboxer reserves, and ids repeated within one write."""

from __future__ import annotations

import sqlite3
import uuid

import pytest

from outboxer import DuplicateMessageError, Outbox, PayloadError
from outboxer.contrib.events import record_event
from outboxer.errors import ConfigError
from outboxer.message import Message
from outboxer.receivers.base import decode

RESERVED = [
    "outboxer-key",
    "Outboxer-Key",
    "OUTBOXER-ID",
    "outboxer-topic",
    "outboxer-created-at",
    "outboxer-destination",
    "outboxer-key-id",
    "outboxer-encryption",
    "outboxer-claim-check",
    "outboxer-anything-new",
]


@pytest.mark.parametrize("name", RESERVED)
def test_reserved_header_names_are_refused_at_enqueue(name: str) -> None:
    with pytest.raises(PayloadError, match="reserved"):
        Outbox().build("t", {"a": 1}, headers={name: "forged"})


@pytest.mark.parametrize("name", RESERVED)
def test_reserved_header_names_are_refused_when_an_event_is_recorded(name: str) -> None:
    class Entity:
        pass

    with pytest.raises(PayloadError, match="reserved"):
        record_event(Entity(), "t", {"a": 1}, headers={name: "forged"})


def test_a_keyless_message_reaches_consumers_without_a_key() -> None:
    """Why the names are refused: brokers with headers only carry the envelope beside the
    user's headers, so a user "outboxer-key" would become the key of a keyless message."""
    [message] = Outbox().build("t", {"a": 1}, headers={"trace": "t-1", "outboxer_key": "ok"})
    delivery = decode(message.envelope_headers(), message.payload).delivery
    assert delivery.key is None
    assert delivery.headers == {"trace": "t-1", "outboxer_key": "ok"}
    # What the refusal prevents: such a header, had it been stored, is read as the key.
    forged = Message(id=message.id, topic="t", payload=b"{}", headers={"outboxer-key": "k"})
    assert decode(forged.envelope_headers(), forged.payload).delivery.key == "k"


def test_headers_outboxer_writes_itself_still_pass_through_protection() -> None:
    """Encryption adds outboxer-* headers after the user's were checked."""
    from outboxer.crypto import KeyRing, decrypt, generate_key

    ring = KeyRing({"k1": generate_key()})
    outbox = Outbox(encryption=ring)
    [stored] = outbox.protect(outbox.build("t", {"a": 1}, headers={"trace": "t-1"}))
    assert stored.headers["outboxer-key-id"] == "k1"
    assert decrypt(stored, ring).headers == {"trace": "t-1"}


def test_an_id_repeated_for_one_destination_in_one_batch_is_refused_before_sql() -> None:
    # This database has no outbox table: any SQL would fail with OperationalError.
    same = uuid.uuid4()
    items = [{"topic": "t", "payload": {"n": 1}, "message_id": same}] * 2
    with sqlite3.connect(":memory:") as conn, pytest.raises(DuplicateMessageError, match="twice"):
        Outbox().enqueue_many(conn, items)


def test_a_destination_named_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="twice"):
        Outbox(destinations=("a", "a"))
    with pytest.raises(ConfigError, match="twice"):
        Outbox().build("t", {}, destinations=["b", "b"])


def test_one_id_for_two_destinations_is_fine() -> None:
    copies = Outbox(destinations=("a", "b")).build("t", {})
    assert [(m.destination, m.id) for m in copies] == [("a", copies[0].id), ("b", copies[0].id)]
    assert all(isinstance(m, Message) for m in copies)
