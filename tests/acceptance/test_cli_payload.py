"""``outboxer enqueue --subject``, ``keys generate|rotate|shred`` and ``claim-check sweep`` on a
real SQLite outbox, with their settings from the environment, as an operator runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outboxer.claimcheck import FileObjectStore, fetch_payload, object_name
from outboxer.cli import EXIT_ERROR, EXIT_OK, EXIT_USAGE, main
from outboxer.crypto import FileSubjectKeys, KeyRing, SubjectKeyDeletedError, decrypt
from outboxer.message import uuid7
from tests.integration.test_enqueue_protection import raw_rows


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def new_key(capsys: pytest.CaptureFixture[str], key_id: str) -> str:
    code, out, _ = run(capsys, "keys", "generate", "--id", key_id)
    assert code == EXIT_OK and out.startswith(f"{key_id}=")
    return out.strip()


def test_an_operator_encrypts_rotates_shreds_and_sweeps(
    sqlite_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    k1, k2 = new_key(capsys, "k1"), new_key(capsys, "k2")
    assert k1 != k2
    claims, subjects = tmp_path / "claims", tmp_path / "subjects"
    monkeypatch.setenv("OUTBOXER_DB", sqlite_url)
    monkeypatch.setenv("OUTBOXER_ENCRYPTION_KEYS", k1)
    monkeypatch.setenv("OUTBOXER_SUBJECT_KEYS", str(subjects))
    monkeypatch.setenv("OUTBOXER_CLAIM_CHECK_STORE", f"file://{claims}")
    monkeypatch.setenv("OUTBOXER_CLAIM_CHECK_THRESHOLD", "100")

    code, _, err = run(
        capsys,
        "enqueue",
        "--topic",
        "t",
        "--payload",
        '{"email": "a@b.example"}',
        "--subject",
        "u1",
    )
    assert code == EXIT_OK, err
    code, _, err = run(capsys, "enqueue", "--topic", "t", "--payload", json.dumps(["x" * 300]))
    assert code == EXIT_OK, err
    small, big = raw_rows(sqlite_url)
    assert b"a@b.example" not in small.payload and small.headers["outboxer-key-id"] == "k1"
    assert big.payload == b"" and big.headers["outboxer-key-id"] == "k1"

    monkeypatch.setenv("OUTBOXER_ENCRYPTION_KEYS", f"{k1},{k2}")
    code, out, err = run(capsys, "keys", "rotate", "--rotation-batch", "1")
    assert (code, out.splitlines()[0]) == (EXIT_OK, "re-encrypted 2 message(s) under key k2"), err
    ring = KeyRing.from_text(k2, subjects=FileSubjectKeys(subjects))
    store = FileObjectStore(claims)
    small, big = raw_rows(sqlite_url)
    assert json.loads(decrypt(small, ring).payload) == {"email": "a@b.example"}
    assert json.loads(decrypt(fetch_payload(big, store), ring).payload) == ["x" * 300]

    code, out, _ = run(capsys, "keys", "shred", "u1")
    assert (code, out) == (
        EXIT_OK,
        "shredded subject 'u1': its messages can never be decrypted again\n",
    )
    with pytest.raises(SubjectKeyDeletedError):
        decrypt(small, ring)
    code, out, _ = run(capsys, "keys", "shred", "u1")
    assert (code, out) == (EXIT_OK, "subject 'u1' has no key (never made, or shredded before)\n")

    orphan = object_name(uuid7(), "default")
    store.put(orphan, b"rolled back")
    code, out, _ = run(capsys, "claim-check", "sweep", "--claim-check-sweep-grace", "1h")
    assert (code, out) == (EXIT_OK, "deleted 0 orphaned claim-check object(s)\n"), "too young"
    code, out, _ = run(capsys, "claim-check", "sweep", "--claim-check-sweep-grace", "0")
    assert (code, out) == (EXIT_OK, "deleted 1 orphaned claim-check object(s)\n")
    assert [stored.name for stored in store.list_objects()] == [big.headers["outboxer-claim-check"]]


def test_a_row_under_a_key_the_ring_lacks_fails_the_rotation_and_stays(
    sqlite_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOXER_DB", sqlite_url)
    monkeypatch.setenv("OUTBOXER_ENCRYPTION_KEYS", new_key(capsys, "k1"))
    assert run(capsys, "enqueue", "--topic", "t", "--payload", "{}")[0] == EXIT_OK
    monkeypatch.setenv("OUTBOXER_ENCRYPTION_KEYS", new_key(capsys, "k3"))
    code, out, err = run(capsys, "keys", "rotate")
    assert code == EXIT_ERROR
    assert out.startswith("re-encrypted 0 message(s)")
    assert "cannot re-encrypt message" in err and "no key 'k1'" in err
    [row] = raw_rows(sqlite_url)
    assert row.headers["outboxer-key-id"] == "k1"


@pytest.mark.parametrize(
    ("argv", "environment", "expected"),
    [
        (["keys", "rotate"], {}, "no encryption keys"),
        (["keys", "shred", "u1"], {}, "keys shred needs subject_keys"),
        (["keys", "shred", ""], {"OUTBOXER_SUBJECT_KEYS": "."}, "subject must be"),
        (["claim-check", "sweep"], {}, "claim-check sweep needs claim_check_store"),
        (
            ["enqueue", "--topic", "t", "--payload", "{}", "--subject", "u"],
            {},
            "needs an outbox with encryption",
        ),
        (
            ["keys", "rotate"],
            {"OUTBOXER_ENCRYPTION_KEYS": "k1=short-but-long-enough"},
            "not valid base64",
        ),
        (
            ["keys", "rotate"],
            {"OUTBOXER_ENCRYPTION_KEYS": "k1=AAAAAAAAAAAAAAAAAAAAAA=="},
            "it decodes to 16 bytes",
        ),
        (
            ["keys", "rotate"],
            {"OUTBOXER_ENCRYPTION_CURRENT_KEY": "k1"},
            "no encryption_keys or key file",
        ),
        (["claim-check", "sweep"], {"OUTBOXER_CLAIM_CHECK_STORE": "ftp://x/"}, "file:// or s3://"),
    ],
)
def test_missing_or_bad_settings_exit_2_with_a_clear_message(
    argv: list[str],
    environment: dict[str, str],
    expected: str,
    sqlite_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOXER_DB", sqlite_url)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    code, _, err = run(capsys, *argv)
    assert code == EXIT_USAGE and expected in err, err
    assert "short-but-long-enough" not in err


def test_cleanup_deletes_the_objects_of_the_rows_it_deletes(
    sqlite_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sqlite3

    from outboxer.stores.sqlite import sqlite_path

    claims = tmp_path / "claims"
    monkeypatch.setenv("OUTBOXER_DB", sqlite_url)
    monkeypatch.setenv("OUTBOXER_CLAIM_CHECK_STORE", f"file://{claims}")
    monkeypatch.setenv("OUTBOXER_CLAIM_CHECK_THRESHOLD", "10")
    for text in ("old", "new"):
        code, _, err = run(capsys, "enqueue", "--topic", text, "--payload", json.dumps([text * 20]))
        assert code == EXIT_OK, err
    _, new = raw_rows(sqlite_url)
    with sqlite3.connect(sqlite_path(sqlite_url)) as conn:  # published long ago
        conn.execute("UPDATE outbox SET status = 'PUBLISHED', updated_at = 0 WHERE topic = 'old'")
    # Every object is older than the grace: only the reference of a row keeps one.
    code, out, err = run(capsys, "cleanup", "--claim-check-sweep-grace", "0")
    assert code == EXIT_OK, err
    assert out.splitlines() == ["deleted 1 finished message(s)"]
    store = FileObjectStore(claims)
    assert [stored.name for stored in store.list_objects()] == [new.headers["outboxer-claim-check"]]
    assert json.loads(fetch_payload(new, store).payload) == ["new" * 20]
