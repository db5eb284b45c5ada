"""Settings: flags, then ``OUTBOXER_*`` environment variables, then ``outboxer.toml``.

A file can name several destinations, each with its own broker::

    db = "postgresql://localhost/app"
    batch_size = 500

    [destinations.internal]
    broker = "amqp://guest:guest@localhost/"

    [destinations.partner]
    broker = "https://partner.example/hooks"
    envelope = "stripped"
    routes = { "order.created" = "/orders" }
    options = { secret = "..." }
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import tomllib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outboxer.errors import ConfigError
from outboxer.message import DEFAULT_DESTINATION
from outboxer.retry import Backoff

ENV_PREFIX = "OUTBOXER_"
DEFAULT_CONFIG_FILE = "outboxer.toml"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: object, name: str) -> float:
    """Seconds from a number or a string like ``250ms``, ``30s``, ``5m``, ``7d``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a duration, not a boolean")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ConfigError(
            f"{name} must be a duration such as 30, '30s', '5m' or '7d'; got {value!r}"
        )
    if seconds < 0:
        raise ConfigError(f"{name} must not be negative")
    return seconds


def int_option(value: object, name: str, low: int, high: int) -> int:
    try:
        number = int(str(value)) if not isinstance(value, int) or isinstance(value, bool) else value
    except ValueError:
        raise ConfigError(f"{name} must be a whole number; got {value!r}") from None
    if isinstance(value, bool) or not low <= number <= high:
        raise ConfigError(f"{name} must be between {low} and {high}; got {value!r}")
    return number


def float_option(value: object, name: str, low: float, high: float) -> float:
    try:
        number = (
            float(str(value))
            if not isinstance(value, int | float) or isinstance(value, bool)
            else float(value)
        )
    except ValueError:
        raise ConfigError(f"{name} must be a number; got {value!r}") from None
    if isinstance(value, bool) or not low <= number <= high:
        raise ConfigError(f"{name} must be between {low} and {high}; got {value!r}")
    return number


def bool_option(value: object, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false; got {value!r}")


def parse_http_address(value: object, name: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6) -> (host, port); port 0 picks a free one."""
    text = str(value).strip()
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(
            f"{name}: write an IPv6 address in brackets, as in [::1]:8080; got {value!r}"
        )
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(
            f"{name} must be HOST:PORT, such as 127.0.0.1:8080 or 0.0.0.0:8080; got {value!r}"
        )
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host``; a name other than localhost counts as public."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _http_address(value: object, name: str) -> str:
    parse_http_address(value, name)
    return str(value).strip()


def _secret(value: object, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be a non-empty string")
    return value


def default_relay_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class DestinationSettings:
    """Where one destination's copies go."""

    name: str
    broker: str
    #: ``full``: every envelope field; ``stripped``: what an outside consumer needs (see README).
    envelope: str = "full"
    routes: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.envelope not in ("full", "stripped"):
            raise ConfigError(f"destination {self.name!r}: envelope must be 'full' or 'stripped'")
        if "://" not in self.broker:
            raise ConfigError(
                f"destination {self.name!r}: broker must be a URL such as amqp://host/; got {self.broker!r}"
            )


@dataclass(frozen=True)
class Settings:
    """Every setting of the relay and the CLI, with its documented default."""

    db: str | None = None
    schema: str = "outboxer"
    table: str = "outbox"
    destinations: Mapping[str, DestinationSettings] = field(default_factory=dict)
    batch_size: int = 500
    #: Seconds a claimed row stays locked; a relay that dies releases its rows after this.
    lock_timeout: float = 60.0
    max_attempts: int = 10
    #: Seconds between polls when no NOTIFY arrives (a fallback: NOTIFY wakes the relay at once).
    poll_interval: float = 1.0
    backoff_base: float = 1.0
    backoff_multiplier: float = 2.0
    backoff_max: float = 300.0
    backoff_jitter: float = 0.25
    published_retention: float = 7 * 86400.0
    abandoned_retention: float = 30 * 86400.0
    #: Keep inbox entries this long: longer than any redelivery can come late.
    inbox_retention: float = 30 * 86400.0
    cleanup_interval: float = 300.0
    cleanup_batch: int = 1000
    #: Claim-publish-settle loops per destination in one relay process.
    concurrency: int = 4
    publish_timeout: float = 30.0
    #: Whether an abandoned message holds back the later messages of its key.
    abandoned_blocks_key: bool = False
    exit_when_idle: bool = False
    relay_id: str = field(default_factory=default_relay_id)
    #: ``HOST:PORT`` of the HTTP API (health, metrics, status, requeue); None: no API.
    http: str | None = None
    #: Bearer token the HTTP API's mutating endpoints require (kept out of reprs and logs).
    http_token: str | None = field(default=None, repr=False)

    @property
    def backoff(self) -> Backoff:
        return Backoff(
            self.backoff_base, self.backoff_multiplier, self.backoff_max, self.backoff_jitter
        )

    @property
    def destination_names(self) -> list[str]:
        """The configured destinations, or the default one when none is configured."""
        return list(self.destinations) or [DEFAULT_DESTINATION]

    def require_db(self) -> str:
        if not self.db:
            raise ConfigError("no database: pass --db URL or set OUTBOXER_DB")
        return self.db


def _positive_duration(value: object, name: str) -> float:
    seconds = parse_duration(value, name)
    if seconds <= 0:
        raise ConfigError(f"{name} must be greater than zero")
    return seconds


_CHECKS: dict[str, Any] = {
    "batch_size": lambda v, n: int_option(v, n, 1, 10_000),
    "lock_timeout": _positive_duration,
    "max_attempts": lambda v, n: int_option(v, n, 1, 1_000_000),
    "poll_interval": _positive_duration,
    "backoff_base": _positive_duration,
    "backoff_multiplier": lambda v, n: float_option(v, n, 1.0, 1000.0),
    "backoff_max": _positive_duration,
    "backoff_jitter": lambda v, n: float_option(v, n, 0.0, 0.99),
    "published_retention": parse_duration,
    "abandoned_retention": parse_duration,
    "inbox_retention": parse_duration,
    "cleanup_interval": _positive_duration,
    "cleanup_batch": lambda v, n: int_option(v, n, 1, 1_000_000),
    "concurrency": lambda v, n: int_option(v, n, 1, 64),
    "publish_timeout": _positive_duration,
    "abandoned_blocks_key": bool_option,
    "exit_when_idle": bool_option,
    "db": lambda v, n: _url(v, n),
    "schema": lambda v, n: str(v),
    "table": lambda v, n: str(v),
    "relay_id": lambda v, n: str(v),
    "http": _http_address,
    "http_token": _secret,
}


def _url(value: object, name: str) -> str:
    if not isinstance(value, str) or "://" not in value:
        raise ConfigError(
            f"{name} must be a URL such as postgresql://host/db or sqlite:///file.db; got {value!r}"
        )
    return value


SETTING_NAMES = tuple(_CHECKS)


def _destinations(raw: object, origin: str) -> dict[str, DestinationSettings]:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{origin}: [destinations] must be a table of named destinations")
    result = {}
    for name, spec in raw.items():
        if not isinstance(spec, Mapping) or "broker" not in spec:
            raise ConfigError(f"{origin}: destination {name!r} needs a broker URL")
        unknown = set(spec) - {"broker", "envelope", "routes", "options"}
        if unknown:
            raise ConfigError(f"{origin}: destination {name!r} has unknown keys {sorted(unknown)}")
        routes = spec.get("routes", {})
        options = spec.get("options", {})
        if not isinstance(routes, Mapping) or not all(isinstance(v, str) for v in routes.values()):
            raise ConfigError(f"{origin}: destination {name!r}: routes must map topics to names")
        if not isinstance(options, Mapping):
            raise ConfigError(f"{origin}: destination {name!r}: options must be a table")
        result[name] = DestinationSettings(
            name,
            str(spec["broker"]),
            str(spec.get("envelope", "full")),
            dict(routes),
            dict(options),
        )
    return result


def load_settings(
    flags: Mapping[str, object] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> Settings:
    """Merge the three sources; a value given in a stronger source wins.

    ``flags`` may hold ``broker`` (a URL for the ``default`` destination).
    """
    environ = os.environ if environ is None else environ
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    path = config_file or environ.get(ENV_PREFIX + "CONFIG")
    file_values: dict[str, Any] = {}
    if path is None and Path(DEFAULT_CONFIG_FILE).is_file():
        path = DEFAULT_CONFIG_FILE
    if path is not None:
        try:
            file_values = tomllib.loads(Path(path).read_text("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        file_values = dict(file_values.get("outboxer", file_values))
    # [consumer]: the settings of `outboxer consume` alone (outboxer.consume_cli).
    unknown = set(file_values) - set(SETTING_NAMES) - {"destinations", "broker", "consumer"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown settings {sorted(unknown)}; known: {sorted(SETTING_NAMES)}"
        )

    values: dict[str, Any] = {}
    for name in SETTING_NAMES:
        if name in flags:
            raw, origin = flags[name], f"--{name.replace('_', '-')}"
        elif environ.get(ENV_PREFIX + name.upper()):  # set and not empty
            raw, origin = environ[ENV_PREFIX + name.upper()], ENV_PREFIX + name.upper()
        elif name in file_values:
            raw, origin = file_values[name], f"{path}: {name}"
        else:
            continue
        values[name] = _CHECKS[name](raw, origin)

    destinations = _destinations(file_values.get("destinations", {}), str(path))
    broker = flags.get("broker") or environ.get(ENV_PREFIX + "BROKER") or file_values.get("broker")
    if broker is not None:
        base = destinations.get(DEFAULT_DESTINATION)
        destinations[DEFAULT_DESTINATION] = (
            dataclasses.replace(base, broker=str(broker))
            if base
            else DestinationSettings(DEFAULT_DESTINATION, str(broker))
        )
    values["destinations"] = destinations
    settings = Settings(**values)
    settings.backoff  # validates the combination (cap >= base, …)  # noqa: B018
    return settings
