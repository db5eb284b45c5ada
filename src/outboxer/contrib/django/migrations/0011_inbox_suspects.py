"""outboxer's table of the consumer runner's suspects: redelivered messages whose attempt is
recorded before their handler runs, so that one that kills the process is dead-lettered
after max_attempts deaths (PostgreSQL migration 12, MySQL 6, SQLite 8)."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0010_claim_check_index")]

    operations = [ApplyOutboxerSchema(postgres=12, mysql=6, sqlite=8)]
