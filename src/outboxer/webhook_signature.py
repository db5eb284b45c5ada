"""Sign outboxer webhooks and verify them on the receiving side (standard library only).

Scheme ``v1``. The publisher sends, with every POST::

    Outboxer-Id: <message id: a UUID, 8-4-4-4-12 hex digits>
    Outboxer-Timestamp: <Unix time in whole seconds, when the request was signed: 1 to 12 digits>
    Outboxer-Signature: v1=<hex HMAC-SHA256(secret, f"{timestamp}.{id}.".encode() + body)>

The signed bytes are the timestamp in decimal (no sign, no leading zeros), a
dot, the message id in its canonical form (36 characters: lower-case hex and
four hyphens), a dot, then the raw request body exactly as received. Neither the
timestamp nor the id can hold a dot and the id has a fixed length, so the signed
bytes split back into timestamp, id and body in one way only: a captured request
cannot be made to verify with another id by moving bytes between the id and the
body. The timestamp bounds how long a captured request can be replayed; the id
stops a signature from being replayed with another message's id (receivers
deduplicate on the id anyway). Headers other than these are not signed.

A receiver calls :func:`verify_signature` with the raw body (before any JSON
parsing) and the request headers::

    from outboxer.webhook_signature import WebhookSignatureError, verify_signature

    try:
        message_id = verify_signature(SECRET, request.headers, request.body)
    except WebhookSignatureError as exc:
        return 401, exc.reason

Whatever the request holds, :func:`verify_signature` returns the canonical id or
raises :class:`WebhookSignatureError`; only an unusable secret (the receiver's
own setting) raises :class:`~outboxer.errors.ConfigError` instead.

The header may carry several signatures separated by commas (``v1=…,v1=…``);
one match is enough, so secrets can be rotated without downtime.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from outboxer.errors import ConfigError, OutboxerError

HEADER_ID = "Outboxer-Id"
HEADER_TIMESTAMP = "Outboxer-Timestamp"
HEADER_SIGNATURE = "Outboxer-Signature"
SCHEME = "v1"
#: Seconds a signed request stays acceptable, either side of the receiver's clock.
DEFAULT_TOLERANCE = 300.0
#: Digits a timestamp may have: Unix seconds until the year 33658.
TIMESTAMP_DIGITS = 12

Secret = str | bytes

_TIMESTAMP = re.compile(rf"[0-9]{{1,{TIMESTAMP_DIGITS}}}")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_ENTRY = re.compile(r"([A-Za-z0-9]+)=([0-9a-fA-F]+)")


class WebhookSignatureError(OutboxerError):
    """A webhook request whose signature does not check out; answer it with 401.

    ``reason`` is one of ``missing`` (a header is absent), ``malformed`` (a
    header cannot be parsed), ``expired`` (the timestamp is outside the
    tolerance) or ``mismatch`` (no signature matches any secret).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"webhook signature {reason}: {detail}")
        self.reason = reason


def signed_bytes(timestamp: int, message_id: str | uuid.UUID, body: bytes) -> bytes:
    """The exact bytes the v1 signature covers; ValueError for an id that is not a UUID or
    a timestamp outside 0 to 12 digits (they could not be told apart from the body)."""
    if not 0 <= timestamp < 10**TIMESTAMP_DIGITS:
        raise ValueError(f"a webhook timestamp has 1 to {TIMESTAMP_DIGITS} digits: {timestamp}")
    return f"{timestamp}.{canonical_id(message_id)}.".encode() + body


def canonical_id(message_id: str | uuid.UUID) -> str:
    """The id as it is signed: a UUID's 36-character lower-case form; ValueError if it is
    not a UUID written 8-4-4-4-12."""
    if isinstance(message_id, uuid.UUID):
        return str(message_id)
    if not _UUID.fullmatch(message_id):
        raise ValueError(f"a webhook message id is a UUID (8-4-4-4-12 hex): {message_id[:60]!r}")
    return message_id.lower()


def sign(secret: Secret, timestamp: int, message_id: str | uuid.UUID, body: bytes) -> str:
    """The ``Outboxer-Signature`` header value for one request (``v1=<hex>``)."""
    return f"{SCHEME}={_digest(_key(secret), signed_bytes(timestamp, message_id, body))}"


def verify_signature(
    secret: Secret | Sequence[Secret],
    headers: Mapping[Any, str | bytes],
    body: bytes | str,
    tolerance: float | None = DEFAULT_TOLERANCE,
    *,
    now: float | None = None,
) -> str:
    """Check a received webhook and return its message id (canonical: lower case); raise
    WebhookSignatureError if it does not check out, whatever the headers and body hold.

    ``secret`` may be one secret or several (during a rotation); ConfigError if one is
    empty. ``headers`` is looked up without regard to case; names and values may be
    text or bytes (ASCII). ``body`` is the raw body; text is taken as its UTF-8 encoding.
    ``tolerance`` is in seconds (``None`` turns the timestamp check off; not recommended).
    """
    keys = [_key(s) for s in ([secret] if isinstance(secret, str | bytes) else list(secret))]
    if not keys:
        raise ConfigError("verify_signature needs a secret")
    raw_id = _header(headers, HEADER_ID)
    raw_timestamp = _header(headers, HEADER_TIMESTAMP)
    raw_signature = _header(headers, HEADER_SIGNATURE)
    try:
        message_id = canonical_id(raw_id)
    except ValueError:
        raise WebhookSignatureError(
            "malformed", f"{HEADER_ID} is not a UUID: {raw_id[:60]!r}"
        ) from None
    if not _TIMESTAMP.fullmatch(raw_timestamp):
        raise WebhookSignatureError(
            "malformed",
            f"{HEADER_TIMESTAMP} is not Unix seconds (1 to {TIMESTAMP_DIGITS} digits): "
            f"{raw_timestamp[:40]!r}",
        )
    timestamp = int(raw_timestamp)
    if tolerance is not None:
        current = time.time() if now is None else now
        if not abs(current - timestamp) <= tolerance:  # a NaN clock fails too
            raise WebhookSignatureError(
                "expired",
                f"signed at {timestamp}, {current - timestamp:+.0f}s from now (tolerance {tolerance:g}s)",
            )
    candidates = _signatures(raw_signature)
    signed = signed_bytes(timestamp, message_id, _body_bytes(body))
    for key in keys:
        expected = _digest(key, signed)
        # Compare with every candidate (no early exit), in constant time each.
        if sum(hmac.compare_digest(expected, candidate) for candidate in candidates):
            return message_id
    raise WebhookSignatureError("mismatch", "no signature matches the secret")


def _key(secret: object) -> bytes:
    """A secret as HMAC key bytes; ConfigError for an empty or unusable one."""
    if isinstance(secret, str):
        try:
            secret = secret.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError("a webhook secret must be text that UTF-8 can encode") from None
    if not isinstance(secret, bytes) or not secret:
        raise ConfigError("a webhook secret must be non-empty text or bytes")
    return secret


def _digest(key: bytes, signed: bytes) -> str:
    return hmac.new(key, signed, hashlib.sha256).hexdigest()


def _body_bytes(body: bytes | str) -> bytes:
    if isinstance(body, bytes):
        return body
    try:  # text decoded with surrogateescape encodes back to the bytes received
        return body.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise WebhookSignatureError(
            "malformed", "the body is text that UTF-8 cannot encode"
        ) from None


def _header(headers: Mapping[Any, str | bytes], name: str) -> str:
    """A header's value as text, stripped; 'missing' if absent or blank, 'malformed' if it
    is not ASCII text."""
    value: object = headers.get(name)
    if value is None:
        lowered = name.lower()
        value = next((v for k, v in headers.items() if _lower_name(k) == lowered), None)
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")  # a non-ASCII byte then fails to parse
    if value is None or (isinstance(value, str) and not value.strip()):
        raise WebhookSignatureError("missing", f"no {name} header")
    if not isinstance(value, str):
        raise WebhookSignatureError("malformed", f"{name} is not text: {type(value).__name__}")
    return value.strip()


def _lower_name(name: object) -> str | None:
    if isinstance(name, bytes):
        return name.decode("latin-1").lower()
    return name.lower() if isinstance(name, str) else None


def _signatures(header: str) -> list[str]:
    """The v1 hex digests in a signature header (other schemes are ignored)."""
    found: list[str] = []
    for entry in re.split(r"[,\s]+", header.strip()):
        match = _ENTRY.fullmatch(entry)
        if match is None:
            raise WebhookSignatureError(
                "malformed", f"cannot parse {HEADER_SIGNATURE} entry {entry[:80]!r}"
            )
        if match.group(1) == SCHEME:
            found.append(match.group(2).lower())
    if not found:
        raise WebhookSignatureError("malformed", f"{HEADER_SIGNATURE} has no {SCHEME}= signature")
    return found


__all__ = [
    "DEFAULT_TOLERANCE",
    "HEADER_ID",
    "HEADER_SIGNATURE",
    "HEADER_TIMESTAMP",
    "SCHEME",
    "TIMESTAMP_DIGITS",
    "WebhookSignatureError",
    "canonical_id",
    "sign",
    "signed_bytes",
    "verify_signature",
]
