"""outboxer's index of the claim-checked rows, which keeps the claim-check sweep from
scanning the whole table (PostgreSQL migration 11, SQLite 7)."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0009_sqlite_waiting_index")]

    operations = [ApplyOutboxerSchema(postgres=11, mysql=5, sqlite=7)]
