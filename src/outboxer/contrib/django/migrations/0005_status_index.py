"""outboxer's status index (PostgreSQL migration 8, MySQL 4, SQLite 5): status stays cheap."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0004_deadletter")]

    operations = [ApplyOutboxerSchema(postgres=8, mysql=4, sqlite=5)]
