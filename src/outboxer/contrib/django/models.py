"""An unmanaged model of the outbox table, for the admin (read-only: the relay owns the rows).

Its table name depends on settings (``schema`` and ``table``) and on the database vendor
(PostgreSQL qualifies it with the schema), so it is set on ``_meta`` when this module loads,
not in ``Meta``: the migrations keep a fixed model state, and changing the names never asks
for a migration of this app.
"""

from __future__ import annotations

from django.db import models

from outboxer.contrib.django import conf
from outboxer.contrib.django.fields import StoredTime


class OutboxMessage(models.Model):
    """One row of the outbox: a message for one destination."""

    seq = models.BigIntegerField(primary_key=True)
    # Django reserves the field name ``id`` for primary keys.
    message_id = models.UUIDField(db_column="id")
    destination = models.CharField(max_length=255)
    topic = models.CharField(max_length=255)
    key = models.CharField(max_length=255, null=True)
    payload = models.BinaryField()
    content_type = models.CharField(max_length=255)
    headers = models.JSONField()
    status = models.CharField(max_length=10)
    attempts = models.IntegerField()
    next_attempt_at = StoredTime()
    last_error = models.TextField(null=True)
    locked_by = models.CharField(max_length=255, null=True)
    locked_until = StoredTime(null=True)
    created_at = StoredTime()
    updated_at = StoredTime()
    published_at = StoredTime(null=True)

    class Meta:
        managed = False
        verbose_name = "outbox message"
        ordering = ("-seq",)

    def __str__(self) -> str:
        return f"{self.topic} {self.message_id} ({self.destination}, {self.status})"

    def payload_text(self) -> str:
        """The payload as text when it is text (JSON included), else in hex."""
        body = bytes(self.payload)
        if self.content_type.startswith(("application/json", "text/")):
            return body.decode("utf-8", errors="replace")
        return body.hex()


def _point_at_the_outbox() -> None:
    alias = conf.database_alias()
    if conf.dialect(alias) == "postgres":
        # Django leaves a name that starts and ends with a quote alone: "schema"."table".
        OutboxMessage._meta.db_table = conf.outbox_table(alias)
    else:
        OutboxMessage._meta.db_table = conf.outbox().table


_point_at_the_outbox()
