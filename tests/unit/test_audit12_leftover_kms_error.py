"""A key source's (KMS's) own exception text went whole into KeyRingUnavailableError, and from
there into logs, dead letters and the relay's errors: a KMS that quotes a whole response
body made a megabyte of error text, and one that quotes a signed URL leaked its credentials.
It is now masked as log lines are and cut."""

from __future__ import annotations

import base64
import os

import pytest

from outboxer.crypto import KeyRing, KeyRingUnavailableError
from outboxer.redact import register_secret

SECRET = "kms-token-" + "7f3a9c2e41d8b6"
REGISTERED = "registered-" + "a" * 20


def failing_fetch(key_id: str) -> bytes:
    raise RuntimeError(
        f"GET https://svc:{SECRET}@kms.example/v1/keys/{key_id} answered 503: {REGISTERED} "
        + "x" * 1_000_000
    )


def test_a_kms_error_text_is_cut_and_redacted() -> None:
    key = base64.b64encode(os.urandom(32)).decode()
    register_secret(REGISTERED)
    ring = KeyRing({"k1": key}, "k1")
    stored, headers = ring.encrypt(b"secret payload", message_id="m1", destination="default")
    failing = KeyRing.from_callable(failing_fetch, "k1")
    with pytest.raises(KeyRingUnavailableError) as caught:
        failing.decrypt_payload(stored, headers, message_id="m1", destination="default")
    text = str(caught.value)
    assert len(text) < 500, len(text)
    assert SECRET not in text and REGISTERED not in text
    assert text.startswith("fetching key 'k1' failed: RuntimeError: GET https://svc:")
    assert "[cut: " in text


def test_a_short_kms_error_is_kept_whole() -> None:
    def fetch(key_id: str) -> bytes:
        raise TimeoutError("KMS did not answer within 2s")

    with pytest.raises(
        KeyRingUnavailableError, match=r"TimeoutError: KMS did not answer within 2s$"
    ):
        KeyRing.from_callable(fetch, "k1").key("k1")
