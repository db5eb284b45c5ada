"""outboxer's claim with a byte budget (claim_max_bytes; PostgreSQL migration 10)."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0007_release_behind_abandoned")]

    operations = [ApplyOutboxerSchema(postgres=10, mysql=5, sqlite=5)]
