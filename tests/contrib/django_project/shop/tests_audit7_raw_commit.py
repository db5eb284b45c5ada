"""``outboxer_consume`` when a handler ends the batch's transaction with SQL of its own
(``cursor.execute("COMMIT")`` or ``"ROLLBACK"``), which Django's ``atomic()`` does not see.

On PostgreSQL the runner claims the batch's inbox rows at once: the first handler's COMMIT
committed the second message's claim, whose handler then failed; every redelivery of it
was skipped as a duplicate, never applied. On SQLite (claimed one by one, but no check of
the transaction) the COMMIT went unseen. Either ending is the handler's failed attempt.

Run by tests/contrib/test_django.py::test_django_test_runner (Django's discovery takes every
shop/test*.py) on PostgreSQL, MariaDB and SQLite, through Redis Streams like the
ConsumeTestCase tests.
"""

from __future__ import annotations

from typing import Any

from django.test import override_settings

from outboxer.consumer import Delivery
from tests.contrib.django_project.shop.handlers import ship
from tests.contrib.django_project.shop.tests import REDIS, ConsumeTestCase

HERE = __name__
#: (order, what) already done once: each happens on the first attempt only.
DONE: set[tuple[int, str]] = set()


def _once(order: int, what: str) -> bool:
    if (order, what) in DONE:
        return False
    DONE.add((order, what))
    return True


def _handler(sql: str) -> Any:
    def handler(message: Delivery, conn: Any) -> None:
        ship(message, conn)
        order = message.payload["order"]
        if order == 0 and _once(order, sql):
            with conn.cursor() as cursor:
                cursor.execute(sql)
        elif order == 1 and _once(order, "fail"):
            raise RuntimeError("first attempt fails")

    return handler


commit_then_fail = _handler("COMMIT")
rollback_then_fail = _handler("ROLLBACK")


class HandlerEndsTheTransactionTests(ConsumeTestCase):
    def setUp(self) -> None:
        super().setUp()
        DONE.clear()
        # One worker: both messages in one batch, the one that ends it first (by id).
        consumer = {"group": self.group, "topics": [self.topic], "concurrency": 1, "batch": 10}
        one_worker = override_settings(OUTBOXER={"broker": REDIS, "consumer": consumer})
        one_worker.enable()  # over ConsumeTestCase's, disabled before it
        self.addCleanup(one_worker.disable)

    def run_ending(self, handler: str) -> None:
        ids = self.place({"order": 0}, {"order": 1})
        # Ids grow: order 0 is applied first in the batch.
        with self.assertLogs("outboxer.consumer", "WARNING") as logs:
            self.consume(f"{HERE}:{handler}", "--max-attempts", "5")
        self.assertEqual(self.shipped(), [(0, ids[0]), (1, ids[1])])
        self.assertEqual((self.count("inbox"), self.count("dead_letters")), (2, 0))
        ended = [line for line in logs.output if "HandlerEndedTransaction" in line]
        self.assertTrue(ended, logs.output)
        self.assertIn(f"message {ids[0]}", ended[0])

    def test_a_handler_s_commit_statement_loses_no_message(self) -> None:
        self.run_ending("commit_then_fail")

    def test_a_handler_s_rollback_statement_loses_no_message(self) -> None:
        self.run_ending("rollback_then_fail")
