"""``outboxer keys rotate`` and ``outboxer replay`` with a key ring that fetches its keys
(``KeyRing.from_callable``, a KMS) that stops answering: the command exits 1 within
``claim_check_read_timeout`` (the bound of its object-store reads, and of the consumer's key
fetches), with one line naming the key and the bound, and writes nothing: a rotation fetches
every key it needs before its first batch, a replay rolls back its one transaction.

Before, both called ``ring.key(...)`` inside their transaction, without a bound: the command
(and the rows' locks, SQLite's write lock) waited for the KMS for ever.

Rings built from the settings hold their keys and never fetch: the command is given the
fetching ring as an application embedding it would (``payload_admin.keyring`` replaced),
the database is real, the command's code path the CLI's own (``main``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from outboxer import Outbox, payload_admin
from outboxer.cli import EXIT_ERROR, EXIT_OK, main
from outboxer.crypto import HEADER_KEY_ID, KeyRing
from tests.integration.test_enqueue_protection import raw_rows, writer
from tests.unit.test_audit19_kmsadmin_sync_fetch import KEY, SilentKms, fetch_threads
from tests.waiting import wait_for, within

TIMEOUT = 0.5
#: The command's own work besides the wait (connect, a scan, the rollback), and slack.
SLACK = 3.0


@pytest.fixture(params=["sqlite_url", "pg_url", "mysql_url"])
def db_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    return url


@pytest.fixture
def kms(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[SilentKms]:
    """The command's key ring fetches from this KMS (current key k2); answered at the end."""
    source = SilentKms()

    def fetching_ring(settings: Any) -> KeyRing:
        return source.ring("k2")

    monkeypatch.setattr(payload_admin, "keyring", fetching_ring)
    monkeypatch.setenv("OUTBOXER_DB", db_url)
    monkeypatch.setenv("OUTBOXER_CLAIM_CHECK_READ_TIMEOUT", f"{TIMEOUT}s")
    yield source
    source.answer.set()
    wait_for(lambda: fetch_threads() == 0, 5, "key fetch threads did not end")


def enqueue(url: str, key_id: str, rows: int, *, published: bool = False) -> None:
    outbox = Outbox(encryption=KeyRing({key_id: KEY}))
    conn = writer(url)
    try:
        for n in range(rows):
            outbox.enqueue(conn, "t", {"n": n, "under": key_id}, key=f"k{n}")
        if published:
            table = "outboxer.outbox" if url.startswith("postgres") else "outbox"
            conn.cursor().execute(f"UPDATE {table} SET status = 'PUBLISHED'")
        conn.commit()
    finally:
        conn.close()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str, float]:
    began = time.monotonic()
    code = within(TIMEOUT + SLACK + 1, f"outboxer {' '.join(argv)}", lambda: main(list(argv)))
    took = time.monotonic() - began
    out, err = capsys.readouterr()
    assert isinstance(code, int), code
    return code, out, err, took


def assert_one_line(err: str, *parts: str) -> None:
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    assert KEY.hex() not in err
    for part in parts:
        assert part in err, err


def test_keys_rotate_exits_1_within_the_bound_and_changes_nothing(
    db_url: str, kms: SilentKms, capsys: pytest.CaptureFixture[str]
) -> None:
    # Batches of one: the k0 rows come first, and before they were re-encrypted and
    # committed, the run then waiting for ever on k1 inside the next batch's transaction.
    enqueue(db_url, "k0", 2)
    enqueue(db_url, "k1", 2)
    kms.silent = {"k1"}
    before = raw_rows(db_url)

    code, out, err, took = run(capsys, "keys", "rotate", "--rotation-batch", "1")

    assert code == EXIT_ERROR, (out, err)
    assert_one_line(
        err,
        f"key 'k1': the keyring's source did not answer within {TIMEOUT:g} s",
        "the rotation stopped before re-encrypting any message",
    )
    assert TIMEOUT <= took < TIMEOUT + SLACK, took
    assert raw_rows(db_url) == before, "no row changed"

    # Once the KMS answers, a new run re-encrypts them all.
    kms.answer.set()
    code, out, err, _ = run(capsys, "keys", "rotate", "--rotation-batch", "1")
    assert code == EXIT_OK, (out, err)
    assert "re-encrypted 4 message(s) under key k2" in out
    assert {row.headers[HEADER_KEY_ID] for row in raw_rows(db_url)} == {"k2"}


def test_keys_rotate_stops_at_once_when_the_current_key_does_not_come(
    db_url: str, kms: SilentKms, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(db_url, "k1", 3)
    before = raw_rows(db_url)

    code, out, err, took = run(capsys, "keys", "rotate")

    assert code == EXIT_ERROR, (out, err)
    assert_one_line(err, f"key 'k2': the keyring's source did not answer within {TIMEOUT:g} s")
    assert TIMEOUT <= took < TIMEOUT + SLACK, took
    assert kms.calls == ["k2"], "one wait, not one per key or row"
    assert raw_rows(db_url) == before


def test_replay_exits_1_within_the_bound_and_copies_nothing(
    db_url: str, kms: SilentKms, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(db_url, "k1", 3, published=True)
    kms.silent = {"k1"}
    before = raw_rows(db_url)

    code, out, err, took = run(capsys, "replay", "--all")

    assert code == EXIT_ERROR, (out, err)
    assert_one_line(
        err,
        "cannot be replayed: ",
        f"key 'k1': the keyring's source did not answer within {TIMEOUT:g} s",
    )
    assert TIMEOUT <= took < TIMEOUT + SLACK, took
    assert raw_rows(db_url) == before, "no copy written"
