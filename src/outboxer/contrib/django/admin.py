"""A read-only admin of the outbox, with a requeue action.

Rows are the relay's: the admin shows them and never edits or deletes one. The requeue
action goes through the store's ``requeue`` (what ``outboxer requeue`` runs), under the
relay's destination lock; it needs the ``change`` permission of outbox messages.

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
from outboxer.contrib.django.models import OutboxMessage
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


@admin.register(OutboxMessage)
class OutboxMessageAdmin(admin.ModelAdmin):
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
    list_per_page = 50
    show_full_result_count = False  # no COUNT(*) of the whole table on every page
    actions = ("requeue",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        opts = self.opts
        return bool(request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}"))

    @admin.action(
        description="Requeue the selected ABANDONED or FAILED messages",
        permissions=["requeue"],
    )
    def requeue(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        rows = list(queryset.values_list("message_id", "destination"))
        count = requeue_messages(rows)
        skipped = len(rows) - count
        note = f"; {skipped} not ABANDONED or FAILED, left alone" if skipped else ""
        self.message_user(request, f"Requeued {count} message(s){note}.", messages.SUCCESS)
