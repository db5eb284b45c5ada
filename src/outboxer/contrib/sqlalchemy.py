"""SQLAlchemy domain events: entities record events, the flush that writes them enqueues them.

::

    from outboxer.contrib.sqlalchemy import RecordsEvents, listen

    class Order(RecordsEvents, Base):
        __tablename__ = "orders"
        ...

    Session = sessionmaker(engine)
    listen(Session)                  # or a Session, AsyncSession, async_sessionmaker

    with Session.begin() as session:
        order = Order(customer="c-7", total=99.5)
        session.add(order)
        order.record_event("order.placed", lambda: {"id": order.id}, key="c-7")
    # the order and its event committed together; a rollback drops both

How it holds:

* The events are written in ``after_flush``: after the flush's INSERT/UPDATE/DELETE
  statements (so generated keys exist for deferred payloads) and inside the flush's
  transaction, on ``session.connection()``, the very connection the rows went through. An
  error there fails the flush, and SQLAlchemy rolls back the whole transaction. Only Core
  SQL runs in that hook (``enqueue_many``); SQLAlchemy warns against ORM operations there.
  A session with no changed rows does not flush at all, so ``before_commit`` writes the
  events of entities that changed nothing; an entity that records one later in the commit
  (another ``before_commit`` listener) is flagged dirty, so the commit's flush writes it.
* A written event is forgotten at once, so flushing again never writes it twice. Events
  recorded by another ``after_flush`` listener, after this one wrote, are written in
  ``after_flush_postexec`` of the same flush: the final flush of a commit included.
* A rollback of the whole transaction (``after_soft_rollback``: ``Session.rollback()``,
  a failed flush outside any savepoint) forgets the recorded events of the session's
  entities, written or not: the changes they describe are gone too (SQLAlchemy expires
  them). Not those of a new object the rollback returned to transient: SQLAlchemy keeps
  its attributes so that it can be added again, and it keeps its events too, those the
  rolled-back flush wrote included, so adding it again writes the row and each event once
  (record them once, not again on the retry). Nor those of an entity that left the
  session before the rollback (``expunge()``, then another session, say).
* A rolled-back savepoint (``begin_nested()``, or a failed flush inside one) forgets only
  the events recorded since it began, and keeps those of the new objects it returned to
  transient, as above. Those recorded before it stay pending, and the ones
  among them that the savepoint wrote are pending again (its rollback removed their rows),
  so the outer transaction still commits them: an entity that changed no row is not
  flushed when the savepoint begins, so its events may still be unwritten then.
* The events of one flush are written in the order they were recorded, across entities.
* ``AsyncSession`` runs its flush on a sync ``Session`` (``sync_session``) in a greenlet;
  the listener sits on that session, and its SQL goes through the async driver.
"""

from __future__ import annotations

from typing import Any

from outboxer.contrib.events import (
    RecordedEvent,
    forget_events,
    in_recording_order,
    pending_events,
    recording_mark,
    restore_events,
)
from outboxer.contrib.events import RecordsEvents as _RecordsEvents
from outboxer.contrib.events import record_event as _record_event
from outboxer.enqueue import Outbox
from outboxer.errors import MissingDependencyError

try:
    from sqlalchemy import event, inspect
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
    from sqlalchemy.orm import (
        Session,
        SessionTransaction,
        object_session,
        scoped_session,
        sessionmaker,
    )
    from sqlalchemy.orm.attributes import flag_dirty
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise MissingDependencyError("sqlalchemy", "sqlalchemy") from exc

__all__ = ["RecordedEvent", "RecordsEvents", "listen", "record_event"]

#: ``session.info`` key: the entities of this session that hold unwritten events, by id().
_RECORDING = "outboxer.recording"
#: ``session.info`` key: the events written in the current transaction, in writing order, as
#: (entity, event); a rollback takes back the ones written since its savepoint (or the
#: transaction) began, and gives a new object it returns to transient its own back.
_WRITTEN = "outboxer.written"
#: ``session.info`` key: per savepoint (by id()), its start: (recording mark, len(_WRITTEN)).
_SAVEPOINTS = "outboxer.savepoints"
#: ``session.info`` key: set from ``before_commit`` to the commit's end (or its failure).
_COMMITTING = "outboxer.committing"


def _track(entity: object) -> None:
    session = object_session(entity)
    if session is not None:
        session.info.setdefault(_RECORDING, {})[id(entity)] = entity
        if session.info.get(_COMMITTING) and inspect(entity).persistent:
            # Recorded by a listener after before_commit wrote, on an entity with no row
            # change: flagged, the commit flushes it (no UPDATE), and after_flush writes.
            flag_dirty(entity)


def record_event(entity: object, topic: str, payload: object, **options: Any) -> RecordedEvent:
    """``RecordsEvents.record_event`` for a mapped object that does not use the mixin."""
    recorded = _record_event(entity, topic, payload, **options)
    _track(entity)
    return recorded


class RecordsEvents(_RecordsEvents):
    """Mixin for mapped classes: ``entity.record_event(topic, payload, key=...)``.

    The events are written by the next flush of the session the entity belongs to (or is
    added to later), if ``listen`` was called for that session.
    """

    def _outboxer_recorded(self) -> None:
        _track(self)


class _Writer:
    """The session listeners: track entities with events, write them at flush, forget on rollback."""

    def __init__(self, outbox: Outbox | None) -> None:
        self.outbox = outbox

    def after_attach(self, session: Session, entity: object) -> None:
        if pending_events(entity):  # recorded before the entity joined this session
            session.info.setdefault(_RECORDING, {})[id(entity)] = entity

    def after_flush(self, session: Session, flush_context: object) -> None:
        self.write(session)

    def after_flush_postexec(self, session: Session, flush_context: object) -> None:
        """Events another ``after_flush`` listener recorded after ``after_flush`` wrote: the
        final flush of a commit is followed by the commit, not by ``before_commit``."""
        self.write(session)

    def before_commit(self, session: Session) -> None:
        """A flush runs only when rows changed: write the events of unchanged entities too."""
        session.info[_COMMITTING] = True  # later records: see _track
        if session.info.get(_RECORDING):
            session.flush()  # rows first, as at every flush: deferred payloads see their keys
            self.write(session)

    def write(self, session: Session) -> None:
        tracked: dict[int, object] | None = session.info.get(_RECORDING)
        if not tracked:
            return
        batches: dict[int, tuple[Any, list[tuple[object, RecordedEvent]]]] = {}
        for entity, recorded in in_recording_order(tracked.values()):
            if object_session(entity) is not session:
                continue  # expunged since: its events wait for the session it joins next
            # The connection of the entity's own bind (a session may bind mappers apart).
            mapper = inspect(entity).mapper
            bind = session.get_bind(mapper=mapper)
            if id(bind) not in batches:
                batches[id(bind)] = (session.connection(bind_arguments={"mapper": mapper}), [])
            batches[id(bind)][1].append((entity, recorded))
        for connection, pairs in batches.values():
            items = [recorded.as_item() for _, recorded in pairs]
            if self.outbox is None:  # outboxer.configure() may change it at any time
                from outboxer.enqueue import enqueue_many

                enqueue_many(connection, items)
            else:
                self.outbox.enqueue_many(connection, items)
            for entity, recorded in pairs:
                forget_events(entity, [recorded])
            # A rollback may take these back (a new object's, or a savepoint's).
            session.info.setdefault(_WRITTEN, []).extend(pairs)
        # Only now: had a write failed, the rollback that follows must find these entities.
        tracked.clear()

    def after_transaction_create(self, session: Session, transaction: SessionTransaction) -> None:
        if transaction.nested:
            start = (recording_mark(), len(session.info.get(_WRITTEN, ())))
            session.info.setdefault(_SAVEPOINTS, {})[id(transaction)] = start

    def after_commit(self, session: Session) -> None:
        session.info.pop(_COMMITTING, None)
        if not session.in_nested_transaction():  # committed: no rollback takes these back
            session.info.pop(_WRITTEN, None)

    def after_transaction_end(self, session: Session, transaction: SessionTransaction) -> None:
        # A savepoint's start stays until its whole transaction ends: its rollback is
        # reported (after_soft_rollback) after its end. Released ones cost a tuple each.
        if transaction.parent is None:
            session.info.pop(_COMMITTING, None)
            # Still here, the transaction did not commit: a rollback, reported after this
            # end. The new objects it returned to transient get back what it wrote.
            for entity, recorded in session.info.pop(_WRITTEN, ()):
                if inspect(entity).transient:
                    restore_events(entity, [recorded])
            session.info.pop(_SAVEPOINTS, None)

    def after_soft_rollback(
        self, session: Session, previous_transaction: SessionTransaction
    ) -> None:
        session.info.pop(_COMMITTING, None)
        # What the database rolled back: the innermost savepoint or the whole transaction
        # (a failed flush reports its own subtransaction).
        boundary = previous_transaction
        while not boundary.nested and boundary.parent is not None:
            boundary = boundary.parent
        start = session.info.get(_SAVEPOINTS, {}).get(id(boundary)) if boundary.nested else None
        mark, first_written = start if start is not None else (None, 0)
        tracked: dict[int, object] = session.info.setdefault(_RECORDING, {})
        written: list[tuple[object, RecordedEvent]] = session.info.get(_WRITTEN, [])
        taken_back = written[first_written:]
        del written[first_written:]
        for entity in list(tracked.values()):
            if object_session(entity) is not session:
                # Not this session's any more: in another one (moved there before this
                # rollback), or transient, a new object this rollback expunged with its
                # attributes kept, to be added again: either way it keeps its events.
                del tracked[id(entity)]
                continue
            # Recorded inside what rolled back: the changes they describe are gone with it.
            forget_events(
                entity, [e for e in pending_events(entity) if mark is None or e.order > mark]
            )
            if not pending_events(entity):
                del tracked[id(entity)]
        for entity, recorded in taken_back:
            if inspect(entity).transient:
                # A new object the rollback made transient: its INSERT is gone, not its
                # attributes, and adding it again writes these with it.
                restore_events(entity, [recorded])
            elif mark is not None and recorded.order < mark and object_session(entity) is session:
                # Recorded before the savepoint, written inside it: their rows are gone,
                # not their changes.
                restore_events(entity, [recorded])
                tracked[id(entity)] = entity


def _session_target(target: object) -> Any:
    """What SQLAlchemy's session events accept for ``target`` (async ones mapped to sync)."""
    if isinstance(target, AsyncSession):
        return target.sync_session
    if isinstance(target, async_sessionmaker):
        # Its sessions flush on a sync Session of class ``sync_session_class``: give this
        # factory a subclass of its own, so the listeners reach its sessions only.
        base = target.kw.get("sync_session_class") or target.class_.sync_session_class
        own = type(f"Outboxer{base.__name__}", (base,), {})
        target.kw["sync_session_class"] = own
        return own
    if isinstance(target, Session | sessionmaker | scoped_session) or (
        isinstance(target, type) and issubclass(target, Session)
    ):
        return target
    raise TypeError(
        "listen() takes a Session, AsyncSession, sessionmaker, async_sessionmaker, "
        f"scoped_session or Session subclass, not {type(target).__name__}"
    )


def listen(target: object, *, outbox: Outbox | None = None) -> None:
    """Write recorded events at every flush of the sessions of ``target``.

    ``outbox`` names the table and destinations (default: the one ``outboxer.enqueue``
    uses, as ``outboxer.configure`` set it). Call it once per target.
    """
    where = _session_target(target)
    writer = _Writer(outbox)
    event.listen(where, "after_attach", writer.after_attach)
    event.listen(where, "after_flush", writer.after_flush)
    event.listen(where, "after_flush_postexec", writer.after_flush_postexec)
    event.listen(where, "before_commit", writer.before_commit)
    event.listen(where, "after_commit", writer.after_commit)
    event.listen(where, "after_transaction_create", writer.after_transaction_create)
    event.listen(where, "after_transaction_end", writer.after_transaction_end)
    event.listen(where, "after_soft_rollback", writer.after_soft_rollback)
