"""outboxer's MySQL key-lock slots (MySQL migration 5): writers of one key never deadlock."""

from django.db import migrations

from outboxer.contrib.django.schema import ApplyOutboxerSchema


class Migration(migrations.Migration):
    dependencies = [("outboxer", "0005_status_index")]

    operations = [ApplyOutboxerSchema(postgres=8, mysql=5, sqlite=5)]
