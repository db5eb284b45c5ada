"""Claim-check against real stores: a directory and an S3-compatible server (moto, 127.0.0.1),
and orphans of rolled-back transactions against the real PostgreSQL outbox."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from outboxer.claimcheck import (
    HEADER_CLAIM_CHECK,
    HEADER_CLAIM_CHECK_CONTENT_TYPE,
    HEADER_CLAIM_CHECK_SHA256,
    HEADER_CLAIM_CHECK_SIZE,
    ClaimCheck,
    ClaimCheckError,
    FileObjectStore,
    ObjectMismatchError,
    ObjectName,
    ObjectNotFoundError,
    ObjectStore,
    S3ObjectStore,
    create_object_store,
    fetch_payload,
    fetch_payload_async,
    object_name,
    sweep_orphans,
    sweep_orphans_async,
)
from outboxer.crypto import KeyRing, decrypt, encrypt_message, generate_key
from outboxer.errors import ConfigError, PayloadError
from outboxer.message import BINARY, JSON, Message, uuid7
from tests.s3 import s3_bucket, s3_client, s3_server, s3_url  # noqa: F401 -- fixtures

BIG = b'{"blob":"' + b"x" * 300_000 + b'"}'


def message(payload: bytes = BIG, destination: str = "default") -> Message:
    return Message(
        id=uuid7(),
        topic="report.ready",
        payload=payload,
        key="report-1",
        headers={"traceparent": "00-ab-01"},
        content_type=JSON,
        destination=destination,
    )


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "file":
        yield FileObjectStore(tmp_path / "claims")
    else:
        bucket = request.getfixturevalue("s3_bucket")
        yield S3ObjectStore(bucket, prefix="claims", client=request.getfixturevalue("s3_client"))


def test_round_trip_through_the_store(store: ObjectStore) -> None:
    claim_check = ClaimCheck(store, threshold=64 * 1024)
    original = message(destination="partner.eu")
    reference = claim_check.offload(original)

    assert reference.payload == b""
    assert reference.content_type == BINARY
    assert reference.headers["traceparent"] == "00-ab-01"
    assert reference.headers[HEADER_CLAIM_CHECK_SIZE] == str(len(BIG))
    assert reference.headers[HEADER_CLAIM_CHECK_SHA256] == hashlib.sha256(BIG).hexdigest()
    assert reference.headers[HEADER_CLAIM_CHECK_CONTENT_TYPE] == JSON
    name = ObjectName.parse(reference.headers[HEADER_CLAIM_CHECK])
    assert name is not None
    assert (name.message_id, name.destination) == (str(original.id), "partner.eu")
    assert store.get(name.name) == BIG  # durable as soon as offload returned

    assert fetch_payload(reference, store) == original


def test_small_payloads_stay_in_the_row(store: ObjectStore) -> None:
    small = message(payload=b'{"a":1}')
    assert ClaimCheck(store, threshold=1024).offload(small) is small
    assert fetch_payload(small, store) is small
    assert list(store.list_objects()) == []


async def test_async_round_trip(store: ObjectStore) -> None:
    original = message()
    reference = await ClaimCheck(store, threshold=1024).offload_async(original)
    assert await fetch_payload_async(reference, store) == original


def test_two_puts_for_one_row_never_overwrite_each_other(store: ObjectStore) -> None:
    """A duplicate enqueue puts before its INSERT fails: the committed row's object survives."""
    claim_check = ClaimCheck(store, threshold=1024)
    first = message()
    duplicate = replace(first, payload=b"y" * 5000)
    kept = claim_check.offload(first)
    claim_check.offload(duplicate)
    assert fetch_payload(kept, store).payload == BIG


def test_an_altered_object_is_an_error_never_a_wrong_payload(store: ObjectStore) -> None:
    reference = ClaimCheck(store, threshold=1024).offload(message())
    name = reference.headers[HEADER_CLAIM_CHECK]
    store.put(name, BIG[:-1] + b"!")
    with pytest.raises(ObjectMismatchError, match="SHA-256"):
        fetch_payload(reference, store)
    store.put(name, b"short")
    with pytest.raises(ObjectMismatchError, match="holds 5 bytes"):
        fetch_payload(reference, store)
    store.delete(name)
    with pytest.raises(ObjectNotFoundError):
        fetch_payload(reference, store)


@pytest.mark.parametrize(
    "forged",
    ["../../etc/passwd", "/etc/passwd", ".hidden", "0193-not-a-uuid.default.0123456789abcdef"],
)
def test_a_forged_reference_never_reaches_the_store(
    store: ObjectStore, forged: str, tmp_path: Path
) -> None:
    victim = message()
    headers = {**victim.headers, HEADER_CLAIM_CHECK: forged}
    with pytest.raises(ClaimCheckError, match="not an outboxer claim-check object name"):
        fetch_payload(replace(victim, headers=headers), store)


def test_a_message_cannot_fetch_another_messages_object(store: ObjectStore) -> None:
    claim_check = ClaimCheck(store, threshold=1024)
    other = claim_check.offload(message())
    thief = message(payload=b"")
    headers = {**thief.headers, HEADER_CLAIM_CHECK: other.headers[HEADER_CLAIM_CHECK]}
    with pytest.raises(ClaimCheckError, match="of another message"):
        fetch_payload(replace(thief, headers=headers), store)


def test_own_headers_cannot_be_given_by_the_writer(store: ObjectStore) -> None:
    forged = replace(message(), headers={HEADER_CLAIM_CHECK: "x"})
    with pytest.raises(PayloadError, match="outboxer's own"):
        ClaimCheck(store, threshold=0).offload(forged)


def test_an_encrypted_outbox_offloads_ciphertext_only(store: ObjectStore) -> None:
    keyring = KeyRing({"k1": generate_key()})
    original = message(payload=b'{"secret":"' + b"s" * 5000 + b'"}')
    stored = ClaimCheck(store, threshold=1024).offload(encrypt_message(original, keyring))
    raw = store.get(stored.headers[HEADER_CLAIM_CHECK])
    assert b"sssss" not in raw
    assert decrypt(fetch_payload(stored, store), keyring) == original


# ----- orphans --------------------------------------------------------------------------------


def _age(store: ObjectStore, name: str, seconds: float) -> None:
    """Make an object look older than it is (file stores only: their mtime is ours to set)."""
    assert isinstance(store, FileObjectStore)
    path = store.directory / name
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_sweep_deletes_old_unreferenced_objects_only(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "claims")
    claim_check = ClaimCheck(store, threshold=0)
    referenced_old = claim_check.offload(message()).headers[HEADER_CLAIM_CHECK]
    orphan_old = claim_check.offload(message()).headers[HEADER_CLAIM_CHECK]
    orphan_young = claim_check.offload(message()).headers[HEADER_CLAIM_CHECK]
    (store.directory / "not-ours.txt").write_text("someone else's file")
    for name in (referenced_old, orphan_old):
        _age(store, name, 7200)
    asked: list[str] = []

    def referenced(names: Sequence[ObjectName]) -> Collection[str]:
        asked.extend(n.name for n in names)
        return {referenced_old} & {n.name for n in names}

    assert sweep_orphans(store, referenced, grace=3600) == 1
    assert sorted(asked) == sorted([referenced_old, orphan_old])  # young ones are not asked about
    left = {o.name for o in store.list_objects()}
    assert left == {referenced_old, orphan_young, "not-ours.txt"}


async def test_sweep_on_s3_uses_the_servers_times(s3_server: str, s3_bucket: str) -> None:  # noqa: F811
    """Made from its URL (endpoint, region, credentials), as a relay would make it."""
    store = create_object_store(s3_url(s3_server, s3_bucket))
    assert isinstance(store, S3ObjectStore)
    claim_check = ClaimCheck(store, threshold=0)
    kept = claim_check.offload(message()).headers[HEADER_CLAIM_CHECK]
    claim_check.offload(message())  # an orphan: no row refers to it
    store.client.put_object(Bucket=s3_bucket, Key="claims/not-ours", Body=b"x")

    async def referenced(names: Sequence[ObjectName]) -> Collection[str]:
        return {kept} & {n.name for n in names}

    # Nothing is old enough yet; then, seen from an hour later, the orphan is.
    assert await sweep_orphans_async(store, referenced, grace=3600) == 0
    assert await sweep_orphans_async(store, referenced, grace=3600, now=time.time() + 3700) == 1
    left = {o.name for o in store.list_objects()}
    assert left == {kept, "not-ours"}
    store.close()


def test_a_rolled_back_transaction_leaves_no_reachable_object_after_the_sweep(
    pg_url: str, tmp_path: Path
) -> None:
    """The object is written before the row; the row's transaction rolls back; the sweep
    finds the object in no row of the real outbox and deletes it. A committed row's object
    stays and is fetched."""
    import psycopg

    import outboxer

    store = FileObjectStore(tmp_path / "claims")
    claim_check = ClaimCheck(store, threshold=1024)

    def enqueue_offloaded(conn: psycopg.Connection[object], original: Message) -> Message:
        reference = claim_check.offload(original)
        # The row Outbox(claim_check=...) writes (enqueue refuses outboxer-* headers of
        # its caller's).
        outboxer.Outbox()._write(conn, [reference])
        return reference

    with psycopg.connect(pg_url) as conn:
        committed = enqueue_offloaded(conn, message())
    with psycopg.connect(pg_url) as conn:
        rolled_back = enqueue_offloaded(conn, message())
        conn.rollback()
    for reference in (committed, rolled_back):
        _age(store, reference.headers[HEADER_CLAIM_CHECK], 7200)

    def referenced(names: Sequence[ObjectName]) -> Collection[str]:
        with psycopg.connect(pg_url) as conn:
            rows = conn.execute(
                "SELECT headers->>%s FROM outboxer.outbox WHERE headers->>%s = ANY(%s)",
                (HEADER_CLAIM_CHECK, HEADER_CLAIM_CHECK, [n.name for n in names]),
            ).fetchall()
        return {row[0] for row in rows}

    assert sweep_orphans(store, referenced, grace=3600) == 1
    with pytest.raises(ObjectNotFoundError):
        fetch_payload(rolled_back, store)
    with psycopg.connect(pg_url) as conn:
        row = conn.execute(
            "SELECT payload, content_type, headers FROM outboxer.outbox WHERE id = %s",
            (committed.id,),
        ).fetchone()
    assert row is not None and bytes(row[0]) == b""
    from_row = replace(committed, headers=row[2], content_type=row[1])
    assert fetch_payload(from_row, store).payload == BIG


# ----- configuration --------------------------------------------------------------------------


def test_store_urls(tmp_path: Path) -> None:
    store = create_object_store(f"file://{tmp_path}/objects")
    assert isinstance(store, FileObjectStore) and store.directory == tmp_path / "objects"
    s3 = create_object_store(
        "s3://bucket/a/b/?endpoint_url=http://127.0.0.1:9/&region=eu-west-1"
        "&access_key_id=AK&secret_access_key=very-secret-key"
    )
    assert isinstance(s3, S3ObjectStore) and (s3.bucket, s3.prefix) == ("bucket", "a/b/")
    assert "very-secret-key" not in repr(s3)
    with pytest.raises(ConfigError, match="unknown options"):
        create_object_store("s3://bucket/?endpont_url=x")
    with pytest.raises(ConfigError, match="file:// or s3://"):
        create_object_store("ftp://host/dir")
    with pytest.raises(ConfigError, match="threshold"):
        ClaimCheck(store, threshold=-1)


def test_object_names_round_trip_any_destination() -> None:
    identifier = uuid7()
    for destination in ("default", "partner.eu", "a_b", "../..", "é/ü", ".hidden"):
        name = object_name(identifier, destination)
        parsed = ObjectName.parse(name)
        assert parsed is not None, name
        assert (parsed.message_id, parsed.destination) == (str(identifier), destination)
        assert "/" not in name and not name.startswith(".")
