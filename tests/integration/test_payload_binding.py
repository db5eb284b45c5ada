"""A row's ciphertext stays bound to that row, and a shredded subject stays shredded, on the
real PostgreSQL and SQLite outbox tables: through the relay's decryption and through
``outboxer keys rotate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outboxer import Outbox
from outboxer.crypto import (
    HEADER_DESTINATION,
    DecryptionError,
    KeyRing,
    SubjectKeyDeletedError,
    decrypt,
    generate_key,
)
from outboxer.message import Message
from outboxer.payload_admin import payload_table
from outboxer.payload_relay import PayloadHandling
from tests.integration.test_enqueue_protection import raw_rows, writer
from tests.integration.test_keys_rotate import execute
from tests.subjects import ShredDuringRead

K1, K2 = generate_key(), generate_key()


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = {"postgres": "pg_url", "sqlite": "sqlite_url"}[request.param]
    url: str = request.getfixturevalue(fixture)
    return url


def _swap_into_partner_row(db_url: str, ring: KeyRing) -> tuple[Message, Message]:
    """One message for an internal bus and a partner; then someone with write access to the
    table copies the internal copy's ciphertext into the partner's row, adding the
    ``outboxer-destination`` header a relay puts on forwarded ciphertext."""
    conn = writer(db_url)
    try:
        Outbox(encryption=ring).enqueue(
            conn,
            "orders",
            {"internal": "margin 42%"},
            destinations=["internal", "partner"],
        )
        conn.commit()
    finally:
        conn.close()
    internal, partner = raw_rows(db_url)
    assert (internal.destination, partner.destination) == ("internal", "partner")
    forged = {**internal.headers, HEADER_DESTINATION: "internal"}
    execute(
        db_url,
        "UPDATE {outbox} SET payload = ?, headers = ? WHERE destination = 'partner'",
        internal.payload,
        json.dumps(forged),
    )
    return internal, raw_rows(db_url)[1]


async def test_the_relay_decrypts_a_row_for_its_own_destination_only(db_url: str) -> None:
    ring = KeyRing({"k1": K1})
    internal, forged = _swap_into_partner_row(db_url, ring)
    handling = PayloadHandling("partner", "decrypt", ring)
    # The internal copy's plaintext must never go out to the partner.
    with pytest.raises(DecryptionError, match="does not authenticate"):
        await handling.prepare(forged)
    # The genuine internal row still decrypts for its own destination.
    assert json.loads(
        (await PayloadHandling("internal", "decrypt", ring).prepare(internal)).payload
    )


def test_rotation_does_not_rebind_a_ciphertext_to_another_destination(db_url: str) -> None:
    _, forged = _swap_into_partner_row(db_url, KeyRing({"k1": K1}))
    new_ring = KeyRing({"k1": K1, "k2": K2})
    with payload_table(db_url) as table:
        result = table.rotate(new_ring)
    # Only the genuine internal row is re-encrypted; the forged one is reported and left.
    assert result.rotated == 1
    assert len(result.failed) == 1 and str(forged.id) in result.failed[0]
    partner = raw_rows(db_url)[1]
    assert partner.payload == forged.payload
    assert partner.headers == forged.headers
    with pytest.raises(DecryptionError):
        decrypt(partner, new_ring, destination="partner")


def test_rotation_never_recreates_the_key_of_a_subject_shredded_meanwhile(
    db_url: str, tmp_path: Path
) -> None:
    subjects = ShredDuringRead(tmp_path / "subjects")
    conn = writer(db_url)
    try:
        Outbox(encryption=KeyRing({"k1": K1}, subjects=subjects)).enqueue(
            conn, "profile", {"email": "ann@example.com"}, subject="user-1"
        )
        conn.commit()
    finally:
        conn.close()
    (before,) = raw_rows(db_url)
    subjects.shred_after_read = True
    new_ring = KeyRing({"k1": K1, "k2": K2}, subjects=subjects)
    with payload_table(db_url) as table:
        result = table.rotate(new_ring)
    subjects.shred_after_read = False
    assert (result.rotated, result.shredded, result.failed) == (0, 1, [])
    # No new secret was made for the subject, and its row is as unreadable as before.
    assert subjects.get("user-1") is None
    (after,) = raw_rows(db_url)
    assert after.payload == before.payload
    with pytest.raises(SubjectKeyDeletedError):
        decrypt(after, new_ring)
