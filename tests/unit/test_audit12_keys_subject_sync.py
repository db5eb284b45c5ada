"""FileSubjectKeys: a writer never uses a secret whose directory entry may not be durable.

The creator fsyncs the directory after linking the secret's file. A writer that lost the
link race, or read a file created moments ago (its creator perhaps dead before its fsync),
used the secret at once: a power cut could then lose the secret of a message it had
committed. Such a writer now fsyncs the directory itself; a durable (old) file costs none.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from outboxer import crypto
from outboxer.crypto import FileSubjectKeys
from outboxer.durable import write_new_file


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The directories FileSubjectKeys fsyncs, in order."""
    synced: list[Path] = []
    real = crypto.sync_directory

    def spy(directory: Path) -> None:
        synced.append(Path(directory))
        real(directory)

    monkeypatch.setattr(crypto, "sync_directory", spy)
    return synced


def _planted(store: FileSubjectKeys, subject: str, secret: bytes, *, age: float = 0.0) -> Path:
    """The subject's file as another writer made it, without fsyncing the directory."""
    path = store._path(subject)
    write_new_file(path, secret)
    if age:
        past = time.time() - age
        os.utime(path, (past, past))
    return path


def test_the_loser_of_the_link_race_fsyncs_the_directory_before_using_the_secret(
    tmp_path: Path, syncs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileSubjectKeys(tmp_path)
    winner = b"w" * 32
    real_link = os.link

    def link_after_the_winner(source: object, target: object) -> None:
        _planted(store, "user-1", winner)  # the winner links first, its fsync not yet done
        real_link(source, target)  # type: ignore[arg-type]

    monkeypatch.setattr(crypto.os, "link", link_after_the_winner)
    assert store.get_or_create("user-1") == winner
    assert syncs == [tmp_path], "the loser made the winner's secret durable before using it"
    assert [p.name for p in tmp_path.iterdir()] == [store._path("user-1").name]


def test_a_young_secret_read_by_a_writer_is_made_durable_once(
    tmp_path: Path, syncs: list[Path]
) -> None:
    creator = FileSubjectKeys(tmp_path)
    secret = b"s" * 32
    _planted(creator, "user-1", secret)  # its creator died between link and fsync
    reader = FileSubjectKeys(tmp_path)
    assert reader.get_or_create("user-1") == secret
    assert syncs == [tmp_path]
    assert reader.get_or_create("user-1") == secret
    assert syncs == [tmp_path], "once per file and instance, not per message"


def test_a_secret_dated_in_the_future_counts_as_young(tmp_path: Path, syncs: list[Path]) -> None:
    store = FileSubjectKeys(tmp_path)
    _planted(store, "user-1", b"f" * 32, age=-3600)  # another host's clock, ahead
    store.get_or_create("user-1")
    assert syncs == [tmp_path]


def test_the_common_path_costs_no_fsync(tmp_path: Path, syncs: list[Path]) -> None:
    store = FileSubjectKeys(tmp_path)
    durable = b"d" * 32
    _planted(store, "old", durable, age=3600)
    for _ in range(3):
        assert store.get_or_create("old") == durable
        assert store.get("old") == durable
    assert syncs == []

    made = store.get_or_create("new")  # the creator fsyncs once, after its link ...
    assert syncs == [tmp_path]
    for _ in range(3):  # ... and its own reads of the young file need no more
        assert store.get_or_create("new") == made
    assert syncs == [tmp_path]


def test_a_shredded_and_recreated_subject_is_made_durable_again(
    tmp_path: Path, syncs: list[Path]
) -> None:
    store, other = FileSubjectKeys(tmp_path), FileSubjectKeys(tmp_path)
    first = store.get_or_create("user-1")
    assert other.get_or_create("user-1") == first
    assert other.delete("user-1")
    syncs.clear()
    path = _planted(other, "user-1", b"n" * 32)
    os.utime(path, ns=(time.time_ns() + 1_000_000, time.time_ns() + 1_000_000))
    assert store.get_or_create("user-1") == b"n" * 32
    assert syncs == [tmp_path]


def test_an_altered_file_is_still_refused(tmp_path: Path) -> None:
    store = FileSubjectKeys(tmp_path)
    store._path("user-1").write_bytes(b"x" * 33)
    with pytest.raises(crypto.EncryptionError, match="holds 33 bytes"):
        store.get_or_create("user-1")
