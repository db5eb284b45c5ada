"""``kafka://host:9092``: a Kafka consumer group (``group.id`` = the group), offsets committed
only after the database commit.

The relay gives a message's key to Kafka, so each key lives on one partition and the
partition's order is the key's order; the runner applies a key's messages in that order
and different keys in parallel. Partitions are shared among the group's processes by Kafka
(a rebalance moves them); a topic (or a ``^regex``) is given per ``--topic``.

Offsets. An offset is committed only once every message of its partition up to it has
been applied (or dead-lettered) and committed to the database: messages finish out of
order across keys, so each partition keeps the offsets received and commits up to the
first one not done. Auto-commit is off. After a crash the group reads again from the last
committed offset; what was applied since is recognised by the inbox. Before a rebalance
takes a partition away, what is done of it is committed; acks of messages from a
partition this process no longer owns are dropped, and those of its messages still waiting
for the runner are not handed over (its new owner gets them again). A commit the
coordinator refuses is tried again while the partition is still this process's. If
``auto.offset.reset`` moves a partition back while it stays this process's (its position out
of range: a truncated log), the records read again are tracked apart from the earlier ones
(whose acks then commit nothing), and the committed offset never goes back.

librdkafka wants its consumer polled continuously (``max.poll.interval.ms``), also while
the runner is busy, so a thread of the receiver's own polls it, pausing the partitions
while ``prefetch`` messages wait for the runner, and runs every call on the consumer
(commits included), one at a time.

The URL is the relay's (bootstrap servers, SASL user, librdkafka options), read by
:class:`KafkaPublisher`; its producer-only settings are left out. Options of the receiver:
``offset_reset`` (``earliest``, the default: a new group reads each partition from its
start, or ``latest``) and ``suspect_window`` (below).

Suspects (``suspect_window``, default 0: off). A record read again from the committed offset
carries no redelivered flag, so a message that kills the process (a segfault, the OOM
killer) would come first again after every restart, for ever, its partition stopped. With
``suspect_window=N``, the first N messages this member receives from a partition after each
assignment of it (a start, a reconnect, every rebalance, eager or cooperative: only the
partitions an assignment adds) are marked ``redelivered``, so the runner applies each alone
and records its attempt before its handler runs (a *suspect*, docs/design/consumer.md).
When a process dies, the message that killed it is among those past its partition's
committed offset, which is where the next owner starts: acks commit offsets as they go, so
those are at most the messages the runner held (``prefetch``), unless one held back the
commit (a message of another key retrying, while later ones were applied). N should be at
least the consumer's ``prefetch``. The cost, why it is off by default: N messages per
partition after every assignment are applied alone, each with one extra commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from outboxer.brokers.base import describe
from outboxer.brokers.kafka import CONSUMER_OPTIONS, ENFORCED, KafkaPublisher
from outboxer.config import int_option
from outboxer.errors import ConfigError
from outboxer.receivers.base import Incoming, Receiver, decode, take, unreadable

logger = logging.getLogger("outboxer.kafka")

#: Producer settings the publisher adds that a consumer has no use for.
_PRODUCER_ONLY = (*ENFORCED, "message.timeout.ms", "logger")
_POLL = 0.1
#: A name Kafka accepts for a topic (a subscription starting with ``^`` is a pattern).
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
#: Seconds before a commit the coordinator refused is tried again.
_COMMIT_RETRY = 1.0
#: Session timeouts a cooperative handover (``idle``) is waited for at most.
_HANDOVER_SESSIONS = 3
#: Seconds the polling thread may spend asking the broker for one ``lag`` reading.
LAG_BROKER_BUDGET = 0.5
#: Seconds between two looks at a handover's partitions (committed offsets, ends), and
#: the bound on each of the two requests a look makes.
_HANDOVER_CHECK_EVERY = 0.5
_HANDOVER_CHECK_TIMEOUT = 2.0
#: ``message.headers()``, called through the C API. For a header name that is not UTF-8,
#: confluent-kafka returns a list holding a NULL with an exception set: the C API turns that
#: into a SystemError, but once CPython specialised a plain ``message.headers()`` call site
#: (after a few calls) nothing checks, and reading the list crashes the process. Either way
#: the record came first again after a restart: one foreign record stopped the group.
_read_headers = operator.methodcaller("headers")


@dataclass
class _Partition:
    """A partition this process owns: offsets received in order, and which are done.

    ``epoch`` names the series of offsets ``received`` holds: a new assignment starts one
    (``assigned``), and so does ``auto.offset.reset`` moving the position back while the
    partition stays ours (a truncated log: the same offsets may then hold other records)."""

    epoch: int
    assigned: int
    received: deque[int] = field(default_factory=deque)
    done: set[int] = field(default_factory=set)
    #: The highest offset received in this series (-1: none yet).
    last: int = -1
    #: The highest offset queued for commit under this assignment: never committed lower.
    floor: int = 0
    #: Where the last end of the partition was reached (-1: not yet, in this series); caught up
    #: while nothing came after it (``eof > last``).
    eof: int = -1
    #: Messages received under this assignment (counted up to ``suspect_window`` only).
    seen: int = 0

    def restart(self, epoch: int) -> None:
        """A new series (the position moved back): what the old one received counts no more."""
        self.epoch = epoch
        self.received.clear()
        self.done.clear()
        self.last = -1
        self.eof = -1

    def complete(self, offset: int) -> int | None:
        """Mark ``offset`` done; the offset to commit now (next to read), if it moved on."""
        self.done.add(offset)
        last = None
        while self.received and self.received[0] in self.done:
            last = self.received.popleft()
            self.done.discard(last)
        if last is None or last + 1 <= self.floor:
            # Re-read after a reset backwards: committing it would move the group back, and a
            # restart would read (and apply) again all that was already committed.
            return None
        self.floor = last + 1
        return self.floor


class KafkaReceiver(Receiver):
    """A consumer group member; commits a partition's offsets only past applied messages."""

    schemes = ("kafka",)
    options = CONSUMER_OPTIONS
    publisher_class = KafkaPublisher

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        reset = str(self.settings.get("offset_reset", "earliest"))
        if reset not in ("earliest", "latest"):
            raise ConfigError(
                f"kafka option offset_reset must be earliest or latest, not {reset!r}"
            )
        #: The first messages of each partition's assignment marked redelivered (suspects).
        self.suspect_window = int_option(
            self.settings.get("suspect_window", 0),
            "kafka option suspect_window",
            0,
            Receiver.max_prefetch,
        )
        for topic in self.topics:
            # Subscribed to, a name Kafka refuses is a topic that never comes: the member
            # would wait for ever, logging at INFO only.
            if not topic.startswith("^") and not _TOPIC_NAME.fullmatch(topic):
                raise ConfigError(
                    f"{topic!r:.300} is not a Kafka topic name: 1 to 249 of a-z A-Z 0-9 . _ - "
                    "(or a ^regex)"
                )
        settings = {k: v for k, v in self._kafka.config.items() if k not in _PRODUCER_ONLY}
        self.config: dict[str, Any] = {
            **settings,
            "group.id": self.group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": reset,
            # The end of each partition is reported (``idle``: every partition caught up).
            "enable.partition.eof": True,
            "logger": logger,
        }
        self._consumer: Consumer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        #: Offsets to commit (next to read, per partition), taken by the polling thread.
        self._to_commit: dict[tuple[str, int], int] = {}
        #: No commit before this (monotonic) time, after a failed one; but at revoke and close.
        self._commit_after = 0.0
        self._arrived: asyncio.Queue[Incoming] = asyncio.Queue()
        self._lost = asyncio.Event()
        self._lock = threading.Lock()
        self._partitions: dict[tuple[str, int], _Partition] = {}
        self._epoch = 0
        #: Messages handed to the event loop and not yet taken by the runner.
        self._waiting = 0
        #: The group gave this member its share (``idle``), since the last connect or revoke
        #: (a rebalance in progress: the next share is not known yet).
        self._assigned = False
        #: ``cooperative-sticky``: a revoke hands partitions over in two rebalance rounds or
        #: more (the member giving them up gets ``revoke`` then an ``assign`` of what it
        #: gains, often nothing; their new owner gets them in a later round, when the group
        #: coordinator has heard from every member: on a loaded box, a round later than that).
        self._cooperative = "cooperative" in str(
            self.config.get("partition.assignment.strategy", "")
        )
        self._offset_reset = reset
        #: Partitions this member gave up in a cooperative revoke whose records may be still
        #: unread: ``idle`` waits until the group's committed offset reaches each one's end
        #: (their new owner applied them), or until ``_handover_until`` (monotonic). No
        #: member owns them for a round or more, and nothing this member is told says when
        #: they reach their new owner (counting two assignments did not: an extra round
        #: came under load, and both members were idle with a partition unread for 1.5 s).
        self._handed_over: set[tuple[str, int]] = set()
        self._handover_until = 0.0
        #: When (monotonic) the polling thread looks at the handed-over partitions next.
        self._handover_check_at = 0.0
        try:
            session = float(self.config.get("session.timeout.ms", 45000)) / 1000
        except (TypeError, ValueError):  # librdkafka refuses it at connect
            session = 45.0
        self._handover_wait = _HANDOVER_SESSIONS * session
        #: ``lag`` calls waiting for the polling thread (which owns the consumer) to measure
        #: it, each with its deadline (monotonic).
        self._lag_asked: list[tuple[asyncio.Future[int | None], float]] = []

    @property
    def _kafka(self) -> KafkaPublisher:
        assert isinstance(self.publisher, KafkaPublisher)
        return self.publisher

    def parse(self, url: str, **options: Any) -> KafkaPublisher:
        return KafkaPublisher(url, **options)

    # ----- the polling thread ----------------------------------------------------------------

    async def _connect(self) -> None:
        await self._close()
        consumer = Consumer(self.config)
        probe = _Probe(consumer)
        try:
            await asyncio.to_thread(probe.run, self.connect_timeout)
        except KafkaException as exc:  # closed by the probe
            raise ConnectionError(f"no Kafka broker answered: {exc}") from exc
        except BaseException:
            # connect()'s own timeout (the same as the request's, so the first to end): the
            # consumer, its threads and sockets, was left to the garbage collector, never
            # closed while anything (a logged traceback) held the failed attempt.
            probe.abandon()
            raise
        try:
            consumer.subscribe(
                self.topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
        except KafkaException as exc:
            await asyncio.to_thread(consumer.close)
            error = exc.args[0] if exc.args else None
            if isinstance(error, KafkaError) and error.code() == KafkaError._INVALID_ARG:
                # A ^pattern librdkafka cannot compile: no reconnect will mend it.
                raise ConfigError(
                    f"kafka cannot subscribe to {self.topics!r:.300}: {exc}"
                ) from None
            raise
        self._consumer = consumer
        self._arrived = asyncio.Queue()
        self._waiting = 0
        self._lost = asyncio.Event()
        self._stop = threading.Event()
        self._assigned = False
        self._handed_over = set()
        self._thread = threading.Thread(
            target=self._poll,
            args=(consumer, asyncio.get_running_loop()),
            name="outboxer-kafka-consume",
            daemon=True,
        )
        self._thread.start()

    def _poll(self, consumer: Consumer, loop: asyncio.AbstractEventLoop) -> None:
        paused = False
        try:
            while not self._stop.is_set():
                if time.monotonic() >= self._commit_after:
                    self._commit(consumer)
                if self._handed_over and time.monotonic() >= self._handover_check_at:
                    self._check_handover(consumer)
                full = self._waiting >= self.prefetch
                if full:  # also partitions a rebalance just gave us
                    consumer.pause(consumer.assignment())
                elif paused:
                    consumer.resume(consumer.assignment())
                paused = full
                messages = consumer.consume(max(1, self.prefetch - self._waiting), _POLL)
                received: list[Incoming] = []
                ends: list[Any] = []
                for message in messages:
                    error: KafkaError | None = message.error()
                    if error is None:
                        received.append(self._incoming(message))
                    elif error.code() == KafkaError._PARTITION_EOF:
                        ends.append(message)
                    else:
                        _failed(error)
                if received or ends:
                    with self._lock:
                        # Counted waiting before a partition's end (of the same batch) counts:
                        # idle() must not see the end of records still on their way.
                        self._waiting += len(received)
                        for end in ends:
                            self._caught_up(end)
                    if received:
                        loop.call_soon_threadsafe(self._deliver, received)
                if self._lag_asked:
                    # Paused, the partitions are not fetched: their cached ends are stale.
                    self._answer_lag(consumer, loop, stale=full)
            self._commit(consumer)  # the last acks
        except Exception as exc:  # noqa: BLE001 -- reported to the runner, which reconnects
            logger.warning("kafka consumer failed: %s", exc)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                loop.call_soon_threadsafe(self._lost.set)
        finally:
            self._settle_lag(loop, None)  # nobody measures it any more on this consumer

    def _commit(self, consumer: Consumer) -> None:
        """Commit the offsets acks moved (in the polling thread, which owns the consumer)."""
        with self._lock:
            due, self._to_commit = self._to_commit, {}
        if not due:
            return
        offsets = [TopicPartition(topic, part, offset) for (topic, part), offset in due.items()]
        try:
            answered = consumer.commit(offsets=offsets, asynchronous=False) or []
        except KafkaException as exc:
            logger.info("kafka commit of %s failed: %s", offsets, exc)
            failed = set(due)
        else:
            failed = {(tp.topic, tp.partition) for tp in answered if tp.error is not None}
            if failed:
                logger.info("kafka commit of %s failed: %s", offsets, answered)
        if not failed:
            return
        # Tried again (after a pause: the error may last) while the partition is still ours;
        # dropped, a partition with no later ack would keep its applied messages uncommitted,
        # read again after every restart. A partition since revoked is its new owner's.
        self._commit_after = time.monotonic() + _COMMIT_RETRY
        with self._lock:
            for where in failed:
                if where in self._partitions:
                    self._to_commit.setdefault(where, due[where])  # a later ack's offset wins

    def _answer_lag(self, consumer: Any, loop: asyncio.AbstractEventLoop, stale: bool) -> None:
        """Measure the lag for the ``lag`` calls waiting (in the polling thread, which owns
        the consumer); None if it cannot be told. Never raises: a metric must not stop the
        polling."""
        with self._lock:
            deadline = max((until for _, until in self._lag_asked), default=0.0)
        # The polling thread neither fetches nor commits while it asks the broker (committed
        # offsets, paused partitions' ends): a slow coordinator must cost it a moment every
        # LAG_INTERVAL, not the caller's whole timeout. Unanswered within it: None.
        deadline = min(deadline, time.monotonic() + LAG_BROKER_BUDGET)
        try:
            value = self._measure_lag(consumer, stale, deadline)
        except Exception as exc:  # noqa: BLE001 -- KafkaException, a timeout: unknown this time
            logger.debug("kafka lag not measured: %s", describe(exc))
            value = None
        self._settle_lag(loop, value)

    def _settle_lag(self, loop: asyncio.AbstractEventLoop, value: int | None) -> None:
        with self._lock:
            asked, self._lag_asked = self._lag_asked, []
        if asked:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                loop.call_soon_threadsafe(_settle, [answer for answer, _ in asked], value)

    def _measure_lag(self, consumer: Any, stale: bool, deadline: float) -> int | None:
        """The records of this member's partitions past its position: their end (the high
        watermark) less the offset of the next record the consumer hands over, or where
        it starts reading (the committed offset, else ``offset_reset``) if it has handed
        over none yet. Ends cached from the fetches, else asked of the broker (``stale``: the
        partitions are paused, and not fetched), until ``deadline`` (monotonic)."""
        with self._lock:
            if not self._assigned:
                return None  # a rebalance: this member's share is not known yet
        assigned = consumer.assignment()
        if not assigned:
            return 0  # more members than partitions: nothing is this member's
        starts: dict[tuple[str, int], int] = {}
        unplaced: list[TopicPartition] = []
        for tp in consumer.position(assigned):
            if tp.error is not None:
                return None
            if tp.offset >= 0:
                starts[(tp.topic, tp.partition)] = tp.offset
            else:
                unplaced.append(TopicPartition(tp.topic, tp.partition))
        if unplaced:
            for tp in consumer.committed(unplaced, timeout=_left(deadline)):
                if tp.error is not None:
                    return None
                starts[(tp.topic, tp.partition)] = tp.offset  # negative: none committed
        total = 0
        for (topic, part), start in starts.items():
            where = TopicPartition(topic, part)
            ends = None if stale else consumer.get_watermark_offsets(where, cached=True)
            if ends is None or ends[1] < 0 or (start < 0 and ends[0] < 0):
                ends = consumer.get_watermark_offsets(where, timeout=_left(deadline))
                if ends is None:
                    return None  # the broker did not answer in time
            low, high = ends
            if start < 0:
                start = low if self._offset_reset == "earliest" else high
            total += max(0, high - start)
        return total

    def _check_handover(self, consumer: Any) -> None:
        """Forget the handed-over partitions nothing is left to read in: the group's
        committed offset (or, with none, where ``offset_reset`` starts a new owner) reached
        their end (in the polling thread, which owns the consumer). A broker that does not
        answer leaves them waited for, up to ``_handover_until``. A partition whose last
        offsets are transaction markers never looks done this way: the bound ends its wait."""
        self._handover_check_at = time.monotonic() + _HANDOVER_CHECK_EVERY
        with self._lock:
            pending = [TopicPartition(topic, part) for topic, part in self._handed_over]
        done: set[tuple[str, int]] = set()
        try:
            for committed in consumer.committed(pending, timeout=_HANDOVER_CHECK_TIMEOUT):
                if committed.error is not None:
                    continue
                where = TopicPartition(committed.topic, committed.partition)
                low, high = consumer.get_watermark_offsets(
                    where, timeout=_HANDOVER_CHECK_TIMEOUT, cached=False
                )
                start = committed.offset
                if start < 0:  # no committed offset: where a new owner begins
                    start = low if self._offset_reset == "earliest" else high
                if start >= high:
                    done.add((committed.topic, committed.partition))
        except KafkaException as exc:
            logger.debug("kafka handover check of %s failed: %s", pending, exc)
        if done:
            with self._lock:
                self._handed_over -= done

    def _deliver(self, received: list[Incoming]) -> None:
        for incoming in received:
            self._arrived.put_nowait(incoming)

    def _caught_up(self, end: Any) -> None:
        """A partition's end was reached (``enable.partition.eof``), under the lock."""
        where = (end.topic(), end.partition())
        partition = self._partitions.get(where)
        if partition is None:  # assigned before on_assign ran (it runs in this thread)
            partition = self._partitions[where] = _Partition(self._epoch, self._epoch)
        if end.offset() > partition.last:  # else: an end of the series before a reset back
            partition.eof = end.offset()

    def _incoming(self, message: Any) -> Incoming:
        incoming = _read(message)
        where = (message.topic(), message.partition())
        with self._lock:
            partition = self._partitions.get(where)
            if partition is None:  # assigned before on_assign ran (it runs in this thread)
                partition = self._partitions[where] = _Partition(self._epoch, self._epoch)
            offset = message.offset()
            if offset <= partition.last:
                # auto.offset.reset moved the position back (out of range) while the partition
                # stayed ours. Recorded in the same series, an offset would be there twice, and
                # the ack of one copy would count for the other (after a truncation, another
                # record): a new series; acks of the old one's messages commit nothing.
                self._epoch += 1
                partition.restart(self._epoch)
            partition.last = offset
            partition.received.append(offset)
            if partition.seen < self.suspect_window:
                # Read again from the committed offset, this may be the message that killed
                # the partition's last owner: nothing else tells (no redelivered flag).
                partition.seen += 1
                incoming.redelivered = True
            incoming.token = (where, message.offset(), partition.epoch)
        return incoming

    def _on_assign(self, consumer: Consumer, assigned: list[TopicPartition]) -> None:
        with self._lock:
            self._epoch += 1
            self._assigned = True  # also with no partition: more members than partitions
            for tp in assigned:
                self._handed_over.discard((tp.topic, tp.partition))  # ours again
                self._partitions[(tp.topic, tp.partition)] = _Partition(self._epoch, self._epoch)

    def idle(self) -> bool:
        """Idle once the group gave this member its share (no partition at all, when the group
        has more members than partitions) and every partition of it is caught up: its end was
        reached and nothing came after it, nor waits for the runner. Not during a rebalance
        (from a revoke to the next assignment), nor before a partition's first fetch ended
        (an empty poll says nothing then: quiet for a while is not caught up, a slow broker
        takes round trips to answer). With ``cooperative-sticky``, not while partitions this
        member gave up hold records the group has not committed (their new owner, which
        gets them a round later or more, is idle meanwhile, owning nothing yet), for a few
        session timeouts at most."""
        with self._lock:
            return (
                self._assigned
                and self._waiting == 0
                and all(p.eof > p.last for p in self._partitions.values())
                and (not self._handed_over or time.monotonic() >= self._handover_until)
            )

    def _on_revoke(self, consumer: Consumer, revoked: list[TopicPartition]) -> None:
        """Before the partitions go: what is done is committed, the rest is the new owner's."""
        self._revoked(consumer, revoked, handover=self._cooperative)

    def _on_lost(self, consumer: Consumer, lost: list[TopicPartition]) -> None:
        """The partitions went already (the session expired): as a revoke, but no cooperative
        handover is waited for, the member is taken back in one round."""
        self._revoked(consumer, lost, handover=False)

    def _revoked(self, consumer: Consumer, revoked: list[TopicPartition], handover: bool) -> None:
        with self._lock:
            self._assigned = False  # a rebalance: not idle before its assignment
            if handover and revoked:
                # Looked at after the commit below: what this member applied may be all.
                self._handed_over.update((tp.topic, tp.partition) for tp in revoked)
                self._handover_until = time.monotonic() + self._handover_wait
                self._handover_check_at = 0.0
            elif not handover:
                self._handed_over.clear()
            for tp in revoked:
                self._partitions.pop((tp.topic, tp.partition), None)
        self._commit(consumer)

    # ----- what the runner calls ---------------------------------------------------------------

    async def lag(self, timeout: float = 5.0) -> int | None:
        """The records of *this member's* partitions it has not handed over yet (each
        partition's high watermark less the member's position): a group's lag is the sum
        over its members. Measured by the polling thread, which alone calls the consumer."""
        thread = self._thread
        if not self._connected or thread is None or not thread.is_alive():
            return None
        answer: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._lag_asked.append((answer, time.monotonic() + timeout))
        try:
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            logger.debug("kafka lag not measured within %.1f s", timeout)
            return None

    async def _close(self) -> None:
        consumer, thread = self._consumer, self._thread
        self._consumer = self._thread = None
        if consumer is None:
            return
        self._stop.set()
        if thread is not None:
            await asyncio.to_thread(thread.join)
        with contextlib.suppress(KafkaException, RuntimeError):  # a broken consumer: nothing left
            await asyncio.to_thread(consumer.close)  # leaves the group: a rebalance at once

    async def _receive(self, limit: int, timeout: float) -> list[Incoming]:
        if self._thread is not None and not self._thread.is_alive():
            self._lost.set()
        received = await take(self._arrived, self._lost, limit, timeout, "Kafka")
        with self._lock:
            self._waiting -= len(received)
            # Messages of a partition revoked while they waited here are its new owner's,
            # read by it from the last commit: applied here too, they raced the new owner's
            # copies (the two members' transactions waiting on each other's inbox rows)
            # and, at a revoke and re-assign, came twice here, the stale copies first.
            return [incoming for incoming in received if self._owned(incoming)]

    def _owned(self, incoming: Incoming) -> bool:
        """Whether ``incoming`` came under the assignment of its partition that still holds."""
        where, _offset, epoch = incoming.token
        partition = self._partitions.get(where)
        return partition is not None and epoch >= partition.assigned

    async def _ack(self, incomings: Sequence[Incoming]) -> None:
        """Record the offsets done; the polling thread commits them before its next poll."""
        with self._lock:
            for incoming in incomings:
                where, offset, epoch = incoming.token
                if not self._owned(incoming):
                    continue  # revoked meanwhile: its new owner reads it again
                partition = self._partitions[where]
                if epoch != partition.epoch:
                    continue  # read before a reset moved the position back: counts no more
                moved = partition.complete(offset)
                if moved is not None:
                    self._to_commit[where] = moved


class _Probe:
    """A new consumer's first metadata request, in a thread of its own. If the connect stops
    waiting for it, the consumer is closed once the request ends, by whichever side comes
    last (closed at once, it would be freed under the request still using it)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self._lock = threading.Lock()
        self._abandoned = self._finished = False

    def run(self, timeout: float) -> None:
        try:
            self.consumer.list_topics(None, timeout)
        except BaseException:
            _close(self.consumer)
            raise
        with self._lock:
            self._finished = True
            abandoned = self._abandoned
        if abandoned:
            _close(self.consumer)

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            finished = self._finished
        if finished:  # the request ended as the connect gave up: nobody else will close it
            threading.Thread(target=_close, args=(self.consumer,), daemon=True).start()


def _settle(answers: Sequence[asyncio.Future[int | None]], value: int | None) -> None:
    for answer in answers:
        if not answer.done():  # else its lag() gave up waiting
            answer.set_result(value)


def _left(deadline: float) -> float:
    """Seconds to ``deadline``; TimeoutError once it passed (a lag nobody waits for)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the lag's deadline passed")
    return left


def _failed(error: KafkaError) -> None:
    """An error event of the consumer: raised if fatal (the runner reconnects), else logged."""
    if error.fatal():
        raise KafkaException(error)
    logger.info("kafka: %s", error)


def _close(consumer: Consumer) -> None:
    with contextlib.suppress(KafkaException, RuntimeError):  # a broken consumer: nothing left
        consumer.close()


def _read(message: Any) -> Incoming:
    """The Incoming of a record; unreadable (dead-lettered, then acked), never raised: a raise
    would stop the polling thread, and after the reconnect the same record comes first
    again, so one hostile record would stop the member for good."""
    body = message.value() or b""
    try:
        raw_headers = _read_headers(message) or []
    except Exception:  # noqa: BLE001 -- the record's fault
        return unreadable(
            "kafka record headers cannot be read (a header name is not UTF-8)",
            body,
            topic=message.topic(),
        )
    headers = {name: (value or b"").decode("utf-8", "replace") for name, value in raw_headers}
    key = message.key()
    try:
        return decode(
            headers,
            body,
            key=key.decode("utf-8", "replace") if key is not None else None,
            fallback_topic=message.topic(),
        )
    except Exception as exc:  # noqa: BLE001 -- e.g. RecursionError: JSON nested too deep
        return unreadable(
            f"kafka record cannot be decoded: {describe(exc)}", body, topic=message.topic()
        )


__all__ = ["KafkaReceiver"]
