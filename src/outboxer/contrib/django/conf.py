"""outboxer's settings in a Django project: ``settings.OUTBOXER`` and ``DATABASES``.

``settings.OUTBOXER`` is a dict of outboxer's settings (the names of ``outboxer.toml``:
``schema``, ``table``, ``batch_size``, ``broker``, ``destinations``, ``http`` …) plus
``database``, the alias whose database holds the outbox (default ``"default"``), and
``consumer``, the settings of ``manage.py outboxer_consume`` (those of ``outboxer.toml``'s
``[consumer]`` table). ``db`` defaults to that alias's ``DATABASES`` entry as a URL. As with
the CLI, values given here win over ``OUTBOXER_*`` environment variables, which win over
``outboxer.toml`` (``destinations`` here replace the file's)::

    OUTBOXER = {
        "broker": "amqp://guest:guest@localhost/",
        "batch_size": 200,
        # or several destinations, as in outboxer.toml:
        # "destinations": {"internal": {"broker": "amqp://…"}, "partner": {"broker": "https://…"}},
        "consumer": {"group": "shipping", "handler": "shipping.events:apply"},
    }

Model events are enqueued for every configured destination (``Outbox.destinations``), with
the payload protection ``outboxer enqueue`` applies (``encryption_keys`` or
``encryption_key_file``, ``claim_check_store``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from django.conf import settings as django_settings
from django.db import DEFAULT_DB_ALIAS, connections

from outboxer.config import (
    Settings,
    declarations,
    declared_values,
    file_table,
    load_settings,
    parse_destinations,
    read_config_file,
)
from outboxer.enqueue import Outbox
from outboxer.errors import ConfigError
from outboxer.stores.sqlfiles import table_name

if TYPE_CHECKING:
    from outboxer.consume_cli import ConsumerSettings

#: Django's database vendors and outboxer's dialect of each.
DIALECTS = {"postgresql": "postgres", "mysql": "mysql", "sqlite": "sqlite"}

#: libpq options of a PostgreSQL entry's OPTIONS that the URL carries (asyncpg and psycopg
#: read them from its query): the service, password file and certificates Django's
#: connection uses are outboxer's too. Not sslpassword: a secret outside the URL's password.
PG_OPTIONS = (
    "service",
    "passfile",
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslcrl",
    "target_session_attrs",
)


#: Options of a MySQL entry's OPTIONS that the URL carries by the same name (the MySQL
#: store's URL options): the socket, option file and TLS Django's connection uses are
#: outboxer's too.
MYSQL_OPTIONS = (
    "unix_socket",
    "connect_timeout",
    "read_default_file",
    "read_default_group",
    "ssl_mode",
)

#: The keys of a MySQL entry's ``OPTIONS["ssl"]`` (PyMySQL's and mysqlclient's dict) that
#: the URL can carry.
MYSQL_SSL_KEYS = ("ca", "cert", "key", "check_hostname", "verify_mode")


def mysql_query(alias: str, options: Mapping[str, Any]) -> dict[str, str]:
    """The MySQL URL's query options for a MySQL entry's ``OPTIONS``. A TLS setting the URL
    cannot carry is a ConfigError: dropped, outboxer would connect without the TLS (or the
    verification) the project configured."""
    query = {name: str(options[name]) for name in MYSQL_OPTIONS if options.get(name)}
    tls = options.get("ssl")
    if not tls:
        return query
    where = f'database {alias!r}: OPTIONS["ssl"]'
    if not isinstance(tls, Mapping):
        raise ConfigError(
            f"{where} is a {type(tls).__name__}, which outboxer's connections (a URL) cannot "
            'take: give a dict (ca, cert, key), or OUTBOXER["db"] with the ssl_* URL options'
        )
    if unknown := sorted(set(tls) - set(MYSQL_SSL_KEYS)):
        raise ConfigError(f"{where}: outboxer cannot carry {unknown}; it takes {MYSQL_SSL_KEYS}")
    query.update({f"ssl_{name}": str(tls[name]) for name in ("ca", "cert", "key") if tls.get(name)})
    if "ssl_mode" not in query and ("check_hostname" in tls or "verify_mode" in tls):
        # PyMySQL's reading of its dict: verification unless verify_mode says none, the host
        # checked with a CA unless check_hostname is false (never without a CA).
        verify = tls.get("verify_mode", True)
        if isinstance(verify, str):
            verify = verify.lower() not in ("none", "0", "false", "no")
        if not verify:
            query.pop("ssl_ca", None)  # loaded but never checked: the URL refuses that pair
            query["ssl_mode"] = "required"
        else:
            identity = bool(tls.get("ca")) and bool(tls.get("check_hostname", True))
            query["ssl_mode"] = "verify_identity" if identity else "verify_ca"
    return query


def raw_settings() -> dict[str, Any]:
    value = getattr(django_settings, "OUTBOXER", {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"settings.OUTBOXER must be a dict, not {type(value).__name__}")
    return dict(value)


def database_alias() -> str:
    """The alias of the database that holds the outbox (``OUTBOXER["database"]``)."""
    alias = raw_settings().get("database", DEFAULT_DB_ALIAS)
    if not isinstance(alias, str) or alias not in django_settings.DATABASES:
        raise ConfigError(f'settings.OUTBOXER["database"] names no database: {alias!r}')
    return str(alias)


def dialect(alias: str) -> str:
    vendor = str(connections[alias].vendor)
    if vendor not in DIALECTS:
        raise ConfigError(f"Django database vendor {vendor!r} ({alias!r}) is not supported")
    return DIALECTS[vendor]


def database_url(alias: str) -> str:
    """A URL outboxer's stores take for Django's database ``alias``."""
    entry = connections[alias].settings_dict
    kind = dialect(alias)
    name = str(entry.get("NAME") or "")
    if kind == "sqlite":
        if not name or name == ":memory:" or name.startswith("file:"):
            raise ConfigError(f"database {alias!r}: the relay needs an SQLite file, not {name!r}")
        return f"sqlite:///{name}"  # an absolute NAME gives sqlite:////path, as it should
    user, password = str(entry.get("USER") or ""), str(entry.get("PASSWORD") or "")
    host, port = str(entry.get("HOST") or ""), str(entry.get("PORT") or "")
    options: Mapping[str, Any] = entry.get("OPTIONS") or {}
    query: dict[str, str] = {}
    if host.startswith("/"):  # a socket directory (PostgreSQL) or socket file (MySQL)
        query["host" if kind == "postgres" else "unix_socket"] = host
        host = ""
    elif ":" in host and not host.startswith("["):  # an IPv6 address: [::1]:5432, as URLs say
        host = f"[{host}]"
    if kind == "mysql":
        query.update(mysql_query(alias, options))
    if kind == "postgres":
        query.update({name: str(options[name]) for name in PG_OPTIONS if name in options})
    credentials = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
    netloc = (credentials + "@" if credentials else "") + host + (":" + port if port else "")
    scheme = "postgresql" if kind == "postgres" else "mysql"
    suffix = "?" + urlencode(query) if query else ""
    # No NAME (PostgreSQL: a service names the database): no path, which would name "".
    path = "/" + quote(name, safe="") if name else ""
    return f"{scheme}://{netloc}{path}{suffix}"


def outboxer_settings() -> Settings:
    """outboxer's ``Settings`` for this project.

    The database URL is derived on every call, never cached: Django's test runner renames
    the database after the app has loaded."""
    return settings_with()


def settings_with(**overrides: Any) -> Settings:
    """``outboxer_settings()`` with some values replaced (a management command's options)."""
    alias = overrides.pop("database", None) or database_alias()
    given = {name: value for name, value in overrides.items() if value is not None}
    loaded = _load(given) if given else _names()
    # A db given in OUTBOXER, OUTBOXER_DB or outboxer.toml wins over the alias's DATABASES:
    # it is OUTBOXER["database"]'s. Another alias (a command's --database) is its own
    # database: checked, relayed or consumed there, not on the configured db.
    if loaded.db and alias == database_alias():
        return loaded
    return dataclasses.replace(loaded, db=database_url(alias))


@functools.cache
def _names() -> Settings:
    """The settings as configured (read once; ``override_settings`` resets it), without the
    database URL derived from ``DATABASES``: names and destinations are all that writing to
    the outbox needs, even where no relay could run (an in-memory SQLite test database)."""
    return _load({})


def _load(overrides: dict[str, Any]) -> Settings:
    raw = raw_settings()
    raw.pop("database", None)
    raw.pop("consumer", None)  # the consumer's own settings: consumer_settings()
    destinations = parse_destinations(
        raw.pop("destinations", {}), 'settings.OUTBOXER["destinations"]'
    )
    _check(raw, Settings, "settings.OUTBOXER", skip=("db",))  # db: one URL or several
    raw.update(overrides)
    loaded = load_settings(raw)
    # OUTBOXER["destinations"] replace outboxer.toml's; Settings gives the "broker" setting
    # (OUTBOXER, OUTBOXER_BROKER or the file) to the default destination, as everywhere.
    return dataclasses.replace(loaded, destinations=destinations) if destinations else loaded


def consumer_settings(**overrides: Any) -> ConsumerSettings:
    """``manage.py outboxer_consume``'s own settings (group, handler, topics …), strongest
    first: ``overrides`` (its options), ``OUTBOXER["consumer"]``, ``OUTBOXER_*`` environment
    variables, the ``[consumer]`` table of ``outboxer.toml``."""
    from outboxer.consume_cli import ConsumerSettings

    given = raw_settings().get("consumer", {})
    if not isinstance(given, Mapping):
        raise ConfigError(
            f'settings.OUTBOXER["consumer"] must be a dict, not {type(given).__name__}'
        )
    _check(given, ConsumerSettings, 'settings.OUTBOXER["consumer"]')
    given = {**given, **{name: value for name, value in overrides.items() if value is not None}}
    file_values, origin = read_config_file(None, os.environ)
    values = declared_values(
        ConsumerSettings,
        given,
        os.environ,
        file_table(file_values, "consumer", origin),
        f"{origin} [consumer]",
    )
    return ConsumerSettings(**values)


def _check(values: Mapping[str, Any], cls: type, where: str, *, skip: tuple[str, ...] = ()) -> None:
    """Parse ``values`` as ``cls`` declares its settings, so that an error names the value
    where the project wrote it (``settings.OUTBOXER["batch_size"]``), not the command-line
    flag ``load_settings`` names for a value given to it (``--batch-size``)."""
    known = {declared.name: declared for declared in declarations(cls)}
    if unknown := sorted(set(values) - set(known)):
        raise ConfigError(f"{where}: unknown settings {unknown}; known: {sorted(known)}")
    for name, value in values.items():
        if value is not None and name not in skip:
            known[name].kind.parse(value, f'{where}["{name}"]')


def forget_settings(**signal: Any) -> None:
    """``setting_changed`` receiver: the next use reads the settings again."""
    if signal.get("setting") in ("OUTBOXER", "DATABASES"):
        _names.cache_clear()
        outbox_names.cache_clear()
        outbox.cache_clear()


@functools.cache
def outbox_names() -> Outbox:
    """The outbox's names and destinations, without payload protection: what the migrations
    and the admin's models need, which must load without the keys or the object store."""
    current = _names()
    return Outbox(
        schema=current.schema,
        table=current.table,
        destinations=tuple(current.destination_names),
    )


@functools.cache
def outbox() -> Outbox:
    """The outbox model events are written to: the configured names and destinations, and
    the payload protection of ``outboxer enqueue`` (``encryption_keys`` or
    ``encryption_key_file``, ``claim_check_store``), so that the table holds what the
    settings promise: ciphertext and claim-check references, never the plaintext."""
    from outboxer import payload_admin

    current = _names()
    return Outbox(
        schema=current.schema,
        table=current.table,
        destinations=tuple(current.destination_names),
        encryption=payload_admin.keyring(current),
        claim_check=payload_admin.claim_check(current),
    )


def outbox_table(alias: str) -> str:
    """The outbox table as the SQL of ``alias``'s vendor names it (quoted)."""
    return schema_table(alias, outbox_names().table)


def schema_table(alias: str, table: str) -> str:
    """A table of outboxer's schema (the outbox, ``inbox``, ``dead_letters``) as the SQL of
    ``alias``'s vendor names it (quoted)."""
    return table_name(dialect(alias), outbox_names().schema, table)
