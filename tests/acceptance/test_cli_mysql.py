"""The real ``outboxer`` command against MariaDB: schema, enqueue, relay, status, operations."""

from __future__ import annotations

import json
from pathlib import Path

from outboxer.stores.sqlfiles import migrations
from tests.acceptance.test_cli import cli


def test_schema_enqueue_relay_status_and_operations(mysql_empty_url: str, tmp_path: Path) -> None:
    db = mysql_empty_url
    out = tmp_path / "events.jsonl"
    refused = cli("relay", "--db", db, "--broker", f"file://{out}", "--exit-when-idle")
    assert refused.returncode == 2 and "outboxer schema apply" in refused.stderr, refused.stderr
    every = ", ".join(migration.name for migration in migrations("mysql"))
    assert cli("schema", "apply", "--db", db).stdout.strip() == f"applied: {every}"
    assert cli("schema", "apply", "--db", db).stdout.strip() == "schema is up to date"
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
    done = cli("relay", "--db", db, "--broker", f"file://{out}", "--exit-when-idle")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["payload"] for line in lines] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert {line["key"] for line in lines} == {"k"} and lines[0]["headers"] == {"h": "v"}
    report = json.loads(cli("status", "--db", db, "--json").stdout)
    [destination] = report["destinations"]
    assert destination["counts"] == {"PUBLISHED": 3} and destination["abandoned"] == 0
    assert report["oldest_transaction_age_seconds"] == 0
    assert "requeued 0" in cli("requeue", "--db", db).stdout
    assert cli("messages", "--db", db, "--status", "PUBLISHED", "--json").returncode == 0
    assert "deleted 0" in cli("cleanup", "--db", db).stdout
    assert "deleted 3" in cli("cleanup", "--db", db, "--published-retention", "0").stdout
    ddl = cli("schema", "sql", "--dialect", "mysql").stdout
    assert (
        "CREATE TABLE IF NOT EXISTS `outbox`" in ddl
        and "INSERT IGNORE INTO `outbox_migrations`" in ddl
    )
