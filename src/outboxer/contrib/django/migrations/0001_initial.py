"""outboxer's schema (PostgreSQL migrations 1-5, MySQL 1, SQLite 1-2) and the admin's model."""

from django.db import migrations, models

import outboxer.contrib.django.fields
from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        ApplyOutboxerSchema(postgres=5, mysql=1, sqlite=2),
        # The outbox table as the admin reads it; outboxer owns the table (managed=False).
        migrations.CreateModel(
            name="OutboxMessage",
            fields=[
                ("seq", models.BigIntegerField(primary_key=True, serialize=False)),
                ("message_id", models.UUIDField(db_column="id")),
                ("destination", models.CharField(max_length=255)),
                ("topic", models.CharField(max_length=255)),
                ("key", models.CharField(max_length=255, null=True)),
                ("payload", models.BinaryField()),
                ("content_type", models.CharField(max_length=255)),
                ("headers", models.JSONField()),
                ("status", models.CharField(max_length=10)),
                ("attempts", models.IntegerField()),
                ("next_attempt_at", outboxer.contrib.django.fields.StoredTime()),
                ("last_error", models.TextField(null=True)),
                ("locked_by", models.CharField(max_length=255, null=True)),
                ("locked_until", outboxer.contrib.django.fields.StoredTime(null=True)),
                ("created_at", outboxer.contrib.django.fields.StoredTime()),
                ("updated_at", outboxer.contrib.django.fields.StoredTime()),
                ("published_at", outboxer.contrib.django.fields.StoredTime(null=True)),
            ],
            options={
                "verbose_name": "outbox message",
                "ordering": ("-seq",),
                "managed": False,
            },
        ),
    ]
