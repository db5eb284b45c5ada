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

Scheme ``v2`` covers the headers too: v1 leaves the topic, the key, the content type and
the user headers open to a change on the way (or in a captured request sent again within
the tolerance, ahead of the relay's retry), and a receiver dispatches on the topic and
orders by the key. The publisher sends both, and names what v2 covers::

    Outboxer-Signed-Headers: <the covered header names, lower case, ";"-separated>
    Outboxer-Signature: v1=<hex>,v2=<hex HMAC-SHA256(secret, f"{timestamp}.{id}.{digest}.".encode() + body)>

``digest`` is the hex SHA-256 of the canonical headers: the line
``outboxer-signed-headers:<the list as sent>``, then one line ``<name>:<value, stripped>``
per listed name in the listed order, joined with ``\\n`` (UTF-8). The digest has a fixed
length, so the signed bytes still split one way only. :func:`verify_request` checks v2
when the request carries it and returns the covered names: a receiver trusts those
headers and no others. With ``require_signed_headers`` it refuses a request signed with
v1 only, which is what a request stripped of its v2 signature looks like.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from outboxer.errors import ConfigError, OutboxerError

HEADER_ID = "Outboxer-Id"
HEADER_TIMESTAMP = "Outboxer-Timestamp"
HEADER_SIGNATURE = "Outboxer-Signature"
HEADER_SIGNED_HEADERS = "Outboxer-Signed-Headers"
SCHEME = "v1"
SCHEME_V2 = "v2"
#: Seconds a signed request stays acceptable, either side of the receiver's clock.
DEFAULT_TOLERANCE = 300.0
#: Digits a timestamp may have: Unix seconds until the year 33658.
TIMESTAMP_DIGITS = 12

Secret = str | bytes

_TIMESTAMP = re.compile(rf"[0-9]{{1,{TIMESTAMP_DIGITS}}}")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_ENTRY = re.compile(r"([A-Za-z0-9]+)=([0-9a-fA-F]+)")
#: A header name as v2 lists it: an HTTP token in lower case.
_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")
#: Never covered: the signature itself, and what the connection adds or changes on the way.
_UNSIGNED = frozenset({HEADER_SIGNATURE.lower(), HEADER_SIGNED_HEADERS.lower()})


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


def envelope_digest(names: Sequence[str], headers: Mapping[Any, str | bytes]) -> str:
    """The hex SHA-256 of the canonical form of ``headers``' ``names`` (see the module doc);
    WebhookSignatureError 'malformed' if a name is not a lower-case token or is absent."""
    listed = ";".join(names)
    lines = [f"{HEADER_SIGNED_HEADERS.lower()}:{listed}"]
    for name in names:
        if not _NAME.fullmatch(name) or name in _UNSIGNED:
            raise WebhookSignatureError("malformed", f"cannot sign header {name[:60]!r}")
        lines.append(f"{name}:{_header(headers, name)}")
    canonical = "\n".join(lines).encode("utf-8", "surrogateescape")
    return hashlib.sha256(canonical).hexdigest()


def signed_bytes_v2(timestamp: int, message_id: str | uuid.UUID, digest: str, body: bytes) -> bytes:
    """The exact bytes the v2 signature covers (``digest``: see ``envelope_digest``)."""
    return signed_bytes(timestamp, message_id, f"{digest}.".encode() + body)


def sign_headers(
    secret: Secret,
    timestamp: int,
    message_id: str | uuid.UUID,
    headers: Mapping[str, str],
    body: bytes,
) -> dict[str, str]:
    """``Outboxer-Signed-Headers`` and ``Outboxer-Signature`` (v1 and v2) for a request
    that sends ``headers`` (every one of them covered by v2) and ``body``."""
    names = sorted({name.lower() for name in headers} - _UNSIGNED)
    key = _key(secret)
    v2 = _digest(key, signed_bytes_v2(timestamp, message_id, envelope_digest(names, headers), body))
    v1 = _digest(key, signed_bytes(timestamp, message_id, body))
    return {
        HEADER_SIGNED_HEADERS: ";".join(names),
        HEADER_SIGNATURE: f"{SCHEME}={v1},{SCHEME_V2}={v2}",
    }


@dataclass(frozen=True)
class VerifiedRequest:
    """A webhook whose signature checked out: its id, and the header names v2 covered
    (lower case; None when it was signed with v1 only, which covers no header)."""

    message_id: str
    signed_headers: frozenset[str] | None


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
    A v2 signature, when present, is the one checked (see :func:`verify_request`).
    """
    return verify_request(secret, headers, body, tolerance, now=now).message_id


def verify_request(
    secret: Secret | Sequence[Secret],
    headers: Mapping[Any, str | bytes],
    body: bytes | str,
    tolerance: float | None = DEFAULT_TOLERANCE,
    *,
    now: float | None = None,
    require_signed_headers: bool = False,
) -> VerifiedRequest:
    """As :func:`verify_signature`, and which headers the signature covered: v2 when the
    request carries a v2 signature (then its v1 ones are not consulted), else v1, unless
    ``require_signed_headers`` (then 'missing': a v1-only request may be one stripped of
    its v2 signature to pass changed headers)."""
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
    entries = _signatures(raw_signature)
    covered: frozenset[str] | None = None
    if entries.get(SCHEME_V2):
        listed = _header(headers, HEADER_SIGNED_HEADERS)
        names = listed.split(";")
        digest = envelope_digest(names, headers)
        signed = signed_bytes_v2(timestamp, message_id, digest, _body_bytes(body))
        candidates, covered = entries[SCHEME_V2], frozenset(names)
    elif require_signed_headers:
        raise WebhookSignatureError(
            "missing", f"no {SCHEME_V2}= signature: the headers are not signed"
        )
    else:
        signed = signed_bytes(timestamp, message_id, _body_bytes(body))
        candidates = entries.get(SCHEME, [])
    if not candidates:
        raise WebhookSignatureError("malformed", f"{HEADER_SIGNATURE} has no {SCHEME}= signature")
    for key in keys:
        expected = _digest(key, signed)
        # Compare with every candidate (no early exit), in constant time each.
        if sum(hmac.compare_digest(expected, candidate) for candidate in candidates):
            return VerifiedRequest(message_id, covered)
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


def _signatures(header: str) -> dict[str, list[str]]:
    """The hex digests in a signature header, by scheme (unknown schemes are kept apart)."""
    found: dict[str, list[str]] = {}
    for entry in re.split(r"[,\s]+", header.strip()):
        match = _ENTRY.fullmatch(entry)
        if match is None:
            raise WebhookSignatureError(
                "malformed", f"cannot parse {HEADER_SIGNATURE} entry {entry[:80]!r}"
            )
        found.setdefault(match.group(1), []).append(match.group(2).lower())
    return found


__all__ = [
    "DEFAULT_TOLERANCE",
    "HEADER_ID",
    "HEADER_SIGNATURE",
    "HEADER_SIGNED_HEADERS",
    "HEADER_TIMESTAMP",
    "SCHEME",
    "SCHEME_V2",
    "TIMESTAMP_DIGITS",
    "VerifiedRequest",
    "WebhookSignatureError",
    "canonical_id",
    "envelope_digest",
    "sign",
    "sign_headers",
    "signed_bytes",
    "signed_bytes_v2",
    "verify_request",
    "verify_signature",
]
