"""Claim-check fetches against a hostile directory store and hand-written references: files
outside the store are never read, a planted FIFO never blocks, and a reference without the
size and digest outboxer always writes never reaches the store."""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from outboxer.claimcheck import (
    HEADER_CLAIM_CHECK,
    HEADER_CLAIM_CHECK_SHA256,
    HEADER_CLAIM_CHECK_SIZE,
    ClaimCheckError,
    FileObjectStore,
    ObjectMismatchError,
    ObjectName,
    create_object_store,
    fetch_payload,
    fetch_payload_async,
    object_name,
)
from outboxer.errors import ConfigError
from outboxer.message import BINARY, Message, uuid7

SECRET = b"root:$6$not-a-claim-check-object$:19000:0:99999:7:::\n"


def reference(name: str, data: bytes | None) -> Message:
    """A row as anyone with database access can write it: a reference to ``name``, with the
    size and digest of ``data`` (None: without them)."""
    parsed = ObjectName.parse(name)
    assert parsed is not None
    headers = {HEADER_CLAIM_CHECK: name}
    if data is not None:
        headers[HEADER_CLAIM_CHECK_SIZE] = str(len(data))
        headers[HEADER_CLAIM_CHECK_SHA256] = hashlib.sha256(data).hexdigest()
    return Message(
        id=uuid.UUID(parsed.message_id),
        topic="report.ready",
        payload=b"",
        headers=headers,
        content_type=BINARY,
    )


@pytest.fixture
def store(tmp_path: Path) -> FileObjectStore:
    return FileObjectStore(tmp_path / "claims")


def test_a_symlink_planted_under_an_objects_name_is_never_followed(
    store: FileObjectStore, tmp_path: Path
) -> None:
    outside = tmp_path / "shadow"
    outside.write_bytes(SECRET)
    name = object_name(uuid7(), "default")
    (store.directory / name).symlink_to(outside)
    # Even a forger who knows the file's digest gets nothing: the link itself is refused.
    with pytest.raises(ClaimCheckError, match="symbolic link"):
        fetch_payload(reference(name, SECRET), store)
    with pytest.raises(ClaimCheckError, match="symbolic link"):
        store.get(name)


async def test_a_symlink_is_refused_on_the_async_path_too(
    store: FileObjectStore, tmp_path: Path
) -> None:
    outside = tmp_path / "shadow"
    outside.write_bytes(SECRET)
    name = object_name(uuid7(), "default")
    (store.directory / name).symlink_to(outside)
    with pytest.raises(ClaimCheckError, match="symbolic link"):
        await fetch_payload_async(reference(name, SECRET), store)


class CountingStore(FileObjectStore):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.gets = 0

    def get(self, name: str) -> bytes:
        self.gets += 1
        return super().get(name)


def test_a_reference_without_size_and_digest_is_refused_before_the_store(
    tmp_path: Path,
) -> None:
    store = CountingStore(tmp_path / "claims")
    name = object_name(uuid7(), "default")
    store.put(name, b"x" * 1000)
    for missing in (HEADER_CLAIM_CHECK_SIZE, HEADER_CLAIM_CHECK_SHA256):
        forged = reference(name, b"x" * 1000)
        headers = {k: v for k, v in forged.headers.items() if k != missing}
        with pytest.raises(ObjectMismatchError, match="without its size and SHA-256"):
            fetch_payload(replace(forged, headers=headers), store)
    with pytest.raises(ObjectMismatchError, match="without its size and SHA-256"):
        fetch_payload(reference(name, None), store)
    assert store.gets == 0, "a reference outboxer did not write never reaches the store"
    # The genuine reference still fetches.
    assert fetch_payload(reference(name, b"x" * 1000), store).payload == b"x" * 1000


@pytest.fixture
def fifo_name(store: FileObjectStore) -> Iterator[str]:
    name = object_name(uuid7(), "default")
    path = store.directory / name
    os.mkfifo(path)
    yield name
    # Old code blocks in open() until a writer comes: be that writer, so its thread ends.
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no reader waiting: nothing to release
        return
    os.close(descriptor)


def test_a_fifo_planted_under_an_objects_name_never_blocks_a_fetch(
    store: FileObjectStore, fifo_name: str
) -> None:
    outcome: list[BaseException | bytes] = []
    done = threading.Event()

    def fetch() -> None:
        try:
            outcome.append(fetch_payload(reference(fifo_name, b""), store).payload)
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)
        done.set()

    threading.Thread(target=fetch, daemon=True).start()
    # A bound on a failure, not a synchronisation: the fixed fetch returns at once.
    assert done.wait(10), "the fetch blocked on a FIFO planted in the store"
    [result] = outcome
    assert isinstance(result, ClaimCheckError) and "not a regular file" in str(result)


def test_a_name_with_a_trailing_newline_is_not_outboxers() -> None:
    name = object_name(uuid7(), "default")
    assert ObjectName.parse(name) is not None
    assert ObjectName.parse(name + "\n") is None
    with pytest.raises(ClaimCheckError):
        FileObjectStore.check_name(name + "\n")


def test_a_password_in_the_s3_endpoint_url_never_appears_in_the_stores_errors() -> None:
    password = "Endpoint-Passw0rd-7f3a"
    url = f"s3://bucket/claims?endpoint_url=http://minio:{password}@127.0.0.1:9000&region_=x"
    with pytest.raises(ConfigError) as raised:
        create_object_store(url)
    assert "unknown options" in str(raised.value)
    assert password not in str(raised.value)
