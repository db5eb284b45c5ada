"""Messages, their states, payload encoding and time-ordered ids."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from outboxer.errors import PayloadError

DEFAULT_DESTINATION = "default"

#: Header names that carry the envelope on brokers without a native field for it.
HEADER_ID = "outboxer-id"
HEADER_TOPIC = "outboxer-topic"
HEADER_KEY = "outboxer-key"
HEADER_CREATED_AT = "outboxer-created-at"
HEADER_CONTENT_TYPE = "content-type"
#: Every header outboxer itself writes (envelope, encryption, claim-check) starts so; a user
#: header of that name would be read as outboxer's own. Refused in any case: HTTP and some
#: brokers fold header names to lower case on the way.
RESERVED_HEADER_PREFIX = "outboxer-"

JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
BINARY = "application/octet-stream"

MAX_TOPIC_LENGTH = 255
MAX_KEY_LENGTH = 255
#: The content_type and destination columns are VARCHAR(255) on MySQL.
MAX_CONTENT_TYPE_LENGTH = 255
MAX_DESTINATION_LENGTH = 255
#: AMQP field-table keys hold at most 128 bytes: a longer header name failed its publish.
MAX_HEADER_NAME_BYTES = 128

_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]+")


class Status(StrEnum):
    """The states of an outbox row; docs/design/message-states.md has the transitions."""

    PENDING = "PENDING"
    PROCESSING = "PROCESSING"
    PUBLISHED = "PUBLISHED"
    FAILED = "FAILED"
    ABANDONED = "ABANDONED"


@dataclass(frozen=True, slots=True)
class Message:
    """One outbox message for one destination, as stored and as published."""

    id: uuid.UUID
    topic: str
    payload: bytes
    key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    content_type: str = JSON
    destination: str = DEFAULT_DESTINATION
    created_at: datetime | None = None
    attempts: int = 0
    #: The store's position of the row (None until stored and claimed).
    seq: int | None = None

    @property
    def stored_seq(self) -> int:
        """``seq``, for a message that came from a store (raises for one that did not)."""
        if self.seq is None:
            raise ValueError(f"message {self.id} has no seq: it was not claimed from a store")
        return self.seq

    def envelope_headers(self) -> dict[str, str]:
        """User headers plus the envelope fields, for brokers that only have headers."""
        carried = dict(self.headers)
        carried[HEADER_ID] = str(self.id)
        carried[HEADER_TOPIC] = self.topic
        carried[HEADER_CONTENT_TYPE] = self.content_type
        if self.key is not None:
            carried[HEADER_KEY] = self.key
        if self.created_at is not None:
            carried[HEADER_CREATED_AT] = self.created_at.isoformat()
        return carried

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe view (payload decoded as text when it is text) for files and logs."""
        body: Any
        if self.content_type == JSON:
            body = json.loads(self.payload)
        elif self.content_type.startswith("text/"):
            body = self.payload.decode("utf-8")
        else:
            body = self.payload.hex()
        return {
            "id": str(self.id),
            "topic": self.topic,
            "key": self.key,
            "headers": dict(self.headers),
            "content_type": self.content_type,
            "destination": self.destination,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "payload": body,
        }


def encode_payload(
    payload: object, content_type: str | None = None, max_bytes: int | None = None
) -> tuple[bytes, str]:
    """Turn a dict, list, str or bytes into stored bytes and a content type.

    Raises PayloadError for anything else, for dicts or lists that JSON cannot
    represent, for text no database stores (see ``check_text``), and for an
    encoded payload over ``max_bytes``, so the caller learns before any SQL runs.
    """
    if content_type is not None:
        check_content_type(content_type)
    body: bytes
    if isinstance(payload, bytes | bytearray | memoryview):
        body, kind = bytes(payload), content_type or BINARY
    elif isinstance(payload, str):
        body = text_bytes(payload, "a text payload", hint="; send bytes for binary data")
        kind = content_type or TEXT
    elif isinstance(payload, dict | list):
        try:
            encoded = json.dumps(
                payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            )
        except (TypeError, ValueError, RecursionError) as exc:
            raise PayloadError(f"payload is not JSON-serializable: {exc}") from exc
        try:
            body = encoded.encode("utf-8")
        except UnicodeEncodeError as exc:
            # JSON could escape it as \udXXX, but parsers that check Unicode refuse that.
            raise PayloadError(
                f"a string in the payload contains a lone surrogate {exc.object[exc.start]!r}: "
                "it is not valid Unicode text"
            ) from None
        kind = content_type or JSON
    else:
        raise PayloadError(
            f"payload must be dict, list, str or bytes, not {type(payload).__name__}"
        )
    if max_bytes is not None and len(body) > max_bytes:
        raise PayloadError(
            f"the payload is {len(body)} bytes encoded, over max_payload_bytes={max_bytes}"
        )
    return body, kind


def check_text(value: str, what: str) -> None:
    """Refuse text that a database cannot store, before the driver finds out mid-transaction.

    A NUL is refused by PostgreSQL's text and jsonb (psycopg refuses it client-side; asyncpg
    sends it and the server aborts the caller's transaction). A lone surrogate cannot be
    encoded as UTF-8, so every driver fails on it, some after the transaction began.
    """
    text_bytes(value, what)


def text_bytes(value: str, what: str, *, hint: str = "") -> bytes:
    """``value`` as UTF-8, or PayloadError naming ``what`` if it holds a NUL or a lone surrogate."""
    if "\x00" in value:
        raise PayloadError(f"{what} contains a NUL character (\\x00){hint}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(
            f"{what} contains a lone surrogate {value[exc.start]!r} at index {exc.start}: "
            f"it is not valid Unicode text{hint}"
        ) from None


def destination_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a destination (None: it can). A destination is a name of 1 to
    MAX_DESTINATION_LENGTH characters, storable text, without whitespace around it: MySQL's
    utf8mb4_bin collation pads with spaces, so 'orders ' and 'orders' were one destination
    there (the relay of 'orders' claimed the other's rows) and two elsewhere (nobody
    claimed them)."""
    if not isinstance(name, str) or not name or len(name) > MAX_DESTINATION_LENGTH:
        return (
            f"a destination name must be a string of 1 to {MAX_DESTINATION_LENGTH} "
            f"characters; got {name!r:.80}"
        )
    if name.strip() != name:
        return (
            f"a destination name must not begin or end with whitespace; got {name!r:.80} "
            f"(did you mean {name.strip()!r:.80}?)"
        )
    try:
        check_text(name, "a destination name")
    except PayloadError as exc:
        return f"{exc}; got {name!r:.80}"
    return None


def check_content_type(content_type: object) -> None:
    # A media type is printable ASCII (RFC 9110, 8.3); it goes into broker and HTTP headers.
    if (
        not isinstance(content_type, str)
        or not content_type
        or len(content_type) > MAX_CONTENT_TYPE_LENGTH
        or not _PRINTABLE_ASCII.fullmatch(content_type)
    ):
        raise PayloadError(
            "content_type must be None or a media type of at most "
            f"{MAX_CONTENT_TYPE_LENGTH} printable ASCII characters; got {content_type!r:.80}"
        )


def validate_envelope(
    topic: object, key: object, headers: object
) -> tuple[str, str | None, dict[str, str]]:
    """Check topic, key and headers at the boundary; return them normalised."""
    if not isinstance(topic, str) or not topic or len(topic) > MAX_TOPIC_LENGTH:
        raise PayloadError(
            f"topic must be a non-empty string of at most {MAX_TOPIC_LENGTH} characters"
        )
    check_text(topic, "the topic")
    if key is not None:
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
            raise PayloadError(
                f"key must be None or a non-empty string of at most {MAX_KEY_LENGTH} characters"
            )
        check_text(key, "the key")
    if headers is None:
        return topic, key, {}
    if not isinstance(headers, Mapping):
        raise PayloadError(f"headers must be a mapping of str to str, not {type(headers).__name__}")
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str) or not name:
            raise PayloadError(
                f"headers must map non-empty str to str; got {name!r:.80}: {value!r:.80}"
            )
        if name.lower().startswith(RESERVED_HEADER_PREFIX):
            # Brokers with headers only carry the envelope beside the user's headers: a user
            # "outboxer-key" on a keyless message would reach consumers as its key, and a
            # forged encryption or claim-check header would make the relay misread the row.
            raise PayloadError(
                f"the header name {name!r:.80} is reserved: names starting with "
                f"{RESERVED_HEADER_PREFIX!r} (in any case) carry outboxer's own envelope"
            )
        if name.lower() == HEADER_CONTENT_TYPE:
            # The envelope's content type travels under this name on Kafka, NATS, MQTT and
            # in AMQP's headers, and HTTP folds the case: a user header of that name was
            # overwritten by it, then dropped from the delivery as envelope.
            raise PayloadError(
                f"the header name {name!r:.80} is reserved: the content type is the "
                "content_type argument of enqueue"
            )
        check_text(name, f"the header name {name!r:.80}")
        if len(name) > MAX_HEADER_NAME_BYTES // 4 and len(name.encode()) > MAX_HEADER_NAME_BYTES:
            raise PayloadError(
                f"the header name {name!r:.80} is {len(name.encode())} bytes in UTF-8, over "
                f"{MAX_HEADER_NAME_BYTES} (AMQP's limit for a header name)"
            )
        check_text(value, f"the value of header {name!r:.80}")
    return topic, key, dict(headers)


def coerce_message_id(message_id: object) -> uuid.UUID:
    if message_id is None:
        return uuid7()
    if isinstance(message_id, uuid.UUID):
        return message_id
    if isinstance(message_id, str):
        try:
            return uuid.UUID(message_id)
        except ValueError as exc:
            raise PayloadError(f"message_id is not a UUID: {message_id!r:.80}") from exc
    raise PayloadError(
        f"message_id must be a UUID or a UUID string, not {type(message_id).__name__}"
    )


_uuid7_lock = threading.Lock()
_uuid7_last = [0, 0]  # last millisecond, last 12-bit counter


def uuid7() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds, then random bits.

    Ids made in one process are strictly increasing: within one millisecond a
    12-bit counter (seeded randomly) takes the place of rand_a, so ids sort in
    creation order, which keeps the primary-key index append-only.
    """
    with _uuid7_lock:
        millis = time.time_ns() // 1_000_000
        last_millis, counter = _uuid7_last
        if millis <= last_millis:
            millis = last_millis
            counter += 1
            if counter > 0xFFF:  # counter overflow: borrow the next millisecond
                millis += 1
                counter = int.from_bytes(os.urandom(2), "big") & 0x7FF
        else:
            counter = int.from_bytes(os.urandom(2), "big") & 0x7FF
        _uuid7_last[0], _uuid7_last[1] = millis, counter
    rand_b = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (millis & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= counter << 64
    value |= 0b10 << 62
    value |= rand_b
    return uuid.UUID(int=value)
