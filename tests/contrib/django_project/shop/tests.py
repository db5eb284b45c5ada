"""outboxer's Django app under Django's test runner (tests/contrib/test_django.py runs it on
PostgreSQL, MariaDB and SQLite): the migrated schema, model events, commands and admin, and
outboxer_consume end to end through Redis Streams."""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from collections.abc import Callable
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import IntegrityError, connection, transaction
from django.test import TransactionTestCase, override_settings

import outboxer
from outboxer.brokers.memory import memory_broker
from outboxer.contrib.django import conf
from outboxer.contrib.django.events import write_events_for
from outboxer.message import Message
from outboxer.stores import create_store
from tests.contrib.django_project.shop.models import Order, Shipment
from tests.services import IN_CI, port_open


def with_store(work: Callable[[outboxer.Store], Any]) -> Any:
    """Run ``await work(store)`` on outboxer's store of the test database (its own connection)."""

    async def run() -> Any:
        current = conf.outboxer_settings()
        async with create_store(
            current.require_db(), schema=current.schema, table=current.table
        ) as store:
            return await work(store)

    return asyncio.run(run())


def claim_all() -> list[Message]:
    return list(with_store(lambda store: store.claim("default", "test", 1000, 30.0, False)))


def pending() -> list[dict[str, object]]:
    """The PENDING rows as ``outboxer messages`` lists them: a read, which waits for no writer."""
    return list(with_store(lambda store: store.list_messages(["PENDING"], 1000)))


def payloads() -> list[Any]:
    return [json.loads(message.payload) for message in claim_all()]


class OutboxTestCase(TransactionTestCase):
    def setUp(self) -> None:
        # Django flushes managed tables between tests; the outbox is outboxer's.
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {conf.outbox_table(connection.alias)}")


class SchemaTests(OutboxTestCase):
    def test_the_migrated_schema_passes_the_relays_check(self) -> None:
        with_store(lambda store: store.check_schema())
        applied = with_store(lambda store: store.apply_schema())
        self.assertEqual(applied, [], "outboxer schema apply finds nothing left to do")

    def test_no_migration_is_missing(self) -> None:
        call_command("makemigrations", "--check", "--dry-run", stdout=io.StringIO())


class ModelEventTests(OutboxTestCase):
    def test_save_writes_the_events_with_the_row_in_recording_order(self) -> None:
        with transaction.atomic():
            first, second = Order(customer="c-1"), Order(customer="c-2", total=2.0)
            first.place()
            first.record_event("order.noted", "first", key="c-1")
            second.place()
            first.save()
            second.save()
            self.assertEqual(pending(), [], "nothing is visible before the commit")
        messages = claim_all()
        self.assertEqual(
            [(m.topic, m.key) for m in messages],
            [("order.placed", "c-1"), ("order.noted", "c-1"), ("order.placed", "c-2")],
        )
        self.assertEqual(json.loads(messages[0].payload), {"id": first.pk})  # after the INSERT
        self.assertEqual(json.loads(messages[2].payload), {"id": second.pk})
        self.assertEqual(first.pending_events, ())

    def test_a_rolled_back_block_leaves_no_event_and_a_later_save_writes_it_once(self) -> None:
        order = Order(customer="c-1")
        order.place()
        with self.assertRaises(RuntimeError), transaction.atomic():
            order.save()
            raise RuntimeError("a business rule failed: the block rolls back")
        self.assertEqual(claim_all(), [])
        self.assertEqual(len(order.pending_events), 1, "the instance still holds its change")
        order.pk = None  # the INSERT was rolled back too
        with transaction.atomic():
            order.save()
            order.save()  # again in the same transaction: not written twice
        self.assertEqual(payloads(), [{"id": order.pk}])
        self.assertEqual(order.pending_events, ())

    def test_a_failed_save_writes_nothing_and_keeps_its_events(self) -> None:
        Order.objects.create(customer="taken")
        order = Order(customer="taken")
        order.record_event("order.placed", {"n": 1})
        with self.assertRaises(IntegrityError):
            order.save()
        self.assertEqual(claim_all(), [])
        order.customer = "free"
        order.save()
        self.assertEqual(payloads(), [{"n": 1}])

    def test_a_rolled_back_savepoint_drops_its_writes_only(self) -> None:
        with transaction.atomic():
            order = Order(customer="c-1")
            order.record_event("order.placed", {"n": 1})
            order.save()
            with self.assertRaises(RuntimeError), transaction.atomic():
                order.record_event("order.changed", {"n": 2})
                order.save()
                raise RuntimeError("the inner block rolls back")
            topics = [event.topic for event in order.pending_events]
            self.assertEqual(topics, ["order.placed", "order.changed"], "until the commit")
        self.assertEqual(payloads(), [{"n": 1}])
        self.assertEqual([e.topic for e in order.pending_events], ["order.changed"])
        order.save()  # the change it announces is saved now: so is the event
        self.assertEqual(payloads(), [{"n": 2}])

    def test_delete_writes_its_events(self) -> None:
        order = Order.objects.create(customer="c-1")
        order.record_event("order.cancelled", {"customer": "c-1"})
        order.delete()
        self.assertEqual(payloads(), [{"customer": "c-1"}])
        self.assertFalse(Order.objects.exists())

    def test_write_events_for_writes_what_bulk_create_bypasses(self) -> None:
        with transaction.atomic():
            orders = Order.objects.bulk_create([Order(customer="c-1"), Order(customer="c-2")])
            for order in reversed(orders):  # recording order, not the list's, is kept
                order.record_event("order.imported", {"customer": order.customer})
            self.assertEqual(write_events_for(orders), 2)
            self.assertEqual(write_events_for(orders), 0, "not twice in one transaction")
        self.assertEqual(payloads(), [{"customer": "c-2"}, {"customer": "c-1"}])
        self.assertEqual(orders[0].pending_events, ())

    def test_write_events_for_refuses_to_write_apart_from_the_rows(self) -> None:
        [order] = Order.objects.bulk_create([Order(customer="c-1")])  # committed already
        order.record_event("order.imported", {"customer": "c-1"})
        with self.assertRaises(TypeError):
            write_events_for([order])
        self.assertEqual(claim_all(), [])
        self.assertEqual(len(order.pending_events), 1)

    def test_events_are_enqueued_for_every_configured_destination(self) -> None:
        destinations = {"internal": {"broker": "memory://a"}, "partner": {"broker": "memory://b"}}
        with override_settings(OUTBOXER={"destinations": destinations}):
            order = Order(customer="c-1")
            event = order.record_event("order.placed", {"n": 1})
            order.save()
            found = with_store(lambda store: store.list_messages(["PENDING"], 10))
        self.assertEqual(
            sorted((str(row["id"]), row["destination"]) for row in found),
            [(str(event.message_id), "internal"), (str(event.message_id), "partner")],
        )


@override_settings(OUTBOXER={"broker": "memory://django-relay-command"})
class CommandTests(OutboxTestCase):
    def test_outboxer_relay_publishes_with_the_projects_settings(self) -> None:
        broker = memory_broker("django-relay-command")
        broker.clear()
        order = Order(customer="c-1")
        order.place()
        order.save()
        call_command("outboxer_relay", "--exit-when-idle")
        self.assertEqual(
            [(m.topic, json.loads(m.payload)) for m in broker.messages],
            [("order.placed", {"id": order.pk})],
        )
        self.assertEqual(claim_all(), [], "published, nothing left to claim")

    def test_outboxer_status(self) -> None:
        Order(customer="c-1").save()
        order = Order(customer="c-2")
        order.place()
        order.save()
        out = io.StringIO()
        call_command("outboxer_status", "--json", stdout=out)
        [entry] = json.loads(out.getvalue())["destinations"]
        self.assertEqual((entry["destination"], entry["counts"]), ("default", {"PENDING": 1}))

    def test_a_bad_setting_is_a_usage_error(self) -> None:
        with (
            override_settings(OUTBOXER={"batch_size": 0}),
            self.assertRaises(CommandError) as raised,
        ):
            call_command("outboxer_relay", "--exit-when-idle")
        self.assertEqual(raised.exception.returncode, 2)
        self.assertIn('OUTBOXER["batch_size"] must be between 1 and', str(raised.exception))


class AdminTests(OutboxTestCase):
    def setUp(self) -> None:
        super().setUp()
        user = get_user_model().objects.create_superuser("admin", "a@example.com", "pw")
        self.client.force_login(user)
        order = Order(customer="c-1")
        self.placed = order.record_event("order.placed", {"n": 1})
        self.noted = order.record_event("order.noted", {"n": 2})
        order.save()
        with connection.cursor() as cursor:  # as the relay leaves a message it gave up on
            cursor.execute(
                f"UPDATE {conf.outbox_table(connection.alias)} "
                "SET status = 'ABANDONED', attempts = 10, last_error = 'broker said no' "
                "WHERE topic = 'order.placed'"
            )

    def test_the_outbox_is_listed_and_read_only(self) -> None:
        listing = self.client.get("/admin/outboxer/outboxmessage/?status__exact=ABANDONED")
        self.assertContains(listing, "broker said no")
        self.assertNotContains(listing, "order.noted")
        [row] = listing.context["cl"].result_list
        detail = self.client.get(f"/admin/outboxer/outboxmessage/{row.seq}/change/")
        self.assertContains(detail, "{&quot;n&quot;:1}")  # the payload, as text
        self.assertNotContains(detail, 'type="submit" value="Save"')
        self.assertEqual(self.client.get("/admin/outboxer/outboxmessage/add/").status_code, 403)
        self.assertEqual(
            self.client.post(f"/admin/outboxer/outboxmessage/{row.seq}/delete/").status_code, 403
        )

    def test_requeue_moves_abandoned_messages_back_to_pending(self) -> None:
        seqs = [row.seq for row in outbox_rows()]
        response = self.client.post(
            "/admin/outboxer/outboxmessage/",
            {"action": "requeue", "_selected_action": seqs},
            follow=True,
        )
        self.assertContains(response, "Requeued 1 message(s); 1 not ABANDONED or FAILED")
        statuses = {str(row["id"]): (row["status"], row["attempts"]) for row in all_rows()}
        self.assertEqual(statuses[str(self.placed.message_id)], ("PENDING", 0))
        self.assertEqual(statuses[str(self.noted.message_id)], ("PENDING", 0))


def all_rows() -> list[dict[str, Any]]:
    statuses = ["PENDING", "PROCESSING", "FAILED", "PUBLISHED", "ABANDONED"]
    return list(with_store(lambda store: store.list_messages(statuses, 100)))


def outbox_rows() -> list[Any]:
    from outboxer.contrib.django.models import OutboxMessage

    return list(OutboxMessage.objects.all())


# ----- outboxer_consume and the dead-letter admin, through Redis Streams ----------------------

REDIS = "redis://127.0.0.1:6379/0"
HANDLERS = "tests.contrib.django_project.shop.handlers"


class ConsumeTestCase(OutboxTestCase):
    """Orders' events go out through the relay to a Redis stream of this test's own, and come
    back through ``outboxer_consume`` as Shipment rows the handler writes with the ORM."""

    def setUp(self) -> None:
        if not port_open(6379):
            if IN_CI:
                self.fail("redis is not reachable on 127.0.0.1:6379")
            self.skipTest("redis is not reachable on 127.0.0.1:6379 (run scripts/services.sh)")
        super().setUp()
        with connection.cursor() as cursor:  # outboxer's tables, which Django does not flush
            for table in ("inbox", "dead_letters"):
                cursor.execute(f"DELETE FROM {conf.schema_table(connection.alias, table)}")
        self.topic = f"shop-{uuid.uuid4().hex[:12]}"  # the stream: no entry of another run
        self.group = f"g-{self.topic}"
        consumer = {"group": self.group, "topics": [self.topic], "handler": f"{HANDLERS}:ship"}
        consumer |= {"concurrency": 2, "batch": 10}
        self.settings = override_settings(OUTBOXER={"broker": REDIS, "consumer": consumer})
        self.settings.enable()
        self.addCleanup(self.settings.disable)
        self.addCleanup(self.delete_stream)

    def delete_stream(self) -> None:
        import redis

        with redis.Redis.from_url(REDIS) as client:
            client.delete(self.topic)

    def place(self, *payloads: dict[str, Any]) -> list[uuid.UUID]:
        """One order per payload, its event on this test's stream; the events' ids."""
        ids = []
        for payload in payloads:
            order = Order(customer=f"c-{payload['order']}")
            ids.append(order.record_event(self.topic, payload, key=order.customer).message_id)
            order.save()
        return ids

    def consume(self, *options: str) -> str:
        call_command("outboxer_relay", "--exit-when-idle")
        out = io.StringIO()
        call_command("outboxer_consume", "--exit-when-idle", *options, stdout=out)
        return out.getvalue()

    def consume_refusing(self) -> str:
        """Consume with a handler that refuses the messages that ask for it, each a dead
        letter at its first failure."""
        with self.assertLogs("outboxer.consumer", "ERROR") as logs:
            output = self.consume(f"{HANDLERS}:ship_or_refuse", "--max-attempts", "1")
        self.assertIn("is a dead letter after 1 attempt(s): RuntimeError", logs.output[0])
        return output

    def shipped(self) -> list[tuple[int, uuid.UUID]]:
        return sorted(Shipment.objects.values_list("order", "message_id"))

    def count(self, table: str) -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT count(*) FROM {conf.schema_table(connection.alias, table)} "
                "WHERE consumer = %s",
                [self.group],
            )
            return int(cursor.fetchone()[0])


class ConsumeCommandTests(ConsumeTestCase):
    def test_each_message_is_applied_once_by_an_orm_handler(self) -> None:
        ids = self.place({"order": 0}, {"order": 1}, {"order": 2})
        output = self.consume()
        self.assertIn(f"consumer {self.group}: applied 3, duplicates 0", output)
        self.assertEqual(self.shipped(), list(zip(range(3), ids, strict=True)))
        self.assertEqual(self.count("inbox"), 3, "the inbox claims committed with the rows")
        # The relay publishes the first again (it crashed after publishing, before marking
        # it PUBLISHED): the broker delivers it twice, the inbox has it, the handler skips.
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {conf.outbox_table(connection.alias)} SET status = 'PENDING' "
                "WHERE id = %s",
                [ids[0] if connection.vendor == "postgresql" else str(ids[0])],
            )
        output = self.consume()
        self.assertIn("applied 0, duplicates 1", output)
        self.assertEqual(self.shipped(), list(zip(range(3), ids, strict=True)))

    def test_a_lost_connection_is_opened_again_and_costs_no_attempt(self) -> None:
        if connection.vendor == "sqlite":
            self.skipTest("an SQLite connection is a file: it cannot be lost")
        [placed] = self.place({"order": 0})
        with self.assertLogs("outboxer.consumer", "WARNING") as logs:
            output = self.consume(
                f"{HANDLERS}:ship_after_losing_the_connection", "--max-attempts", "1"
            )
        self.assertIn("database connection lost", "\n".join(logs.output))
        self.assertIn("applied 1, duplicates 0, dead letters 0, failed attempts 0", output)
        self.assertEqual(self.shipped(), [(0, placed)])

    def test_a_transaction_a_swallowed_error_aborted_is_not_counted_as_applied(self) -> None:
        if connection.vendor != "postgresql":
            self.skipTest("only PostgreSQL aborts the transaction on a failed statement")
        self.place({"order": 0})
        with self.assertLogs("outboxer.consumer", "ERROR") as logs:
            output = self.consume(f"{HANDLERS}:ship_then_swallow_an_error", "--max-attempts", "1")
        self.assertIn("dead letter after 1 attempt(s): AbortedTransaction", logs.output[0])
        self.assertIn("applied 0, duplicates 0, dead letters 1", output)
        self.assertEqual((self.shipped(), self.count("inbox")), ([], 0))

    def test_a_coroutine_handler_is_refused(self) -> None:
        with self.assertRaises(CommandError) as raised:
            call_command("outboxer_consume", f"{HANDLERS}:ship_async")
        self.assertEqual(raised.exception.returncode, 2)
        self.assertIn("plain function", str(raised.exception))

    def test_the_handler_is_given_once(self) -> None:
        with self.assertRaises(CommandError) as raised:
            call_command("outboxer_consume", f"{HANDLERS}:ship", "--handler", f"{HANDLERS}:ship")
        self.assertEqual(raised.exception.returncode, 2)


class DjangoSessionTests(OutboxTestCase):
    def test_an_on_commit_callback_that_raises_does_not_fail_a_committed_batch(self) -> None:
        from outboxer.contrib.django.consumer import DjangoSession

        def work() -> str:
            Shipment.objects.create(message_id=uuid.uuid4(), order=7)
            transaction.on_commit(lambda: 1 / 0)  # the handler's, after the commit
            return "applied"

        async def batch() -> str:
            session = DjangoSession(connection.alias, "outboxer", conf.dialect(connection.alias))
            await session.open()
            try:
                return await session._call(session._transaction, work)
            finally:
                await session.close()

        with self.assertLogs("outboxer.consumer", "ERROR") as logs:
            self.assertEqual(asyncio.run(batch()), "applied")
        self.assertIn("on_commit callback failed after the consumer's commit", logs.output[0])
        self.assertEqual(list(Shipment.objects.values_list("order", flat=True)), [7])


class DeadLetterTests(ConsumeTestCase):
    def test_a_refused_message_becomes_a_dead_letter_that_the_admin_replays(self) -> None:
        kept, refused = self.place({"order": 0}, {"order": 1, "refuse": True})
        output = self.consume_refusing()
        self.assertIn("applied 1, duplicates 0, dead letters 1", output)
        # The refused message's Shipment was written before the handler raised: rolled back
        # with its inbox claim; the other message of the batch was applied again, alone.
        self.assertEqual(self.shipped(), [(0, kept)])
        self.assertEqual(self.count("inbox"), 1)

        user = get_user_model().objects.create_superuser("admin", "a@example.com", "pw")
        self.client.force_login(user)
        listing = self.client.get("/admin/outboxer/deadletter/")
        self.assertContains(listing, "refused order 1")
        [row] = listing.context["cl"].result_list
        self.assertEqual((row.message_id, row.consumer, row.attempts), (refused, self.group, 1))
        detail = self.client.get(f"/admin/outboxer/deadletter/{row.seq}/change/")
        self.assertContains(detail, "&quot;refuse&quot;:true")  # the payload, as text
        self.assertNotContains(detail, 'type="submit" value="Save"')
        self.assertEqual(self.client.get("/admin/outboxer/deadletter/add/").status_code, 403)
        self.assertEqual(
            self.client.post(f"/admin/outboxer/deadletter/{row.seq}/delete/").status_code, 403
        )

        # Without OUTBOXER["consumer"] the admin has no group and no handler to replay with.
        with override_settings(OUTBOXER={"broker": REDIS}):
            response = self.client.post(
                "/admin/outboxer/deadletter/",
                {"action": "replay", "_selected_action": [row.seq]},
                follow=True,
            )
        self.assertContains(response, "Nothing replayed: no group")
        self.assertEqual(self.count("dead_letters"), 1)

        # Replayed with OUTBOXER["consumer"]'s handler, which ships every order.
        response = self.client.post(
            "/admin/outboxer/deadletter/",
            {"action": "replay", "_selected_action": [row.seq]},
            follow=True,
        )
        self.assertContains(response, f"Replayed 1 dead letter(s) of &#x27;{self.group}&#x27;")
        self.assertEqual(self.shipped(), [(0, kept), (1, refused)])
        self.assertEqual((self.count("inbox"), self.count("dead_letters")), (2, 0))

    def test_the_admin_purges_the_selected_dead_letters_only(self) -> None:
        self.place({"order": 0, "refuse": True}, {"order": 1, "refuse": True})
        self.assertIn("dead letters 2", self.consume_refusing())
        user = get_user_model().objects.create_superuser("admin", "a@example.com", "pw")
        self.client.force_login(user)
        first, second = self.client.get("/admin/outboxer/deadletter/").context["cl"].result_list
        response = self.client.post(
            "/admin/outboxer/deadletter/",
            {"action": "purge", "_selected_action": [first.seq]},
            follow=True,
        )
        self.assertContains(response, "Purged 1 dead letter(s).")
        [left] = self.client.get("/admin/outboxer/deadletter/").context["cl"].result_list
        self.assertEqual(left.seq, second.seq)
        self.assertEqual((self.count("dead_letters"), self.shipped()), (1, []))
