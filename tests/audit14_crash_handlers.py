"""A handler for `outboxer consume` that kills its own process on one message (a segfault of
a C extension, the OOM killer): tests/acceptance/test_audit14_crash_consumer_rabbitmq.py."""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from outboxer.consumer import Delivery

#: What the process exits with: a SIGKILL's status, as the OOM killer leaves it.
KILLED = 137


def record_or_die(message: Delivery, conn: sqlite3.Connection) -> Any:
    """Applies ``{"n": …}`` as one ``applied`` row; ``{"die": true}`` ends the process at
    once, inside the consumer's open transaction (nothing committed, nothing acked)."""
    if message.payload.get("die"):
        os._exit(KILLED)
    conn.execute(
        "INSERT INTO applied (message_id, key, n) VALUES (?, ?, ?)",
        (str(message.id), message.key, message.payload["n"]),
    )
