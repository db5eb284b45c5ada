"""outboxer's dead-letter table of the consumer runner (PostgreSQL 7, MySQL 3, SQLite 4)."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0002_leases")]

    operations = [ApplyOutboxerSchema(postgres=7, mysql=3, sqlite=4)]
