"""outboxer's claim never waits for a row lock, so it never deadlocks with a stalled relay's
lease renewal (PostgreSQL migration 14: the claim function replaced in place)."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0012_recovery_skips_used_up_rows")]

    operations = [ApplyOutboxerSchema(postgres=14, mysql=6, sqlite=8)]
