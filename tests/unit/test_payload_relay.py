"""The relay's per-destination payload handling (outboxer.payload_relay), on the memory broker."""

from __future__ import annotations

import dataclasses
import json
import uuid

import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.memory import MemoryPublisher
from outboxer.claimcheck import ClaimCheck, FileObjectStore
from outboxer.config import DestinationSettings, _destinations
from outboxer.crypto import (
    HEADER_DESTINATION,
    KeyRing,
    MemorySubjectKeys,
    decrypt,
    encrypt_message,
    generate_key,
)
from outboxer.errors import ConfigError
from outboxer.message import Message
from outboxer.payload_relay import PayloadHandling

KEY = generate_key()


def message(n: int, key: str | None = None, destination: str = "d") -> Message:
    return Message(
        id=uuid.uuid4(),
        topic="t",
        payload=json.dumps({"n": n}).encode(),
        key=key,
        headers={"h": "v"},
        destination=destination,
    )


async def publisher(name: str) -> MemoryPublisher:
    memory = MemoryPublisher(f"memory://{name}-{uuid.uuid4().hex[:6]}")
    await memory.connect()
    return memory


async def test_decrypt_publishes_the_plaintext_and_forward_the_ciphertext() -> None:
    ring = KeyRing({"k1": KEY}, subjects=MemorySubjectKeys())
    plain = message(1)
    stored = encrypt_message(plain, ring, subject="u1", seal_headers=True)

    decrypting = await publisher("decrypt")
    outcomes = await PayloadHandling("d", "decrypt", ring).publish(decrypting, [stored, plain])
    assert [o.kind for o in outcomes] == [OutcomeKind.PUBLISHED, OutcomeKind.PUBLISHED]
    sent, unchanged = decrypting.broker.messages
    assert (sent.payload, sent.headers, sent.content_type) == (
        plain.payload,
        {"h": "v"},
        "application/json",
    )
    assert unchanged == plain

    forwarding = await publisher("forward")
    await PayloadHandling("d", "forward", None).publish(forwarding, [stored])
    [forwarded] = forwarding.broker.messages
    assert forwarded.payload == stored.payload and forwarded.headers[HEADER_DESTINATION] == "d"
    assert "h" not in forwarded.headers, "sealed headers stay sealed"
    assert decrypt(forwarded, ring).payload == plain.payload, "a consumer with the key reads it"


async def test_a_key_error_fails_that_message_alone_permanently_and_skips_its_key() -> None:
    ring = KeyRing({"k1": KEY})
    other = KeyRing({"k9": generate_key()})
    unreadable = encrypt_message(message(1, key="a"), other)
    after_it = encrypt_message(message(2, key="a"), ring)
    unrelated = encrypt_message(message(3, key="b"), ring)
    memory = await publisher("keys")
    outcomes = await PayloadHandling("d", "decrypt", ring).publish(
        memory, [unreadable, after_it, unrelated]
    )
    assert [o.kind for o in outcomes] == [
        OutcomeKind.FAILED,
        OutcomeKind.SKIPPED,
        OutcomeKind.PUBLISHED,
    ]
    assert outcomes[0].retryable is False and "no key 'k9'" in (outcomes[0].error or "")
    assert [json.loads(m.payload) for m in memory.broker.messages] == [{"n": 3}]


async def test_a_relay_without_keys_fails_encrypted_messages_with_a_clear_error() -> None:
    stored = encrypt_message(message(1), KeyRing({"k1": KEY}))
    outcomes = await PayloadHandling("d").publish(await publisher("nokeys"), [stored])
    assert outcomes[0].retryable is False
    assert "this relay has no encryption keys" in (outcomes[0].error or "")


async def test_a_key_source_outage_is_retryable_and_its_fetch_leaves_the_event_loop() -> None:
    import threading

    loop_thread = threading.get_ident()
    calls: list[int] = []
    healthy = {"up": False}

    def kms(key_id: str) -> str | None:
        calls.append(threading.get_ident())
        if not healthy["up"]:
            raise TimeoutError("KMS did not answer")
        return KEY if key_id == "k1" else None

    stored = encrypt_message(message(1), KeyRing({"k1": KEY}))
    handling = PayloadHandling("d", "decrypt", KeyRing.from_callable(kms, "k1"))
    memory = await publisher("kms")
    [outcome] = await handling.publish(memory, [stored])
    assert outcome.kind is OutcomeKind.FAILED and outcome.retryable is True
    assert "KMS did not answer" in (outcome.error or "")
    healthy["up"] = True
    [outcome] = await handling.publish(memory, [stored])
    assert outcome.kind is OutcomeKind.PUBLISHED
    assert calls and loop_thread not in calls


async def test_claim_checked_messages_are_published_as_references(tmp_path: object) -> None:
    from pathlib import Path

    assert isinstance(tmp_path, Path)
    ring = KeyRing({"k1": KEY})
    offload = ClaimCheck(FileObjectStore(tmp_path / "claims"), threshold=1).offload
    reference = offload(encrypt_message(message(1), ring))
    memory = await publisher("claims")
    await PayloadHandling("d", "decrypt", ring).publish(memory, [reference])
    [sent] = memory.broker.messages
    assert sent.payload == b"" and sent.headers[HEADER_DESTINATION] == "d"
    assert sent.headers["outboxer-claim-check"] == reference.headers["outboxer-claim-check"]


async def test_a_stripped_envelope_drops_internal_headers_once_decrypted() -> None:
    ring = KeyRing({"k1": KEY})
    plain = dataclasses.replace(message(1), headers={"internal-user": "alice", "h": "v"})
    stored = encrypt_message(plain, ring, seal_headers=True)
    memory = await publisher("stripped")
    await PayloadHandling("d", "decrypt", ring, envelope="stripped").publish(memory, [stored])
    [sent] = memory.broker.messages
    assert sent.headers == {"h": "v"} and sent.payload == plain.payload


def test_a_destination_names_its_payload_mode() -> None:
    assert DestinationSettings("d", "memory://x", payload="forward").payload == "forward"
    assert DestinationSettings("d", "memory://x").payload == "decrypt"
    with pytest.raises(ConfigError, match="payload must be 'decrypt' or 'forward'"):
        DestinationSettings("d", "memory://x", payload="plain")
    with pytest.raises(ConfigError, match="payload must be 'decrypt' or 'forward'"):
        _destinations({"d": {"broker": "memory://x", "payload": 1}}, "outboxer.toml")


def test_decrypt_keeps_every_message_field_and_the_associated_data_format() -> None:
    """decrypt builds the Message itself (dataclasses.replace costs 10 µs a message): a
    field added to Message must come through too; the associated data stays the same bytes."""
    from datetime import UTC, datetime

    from outboxer.crypto import _with_payload, associated_data

    full = dataclasses.replace(
        message(1, key="k", destination="dé.st"),
        created_at=datetime.now(UTC),
        attempts=3,
        seq=42,
    )
    rebuilt = _with_payload(full, b"p", "text/plain", {"a": "b"})
    expected = dataclasses.replace(
        full, payload=b"p", content_type="text/plain", headers={"a": "b"}
    )
    assert rebuilt == expected
    assert [f.name for f in dataclasses.fields(Message)] == [
        "id",
        "topic",
        "payload",
        "key",
        "headers",
        "content_type",
        "destination",
        "created_at",
        "attempts",
        "seq",
    ], "a new Message field: copy it in crypto._with_payload"
    headers = {"outboxer-key-id": "k1", "outboxer-subject": "ü", "other": "x"}
    assert (
        associated_data(full.id, "dé.st", headers)
        == json.dumps(
            [
                "outboxer/1",
                str(full.id),
                "dé.st",
                [["outboxer-key-id", "k1"], ["outboxer-subject", "ü"]],
            ],
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode()
    )
