"""Claim-check: a payload above a threshold goes to an object store; the row carries a reference.

Brokers cap message sizes (RabbitMQ's default 128 MiB frame is generous, Kafka's 1 MiB and
NATS's 1 MiB are not) and a database full of megabyte payloads vacuums slowly. So a large
payload is written to an object store (a directory, or S3-compatible storage) *before* the
row is inserted, and the row, then the published message, hold an empty payload and these
headers:

- ``outboxer-claim-check``: the object's name, ``<message id>.<destination>.<random>``
  (the destination percent-encoded, with ``.`` and ``_`` too). One object per row: two
  destinations of a message may hold different bytes (each is encrypted for its own
  destination). The random part means a put never overwrites another's object, not even
  when an ``enqueue`` with an id already in the outbox fails on the duplicate.
- ``outboxer-claim-check-size`` and ``outboxer-claim-check-sha256``: checked by the consumer
  on fetch, so a truncated or swapped object is an error, never a wrong payload. Both are
  required: a reference without them (a row forged by hand) is refused, so a fetch only
  ever returns bytes whose digest the row's writer already knew.
- ``outboxer-claim-check-content-type``: the payload's content type; the message itself
  says ``application/octet-stream`` until the payload is fetched.

An object whose row never committed (the transaction rolled back after the put) is an
orphan: :func:`sweep_orphans` deletes objects older than a grace period that no row
references. The grace period must exceed the longest transaction that enqueues, or a
sweep could delete the object of a row about to commit. Retention deletes a row's object
with the row.

A consumer that dead-letters a claim-checked message records a *hold* on its object in the
store itself (:meth:`ObjectStore.put_hold`: a small marker, ``.holds/<object>.<holder>``),
before the dead letter commits; the sweep never deletes a held object, and replaying or
purging the dead letter releases the hold once that has committed. The consumer's database
may be another than the outbox's: the store is the one place both sides see. A crash
between the steps keeps an object too long, never loses one.

With encryption, the object holds the ciphertext (encrypt first, then offload), so the
object store never holds the plaintext of an encrypted outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from outboxer.durable import sync_directory, write_new_file
from outboxer.errors import ConfigError, MissingDependencyError, OutboxerError, PayloadError
from outboxer.message import BINARY, Message
from outboxer.redact import (
    Log,
    get_logger,
    redact_text,
    redact_url,
    register_secret,
    register_url_secrets,
)

logger = get_logger("outboxer.claimcheck")

HEADER_CLAIM_CHECK = "outboxer-claim-check"
HEADER_CLAIM_CHECK_SIZE = "outboxer-claim-check-size"
HEADER_CLAIM_CHECK_SHA256 = "outboxer-claim-check-sha256"
HEADER_CLAIM_CHECK_CONTENT_TYPE = "outboxer-claim-check-content-type"
CLAIM_CHECK_HEADERS = frozenset(
    {
        HEADER_CLAIM_CHECK,
        HEADER_CLAIM_CHECK_SIZE,
        HEADER_CLAIM_CHECK_SHA256,
        HEADER_CLAIM_CHECK_CONTENT_TYPE,
    }
)

#: Payloads larger than this (bytes, as stored: after encryption) are offloaded by default.
DEFAULT_THRESHOLD = 256 * 1024
#: An object younger than this is never swept: its transaction may still commit.
DEFAULT_SWEEP_GRACE = 3600.0
#: A claim-check put not answered within this many seconds fails the enqueue.
DEFAULT_PUT_TIMEOUT = 30.0
#: A claim-check read an operator's command makes (``replay``, ``keys rotate``) not
#: answered within this many seconds fails it (``claim_check_read_timeout``).
DEFAULT_READ_TIMEOUT = 30.0
#: Bounded puts of one ClaimCheck whose threads may run at once (answered or not): past it, a
#: put fails at once (errno EBUSY). A healthy put lasts milliseconds, so even 50 writers
#: each putting 10 objects a second into a 100 ms S3 keep about 50 in flight; a hung store
#: holds each thread, with its payload (over the threshold: 256 KiB or more), until it
#: answers, so the cap bounds what a hang costs to 64 threads and 64 payloads.
DEFAULT_MAX_UNANSWERED_PUTS = 64
#: Puts of one ``offload_all_async`` batch started at once, well under the cap above: a
#: batch of many large messages never takes every slot by itself.
BATCH_PUTS = 16
#: A sweep gives up a call to the store (a listing page, ``held``, a delete) not answered
#: within this many seconds (``outboxer claim-check sweep`` and the relay's cleanup pass
#: ``claim_check_read_timeout``).
DEFAULT_SWEEP_CALL_TIMEOUT = 30.0
#: Sweep calls to stores that may run at once in the process (``delete_many_bounded``'s and
#: ``close_store``'s too). A sweep that times out leaves one call hung and ends; once this
#: many are, sweeps fail at once until one returns (the relay makes a new store for each
#: sweep, so the bound is the process's, not a store's).
SWEEP_THREADS = 4

#: Where holds live in a store: a name no object has (objects never start with a dot).
HOLDS = ".holds"

#: ``<uuid>.<encoded destination>.<16 hex>``: anything else in a store is not outboxer's.
_NAME = re.compile(
    r"^(?P<id>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
    r"\.(?P<destination>[A-Za-z0-9%~-]+)\.(?P<token>[0-9a-f]{16})$"
)


class ClaimCheckError(OutboxerError):
    """A claim-checked payload cannot be stored or fetched as it should."""


class ObjectNotFoundError(ClaimCheckError):
    """The object a message refers to is not in the store (deleted by retention or a sweep)."""


class ObjectMismatchError(ClaimCheckError):
    """The object's size or SHA-256 is not what the message says: it was altered or swapped."""


class ObjectReadTimeoutError(ClaimCheckError, TimeoutError):
    """The store did not answer a read in time (a hung NFS mount, a stalled S3 connection):
    the same read may succeed later."""


class ObjectDeleteTimeoutError(ClaimCheckError, TimeoutError):
    """The store did not answer a delete in time, or was not asked because earlier calls
    to object stores are still unanswered (:func:`delete_many_bounded`). The objects may
    or may not be gone: those no row refers to are the orphan sweep's."""


class HoldTimeoutError(ClaimCheckError, TimeoutError):
    """The object store did not put (or delete) a claim-check hold within its timeout: as
    a failed hold, the dead letter that needed it is not written (retried later)."""


class ClaimCheckSweepTimeoutError(ClaimCheckError, TimeoutError):
    """A claim-check sweep gave up: the object store did not answer one of its calls in
    time (or calls of earlier sweeps are still unanswered). What it deleted before stays
    deleted (``deleted``); the next sweep starts over."""

    def __init__(self, message: str, *, deleted: int = 0) -> None:
        super().__init__(message)
        self.deleted = deleted

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ClaimCheckStoreError(ClaimCheckError, OSError):
    """A claim-check store could not store an object: a full disk (``errno`` ENOSPC), a
    permission, S3 refusing or not answering the put. Nothing is left under the object's
    name and the enqueue wrote no row; the transaction is the caller's to roll back.

    An OSError too (``errno`` is the file system's, None for S3), so code that caught the
    OSError of a failed put still does. ``store`` is the store's description (its URL's
    secrets masked), ``object_name`` the object's name.
    """

    def __init__(
        self, message: str, *, store: str = "", object_name: str = "", errno: int | None = None
    ) -> None:
        super().__init__(message)
        self.errno = errno
        self.strerror = message
        self.store = store
        self.object_name = object_name

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        # OSError's would drop errno (its slot, not in __dict__) across a process boundary.
        return (type(self), self.args, {**self.__dict__, "errno": self.errno})

    @classmethod
    def of_put(cls, store: ObjectStore, name: str, exc: BaseException) -> ClaimCheckStoreError:
        """The error of ``store``'s put of ``name`` that failed with ``exc``."""
        if isinstance(exc, OSError) and exc.strerror:
            reason = exc.strerror  # not str(exc): its file name is the temporary file's
        else:
            reason = str(exc) or type(exc).__name__
        errno_ = exc.errno if isinstance(exc, OSError) else None
        return cls(
            f"claim-check store {store!r} could not store object {name}: {redact_text(reason)}",
            store=repr(store),
            object_name=name,
            errno=errno_,
        )


def encode_destination(destination: str) -> str:
    """Percent-encoding with ``.``, ``_`` and ``~`` encoded too, so ``.`` separates the
    parts of an object name and no name starts with a dot."""
    return quote(destination, safe="").replace(".", "%2E").replace("_", "%5F")


def object_name(message_id: object, destination: str) -> str:
    """A new, never reused, object name for one row."""
    return f"{message_id}.{encode_destination(destination)}.{secrets.token_hex(8)}"


@dataclass(frozen=True)
class ObjectName:
    """An object name taken apart; :meth:`parse` refuses anything outboxer did not make."""

    name: str
    message_id: str
    destination: str

    @classmethod
    def parse(cls, name: str) -> ObjectName | None:
        # fullmatch: ``$`` alone also matches before a trailing newline.
        match = _NAME.fullmatch(name)
        if match is None:
            return None
        return cls(name, match.group("id"), unquote(match.group("destination")))


def hold_name(name: str, holder: str) -> str:
    """The name of ``holder``'s hold on object ``name`` (within the store's holds): one
    per holder (a consumer group), so each releases only its own."""
    ObjectStore.check_name(name)
    return f"{name}.{hashlib.sha256(holder.encode()).hexdigest()[:16]}"


def held_object(hold: str) -> str | None:
    """The object a hold's name (:func:`hold_name`) holds; None for anything else."""
    name, _, digest = hold.rpartition(".")
    if len(digest) != 16 or ObjectName.parse(name) is None:
        return None
    return name


@dataclass(frozen=True)
class StoredObject:
    name: str
    #: Unix time of the last write.
    modified: float


# ----- the ObjectStore port -------------------------------------------------------------------


class ObjectStore(ABC):
    """Bytes by name. Sync methods are the primitives; the async ones run them in a thread
    (both kinds of enqueue, the relay and consumers all use one store)."""

    @abstractmethod
    def put(self, name: str, data: bytes) -> None:
        """Store ``data`` durably under ``name`` before returning."""

    @abstractmethod
    def get(self, name: str) -> bytes:
        """The object's bytes; raises ObjectNotFoundError."""

    def get_at_most(self, name: str, max_size: int) -> bytes:
        """The object's bytes; ObjectMismatchError when it holds more than ``max_size``
        bytes. The consumer reads through this with the size the message declares, so a
        planted or corrupted huge object is refused after ``max_size + 1`` bytes rather than
        read whole into memory. Stores override it; this fallback reads the object whole
        (a store written before this method existed)."""
        data = self.get(name)
        if len(data) > max_size:
            raise _too_large(name, max_size)
        return data

    @abstractmethod
    def delete(self, name: str) -> bool:
        """Delete the object; True if it existed. Deleting a missing object is not an error."""

    def delete_many(self, names: Sequence[str]) -> None:
        """Delete these objects (missing ones are no error), in as few requests as the store
        allows."""
        for name in names:
            self.delete(name)

    @abstractmethod
    def list_objects(self) -> Iterator[StoredObject]:
        """Every object of this store (outboxer's or not: callers filter with ObjectName)."""

    def delete_leftovers(self, cutoff: float) -> int:
        """Delete what puts that died half-way left behind, older than ``cutoff`` (Unix
        time); how many. Most stores' puts are atomic and leave nothing."""
        return 0

    def close(self) -> None:  # noqa: B027 -- most stores hold nothing to close
        """Release connections (S3's pool); the store is not used afterwards."""

    # Holds: an object somebody outside the outbox table still needs (a consumer's dead
    # letter refers to it) is kept by the sweep, whatever the rows say.

    def put_hold(self, name: str, holder: str) -> None:
        """Record, durably before returning, that ``holder`` needs object ``name``: the
        sweep keeps it until :meth:`delete_hold`. Putting a hold twice is no error. A store
        without holds raises NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} keeps no claim-check holds")

    def delete_hold(self, name: str, holder: str) -> None:
        """Release ``holder``'s hold on ``name`` (a missing hold is no error)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no claim-check holds")

    def held(self) -> set[str]:
        """The names of the objects some holder still holds."""
        return set()

    async def put_hold_async(self, name: str, holder: str) -> None:
        await asyncio.to_thread(self.put_hold, name, holder)

    async def delete_hold_async(self, name: str, holder: str) -> None:
        await asyncio.to_thread(self.delete_hold, name, holder)

    @staticmethod
    def check_name(name: str) -> ObjectName:
        """The parsed name; ClaimCheckError for one outboxer never makes (``../etc`` from a
        forged header never reaches a path or a bucket key)."""
        parsed = ObjectName.parse(name)
        if parsed is None:
            raise ClaimCheckError(f"{name!r} is not an outboxer claim-check object name")
        return parsed

    async def put_async(self, name: str, data: bytes) -> None:
        await asyncio.to_thread(self.put, name, data)

    async def get_async(self, name: str) -> bytes:
        return await asyncio.to_thread(self.get, name)

    async def get_at_most_async(self, name: str, max_size: int) -> bytes:
        return await asyncio.to_thread(self.get_at_most, name, max_size)

    async def delete_async(self, name: str) -> bool:
        return await asyncio.to_thread(self.delete, name)

    async def delete_many_async(self, names: Sequence[str]) -> None:
        await asyncio.to_thread(self.delete_many, names)

    async def list_objects_async(self) -> list[StoredObject]:
        return await asyncio.to_thread(lambda: list(self.list_objects()))


class FileObjectStore(ObjectStore):
    """Objects as files in one directory (``file:///var/lib/app/claim-checks``).

    A put writes a temporary file, fsyncs it, renames it into place and fsyncs the
    directory: once ``put`` returns, a crash cannot lose the object whose row commits next.
    Files are 0600 and the directory 0700 when created here.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, name: str) -> Path:
        self.check_name(name)
        return self.directory / name

    def put(self, name: str, data: bytes) -> None:
        """Raises ClaimCheckStoreError (an OSError) on a full disk or any other OS error,
        leaving neither the temporary file nor the object behind."""
        path = self._path(name)
        temporary = self.directory / f".{name}.tmp"
        try:
            write_new_file(temporary, data)  # removes its file on failure
            try:
                os.replace(temporary, path)
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
            try:
                sync_directory(self.directory)
            except BaseException:
                # Not known to survive a crash: no row will refer to it, and none must.
                path.unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise ClaimCheckStoreError.of_put(self, name, exc) from exc

    def get(self, name: str) -> bytes:
        return self._read(name, None)

    def get_at_most(self, name: str, max_size: int) -> bytes:
        return self._read(name, max_size)

    def _read(self, name: str, max_size: int | None) -> bytes:
        # Only a regular file put wrote: O_NOFOLLOW refuses a symbolic link planted under an
        # object's name (it could point anywhere: /etc/shadow, another store), O_NONBLOCK
        # keeps a planted FIFO from blocking the open for ever, and fstat refuses it, a
        # device or a directory before any read.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            descriptor = os.open(self._path(name), flags)
        except FileNotFoundError:
            raise ObjectNotFoundError(
                f"claim-check object {name} is not in {self.directory}"
            ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ClaimCheckError(
                    f"claim-check object {name} in {self.directory} is a symbolic link, "
                    "not an object outboxer wrote"
                ) from None
            raise
        with open(descriptor, "rb") as file:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                raise ClaimCheckError(
                    f"claim-check object {name} in {self.directory} is not a regular file"
                )
            if max_size is None:
                return file.read()
            # One byte past the limit tells "larger" without reading the rest. Capped by the
            # file's size too: read(n) allocates n bytes first, and the limit comes from a
            # header a forged row may set to a terabyte.
            data = file.read(min(max_size, status.st_size) + 1)
            if len(data) > max_size:
                raise _too_large(name, max_size)
            return data

    def delete(self, name: str) -> bool:
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            return False
        return True

    def put_hold(self, name: str, holder: str) -> None:
        hold = hold_name(name, holder)
        holds = self.directory / HOLDS  # hidden from list_objects: a dot and a directory
        if not holds.is_dir():
            holds.mkdir(mode=0o700, exist_ok=True)
            sync_directory(self.directory)
        temporary = holds / f".{hold}.{secrets.token_hex(4)}.tmp"
        write_new_file(temporary, b"")
        try:
            os.replace(temporary, holds / hold)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        sync_directory(holds)

    def delete_hold(self, name: str, holder: str) -> None:
        holds = self.directory / HOLDS
        try:
            (holds / hold_name(name, holder)).unlink()
        except FileNotFoundError:
            return
        sync_directory(holds)

    def held(self) -> set[str]:
        try:
            entries = os.scandir(self.directory / HOLDS)
        except FileNotFoundError:
            return set()
        with entries:
            found = (held_object(entry.name) for entry in entries)
            return {name for name in found if name is not None}

    def list_objects(self) -> Iterator[StoredObject]:
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                    continue
                try:
                    modified = entry.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:  # deleted while listing
                    continue
                yield StoredObject(entry.name, modified)

    def delete_leftovers(self, cutoff: float) -> int:
        # A put killed (kill -9, OOM) between its write and its rename leaves its temporary
        # file, which list_objects hides. A put runs inside the enqueue's transaction, so one
        # older than the sweep's grace is dead, and its file would stay forever.
        deleted = 0
        with os.scandir(self.directory) as entries:
            for entry in entries:
                name = entry.name
                if not (name.startswith(".") and name.endswith(".tmp")):
                    continue
                if ObjectName.parse(name[1:-4]) is None:
                    continue  # not one of outboxer's temporary files
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    if entry.stat(follow_symlinks=False).st_mtime >= cutoff:
                        continue
                    os.unlink(entry.path)
                except FileNotFoundError:  # renamed or deleted meanwhile
                    continue
                deleted += 1
        return deleted

    def __repr__(self) -> str:
        return f"FileObjectStore({str(self.directory)!r})"


class S3ObjectStore(ObjectStore):
    """Objects in an S3 bucket (or any S3-compatible server: MinIO, Ceph, R2…) under ``prefix``.

    ``s3://bucket/prefix/?endpoint_url=http://127.0.0.1:9000&region=eu-west-1``. Credentials
    come from boto3's usual chain (environment, profile, instance role) unless given as
    ``access_key_id`` and ``secret_access_key``. A put returns once S3 answered 200: S3's
    writes are durable and read-after-write consistent.
    """

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        client: Any = None,
    ) -> None:
        if not bucket:
            raise ConfigError("an S3 claim-check store needs a bucket: s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url
        if client is None:
            try:
                import boto3
            except ImportError:
                raise MissingDependencyError("boto3", "s3") from None
            register_url_secrets(endpoint_url)
            register_secret(secret_access_key)
            client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=region,
                aws_access_key_id=access_key_id,
                aws_secret_access_key=secret_access_key,
            )
        self.client = client

    def _key(self, name: str) -> str:
        self.check_name(name)
        return self.prefix + name

    def put(self, name: str, data: bytes) -> None:
        """Raises ClaimCheckStoreError when S3 refuses or does not answer the put (S3
        stores an object whole or not at all)."""
        key = self._key(name)
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        except Exception as exc:
            raise ClaimCheckStoreError.of_put(self, name, exc) from exc

    def _get_object(self, name: str) -> dict[str, Any]:
        """GetObject's response (its body not read yet); a missing key is ObjectNotFoundError."""
        try:
            response: dict[str, Any] = self.client.get_object(
                Bucket=self.bucket, Key=self._key(name)
            )
        except Exception as exc:
            if _s3_error_code(exc) in ("NoSuchKey", "404"):
                raise ObjectNotFoundError(
                    f"claim-check object {name} is not in s3://{self.bucket}/{self.prefix}"
                ) from None
            raise
        return response

    def get(self, name: str) -> bytes:
        body: bytes = self._get_object(name)["Body"].read()
        return body

    def get_at_most(self, name: str, max_size: int) -> bytes:
        response = self._get_object(name)
        stream = response["Body"]
        try:
            # The length S3 announces refuses a larger object before any of its body is
            # read; reading one byte past the limit covers a server that announces none.
            length = response.get("ContentLength")
            if isinstance(length, int) and length > max_size:
                raise _too_large(name, max_size)
            limit = min(max_size, length) if isinstance(length, int) else max_size
            body: bytes = stream.read(limit + 1)
        finally:
            # Unread bytes stay in the socket: closing drops that connection from the pool
            # rather than draining a huge body into nowhere.
            stream.close()
        if len(body) > max_size:
            raise _too_large(name, max_size)
        return body

    def delete(self, name: str) -> bool:
        # S3's DeleteObject answers 204 whether or not the key existed; a HEAD first tells.
        key = self._key(name)
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            if _s3_error_code(exc) in ("NoSuchKey", "404"):
                return False
            raise
        self.client.delete_object(Bucket=self.bucket, Key=key)
        return True

    def delete_many(self, names: Sequence[str]) -> None:
        """One DeleteObjects request per 1,000 objects."""
        for start in range(0, len(names), 1000):
            chunk = names[start : start + 1000]
            response = self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": self._key(name)} for name in chunk], "Quiet": True},
            )
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise ClaimCheckError(
                    f"S3 refused to delete {len(errors)} object(s), first {first.get('Key')}: "
                    f"{first.get('Code')} {first.get('Message')}"
                )

    def _hold_key(self, name: str, holder: str) -> str:
        return f"{self.prefix}{HOLDS}/{hold_name(name, holder)}"

    def put_hold(self, name: str, holder: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._hold_key(name, holder), Body=b"")

    def delete_hold(self, name: str, holder: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._hold_key(name, holder))

    def held(self) -> set[str]:
        # A key of the holds' prefix never parses as an object's name: list_objects'
        # callers skip them.
        prefix = f"{self.prefix}{HOLDS}/"
        found: set[str] = set()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                name = held_object(item["Key"][len(prefix) :])
                if name is not None:
                    found.add(name)
        return found

    def list_objects(self) -> Iterator[StoredObject]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for item in page.get("Contents", []):
                yield StoredObject(
                    item["Key"][len(self.prefix) :], item["LastModified"].timestamp()
                )

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        where = f" at {redact_url(self.endpoint_url)}" if self.endpoint_url else ""
        return f"S3ObjectStore('s3://{self.bucket}/{self.prefix}'{where})"


def _too_large(name: str, max_size: int) -> ObjectMismatchError:
    return ObjectMismatchError(f"claim-check object {name} holds more than {max_size} bytes")


def _s3_error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        error = response.get("Error") or {}
        code = error.get("Code")
        return str(code) if code is not None else None
    return None


def create_object_store(url: str) -> ObjectStore:
    """``file:///absolute/dir``, ``file://relative/dir`` or ``s3://bucket/prefix?options``
    (options: ``endpoint_url``, ``region``, ``access_key_id``, ``secret_access_key``)."""
    register_url_secrets(url)
    parts = urlsplit(url)
    if parts.scheme == "file":
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise ConfigError("a file claim-check store needs a directory: file:///path/to/dir")
        try:
            return FileObjectStore(path)
        except ValueError:  # a NUL or a lone surrogate: no file system can name it
            raise ConfigError(
                f"claim-check store {redact_url(url)!r}: {path!r} is not a usable directory path"
            ) from None
    if parts.scheme == "s3":
        options = dict(parse_qsl(parts.query))
        # The endpoint is a URL inside the query: its password is no query value that
        # register_url_secrets above knows, and every error below quotes the store's URL.
        register_url_secrets(options.get("endpoint_url"))
        unknown = set(options) - {"endpoint_url", "region", "access_key_id", "secret_access_key"}
        if unknown:
            raise ConfigError(
                f"claim-check store {redact_url(url)}: unknown options {sorted(unknown)}"
            )
        return S3ObjectStore(
            parts.netloc,
            prefix=unquote(parts.path),
            endpoint_url=options.get("endpoint_url"),
            region=options.get("region"),
            access_key_id=options.get("access_key_id"),
            secret_access_key=options.get("secret_access_key"),
        )
    raise ConfigError(f"claim-check store must be a file:// or s3:// URL; got {redact_url(url)!r}")


# ----- messages -------------------------------------------------------------------------------


def is_claim_checked(message: Message) -> bool:
    return HEADER_CLAIM_CHECK in message.headers


@dataclass(frozen=True)
class ClaimCheck:
    """Offload payloads larger than ``threshold`` bytes to ``store`` (call before the INSERT).

    A put runs inside the caller's open transaction, holding its row locks: ``put_timeout``
    (seconds, None for no bound) gives it up with ClaimCheckStoreError (``errno``
    ETIMEDOUT) when the store has not answered by then (a hung NFS mount, an S3 endpoint
    that accepts and never answers). Nothing interrupts the put itself: it goes on in a
    daemon thread, and its object, if it lands after all, is deleted then (or by the sweep).

    ``max_unanswered_puts`` caps those threads (in flight or given up, until the store
    answers): a put that finds them all running fails at once with ClaimCheckStoreError
    (``errno`` EBUSY), writing nothing, so a store that hangs costs a bounded number of
    threads, not one per enqueue.
    """

    store: ObjectStore
    threshold: int = DEFAULT_THRESHOLD
    put_timeout: float | None = DEFAULT_PUT_TIMEOUT
    max_unanswered_puts: int = DEFAULT_MAX_UNANSWERED_PUTS
    _put_slots: _Slots = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int):
            raise ConfigError("claim-check threshold must be a whole number of bytes")
        if self.threshold < 0:
            raise ConfigError("claim-check threshold must not be negative")
        if self.put_timeout is not None and not self.put_timeout > 0:  # NaN too
            raise ConfigError("claim-check put_timeout must be positive (or None)")
        if (
            isinstance(self.max_unanswered_puts, bool)
            or not isinstance(self.max_unanswered_puts, int)
            or self.max_unanswered_puts < 1
        ):
            raise ConfigError("claim-check max_unanswered_puts must be a whole number, at least 1")
        # Per ClaimCheck: replace() makes a new one, with slots of its own.
        object.__setattr__(self, "_put_slots", _Slots(self.max_unanswered_puts))

    def needs_offload(self, message: Message) -> bool:
        return len(message.payload) > self.threshold

    def _reference(self, message: Message) -> tuple[str, Message]:
        if any(name in CLAIM_CHECK_HEADERS for name in message.headers):
            raise PayloadError(
                f"message {message.id} already carries outboxer claim-check headers; "
                "they are outboxer's own and cannot be given"
            )
        name = object_name(message.id, message.destination)
        headers = {
            **message.headers,
            HEADER_CLAIM_CHECK: name,
            HEADER_CLAIM_CHECK_SIZE: str(len(message.payload)),
            HEADER_CLAIM_CHECK_SHA256: hashlib.sha256(message.payload).hexdigest(),
            HEADER_CLAIM_CHECK_CONTENT_TYPE: message.content_type,
        }
        return name, replace(message, payload=b"", content_type=BINARY, headers=headers)

    def offload(self, message: Message) -> Message:
        """``message`` with its payload in the store and a reference in its headers, or
        ``message`` itself when the payload is small enough. The object is durable on return."""
        if not self.needs_offload(message):
            return message
        return self.offload_always(message)

    def offload_always(self, message: Message) -> Message:
        """:meth:`offload` whatever the payload's size (a row already sized for a reference,
        as ``outboxer keys rotate`` rewrites), within this ClaimCheck's ``put_timeout`` and
        ``max_unanswered_puts``: a ClaimCheck made per message would have a cap of its own
        each, and a hung store one thread per message."""
        name, reference = self._reference(message)
        try:
            if self.put_timeout is None:
                self.store.put(name, message.payload)
            else:
                _put_within(self.store, name, message.payload, self.put_timeout, self._put_slots)
        except OutboxerError:
            raise  # ClaimCheckStoreError from outboxer's stores, or a bad name
        except Exception as exc:  # a store of the application's own raises what it likes
            raise ClaimCheckStoreError.of_put(self.store, name, exc) from exc
        return reference

    async def offload_async(self, message: Message) -> Message:
        if not self.needs_offload(message):
            return message
        name, reference = self._reference(message)
        try:
            if self.put_timeout is None:
                await self.store.put_async(name, message.payload)
            else:
                await _put_within_async(
                    self.store, name, message.payload, self.put_timeout, self._put_slots
                )
        except OutboxerError:
            raise  # ClaimCheckStoreError from outboxer's stores, or a bad name
        except Exception as exc:  # a store of the application's own raises what it likes
            raise ClaimCheckStoreError.of_put(self.store, name, exc) from exc
        return reference

    def offload_all(self, messages: Sequence[Message]) -> list[Message]:
        """:meth:`offload` of each message; when one fails, the objects of those before it,
        which no row will refer to, are deleted (as far as the store lets) before the error
        is raised."""
        done: list[Message] = []
        try:
            for message in messages:
                done.append(self.offload(message))
        except BaseException:
            self._forget(done)
            raise
        return done

    async def offload_all_async(self, messages: Sequence[Message]) -> list[Message]:
        """:meth:`offload_async` of the messages, BATCH_PUTS at a time; as
        :meth:`offload_all`, the others' objects are deleted when one fails."""
        started = asyncio.Semaphore(BATCH_PUTS)

        async def offload_one(message: Message) -> Message:
            async with started:
                return await self.offload_async(message)

        results = await asyncio.gather(*(offload_one(m) for m in messages), return_exceptions=True)
        done = [r for r in results if isinstance(r, Message)]
        for result in results:
            if isinstance(result, BaseException):
                await asyncio.to_thread(self._forget, done)
                raise result
        return done

    def _forget(self, offloaded: Sequence[Message]) -> None:
        names = references(offloaded)
        if not names:
            return
        try:
            self.store.delete_many(names)
        except Exception as exc:  # noqa: BLE001 -- the sweep deletes them later
            logger.warning(
                "could not delete %d claim-check object(s) of a failed enqueue from %r (the "
                "orphan sweep will): %s",
                len(names),
                self.store,
                exc,
            )


class _Put:
    """One bounded put, run in a daemon thread: if its caller gave up before it finished,
    the object it stored anyway is deleted, since no row will ever refer to it."""

    def __init__(self, store: ObjectStore, name: str, data: bytes) -> None:
        self.store = store
        self.name = name
        self.data = data
        self.lock = threading.Lock()
        self.finished = False
        self.abandoned = False

    def __call__(self) -> None:
        try:
            self.store.put(self.name, self.data)
        except BaseException:
            with self.lock:
                self.finished = True
            raise
        with self.lock:
            self.finished = True
            abandoned = self.abandoned
        if abandoned:
            self.store.delete(self.name)

    def give_up(self) -> bool:
        """True when the put had not finished: it will clean up after itself."""
        with self.lock:
            self.abandoned = not self.finished
            return self.abandoned

    def timed_out(self, timeout: float) -> ClaimCheckStoreError:
        return ClaimCheckStoreError(
            f"claim-check store {self.store!r} could not store object {self.name}: "
            f"no answer within {timeout:g} s (put_timeout)",
            store=repr(self.store),
            object_name=self.name,
            errno=errno.ETIMEDOUT,
        )

    def busy(self, slots: _Slots) -> ClaimCheckStoreError:
        return ClaimCheckStoreError(
            f"claim-check store {self.store!r} could not store object {self.name}: "
            f"{slots.taken} puts to the object store are still unanswered "
            f"(max_unanswered_puts {slots.limit}); not tried",
            store=repr(self.store),
            object_name=self.name,
            errno=errno.EBUSY,
        )


def _put_within(store: ObjectStore, name: str, data: bytes, timeout: float, slots: _Slots) -> None:
    """``store.put`` given up after ``timeout`` seconds: in a daemon thread, so a hung put
    neither holds the caller's transaction for ever nor keeps the process from exiting. The
    thread holds one of ``slots`` until it ends; with none free, the put fails at once."""
    put = _Put(store, name, data)
    if not slots.take():
        raise put.busy(slots)
    outcome: list[BaseException | None] = []
    done = threading.Event()

    def work() -> None:
        try:
            put()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 -- raised in the waiting caller
            outcome.append(exc)
        finally:
            slots.give_back()  # after the late object's delete too: the thread is done
            done.set()

    try:
        threading.Thread(target=work, name="outboxer-claim-check-put", daemon=True).start()
    except BaseException:
        slots.give_back()
        raise
    if not done.wait(timeout) and put.give_up():
        raise put.timed_out(timeout)
    done.wait()  # finished just as the wait ended: its outcome is moments away
    if outcome[0] is not None:
        raise outcome[0]


async def _put_within_async(
    store: ObjectStore, name: str, data: bytes, timeout: float, slots: _Slots
) -> None:
    """:func:`_put_within` for async callers, in a daemon thread holding one of ``slots``
    (none free: fails at once); a store that overrides ``put_async`` starts no thread of
    outboxer's and is awaited within the same bound."""
    put = _Put(store, name, data)
    if type(store).put_async is not ObjectStore.put_async:
        call: Awaitable[None] = store.put_async(name, data)
    else:
        if not slots.take():
            raise put.busy(slots)
        call = in_daemon_thread(put, slots.give_back, "outboxer-claim-check-put")
    task = asyncio.ensure_future(call)
    try:
        finished, _ = await asyncio.wait((task,), timeout=timeout)
    except BaseException:
        task.cancel()
        raise
    if not finished and put.give_up():
        task.cancel()
        raise put.timed_out(timeout)
    await task


def _restore(message: Message, data: bytes) -> Message:
    name = message.headers[HEADER_CLAIM_CHECK]
    size = message.headers[HEADER_CLAIM_CHECK_SIZE]  # both there: see _checked_reference
    digest = message.headers[HEADER_CLAIM_CHECK_SHA256]
    if size != str(len(data)):
        raise ObjectMismatchError(
            f"claim-check object {name} holds {len(data)} bytes; message {message.id} says {size}"
        )
    if hashlib.sha256(data).hexdigest() != digest:
        raise ObjectMismatchError(
            f"claim-check object {name} does not match the SHA-256 message {message.id} carries"
        )
    headers = {
        name: value for name, value in message.headers.items() if name not in CLAIM_CHECK_HEADERS
    }
    content_type = message.headers.get(HEADER_CLAIM_CHECK_CONTENT_TYPE, BINARY)
    return replace(message, payload=data, content_type=content_type, headers=headers)


_SIZE = re.compile(r"0|[1-9][0-9]{0,19}")


def _checked_reference(message: Message) -> tuple[str, int]:
    name = message.headers[HEADER_CLAIM_CHECK]
    parsed = ObjectStore.check_name(name)
    if parsed.message_id != str(message.id):
        # A message may only fetch its own object, never another message's.
        raise ClaimCheckError(
            f"message {message.id} refers to claim-check object {name} of another message"
        )
    if HEADER_CLAIM_CHECK_SIZE not in message.headers or (
        HEADER_CLAIM_CHECK_SHA256 not in message.headers
    ):
        # ClaimCheck always writes both. Without them any readable object would do, so a
        # hand-written row could have a consumer fetch bytes nobody vouched for; checked
        # before the store is touched.
        raise ObjectMismatchError(
            f"message {message.id} refers to claim-check object {name} without its size "
            "and SHA-256: not a reference outboxer wrote"
        )
    size = message.headers[HEADER_CLAIM_CHECK_SIZE]
    if _SIZE.fullmatch(size) is None:
        # ClaimCheck writes str(len(payload)); no object can match anything else, and the
        # read below is bounded by this number.
        raise ObjectMismatchError(
            f"message {message.id} declares claim-check size {size!r:.40}: not a byte count"
        )
    return name, int(size)


def fetch_payload(message: Message, store: ObjectStore, *, timeout: float | None = None) -> Message:
    """The message with its claim-checked payload fetched, checked (size, SHA-256) and
    restored, with its content type; a message without a claim-check comes back unchanged.

    Raises ObjectNotFoundError, ObjectMismatchError or ClaimCheckError (a reference that
    is not outboxer's, or another message's). If the outbox encrypts, decrypt afterwards:
    ``outboxer.decrypt(fetch_payload(message, store), keyring)``.

    With ``timeout`` (seconds), a read the store has not answered by then raises
    ObjectReadTimeoutError: it runs in a daemon thread holding one of the store's read
    slots (the ones :func:`fetch_payload_async` takes), left to finish when given up. A
    synchronous caller cannot wait for a slot within its bound as an async one does, so
    with all READ_THREADS of them held by unanswered reads it fails at once, not tried.
    """
    if not is_claim_checked(message):
        return message
    name, size = _checked_reference(message)
    if timeout is None:
        return _restore(message, store.get_at_most(name, size))
    if not timeout > 0:  # NaN too
        raise ConfigError("the claim-check read timeout must be positive (or None)")
    reads = _read_threads(store)
    if not reads.take_now():
        raise ObjectReadTimeoutError(
            f"claim-check object {name}: {store!r} not read: {reads.running} read(s) of it "
            "are still unanswered"
        )
    outcome = _within(
        lambda: store.get_at_most(name, size), timeout, reads.release, "outboxer-claim-check-read"
    )
    if outcome is None:
        raise ObjectReadTimeoutError(
            f"claim-check object {name}: {store!r} did not answer within {timeout:g} s "
            f"({reads.running} read(s) of it still running)"
        )
    answered, result = outcome
    if not answered:
        raise result
    return _restore(message, result)


async def fetch_payload_async(
    message: Message, store: ObjectStore, *, timeout: float | None = None
) -> Message:
    """:func:`fetch_payload` for async callers. With ``timeout`` (seconds), a read the
    store has not answered by then raises ObjectReadTimeoutError; its thread, which nothing
    can interrupt, is left to finish (see _ReadThreads)."""
    if not is_claim_checked(message):
        return message
    name, size = _checked_reference(message)
    if timeout is None:
        return _restore(message, await store.get_at_most_async(name, size))
    reads = _read_threads(store)
    data = await _bounded(
        reads.run(lambda: store.get_at_most(name, size)),
        timeout,
        lambda: ObjectReadTimeoutError(
            f"claim-check object {name}: {store!r} did not answer within {timeout:g} s "
            f"({reads.running} read(s) of it still running)"
        ),
    )
    return _restore(message, data)


#: Reads of one store that may run at once in fetch_payload_async with a timeout (holds,
#: put_hold_bounded and delete_hold_bounded, share them: a hung store hangs both; puts and
#: sweeps have slots of their own, and fail at once rather than wait for one).
READ_THREADS = 16

_T = TypeVar("_T")


async def put_hold_bounded(store: ObjectStore, name: str, holder: str, *, timeout: float) -> None:
    """:meth:`ObjectStore.put_hold_async`, given up after ``timeout`` seconds with
    HoldTimeoutError: in a daemon thread of the store's _ReadThreads (a hung store, such as
    a dead NFS mount, then neither stalls its caller for ever nor keeps the program from
    exiting); a store that overrides ``put_hold_async`` is awaited within the same bound."""
    if type(store).put_hold_async is not ObjectStore.put_hold_async:
        await _bounded_hold(store, store.put_hold_async(name, holder), timeout, f"holding {name}")
        return
    reads = _read_threads(store)
    run = reads.run(lambda: store.put_hold(name, holder))
    await _bounded_hold(store, run, timeout, f"holding {name}", reads)


async def delete_hold_bounded(
    store: ObjectStore, name: str, holder: str, *, timeout: float
) -> None:
    """:meth:`ObjectStore.delete_hold_async` bounded as :func:`put_hold_bounded`."""
    if type(store).delete_hold_async is not ObjectStore.delete_hold_async:
        await _bounded_hold(
            store, store.delete_hold_async(name, holder), timeout, f"releasing the hold on {name}"
        )
        return
    reads = _read_threads(store)
    run = reads.run(lambda: store.delete_hold(name, holder))
    await _bounded_hold(store, run, timeout, f"releasing the hold on {name}", reads)


async def _bounded_hold(
    store: ObjectStore,
    call: Awaitable[None],
    timeout: float,
    what: str,
    reads: _ReadThreads | None = None,
) -> None:
    def timed_out() -> HoldTimeoutError:
        running = "" if reads is None else f" ({reads.running} call(s) of it still running)"
        return HoldTimeoutError(
            f"claim-check {what}: {store!r} did not answer within {timeout:g} s{running}"
        )

    await _bounded(call, timeout, timed_out)


async def _bounded(call: Awaitable[_T], timeout: float, timed_out: Callable[[], Exception]) -> _T:
    """``call``'s result, or ``timed_out()`` raised after ``timeout`` seconds. asyncio.wait,
    not wait_for: a TimeoutError the call itself raises (a socket's) is the store's answer,
    not this deadline."""
    task = asyncio.ensure_future(call)
    try:
        finished, _ = await asyncio.wait((task,), timeout=timeout)
    except BaseException:  # this caller cancelled: the call goes with it
        task.cancel()
        raise
    if not finished:
        task.cancel()  # gives up its wait for a slot, or leaves its thread to finish
        raise timed_out()
    return task.result()


class _ReadThreads:
    """Runs a store's reads in daemon threads, at most ``limit`` at once.

    A read that hangs (a hard NFS mount that stopped answering) cannot be cancelled: when
    its caller gives up, its thread is left to finish and keeps its slot until then, so hung
    reads never add up to more than ``limit`` threads; further reads wait for a slot within
    their own timeout. Daemon threads, and not a pool's: a pool's threads are joined at
    exit (asyncio's default executor's at the end of ``asyncio.run``), so a single hung
    read would keep a stopped consumer from ever exiting.
    """

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._free = limit
        self._limit = limit
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    @property
    def running(self) -> int:
        with self._lock:
            return self._limit - self._free

    async def run(self, read: Callable[[], _T]) -> _T:
        await self._acquire(asyncio.get_running_loop())
        return await in_daemon_thread(read, self._release, "outboxer-claim-check-read")

    def take_now(self) -> bool:
        """A slot for a synchronous caller, without waiting: False when none is free (or
        async readers queue for one: they come first). Given back with :meth:`release`."""
        with self._lock:
            if self._free > 0 and not self._waiters:
                self._free -= 1
                return True
            return False

    def release(self) -> None:
        self._release()

    async def _acquire(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._free > 0 and not self._waiters:
                self._free -= 1
                return
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            with self._lock:
                try:
                    self._waiters.remove((loop, waiter))
                    granted = False
                except ValueError:  # a finished read handed its slot over meanwhile
                    granted = True
            if granted:
                self._release()  # to the next waiter: this caller no longer reads
            raise

    def _release(self) -> None:
        """Give the slot to the longest waiter, or back (any thread)."""
        with self._lock:
            while self._waiters:
                loop, waiter = self._waiters.popleft()
                try:
                    loop.call_soon_threadsafe(_grant, waiter)
                except RuntimeError:  # its loop is closed: nobody waits there any more
                    continue
                return
            self._free += 1


class _Slots:
    """A count of daemon threads that may run at once, taken without waiting: a caller that
    finds none free fails at once rather than queue behind calls a hung store may never
    answer. A thread gives its slot back when its call returns, however late."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self.limit = limit
        self._taken = 0

    @property
    def taken(self) -> int:
        with self._lock:
            return self._taken

    def take(self) -> bool:
        with self._lock:
            if self._taken >= self.limit:
                return False
            self._taken += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self._taken -= 1


def in_daemon_thread(
    call: Callable[[], _T], release: Callable[[], None] | None, thread_name: str
) -> Awaitable[_T]:
    """``call()`` in a daemon thread, its outcome awaited: unlike ``asyncio.to_thread``,
    nothing joins the thread at exit (``asyncio.run`` joins the default executor's). If
    the caller holds a slot for it, ``release`` gives it back when the call returns.
    Awaiting may be given up (a timeout, a cancellation): the thread goes on, holding its
    slot, and its outcome is dropped."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def work() -> None:
        try:
            outcome: _T | BaseException = call()
        except BaseException as exc:  # noqa: BLE001 -- handed to the waiting caller
            outcome = exc
        finally:
            if release is not None:
                release()
        _settle(loop, done, outcome)

    try:
        threading.Thread(target=work, name=thread_name, daemon=True).start()
    except BaseException:
        if release is not None:
            release()
        raise
    return done


def _grant(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
    # Cancelled already: its caller found itself out of the queue and passed the slot on.


def _settle(
    loop: asyncio.AbstractEventLoop, done: asyncio.Future[_T], outcome: _T | BaseException
) -> None:
    def settle() -> None:
        if done.done():  # the caller gave up (timed out, cancelled)
            return
        if isinstance(outcome, BaseException):
            done.set_exception(outcome)
        else:
            done.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # a closed loop: its caller is long gone
        loop.call_soon_threadsafe(settle)


_read_threads_lock = threading.Lock()
_read_threads_of: weakref.WeakKeyDictionary[ObjectStore, _ReadThreads] = weakref.WeakKeyDictionary()


_shared_read_threads = _ReadThreads(READ_THREADS)


def _read_threads(store: ObjectStore) -> _ReadThreads:
    # One set per store: a hung directory store does not take the slots of an S3 one.
    with _read_threads_lock:
        try:
            reads = _read_threads_of.get(store)
            if reads is None:
                reads = _read_threads_of[store] = _ReadThreads(READ_THREADS)
        except TypeError:  # a store class that is not hashable (a plain @dataclass)
            return _shared_read_threads
        return reads


def references(messages: Sequence[Message]) -> list[str]:
    """The object names ``messages`` refer to."""
    return [m.headers[HEADER_CLAIM_CHECK] for m in messages if HEADER_CLAIM_CHECK in m.headers]


# ----- orphans --------------------------------------------------------------------------------

#: Given object names, answer the subset some outbox row still refers to.
Referenced = Callable[[Sequence[ObjectName]], Collection[str]]
ReferencedAsync = Callable[[Sequence[ObjectName]], Awaitable[Collection[str]]]


def _candidate_pages(
    objects: Iterator[StoredObject], grace: float, now: float | None, batch: int
) -> Generator[list[ObjectName], None, None]:
    """outboxer's objects older than the grace, ``batch`` at a time, as the listing goes: a
    store of millions of objects is never held in memory whole. Deleting a page before the
    listing goes on is safe: a directory listing may or may not show a deleted entry again
    (deleting a missing object is no error), and S3 continues after the last key listed."""
    cutoff = (time.time() if now is None else now) - grace
    page: list[ObjectName] = []
    for stored in objects:
        parsed = ObjectName.parse(stored.name)
        if parsed is not None and stored.modified < cutoff:
            page.append(parsed)
            if len(page) >= batch:
                yield page
                page = []
    if page:
        yield page


def _check_grace(grace: float) -> None:
    if grace < 0:
        raise ConfigError("the claim-check sweep's grace period must not be negative")


def _check_batch(batch: int) -> None:
    if batch < 1:
        raise ConfigError("the claim-check sweep's batch must be at least 1")


def _delete_leftovers(store: ObjectStore, grace: float, now: float | None, log: Log) -> None:
    leftovers = store.delete_leftovers((time.time() if now is None else now) - grace)
    if leftovers:
        log.info("claim-check sweep deleted %d leftover(s) of interrupted puts", leftovers)


#: The sweeps' store calls running in the process, answered or not (see SWEEP_THREADS).
_sweep_slots = _Slots(SWEEP_THREADS)
_sweep_failures_lock = threading.Lock()
_sweep_failures = 0


def sweep_failures() -> int:
    """How many sweeps of this process gave up on a store that did not answer in time."""
    with _sweep_failures_lock:
        return _sweep_failures


class _SweepCalls:
    """One sweep's calls to its store, each given up after ``timeout`` seconds (None: no
    bound, in the caller's thread). A call runs in a daemon thread holding one of the
    process's sweep slots: a hung one is left behind, which neither keeps the process from
    exiting nor, past SWEEP_THREADS, adds threads (further sweeps fail at once)."""

    def __init__(self, store: ObjectStore, timeout: float | None, log: Log | None) -> None:
        if timeout is not None and not timeout > 0:  # NaN too
            raise ConfigError("the claim-check sweep's call timeout must be positive (or None)")
        self.store = store
        self.timeout = timeout
        self.log = logger if log is None else log
        self.deleted = 0

    def busy(self, what: str) -> ClaimCheckSweepTimeoutError:
        return self.failed(
            f"claim-check sweep of {self.store!r} not {what}: {_sweep_slots.taken} calls of "
            "earlier sweeps to object stores are still unanswered"
        )

    def timed_out(self, what: str) -> ClaimCheckSweepTimeoutError:
        return self.failed(
            f"claim-check sweep of {self.store!r} gave up {what}: no answer within "
            f"{self.timeout:g} s ({self.deleted} object(s) deleted before)"
        )

    def failed(self, message: str) -> ClaimCheckSweepTimeoutError:
        global _sweep_failures
        with _sweep_failures_lock:
            _sweep_failures += 1
        self.log.warning("%s; the next sweep tries again", message)
        return ClaimCheckSweepTimeoutError(message, deleted=self.deleted)

    def call(self, what: str, call: Callable[[], _T]) -> _T:
        if self.timeout is None:
            return call()
        if not _sweep_slots.take():
            raise self.busy(what)
        outcome = _in_sweep_thread(call, self.timeout)
        if outcome is None:
            raise self.timed_out(what)
        answered, result = outcome
        if not answered:
            raise result
        return result  # type: ignore[no-any-return]

    async def call_async(self, what: str, call: Callable[[], _T]) -> _T:
        if self.timeout is None:
            return await asyncio.to_thread(call)
        if not _sweep_slots.take():
            raise self.busy(what)
        running = in_daemon_thread(call, _sweep_slots.give_back, "outboxer-claim-check-sweep")
        return await _bounded(running, self.timeout, lambda: self.timed_out(what))


def _in_sweep_thread(call: Callable[[], _T], timeout: float) -> tuple[bool, Any] | None:
    """``call()`` in a daemon thread holding a sweep slot the caller took: see _within."""
    return _within(call, timeout, _sweep_slots.give_back, "outboxer-claim-check-sweep")


def _within(
    call: Callable[[], _T], timeout: float, release: Callable[[], None], thread_name: str
) -> tuple[bool, Any] | None:
    """``call()`` in a daemon thread holding a slot the caller took (``release`` gives it
    back when the call returns, however late): (True, its result) or (False, its
    exception), or None when it has not returned within ``timeout`` seconds (the thread
    goes on)."""
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def work() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 -- raised in the waiting caller
            outcome.append((False, exc))
        finally:
            release()
            done.set()

    try:
        threading.Thread(target=work, name=thread_name, daemon=True).start()
    except BaseException:
        release()
        raise
    if not done.wait(timeout):
        return None
    return outcome[0]


def delete_many_bounded(store: ObjectStore, names: Sequence[str], *, timeout: float | None) -> None:
    """``store.delete_many(names)`` given up after ``timeout`` seconds (None: no bound, in
    the caller's thread) with ObjectDeleteTimeoutError, as a sweep's calls are: in a daemon
    thread holding one of the process's SWEEP_THREADS slots, so hung deletes add up to no
    more threads than hung sweeps do, and with none free the delete fails at once, not
    tried. An error of the delete itself is raised."""
    names = list(names)  # the thread may outlive the caller's list
    if not names:
        return
    if timeout is None:
        store.delete_many(names)
        return
    if not timeout > 0:  # NaN too
        raise ConfigError("the claim-check delete timeout must be positive (or None)")
    if not _sweep_slots.take():
        raise ObjectDeleteTimeoutError(
            f"claim-check store {store!r}: {len(names)} object(s) not deleted: "
            f"{_sweep_slots.taken} calls of sweeps or deletes to object stores are still "
            "unanswered"
        )
    outcome = _within(
        lambda: store.delete_many(names),
        timeout,
        _sweep_slots.give_back,
        "outboxer-claim-check-delete",
    )
    if outcome is None:
        raise ObjectDeleteTimeoutError(
            f"claim-check store {store!r} did not delete {len(names)} object(s) within "
            f"{timeout:g} s"
        )
    answered, result = outcome
    if not answered:
        raise result


def run_bounded(
    call: Callable[[], object], *, timeout: float, what: str, log: Log | None = None
) -> bool:
    """``call()`` given up after ``timeout`` seconds, in a daemon thread holding one of the
    sweep slots (as :func:`delete_many_bounded`): True once it returned; False, with a logged
    warning naming ``what``, when it did not answer in time (the thread goes on) or was not
    tried (SWEEP_THREADS calls to object stores are still unanswered). An error of the call
    is raised. For an operator's calls after a commit (releasing holds), which a hung store
    must not keep from returning: the command, or a web request of Django's admin."""
    if not timeout > 0:  # NaN too
        raise ConfigError("the claim-check store's call timeout must be positive")
    log = logger if log is None else log
    if not _sweep_slots.take():
        log.warning(
            "%s: not tried, %d calls to object stores are still unanswered",
            what,
            _sweep_slots.taken,
        )
        return False
    outcome = _within(call, timeout, _sweep_slots.give_back, "outboxer-claim-check-call")
    if outcome is None:
        log.warning("%s: no answer within %g s; left to finish in the background", what, timeout)
        return False
    answered, result = outcome
    if not answered:
        raise result
    return True


def close_store(store: ObjectStore, *, timeout: float | None, log: Log | None = None) -> bool:
    """``store.close()``, given up after ``timeout`` seconds (None: no bound) as a sweep's
    calls are, in a daemon thread holding one of the sweep slots: a store whose close hangs
    (S3's pool on a dead connection, a wrapper of the application's) neither hangs
    ``outboxer claim-check sweep`` nor the relay's cleanup round. False, with a logged
    warning, when it did not answer in time; False too when it was not tried because
    SWEEP_THREADS calls are still unanswered (the store is then dropped unclosed, its
    connections with it: logged at INFO, the sweep that met the same wall warned already).
    An error of the close itself is raised."""
    if timeout is None:
        store.close()
        return True
    if not timeout > 0:  # NaN too
        raise ConfigError("the claim-check store's close timeout must be positive (or None)")
    log = logger if log is None else log
    if not _sweep_slots.take():
        log.info(
            "claim-check store %r not closed: %d calls of sweeps to object stores are still "
            "unanswered",
            store,
            _sweep_slots.taken,
        )
        return False
    outcome = _in_sweep_thread(store.close, timeout)
    if outcome is None:
        log.warning(
            "claim-check store %r did not close within %g s; left to close in the background",
            store,
            timeout,
        )
        return False
    answered, result = outcome
    if not answered:
        raise result
    return True


def sweep_orphans(
    store: ObjectStore,
    referenced: Referenced,
    *,
    grace: float = DEFAULT_SWEEP_GRACE,
    batch: int = 1000,
    now: float | None = None,
    call_timeout: float | None = DEFAULT_SWEEP_CALL_TIMEOUT,
    log: Log | None = None,
) -> int:
    """Delete outboxer's objects older than ``grace`` seconds that no row refers to and
    no holder holds (:meth:`ObjectStore.put_hold`: a consumer's dead letter).

    ``referenced`` gets a batch of object names and answers which of them some outbox row
    still refers to (the Store's query; any row counts, whatever its status). Objects that
    are not outboxer's (other names) are never touched. Returns how many were deleted
    (objects deleted by someone else between the listing and the delete count too).

    Each call to the store (a page of the listing, ``held``, a page's deletes) not answered
    within ``call_timeout`` seconds ends the sweep with ClaimCheckSweepTimeoutError, a
    logged warning and one more :func:`sweep_failures`: a hung store never hangs the sweep
    (nor the relay's cleanup that runs it); the next sweep tries again.

    ``log`` (a logger or adapter; this module's by default) gets the sweep's lines: the
    relay passes its own, so a warning names the database whose sweep it is.
    """
    _check_grace(grace)
    _check_batch(batch)
    calls = _SweepCalls(store, call_timeout, log)
    calls.call("deleting leftovers", lambda: _delete_leftovers(store, grace, now, calls.log))
    listing = calls.call("listing", store.list_objects)
    pages = _candidate_pages(listing, grace, now, batch)
    try:
        while True:
            chunk = calls.call("listing", lambda: next(pages, None))
            if chunk is None:
                break
            kept = set(referenced(chunk))
            # Asked again for each page, just before its deletes: a hold put since the
            # previous page counts.
            kept |= calls.call("reading holds", store.held)
            orphans = [parsed.name for parsed in chunk if parsed.name not in kept]
            calls.call("deleting", lambda: store.delete_many(orphans))  # noqa: B023 -- called here
            calls.deleted += len(orphans)
    finally:
        # The listing's directory handle, at once even on an error; a listing still hung in
        # a thread cannot be closed (ValueError), and is closed when collected instead.
        with contextlib.suppress(ValueError):
            pages.close()
    if calls.deleted:
        calls.log.info("claim-check sweep deleted %d orphaned object(s)", calls.deleted)
    return calls.deleted


async def sweep_orphans_async(
    store: ObjectStore,
    referenced: ReferencedAsync,
    *,
    grace: float = DEFAULT_SWEEP_GRACE,
    batch: int = 1000,
    now: float | None = None,
    call_timeout: float | None = DEFAULT_SWEEP_CALL_TIMEOUT,
    log: Log | None = None,
) -> int:
    """:func:`sweep_orphans` for async callers: listing (a page at a time, through the
    store's ``list_objects``) and deleting in threads, each call bounded the same way, its
    lines to ``log`` the same way."""
    _check_grace(grace)
    _check_batch(batch)
    calls = _SweepCalls(store, call_timeout, log)
    await calls.call_async(
        "deleting leftovers", lambda: _delete_leftovers(store, grace, now, calls.log)
    )
    listing = await calls.call_async("listing", store.list_objects)
    pages = _candidate_pages(listing, grace, now, batch)
    try:
        while True:
            # One thread at a time pulls from the listing: never two at once (a timed-out
            # pull ends the sweep).
            chunk = await calls.call_async("listing", lambda: next(pages, None))
            if chunk is None:
                break
            kept = set(await referenced(chunk))
            kept |= await calls.call_async("reading holds", store.held)
            orphans = [parsed.name for parsed in chunk if parsed.name not in kept]
            await calls.call_async("deleting", lambda: store.delete_many(orphans))  # noqa: B023
            calls.deleted += len(orphans)
    finally:
        # Cancelled or timed out while a thread pulls a page, the generator is still
        # running there: closing it then raises ValueError, and it is closed when collected.
        with contextlib.suppress(ValueError):
            pages.close()
    if calls.deleted:
        calls.log.info("claim-check sweep deleted %d orphaned object(s)", calls.deleted)
    return calls.deleted


__all__ = [
    "CLAIM_CHECK_HEADERS",
    "DEFAULT_MAX_UNANSWERED_PUTS",
    "DEFAULT_PUT_TIMEOUT",
    "DEFAULT_SWEEP_CALL_TIMEOUT",
    "DEFAULT_SWEEP_GRACE",
    "DEFAULT_THRESHOLD",
    "HEADER_CLAIM_CHECK",
    "HEADER_CLAIM_CHECK_CONTENT_TYPE",
    "HEADER_CLAIM_CHECK_SHA256",
    "HEADER_CLAIM_CHECK_SIZE",
    "HOLDS",
    "ClaimCheck",
    "ClaimCheckError",
    "ClaimCheckStoreError",
    "ClaimCheckSweepTimeoutError",
    "FileObjectStore",
    "HoldTimeoutError",
    "ObjectDeleteTimeoutError",
    "ObjectMismatchError",
    "ObjectName",
    "ObjectNotFoundError",
    "ObjectReadTimeoutError",
    "ObjectStore",
    "S3ObjectStore",
    "StoredObject",
    "close_store",
    "create_object_store",
    "delete_hold_bounded",
    "delete_many_bounded",
    "fetch_payload",
    "fetch_payload_async",
    "held_object",
    "hold_name",
    "is_claim_checked",
    "object_name",
    "put_hold_bounded",
    "references",
    "sweep_failures",
    "sweep_orphans",
    "sweep_orphans_async",
]
