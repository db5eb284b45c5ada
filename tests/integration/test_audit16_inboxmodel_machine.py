"""A stateful model test of the consumer's database layer on the real SQLite, PostgreSQL
(psycopg and asyncpg) and MariaDB.

Hypothesis drives a RuleBasedStateMachine through what ``Consumer`` does with a
``consumer_db.Session``: batches of deliveries (ids from a small pool, so redeliveries
happen; keys among three or none) whose handler writes a row to an application table and
succeeds, raises, runs COMMIT itself, or kills its connection; a message dead-lettered after its failures
(``record_dead_letter``), later messages of its key held behind it (``hold_keys``);
suspects (``suspect_attempt``, ``apply(suspect=True)``, ``suspect_done``): applied, failed,
dead-lettered after ``max_attempts`` deaths, cut short, or the process dying under them;
``Consumer.replay_dead_letters`` (the whole group, or chosen ids); the inbox retention
(``Store.cleanup_inbox``) after some rows were made old by SQL; the worker's connection
closed and opened again between steps. A plain-Python model predicts each step's results;
after every step the inbox, the application table, the dead letters (order, held,
attempts) and the suspects' deaths are compared with it.

Time is moved by hand: "ageing" a row sets its timestamp 40 days (and a few seconds, a
distinct value per row so that the retention's oldest-first order is known) back.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import outboxer
from outboxer.consumer import Consumer
from outboxer.consumer_db import (
    BatchFailed,
    DaemonThreadPool,
    HandlerEndedTransaction,
    Result,
    Session,
    session_factory,
)
from outboxer.receivers.base import Delivery
from outboxer.stores.base import Store
from tests.peek import Peek

KEYS = ("k1", "k2", "k3", None)
POOL = 6
DAY = 86400.0
RETENTION = 7 * DAY
APP = "audit16_effects"
#: kind -> (database fixture, async driver)
KINDS: dict[str, tuple[str, str | None]] = {
    "sqlite": ("sqlite_url", None),
    "postgres-psycopg": ("pg_url", None),
    "postgres-asyncpg": ("pg_url", "asyncpg"),
    "mysql": ("mysql_url", None),
}
#: A timestamp 40 days and %d seconds back, as each database writes it.
OLD = {
    "sqlite": "(julianday('now') - 2440587.5) * 86400.0 - 40 * 86400.0 - {n}",
    "postgres": "now() - interval '40 days' - make_interval(secs => {n})",
    "mysql": "UTC_TIMESTAMP(6) - INTERVAL 40 DAY - INTERVAL {n} SECOND",
}


class Database(Peek):
    """The test's own SQL on the real database: reading the tables, ageing rows."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        prefix = "outboxer." if self.dialect == "postgres" else ""
        self.inbox = f"{prefix}inbox"
        self.suspects = f"{prefix}inbox_suspects"
        self.dead_letters = f"{prefix}dead_letters"
        self.key = "`key`" if self.dialect == "mysql" else "key"
        self._run(
            f"CREATE TABLE IF NOT EXISTS {APP} "
            "(consumer VARCHAR(100) NOT NULL, message_id VARCHAR(36) NOT NULL)"
        )

    # Only our own group names and UUIDs go into the SQL: no quoting beyond the quotes.

    def inbox_ids(self, group: str) -> list[str]:
        return [
            str(r[0])
            for r in self._run(f"SELECT message_id FROM {self.inbox} WHERE consumer = '{group}'")
        ]

    def effects(self, group: str) -> Counter[str]:
        rows = self._run(f"SELECT message_id FROM {APP} WHERE consumer = '{group}'")
        return Counter(str(r[0]) for r in rows)

    def letters(self, group: str) -> list[tuple[str, str | None, bool, int]]:
        rows = self._run(
            f"SELECT message_id, {self.key}, held, attempts FROM {self.dead_letters} "
            f"WHERE consumer = '{group}' ORDER BY seq"
        )
        return [(str(r[0]), r[1], bool(r[2]), int(r[3])) for r in rows]

    def deaths(self, group: str) -> dict[str, int]:
        rows = self._run(
            f"SELECT message_id, deaths FROM {self.suspects} WHERE consumer = '{group}'"
        )
        return {str(r[0]): int(r[1]) for r in rows}

    def age(self, table: str, column: str, group: str, message_id: str, n: int) -> None:
        old = OLD[self.dialect].format(n=n)
        self._run(
            f"UPDATE {table} SET {column} = {old} "
            f"WHERE consumer = '{group}' AND message_id = '{message_id}'"
        )

    def forget(self, group: str) -> None:
        for table in (self.inbox, self.suspects, self.dead_letters, APP):
            self._run(f"DELETE FROM {table} WHERE consumer = '{group}'")


@dataclass
class Letter:
    """The model's view of one dead letter (in seq order in ``InboxMachine.letters``)."""

    id: str
    key: str | None
    held: bool
    attempts: int


class InboxMachine(RuleBasedStateMachine):
    """One example: a fresh consumer group on the shared tables, and the model."""

    runner: asyncio.Runner
    url: str
    driver: str | None
    store: Store
    db: Database

    def __init__(self) -> None:
        super().__init__()
        self.group = f"g{uuid.uuid4().hex[:12]}"
        # The same ids in every example (each has a group of its own): their order, which
        # a batch's sort and the dead letters' draws follow, must not vary between runs.
        self.ids = [uuid.UUID(f"00000000-0000-4000-8000-{n:012d}") for n in range(POOL)]
        self.keys: dict[uuid.UUID, str | None] = {}
        self.hold = False
        self.max_attempts = 3
        #: What the handler does with each message: ok, fail (raises), commit (runs a
        #: COMMIT statement itself, and returns), kill (closes its
        #: connection, and returns as if nothing happened).
        self.plan: dict[uuid.UUID, str] = {}
        # The model.
        self.inbox: dict[str, int | None] = {}  # id -> its age rank (None: fresh)
        self.applied: Counter[str] = Counter()
        self.retained: Counter[str] = Counter()  # inbox entries the retention deleted
        self.letters: list[Letter] = []
        self.suspects: dict[str, tuple[int, int | None]] = {}  # id -> (deaths, age rank)
        self.aged = 0
        self.pool = DaemonThreadPool(1, thread_name_prefix="audit16-inbox")
        self.session = self.make_session()
        self.run(self.session.open())

    def make_session(self) -> Session:
        factory = session_factory(
            self.url, "outboxer", is_async=self.driver is not None, async_driver=self.driver
        )
        return factory(self.pool)

    def teardown(self) -> None:
        try:
            self.run(self.session.close())
        finally:
            self.pool.shutdown(wait=False)
            # The tables are shared by every example; the retention's counts and the
            # tables' reads must see this example's rows only.
            self.db.forget(self.group)

    def run(self, work: Any) -> Any:
        return self.runner.run(work)

    # ----- the handler -----------------------------------------------------------------

    def _sync_handler(self, delivery: Delivery, conn: Any) -> None:
        sql = f"INSERT INTO {APP} (consumer, message_id) VALUES (%s, %s)"
        args = (self.group, str(delivery.id))
        if self.db.dialect == "sqlite":
            conn.execute(sql.replace("%s", "?"), args)
        else:
            cursor = conn.cursor()
            try:
                cursor.execute(sql, args)
            finally:
                cursor.close()
        action = self.plan.get(delivery.id, "ok")
        if action == "fail":
            raise RuntimeError(f"refused {delivery.id}")
        if action == "commit":
            if self.db.dialect == "sqlite":
                conn.execute("COMMIT")
            else:
                cursor = conn.cursor()
                try:
                    cursor.execute("COMMIT")
                finally:
                    cursor.close()
        if action == "kill":
            conn.close()

    async def _async_handler(self, delivery: Delivery, conn: Any) -> None:
        await conn.execute(
            f"INSERT INTO {APP} (consumer, message_id) VALUES ($1, $2)",
            self.group,
            str(delivery.id),
        )
        action = self.plan.get(delivery.id, "ok")
        if action == "fail":
            raise RuntimeError(f"refused {delivery.id}")
        if action == "commit":
            await conn.execute("COMMIT")
        if action == "kill":
            conn.terminate()

    @property
    def handler(self) -> Any:
        return self._async_handler if self.driver is not None else self._sync_handler

    def delivery(self, message_id: uuid.UUID) -> Delivery:
        return Delivery(
            id=message_id,
            topic="t",
            key=self.keys[message_id],
            headers={},
            payload={"id": str(message_id)},
            body=b"{}",
            content_type="application/json",
        )

    # ----- the model -------------------------------------------------------------------

    def _letter(self, message_id: str) -> Letter | None:
        return next((letter for letter in self.letters if letter.id == message_id), None)

    def _key_blocked(self, key: str | None) -> bool:
        return key is not None and any(letter.key == key for letter in self.letters)

    def _add_letter(self, message_id: uuid.UUID, held: bool, attempts: int) -> None:
        if self._letter(str(message_id)) is None:  # a second one changes nothing
            self.letters.append(Letter(str(message_id), self.keys[message_id], held, attempts))

    def _apply(
        self, ids: list[uuid.UUID], *, suspect: bool = False
    ) -> tuple[list[Result] | None, BaseException | None]:
        """``Session.apply`` of ``ids`` with the model's prediction checked: the results, or
        the failure (then nothing of the batch is committed)."""
        held = [self.hold and self._key_blocked(self.keys[i]) for i in ids]
        expected: list[Result] = []
        failure: tuple[str, int] | None = None
        for index, message_id in enumerate(ids):
            if held[index]:
                expected.append(Result.HELD)
            elif str(message_id) in self.inbox:
                expected.append(Result.DUPLICATE)
            else:
                expected.append(Result.APPLIED)
                action = self.plan.get(message_id, "ok")
                if action != "ok" and failure is None:
                    failure = (action, index)
        deliveries = [self.delivery(i) for i in ids]
        try:
            results = self.run(
                self.session.apply(
                    self.group, deliveries, self.handler, hold_keys=self.hold, suspect=suspect
                )
            )
        except Exception as exc:  # compared with the model below
            assert failure is not None, f"apply failed, the model expected {expected}: {exc!r}"
            action, index = failure
            assert isinstance(exc, BatchFailed), repr(exc)
            if action in ("fail", "commit"):
                assert (exc.stage, exc.index) == ("handler", index), (exc.stage, exc.index, exc)
                assert not self.session.lost(exc), "a handler's exception taken for an outage"
            if action == "commit":
                # The handler's COMMIT took the batch so far: the held records and the
                # messages up to its own (claims and writes alike); a later message's claim
                # made ahead (PostgreSQL) was released.
                assert isinstance(exc.cause, HandlerEndedTransaction), repr(exc.cause)
                for k, message_id in enumerate(ids):
                    if expected[k] is Result.HELD:
                        self._add_letter(message_id, True, 0)
                    elif expected[k] is Result.APPLIED and k <= index:
                        self.inbox[str(message_id)] = None
                        self.applied[str(message_id)] += 1
            if action == "kill":
                assert self.session.lost(exc), f"a killed connection not seen as lost: {exc!r}"
                self.reconnect()
            event(f"apply failed: {action}")
            return None, exc
        assert failure is None, f"apply committed, the model expected {failure}: {results}"
        assert results == expected, (results, expected)
        for result in results:
            event(f"apply: {result}")
        for message_id, result in zip(ids, results, strict=True):
            if result is Result.HELD:
                self._add_letter(message_id, True, 0)
            elif result is Result.APPLIED:
                self.inbox[str(message_id)] = None
                self.applied[str(message_id)] += 1
            if suspect:
                self.suspects.pop(str(message_id), None)
        return results, None

    def reconnect(self) -> None:
        """What Consumer._open does with a worker's broken session."""
        self.run(self.session.close())
        self.run(self.session.open())

    def _dead_letter(self, message_id: uuid.UUID, attempts: int) -> None:
        """Consumer._dead_letter: the record, then the suspect row (if any) goes."""
        delivery = self.delivery(message_id)
        self.run(self.session.record_dead_letter(self.group, delivery, "refused", attempts))
        self._add_letter(message_id, False, attempts)

    def _suspect_attempt(self, message_id: uuid.UUID) -> int:
        deaths = self.run(self.session.suspect_attempt(self.group, message_id))
        before = self.suspects.get(str(message_id))
        expected = 0 if before is None else before[0] + 1
        assert deaths == expected, (deaths, expected)
        self.suspects[str(message_id)] = (expected, None)  # each attempt sets first_seen
        return int(deaths)

    def _suspect_done(self, message_id: uuid.UUID) -> None:
        self.run(self.session.suspect_done(self.group, message_id))
        self.suspects.pop(str(message_id), None)

    # ----- rules -----------------------------------------------------------------------

    @initialize(
        keys=st.lists(st.sampled_from(KEYS), min_size=POOL, max_size=POOL),
        hold=st.booleans(),
        max_attempts=st.integers(1, 3),
    )
    def configure(self, keys: list[str | None], hold: bool, max_attempts: int) -> None:
        self.keys = dict(zip(self.ids, keys, strict=True))
        self.hold = hold
        self.max_attempts = max_attempts

    @rule(
        picks=st.lists(st.integers(0, POOL - 1), min_size=1, max_size=4, unique=True),
        actions=st.lists(
            st.sampled_from(["ok", "ok", "ok", "fail", "commit", "kill"]), min_size=4, max_size=4
        ),
    )
    def deliver(self, picks: list[int], actions: list[str]) -> None:
        """A worker's batch: distinct keys (a lane's head each), sorted by id, as
        Consumer._apply makes it; a failure applies the others again at once, the failed
        one dead-lettered once its attempts are used up (one failure stands for them)."""
        ids: list[uuid.UUID] = []
        keys: set[str] = set()
        for pick in picks:
            key = self.keys[self.ids[pick]]
            if key is None or key not in keys:
                ids.append(self.ids[pick])
                if key is not None:
                    keys.add(key)
        ids.sort()
        for message_id, action in zip(ids, actions, strict=False):
            self.plan[message_id] = action
        while ids:
            _, failure = self._apply(ids)
            if failure is None:
                return
            assert isinstance(failure, BatchFailed)
            if failure.index is None or self.plan.get(ids[failure.index]) == "kill":
                # An outage: no attempt counted, the batch again on the new connection;
                # the killing handler behaves from now on.
                for message_id in ids:
                    if self.plan.get(message_id) == "kill":
                        self.plan[message_id] = "ok"
                continue
            failed = ids.pop(failure.index)
            if self.max_attempts == 1:
                self._dead_letter(failed, 1)

    @rule(pick=st.integers(0, POOL - 1))
    def fail_out(self, pick: int) -> None:
        """A message that fails every attempt: applied alone, refused, then dead-lettered
        (Consumer._failed at max_attempts) unless its apply did not run its handler."""
        message_id = self.ids[pick]
        self.plan[message_id] = "fail"
        _, failure = self._apply([message_id])
        if failure is not None:
            self._dead_letter(message_id, self.max_attempts)
        self.plan[message_id] = "ok"

    @rule(pick=st.integers(0, POOL - 1), action=st.sampled_from(["ok", "fail", "commit", "kill"]))
    def redelivered(self, pick: int, action: str) -> None:
        """A suspect, as Consumer._apply and _suspect_attempt treat it: its attempt
        recorded, then dead-lettered once ``max_attempts`` deaths were counted, or applied
        alone with ``suspect=True``; a handler's failure ends the attempt in-process
        (suspect_done); a killed connection: no attempt counted, applied again."""
        message_id = self.ids[pick]
        self.plan[message_id] = action
        deaths = self._suspect_attempt(message_id)
        event(f"suspect deaths {deaths}")
        if deaths >= self.max_attempts:
            self._dead_letter(message_id, deaths)
            self._suspect_done(message_id)
            return
        while True:
            _, failure = self._apply([message_id], suspect=True)
            if failure is None:
                break
            if self.plan.get(message_id) == "kill":
                self.plan[message_id] = "ok"
                continue  # the row stays: the attempt goes on, on the new connection
            self._suspect_done(message_id)  # Consumer._failed's _forget_suspect
            break
        self.plan[message_id] = "ok"

    @rule(pick=st.integers(0, POOL - 1), times=st.integers(1, 3), cut_short=st.booleans())
    def dies_under_suspect(self, pick: int, times: int, cut_short: bool) -> None:
        """The process dies ``times`` times in a row after recording a suspect's attempt
        (its row stays: a death the next attempt counts); then, perhaps, its own shutdown
        cuts the next attempt short (the row deleted: no death)."""
        message_id = self.ids[pick]
        for _ in range(times):
            self._suspect_attempt(message_id)
        if cut_short:
            self._suspect_done(message_id)

    @rule()
    def connection_closed(self) -> None:
        """The worker's connection goes between two batches and a new one is opened."""
        self.reconnect()

    @precondition(lambda self: bool(self.letters))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """``outboxer dead-letters replay`` (Consumer.replay_dead_letters), the whole
        group or chosen ids; some fail again, one handler perhaps runs COMMIT itself or
        kills its connection (the replay stops there: an outage)."""
        chosen: list[str] | None = None
        if data.draw(st.booleans(), label="chosen"):
            chosen = data.draw(
                st.lists(st.sampled_from([letter.id for letter in self.letters]), unique=True),
                label="ids",
            )
        failing = data.draw(
            st.sets(st.sampled_from([str(i) for i in self.ids]), max_size=2), label="fail"
        )
        special = data.draw(
            st.none() | st.tuples(st.sampled_from(self.ids), st.sampled_from(["commit", "kill"])),
            label="special",
        )
        for message_id in self.ids:
            self.plan[message_id] = "fail" if str(message_id) in failing else "ok"
        if special is not None:
            self.plan[special[0]] = special[1]
        expected = dict.fromkeys(("replayed", "duplicates", "failed", "skipped"), 0)
        blocked: set[str] = set()
        killed = False
        for letter in list(self.letters):
            if chosen is not None and letter.id not in chosen:
                continue
            key = letter.key if self.hold else None
            if key is not None:
                earlier = self.letters[: self.letters.index(letter)]
                if key in blocked or any(e.key == key for e in earlier):
                    blocked.add(key)
                    expected["skipped"] += 1
                    continue
            action = self.plan[uuid.UUID(letter.id)]
            if letter.id in self.inbox:
                expected["duplicates"] += 1
                self.letters.remove(letter)
            elif action == "kill":
                killed = True  # rolled back, and the replay stops
                break
            elif action == "commit":
                # Its COMMIT took its claim and write, not the removal of its dead letter
                # (after the handlers): a failure, the next replay finds a duplicate.
                expected["failed"] += 1
                letter.attempts += 1
                letter.held = False
                self.inbox[letter.id] = None
                self.applied[letter.id] += 1
                if key is not None:
                    blocked.add(key)
            elif action == "fail":
                expected["failed"] += 1
                letter.attempts += 1
                letter.held = False
                if key is not None:
                    blocked.add(key)
            else:
                expected["replayed"] += 1
                self.letters.remove(letter)
                self.inbox[letter.id] = None
                self.applied[letter.id] += 1
        consumer = Consumer(
            db=self.url,
            broker=None,
            group=self.group,
            handler=self.handler,
            abandoned_blocks_key=self.hold,
            max_attempts=self.max_attempts,
            async_driver=self.driver,
        )
        try:
            counts = self.run(consumer.replay_dead_letters(chosen))
        except Exception as exc:
            assert killed, f"the replay failed: {exc!r}"
            event("replay: killed")
            return
        finally:
            self.plan.clear()
        assert not killed, f"the replay went on past a killed connection: {counts}"
        assert counts == expected, (counts, expected)
        event("replay: " + ", ".join(f"{name} {n}" for name, n in counts.items() if n))

    @precondition(lambda self: any(age is None for age in self.inbox.values()))
    @rule(data=st.data())
    def age_inbox(self, data: st.DataObject) -> None:
        fresh = sorted(i for i, age in self.inbox.items() if age is None)
        message_id = data.draw(st.sampled_from(fresh), label="inbox entry")
        self.aged += 1
        self.db.age(self.db.inbox, "received_at", self.group, message_id, self.aged)
        self.inbox[message_id] = self.aged

    @precondition(lambda self: any(age is None for _, age in self.suspects.values()))
    @rule(data=st.data())
    def age_suspect(self, data: st.DataObject) -> None:
        fresh = sorted(i for i, (_, age) in self.suspects.items() if age is None)
        message_id = data.draw(st.sampled_from(fresh), label="suspect")
        self.aged += 1
        self.db.age(self.db.suspects, "first_seen", self.group, message_id, self.aged)
        self.suspects[message_id] = (self.suspects[message_id][0], self.aged)

    @precondition(
        lambda self: (
            any(age is not None for age in self.inbox.values())
            or any(age is not None for _, age in self.suspects.values())
        )
    )
    @rule(limit=st.integers(1, 4))
    def cleanup(self, limit: int) -> None:
        """The relay's inbox retention: up to ``limit`` of each table, oldest first (the
        highest age rank: the furthest back)."""
        old_inbox = sorted(
            (i for i, age in self.inbox.items() if age is not None),
            key=lambda i: -(self.inbox[i] or 0),
        )[:limit]
        old_suspects = sorted(
            (i for i, (_, age) in self.suspects.items() if age is not None),
            key=lambda i: -(self.suspects[i][1] or 0),
        )[:limit]
        deleted = self.run(self.store.cleanup_inbox(RETENTION, limit))
        assert deleted == len(old_inbox) + len(old_suspects), (deleted, old_inbox, old_suspects)
        event(f"cleanup: {len(old_inbox)} inbox, {len(old_suspects)} suspects")
        for message_id in old_inbox:
            del self.inbox[message_id]
            self.retained[message_id] += 1
        for message_id in old_suspects:
            del self.suspects[message_id]

    # ----- invariants ------------------------------------------------------------------

    @invariant()
    def tables_agree(self) -> None:
        group = self.group
        inbox = self.db.inbox_ids(group)
        assert sorted(inbox) == sorted(self.inbox), ("inbox", sorted(inbox), sorted(self.inbox))
        effects = self.db.effects(group)
        assert effects == self.applied, ("application rows", effects, self.applied)
        for message_id, times in effects.items():
            # Applied once, and once more only after the retention forgot it.
            assert times <= 1 + self.retained[message_id], (message_id, times)
        letters = self.db.letters(group)
        model = [(m.id, m.key, m.held, m.attempts) for m in self.letters]
        assert letters == model, ("dead letters (id, key, held, attempts)", letters, model)
        deaths = self.db.deaths(group)
        expected = {i: d for i, (d, _) in self.suspects.items()}
        assert deaths == expected, ("suspect deaths", deaths, expected)


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    report_multiple_bugs=False,
    # No shrinking (slow on the servers): a failing run prints its steps as found.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(params=list(KINDS))
def machine_kind(request: pytest.FixtureRequest) -> Iterator[tuple[str, str | None]]:
    fixture, driver = KINDS[request.param]
    url: str = request.getfixturevalue(fixture)
    yield url, driver


def test_consumer_database_matches_the_model(machine_kind: tuple[str, str | None]) -> None:
    url, driver = machine_kind
    with asyncio.Runner() as runner:
        store = outboxer.create_store(url)
        runner.run(store.connect())
        db = Database(url)
        try:

            class Bound(InboxMachine):
                pass

            Bound.runner, Bound.url, Bound.driver = runner, url, driver
            Bound.store, Bound.db = store, db
            # MariaDB's round trips are the slowest: fewer examples keep it near 5 s.
            examples = 25 if url.startswith("mysql") else 40
            run_state_machine_as_test(Bound, settings=settings(SETTINGS, max_examples=examples))
        finally:
            db.close()
            runner.run(store.close())


@pytest.mark.parametrize("driver", [None, "asyncpg"])
def test_a_later_handlers_commit_keeps_its_own_claim(pg_url: str, driver: str | None) -> None:
    """Found by the machine above (PostgreSQL, psycopg and asyncpg). A batch of two, the
    second message's handler runs COMMIT itself: that committed both messages' writes and
    claims (PostgreSQL claims the batch at once), and the session sees it right after that
    handler (the transaction is no longer open), so it knows which handler ended it and
    that no claim was made for a handler that never ran. The later check meant for when it
    does not know (the transaction committed early: release every claim but the first
    handler's) ran all the same, for nothing was left to release, and deleted the second
    message's claim although its write had committed: its redelivery applied it again."""
    first, second = (uuid.UUID(f"00000000-0000-4000-8000-00000000000{n}") for n in (1, 2))
    db = Database(pg_url)

    def delivery(message_id: uuid.UUID) -> Delivery:
        return Delivery(message_id, "t", None, {}, {}, b"{}", "application/json")

    commits = {second}  # once: the retry's handler behaves

    def write(message: Delivery, conn: Any) -> None:
        conn.execute(f"INSERT INTO {APP} VALUES (%s, %s)", ("g", str(message.id)))
        if message.id in commits:
            commits.discard(message.id)
            conn.execute("COMMIT")

    async def write_async(message: Delivery, conn: Any) -> None:
        await conn.execute(f"INSERT INTO {APP} VALUES ($1, $2)", "g", str(message.id))
        if message.id in commits:
            commits.discard(message.id)
            await conn.execute("COMMIT")

    async def scenario() -> None:
        pool = DaemonThreadPool(1)
        session = session_factory(
            pg_url, "outboxer", is_async=driver is not None, async_driver=driver
        )(pool)
        handler = write if driver is None else write_async
        await session.open()
        try:
            with pytest.raises(BatchFailed) as failed:
                await session.apply(
                    "g", [delivery(first), delivery(second)], handler, hold_keys=False
                )
            assert (failed.value.stage, failed.value.index) == ("handler", 1)
            assert isinstance(failed.value.cause, HandlerEndedTransaction)
            # The consumer counts the second message's failure and applies it again:
            # its write committed, so must its claim have.
            again = await session.apply("g", [delivery(second)], handler, hold_keys=False)
            assert again == [Result.DUPLICATE], "a message whose write committed applied twice"
        finally:
            await session.close()
            pool.shutdown()

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=8))
        assert db.effects("g") == Counter({str(first): 1, str(second): 1})
        assert sorted(db.inbox_ids("g")) == [str(first), str(second)]
    finally:
        db.close()
