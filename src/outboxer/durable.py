"""Files that survive a crash once written: for claim-check objects and subject secrets."""

from __future__ import annotations

import os
from pathlib import Path


def write_new_file(path: Path, data: bytes) -> None:
    """Create ``path`` (mode 0600; an existing file is an error), write ``data``, fsync it.

    On failure the partial file is removed and the error raised.
    """
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            os.fsync(descriptor)
        finally:
            # close can fail too (NFS reports a failed write-back there): the file is then
            # not known to hold ``data``, and must not stay.
            os.close(descriptor)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def sync_directory(directory: Path) -> None:
    """fsync a directory, so that a file created, renamed or deleted in it stays so."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
