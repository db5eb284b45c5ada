"""The webhook signature scheme, as a receiver checks it."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outboxer.errors import ConfigError
from outboxer.webhook_signature import (
    DEFAULT_TOLERANCE,
    HEADER_ID,
    HEADER_SIGNATURE,
    HEADER_SIGNED_HEADERS,
    HEADER_TIMESTAMP,
    TIMESTAMP_DIGITS,
    WebhookSignatureError,
    envelope_digest,
    sign,
    sign_headers,
    signed_bytes,
    signed_bytes_v2,
    verify_request,
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
    future = f"v3=abcdef,{sign('old', NOW, MESSAGE_ID, BODY)}"  # unknown schemes are ignored
    assert verify_signature("old", {**sent, HEADER_SIGNATURE: future}, BODY, now=NOW) == MESSAGE_ID


@pytest.mark.parametrize("secret", ["", b"", [], ["ok", ""], "\udc80"])
def test_an_unusable_secret_is_a_config_error(secret: object) -> None:
    with pytest.raises(ConfigError, match="secret"):
        verify_signature(secret, headers(), BODY, now=NOW)  # type: ignore[arg-type]


def test_bytes_moved_between_the_id_and_the_body_do_not_verify() -> None:
    """The signed text of id U and body ``order.7`` is also that of id ``U.order`` and body
    ``7``: only a UUID is taken as the id, so the shifted request is refused."""
    body = b"order.7"
    captured = headers(body=body)
    assert verify_signature("s3cret", captured, body, now=NOW) == MESSAGE_ID
    shifted = {**captured, HEADER_ID: f"{MESSAGE_ID}.order"}
    assert signed_bytes(NOW, MESSAGE_ID, body) == f"{NOW}.{MESSAGE_ID}.order.".encode() + b"7"
    with pytest.raises(WebhookSignatureError) as raised:
        verify_signature("s3cret", shifted, b"7", now=NOW)
    assert raised.value.reason == "malformed"


def test_the_id_is_returned_in_canonical_form() -> None:
    sent = {**headers(), HEADER_ID: MESSAGE_ID.upper()}
    assert verify_signature("s3cret", sent, BODY, now=NOW) == MESSAGE_ID
    for not_canonical in (
        MESSAGE_ID.replace("-", ""),
        f"{{{MESSAGE_ID}}}",
        f"urn:uuid:{MESSAGE_ID}",
    ):
        with pytest.raises(WebhookSignatureError) as raised:
            verify_signature("s3cret", {**headers(), HEADER_ID: not_canonical}, BODY, now=NOW)
        assert raised.value.reason == "malformed"
    with pytest.raises(ValueError, match="UUID"):
        sign("s3cret", NOW, "not-a-uuid", BODY)


def test_timestamps_have_at_most_twelve_digits() -> None:
    biggest = 10**TIMESTAMP_DIGITS - 1
    sent = headers(timestamp=biggest)
    assert verify_signature("s3cret", sent, BODY, tolerance=None) == MESSAGE_ID
    for too_long in ("1" * 13, "0" * 13, "9" * 5000):  # int() refuses over 4300 digits
        with pytest.raises(WebhookSignatureError) as raised:
            verify_signature("s3cret", {**sent, HEADER_TIMESTAMP: too_long}, BODY, tolerance=None)
        assert raised.value.reason == "malformed"
    with pytest.raises(ValueError, match="digits"):
        sign("s3cret", biggest + 1, MESSAGE_ID, BODY)


def test_headers_and_body_may_be_bytes_or_text() -> None:
    raw = {name.lower().encode(): value.encode() for name, value in headers().items()}
    assert verify_signature("s3cret", raw, BODY, now=NOW) == MESSAGE_ID
    assert verify_signature("s3cret", headers(), BODY.decode(), now=NOW) == MESSAGE_ID
    with pytest.raises(WebhookSignatureError) as raised:
        verify_signature("s3cret", {**headers(), HEADER_ID: b"\xff" * 36}, BODY, now=NOW)
    assert raised.value.reason == "malformed"


# ----- fuzzing: whatever a request holds, a result or WebhookSignatureError ----------------

TEXT_OR_BYTES = st.one_of(st.text(max_size=80), st.binary(max_size=80))


def variants(valid: str) -> st.SearchStrategy[str | bytes | None]:
    """A header value: the valid one (as text or bytes), something else, or absent (None)."""
    return st.one_of(
        st.just(valid),
        st.just(valid.encode()),
        st.builds(lambda text: valid + text, st.text(max_size=8)),
        TEXT_OR_BYTES,
        st.none(),
    )


@st.composite
def requests(draw: st.DrawFn) -> dict[object, str | bytes]:
    """Headers near a valid request's, so the checks past the first are reached too."""
    timestamps = st.one_of(
        variants(str(NOW)),
        st.builds(lambda n: "9" * n, st.integers(min_value=0, max_value=6000)),
        st.builds(str, st.integers(min_value=-(10**15), max_value=10**15)),
    )
    signatures = st.one_of(
        variants(sign("s3cret", NOW, MESSAGE_ID, BODY)),
        st.builds(lambda a, b: f"{a}={b}", st.text(max_size=5), st.text(max_size=70)),
    )
    sent: dict[object, str | bytes] = draw(
        st.dictionaries(TEXT_OR_BYTES, TEXT_OR_BYTES, max_size=3)
    )
    for name, values in (
        (HEADER_ID, variants(MESSAGE_ID)),
        (HEADER_TIMESTAMP, timestamps),
        (HEADER_SIGNATURE, signatures),
    ):
        value = draw(values)
        if value is not None:
            spelled = draw(st.sampled_from([name, name.lower(), name.upper(), name.encode()]))
            sent[spelled] = value
    return sent


@settings(max_examples=500, deadline=None)
@given(
    headers=requests(),
    body=st.one_of(
        st.just(BODY), st.just(BODY.decode()), st.binary(max_size=64), st.text(max_size=64)
    ),
    tolerance=st.one_of(st.none(), st.just(DEFAULT_TOLERANCE), st.floats()),
    now=st.one_of(st.none(), st.just(float(NOW)), st.floats()),
)
def test_any_request_gives_an_id_or_a_signature_error(
    headers: dict[object, str | bytes],
    body: bytes | str,
    tolerance: float | None,
    now: float | None,
) -> None:
    try:
        message_id = verify_signature(["s3cret", b"other"], headers, body, tolerance, now=now)
    except WebhookSignatureError as exc:
        assert exc.reason in ("missing", "malformed", "expired", "mismatch")
    else:
        assert message_id == MESSAGE_ID and body in (BODY, BODY.decode())


def signed_v2(secret: str = "s3cret", **extra: str) -> dict[str, str]:
    """A request's headers as the webhook publisher sends them, signed with v1 and v2."""
    sent = {
        "Content-Type": "application/json",
        HEADER_ID: MESSAGE_ID,
        "Outboxer-Topic": "order.placed",
        "Outboxer-Key": "customer-7",
        HEADER_TIMESTAMP: str(NOW),
        **extra,
    }
    return {**sent, **sign_headers(secret, NOW, MESSAGE_ID, sent, BODY)}


def test_v2_covers_the_topic_key_content_type_and_user_headers() -> None:
    sent = signed_v2(traceparent="00-abc-01")
    verified = verify_request("s3cret", sent, BODY, now=NOW, require_signed_headers=True)
    assert verified.message_id == MESSAGE_ID
    assert verified.signed_headers == {
        "content-type",
        "outboxer-id",
        "outboxer-key",
        "outboxer-timestamp",
        "outboxer-topic",
        "traceparent",
    }
    assert verify_signature("s3cret", sent, BODY, now=NOW) == MESSAGE_ID
    # The v1 part still verifies for a receiver that knows v1 only.
    v1_only = {**sent, HEADER_SIGNATURE: sent[HEADER_SIGNATURE].split(",")[0]}
    assert verify_signature("s3cret", v1_only, BODY, now=NOW) == MESSAGE_ID


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("Outboxer-Topic", "order.cancelled"),
        ("Outboxer-Key", "customer-8"),
        ("Content-Type", "text/plain"),
        ("traceparent", "00-evil-01"),
        (HEADER_SIGNED_HEADERS, "outboxer-id;outboxer-timestamp"),
    ],
)
def test_a_covered_header_changed_on_the_way_does_not_verify(name: str, value: str) -> None:
    tampered = {**signed_v2(traceparent="00-abc-01"), name: value}
    with pytest.raises(WebhookSignatureError) as raised:
        verify_request("s3cret", tampered, BODY, now=NOW)
    assert raised.value.reason == "mismatch"


def test_a_header_added_on_the_way_is_not_among_the_covered_ones() -> None:
    added = {**signed_v2(), "Outboxer-Header-Role": "admin", "X-Forwarded-For": "10.0.0.1"}
    verified = verify_request("s3cret", added, BODY, now=NOW)
    assert verified.signed_headers is not None
    assert "outboxer-header-role" not in verified.signed_headers
    assert "x-forwarded-for" not in verified.signed_headers


def test_a_request_stripped_of_its_v2_signature_is_refused_when_headers_must_be_signed() -> None:
    sent = signed_v2()
    stripped = {**sent, HEADER_SIGNATURE: sent[HEADER_SIGNATURE].split(",")[0]}
    del stripped[HEADER_SIGNED_HEADERS]
    with pytest.raises(WebhookSignatureError) as raised:
        verify_request("s3cret", stripped, BODY, now=NOW, require_signed_headers=True)
    assert raised.value.reason == "missing"
    assert verify_request("s3cret", stripped, BODY, now=NOW).signed_headers is None


def test_v2_signed_bytes_split_one_way_only() -> None:
    digest = envelope_digest(["outboxer-id"], {HEADER_ID: MESSAGE_ID})
    assert len(digest) == 64
    assert signed_bytes_v2(NOW, MESSAGE_ID, digest, BODY) == (
        f"{NOW}.{MESSAGE_ID}.{digest}.".encode() + BODY
    )
    lines = f"outboxer-signed-headers:outboxer-id\noutboxer-id:{MESSAGE_ID}"
    assert digest == hashlib.sha256(lines.encode()).hexdigest()
