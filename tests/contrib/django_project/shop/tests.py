"""outboxer's Django app under Django's test runner (tests/contrib/test_django.py runs it on
PostgreSQL, MariaDB and SQLite): the migrated schema, model events, commands and admin."""

from __future__ import annotations

import asyncio
import io
import json
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
from outboxer.message import Message
from outboxer.stores import create_store
from tests.contrib.django_project.shop.models import Order


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
        self.assertIn("batch-size must be between 1 and", str(raised.exception))


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
