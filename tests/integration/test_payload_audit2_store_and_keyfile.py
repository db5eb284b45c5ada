"""Payload protection, second audit: a file store's put killed mid-way, a failing put, and a
key file that is not UTF-8."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from pathlib import Path

import pytest

from outboxer.claimcheck import FileObjectStore, ObjectName, object_name, sweep_orphans
from outboxer.crypto import (
    HEADER_ENCRYPTION,
    DecryptionError,
    FileSubjectKeys,
    KeyRing,
    decrypt,
    encrypt_message,
    generate_key,
)
from outboxer.durable import write_new_file
from outboxer.errors import ConfigError
from outboxer.message import JSON, Message, uuid7
from outboxer.payload_relay import PayloadHandling

_PUT_KILLED_BEFORE_RENAME = """
import os, signal, sys
from outboxer.claimcheck import FileObjectStore

store = FileObjectStore(sys.argv[1])
# The process dies after the temporary file is durable and before it is renamed: a kill -9
# (OOM killer, deploy) at that instant.
os.replace = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
store.put(sys.argv[2], b"x" * 1000)
"""


def _nothing_referenced(names: Sequence[ObjectName]) -> Collection[str]:
    return set()


def test_a_put_killed_before_its_rename_leaves_nothing_the_sweep_misses(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "claims")
    old_name = object_name("0193a5f2-0000-7000-8000-000000000001", "default")
    young_name = object_name("0193a5f2-0000-7000-8000-000000000002", "default")
    for name in (old_name, young_name):
        child = subprocess.run(
            [sys.executable, "-c", _PUT_KILLED_BEFORE_RENAME, str(store.directory), name],
            capture_output=True,
            timeout=30,
        )
        assert child.returncode == -signal.SIGKILL, child.stderr
    leftovers = sorted(p.name for p in store.directory.iterdir())
    assert leftovers == sorted([f".{old_name}.tmp", f".{young_name}.tmp"])
    then = time.time() - 7200
    os.utime(store.directory / f".{old_name}.tmp", (then, then))

    sweep_orphans(store, _nothing_referenced, grace=3600)

    # The old one can belong to no put still running (a put is inside the enqueue's
    # transaction, shorter than the grace); the young one may, and stays.
    assert sorted(p.name for p in store.directory.iterdir()) == [f".{young_name}.tmp"]


def test_a_put_whose_rename_fails_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileObjectStore(tmp_path / "claims")
    name = object_name("0193a5f2-0000-7000-8000-000000000003", "default")

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        store.put(name, b"y" * 1000)
    monkeypatch.undo()
    assert list(store.directory.iterdir()) == []


def test_a_key_file_that_is_not_utf8_is_a_config_error_without_its_content(
    tmp_path: Path,
) -> None:
    key = generate_key()
    path = tmp_path / "keys.toml"
    # A key file saved in Latin-1 by an editor: the key material sits next to the bad byte.
    path.write_bytes(f'[keys]\n"k1" = "{key}"\n# caf\xe9\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as raised:
        KeyRing.from_file(path)
    assert key not in str(raised.value)
    assert key not in repr(raised.value)
    # A traceback would print the UnicodeDecodeError, whose object is the whole file.
    assert raised.value.__cause__ is None
    assert raised.value.__suppress_context__ or raised.value.__context__ is None


_CREATE_KILLED_AFTER_LINK = """
import os, signal, sys
from pathlib import Path
from outboxer.crypto import FileSubjectKeys

keys = FileSubjectKeys(sys.argv[1])
# The process dies once the secret is linked to its name, before its temporary name is
# removed: a kill -9 at that instant.
Path.unlink = lambda self, missing_ok=False: os.kill(os.getpid(), signal.SIGKILL)
keys.get_or_create(sys.argv[2])
"""


def test_a_shred_leaves_no_copy_of_the_secret_after_a_create_killed_half_way(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "subjects"
    child = subprocess.run(
        [sys.executable, "-c", _CREATE_KILLED_AFTER_LINK, str(directory), "customer-42"],
        capture_output=True,
        timeout=30,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    keys = FileSubjectKeys(directory)
    secret = keys.get("customer-42")
    assert secret is not None

    assert keys.delete("customer-42") is True

    assert keys.get("customer-42") is None
    holding = [p.name for p in directory.iterdir() if p.read_bytes() == secret]
    assert holding == []  # shredded means no file anywhere still holds the secret


def test_a_write_whose_close_fails_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS and some FUSE file systems report a failed write-back (a full disk) at close."""
    real_close = os.close

    def close_reporting_enospc(descriptor: int) -> None:
        real_close(descriptor)
        raise OSError(28, "No space left on device")

    target = tmp_path / "object"
    monkeypatch.setattr(os, "close", close_reporting_enospc)
    with pytest.raises(OSError, match="No space left"):
        write_new_file(target, b"z" * 1000)
    monkeypatch.undo()
    assert not target.exists()


@pytest.mark.parametrize("mode", ["decrypt", "forward"])
async def test_ciphertext_whose_encryption_marker_was_removed_is_refused(mode: str) -> None:
    """A row or message altered to drop ``outboxer-encryption`` still carries its key id: it
    is refused, never handed on as if it were plaintext."""
    ring = KeyRing({"k1": generate_key()})
    plain = Message(
        id=uuid7(),
        topic="t",
        payload=b'{"card":"4111"}',
        key="k",
        headers={"h": "v"},
        content_type=JSON,
        destination="d",
    )
    sealed = encrypt_message(plain, ring)
    altered = dataclasses.replace(
        sealed, headers={n: v for n, v in sealed.headers.items() if n != HEADER_ENCRYPTION}
    )

    handling = PayloadHandling("d", mode="decrypt", keyring=ring)
    if mode == "decrypt":
        with pytest.raises(DecryptionError, match="outboxer-encryption"):
            await handling.prepare(altered)
    else:  # the relay forwards; the consumer's decrypt is the one to refuse
        forwarded = await PayloadHandling("d", mode="forward").prepare(altered)
        with pytest.raises(DecryptionError, match="outboxer-encryption"):
            decrypt(forwarded, ring)
