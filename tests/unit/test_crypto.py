"""Encryption at rest: the format, the binding to the row, rotation, subject keys, key sources."""

from __future__ import annotations

import base64
import json
import logging
import os
import stat
import threading
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from outboxer.crypto import (
    HEADER_DESTINATION,
    HEADER_ENCRYPTED_CONTENT_TYPE,
    HEADER_ENCRYPTION,
    HEADER_KEY_ID,
    HEADER_SEALED_HEADERS,
    HEADER_SUBJECT,
    DecryptionError,
    FileSubjectKeys,
    KeyNotFoundError,
    KeyRing,
    KeyRingUnavailableError,
    MemorySubjectKeys,
    SubjectKeyDeletedError,
    decrypt,
    encrypt_message,
    generate_key,
    reencrypt,
)
from outboxer.errors import ConfigError, PayloadError
from outboxer.message import BINARY, JSON, Message, uuid7
from outboxer.redact import MASK, get_logger

PLAINTEXT = b'{"customer":"Ada Lovelace","card":"4111 1111 1111 1111"}'


def message(
    payload: bytes = PLAINTEXT,
    destination: str = "default",
    headers: dict[str, str] | None = None,
) -> Message:
    return Message(
        id=uuid7(),
        topic="order.placed",
        payload=payload,
        key="customer-7",
        headers=headers if headers is not None else {"traceparent": "00-ab-01"},
        content_type=JSON,
        destination=destination,
    )


def ring(*ids: str, subjects: MemorySubjectKeys | None = None) -> KeyRing:
    return KeyRing({key_id: generate_key() for key_id in ids or ("k1",)}, subjects=subjects)


def test_round_trip_keeps_the_envelope_readable_and_hides_the_payload() -> None:
    keyring = ring("k1")
    original = message()
    stored = encrypt_message(original, keyring)

    assert PLAINTEXT not in stored.payload
    assert b"Lovelace" not in stored.payload
    assert stored.content_type == BINARY
    assert stored.headers[HEADER_ENCRYPTION] == "A256GCM"
    assert stored.headers[HEADER_KEY_ID] == "k1"
    assert stored.headers[HEADER_ENCRYPTED_CONTENT_TYPE] == JSON
    assert stored.headers["traceparent"] == "00-ab-01"  # headers stay plaintext by default
    assert (stored.id, stored.topic, stored.key) == (original.id, original.topic, original.key)
    assert len(stored.payload) == 12 + len(PLAINTEXT) + 16  # nonce, ciphertext, tag

    assert decrypt(stored, keyring) == original


def test_the_documented_format_decrypts_with_plain_aes_gcm() -> None:
    """The module docstring is the spec a consumer in another language implements."""
    material = os.urandom(32)
    keyring = KeyRing({"k1": material})
    stored = encrypt_message(message(destination="partner"), keyring, subject=None)
    bound = sorted(
        [name, value] for name, value in stored.headers.items() if name.startswith("outboxer-")
    )
    aad = json.dumps(
        ["outboxer/1", str(stored.id), "partner", bound], separators=(",", ":")
    ).encode()
    plaintext = AESGCM(material).decrypt(stored.payload[:12], stored.payload[12:], aad)
    assert plaintext == PLAINTEXT


def test_every_encryption_takes_a_fresh_random_nonce() -> None:
    keyring = ring("k1")
    original = message()
    nonces = {encrypt_message(original, keyring).payload[:12] for _ in range(2000)}
    assert len(nonces) == 2000


@pytest.mark.parametrize(
    "move",
    [
        pytest.param(lambda m: replace(m, id=uuid7()), id="to another message id"),
        pytest.param(lambda m: replace(m, destination="partner"), id="to another destination"),
    ],
)
def test_a_ciphertext_moved_to_another_row_does_not_decrypt(move: object) -> None:
    keyring = ring("k1")
    stored = encrypt_message(message(), keyring)
    moved = move(stored)  # type: ignore[operator]
    with pytest.raises(DecryptionError, match="does not authenticate"):
        decrypt(moved, keyring)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        (HEADER_ENCRYPTED_CONTENT_TYPE, "text/plain; charset=utf-8"),
        (HEADER_SUBJECT, "someone-else"),
        (HEADER_SEALED_HEADERS, "1"),
    ],
)
def test_encryption_headers_are_bound_to_the_ciphertext(header: str, value: str) -> None:
    keyring = ring("k1", subjects=MemorySubjectKeys())
    keyring.subjects.get_or_create("someone-else")  # type: ignore[union-attr]
    stored = encrypt_message(message(), keyring)
    altered = replace(stored, headers={**stored.headers, header: value})
    with pytest.raises(DecryptionError):
        decrypt(altered, keyring)


def test_a_flipped_byte_is_detected() -> None:
    keyring = ring("k1")
    stored = encrypt_message(message(), keyring)
    payload = bytearray(stored.payload)
    payload[20] ^= 0x01
    with pytest.raises(DecryptionError, match="altered"):
        decrypt(replace(stored, payload=bytes(payload)), keyring)


def test_a_wrong_key_under_the_same_id_is_a_clear_error() -> None:
    stored = encrypt_message(message(), ring("k1"))
    with pytest.raises(DecryptionError, match="under key 'k1'"):
        decrypt(stored, ring("k1"))


def test_a_missing_key_id_is_a_key_not_found_error_naming_it() -> None:
    stored = encrypt_message(message(), ring("k1"))
    with pytest.raises(KeyNotFoundError, match=r"no key 'k1'.*k2"):
        decrypt(stored, ring("k2"))


def test_a_consumer_decrypts_with_the_destination_the_relay_names() -> None:
    """A forwarded message arrives without the row's destination; the relay's header names it."""
    keyring = ring("k1")
    original = message(destination="partner")
    stored = encrypt_message(original, keyring)
    received = replace(stored, destination="default")
    with pytest.raises(DecryptionError):
        decrypt(received, keyring)
    assert decrypt(received, keyring, destination="partner").payload == PLAINTEXT
    forwarded = replace(received, headers={**received.headers, HEADER_DESTINATION: "partner"})
    assert decrypt(forwarded, keyring) == replace(original, destination="default")


def test_a_message_that_is_not_encrypted_comes_back_unchanged() -> None:
    plain = message()
    assert decrypt(plain, ring("k1")) is plain


def test_own_headers_cannot_be_given_by_the_writer() -> None:
    forged = message(headers={HEADER_KEY_ID: "k0"})
    with pytest.raises(PayloadError, match="outboxer's own"):
        encrypt_message(forged, ring("k1"))


# ----- rotation -------------------------------------------------------------------------------


def test_rotation_reencrypts_under_the_current_key_and_every_message_stays_readable() -> None:
    old = generate_key()
    before = KeyRing({"k1": old})
    originals = [message(payload=f'{{"n":{n}}}'.encode()) for n in range(20)]
    stored = [encrypt_message(m, before) for m in originals]

    after = KeyRing({"k1": old, "k2": generate_key()})  # the new key listed last: current
    assert after.current_key_id == "k2"
    rotated = [reencrypt(m, after) for m in stored]
    assert all(r is not None and r.headers[HEADER_KEY_ID] == "k2" for r in rotated)
    assert all(r.payload[:12] != s.payload[:12] for r, s in zip(rotated, stored, strict=True))  # type: ignore[union-attr]

    # Once every row is rotated, the old key can leave the ring.
    retired = KeyRing({"k2": after.key("k2")})
    assert [decrypt(r, retired) for r in rotated] == originals  # type: ignore[arg-type]
    assert reencrypt(rotated[0], after) is None  # type: ignore[arg-type]
    assert reencrypt(originals[0], after) is None  # not encrypted: nothing to rotate


def test_rotation_keeps_subject_and_sealed_headers() -> None:
    subjects = MemorySubjectKeys()
    old = generate_key()
    original = message(headers={"traceparent": "t", "x-user-email": "ada@example.org"})
    stored = encrypt_message(
        original, KeyRing({"k1": old}, subjects=subjects), subject="user-1", seal_headers=True
    )
    after = KeyRing({"k1": old, "k2": generate_key()}, subjects=subjects)
    rotated = reencrypt(stored, after)
    assert rotated is not None
    assert rotated.headers[HEADER_SUBJECT] == "user-1"
    assert "x-user-email" not in rotated.headers
    assert decrypt(rotated, after) == original


# ----- subjects -------------------------------------------------------------------------------


def test_a_shredded_subject_cannot_be_decrypted_and_others_can() -> None:
    keyring = ring("k1", subjects=MemorySubjectKeys())
    ada = encrypt_message(message(), keyring, subject="user-ada")
    bob = encrypt_message(message(), keyring, subject="user-bob")
    assert ada.headers[HEADER_SUBJECT] == "user-ada"
    assert decrypt(ada, keyring).payload == PLAINTEXT

    assert keyring.shred("user-ada") is True
    assert keyring.shred("user-ada") is False
    with pytest.raises(SubjectKeyDeletedError, match="user-ada"):
        decrypt(ada, keyring)
    assert decrypt(bob, keyring).payload == PLAINTEXT

    # A new message for the same subject makes a new secret: the old ones stay unreadable.
    encrypt_message(message(), keyring, subject="user-ada")
    with pytest.raises(DecryptionError):
        decrypt(ada, keyring)


def test_a_subject_key_is_not_the_ring_key() -> None:
    """Without the subject's secret, the ring key alone decrypts nothing of the subject."""
    keyring = ring("k1", subjects=MemorySubjectKeys())
    stored = encrypt_message(message(), keyring, subject="user-ada")
    headers = {name: value for name, value in stored.headers.items() if name != HEADER_SUBJECT}
    with pytest.raises(DecryptionError):
        decrypt(replace(stored, headers=headers), keyring)


def test_subjects_need_a_subject_store_and_a_sane_id() -> None:
    with pytest.raises(ConfigError, match="subject key store"):
        encrypt_message(message(), ring("k1"), subject="user-1")
    with pytest.raises(PayloadError, match="subject"):
        encrypt_message(message(), ring("k1", subjects=MemorySubjectKeys()), subject="a\nb")


def test_file_subject_keys_persist_agree_under_races_and_shred(tmp_path: Path) -> None:
    directory = tmp_path / "subjects"
    results: list[bytes] = []
    stores = [FileSubjectKeys(directory) for _ in range(8)]
    threads = [
        threading.Thread(target=lambda s=s: results.append(s.get_or_create("user-ada")))
        for s in stores
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(results[0]) == 32

    files = [p for p in directory.iterdir()]
    assert len(files) == 1  # no temporary file left behind
    assert "ada" not in files[0].name
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600

    keyring = KeyRing({"k1": generate_key()}, subjects=FileSubjectKeys(directory))
    stored = encrypt_message(message(), keyring, subject="user-ada")
    reopened = KeyRing({"k1": keyring.key("k1")}, subjects=FileSubjectKeys(directory))
    assert decrypt(stored, reopened).payload == PLAINTEXT
    assert reopened.shred("user-ada") is True
    assert list(directory.iterdir()) == []
    with pytest.raises(SubjectKeyDeletedError):
        decrypt(stored, keyring)


# ----- sealed headers -------------------------------------------------------------------------


def test_sealed_headers_travel_inside_the_ciphertext() -> None:
    keyring = ring("k1")
    original = message(headers={"traceparent": "t-1", "x-email": "ada@example.org", "x": "1"})
    stored = encrypt_message(original, keyring, seal_headers="x-email")  # one name, not "x"
    assert stored.headers["x"] == "1"
    assert "x-email" not in stored.headers
    assert stored.headers["traceparent"] == "t-1"
    assert stored.headers[HEADER_SEALED_HEADERS] == "1"
    assert b"ada@example.org" not in stored.payload
    assert decrypt(stored, keyring) == original


# ----- key sources ----------------------------------------------------------------------------


def test_keys_from_the_environment() -> None:
    k1, k2 = generate_key(), generate_key()
    env = {"OUTBOXER_ENCRYPTION_KEYS": f"k1={k1}, k2={k2}"}
    assert KeyRing.from_env(environ=env).current_key_id == "k2"
    env["OUTBOXER_ENCRYPTION_CURRENT_KEY"] = "k1"
    keyring = KeyRing.from_env(environ=env)
    assert keyring.current_key_id == "k1"
    assert keyring.key("k2") == base64.b64decode(k2)
    with pytest.raises(ConfigError, match="empty"):
        KeyRing.from_env(environ={})
    with pytest.raises(ConfigError, match="twice"):
        KeyRing.from_env(environ={"OUTBOXER_ENCRYPTION_KEYS": f"k1={k1},k1={k2}"})
    with pytest.raises(ConfigError, match="not among"):
        KeyRing.from_env(
            environ={
                "OUTBOXER_ENCRYPTION_KEYS": f"k1={k1}",
                "OUTBOXER_ENCRYPTION_CURRENT_KEY": "k9",
            }
        )


def test_keys_from_a_toml_or_json_file(tmp_path: Path) -> None:
    k1, k2 = generate_key(), generate_key()
    toml_file = tmp_path / "keys.toml"
    toml_file.write_text(f'current = "2025-10"\n[keys]\n"2025-10" = "{k1}"\n"2025-11" = "{k2}"\n')
    assert KeyRing.from_file(toml_file).current_key_id == "2025-10"
    json_file = tmp_path / "keys.json"
    json_file.write_text(json.dumps({"keys": {"a": k1, "b": k2}}))
    assert KeyRing.from_file(json_file).current_key_id == "b"

    broken = tmp_path / "broken.toml"
    broken.write_text(f'[keys]\n"a" = "{k1}\n')  # unterminated string: the parser would quote it
    with pytest.raises(ConfigError) as caught:
        KeyRing.from_file(broken)
    assert k1 not in str(caught.value)
    with pytest.raises(ConfigError, match="cannot read"):
        KeyRing.from_file(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("material", "reason"),
    [
        (base64.b64encode(b"x" * 16).decode(), "decodes to 16 bytes"),
        ("not base64 at all!!", "not valid base64"),
        (b"x" * 31, "decodes to 31 bytes"),
    ],
)
def test_a_bad_key_is_refused_without_quoting_it(material: str | bytes, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as caught:
        KeyRing({"k1": material})
    if isinstance(material, str):
        assert material not in str(caught.value)


def test_url_safe_base64_without_padding_is_accepted() -> None:
    raw = os.urandom(32)
    text = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    assert KeyRing({"k1": text}).key("k1") == raw


def test_keys_from_a_callable_are_fetched_once_and_its_failures_are_typed() -> None:
    material = os.urandom(32)
    calls: list[str] = []

    def fetch(key_id: str) -> bytes | None:
        calls.append(key_id)
        if key_id == "kms-down":
            raise TimeoutError("KMS did not answer")
        return material if key_id == "k1" else None

    keyring = KeyRing.from_callable(fetch, "k1")
    stored = [encrypt_message(message(), keyring) for _ in range(5)]
    assert all(decrypt(s, keyring).payload == PLAINTEXT for s in stored)
    assert calls == ["k1"]
    with pytest.raises(KeyNotFoundError, match="k9"):
        keyring.key("k9")
    with pytest.raises(KeyRingUnavailableError, match="KMS did not answer"):
        keyring.key("kms-down")


def test_key_material_never_reaches_a_log_line_or_a_repr(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = os.urandom(32)
    text = base64.b64encode(raw).decode()
    keyring = KeyRing({"k1": text})
    assert text not in repr(keyring) and "k1" in repr(keyring)

    logger = get_logger("outboxer.test_crypto")
    with caplog.at_level(logging.INFO, logger="outboxer.test_crypto"):
        logger.info("loaded %s and %s", text, raw.hex())
    assert text not in caplog.text and raw.hex() not in caplog.text
    assert MASK in caplog.text


def test_key_ids_are_checked() -> None:
    with pytest.raises(ConfigError, match="key id"):
        KeyRing({"bad id": generate_key()})
    with pytest.raises(ConfigError, match="at least one key"):
        KeyRing({})


def test_message_ids_as_text_bind_like_uuids() -> None:
    keyring = ring("k1")
    identifier = uuid.uuid4()
    stored, headers = keyring.encrypt(PLAINTEXT, str(identifier), "default")
    payload, sealed = keyring.decrypt_payload(stored, headers, identifier, "default")
    assert payload == PLAINTEXT and sealed == {}
