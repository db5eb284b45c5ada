"""Model fields for outboxer's own tables."""

from __future__ import annotations

import datetime
from typing import Any

from django.db import models


class StoredTime(models.DateTimeField):
    """A time as the outbox stores it: ``timestamptz`` on PostgreSQL, a UTC ``DATETIME(6)``
    on MySQL, epoch seconds (``REAL``) on SQLite. Read as an aware UTC datetime."""

    def get_internal_type(self) -> str:
        # No backend converter may touch the value (SQLite's would parse the REAL as text,
        # MySQL's would apply the connection's time zone): from_db_value reads all three.
        return "OutboxerStoredTime"

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if value is None or (isinstance(value, datetime.datetime) and value.tzinfo):
            return value
        if isinstance(value, datetime.datetime):
            return value.replace(tzinfo=datetime.UTC)
        if isinstance(value, int | float):
            return datetime.datetime.fromtimestamp(value, datetime.UTC)
        return datetime.datetime.fromisoformat(str(value)).replace(tzinfo=datetime.UTC)
