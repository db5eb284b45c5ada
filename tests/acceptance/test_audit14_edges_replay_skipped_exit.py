"""`outboxer dead-letters replay` exits 3 (consume_cli.EXIT_SKIPPED), not 0, when it skipped dead letters whose lock it
could not take: they are still dead letters, and a script reading 0 as "all replayed" would
move on. The real command against PostgreSQL, the dead letter's row locked from another
connection; the replay's lock wait bounded by PGOPTIONS (libpq reads it at connect)."""

from __future__ import annotations

import uuid

import psycopg

from tests.acceptance.test_consume_cli import command, rows
from tests.consumer_handlers import APPLIED_DDL

#: The replay's transaction gives up on a held lock after this long (the consumer sets no
#: lock_timeout of its own: without one it would wait for the holder).
SHORT_LOCK_WAIT = {"PGOPTIONS": "-c lock_timeout=300"}


def test_a_replay_that_skipped_a_locked_dead_letter_exits_3(pg_url: str) -> None:
    group = f"audit14-{uuid.uuid4().hex[:8]}"
    message_id = uuid.uuid4()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(APPLIED_DDL)
        conn.execute(
            "INSERT INTO outboxer.dead_letters (consumer, message_id, topic, content_type, "
            "payload, error, attempts) VALUES (%s, %s, 't', 'application/json', %s, 'e', 1)",
            (group, message_id, '{"n": 7}'),
        )
    replay = ("dead-letters", "replay", "--db", pg_url, "--group", group)
    handler = "tests.consumer_handlers:record"
    with psycopg.connect(pg_url) as holder:  # another replay's, or a consumer's, transaction
        holder.execute(
            "SELECT 1 FROM outboxer.dead_letters WHERE consumer = %s FOR UPDATE", (group,)
        )
        skipped = command(*replay, handler, env=SHORT_LOCK_WAIT)
        holder.rollback()
    assert skipped.returncode == 3, (skipped.stdout, skipped.stderr)
    assert skipped.stdout.strip() == "replayed 0, duplicates 0, failed 0, skipped 1"
    assert "run the replay again" in skipped.stderr
    assert rows(
        pg_url, f"SELECT count(*) FROM outboxer.dead_letters WHERE consumer = '{group}'"
    ) == [(1,)]
    # The lock gone, the same command replays it and says so with 0.
    again = command(*replay, handler, env=SHORT_LOCK_WAIT)
    assert again.returncode == 0, (again.stdout, again.stderr)
    assert again.stdout.strip() == "replayed 1, duplicates 0, failed 0, skipped 0"
    assert rows(pg_url, f"SELECT n FROM applied WHERE message_id = '{message_id}'") == [(7,)]
