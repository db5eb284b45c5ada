"""Encryption at rest: AES-256-GCM per payload, a key ring with rotation, per-subject keys.

An encrypted message keeps its envelope (id, topic, key, user headers) readable, so the
relay can route and order it, and replaces its payload by ``nonce || ciphertext || tag``:

- **nonce**: 12 random bytes per encryption (never a counter: writers on many hosts share a
  key, and a random 96-bit nonce needs no coordination). NIST SP 800-38D bounds a key to
  2**32 random-nonce encryptions: rotate long before (``outboxer keys rotate``).
- **key id** in the header ``outboxer-key-id``, so a ring holding old and new keys decrypts
  both while rows are re-encrypted under the current one.
- **associated data** (authenticated, not encrypted): the JSON text of
  ``["outboxer/1", message id, destination, [[name, value], …]]``, the last item being the
  message's ``outboxer-`` encryption headers sorted by name. A ciphertext copied into another
  row (another id or destination), or stripped of its subject or key id, does not
  authenticate there. The destination is bound because two destinations of one message may
  reach different parties: one's ciphertext must not be replayable as the other's.
- **content type**: the stored message says ``application/octet-stream`` (it is bytes until
  decrypted); the real one travels in ``outboxer-encrypted-content-type``.
- **sealed headers** (optional): named user headers move inside the ciphertext; the
  plaintext is then a 4-byte big-endian length, that many bytes of a JSON object of the
  sealed headers, then the payload, and ``outboxer-sealed-headers: 1`` says so.

**Per-subject keys (crypto-shredding).** With a subject (a pseudonymous id of a person, such
as a user's UUID; never an e-mail: the subject travels in clear in ``outboxer-subject``), the
payload key is HKDF-SHA256 of the ring key, salted with a random 32-byte secret kept for that
subject by a :class:`SubjectKeyStore`. Deleting the subject's secret (``KeyRing.shred``)
makes every message of that subject undecryptable, under every ring key, including copies in
database backups and broker logs: the secret was never stored beside them. A key derived
from the ring key and the subject id alone could not be shredded (anyone with the ring key
could derive it again), hence the random secret; and a secret alone is useless without the
ring key, so the subject store may sit in the same database as the outbox.

Key material never reaches a log line: every key given to a ring is registered with
:func:`outboxer.redact.register_secret` (its base64 and hex forms), and a ring's repr shows
key ids only.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import copy
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import struct
import threading
import time
import tomllib
import uuid
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from outboxer.durable import sync_directory, write_new_file
from outboxer.errors import ConfigError, MissingDependencyError, OutboxerError, PayloadError
from outboxer.message import BINARY, Message
from outboxer.redact import redact_text, register_secret

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

#: The algorithm of ``outboxer-encryption``; the only one so far.
ALGORITHM = "A256GCM"
HEADER_ENCRYPTION = "outboxer-encryption"
HEADER_KEY_ID = "outboxer-key-id"
HEADER_SUBJECT = "outboxer-subject"
HEADER_ENCRYPTED_CONTENT_TYPE = "outboxer-encrypted-content-type"
HEADER_SEALED_HEADERS = "outboxer-sealed-headers"
#: Added by a relay that forwards ciphertext: the destination the payload is bound to, which
#: a consumer needs to decrypt (informative only: the relay itself decrypts with the row's).
HEADER_DESTINATION = "outboxer-destination"
#: Every header the encryption owns; all of them are bound into the associated data.
ENCRYPTION_HEADERS = frozenset(
    {
        HEADER_ENCRYPTION,
        HEADER_KEY_ID,
        HEADER_SUBJECT,
        HEADER_ENCRYPTED_CONTENT_TYPE,
        HEADER_SEALED_HEADERS,
    }
)

KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # 96 bits: GCM's native nonce size
TAG_BYTES = 16
_AAD_VERSION = "outboxer/1"
_SUBJECT_INFO = b"outboxer subject key v1\x00"
_SEALED_LENGTH = struct.Struct(">I")

DEFAULT_KEYS_ENV = "OUTBOXER_ENCRYPTION_KEYS"
DEFAULT_CURRENT_KEY_ENV = "OUTBOXER_ENCRYPTION_CURRENT_KEY"

#: The longest key id: longer ones are refused, also when read from a message's header.
MAX_KEY_ID_LENGTH = 64
# \Z, not $: "$" also matched before a final newline, so "k1\n" (from a row's header, or a
# key file) passed, and was handed to the KMS and made a key id of the ring.
_KEY_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_KEY_ID_LENGTH - 1}}}\Z")
MAX_SUBJECT_LENGTH = 255


class EncryptionError(OutboxerError):
    """A payload cannot be encrypted or decrypted; the message names the message and why."""


class DecryptionError(EncryptionError):
    """The ciphertext does not authenticate, or is not in outboxer's format.

    Permanent: the same bytes under the same key fail the same way on every attempt.
    """


class KeyNotFoundError(DecryptionError):
    """The key ring has no key of this id (or the subject's secret is gone)."""


class SubjectKeyDeletedError(KeyNotFoundError):
    """The subject's secret was deleted (crypto-shredded): its messages stay unreadable."""


class KeyRingUnavailableError(EncryptionError):
    """The key source (a KMS behind a callable) failed to answer; trying again may help."""


class EnqueueKeyUnavailableError(KeyRingUnavailableError):
    """``enqueue`` could not get the ring's current key from its source (a KMS): no answer
    within ``Outbox.key_fetch_timeout``, the source failed, or the ring's fetches are all
    still running. Raised before any SQL of outboxer's: nothing was written, and the
    caller's transaction is as it was (roll it back, or try the enqueue again).

    ``key_id`` and ``timeout`` (seconds) name the key and the bound; the message never
    holds key material (the source's own error is masked as in log lines).
    """

    def __init__(self, message: str, key_id: str = "", timeout: float = 0.0) -> None:
        # Defaults: an exception is copied and pickled through its message alone.
        super().__init__(message)
        self.key_id = key_id
        self.timeout = timeout


@functools.cache
def _aesgcm_class() -> type[AESGCM]:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise MissingDependencyError("cryptography", "crypto") from None
    return AESGCM


@functools.cache
def _invalid_tag() -> type[Exception]:
    from cryptography.exceptions import InvalidTag

    return InvalidTag


def _hkdf(key: bytes, salt: bytes, info: bytes) -> bytes:
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError:
        raise MissingDependencyError("cryptography", "crypto") from None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info).derive(key)


def generate_key() -> str:
    """A new random AES-256 key as base64 text, the form key rings read."""
    return base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode("ascii")


def _register_key(material: bytes) -> None:
    for text in (
        base64.b64encode(material).decode("ascii"),
        base64.urlsafe_b64encode(material).decode("ascii"),
        base64.b64encode(material).decode("ascii").rstrip("="),
        base64.urlsafe_b64encode(material).decode("ascii").rstrip("="),
        material.hex(),
    ):
        register_secret(text)


def is_key_id(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a valid key id (the ring refuses any other, before a KMS sees
    it, KeyNotFoundError)."""
    return isinstance(value, str) and _KEY_ID.match(value) is not None


def check_key_id(key_id: object) -> str:
    if not is_key_id(key_id):
        raise ConfigError(
            f"key id {key_id!r} must be 1 to 64 letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit"
        )
    return key_id


def parse_key(key_id: str, material: object) -> bytes:
    """32 bytes from raw bytes or base64 text (standard or URL-safe, padding optional).

    The error never quotes the material: a key mistyped into a config file is still a key.
    """
    if isinstance(material, bytes | bytearray):
        raw = bytes(material)
    elif isinstance(material, str):
        text = material.strip()
        try:
            raw = base64.b64decode(
                text.replace("-", "+").replace("_", "/") + "=" * (-len(text) % 4),
                validate=True,
            )
        except (binascii.Error, ValueError):
            raise ConfigError(f"key {key_id!r} is not valid base64") from None
    else:
        raise ConfigError(f"key {key_id!r} must be base64 text or bytes")
    if len(raw) != KEY_BYTES:
        raise ConfigError(
            f"key {key_id!r} must be {KEY_BYTES} bytes (AES-256), base64-encoded; "
            f"it decodes to {len(raw)} bytes (make one with `outboxer keys generate`)"
        )
    _register_key(raw)
    return raw


def _shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to about ``limit`` characters: for values read from a message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


#: Characters of a key source's own error text kept in KeyRingUnavailableError.
KMS_ERROR_CHARS = 300


def _kms_error(exc: BaseException) -> str:
    """A key source's exception as error text: URLs and registered secrets masked (as in log
    lines), cut to about ``KMS_ERROR_CHARS``. A KMS quotes what it likes (a whole response
    body, a signed URL); the text goes into logs, dead letters and rows' last_error."""
    text = redact_text(f"{type(exc).__name__}: {exc}")
    if len(text) > KMS_ERROR_CHARS:
        text = f"{text[:KMS_ERROR_CHARS]}… [cut: {len(text)} characters in all]"
    return text


def check_subject(subject: object) -> str:
    if (
        not isinstance(subject, str)
        or not subject
        or len(subject) > MAX_SUBJECT_LENGTH
        or not subject.isprintable()
    ):
        raise PayloadError(
            f"subject must be a non-empty printable string of at most {MAX_SUBJECT_LENGTH} "
            "characters"
        )
    return subject


# ----- subject secrets ------------------------------------------------------------------------


class SubjectKeyStore(Protocol):
    """Where each subject's random secret lives; deleting it shreds the subject's messages.

    Writers (``get_or_create``) and readers (``get``) on every host must see one store: a
    directory on shared storage, a database table, a KMS. Deletion must be final where it
    matters: a store whose backups keep deleted secrets for a year shreds after a year.
    """

    def get(self, subject: str) -> bytes | None:
        """The subject's secret, or None when it never existed or was deleted."""
        ...

    def get_or_create(self, subject: str) -> bytes:
        """The subject's secret, made (random, 32 bytes) the first time it is asked for.

        Two writers creating one subject at once must end with the same secret.
        """
        ...

    def delete(self, subject: str) -> bool:
        """Delete the subject's secret; True if there was one."""
        ...


class MemorySubjectKeys:
    """Subject secrets in this process only: tests, and single-process applications that
    keep nothing past a restart (a restart shreds every subject)."""

    def __init__(self) -> None:
        self._secrets: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, subject: str) -> bytes | None:
        return self._secrets.get(subject)

    def get_or_create(self, subject: str) -> bytes:
        with self._lock:
            return self._secrets.setdefault(subject, secrets.token_bytes(KEY_BYTES))

    def delete(self, subject: str) -> bool:
        with self._lock:
            return self._secrets.pop(subject, None) is not None

    def __repr__(self) -> str:
        return f"MemorySubjectKeys({len(self._secrets)} subjects)"


class FileSubjectKeys:
    """One file per subject in a directory (mode 0600), named by the SHA-256 of the subject
    id, so neither the id nor anything about it shows in a listing.

    A secret is written to a temporary file, fsynced, then linked to its name: ``link``
    fails if the name exists, so two writers creating one subject at once agree on the first
    one's secret, and a reader never sees a half-written file.

    The link is durable once the directory is fsynced, which its creator does after the
    link; a writer that uses the secret before that (the loser of the link race, or one
    that reads a file created moments ago, perhaps by a creator that died before its
    fsync) could commit a message whose secret a power cut then loses: undecryptable for
    ever. Such a writer fsyncs the directory itself before it returns the secret (once per
    file and instance); a file older than :attr:`YOUNG_SECONDS` is durable by then (the
    kernel writes dirty metadata back within seconds) and costs nothing more than an fstat.
    """

    #: Age (seconds, by the file's mtime) under which a secret read by ``get_or_create``
    #: may not be durable yet: its reader fsyncs the directory before using it.
    YOUNG_SECONDS = 60.0

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        #: (name, inode, mtime) of young files this instance has made durable already.
        self._synced: set[tuple[str, int, int]] = set()

    def _path(self, subject: str) -> Path:
        return self.directory / hashlib.sha256(subject.encode("utf-8")).hexdigest()

    def get(self, subject: str) -> bytes | None:
        found = self._read(subject)
        return None if found is None else found[0]

    def _read(self, subject: str) -> tuple[bytes, os.stat_result] | None:
        """The subject's secret and its file's status, or None when there is no file."""
        path = self._path(subject)
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            status = os.fstat(descriptor)
            secret = os.read(descriptor, KEY_BYTES + 1)
        finally:
            os.close(descriptor)
        if len(secret) != KEY_BYTES:
            raise EncryptionError(
                f"subject key file {path} holds {len(secret)} bytes, not {KEY_BYTES}: "
                "it was altered"
            )
        return secret, status

    def _make_durable(self, name: str, status: os.stat_result, *, young_only: bool) -> None:
        """fsync the directory unless the file is old enough to be durable already (with
        ``young_only``), or this instance has synced it before."""
        # An mtime in the future (another host's clock, on shared storage) counts as young.
        if young_only and time.time() - status.st_mtime >= self.YOUNG_SECONDS:
            return
        mark = (name, status.st_ino, status.st_mtime_ns)
        if mark in self._synced:
            return
        sync_directory(self.directory)
        if len(self._synced) > 1024:
            self._synced.clear()
        self._synced.add(mark)

    def get_or_create(self, subject: str) -> bytes:
        found = self._read(subject)
        if found is not None:
            self._make_durable(self._path(subject).name, found[1], young_only=True)
            return found[0]
        path = self._path(subject)
        temporary = self.directory / f".{path.name}.{secrets.token_hex(8)}.tmp"
        secret = secrets.token_bytes(KEY_BYTES)
        write_new_file(temporary, secret)
        try:
            made = temporary.stat()
            os.link(temporary, path)
        except FileExistsError:  # another writer made it first: its secret wins
            winner = self._read(subject)
            if winner is None:  # made and deleted (shredded) in between: make it again
                return self.get_or_create(subject)
            # The winner may not have fsynced the directory yet (or died before it): the
            # secret this writer is about to use must survive a power cut first.
            self._make_durable(path.name, winner[1], young_only=False)
            return winner[0]
        except FileNotFoundError:  # a shred removed the temporary file: make it again
            return self.get_or_create(subject)
        finally:
            temporary.unlink(missing_ok=True)
        sync_directory(self.directory)
        # Durable now: this instance's next reads of the young file need no fsync (the link
        # is the temporary file's inode, its mtime unchanged).
        self._synced.add((path.name, made.st_ino, made.st_mtime_ns))
        return secret

    def delete(self, subject: str) -> bool:
        path = self._path(subject)
        try:
            path.unlink()
            existed = True
        except FileNotFoundError:
            existed = False
        # A create killed between its link and its cleanup leaves the temporary name, a hard
        # link to the very secret: a shred that kept it would shred nothing.
        leftovers = list(self.directory.glob(f".{path.name}.*.tmp"))
        for leftover in leftovers:
            leftover.unlink(missing_ok=True)
        if existed or leftovers:
            sync_directory(self.directory)
        return existed

    def __repr__(self) -> str:
        return f"FileSubjectKeys({str(self.directory)!r})"


# ----- the key ring ---------------------------------------------------------------------------


class KeyRing:
    """Keys by id, one of them current (new encryptions use it), and the subject secrets.

    ``KeyRing({"2025-10": old, "2025-11": new})`` makes the last key current; or name it with
    ``current=``. Keys are 32 bytes, or base64 text of 32 bytes. ``from_env``, ``from_file``
    and ``from_callable`` (a KMS) build rings from other sources.
    """

    def __init__(
        self,
        keys: Mapping[str, bytes | str] | None = None,
        current: str | None = None,
        *,
        subjects: SubjectKeyStore | None = None,
        resolve: Callable[[str], bytes | str | None] | None = None,
    ) -> None:
        self._keys: dict[str, bytes] = {
            check_key_id(key_id): parse_key(key_id, material)
            for key_id, material in (keys or {}).items()
        }
        self._resolve = resolve
        self._lock = threading.Lock()
        if current is None:
            if not self._keys:
                raise ConfigError("a key ring needs at least one key, or current= naming one")
            current = list(self._keys)[-1]
        self.current_key_id = check_key_id(current)
        if resolve is None and current not in self._keys:
            raise ConfigError(
                f"current key {current!r} is not among the ring's keys ({', '.join(self._keys)})"
            )
        self.subjects = subjects
        self._ciphers: dict[tuple[str, bytes], AESGCM] = {}

    # ----- sources -----------------------------------------------------------------------------

    @classmethod
    def from_env(
        cls,
        var: str = DEFAULT_KEYS_ENV,
        current_var: str = DEFAULT_CURRENT_KEY_ENV,
        *,
        environ: Mapping[str, str] | None = None,
        subjects: SubjectKeyStore | None = None,
    ) -> KeyRing:
        """Keys from ``id=base64,id=base64`` in ``var``; the current one named by
        ``current_var``, else the last listed (add a new key at the end to rotate)."""
        env = os.environ if environ is None else environ
        return cls.from_text(
            env.get(var, ""), env.get(current_var) or None, origin=var, subjects=subjects
        )

    @classmethod
    def from_text(
        cls,
        text: str,
        current: str | None = None,
        *,
        origin: str = "encryption keys",
        subjects: SubjectKeyStore | None = None,
    ) -> KeyRing:
        """Keys from ``id=base64,id=base64`` (``origin`` names the source in errors, which
        never quote a key); the current one is ``current``, else the last listed."""
        if not text.strip():
            raise ConfigError(f"{origin} is empty: set it to id=base64key[,id=base64key…]")
        keys: dict[str, str] = {}
        for item in text.strip().split(","):
            key_id, sep, material = item.strip().partition("=")
            if not sep or not key_id.strip():
                raise ConfigError(
                    f"{origin}: each entry must be id=base64key (entry {len(keys) + 1})"
                )
            if key_id.strip() in keys:
                raise ConfigError(f"{origin}: key id {key_id.strip()!r} is listed twice")
            keys[key_id.strip()] = material
        return cls(keys, current, subjects=subjects)

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, subjects: SubjectKeyStore | None = None
    ) -> KeyRing:
        """Keys from a TOML file (a ``.json`` file is read as JSON), shaped as::

        current = "2025-11"            # optional: else the last key listed
        [keys]
        "2025-10" = "base64…"
        "2025-11" = "base64…"
        """
        source = Path(path)
        try:
            text = source.read_text("utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read key file {source}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            # Only the position: the exception itself holds the whole file, keys included.
            raise ConfigError(f"key file {source} is not UTF-8 text (byte {exc.start})") from None
        try:
            data: Any = json.loads(text) if source.suffix == ".json" else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError):
            # The parser's message may quote a line of the file, that is, a key.
            raise ConfigError(f"key file {source} is not valid TOML/JSON") from None
        if not isinstance(data, dict) or not isinstance(data.get("keys"), dict):
            raise ConfigError(f"key file {source} needs a [keys] table of id = base64key")
        unknown = set(data) - {"keys", "current"}
        if unknown:
            raise ConfigError(f"key file {source} has unknown entries {sorted(unknown)}")
        current = data.get("current")
        if current is not None and not isinstance(current, str):
            raise ConfigError(f"key file {source}: current must be a key id")
        return cls(data["keys"], current, subjects=subjects)

    @classmethod
    def from_callable(
        cls,
        fetch: Callable[[str], bytes | str | None],
        current: str,
        *,
        subjects: SubjectKeyStore | None = None,
    ) -> KeyRing:
        """Keys fetched by id from your KMS: ``fetch(key_id)`` returns the key (bytes or
        base64), or None for an id it does not know. Each key is fetched once per ring; an
        exception from ``fetch`` becomes :class:`KeyRingUnavailableError` (retryable)."""
        return cls(None, current, subjects=subjects, resolve=fetch)

    # ----- keys --------------------------------------------------------------------------------

    @property
    def key_ids(self) -> list[str]:
        """Ids of the keys loaded so far (for a callable ring, those fetched so far)."""
        return list(self._keys)

    @property
    def fetches(self) -> bool:
        """Whether a key the ring lacks is fetched from a source (``from_callable``: a KMS
        call, which may block) rather than refused at once."""
        return self._resolve is not None

    def same_source(self, other: KeyRing) -> bool:
        """Whether ``other`` fetches from the same source (an equal callable) with the same
        current key and subject store: this ring may stand in for it, keeping the keys it
        fetched and its calls still running (the places the cap counts are per ring)."""
        return (
            self._resolve is not None
            and self._resolve == other._resolve
            and self.current_key_id == other.current_key_id
            and self.subjects is other.subjects
        )

    def has_key(self, key_id: str) -> bool:
        """Whether the key of this id is loaded (a callable ring fetches it at first use)."""
        return isinstance(key_id, str) and key_id in self._keys

    def key(self, key_id: str) -> bytes:
        """The key of this id; raises KeyNotFoundError (or KeyRingUnavailableError)."""
        known = self._keys.get(key_id) if isinstance(key_id, str) else None
        if known is not None:
            return known
        if not is_key_id(key_id):
            # Read from a message header, that is, from whoever wrote the message: never
            # handed to a KMS (a path, a query), never quoted whole into an error text.
            raise KeyNotFoundError(f"key id {_shown(key_id)} is not a valid key id")
        if self._resolve is None:
            raise KeyNotFoundError(
                f"no key {key_id!r} in the key ring (it has {', '.join(self._keys)})"
            )
        try:
            fetched = self._resolve(key_id)
        except Exception as exc:
            raise KeyRingUnavailableError(
                f"fetching key {key_id!r} failed: {_kms_error(exc)}"
            ) from exc
        if fetched is None:
            raise KeyNotFoundError(f"the key source has no key {key_id!r}")
        material = parse_key(key_id, fetched)
        with self._lock:
            self._keys.setdefault(key_id, material)
        return material

    def shred(self, subject: str) -> bool:
        """Delete the subject's secret: its messages can never be decrypted again."""
        return self._subject_store().delete(check_subject(subject))

    def _subject_store(self) -> SubjectKeyStore:
        if self.subjects is None:
            raise ConfigError("this key ring has no subject key store (subjects=...)")
        return self.subjects

    def _cipher(self, key_id: str, subject: str | None, create: bool) -> AESGCM:
        material = self.key(key_id)
        if subject is not None:
            if not create:  # from a message header: checked before any store sees it
                try:
                    check_subject(subject)
                except PayloadError:
                    raise DecryptionError(
                        f"subject {_shown(subject)} is not a valid subject id"
                    ) from None
            store = self._subject_store()
            secret = store.get_or_create(subject) if create else store.get(subject)
            if secret is None:
                raise SubjectKeyDeletedError(
                    f"subject {subject!r} has no key: it was deleted (crypto-shredded) or "
                    "never made"
                )
            # HKDF's salt: the subject's random secret; its info: the subject id, so one
            # secret could never serve two subjects.
            material = _hkdf(material, secret, _SUBJECT_INFO + subject.encode("utf-8"))
        cache_key = (key_id, material)
        cipher = self._ciphers.get(cache_key)
        if cipher is None:
            cipher = _aesgcm_class()(material)
            with self._lock:
                if len(self._ciphers) > 1024:  # per-subject keys: bound the cache
                    self._ciphers.clear()
                self._ciphers[cache_key] = cipher
        return cipher

    # ----- payloads ----------------------------------------------------------------------------

    def encrypt(
        self,
        payload: bytes,
        message_id: uuid.UUID | str,
        destination: str,
        subject: str | None = None,
        *,
        content_type: str | None = None,
        sealed_headers: Mapping[str, str] | None = None,
        create_subject: bool = True,
    ) -> tuple[bytes, dict[str, str]]:
        """``payload`` sealed for one row; returns the stored bytes and the headers to add.

        ``create_subject=False`` when re-encrypting what was already encrypted for the
        subject: a subject shredded since the plaintext was read must raise
        SubjectKeyDeletedError, not get a new secret that makes its data readable again.
        """
        headers = {HEADER_ENCRYPTION: ALGORITHM, HEADER_KEY_ID: self.current_key_id}
        if subject is not None:
            headers[HEADER_SUBJECT] = check_subject(subject)
        if content_type is not None:
            headers[HEADER_ENCRYPTED_CONTENT_TYPE] = content_type
        plaintext = payload
        if sealed_headers:
            headers[HEADER_SEALED_HEADERS] = "1"
            packed = json.dumps(
                dict(sealed_headers), separators=(",", ":"), ensure_ascii=False
            ).encode("utf-8")
            plaintext = _SEALED_LENGTH.pack(len(packed)) + packed + payload
        cipher = self._cipher(self.current_key_id, subject, create=create_subject)
        nonce = os.urandom(NONCE_BYTES)
        sealed = cipher.encrypt(nonce, plaintext, associated_data(message_id, destination, headers))
        return nonce + sealed, headers

    def decrypt_payload(
        self,
        stored: bytes,
        headers: Mapping[str, str],
        message_id: uuid.UUID | str,
        destination: str,
    ) -> tuple[bytes, dict[str, str]]:
        """The payload and the sealed headers (empty if none) of one encrypted row.

        Raises KeyNotFoundError, SubjectKeyDeletedError, DecryptionError (permanent) or
        KeyRingUnavailableError (the key source failed: retry).
        """
        algorithm = headers.get(HEADER_ENCRYPTION)
        if algorithm is None:
            raise DecryptionError(
                f"message {message_id} carries encryption headers but no {HEADER_ENCRYPTION}: "
                "it was altered"
            )
        if algorithm != ALGORITHM:
            raise DecryptionError(
                f"message {message_id}: unknown encryption {algorithm!r} (expected {ALGORITHM})"
            )
        key_id = headers.get(HEADER_KEY_ID)
        if not key_id:
            raise DecryptionError(f"message {message_id}: encrypted, but names no key id")
        if len(stored) < NONCE_BYTES + TAG_BYTES:
            raise DecryptionError(
                f"message {message_id}: {len(stored)} bytes are too short for an AES-GCM ciphertext"
            )
        cipher = self._cipher(key_id, headers.get(HEADER_SUBJECT), create=False)
        bound = {name: value for name, value in headers.items() if name in ENCRYPTION_HEADERS}
        try:
            plaintext = cipher.decrypt(
                stored[:NONCE_BYTES],
                stored[NONCE_BYTES:],
                associated_data(message_id, destination, bound),
            )
        except _invalid_tag():
            raise DecryptionError(
                f"message {message_id} (destination {destination!r}) does not authenticate "
                f"under key {key_id!r}: the key is wrong, or the ciphertext was altered or "
                "copied from another message or destination"
            ) from None
        if headers.get(HEADER_SEALED_HEADERS) != "1":
            return plaintext, {}
        return _unpack_sealed(plaintext, message_id)

    def __repr__(self) -> str:
        source = "callable" if self._resolve is not None else "static"
        return (
            f"KeyRing(current={self.current_key_id!r}, keys={self.key_ids!r}, {source}, "
            f"subjects={self.subjects!r})"
        )


def associated_data(
    message_id: uuid.UUID | str, destination: str, headers: Mapping[str, str]
) -> bytes:
    """What the ciphertext is bound to (module docstring): id, destination, encryption headers."""
    bound = sorted([name, value] for name, value in headers.items() if name in ENCRYPTION_HEADERS)
    return _AAD_JSON.encode([_AAD_VERSION, str(message_id), destination, bound]).encode("utf-8")


#: ``json.dumps(…, separators=(",", ":"), ensure_ascii=False)`` without rebuilding an encoder
#: for every message (the relay decrypts on its hot path): the same bytes.
_AAD_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _unpack_sealed(plaintext: bytes, message_id: object) -> tuple[bytes, dict[str, str]]:
    try:
        (length,) = _SEALED_LENGTH.unpack_from(plaintext)
        end = _SEALED_LENGTH.size + length
        if end > len(plaintext):  # a slice would cut it short, and the payload to nothing
            raise ValueError("the sealed headers' length exceeds the plaintext")
        sealed = json.loads(plaintext[_SEALED_LENGTH.size : end])
    except (struct.error, ValueError, RecursionError):
        raise DecryptionError(f"message {message_id}: its sealed headers are malformed") from None
    if not isinstance(sealed, dict) or not all(
        isinstance(name, str) and isinstance(value, str) for name, value in sealed.items()
    ):
        raise DecryptionError(f"message {message_id}: its sealed headers are malformed")
    return plaintext[end:], sealed


# ----- messages -------------------------------------------------------------------------------


def is_encrypted(message: Message) -> bool:
    # Any of the encryption headers, not the marker alone: ciphertext whose marker was
    # removed must fail to decrypt, not pass on as if it were plaintext.
    return any(name in ENCRYPTION_HEADERS for name in message.headers)


def encrypt_message(
    message: Message,
    keyring: KeyRing,
    *,
    subject: str | None = None,
    seal_headers: bool | Collection[str] = False,
    create_subject: bool = True,
) -> Message:
    """``message`` as it is stored encrypted: payload sealed, content type octet-stream,
    encryption headers added; ``seal_headers`` (True for every user header, or some names)
    moves those headers inside the ciphertext. ``create_subject``: see
    :meth:`KeyRing.encrypt` (False for a message that was encrypted for its subject before)."""
    if any(name in ENCRYPTION_HEADERS for name in message.headers):
        raise PayloadError(
            f"message {message.id} already carries outboxer encryption headers; "
            "they are outboxer's own and cannot be given"
        )
    if isinstance(seal_headers, str):  # one name, not its characters
        seal_headers = {seal_headers}
    if seal_headers is True:
        sealed = dict(message.headers)
    elif seal_headers:
        sealed = {name: value for name, value in message.headers.items() if name in seal_headers}
    else:
        sealed = {}
    kept = {name: value for name, value in message.headers.items() if name not in sealed}
    stored, added = keyring.encrypt(
        message.payload,
        message.id,
        message.destination,
        subject,
        content_type=message.content_type,
        sealed_headers=sealed,
        create_subject=create_subject,
    )
    return _with_payload(message, stored, BINARY, {**kept, **added})


def decrypt(message: Message, keyring: KeyRing, *, destination: str | None = None) -> Message:
    """The plaintext ``message``: payload, content type and sealed headers restored,
    encryption headers removed. A message that is not encrypted comes back unchanged.

    ``destination`` is the outboxer destination the message was encrypted for; it defaults
    to the ``outboxer-destination`` header a relay adds to ciphertext it forwards, then to
    ``message.destination``. Raises the errors of :meth:`KeyRing.decrypt_payload`.
    """
    if not is_encrypted(message):
        return message
    target = destination or message.headers.get(HEADER_DESTINATION) or message.destination
    payload, sealed = keyring.decrypt_payload(message.payload, message.headers, message.id, target)
    headers = {
        name: value
        for name, value in message.headers.items()
        if name not in ENCRYPTION_HEADERS and name != HEADER_DESTINATION
    }
    headers.update(sealed)
    content_type = message.headers.get(HEADER_ENCRYPTED_CONTENT_TYPE, BINARY)
    return _with_payload(message, payload, content_type, headers)


def _with_payload(
    message: Message, payload: bytes, content_type: str, headers: Mapping[str, str]
) -> Message:
    """``dataclasses.replace`` of these three fields, at a third of its cost per message."""
    return Message(
        id=message.id,
        topic=message.topic,
        payload=payload,
        key=message.key,
        headers=headers,
        content_type=content_type,
        destination=message.destination,
        created_at=message.created_at,
        attempts=message.attempts,
        seq=message.seq,
    )


def reencrypt(message: Message, keyring: KeyRing) -> Message | None:
    """``message`` encrypted under the ring's current key (a fresh nonce, the same subject and
    sealed headers), or None when it already is (or is not encrypted at all)."""
    if not is_encrypted(message) or message.headers.get(HEADER_KEY_ID) == keyring.current_key_id:
        return None
    sealed_before = message.headers.get(HEADER_SEALED_HEADERS) == "1"
    # The row's own destination, never an ``outboxer-destination`` header: whoever can write
    # a row could otherwise copy another destination's ciphertext into it, name that
    # destination in the header, and have it re-encrypted here as genuinely this row's.
    plain = decrypt(message, keyring, destination=message.destination)
    user_headers = {name for name in plain.headers if name not in message.headers}
    return encrypt_message(
        plain,
        keyring,
        subject=message.headers.get(HEADER_SUBJECT),
        seal_headers=user_headers if sealed_before else False,
        # Shredded between the decryption above and this encryption: stay shredded.
        create_subject=False,
    )


def keys_in_use(messages: Iterable[Message]) -> set[str]:
    """The key ids ``messages`` are encrypted under (for checking a ring before retiring a key)."""
    return {
        key_id for message in messages if (key_id := message.headers.get(HEADER_KEY_ID)) is not None
    }


#: Key fetches still running, per key ring, waited on or given up on (a KMS client with no
#: timeout of its own keeps its thread): past this many, the ring's fetches fail at once
#: instead of starting one more thread, so a KMS that never answers costs a bounded number
#: of threads, not one per retry nor one per caller waiting at once. One that returns frees
#: its place (with a KMS that answers, a fetch beyond this many at the same moment fails,
#: retryable, and its retry finds the key the others fetched). Per ring, as the error says ("the
#: keyring's source"): one count for the process made a silent KMS behind one ring fail
#: every other ring's fetches (another destination's KMS that answers), and a ring holding
#: its keys answer an unknown id "unavailable" (retried) instead of "not found". The relay
#: and the consumer count together: one ring is one key source, whoever waits for it.
MAX_ABANDONED_FETCHES = 4

_abandoned_lock = threading.Lock()
_abandoned: weakref.WeakKeyDictionary[KeyRing, int] = weakref.WeakKeyDictionary()
#: The fetch of each (ring, key id) that a caller still waits for: a caller asking for the
#: same key meanwhile waits for that call instead of starting one more. Without it, a KMS
#: that answers failed every fetch beyond the cap that began at the same moment (the
#: consumer's lanes meeting a new key together), each a failed attempt for nothing. A
#: fetch given up on is no longer joined: a later one may reach a KMS that recovered.
_joinable: weakref.WeakKeyDictionary[KeyRing, dict[str, concurrent.futures.Future[None]]] = (
    weakref.WeakKeyDictionary()
)


class _KeyFetch:
    """One call of a ring's source for one key, in a daemon thread of its own: what
    :func:`fetch_key_bounded` and :func:`fetch_key_bounded_sync` share (the ring's place it
    holds until the call returns, its sharing with callers of the same key, how it is given
    up on, its late outcome's log); only the wait differs, awaited or blocking."""

    def __init__(
        self, keyring: KeyRing, key_id: str, timeout: float, waiter: str, log: logging.Logger
    ) -> None:
        self.keyring = keyring
        self.key_id = key_id
        self.timeout = timeout
        self.waiter = waiter
        self.log = log
        self.outcome: concurrent.futures.Future[None] = concurrent.futures.Future()
        # Only a text id is shared: a row's headers are JSON, and a hand-written list or
        # object there is no key to look up (the ring answers it KeyNotFoundError, permanent).
        self.shared = isinstance(key_id, str)
        self.given_up = False
        self.started = 0.0

    @classmethod
    def admit(
        cls, keyring: KeyRing, key_id: str, timeout: float, waiter: str, log: logging.Logger
    ) -> _KeyFetch | concurrent.futures.Future[None]:
        """A new fetch holding one of the ring's places, or the outcome of the fetch of the
        same key another caller still waits for (to wait for instead); past the ring's
        places, KeyRingUnavailableError."""
        # The check and the count in one hold of the lock, the count taken when the thread is
        # started, not when it is given up on: checked here and counted only at the timeout,
        # every fetch that began while fewer than the cap were left (the consumer's lanes, up
        # to ``concurrency`` of them, meeting the same new key at once) passed, and a KMS that
        # never answered kept one thread per lane, past the cap. A thread counts until it ends.
        fetch = cls(keyring, key_id, timeout, waiter, log)
        with _abandoned_lock:
            joined = _joinable.get(keyring, {}).get(key_id) if fetch.shared else None
            if joined is not None:
                return joined
            stuck = _abandoned.get(keyring, 0)
            if stuck >= MAX_ABANDONED_FETCHES:
                raise KeyRingUnavailableError(
                    f"key {key_id!r}: {stuck} earlier fetches from the keyring's source have "
                    "not returned; it is not asked again until one does"
                )
            _abandoned[keyring] = stuck + 1
            if fetch.shared:
                _joinable.setdefault(keyring, {})[key_id] = fetch.outcome
        fetch.started = time.monotonic()
        return fetch

    def _unjoinable(self) -> None:
        """No later caller joins this fetch (under the lock)."""
        calls = _joinable.get(self.keyring) if self.shared else None
        if calls is not None and calls.get(self.key_id) is self.outcome:
            del calls[self.key_id]

    def _work(self) -> None:
        ran = self.outcome.set_running_or_notify_cancel()
        error: BaseException | None = None
        if ran:
            try:
                self.keyring.key(self.key_id)  # the ring keeps what it fetched, even given up on
            except Exception as exc:  # noqa: BLE001 -- the waiting caller's to raise
                error = exc
                self.outcome.set_exception(exc)
            except BaseException as exc:  # noqa: BLE001 -- the source's, in this thread
                # Raised in this thread, not the waiter's: re-raised there, a KMS client's
                # CancelledError read as the waiter's own cancellation (an enqueue_async's
                # task "cancelled" that nobody cancelled) and its SystemExit or
                # KeyboardInterrupt as the waiter's exit, past every `except Exception`.
                error = exc
                failed = KeyRingUnavailableError(
                    f"fetching key {self.key_id!r} failed: {_kms_error(exc)}"
                )
                failed.__cause__ = exc
                self.outcome.set_exception(failed)
            else:
                self.outcome.set_result(None)
        with _abandoned_lock:
            late = self.given_up
            _abandoned[self.keyring] -= 1
            self._unjoinable()
        if late and ran:
            _log_late_fetch(
                self.log,
                self.waiter,
                self.key_id,
                time.monotonic() - self.started,
                self.timeout,
                error,
            )

    def start(self) -> None:
        try:
            threading.Thread(target=self._work, name="outboxer-key-fetch", daemon=True).start()
        except BaseException:
            # No thread (none left to the process, or the interpreter shutting down): nothing
            # will give the place back.
            with _abandoned_lock:
                _abandoned[self.keyring] -= 1
                self._unjoinable()
            # A caller that joined it meanwhile gets CancelledError, not a hang.
            self.outcome.cancel()
            raise

    def give_up(self) -> bool:
        """Leave the thread to itself (its late outcome logged); False if it ended already."""
        with _abandoned_lock:
            self._unjoinable()
            if self.outcome.done():
                return False
            self.given_up = True
            return True

    def timed_out(self) -> KeyRingUnavailableError:
        return KeyRingUnavailableError(
            f"key {self.key_id!r}: the keyring's source did not answer within {self.timeout:g} s"
        )


async def fetch_key_bounded(
    keyring: KeyRing, key_id: str, timeout: float, *, waiter: str, log: logging.Logger
) -> None:
    """Load ``key_id`` into ``keyring`` (a KMS call, blocking) in a daemon thread, waiting at
    most ``timeout`` seconds: then KeyRingUnavailableError, and the thread is left to end
    on its own (how it ends is logged on ``log``, naming ``waiter``, "the relay" or "the
    consumer": the KMS's own error is seen nowhere else). Not ``asyncio.to_thread`` nor a
    fixed pool: asyncio.run (and the interpreter) join the default executor's threads at
    exit, and a pool's threads, once all held by calls that never return, left every later
    fetch queued behind them until it timed out, never reaching the KMS again."""
    import asyncio

    fetch = _KeyFetch.admit(keyring, key_id, timeout, waiter, log)
    if not isinstance(fetch, _KeyFetch):
        await _join_fetch(fetch, key_id, timeout)
        return
    # Cancelled once given up: the thread's late answer is then dropped, also after the
    # event loop is closed (asyncio's future chaining checks for both).
    waiting = asyncio.wrap_future(fetch.outcome)
    waiting.add_done_callback(_retrieved)
    try:
        fetch.start()
    except BaseException:
        waiting.cancel()
        raise
    try:
        await asyncio.wait((waiting,), timeout=timeout)
    except BaseException:
        fetch.give_up()
        waiting.cancel()
        raise
    if fetch.give_up():
        waiting.cancel()
        raise fetch.timed_out()
    waiting.cancel()  # its state may still be on its way from the thread: read the source
    fetch.outcome.result()


def fetch_key_bounded_sync(
    keyring: KeyRing, key_id: str, timeout: float | None, *, waiter: str, log: logging.Logger
) -> None:
    """:func:`fetch_key_bounded` for a synchronous caller (an operator's replay or key
    rotation, in a worker thread of their own): the same daemon thread, places per ring,
    sharing of a key's fetch (with the relay's and the consumer's too) and late outcome's
    log, the wait blocking. A ring holding the key, or one with no source to fetch from
    (a static ring: a lookup, which may raise KeyNotFoundError), is answered here without a
    thread; ``timeout`` None calls the source here, unbounded (the caller chose no bound).
    An id that is no valid key id (:func:`is_key_id`) is refused at once, KeyNotFoundError,
    without a thread nor one of the ring's places."""
    if keyring.has_key(key_id):
        return
    if not keyring.fetches or timeout is None or not is_key_id(key_id):
        # An id the ring refuses before any source sees it (a row's hand-written header) is
        # refused here at once too: through a thread, each such row of a rotation cost one
        # (50,000 rows: 15 s, from 0.5 s), and with the ring's places held by a silent KMS
        # it was "unavailable" (a replay's 503, retried) quoting the whole header, where
        # the ring answers "not a valid key id" (for good, shortened).
        keyring.key(key_id)
        return
    fetch = _KeyFetch.admit(keyring, key_id, timeout, waiter, log)
    if not isinstance(fetch, _KeyFetch):
        concurrent.futures.wait((fetch,), timeout=timeout)
        _joined_outcome(fetch, key_id, timeout)
        return
    fetch.start()
    try:
        concurrent.futures.wait((fetch.outcome,), timeout=timeout)
    except BaseException:  # KeyboardInterrupt: the command stops, the thread is left
        fetch.give_up()
        raise
    if fetch.give_up():
        raise fetch.timed_out()
    fetch.outcome.result()


def fetch_message_keys_sync(
    message: Message,
    keyring: KeyRing,
    timeout: float | None,
    *,
    waiter: str,
    log: logging.Logger,
) -> None:
    """Before ``message`` is decrypted and encrypted again under the ring's current key (a
    replay's copy, a rotation): both keys fetched by :func:`fetch_key_bounded_sync` when the
    ring fetches from a source. A static ring is left alone: its lookups cannot block, and
    its errors stay those of the decryption itself."""
    if not keyring.fetches or not is_encrypted(message):
        return
    for key_id in (keyring.current_key_id, message.headers.get(HEADER_KEY_ID)):
        if key_id and not keyring.has_key(key_id):
            fetch_key_bounded_sync(keyring, key_id, timeout, waiter=waiter, log=log)


def _retrieved(waiting: Any) -> None:
    """Mark a wait's outcome seen: the fetch's error is read from the fetch itself, and one
    never read was logged when the wait's future was collected ("Future exception was never
    retrieved"), in the middle of whatever ran then."""
    if not waiting.cancelled():
        waiting.exception()


async def _join_fetch(fetch: concurrent.futures.Future[None], key_id: str, timeout: float) -> None:
    """Wait at most ``timeout`` seconds for another caller's fetch of ``key_id``; its error
    is raised here too. The wait's own future is never cancelled: that would cancel the
    shared fetch (asyncio chains a cancellation back to the future it wraps)."""
    import asyncio

    waiting = asyncio.wrap_future(fetch)
    waiting.add_done_callback(_retrieved)
    await asyncio.wait((waiting,), timeout=timeout)
    _joined_outcome(fetch, key_id, timeout)


def _joined_outcome(fetch: concurrent.futures.Future[None], key_id: str, timeout: float) -> None:
    """After a wait of ``timeout`` seconds for another caller's fetch of ``key_id``: its
    outcome, or KeyRingUnavailableError if it is still running."""
    if not fetch.done():
        raise KeyRingUnavailableError(
            f"key {key_id!r}: the keyring's source did not answer within {timeout:g} s"
        )
    if fetch.cancelled():
        raise KeyRingUnavailableError(f"key {key_id!r}: the fetch this one waited for never ran")
    error = fetch.exception()
    if error is not None:
        # A copy of the fetch's error, of its type (KeyNotFoundError stays permanent): one
        # exception object raised by every waiter would gather all their tracebacks.
        try:
            own = copy.copy(error)
        except Exception:  # noqa: BLE001 -- an error type that cannot be copied
            own = KeyRingUnavailableError(f"key {key_id!r}: {error}")
        raise own.with_traceback(None) from error


def _log_late_fetch(
    log: logging.Logger,
    waiter: str,
    key_id: str,
    took: float,
    timeout: float,
    error: BaseException | None,
) -> None:
    """Say how a fetch given up on ended. Its message failed "did not answer within …": a
    KMS client slower to fail than the bound (its own connect timeout, its retries) left
    its real error (access denied, no such key) nowhere, and a key that did arrive unsaid."""
    if error is None:
        log.info(
            "key %r: the keyring's source answered after %.1f s (%s waited %g s); "
            "the key is kept for the message's next attempt",
            key_id,
            took,
            waiter,
            timeout,
        )
        return
    text = redact_text(str(error) or type(error).__name__)
    log.warning(
        "key %r: the keyring's source failed after %.1f s (%s waited %g s): %s",
        key_id,
        took,
        waiter,
        timeout,
        text[:500],
    )


__all__ = [
    "ALGORITHM",
    "DEFAULT_CURRENT_KEY_ENV",
    "DEFAULT_KEYS_ENV",
    "ENCRYPTION_HEADERS",
    "HEADER_DESTINATION",
    "HEADER_ENCRYPTED_CONTENT_TYPE",
    "HEADER_ENCRYPTION",
    "HEADER_KEY_ID",
    "HEADER_SEALED_HEADERS",
    "HEADER_SUBJECT",
    "MAX_ABANDONED_FETCHES",
    "MAX_KEY_ID_LENGTH",
    "DecryptionError",
    "EncryptionError",
    "EnqueueKeyUnavailableError",
    "FileSubjectKeys",
    "KeyNotFoundError",
    "KeyRing",
    "KeyRingUnavailableError",
    "MemorySubjectKeys",
    "SubjectKeyDeletedError",
    "SubjectKeyStore",
    "associated_data",
    "decrypt",
    "encrypt_message",
    "fetch_key_bounded",
    "fetch_key_bounded_sync",
    "fetch_message_keys_sync",
    "generate_key",
    "is_encrypted",
    "is_key_id",
    "keys_in_use",
    "reencrypt",
]
