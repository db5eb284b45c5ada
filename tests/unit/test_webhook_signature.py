"""The webhook signature scheme, as a receiver checks it."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from outboxer.webhook_signature import (
    HEADER_ID,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    WebhookSignatureError,
    sign,
    signed_bytes,
    verify_signature,
)

NOW = 1_700_000_000
MESSAGE_ID = "01890a5d-ac96-774b-bcce-b302099a8057"
BODY = b'{"order":7}'


def headers(
    secret: str = "s3cret",
    *,
    timestamp: int = NOW,
    message_id: str = MESSAGE_ID,
    body: bytes = BODY,
) -> dict[str, str]:
    return {
        HEADER_ID: message_id,
        HEADER_TIMESTAMP: str(timestamp),
        HEADER_SIGNATURE: sign(secret, timestamp, message_id, body),
    }


def test_the_documented_scheme() -> None:
    expected = hmac.new(
        b"s3cret", f"{NOW}.{MESSAGE_ID}.".encode() + BODY, hashlib.sha256
    ).hexdigest()
    assert signed_bytes(NOW, MESSAGE_ID, BODY) == f"{NOW}.{MESSAGE_ID}.".encode() + BODY
    assert sign("s3cret", NOW, MESSAGE_ID, BODY) == f"v1={expected}"
    assert sign(b"s3cret", NOW, MESSAGE_ID, BODY) == f"v1={expected}"


def test_a_valid_request_returns_its_message_id() -> None:
    assert verify_signature("s3cret", headers(), BODY, now=NOW + 10) == MESSAGE_ID


def test_header_names_are_case_insensitive() -> None:
    lowered = {name.lower(): value for name, value in headers().items()}
    assert verify_signature("s3cret", lowered, BODY, now=NOW) == MESSAGE_ID


@pytest.mark.parametrize(
    ("secret", "sent", "body", "reason"),
    [
        ("s3cret", headers(), BODY + b" ", "mismatch"),
        ("wrong", headers(), BODY, "mismatch"),
        # A signature replayed with another message's id:
        (
            "s3cret",
            {**headers(), HEADER_ID: "01890a5d-0000-774b-bcce-b302099a8057"},
            BODY,
            "mismatch",
        ),
        # A signature replayed with another timestamp:
        ("s3cret", {**headers(), HEADER_TIMESTAMP: str(NOW + 1)}, BODY, "mismatch"),
        ("s3cret", {k: v for k, v in headers().items() if k != HEADER_SIGNATURE}, BODY, "missing"),
        ("s3cret", {k: v for k, v in headers().items() if k != HEADER_ID}, BODY, "missing"),
        ("s3cret", {k: v for k, v in headers().items() if k != HEADER_TIMESTAMP}, BODY, "missing"),
        ("s3cret", {**headers(), HEADER_TIMESTAMP: "yesterday"}, BODY, "malformed"),
        ("s3cret", {**headers(), HEADER_TIMESTAMP: "-5"}, BODY, "malformed"),
        ("s3cret", {**headers(), HEADER_SIGNATURE: "sha256"}, BODY, "malformed"),
        ("s3cret", {**headers(), HEADER_SIGNATURE: "v0=abcd"}, BODY, "malformed"),
    ],
)
def test_bad_requests_raise_a_typed_error(
    secret: str, sent: dict[str, str], body: bytes, reason: str
) -> None:
    with pytest.raises(WebhookSignatureError) as raised:
        verify_signature(secret, sent, body, now=NOW)
    assert raised.value.reason == reason


@pytest.mark.parametrize("offset", [-301, 301, 10_000])
def test_timestamps_outside_the_tolerance_expire(offset: int) -> None:
    with pytest.raises(WebhookSignatureError) as raised:
        verify_signature("s3cret", headers(), BODY, now=NOW + offset)
    assert raised.value.reason == "expired"


def test_tolerance_is_configurable_and_can_be_turned_off() -> None:
    assert verify_signature("s3cret", headers(), BODY, tolerance=1000, now=NOW + 999) == MESSAGE_ID
    assert (
        verify_signature("s3cret", headers(), BODY, tolerance=None, now=NOW + 10**6) == MESSAGE_ID
    )
    with pytest.raises(WebhookSignatureError):
        verify_signature("s3cret", headers(), BODY, tolerance=5, now=NOW + 6)


def test_rotation_several_secrets_and_several_signatures() -> None:
    sent = headers("old")
    assert verify_signature(["new", "old"], sent, BODY, now=NOW) == MESSAGE_ID
    both = f"{sign('new', NOW, MESSAGE_ID, BODY)}, {sign('old', NOW, MESSAGE_ID, BODY)}"
    assert verify_signature("old", {**sent, HEADER_SIGNATURE: both}, BODY, now=NOW) == MESSAGE_ID
    future = f"v2=abcdef,{sign('old', NOW, MESSAGE_ID, BODY)}"  # unknown schemes are ignored
    assert verify_signature("old", {**sent, HEADER_SIGNATURE: future}, BODY, now=NOW) == MESSAGE_ID


def test_an_empty_secret_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="secret"):
        verify_signature("", headers(), BODY, now=NOW)
    with pytest.raises(ValueError, match="secret"):
        verify_signature([], headers(), BODY, now=NOW)
