from __future__ import annotations

from django.apps import AppConfig


class OutboxerConfig(AppConfig):
    name = "outboxer.contrib.django"
    label = "outboxer"
    verbose_name = "Outboxer"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import setting_changed

        from outboxer.contrib.django import conf

        setting_changed.connect(conf.forget_settings)
