"""The admin's model of the consumer's dead-letter table (created by 0003; no SQL here)."""

from django.db import migrations, models

import outboxer.contrib.django.fields


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0003_dead_letters")]

    operations = [
        # The table is outboxer's (managed=False): this only records the model's state.
        migrations.CreateModel(
            name="DeadLetter",
            fields=[
                ("seq", models.BigIntegerField(primary_key=True, serialize=False)),
                ("consumer", models.CharField(max_length=255)),
                ("message_id", models.UUIDField()),
                ("topic", models.CharField(max_length=255)),
                ("key", models.CharField(max_length=255, null=True)),
                ("headers", models.JSONField()),
                ("content_type", models.CharField(max_length=255)),
                ("payload", models.BinaryField()),
                ("created_at", outboxer.contrib.django.fields.StoredTime(null=True)),
                ("error", models.TextField()),
                ("attempts", models.IntegerField()),
                ("held", models.BooleanField()),
                ("failed_at", outboxer.contrib.django.fields.StoredTime()),
            ],
            options={
                "verbose_name": "dead letter",
                "ordering": ("seq",),
                "managed": False,
            },
        ),
    ]
