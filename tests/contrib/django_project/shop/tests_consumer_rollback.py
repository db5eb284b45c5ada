"""``outboxer_consume`` when a handler has Django roll the batch back without raising: the
outermost ``atomic()`` rolls back in silence when the block is marked for rollback
(``transaction.set_rollback(True)``, or an exception caught from an inner
``atomic(savepoint=False)``). Such a batch failed; counting it as applied would ack
messages whose writes and inbox rows were rolled back. Also: a handler object whose
``__call__`` is a coroutine function is refused like a coroutine function.

Run by tests/contrib/test_django.py under Django's test runner on PostgreSQL, MariaDB and
SQLite (through Redis Streams, like the ``ConsumeTestCase`` tests it builds on).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction

from outboxer.consumer import Delivery
from outboxer.consumer_db import AbortedTransaction
from outboxer.contrib.django import conf
from outboxer.contrib.django.consumer import DjangoSession
from tests.contrib.django_project.shop.handlers import ship
from tests.contrib.django_project.shop.models import Shipment
from tests.contrib.django_project.shop.tests import ConsumeTestCase, OutboxTestCase

HERE = __name__


def ship_then_set_rollback(message: Delivery, conn: Any) -> None:
    """Ships, then marks the transaction for rollback for the messages that ask for it."""
    ship(message, conn)
    if message.payload.get("refuse"):
        transaction.set_rollback(True, using=conn.alias)


def ship_then_swallow_an_inner_atomic_error(message: Delivery, conn: Any) -> None:
    """Ships, then catches an exception that left an inner atomic(savepoint=False) block:
    Django marks the whole transaction for rollback."""
    ship(message, conn)
    if message.payload.get("refuse"):
        with contextlib.suppress(RuntimeError), transaction.atomic(conn.alias, savepoint=False):
            raise RuntimeError("refused inside")


def set_rollback_on_the_first_attempt(message: Delivery, conn: Any) -> None:
    ship(message, conn)
    if message.attempt == 1:
        transaction.set_rollback(True, using=conn.alias)


class AsyncCall:
    async def __call__(self, message: Delivery, conn: Any) -> None:
        ship(message, conn)


async_call = AsyncCall()


class RolledBackBatchTests(ConsumeTestCase):
    def consume_rolled_back(self, handler: str) -> str:
        with self.assertLogs("outboxer.consumer", "ERROR") as logs:
            output = self.consume(f"{HERE}:{handler}", "--max-attempts", "1")
        [dead] = [line for line in logs.output if "is a dead letter" in line]
        self.assertIn("dead letter after 1 attempt(s): AbortedTransaction", dead)
        self.assertIn("marked for rollback", dead)
        return output

    def assert_only_the_kept_one_applied(self, kept: uuid.UUID, output: str) -> None:
        self.assertIn("applied 1, duplicates 0, dead letters 1", output)
        self.assertEqual(self.shipped(), [(0, kept)])
        self.assertEqual((self.count("inbox"), self.count("dead_letters")), (1, 1))

    def test_a_batch_the_handler_marked_for_rollback_is_a_failure_not_applied(self) -> None:
        kept, _ = self.place({"order": 0}, {"order": 1, "refuse": True})
        output = self.consume_rolled_back("ship_then_set_rollback")
        self.assert_only_the_kept_one_applied(kept, output)

    def test_an_error_swallowed_from_an_inner_atomic_block_is_a_failure(self) -> None:
        kept, _ = self.place({"order": 0}, {"order": 1, "refuse": True})
        output = self.consume_rolled_back("ship_then_swallow_an_inner_atomic_error")
        self.assert_only_the_kept_one_applied(kept, output)

    def test_a_rolled_back_attempt_is_retried_and_applied_once(self) -> None:
        [placed] = self.place({"order": 0})
        with self.assertLogs("outboxer.consumer", "WARNING") as logs:
            output = self.consume(
                f"{HERE}:set_rollback_on_the_first_attempt",
                "--max-attempts",
                "3",
                "--backoff-base",
                "0.05",
            )
        self.assertIn("failed attempt 1 of 3", "\n".join(logs.output))
        self.assertIn("applied 1, duplicates 0, dead letters 0, failed attempts 1", output)
        self.assertEqual(self.shipped(), [(0, placed)])
        self.assertEqual((self.count("inbox"), self.count("dead_letters")), (1, 0))

    def test_a_handler_object_with_an_async_call_is_refused(self) -> None:
        with self.assertRaises(CommandError) as raised:
            # --exit-when-idle: were it accepted, it would not consume for ever.
            call_command("outboxer_consume", "--exit-when-idle", f"{HERE}:async_call")
        self.assertEqual(raised.exception.returncode, 2)
        self.assertIn("plain function", str(raised.exception))


class DjangoSessionRollbackTests(OutboxTestCase):
    def test_the_session_raises_when_atomic_rolled_back_without_a_word(self) -> None:
        def work() -> str:
            Shipment.objects.create(message_id=uuid.uuid4(), order=7)
            transaction.set_rollback(True)
            return "applied"

        async def batch() -> str:
            session = DjangoSession(connection.alias, "outboxer", conf.dialect(connection.alias))
            await session.open()
            try:
                return await session._call(session._transaction, work)
            finally:
                self.assertFalse(session.broken(), "a rollback the handler asked for is no outage")
                await session.close()

        with self.assertRaises(AbortedTransaction):
            asyncio.run(batch())
        self.assertEqual(Shipment.objects.count(), 0)
