"""The relay's -wal truncation looks at the -wal file SQLite writes, wherever the URL points.

SQLite names the -wal file after the database's full path with symbolic links resolved
(unix VFS), and opens a relative path once, from the directory current at the time.
``SqliteStore.bound_wal`` read ``<path as configured>-wal`` instead: for a database reached
through a symbolic link (a volume mounted or linked into place, a ``current`` link to a
release directory) or by a relative path after the process changed directory, that file
does not exist, so the relay measured 0 bytes, never truncated the real -wal file, and its
gauge ``outboxer_sqlite_wal_bytes`` said 0 while the file kept a burst's tens of MB.
Now the file is the one SQLite names (``PRAGMA database_list``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

import outboxer
from outboxer.stores.sqlite import SqliteStore, sqlite_path

NEAR_ZERO = 256 * 1024
#: sqlite.WAL_TRUNCATE_ABOVE
WAL_TRUNCATE_ABOVE = 8 * 1024 * 1024


def wal_size(path: Path) -> int:
    wal = Path(str(path) + "-wal")
    return wal.stat().st_size if wal.exists() else 0


@pytest.fixture
def real_database(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[Path, sqlite3.Connection]]:
    """The database in a directory of its own, and the application's connection to it
    (open all along: SQLite deletes the -wal file when the last connection closes), after
    a burst that grew the -wal file past the bound."""
    real = tmp_path / "real"
    real.mkdir()
    path = real / "outbox.db"
    Path(sqlite_path(sqlite_url)).rename(path)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE ledger (id INTEGER PRIMARY KEY, entry BLOB NOT NULL)")
    conn.executemany("INSERT INTO ledger (entry) VALUES (?)", [(bytes(4096),) for _ in range(3000)])
    outboxer.enqueue(conn, "audit17.walpath", {"n": 1})
    conn.commit()
    assert wal_size(path) > WAL_TRUNCATE_ABOVE
    yield path, conn
    conn.close()


async def bound(url: str) -> tuple[int | None, SqliteStore]:
    store = outboxer.create_store(url)
    assert isinstance(store, SqliteStore)
    await store.connect()
    return await store.bound_wal(), store


async def test_a_database_reached_through_a_symbolic_link(
    real_database: tuple[Path, sqlite3.Connection], tmp_path: Path
) -> None:
    path, _ = real_database
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "outbox.db").symlink_to(path)
    size, store = await bound(f"sqlite:///{linked / 'outbox.db'}")
    try:
        assert wal_size(path) < NEAR_ZERO, f"the real -wal file kept {wal_size(path)} bytes"
        assert size == wal_size(path)
    finally:
        await store.close()


async def test_a_relative_path_after_the_process_changed_directory(
    real_database: tuple[Path, sqlite3.Connection],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, _ = real_database
    monkeypatch.chdir(path.parent)
    store = outboxer.create_store("sqlite:///outbox.db")
    assert isinstance(store, SqliteStore)
    try:
        await store.connect()
        monkeypatch.chdir(tmp_path)  # a daemon's chdir, after the relay opened the database
        size = await store.bound_wal()
        assert wal_size(path) < NEAR_ZERO, f"the real -wal file kept {wal_size(path)} bytes"
        assert size == wal_size(path)
    finally:
        await store.close()


async def test_an_in_memory_database_has_no_wal_to_bound() -> None:
    store = outboxer.create_store("sqlite:///:memory:")
    assert isinstance(store, SqliteStore)
    try:
        await store.apply_schema()
        assert await store.bound_wal() == 0
    finally:
        await store.close()
