"""The Django app ``outboxer.contrib.django``: put it in ``INSTALLED_APPS``.

* Migrations that create the outbox schema (the same DDL as ``outboxer schema apply``,
  applied per database vendor and recorded, so the relay's schema check passes).
* Settings in ``settings.OUTBOXER`` (see ``outboxer.contrib.django.conf``).
* ``manage.py outboxer_relay`` and ``manage.py outboxer_status``. (``outboxer_consume``
  follows once the consumer side, ``outboxer consume``, is released; until then consume
  with ``outboxer.contrib.faststream`` or ``Inbox.claim`` in your own consumer.)
* Model events: ``outboxer.contrib.django.events.RecordsEvents``, a model mixin whose
  recorded events are enqueued inside the ``atomic()`` block of ``save()``.
* A read-only admin of the outbox with a requeue action.

Modules here import Django lazily enough to be imported before the app registry is ready,
except ``models`` and ``admin``, which Django loads itself.
"""
