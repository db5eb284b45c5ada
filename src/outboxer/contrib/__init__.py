"""Framework integrations, each imported on its own so that its framework stays optional.

* ``outboxer.contrib.sqlalchemy``: entities record domain events; a session listener
  enqueues them during flush, on the flush's own connection.
* ``outboxer.contrib.django``: a Django app (migrations, settings, management commands,
  admin) and the same domain events for models.
* ``outboxer.contrib.faststream``: a FastStream middleware that applies each message once
  through the inbox.
"""
