"""The real ``outboxer`` command against MariaDB: schema, enqueue, relay, status, operations."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from outboxer.stores.sqlfiles import migrations
from tests.acceptance.test_cli import cli
from tests.conftest import mysql_connect


class _Refuse(BaseHTTPRequestHandler):
    """A webhook receiver that refuses every message for good (422)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(422)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def refusing_receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()
    server.server_close()
    thread.join()


def outbox_rows(db: str) -> dict[str, tuple[str, int]]:
    """id -> (status, attempts) of every row."""
    conn = mysql_connect(db)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT id, status, attempts FROM outbox")
            return {str(row[0]): (row[1], row[2]) for row in cursor.fetchall()}
    finally:
        conn.close()


def test_schema_enqueue_relay_status_and_operations(
    mysql_empty_url: str, tmp_path: Path, refusing_receiver: str
) -> None:
    db = mysql_empty_url
    out = tmp_path / "events.jsonl"
    refused = cli("relay", "--db", db, "--broker", f"file://{out}", "--exit-when-idle")
    assert refused.returncode == 2 and "outboxer schema apply" in refused.stderr, refused.stderr
    every = ", ".join(migration.name for migration in migrations("mysql"))
    assert cli("schema", "apply", "--db", db).stdout.strip() == f"applied: {every}"
    assert cli("schema", "apply", "--db", db).stdout.strip() == "schema is up to date"
    ids = []
    for n in range(3):
        added = cli(
            "enqueue",
            "--db",
            db,
            "--topic",
            "t",
            "--key",
            "k",
            "--payload",
            json.dumps({"n": n}),
            "--header",
            "h=v",
        )
        assert added.returncode == 0, added.stderr
        ids.append(added.stdout.strip())

    # A receiver that refuses every message for good: each is ABANDONED after one attempt.
    done = cli("relay", "--db", db, "--broker", refusing_receiver, "--exit-when-idle")
    assert done.returncode == 0, done.stderr
    assert outbox_rows(db) == {id_: ("ABANDONED", 1) for id_ in ids}
    listed = json.loads(cli("messages", "--db", db, "--json").stdout)
    assert sorted(row["id"] for row in listed) == sorted(ids)
    assert all("422" in row["last_error"] for row in listed), listed

    # Requeue one by id, then the rest: PENDING again, attempts reset.
    one = cli("requeue", "--db", db, "--id", ids[1])
    assert one.stdout.strip() == "requeued 1 message(s)", one.stderr
    assert outbox_rows(db) == {
        ids[0]: ("ABANDONED", 1),
        ids[1]: ("PENDING", 0),
        ids[2]: ("ABANDONED", 1),
    }
    rest = cli("requeue", "--db", db)
    assert rest.stdout.strip() == "requeued 2 message(s)", rest.stderr
    assert outbox_rows(db) == {id_: ("PENDING", 0) for id_ in ids}

    done = cli("relay", "--db", db, "--broker", f"file://{out}", "--exit-when-idle")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["payload"] for line in lines] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert [line["id"] for line in lines] == ids
    assert {line["key"] for line in lines} == {"k"} and lines[0]["headers"] == {"h": "v"}
    report = json.loads(cli("status", "--db", db, "--json").stdout)
    [destination] = report["destinations"]
    assert destination["counts"] == {"PUBLISHED": 3} and destination["abandoned"] == 0
    assert report["oldest_transaction_age_seconds"] == 0
    assert cli("requeue", "--db", db).stdout.strip() == "requeued 0 message(s)"
    published = json.loads(cli("messages", "--db", db, "--status", "PUBLISHED", "--json").stdout)
    assert sorted(row["id"] for row in published) == sorted(ids)
    assert "deleted 0" in cli("cleanup", "--db", db).stdout
    assert "deleted 3" in cli("cleanup", "--db", db, "--published-retention", "0").stdout
    ddl = cli("schema", "sql", "--dialect", "mysql").stdout
    assert (
        "CREATE TABLE IF NOT EXISTS `outbox`" in ddl
        and "INSERT IGNORE INTO `outbox_migrations`" in ddl
    )
