"""outboxer's index of each key's unfinished rows, which keeps a claim short on a SQLite
table with a long history (SQLite migration 6)."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0008_claim_byte_budget")]

    operations = [ApplyOutboxerSchema(postgres=10, mysql=5, sqlite=6)]
