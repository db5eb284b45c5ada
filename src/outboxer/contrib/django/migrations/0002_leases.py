"""outboxer's leases (PostgreSQL migration 6, MySQL 2, SQLite 3): renewed, fenced claims."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0001_initial")]

    operations = [ApplyOutboxerSchema(postgres=6, mysql=2, sqlite=3)]
