"""Sign outboxer webhooks and verify them on the receiving side (standard library only).

Scheme ``v1``. The publisher sends, with every POST::

    Outboxer-Id: <message id>
    Outboxer-Timestamp: <Unix time in whole seconds, when the request was signed>
    Outboxer-Signature: v1=<hex HMAC-SHA256(secret, f"{timestamp}.{id}.".encode() + body)>

The signed bytes are the timestamp, a dot, the message id, a dot, then the raw
request body exactly as received. The timestamp bounds how long a captured
request can be replayed; the id stops a signature from being replayed with
another message's id (receivers deduplicate on the id anyway). Headers other
than these are not signed.

A receiver calls :func:`verify_signature` with the raw body (before any JSON
parsing) and the request headers::

    from outboxer.webhook_signature import WebhookSignatureError, verify_signature

    try:
        message_id = verify_signature(SECRET, request.headers, request.body)
    except WebhookSignatureError as exc:
        return 401, exc.reason

The header may carry several signatures separated by commas (``v1=…,v1=…``);
one match is enough, so secrets can be rotated without downtime.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Mapping, Sequence

from outboxer.errors import OutboxerError

HEADER_ID = "Outboxer-Id"
HEADER_TIMESTAMP = "Outboxer-Timestamp"
HEADER_SIGNATURE = "Outboxer-Signature"
SCHEME = "v1"
#: Seconds a signed request stays acceptable, either side of the receiver's clock.
DEFAULT_TOLERANCE = 300.0

Secret = str | bytes


class WebhookSignatureError(OutboxerError):
    """A webhook request whose signature does not check out; answer it with 401.

    ``reason`` is one of ``missing`` (a header is absent), ``malformed`` (a
    header cannot be parsed), ``expired`` (the timestamp is outside the
    tolerance) or ``mismatch`` (no signature matches any secret).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"webhook signature {reason}: {detail}")
        self.reason = reason


def signed_bytes(timestamp: int, message_id: str, body: bytes) -> bytes:
    """The exact bytes the v1 signature covers."""
    return f"{timestamp}.{message_id}.".encode() + body


def sign(secret: Secret, timestamp: int, message_id: str, body: bytes) -> str:
    """The ``Outboxer-Signature`` header value for one request (``v1=<hex>``)."""
    return f"{SCHEME}={_digest(secret, timestamp, message_id, body)}"


def verify_signature(
    secret: Secret | Sequence[Secret],
    headers: Mapping[str, str],
    body: bytes,
    tolerance: float | None = DEFAULT_TOLERANCE,
    *,
    now: float | None = None,
) -> str:
    """Check a received webhook and return its message id; raise WebhookSignatureError if not.

    ``secret`` may be one secret or several (during a rotation). ``headers``
    is looked up without regard to case. ``tolerance`` is in seconds
    (``None`` turns the timestamp check off; not recommended).
    """
    secrets = [secret] if isinstance(secret, str | bytes) else list(secret)
    if not secrets or any(not s for s in secrets):
        raise ValueError("verify_signature needs a non-empty secret")
    message_id = _header(headers, HEADER_ID)
    raw_timestamp = _header(headers, HEADER_TIMESTAMP)
    raw_signature = _header(headers, HEADER_SIGNATURE)
    if not raw_timestamp.isdigit() or not raw_timestamp.isascii():
        raise WebhookSignatureError(
            "malformed", f"{HEADER_TIMESTAMP} is not Unix seconds: {raw_timestamp[:40]!r}"
        )
    timestamp = int(raw_timestamp)
    if tolerance is not None:
        current = time.time() if now is None else now
        if abs(current - timestamp) > tolerance:
            raise WebhookSignatureError(
                "expired",
                f"signed at {timestamp}, {current - timestamp:+.0f}s from now (tolerance {tolerance:g}s)",
            )
    candidates = _signatures(raw_signature)
    for key in secrets:
        expected = _digest(key, timestamp, message_id, body)
        # Compare with every candidate (no early exit), in constant time each.
        if sum(hmac.compare_digest(expected, candidate) for candidate in candidates):
            return message_id
    raise WebhookSignatureError("mismatch", "no signature matches the secret")


def _digest(secret: Secret, timestamp: int, message_id: str, body: bytes) -> str:
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    return hmac.new(key, signed_bytes(timestamp, message_id, body), hashlib.sha256).hexdigest()


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None:
        lowered = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lowered), None)
    if value is None or not value.strip():
        raise WebhookSignatureError("missing", f"no {name} header")
    return value.strip()


_ENTRY = re.compile(r"^([A-Za-z0-9]+)=([0-9a-fA-F]+)$")


def _signatures(header: str) -> list[str]:
    """The v1 hex digests in a signature header (other schemes are ignored)."""
    found: list[str] = []
    for entry in re.split(r"[,\s]+", header.strip()):
        match = _ENTRY.match(entry)
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
    "WebhookSignatureError",
    "sign",
    "signed_bytes",
    "verify_signature",
]
