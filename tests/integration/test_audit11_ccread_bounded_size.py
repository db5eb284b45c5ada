"""Claim-check fetches read at most the size the message declares (+1 byte): a planted or
corrupted huge object is refused as a mismatch without being read whole into memory, from a
directory store and from S3."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import pytest

from outboxer.claimcheck import (
    HEADER_CLAIM_CHECK,
    HEADER_CLAIM_CHECK_SHA256,
    HEADER_CLAIM_CHECK_SIZE,
    FileObjectStore,
    ObjectMismatchError,
    ObjectName,
    ObjectStore,
    S3ObjectStore,
    fetch_payload,
    fetch_payload_async,
    object_name,
)
from outboxer.message import BINARY, Message, uuid7
from tests.s3 import CREDENTIALS, REGION, s3_bucket, s3_client, s3_server  # noqa: F401

DECLARED = b"x" * 1024
HUGE = 64 * 1024 * 1024


def reference(name: str, data: bytes, *, size: str | None = None) -> Message:
    parsed = ObjectName.parse(name)
    assert parsed is not None
    return Message(
        id=uuid.UUID(parsed.message_id),
        topic="report.ready",
        payload=b"",
        headers={
            HEADER_CLAIM_CHECK: name,
            HEADER_CLAIM_CHECK_SIZE: str(len(data)) if size is None else size,
            HEADER_CLAIM_CHECK_SHA256: hashlib.sha256(data).hexdigest(),
        },
        content_type=BINARY,
    )


def plant_huge(store: FileObjectStore) -> str:
    """A 64 MiB object (sparse: no disk used) where the message says 1 KiB."""
    name = object_name(uuid7(), "default")
    with open(store.directory / name, "wb") as file:
        file.truncate(HUGE)
    return name


def test_a_huge_file_is_refused_without_being_read_whole(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "claims")
    name = plant_huge(store)
    tracemalloc.start()
    try:
        with pytest.raises(ObjectMismatchError):
            fetch_payload(reference(name, DECLARED), store)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024, f"peak {peak} bytes while refusing a 1 KiB reference"


async def test_a_huge_file_is_refused_without_being_read_whole_async(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "claims")
    name = plant_huge(store)
    tracemalloc.start()
    try:
        with pytest.raises(ObjectMismatchError):
            await fetch_payload_async(reference(name, DECLARED), store)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024, f"peak {peak} bytes while refusing a 1 KiB reference"


def test_a_file_of_the_declared_size_still_reads(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "claims")
    data = os.urandom(300_000)
    name = object_name(uuid7(), "default")
    store.put(name, data)
    assert fetch_payload(reference(name, data), store).payload == data
    assert store.get_at_most(name, len(data)) == data
    with pytest.raises(ObjectMismatchError):
        store.get_at_most(name, len(data) - 1)


def test_a_terabyte_declared_size_reads_only_what_the_file_holds(tmp_path: Path) -> None:
    # The bound comes from a header: a forged one must not make the read allocate it.
    store = FileObjectStore(tmp_path / "claims")
    data = b"small"
    name = object_name(uuid7(), "default")
    store.put(name, data)
    assert store.get_at_most(name, 1 << 40) == data


class CountingStore(FileObjectStore):
    reads = 0

    def get_at_most(self, name: str, max_size: int) -> bytes:
        self.reads += 1
        return super().get_at_most(name, max_size)

    def get(self, name: str) -> bytes:
        self.reads += 1
        return super().get(name)


@pytest.mark.parametrize("size", ["01024", "+1024", "1e3", " 1024", "1024\n", "-1", "١٠٢٤"])
def test_a_size_that_is_no_byte_count_is_refused_before_the_store(
    tmp_path: Path, size: str
) -> None:
    store = CountingStore(tmp_path / "claims")
    name = object_name(uuid7(), "default")
    store.put(name, DECLARED)
    with pytest.raises(ObjectMismatchError, match="not a byte count"):
        fetch_payload(reference(name, DECLARED, size=size), store)
    assert store.reads == 0


class OldStyleStore(ObjectStore):
    """A store written before get_at_most: the fallback still checks the bound."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put(self, name: str, data: bytes) -> None:
        self.objects[name] = data

    def get(self, name: str) -> bytes:
        return self.objects[name]

    def delete(self, name: str) -> bool:
        return self.objects.pop(name, None) is not None

    def list_objects(self) -> Any:
        return iter(())


def test_a_store_without_get_at_most_is_still_bounded_by_the_check() -> None:
    store = OldStyleStore()
    name = object_name(uuid7(), "default")
    store.put(name, DECLARED + b"y")
    with pytest.raises(ObjectMismatchError, match="more than 1024 bytes"):
        fetch_payload(reference(name, DECLARED), store)


def test_a_huge_s3_object_is_refused_without_reading_its_body(
    s3_server: str,  # noqa: F811
    s3_bucket: str,  # noqa: F811
) -> None:
    store = S3ObjectStore(
        s3_bucket, prefix="claims", endpoint_url=s3_server, region=REGION, **CREDENTIALS
    )
    try:
        name = object_name(uuid7(), "default")
        store.put(name, b"z" * (8 * 1024 * 1024))
        read: list[int] = []
        get_object = store.client.get_object

        def counting_get_object(**kwargs: Any) -> Any:
            response = get_object(**kwargs)
            body = response["Body"]
            original = body.read

            def counting_read(amt: int | None = None) -> bytes:
                chunk: bytes = original(amt)
                read.append(len(chunk))
                return chunk

            body.read = counting_read
            return response

        store.client.get_object = counting_get_object
        with pytest.raises(ObjectMismatchError):
            fetch_payload(reference(name, DECLARED), store)
        assert sum(read) <= len(DECLARED) + 1, f"read {sum(read)} bytes of the body"
        # An object of the declared size still comes back whole.
        data = os.urandom(5000)
        good = object_name(uuid7(), "default")
        store.put(good, data)
        assert fetch_payload(reference(good, data), store).payload == data
    finally:
        store.close()
