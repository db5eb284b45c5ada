"""``outboxer replay --to`` over several databases, on the real PostgreSQL and MariaDB: a
destination one of them lacks is a request error for the whole command, found before any
database changes (as ``POST /messages/replay`` checks it), not after the first committed."""

from __future__ import annotations

from pathlib import Path

import psycopg

import outboxer
from tests.acceptance.test_cli import cli
from tests.conftest import mysql_connect


def test_replay_to_a_destination_one_database_lacks_changes_no_database(
    pg_url: str, mysql_url: str, tmp_path: Path
) -> None:
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue(conn, "t", {"n": 1}, key="k")
        conn.execute("UPDATE outboxer.outbox SET status = 'PUBLISHED'")
    conn = mysql_connect(mysql_url)
    try:
        outboxer.enqueue(conn, "t", {"n": 2}, key="k")
        conn.cursor().execute("UPDATE outbox SET status = 'PUBLISHED'")
        conn.commit()
    finally:
        conn.close()
    config = tmp_path / "outboxer.toml"
    config.write_text(
        'broker = "memory://default"\n'
        f'[databases.billing]\nurl = "{pg_url}"\n'
        '[databases.billing.destinations.partner]\nbroker = "memory://partner"\n'
        f'[databases.shop]\nurl = "{mysql_url}"\n'
    )

    replayed = cli("replay", "--config", str(config), "--all", "--to", "partner")

    assert replayed.returncode == 2, replayed.stdout + replayed.stderr
    assert replayed.stdout == "", "no database reports a change"
    assert "database shop: destination 'partner' is not configured" in replayed.stderr
    with psycopg.connect(pg_url) as conn:
        statuses = [row[0] for row in conn.execute("SELECT status FROM outboxer.outbox")]
    assert statuses == ["PUBLISHED"], "billing was not changed either"


def test_a_database_that_fails_after_another_was_changed_is_named(
    pg_url: str, tmp_path: Path
) -> None:
    """Each database commits on its own: when the second fails after the first changed, the
    error names the one that failed and the ones done (exit 1, not a bare error)."""
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue(conn, "t", {"n": 1}, key="k")
        conn.execute("UPDATE outboxer.outbox SET status = 'ABANDONED'")
    config = tmp_path / "outboxer.toml"
    config.write_text(
        'broker = "memory://default"\n'
        f'[databases.billing]\nurl = "{pg_url}"\n'
        # Nothing listens on port 1: the second database is down.
        '[databases.shop]\nurl = "postgresql://app:s3cret-pw-4471@127.0.0.1:1/shop"\n'
    )

    requeued = cli("requeue", "--config", str(config), "--status", "ABANDONED")

    assert requeued.returncode == 1, requeued.stdout + requeued.stderr
    assert "database billing: requeued 1" in requeued.stdout
    assert "database shop: " in requeued.stderr
    assert "done before it: billing" in requeued.stderr
    assert "s3cret-pw-4471" not in requeued.stderr + requeued.stdout
