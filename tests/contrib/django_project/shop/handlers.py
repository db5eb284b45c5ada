"""Handlers of ``manage.py outboxer_consume`` in the tests: they write with the ORM. The
first is the README's example."""

from __future__ import annotations

from typing import Any

from django.db import DatabaseError

from outboxer.consumer import Delivery

from .models import Shipment


def ship(message: Delivery, connection: Any) -> None:
    # Django's connection, inside the atomic() block that records the message in the inbox:
    # the Shipment commits with that record, or neither does. Never commit here.
    Shipment.objects.create(message_id=message.id, order=message.payload["order"])


def ship_or_refuse(message: Delivery, connection: Any) -> None:
    """Writes its row, then refuses the messages that ask for it: the row must not stay."""
    ship(message, connection)
    if message.payload.get("refuse"):
        raise RuntimeError(f"refused order {message.payload['order']}")


async def ship_async(message: Delivery, connection: Any) -> None:
    ship(message, connection)


#: Messages whose first delivery lost the connection already.
LOST_ONCE: set[Any] = set()


def ship_after_losing_the_connection(message: Delivery, connection: Any) -> None:
    """The first delivery of each message kills its own database connection mid-handler."""
    if message.id not in LOST_ONCE:
        LOST_ONCE.add(message.id)
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
            else:
                cursor.execute("KILL CONNECTION_ID()")
    ship(message, connection)


def ship_then_swallow_an_error(message: Delivery, connection: Any) -> None:
    """Ships, then catches a database error and goes on: on PostgreSQL the transaction is
    aborted, and its COMMIT would roll the Shipment back without a word."""
    ship(message, connection)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")
    except DatabaseError:
        pass
