"""The ``outboxer keys rotate`` command, run as an operator runs it (its own process),
against an S3 endpoint that accepts connections and never answers, on PostgreSQL and
SQLite: it exits 1 within ``claim_check_read_timeout``, naming the store, and leaves the
rows as they were.

Before, its read of the first claim-checked row's object had no bound of outboxer's: the
command waited on botocore's 60 s read timeout, times its retries, inside the batch's
open transaction (here killed after the test's bound instead)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxer import Outbox
from outboxer.claimcheck import HEADER_CLAIM_CHECK, ClaimCheck, FileObjectStore
from outboxer.crypto import KeyRing, generate_key
from tests.integration.test_enqueue_protection import raw_rows, writer
from tests.s3 import CREDENTIALS, REGION, silent_listener

K1, K2 = generate_key(), generate_key()
READ_TIMEOUT = 1.0
#: Python's start, boto3's client (about a second here), the read's bound, and slack.
COMMAND_BOUND = 9.0


@pytest.fixture(params=["pg_url", "sqlite_url"])
def db_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    return url


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """``host:port`` of a listener that accepts connections and never answers."""
    with silent_listener() as endpoint:
        yield endpoint


def test_keys_rotate_exits_1_naming_the_store_when_its_read_hangs(
    db_url: str, tmp_path: Path, silent_endpoint: str
) -> None:
    # Claim-checked rows, written while the store answered.
    outbox = Outbox(
        encryption=KeyRing({"k1": K1}),
        claim_check=ClaimCheck(FileObjectStore(tmp_path / "claims"), threshold=100),
    )
    conn = writer(db_url)
    try:
        for n in range(3):
            outbox.enqueue(conn, "big", {"n": n, "blob": "x" * 300})
        conn.commit()
    finally:
        conn.close()
    before = raw_rows(db_url)

    store_url = (
        f"s3://claims-bucket/claims?endpoint_url=http://{silent_endpoint}&region={REGION}"
        f"&access_key_id={CREDENTIALS['access_key_id']}"
        f"&secret_access_key={CREDENTIALS['secret_access_key']}"
    )
    env = {
        **os.environ,
        "OUTBOXER_DB": db_url,
        "OUTBOXER_ENCRYPTION_KEYS": f"k1={K1},k2={K2}",
        "OUTBOXER_ENCRYPTION_CURRENT_KEY": "k2",
        "OUTBOXER_CLAIM_CHECK_STORE": store_url,
        "OUTBOXER_CLAIM_CHECK_READ_TIMEOUT": f"{READ_TIMEOUT:g}s",
    }
    began = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "outboxer.cli", "keys", "rotate"],
            env=env,
            capture_output=True,
            text=True,
            timeout=COMMAND_BOUND,
        )
    except subprocess.TimeoutExpired as exc:  # run kills it
        pytest.fail(f"keys rotate still waited on the store after {COMMAND_BOUND} s: {exc}")
    elapsed = time.monotonic() - began

    assert done.returncode == 1, done.stderr
    first_object = before[0].headers[HEADER_CLAIM_CHECK]
    assert (
        f"outboxer keys rotate: stopped: claim-check object {first_object}: "
        f"S3ObjectStore('s3://claims-bucket/claims/' at http://{silent_endpoint}) did not "
        f"answer within {READ_TIMEOUT:g} s"
    ) in done.stderr
    assert "(claim_check_read_timeout)" in done.stderr
    assert "0 message(s) re-encrypted in committed batches" in done.stderr
    assert CREDENTIALS["secret_access_key"] not in done.stderr
    assert elapsed >= READ_TIMEOUT
    # Nothing written: the batch rolled back, every row on its old key and object.
    assert [(r.headers, r.payload) for r in raw_rows(db_url)] == [
        (r.headers, r.payload) for r in before
    ]
