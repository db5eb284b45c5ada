"""A read-only admin of the outbox, with a requeue action, and of the consumer's dead
letters, with a replay action.

Rows are the relay's and the consumer's: the admin shows them and never edits or deletes
one. The requeue action goes through the store's ``requeue_matching_counted`` (what
``outboxer requeue --id`` runs), under the relays' destination locks, and reports the rows
it deferred behind a later message of their key in flight; the replay action applies dead letters again
with the handler of ``OUTBOXER["consumer"]`` (what ``outboxer dead-letters replay`` does),
on Django's connection as ``manage.py outboxer_consume`` does. Each needs the ``change``
permission of its model.

On PostgreSQL the outbox has no index on ``seq`` alone (the relay's indexes are partial):
on a large table, filter by status (the finished rows' index serves it) rather than
paging through everything. A page load never reads the whole table otherwise: the filters'
choices are fixed (no ``SELECT DISTINCT``) and the paginator counts at most ``cap`` rows.
The dead letters are listed in arrival order (``seq``, their primary key: the order a
replay applies them in, as ``outboxer dead-letters list`` shows them).

An action takes at most ``MAX_ACTION_ROWS`` rows: "Select all N" across the pages of a big
table is refused (nothing changed) rather than read into memory and sent as one statement;
the CLI (``outboxer requeue``, ``outboxer dead-letters replay`` or ``purge``) does bulk work.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from typing import Any

from django.contrib import admin, messages
from django.core.paginator import Paginator
from django.db import DatabaseError, transaction
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.functional import cached_property

from outboxer.admin import MessageFilter
from outboxer.contrib.django import conf
from outboxer.contrib.django.consumer import django_consumer
from outboxer.contrib.django.models import DeadLetter, OutboxMessage
from outboxer.errors import OutboxerError
from outboxer.message import Status
from outboxer.redact import redact_text
from outboxer.stores import create_store

#: The statuses the requeue action moves back to PENDING (as the HTTP API's requeue allows).
REQUEUED_STATUSES = ("ABANDONED", "FAILED")

#: The most rows one action takes: a selection of more (typically "Select all N" across the
#: pages of a big table) is refused with nothing changed, and the operator pointed at the CLI.
MAX_ACTION_ROWS = 10_000


async def _requeue(ids: list[uuid.UUID], destinations: list[str]) -> tuple[int, int]:
    current = conf.outboxer_settings()
    async with create_store(
        current.require_db(), schema=current.schema, table=current.table
    ) as store:
        where = MessageFilter(
            ids=tuple(ids), destinations=tuple(destinations), statuses=REQUEUED_STATUSES
        )
        return await store.requeue_matching_counted(where)


def requeue_messages(rows: Sequence[tuple[Any, str]]) -> tuple[int, int]:
    """Requeue the ABANDONED or FAILED ones of ``rows`` (message id, destination), in one
    transaction under the lock of each of their destinations (what ``outboxer requeue
    --id`` runs): how many were requeued, and how many were deferred because a later
    message of their key is in flight (requeued, it would go out after that one)."""
    if not rows:
        return 0, 0
    ids = [uuid.UUID(str(message_id)) for message_id, _ in rows]
    return asyncio.run(_requeue(ids, sorted({destination for _, destination in rows})))


class CappedPaginator(Paginator):
    """Counts no further than ``cap`` rows: Django's paginator counted every row the page's
    filter matches (``COUNT(*)`` of millions of PUBLISHED rows on each page load). Beyond
    the cap the count is the planner's estimate (PostgreSQL, MySQL), never below the cap:
    the page links stay roughly right, a page past the real end is merely empty."""

    cap = 10_000

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return int(super().count)
        # A LIMIT inside the count's subquery: the scan stops at cap + 1 rows.
        counted = int(queryset.order_by()[: self.cap + 1].count())
        if counted <= self.cap:
            return counted
        return max(counted, _estimated_rows(queryset))


def _estimated_rows(queryset: QuerySet[Any]) -> int:
    """The planner's estimate of the rows ``queryset`` returns (0 when it gives none)."""
    try:
        plan = json.loads(queryset.order_by().explain(format="json"))
        if isinstance(plan, str):  # MariaDB's plan arrives as a JSON string of JSON
            plan = json.loads(plan)
    except (DatabaseError, ValueError, TypeError):  # SQLite: no JSON plan
        return 0
    return _first_rows(plan)


def _first_rows(plan: Any) -> int:
    """The top node's row estimate: PostgreSQL's "Plan Rows"; MySQL's and MariaDB's "rows"
    read, times the percentage of them its condition keeps ("filtered")."""
    if isinstance(plan, dict):
        if isinstance(rows := plan.get("Plan Rows"), int | float):
            return int(rows)
        if isinstance(rows := plan.get("rows"), int | float):
            kept = plan.get("filtered", 100)
            return int(rows * (kept if isinstance(kept, int | float) else 100) / 100)
        plan = list(plan.values())
    if isinstance(plan, list):
        for item in plan:
            if found := _first_rows(item):
                return found
    return 0


class ChoicesFilter(admin.SimpleListFilter):
    """A filter of fixed choices: Django's own filter of a field lists the values with a
    ``SELECT DISTINCT`` over the whole table on every page load."""

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        return queryset.filter(**{self.parameter_name: value})


class StatusFilter(ChoicesFilter):
    title = "status"
    parameter_name = "status__exact"  # the URL Django's field filter made: links stay good

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(status.value, status.value) for status in Status]


class DestinationFilter(ChoicesFilter):
    title = "destination"
    parameter_name = "destination__exact"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # The configured destinations; one asked for in the URL too (a row of a destination
        # no longer configured stays reachable by its link).
        names = list(conf.outbox_names().destinations)
        asked = self.value()
        if asked is not None and asked not in names:
            names.append(asked)
        return [(name, name) for name in names]


class ConsumerFilter(ChoicesFilter):
    title = "consumer"
    parameter_name = "consumer"  # the URL Django's field filter made: links stay good

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # The configured group (the one the replay action serves); one asked for in the URL
        # too (another group's dead letters stay reachable by their link).
        names = []
        try:
            group = conf.consumer_settings().group
        except OutboxerError:  # a bad OUTBOXER["consumer"]: the replay action reports it
            group = None
        if group:
            names.append(group)
        asked = self.value()
        if asked is not None and asked not in names:
            names.append(asked)
        return [(name, name) for name in names]


def selected_rows(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Any],
    fields: tuple[str, ...],
    bulk_command: str,
) -> list[tuple[Any, ...]] | None:
    """``fields`` of the selected rows, or None (the admin told why) when there are more than
    ``MAX_ACTION_ROWS``: read with a LIMIT of one past the cap, unordered, so a "select all"
    over millions of rows neither scans nor loads them all (nor counts them)."""
    rows = list(queryset.order_by().values_list(*fields)[: MAX_ACTION_ROWS + 1])
    if len(rows) <= MAX_ACTION_ROWS:
        return rows
    model_admin.message_user(
        request,
        f"Nothing done: the selection has more than {MAX_ACTION_ROWS:,} rows, the most one "
        f"action takes. Narrow it with the filters, or use `{bulk_command}` for bulk work.",
        messages.ERROR,
    )
    return None


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows the relay or the consumer own: listed and shown, changed only by actions."""

    list_per_page = 50
    show_full_result_count = False  # no COUNT(*) of the whole table on every page
    paginator = CappedPaginator  # nor of every row the filter matches
    # Nor Django 5's "Show counts" (?_facets): a COUNT of every row per filter choice. Django
    # 4.2 has no facets.
    show_facets = admin.ShowFacets.NEVER if hasattr(admin, "ShowFacets") else None

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
    list_filter = (StatusFilter, DestinationFilter)
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
        rows = selected_rows(
            self,
            request,
            queryset,
            ("message_id", "destination"),
            "outboxer requeue --status … --destination … --older-than …",
        )
        if rows is None:
            return
        try:
            count, deferred = requeue_messages(rows)
        except OutboxerError as exc:
            # A message, as the replay action gives, not a server error: outboxer's own
            # connection can fail where Django's did not (OUTBOXER["db"], a missing driver).
            # One transaction: nothing was requeued.
            text = f"Requeue failed: {redact_text(str(exc))}"
            self.message_user(request, text, messages.ERROR)
            return
        text = f"Requeued {count} message(s)"
        if deferred:
            # Left ABANDONED or FAILED, not silently: the operator requeues them again once
            # the later message of their key is published.
            text += (
                f"; {deferred} deferred: a later message of their key is in flight "
                "(requeue them once it is published)"
            )
        if skipped := len(rows) - count - deferred:
            text += f"; {skipped} not ABANDONED or FAILED, left alone"
        level = messages.WARNING if deferred else messages.SUCCESS
        self.message_user(request, f"{text}.", level)


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


def purge_dead_letters(queryset: QuerySet[DeadLetter], rows: Sequence[tuple[Any, ...]]) -> int:
    """Delete the dead letters of ``rows`` (seq, consumer group, headers) from ``queryset``;
    once the delete has committed, release the claim-check holds they had in the store of
    the ``claim_check_store`` setting, as ``outboxer dead-letters purge`` does: otherwise
    their objects were kept for ever. A crash in between keeps them too long, no more."""
    from outboxer import payload_admin
    from outboxer.claimcheck import close_store, run_bounded
    from outboxer.consume_cli import claim_check_names, release_holds

    alias = queryset.db
    settings = conf.settings_with(database=alias)
    # Opened first: a bad setting purges nothing (the action says why).
    store = payload_admin.object_store(settings)
    held: dict[str, list[str]] = {}  # group -> the objects its purged dead letters held
    if store is not None:
        for _, group, headers in rows:
            if names := claim_check_names(_headers(headers)):
                held.setdefault(group, []).extend(names)
    timeout = settings.claim_check_read_timeout
    try:
        count = int(queryset.filter(seq__in=[row[0] for row in rows]).delete()[0])
    except BaseException:
        if store is not None:
            close_store(store, timeout=timeout)
        raise
    if store is None:
        return count

    def release_all() -> None:
        for group, names in held.items():
            release_holds(store, names, group)

    def release() -> None:
        # Every group's releases in one bounded call: a store that stopped answering holds
        # the admin's request one timeout and leaves one thread, not one of each per group.
        answered = True
        try:
            if held:
                answered = run_bounded(
                    release_all,
                    timeout=timeout,
                    what=f"releasing {sum(map(len, held.values()))} claim-check hold(s) of "
                    f"purged dead letters of {len(held)} group(s) (those not released keep "
                    "their objects until their holds are deleted)",
                )
        finally:
            if answered:  # else one more wait, and one more hung thread
                close_store(store, timeout=timeout)

    # At once in autocommit; after the commit inside a transaction (ATOMIC_REQUESTS).
    transaction.on_commit(release, using=alias)
    return count


def _headers(value: Any) -> Any:
    # A JSONField over a text column (MariaDB, SQLite) may hand the JSON text back.
    if isinstance(value, str | bytes):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


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
    list_filter = (ConsumerFilter, "held")  # held: Django's Yes/No filter reads no rows
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
        # Only the rows counted: one arriving since is not deleted unseen.
        command = "outboxer dead-letters purge --group … --all (or --id …)"
        rows = selected_rows(self, request, queryset, ("seq", "consumer", "headers"), command)
        if rows is None:
            return
        try:
            count = purge_dead_letters(queryset, rows)
        except OutboxerError as exc:  # the claim-check store's setting: nothing purged
            self.message_user(request, f"Nothing purged: {redact_text(str(exc))}", messages.ERROR)
            return
        self.message_user(request, f"Purged {count} dead letter(s).", messages.SUCCESS)

    @admin.action(
        description="Replay the selected dead letters through the consumer's handler",
        permissions=["replay"],
    )
    def replay(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        rows = selected_rows(
            self,
            request,
            queryset,
            ("consumer", "message_id"),
            "outboxer dead-letters replay --group …",
        )
        if rows is None:
            return
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
