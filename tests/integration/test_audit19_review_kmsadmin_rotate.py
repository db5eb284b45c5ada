"""``PayloadTable.rotate`` with a key ring that fetches its keys (``KeyRing.from_callable``)
and rows whose ``outboxer-key-id`` header no key id can be (written by hand, or by a
hostile writer): those rows fail, each on its own, and the KMS is never asked for them.

Before, the rotation's first read (every key id of the rows to re-encrypt, fetched before
the first batch) took each header's text: a number 5 was asked for as "5", ``true`` as
"true", MariaDB's ``null`` as "null", and a key id ending in a newline passed the ring's
check (``$`` matches before a final newline). A KMS that refuses an id it does not know
(an exception, as most KMS clients raise) then stopped the whole rotation ("…: the
rotation stopped before re-encrypting any message") over one such row, where the rows
under real keys used to be re-encrypted and that row reported failed. The read also took
every such value whole into memory, however long.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from outboxer import Outbox
from outboxer.crypto import HEADER_KEY_ID, KeyRing
from outboxer.payload_admin import payload_table
from tests.integration.test_enqueue_protection import raw_rows, writer

KEY = os.urandom(32)
HOSTILE: list[Any] = [5, True, None, ["k1"], "k1\n", "x" * 5000]


@pytest.fixture(params=["sqlite_url", "pg_url", "mysql_url"])
def db_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    return url


def enqueue_with_hostile_rows(url: str) -> None:
    """Two rows under k1, then one per hostile key id header (each enqueued under k1)."""
    outbox = Outbox(encryption=KeyRing({"k1": KEY}))
    table = "outboxer.outbox" if url.startswith("postgres") else "outbox"
    cast = "::jsonb" if url.startswith("postgres") else ""
    mark = "?" if url.startswith("sqlite") else "%s"
    conn = writer(url)
    try:
        for n in range(2 + len(HOSTILE)):
            outbox.enqueue(conn, "t", {"n": n}, key=f"k{n}")
        conn.commit()
        cursor = conn.cursor()
        headers = "headers::text" if url.startswith("postgres") else "headers"
        cursor.execute(f"SELECT seq, {headers} FROM {table} ORDER BY seq")
        rows = cursor.fetchall()
        for (seq, text), value in zip(rows[2:], HOSTILE, strict=True):
            changed = {**json.loads(text), HEADER_KEY_ID: value}
            cursor.execute(
                f"UPDATE {table} SET headers = {mark}{cast} WHERE seq = {mark}",
                (json.dumps(changed), seq),
            )
        conn.commit()
    finally:
        conn.close()


def test_rows_under_no_valid_key_id_fail_alone_and_the_kms_is_never_asked_for_them(
    db_url: str,
) -> None:
    enqueue_with_hostile_rows(db_url)
    asked: list[str] = []

    def kms(key_id: str) -> bytes:
        asked.append(key_id)
        if key_id in ("k1", "k2"):
            return KEY
        raise PermissionError(f"AccessDeniedException: no key {key_id}")

    with payload_table(db_url) as table:
        result = table.rotate(KeyRing.from_callable(kms, "k2"), batch=2, call_timeout=2.0)

    assert sorted(asked) == ["k1", "k2"], asked
    assert result.rotated == 2, result
    assert result.failed, "the hostile rows fail"
    # A JSON null is no key id either (read as "names no key id" where SQL selects it).
    refused = ("is not a valid key id", "names no key id")
    assert all(failure.endswith(refused) for failure in result.failed), [
        f[:300] for f in result.failed
    ]
    assert all(len(failure) < 300 for failure in result.failed), [f[:300] for f in result.failed]
    under = [row.headers.get(HEADER_KEY_ID) for row in raw_rows(db_url)]
    assert under.count("k2") == 2, under
