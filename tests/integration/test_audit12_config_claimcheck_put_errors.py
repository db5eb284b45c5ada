"""A claim-check put that fails at enqueue (a full disk for real: a 64 KiB tmpfs mounted by
the test; a read-only file system; S3 refusing the put on the moto server) raises one typed
error, ClaimCheckStoreError, still an OSError, naming the store and the object without its
secrets, and leaves nothing behind: no temporary file, no object, no outbox row."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import outboxer.claimcheck as claimcheck
from outboxer import Outbox
from outboxer.claimcheck import ClaimCheck, ClaimCheckError, FileObjectStore, create_object_store
from tests.s3 import CREDENTIALS, s3_bucket, s3_client, s3_server, s3_url  # noqa: F401

BIG = {"blob": "x" * 200_000}  # larger than the whole tmpfs


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs of this test's own, unmounted at the end."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def _make_read_only(mount_point: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)


def _rows(conn: psycopg.Connection[object]) -> int:
    (count,) = conn.execute("SELECT count(*) FROM outboxer.outbox").fetchone()  # type: ignore[misc]
    return int(count)


def _check_error(error: BaseException, store: object, expected_errno: int | None) -> None:
    assert isinstance(error, OSError)  # what callers caught before
    assert isinstance(error, ClaimCheckError), f"a bare {type(error).__name__}: {error}"
    assert isinstance(error, claimcheck.ClaimCheckStoreError)
    assert error.errno == expected_errno
    assert error.store == repr(store)
    assert error.object_name in str(error)
    assert repr(store) in str(error)
    claimcheck.ObjectStore.check_name(error.object_name)  # one of outboxer's object names
    copied = pickle.loads(pickle.dumps(error))  # a worker process's error reaches its parent
    assert (type(copied), str(copied), copied.errno) == (type(error), str(error), error.errno)
    assert (copied.store, copied.object_name) == (error.store, error.object_name)


@pytest.mark.parametrize("failure", ["full", "read-only"])
def test_enqueue_on_a_full_or_read_only_disk_raises_the_typed_error_and_leaves_nothing(
    pg_url: str, small_disk: Path, failure: str
) -> None:
    store = FileObjectStore(small_disk / "claims")
    if failure == "read-only":
        _make_read_only(small_disk)
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=1000))
    with psycopg.connect(pg_url) as conn:
        with pytest.raises(OSError) as raised:
            outbox.enqueue(conn, "report.ready", BIG)
        assert _rows(conn) == 0  # not even uncommitted, in the enqueue's own transaction
        conn.rollback()
    expected = errno.ENOSPC if failure == "full" else errno.EROFS
    _check_error(raised.value, store, expected)
    assert os.strerror(expected) in str(raised.value)
    assert list(store.directory.iterdir()) == []  # no temporary file, no object


async def test_enqueue_async_on_a_full_disk_raises_the_typed_error_and_leaves_nothing(
    pg_url: str, small_disk: Path
) -> None:
    store = FileObjectStore(small_disk / "claims")
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=1000))
    async with await psycopg.AsyncConnection.connect(pg_url) as conn:
        with pytest.raises(OSError) as raised:
            await outbox.enqueue_async(conn, "report.ready", BIG)
        (count,) = await (await conn.execute("SELECT count(*) FROM outboxer.outbox")).fetchone()  # type: ignore[misc]
        assert count == 0
        await conn.rollback()
    _check_error(raised.value, store, errno.ENOSPC)
    assert "No space left on device" in str(raised.value)
    assert list(store.directory.iterdir()) == []


def test_a_full_disk_after_earlier_objects_of_one_enqueue_leaves_none_of_them(
    pg_url: str, small_disk: Path
) -> None:
    """enqueue_many: the first payload fits, the second does not; the first's object, which
    no row will ever refer to, is deleted with the failure."""
    store = FileObjectStore(small_disk / "claims")
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=1000))
    fits = {"blob": "y" * 20_000}
    with psycopg.connect(pg_url) as conn:
        with pytest.raises(OSError) as raised:
            outbox.enqueue_many(
                conn, [{"topic": "t", "payload": fits}, {"topic": "t", "payload": BIG}]
            )
        assert _rows(conn) == 0
        conn.rollback()
    assert [p.name for p in store.directory.iterdir()] == []  # not the first's either
    _check_error(raised.value, store, errno.ENOSPC)


async def test_a_full_disk_in_enqueue_many_async_leaves_none_of_its_objects(
    pg_url: str, small_disk: Path
) -> None:
    """The puts run at once; the one that fits may finish after the one that fails: its
    object goes too."""
    store = FileObjectStore(small_disk / "claims")
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=1000))
    items = [{"topic": "t", "payload": {"blob": "y" * 20_000}}, {"topic": "t", "payload": BIG}]
    async with await psycopg.AsyncConnection.connect(pg_url) as conn:
        with pytest.raises(OSError) as raised:
            await outbox.enqueue_many_async(conn, items)
        await conn.rollback()
    assert [p.name for p in store.directory.iterdir()] == []
    _check_error(raised.value, store, errno.ENOSPC)


def test_an_s3_put_refused_raises_the_same_typed_error_without_the_secret(
    pg_url: str,
    s3_server: str,  # noqa: F811
    s3_client: object,  # noqa: F811
) -> None:
    missing_bucket = f"outboxer-missing-{uuid.uuid4().hex[:8]}"  # NoSuchBucket on the put
    store = create_object_store(s3_url(s3_server, missing_bucket))
    try:
        outbox = Outbox(claim_check=ClaimCheck(store, threshold=1000))
        with psycopg.connect(pg_url) as conn:
            with pytest.raises(OSError) as raised:
                outbox.enqueue(conn, "report.ready", BIG)
            assert _rows(conn) == 0
            conn.rollback()
    finally:
        store.close()
    _check_error(raised.value, store, None)
    assert "NoSuchBucket" in str(raised.value)
    assert CREDENTIALS["secret_access_key"] not in str(raised.value)
    assert CREDENTIALS["secret_access_key"] not in repr(raised.value)


async def test_an_s3_put_refused_in_enqueue_async_raises_the_same_typed_error(
    pg_url: str,
    s3_server: str,  # noqa: F811
    s3_client: object,  # noqa: F811
) -> None:
    store = create_object_store(s3_url(s3_server, f"outboxer-missing-{uuid.uuid4().hex[:8]}"))
    try:
        outbox = Outbox(claim_check=ClaimCheck(store, threshold=1000))
        async with await psycopg.AsyncConnection.connect(pg_url) as conn:
            with pytest.raises(OSError) as raised:
                await outbox.enqueue_async(conn, "report.ready", BIG)
            await conn.rollback()
    finally:
        store.close()
    _check_error(raised.value, store, None)


def test_an_application_store_raising_anything_is_the_typed_error_at_enqueue(
    pg_url: str, tmp_path: Path
) -> None:
    class Refusing(FileObjectStore):
        def put(self, name: str, data: bytes) -> None:
            raise RuntimeError("quota exceeded")

    store = Refusing(tmp_path / "claims")
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=1000))
    with psycopg.connect(pg_url) as conn:
        with pytest.raises(OSError) as raised:
            outbox.enqueue(conn, "report.ready", BIG)
        conn.rollback()
    _check_error(raised.value, store, None)
    assert "quota exceeded" in str(raised.value)
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_a_directory_sync_that_fails_after_the_rename_leaves_no_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object is in place but not known to survive a crash (an fsync of the directory
    reporting EIO): no row will refer to it, so it goes."""
    store = FileObjectStore(tmp_path / "claims")
    name = claimcheck.object_name("0193a5f2-0000-7000-8000-000000000012", "default")

    def failing_sync(directory: Path) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(claimcheck, "sync_directory", failing_sync)
    with pytest.raises(OSError) as raised:
        store.put(name, b"z" * 1000)
    monkeypatch.undo()
    assert list(store.directory.iterdir()) == []
    _check_error(raised.value, store, errno.EIO)
    assert raised.value.object_name == name  # type: ignore[attr-defined]
