"""Django model events: a model records events; ``save()`` enqueues them in its ``atomic()``.

::

    from outboxer.contrib.django.events import RecordsEvents

    class Order(RecordsEvents, models.Model):
        ...

    with transaction.atomic():
        order = Order(customer="c-7", total=99.5)
        order.record_event("order.placed", lambda: {"id": order.pk}, key="c-7")
        order.save()   # the row, then its events, on the same connection and transaction

``save()`` and ``delete()`` run the model's own write and ``enqueue_many`` of the recorded
events inside one ``transaction.atomic(using=...)`` on the database the instance is written
to, so the events commit or roll back with the row (``save(update_fields=[])``, which Django
skips, writes no event either: they wait for the next save); the events of one instance keep
their recording order (callable payloads run after the row's INSERT: the pk is there;
``delete()`` writes them before its DELETE, which sets the pk to None, and those recorded
during it, by a ``pre_delete`` or ``post_delete`` receiver, after it).

When an event is forgotten, and why it differs from the SQLAlchemy integration: a Django
instance keeps its changed fields after a rollback, and saving it again writes them again.
So an event is forgotten when the transaction that wrote it commits (``on_commit``), not
when it is written: saving again in the same transaction does not write it twice (the
outbox already holds its row), while saving after a rollback, or after a failed save, writes
it again with the fields it describes. ``discard_events()`` drops what should never go out.

``QuerySet.update()``, ``bulk_create()`` and raw SQL bypass ``save()`` (and so the events):
record on the instances and call ``write_events_for(instances)`` in the same ``atomic()``::

    with transaction.atomic():
        orders = Order.objects.bulk_create([Order(customer=c) for c in customers])
        for order in orders:
            order.record_event("order.imported", {"customer": order.customer})
        write_events_for(orders)   # one enqueue_many, in recording order
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from django.db import connections, router, transaction

from outboxer.contrib.django import conf
from outboxer.contrib.events import RecordedEvent, forget_events, in_recording_order
from outboxer.contrib.events import RecordsEvents as _RecordsEvents

__all__ = ["RecordsEvents", "write_events", "write_events_for"]

#: Instance ``__dict__`` key: ids of events written by a transaction that has not committed.
_AWAITING_COMMIT = "_outboxer_awaiting_commit"


def _already_stored(alias: str, events: Sequence[RecordedEvent]) -> set[uuid.UUID]:
    """Which of ``events`` the outbox holds on ``alias``'s connection (in its transaction)."""
    if not events:
        return set()
    postgres = conf.dialect(alias) == "postgres"
    ids = [event.message_id if postgres else str(event.message_id) for event in events]
    marks = ", ".join(["%s"] * len(ids))
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT id FROM {conf.outbox_table(alias)} WHERE id IN ({marks})", ids)
        return {row[0] if postgres else uuid.UUID(row[0]) for row in cursor.fetchall()}


def write_events(instance: object, using: str) -> None:
    """Enqueue ``instance``'s recorded events on ``using``, inside its open transaction.

    For a model that does not use the mixin: record with
    ``outboxer.contrib.events.record_event(instance, ...)`` and call this after the write,
    inside the same ``transaction.atomic(using=using)``.
    """
    _write([instance], using)


def write_events_for(instances: Iterable[object], using: str | None = None) -> int:
    """Enqueue the events recorded on ``instances`` that were written without ``save()``
    (``bulk_create()``, ``QuerySet.update()``, raw SQL), inside the ``transaction.atomic()``
    that wrote them; the number of events enqueued.

    One ``enqueue_many`` for all of them, in recording order, on ``using`` (default: the
    database the router writes the first instance to). As with ``save()``, an event is
    forgotten once its transaction commits, and calling this again in the same transaction
    writes nothing twice. Outside ``atomic()`` it raises ``TypeError`` and writes nothing:
    the rows committed already, and the events would not commit with them.
    """
    entities = list(instances)
    if not entities:
        return 0
    first = entities[0]
    return _write(entities, using or router.db_for_write(type(first), instance=first))


def _awaiting(instance: object) -> set[uuid.UUID]:
    awaiting: set[uuid.UUID] = instance.__dict__.setdefault(_AWAITING_COMMIT, set())
    return awaiting


def _write(instances: Sequence[object], using: str) -> int:
    pairs = in_recording_order(instances)
    if not pairs:
        return 0
    written_before = [event for instance, event in pairs if event.message_id in _awaiting(instance)]
    # Written by an earlier save: still there if that save's transaction is this one (a
    # second save), gone if it rolled back (the instance still holds what they announce).
    stored = _already_stored(using, written_before)
    due = [(instance, event) for instance, event in pairs if event.message_id not in stored]
    if not due:
        return 0
    conf.outbox().enqueue_many(connections[using], [event.as_item() for _, event in due])
    by_instance: dict[int, tuple[object, list[RecordedEvent]]] = {}
    for instance, event in due:
        by_instance.setdefault(id(instance), (instance, []))[1].append(event)
    for instance, events in by_instance.values():
        _awaiting(instance).update(event.message_id for event in events)
        transaction.on_commit(functools.partial(_committed, instance, events), using=using)
    return len(due)


def _committed(instance: object, events: list[RecordedEvent]) -> None:
    forget_events(instance, events)
    _awaiting(instance).difference_update(event.message_id for event in events)


class RecordsEvents(_RecordsEvents):
    """Model mixin (put it before ``models.Model``): ``save()`` and ``delete()`` enqueue the
    recorded events in the same ``atomic()`` block as the write."""

    def save(self, *args: Any, **kwargs: Any) -> None:
        # ``using`` may come third positionally (force_insert, force_update, using, ...:
        # deprecated in Django 5.x, still honoured): the events go where the row goes.
        using = kwargs.get("using") or (args[2] if len(args) > 2 else None)
        using = using or router.db_for_write(type(self), instance=self)
        update_fields = kwargs.get("update_fields")
        if update_fields is None and len(args) > 3:
            update_fields = args[3]
        if update_fields is not None and not update_fields:
            # Django skips such a save (no write, no signals): so do its events, which stay
            # recorded for the next save that writes the row.
            super().save(*args, **kwargs)  # type: ignore[misc]
            return
        with transaction.atomic(using=using, savepoint=False):
            super().save(*args, **kwargs)  # type: ignore[misc]
            write_events(self, using)

    def delete(self, using: str | None = None, keep_parents: bool = False) -> Any:
        using = using or router.db_for_write(type(self), instance=self)
        with transaction.atomic(using=using, savepoint=False):
            # Before the DELETE: Django sets the primary key to None once the row is gone,
            # and a deferred payload or key (``lambda: {"id": self.pk}``) must still see it.
            write_events(self, using)
            deleted = super().delete(using=using, keep_parents=keep_parents)  # type: ignore[misc]
            # And after it, for the events recorded during it (a pre_delete or post_delete
            # receiver): those written above are in the outbox already, and not written twice.
            write_events(self, using)
        return deleted
