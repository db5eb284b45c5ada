"""The real ``outboxer purge``, ``replay`` and ``requeue`` in subprocesses, on the real
PostgreSQL and MariaDB: dry runs print counts and change nothing, refusals exit 2 with one
line, real runs change what the filter matches."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

import outboxer
from tests.acceptance.test_cli import cli
from tests.conftest import mysql_connect


def seed_postgres(url: str) -> dict[str, uuid.UUID]:
    """Rows in every state purge, replay and requeue look at; the ids by name."""
    with psycopg.connect(url) as conn:
        ids = {
            name: outboxer.enqueue(conn, topic, {"name": name}, key=key).id
            for name, topic, key in (
                ("placed-1", "order.placed", "o1"),
                ("paid-1", "order.paid", "o1"),
                ("placed-2", "order.placed", "o2"),
                ("lost", "order.placed", "o3"),
                ("late", "order.paid", "o4"),
                ("waiting", "order.placed", "o5"),
            )
        }

        def mark(names: list[str], status: str, error: str | None = None) -> None:
            conn.execute(
                "UPDATE outboxer.outbox SET status = %s, last_error = %s, attempts = 3 "
                "WHERE id = ANY(%s)",
                (status, error, [ids[name] for name in names]),
            )

        mark(["placed-1", "paid-1", "placed-2"], "PUBLISHED")
        mark(["lost"], "ABANDONED", "HTTP 410 Gone")
        mark(["late"], "ABANDONED", "TimeoutError: no confirm within 30s")
        conn.execute(
            "UPDATE outboxer.outbox SET created_at = now() - interval '2 days' WHERE id = %s",
            (ids["placed-1"],),
        )
    return ids


def rows(url: str) -> dict[str, tuple[str, str, str | None]]:
    """status, destination and replay-of of every row, by id."""
    with psycopg.connect(url) as conn:
        found = conn.execute(
            "SELECT id, status, destination, headers->>'replay-of' FROM outboxer.outbox"
        ).fetchall()
    return {str(row_id): (status, dest, of) for row_id, status, dest, of in found}


def test_purge_replay_and_requeue_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    ids = seed_postgres(pg_url)
    before = rows(pg_url)
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'db = "{pg_url}"\nbroker = "memory://default"\n\n'
        '[destinations.partner]\nbroker = "memory://partner"\n'
    )

    refused = [
        cli("purge", "--db", pg_url),
        cli("purge", "--db", pg_url, "--topic", "order.placed", "--status", "PROCESSING"),
        cli("replay", "--config", str(config), "--key", "o1", "--to", "parnter"),
    ]
    assert [r.returncode for r in refused] == [2, 2, 2]
    assert "outboxer purge: purge needs a filter" in refused[0].stderr
    assert "PROCESSING messages cannot be purged" in refused[1].stderr
    assert "destination 'parnter' is not configured (configured: default, partner)" in (
        refused[2].stderr
    )
    assert all(len(r.stderr.strip().splitlines()) == 1 for r in refused), "one line each"

    dry = cli("purge", "--db", pg_url, "--topic", "order.placed", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        "would purge 4 message(s); dry run, nothing changed",
        "  default          ABANDONED           1",
        "  default          PENDING             1",
        "  default          PUBLISHED           2",
    ]
    assert rows(pg_url) == before, "a dry run changes nothing"

    purged = cli("purge", "--db", pg_url, "--topic", "order.placed", "--status", "ABANDONED")
    assert purged.stdout.strip() == "purged 1 message(s)", purged.stderr
    assert str(ids["lost"]) not in rows(pg_url)

    since = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    dry = cli("replay", "--db", pg_url, "--key", "o1", "--created-after", since, "--dry-run")
    assert dry.stdout.splitlines()[0] == (
        "would replay 1 message(s) (each to its own destination); dry run, nothing changed"
    )
    replayed = cli("replay", "--config", str(config), "--key", "o1", "--to", "partner")
    assert replayed.stdout.strip() == (
        "replayed 2 message(s) as new PENDING messages (to destination partner)"
    ), replayed.stderr
    copies = {of: (status, dest) for status, dest, of in rows(pg_url).values() if of}
    assert copies == {
        str(ids["placed-1"]): ("PENDING", "partner"),
        str(ids["paid-1"]): ("PENDING", "partner"),
    }

    dry = cli("requeue", "--db", pg_url, "--error", "Timeout", "--dry-run")
    assert dry.stdout.splitlines()[0] == "would requeue 1 message(s); dry run, nothing changed"
    requeued = cli("requeue", "--db", pg_url, "--error", "Timeout", "--topic", "order.paid")
    assert requeued.stdout.strip() == "requeued 1 message(s)", requeued.stderr
    assert rows(pg_url)[str(ids["late"])][0] == "PENDING"
    old = cli("purge", "--db", pg_url, "--older-than", "1d", "--status", "PUBLISHED")
    assert old.stdout.strip() == "purged 1 message(s)", old.stderr
    assert str(ids["placed-1"]) not in rows(pg_url)


def test_purge_replay_and_requeue_on_mariadb(mysql_url: str) -> None:
    conn = mysql_connect(mysql_url)
    try:
        sent = [outboxer.enqueue(conn, "t", {"n": n}, key=f"k{n % 2}") for n in range(4)]
        with conn.cursor() as cursor:
            cursor.execute("UPDATE outbox SET status = 'PUBLISHED' WHERE seq <= 2")
            cursor.execute(
                "UPDATE outbox SET status = 'ABANDONED', last_error = 'nope' WHERE seq = 3"
            )
        conn.commit()
    finally:
        conn.close()
    replayed = cli("replay", "--db", mysql_url, "--all")
    assert replayed.stdout.strip().startswith("replayed 2 message(s)"), replayed.stderr
    dry = cli("purge", "--db", mysql_url, "--key", "k0", "--dry-run")
    assert dry.stdout.splitlines() == [
        "would purge 3 message(s); dry run, nothing changed",
        "  default          ABANDONED           1",
        "  default          PENDING             1",
        "  default          PUBLISHED           1",
    ], dry.stderr
    requeued = cli("requeue", "--db", mysql_url, "--error", "nope", "--id", str(sent[2].id))
    assert requeued.stdout.strip() == "requeued 1 message(s)", requeued.stderr
    purged = cli("purge", "--db", mysql_url, "--status", "PUBLISHED")
    assert purged.stdout.strip() == "purged 2 message(s)", purged.stderr
    conn = mysql_connect(mysql_url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT status, headers FROM outbox ORDER BY seq")
            left = [(status, json.loads(headers).get("replay-of")) for status, headers in cursor]
    finally:
        conn.close()
    assert left == [
        ("PENDING", None),
        ("PENDING", None),
        ("PENDING", str(sent[0].id)),
        ("PENDING", str(sent[1].id)),
    ]
