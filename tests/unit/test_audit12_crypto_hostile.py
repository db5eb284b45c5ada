"""Hostile encryption headers and malformed sealed plaintexts: typed, permanent, bounded
errors; a key id or subject id read from a message never reaches the KMS or the subject
store unless it is a valid id."""

from __future__ import annotations

import asyncio
import os
import struct
import uuid

import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.crypto import (
    HEADER_ENCRYPTED_CONTENT_TYPE,
    HEADER_ENCRYPTION,
    HEADER_KEY_ID,
    HEADER_SEALED_HEADERS,
    HEADER_SUBJECT,
    DecryptionError,
    KeyNotFoundError,
    KeyRing,
    MemorySubjectKeys,
    associated_data,
    decrypt,
    encrypt_message,
)
from outboxer.message import Message
from outboxer.payload_relay import PayloadHandling
from outboxer.testing import make_message

HOSTILE_KEY_ID = "../../secrets/" + "\x00\n" + "A" * 100_000


def _forged(key_id: str, **extra: str) -> Message:
    return Message(
        id=uuid.uuid4(),
        topic="t",
        payload=os.urandom(64),
        headers={HEADER_ENCRYPTION: "A256GCM", HEADER_KEY_ID: key_id, **extra},
        destination="d",
    )


def test_a_hostile_key_id_never_reaches_the_kms_and_fails_permanently() -> None:
    asked: list[str] = []

    def kms(key_id: str) -> bytes:
        asked.append(key_id)
        raise ValueError("ValidationException: malformed key id")  # as a KMS answers

    ring = KeyRing.from_callable(kms, "k1")
    with pytest.raises(KeyNotFoundError) as caught:
        decrypt(_forged(HOSTILE_KEY_ID), ring)
    assert asked == []
    assert len(str(caught.value)) < 300

    # The relay: abandoned at once (not retried max_attempts times), the KMS never asked.
    handling = PayloadHandling("d", "decrypt", ring)
    [outcome] = asyncio.run(
        handling.publish(memory_broker(f"unit-{uuid.uuid4().hex[:8]}"), [_forged(HOSTILE_KEY_ID)])
    )
    assert asked == []
    assert outcome.retryable is False and len(outcome.error or "") < 300


class _RecordingSubjects(MemorySubjectKeys):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def get(self, subject: str) -> bytes | None:
        self.asked.append(subject)
        return super().get(subject)


@pytest.mark.parametrize("subject", ["u" * 1_000_000, "a\x00b", "line\nbreak"])
def test_a_hostile_subject_header_is_a_bounded_decryption_error(subject: str) -> None:
    subjects = _RecordingSubjects()
    ring = KeyRing({"k1": os.urandom(32)}, subjects=subjects)
    with pytest.raises(DecryptionError) as caught:
        decrypt(_forged("k1", **{HEADER_SUBJECT: subject}), ring)
    assert subjects.asked == []
    assert len(str(caught.value)) < 300


def _sealed_plaintext(ring: KeyRing, plaintext: bytes) -> Message:
    """A message that authenticates (its writer holds the key) with this sealed plaintext."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    headers = {
        HEADER_ENCRYPTION: "A256GCM",
        HEADER_KEY_ID: "k1",
        HEADER_ENCRYPTED_CONTENT_TYPE: "application/json",
        HEADER_SEALED_HEADERS: "1",
    }
    identifier = uuid.uuid4()
    nonce = os.urandom(12)
    sealed = AESGCM(ring.key("k1")).encrypt(
        nonce, plaintext, associated_data(identifier, "d", headers)
    )
    return Message(
        id=identifier, topic="t", payload=nonce + sealed, headers=headers, destination="d"
    )


def test_a_sealed_length_beyond_the_plaintext_is_a_decryption_error() -> None:
    ring = KeyRing({"k1": os.urandom(32)})
    packed = b'{"a":"b"}'
    # Declares 1000 bytes of sealed headers; the plaintext holds 9 and no payload.
    message = _sealed_plaintext(ring, struct.pack(">I", 1000) + packed)
    with pytest.raises(DecryptionError, match="sealed headers are malformed"):
        decrypt(message, ring)
    huge = _sealed_plaintext(ring, struct.pack(">I", 0xFFFFFFFF) + packed + b"{}")
    with pytest.raises(DecryptionError, match="sealed headers are malformed"):
        decrypt(huge, ring)


def test_sealed_headers_nested_too_deep_are_a_decryption_error() -> None:
    ring = KeyRing({"k1": os.urandom(32)})
    packed = b"[" * 200_000 + b"]" * 200_000
    message = _sealed_plaintext(ring, struct.pack(">I", len(packed)) + packed + b"{}")
    with pytest.raises(DecryptionError, match="sealed headers are malformed"):
        decrypt(message, ring)


def test_well_formed_sealed_headers_still_round_trip() -> None:
    ring = KeyRing({"k1": os.urandom(32)}, subjects=MemorySubjectKeys())
    message = make_message("t", {"n": 1}, headers={"secret": "s", "open": "o"})
    stored = encrypt_message(message, ring, subject="user-1", seal_headers={"secret"})
    assert "secret" not in stored.headers
    plain = decrypt(stored, ring)
    assert plain.payload == message.payload and plain.headers == {"secret": "s", "open": "o"}


@pytest.mark.parametrize("key_id", [["k1"], {"k": "1"}, 7])
def test_a_key_id_of_another_json_type_is_a_key_not_found_error(key_id: object) -> None:
    """Headers of a row are JSON: a hand-written row may hold a list or a number there."""
    ring = KeyRing({"k1": os.urandom(32)})
    with pytest.raises(KeyNotFoundError, match="not a valid key id"):
        ring.key(key_id)  # type: ignore[arg-type]
    [outcome] = asyncio.run(
        PayloadHandling("d", "decrypt", ring).publish(
            memory_broker(f"unit-{uuid.uuid4().hex[:8]}"),
            [_forged(key_id)],  # type: ignore[arg-type]
        )
    )
    assert outcome.retryable is False
