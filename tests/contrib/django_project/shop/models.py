from __future__ import annotations

from django.db import models

from outboxer.contrib.django.events import RecordsEvents


class Order(RecordsEvents, models.Model):
    customer = models.CharField(max_length=64, unique=True)
    total = models.FloatField(default=0.0)

    def place(self) -> None:
        self.record_event("order.placed", lambda: {"id": self.pk}, key=self.customer)


class Shipment(models.Model):
    """What the consumer tests' handlers write with the ORM, one row per message applied."""

    message_id = models.UUIDField()
    order = models.IntegerField()
