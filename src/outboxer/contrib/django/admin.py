"""A read-only admin of the outbox, with a requeue action, and of the consumer's dead
letters, with a replay action.

Rows are the relay's and the consumer's: the admin shows them and never edits or deletes
one. The requeue action goes through the store's ``requeue`` (what ``outboxer requeue``
runs), under the relay's destination lock; the replay action applies dead letters again
with the handler of ``OUTBOXER["consumer"]`` (what ``outboxer dead-letters replay`` does),
on Django's connection as ``manage.py outboxer_consume`` does. Each needs the ``change``
permission of its model.

On PostgreSQL the outbox has no index on ``seq`` alone (the relay's indexes are partial):
on a large table, filter by status (the finished rows' index serves it) rather than
paging through everything.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from outboxer.contrib.django import conf
from outboxer.contrib.django.consumer import django_consumer
from outboxer.contrib.django.models import DeadLetter, OutboxMessage
from outboxer.errors import OutboxerError
from outboxer.redact import redact_text
from outboxer.stores import create_store

#: The statuses the requeue action moves back to PENDING (as the HTTP API's requeue allows).
REQUEUED_STATUSES = ("ABANDONED", "FAILED")


async def _requeue(by_destination: dict[str, list[str]]) -> int:
    current = conf.outboxer_settings()
    async with create_store(
        current.require_db(), schema=current.schema, table=current.table
    ) as store:
        count = 0
        for destination, ids in by_destination.items():
            count += await store.requeue([destination], REQUEUED_STATUSES, ids)
        return count


def requeue_messages(rows: Sequence[tuple[Any, str]]) -> int:
    """Requeue the ABANDONED or FAILED ones of ``rows`` (message id, destination)."""
    by_destination: dict[str, list[str]] = defaultdict(list)
    for message_id, destination in rows:
        by_destination[destination].append(str(message_id))
    return asyncio.run(_requeue(by_destination))


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows the relay or the consumer own: listed and shown, changed only by actions."""

    list_per_page = 50
    show_full_result_count = False  # no COUNT(*) of the whole table on every page

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    list_display = (
        "seq",
        "message_id",
        "destination",
        "topic",
        "key",
        "status",
        "attempts",
        "created_at",
        "next_attempt_at",
        "last_error",
    )
    list_filter = ("status", "destination")
    search_fields = ("=topic", "=key")
    fields = (
        *(field.name for field in OutboxMessage._meta.fields if field.name != "payload"),
        "payload_text",
    )
    readonly_fields = fields
    ordering = ("-seq",)
    actions = ("requeue",)

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        return _has_change_permission(self, request)

    @admin.action(
        description="Requeue the selected ABANDONED or FAILED messages",
        permissions=["requeue"],
    )
    def requeue(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        rows = list(queryset.values_list("message_id", "destination"))
        try:
            count = requeue_messages(rows)
        except OutboxerError as exc:
            # A message, as the replay action gives, not a server error: outboxer's own
            # connection can fail where Django's did not (OUTBOXER["db"], a missing driver).
            # Each destination's rows are requeued in a transaction of their own.
            several = len({destination for _, destination in rows}) > 1
            note = " (those of an earlier destination may be requeued already)" if several else ""
            text = f"Requeue failed{note}: {redact_text(str(exc))}"
            self.message_user(request, text, messages.ERROR)
            return
        skipped = len(rows) - count
        note = f"; {skipped} not ABANDONED or FAILED, left alone" if skipped else ""
        self.message_user(request, f"Requeued {count} message(s){note}.", messages.SUCCESS)


def replay_dead_letters(rows: Sequence[tuple[str, Any]]) -> tuple[str, dict[str, int], int]:
    """Replay the dead letters of ``rows`` (consumer group, message id) that belong to the
    group of ``OUTBOXER["consumer"]``, with its handler: that group, the counts (replayed,
    duplicates, failed, skipped) and how many rows of other groups were left alone."""
    own = conf.consumer_settings()
    group: str = own.require("group")
    ids = [str(message_id) for consumer, message_id in rows if consumer == group]
    counts = dict.fromkeys(("replayed", "duplicates", "failed", "skipped"), 0)
    if ids:
        alias = conf.database_alias()
        consumer = django_consumer(conf.settings_with(database=alias), own, alias, broker=None)
        counts = asyncio.run(consumer.replay_dead_letters(ids))
    return group, counts, len(rows) - len(ids)


def _has_change_permission(model_admin: admin.ModelAdmin, request: HttpRequest) -> bool:
    opts = model_admin.opts
    return bool(request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}"))


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    list_display = (
        "seq",
        "consumer",
        "message_id",
        "topic",
        "key",
        "attempts",
        "held",
        "failed_at",
        "error",
    )
    list_filter = ("consumer", "held")
    search_fields = ("=topic", "=key")
    fields = (
        *(field.name for field in DeadLetter._meta.fields if field.name != "payload"),
        "payload_text",
    )
    readonly_fields = fields
    actions = ("replay", "purge")

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return _has_change_permission(self, request)

    def has_purge_permission(self, request: HttpRequest) -> bool:
        opts = self.opts
        return bool(request.user.has_perm(f"{opts.app_label}.delete_{opts.model_name}"))

    @admin.action(
        description="Purge the selected dead letters (their messages are given up for good)",
        permissions=["purge"],
    )
    def purge(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        # As `outboxer dead-letters purge --id`: the rows go, in one statement; a later
        # message of a key a held dead letter blocked is applied at its next delivery.
        count, _ = queryset.delete()
        self.message_user(request, f"Purged {count} dead letter(s).", messages.SUCCESS)

    @admin.action(
        description="Replay the selected dead letters through the consumer's handler",
        permissions=["replay"],
    )
    def replay(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        rows = list(queryset.values_list("consumer", "message_id"))
        try:
            group, counts, others = replay_dead_letters(rows)
        except OutboxerError as exc:
            self.message_user(request, f"Nothing replayed: {redact_text(str(exc))}", messages.ERROR)
            return
        text = (
            f"Replayed {counts['replayed']} dead letter(s) of {group!r}; "
            f"{counts['duplicates']} already applied (removed); {counts['failed']} failed "
            f"again (kept, with the new error); {counts['skipped']} left behind an earlier "
            "dead letter of their key."
        )
        if others:
            text += (
                f' {others} of other groups left alone: OUTBOXER["consumer"] names the group '
                "and the handler the admin replays with."
            )
        failed = counts["failed"] or counts["skipped"] or others
        self.message_user(request, text, messages.WARNING if failed else messages.SUCCESS)
