"""outboxer's claim that releases a dead relay's rows behind an abandoned row of their key
(PostgreSQL migration 9)."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0006_key_slots")]

    operations = [ApplyOutboxerSchema(postgres=9, mysql=5, sqlite=5)]
