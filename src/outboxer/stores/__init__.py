"""Stores, one module per database, chosen by URL scheme."""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import urlsplit

from outboxer.config import check_url
from outboxer.errors import ConfigError
from outboxer.redact import redact_url
from outboxer.stores.base import (
    AbandonedRow,
    Claim,
    DestinationStatus,
    Failure,
    Lease,
    SettleResult,
    Store,
    StoreDataError,
    storable_error,
)

#: URL scheme -> (module, class).
REGISTRY: dict[str, tuple[str, str]] = {
    "postgresql": ("outboxer.stores.postgres", "PostgresStore"),
    "postgres": ("outboxer.stores.postgres", "PostgresStore"),
    "postgresql+asyncpg": ("outboxer.stores.postgres", "PostgresStore"),
    "postgresql+psycopg": ("outboxer.stores.postgres", "PostgresStore"),
    "sqlite": ("outboxer.stores.sqlite", "SqliteStore"),
    "mysql": ("outboxer.stores.mysql", "MySQLStore"),
    "mysql+pymysql": ("outboxer.stores.mysql", "MySQLStore"),
    "mysql+aiomysql": ("outboxer.stores.mysql", "MySQLStore"),
    "mariadb": ("outboxer.stores.mysql", "MySQLStore"),
    "mariadb+pymysql": ("outboxer.stores.mysql", "MySQLStore"),
    "mariadb+aiomysql": ("outboxer.stores.mysql", "MySQLStore"),
}


def create_store(url: str, **options: Any) -> Store:
    """A store for the database at ``url`` (its scheme picks the adapter), not yet connected."""
    check_url(url, "database URL")
    scheme = urlsplit(url).scheme.lower()
    if scheme not in REGISTRY:
        raise ConfigError(
            f"unknown database URL scheme {scheme!r} in {redact_url(url)!r}; "
            f"known: {', '.join(sorted(REGISTRY))}"
        )
    module_name, class_name = REGISTRY[scheme]
    cls: type[Store] = getattr(importlib.import_module(module_name), class_name)
    return cls(url, **options)


__all__ = [
    "REGISTRY",
    "AbandonedRow",
    "Claim",
    "DestinationStatus",
    "Failure",
    "Lease",
    "SettleResult",
    "Store",
    "StoreDataError",
    "create_store",
    "storable_error",
]
