"""The Django app ``outboxer.contrib.django``: put it in ``INSTALLED_APPS``.

* Migrations that create the outbox schema (the same DDL as ``outboxer schema apply``,
  applied per database vendor and recorded, so the relay's schema check passes).
* Settings in ``settings.OUTBOXER`` (see ``outboxer.contrib.django.conf``).
* ``manage.py outboxer_relay``, ``manage.py outboxer_status`` and ``manage.py
  outboxer_consume``, whose handler runs on Django's connection, in the transaction of
  the inbox claim (``outboxer.contrib.django.consumer``).
* Model events: ``outboxer.contrib.django.events.RecordsEvents``, a model mixin whose
  recorded events are enqueued inside the ``atomic()`` block of ``save()``, and
  ``write_events_for`` for what ``bulk_create()`` and ``update()`` write.
* A read-only admin of the outbox with a requeue action, and of the consumer's dead
  letters with a replay action.

Modules here import Django lazily enough to be imported before the app registry is ready,
except ``models`` and ``admin``, which Django loads itself.
"""
