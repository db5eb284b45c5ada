"""Domain events recorded on an entity, written to the outbox with the entity's own rows.

The ORM integrations (``outboxer.contrib.sqlalchemy``, ``outboxer.contrib.django``) share
this part: an entity records events in memory (``record_event``); the integration hands
them to ``enqueue_many`` on the connection that writes the entity, inside the same
transaction, and forgets them once written. What is recorded is checked and encoded at once,
so a bad payload fails where it was recorded, not at a later flush, and a dict changed after
recording does not change the event.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from outboxer.enqueue import Outbox
from outboxer.message import (
    check_content_type,
    coerce_message_id,
    encode_payload,
    validate_envelope,
)

#: Where an entity keeps its unwritten events (in its instance ``__dict__``, never a column).
EVENTS_ATTRIBUTE = "_outboxer_events"

#: One process-wide order of recording, so the events of several entities written by one
#: flush or save keep the order in which they were recorded (``next()`` is atomic).
_recording_order = itertools.count()

Deferred = Callable[[], Any]


@dataclass(frozen=True)
class RecordedEvent:
    """One event recorded on an entity and not yet written to the outbox.

    ``payload`` is already encoded (``content_type`` says how), unless it was given as a
    callable: then it, like a callable ``key``, is called when the event is written, after
    the entity's own rows, so it can use a primary key the database generated.
    """

    topic: str
    payload: bytes | Deferred
    content_type: str | None
    key: str | Deferred | None
    headers: Mapping[str, str]
    message_id: uuid.UUID
    destinations: tuple[str, ...] | None
    order: int

    def as_item(self) -> dict[str, Any]:
        """``enqueue_many``'s arguments for this event (calls a deferred payload or key)."""
        payload: object = self.payload() if callable(self.payload) else self.payload
        key = self.key() if callable(self.key) else self.key
        return {
            "topic": self.topic,
            "payload": payload,
            "key": key,
            "headers": self.headers,
            "message_id": self.message_id,
            "content_type": self.content_type,
            "destinations": self.destinations,
        }


def record_event(
    entity: object,
    topic: str,
    payload: object,
    *,
    key: str | Deferred | None = None,
    headers: Mapping[str, str] | None = None,
    message_id: object = None,
    content_type: str | None = None,
    destinations: Sequence[str] | None = None,
) -> RecordedEvent:
    """Record an event on ``entity``; the integration writes it with the entity's rows.

    Arguments as ``outboxer.enqueue``'s; ``payload`` and ``key`` may also be callables
    taking no argument, called when the event is written. Raises ``PayloadError`` at once
    for what can be checked now. The event's id is chosen now (``message_id``).
    """
    topic, checked_key, clean_headers = validate_envelope(
        topic, None if callable(key) else key, headers
    )
    body: bytes | Deferred
    if callable(payload):
        body = payload
        if content_type is not None:
            check_content_type(content_type)
    else:
        body, content_type = encode_payload(payload, content_type)
    if destinations is not None:  # an Outbox checks the names (ConfigError), a str included
        destinations = Outbox(destinations=cast(tuple[str, ...], destinations)).destinations
    event = RecordedEvent(
        topic=topic,
        payload=body,
        content_type=content_type,
        key=key if callable(key) else checked_key,
        headers=clean_headers,
        message_id=coerce_message_id(message_id),
        destinations=tuple(destinations) if destinations is not None else None,
        order=next(_recording_order),
    )
    entity.__dict__.setdefault(EVENTS_ATTRIBUTE, []).append(event)
    hook = getattr(entity, "_outboxer_recorded", None)
    if hook is not None:  # an integration's tracking (the SQLAlchemy mixin's session, say)
        hook()
    return event


def pending_events(entity: object) -> list[RecordedEvent]:
    """The events recorded on ``entity`` and not yet written, in recording order."""
    events: list[RecordedEvent] = entity.__dict__.get(EVENTS_ATTRIBUTE, [])
    return events


def forget_events(entity: object, written: Iterable[RecordedEvent] | None = None) -> None:
    """Drop ``written`` from the entity's pending events (every one when None)."""
    events = entity.__dict__.get(EVENTS_ATTRIBUTE)
    if not events:
        return
    if written is None:
        events.clear()
    else:
        done = {id(event) for event in written}
        events[:] = [event for event in events if id(event) not in done]


def recording_mark() -> int:
    """A point in the order of recording: events recorded from now on have a greater
    ``order``, those recorded before it a smaller one (a savepoint's start, say)."""
    return next(_recording_order)


def restore_events(entity: object, events: Iterable[RecordedEvent]) -> None:
    """Make ``events`` pending again on ``entity``, in recording order: the savepoint that
    wrote them rolled back, and the transaction that recorded them still stands."""
    pending = entity.__dict__.setdefault(EVENTS_ATTRIBUTE, [])
    present = {id(event) for event in pending}
    pending.extend(event for event in events if id(event) not in present)
    pending.sort(key=lambda event: event.order)


def in_recording_order(
    entities: Iterable[object],
) -> list[tuple[object, RecordedEvent]]:
    """Every pending event of ``entities`` with its entity, in the order they were recorded."""
    pairs = [(entity, event) for entity in entities for event in pending_events(entity)]
    pairs.sort(key=lambda pair: pair[1].order)
    return pairs


class RecordsEvents:
    """Mixin for entities (SQLAlchemy mapped classes, Django models) that record events.

    Its methods use no mapped attribute: the events live in the instance's ``__dict__``.
    """

    #: ``entity.record_event(topic, payload, key=...)``: the function above, as a method.
    record_event = record_event

    @property
    def pending_events(self) -> tuple[RecordedEvent, ...]:
        """Recorded events not written yet, in recording order."""
        return tuple(pending_events(self))

    def discard_events(self) -> None:
        """Drop the recorded events that were not written yet."""
        forget_events(self)
