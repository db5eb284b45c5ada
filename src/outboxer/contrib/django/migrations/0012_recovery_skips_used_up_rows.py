"""outboxer's claim never takes over a row whose attempts are used up (PostgreSQL migration
13: the claim function replaced in place)."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0011_inbox_suspects")]

    operations = [ApplyOutboxerSchema(postgres=13, mysql=6, sqlite=8)]
