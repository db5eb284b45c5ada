"""Audit 13, rolling upgrade: a relay of this version started on a MySQL schema one migration
behind refuses with the SchemaError and exit 2, and nothing else. It used to leave its
aiomysql pool open past the event loop, whose finalizer then printed a traceback ("Event
loop is closed") after the refusal, so the refusal read like a crash."""

from __future__ import annotations

import os
import subprocess
import sys

from outboxer.stores.sqlfiles import migrations
from tests.conftest import mysql_connect


def test_relay_on_an_older_mysql_schema_refuses_cleanly(mysql_url: str, tmp_path: str) -> None:
    newest = migrations("mysql")[-1]
    conn = mysql_connect(mysql_url, autocommit=True)
    try:
        # The schema of the version before: its newest migration not recorded.
        conn.cursor().execute("DELETE FROM outbox_migrations WHERE version = %s", (newest.version,))
    finally:
        conn.close()
    argv = ["relay", "--db", mysql_url, "--broker", f"file://{tmp_path}/events.jsonl"]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from outboxer.cli import main; sys.exit(main())",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ),
    )
    assert done.returncode == 2, done.stderr
    assert f"lacks migration(s) {newest.name}" in done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
