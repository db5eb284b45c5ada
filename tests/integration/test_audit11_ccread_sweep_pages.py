"""The orphan sweep goes through the store's listing a page at a time: it asks which names
are referenced, and deletes, before listing further, so a huge store is never held in
memory whole. Sync and async."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from outboxer.claimcheck import (
    FileObjectStore,
    ObjectName,
    StoredObject,
    object_name,
    sweep_orphans,
    sweep_orphans_async,
)
from outboxer.errors import ConfigError
from outboxer.message import uuid7

OBJECTS = 2000
BATCH = 100


class CountingStore(FileObjectStore):
    """Counts how far the listing went."""

    listed = 0

    def list_objects(self) -> Iterator[StoredObject]:
        for stored in super().list_objects():
            self.listed += 1
            yield stored


def planted(tmp_path: Path) -> CountingStore:
    store = CountingStore(tmp_path / "claims")
    old = 1_000_000_000.0
    for _ in range(OBJECTS):
        path = store.directory / object_name(uuid7(), "default")
        path.write_bytes(b"o")
        os.utime(path, (old, old))
    (store.directory / "not-outboxers.txt").write_bytes(b"kept")
    return store


def test_the_sweep_asks_and_deletes_a_page_before_listing_on(tmp_path: Path) -> None:
    store = planted(tmp_path)
    listed_at_first_question: list[int] = []
    kept: set[str] = set()

    def referenced(names: Sequence[ObjectName]) -> list[str]:
        assert len(names) <= BATCH
        listed_at_first_question.append(store.listed)
        kept.add(names[0].name)  # one referenced name per page stays
        return [names[0].name]

    deleted = sweep_orphans(store, referenced, grace=60, batch=BATCH)
    assert listed_at_first_question[0] <= BATCH + 1, listed_at_first_question[:3]
    assert deleted == OBJECTS - len(kept)
    assert sorted(os.listdir(store.directory)) == sorted([*kept, "not-outboxers.txt"])


async def test_the_async_sweep_asks_and_deletes_a_page_before_listing_on(tmp_path: Path) -> None:
    store = planted(tmp_path)
    listed_at_first_question: list[int] = []

    async def referenced(names: Sequence[ObjectName]) -> list[str]:
        assert len(names) <= BATCH
        listed_at_first_question.append(store.listed)
        return []

    deleted = await sweep_orphans_async(store, referenced, grace=60, batch=BATCH)
    assert listed_at_first_question[0] <= BATCH + 1, listed_at_first_question[:3]
    assert deleted == OBJECTS
    assert os.listdir(store.directory) == ["not-outboxers.txt"]


async def test_a_failing_question_stops_the_async_sweep_and_closes_the_listing(
    tmp_path: Path,
) -> None:
    store = planted(tmp_path)

    async def referenced(names: Sequence[ObjectName]) -> list[str]:
        raise RuntimeError("database gone")

    with pytest.raises(RuntimeError, match="database gone"):
        await sweep_orphans_async(store, referenced, grace=60, batch=BATCH)
    assert store.listed <= BATCH + 1
    assert len(os.listdir(store.directory)) == OBJECTS + 1  # nothing deleted unasked


def test_a_batch_below_one_is_refused(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "claims")
    with pytest.raises(ConfigError, match="batch"):
        sweep_orphans(store, lambda names: [], batch=0)
