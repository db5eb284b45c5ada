"""Unmanaged models of the outbox table and the consumer's dead-letter table, for the admin
(read-only: the relay and the consumer own the rows).

Their table names depend on settings (``schema`` and ``table``) and on the database vendor
(PostgreSQL qualifies them with the schema), so they are set on ``_meta`` when this module
loads, not in ``Meta``: the migrations keep a fixed model state, and changing the names never asks
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
        return _as_text(bytes(self.payload), self.content_type)


class DeadLetter(models.Model):
    """One row of the consumer's dead-letter table: a message a consumer group gave up on
    (or held back behind an earlier dead letter of its key), until replayed or purged."""

    seq = models.BigIntegerField(primary_key=True)
    consumer = models.CharField(max_length=255)
    message_id = models.UUIDField()
    topic = models.CharField(max_length=255)
    key = models.CharField(max_length=255, null=True)
    headers = models.JSONField()
    content_type = models.CharField(max_length=255)
    payload = models.BinaryField()
    created_at = StoredTime(null=True)
    error = models.TextField()
    attempts = models.IntegerField()
    held = models.BooleanField()
    failed_at = StoredTime()

    class Meta:
        managed = False
        verbose_name = "dead letter"
        ordering = ("seq",)  # arrival order, the order a replay applies them in

    def __str__(self) -> str:
        return f"{self.topic} {self.message_id} ({self.consumer})"

    def payload_text(self) -> str:
        """The payload as text when it is text (JSON included), else in hex."""
        return _as_text(bytes(self.payload), self.content_type)


def _as_text(body: bytes, content_type: str) -> str:
    if content_type.startswith(("application/json", "text/")):
        return body.decode("utf-8", errors="replace")
    return body.hex()


def _point_at_the_tables() -> None:
    """The models' tables as the configured names and the outbox database's vendor say."""
    alias = conf.database_alias()
    postgres = conf.dialect(alias) == "postgres"
    for model, table in ((OutboxMessage, conf.outbox_names().table), (DeadLetter, "dead_letters")):
        # Django leaves a name that starts and ends with a quote alone: "schema"."table".
        model._meta.db_table = conf.schema_table(alias, table) if postgres else table


_point_at_the_tables()
