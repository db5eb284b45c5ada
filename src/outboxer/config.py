"""Settings: flags, then ``OUTBOXER_*`` environment variables, then ``outboxer.toml``.

Each setting is declared once, as a field of :class:`Settings` made by :func:`setting`:
its type, default, value kind (how text becomes a value, and its bounds), help text and
the commands that take it. Everything else derives from that declaration: the flag
``--batch-size``, the environment variable ``OUTBOXER_BATCH_SIZE``, the TOML key
``batch_size``, the CLI's help with the real default (:func:`add_flags`) and the README's
table (:func:`settings_table`; ``scripts/settings-table`` writes it into README.md).

Another command's settings reuse the mechanism: add fields to :class:`Settings` with
``commands=("consume",)`` (or add "consume" to a shared setting's commands), or declare a
dataclass of their own with :func:`setting`, give it flags with :func:`add_flags`, and read
it with :func:`declared_values` from its own table of the file (:func:`read_config_file`,
:func:`file_table`; list the table in ``OTHER_COMMANDS_TABLES``). ``repeatable=True`` makes
a flag that can be given several times (kinds :class:`TextList`, :class:`Pairs`);
``flag=``/``env=`` rename a vague flag or variable (``OUTBOXER_CONSUMER_NAME``).

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

import argparse
import dataclasses
import datetime
import functools
import ipaddress
import math
import os
import re
import socket
import tomllib
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from outboxer.errors import ConfigError
from outboxer.message import DEFAULT_DESTINATION, destination_name_problem
from outboxer.options import parse_bool
from outboxer.redact import (
    LONGEST_PORT,
    MASK,
    is_secret_option,
    printable,
    redact_malformed_url,
    redact_text,
    redact_url,
    register_secret,
    register_url_secrets,
    split_unencoded_userinfo,
)
from outboxer.retry import Backoff

ENV_PREFIX = "OUTBOXER_"
DEFAULT_CONFIG_FILE = "outboxer.toml"

T = TypeVar("T")

DAY = 86400.0
#: The longest timeout or interval: longer ones are typos (or ``1e20``) that would make a
#: claim lock rows, or a loop sleep, for ever.
LONGEST_INTERVAL = 30 * DAY
#: The longest retention.
LONGEST_RETENTION = 3650 * DAY


# ----- value kinds: how a flag's, a variable's or a TOML value's text becomes a value -----


class Kind(ABC, Generic[T]):
    """How one setting's value is read, shown and described."""

    #: What the CLI's help shows in place of the value.
    metavar: ClassVar[str] = "VALUE"

    @abstractmethod
    def parse(self, value: object, name: str) -> T:
        """The value, or a ConfigError naming ``name`` (a flag, a variable or a file key)."""

    def show(self, value: T) -> str:
        """``value`` as a user would write it (the help's and the README's default)."""
        return str(value)

    def allowed(self) -> str:
        """The values it takes, for the help and the README ("" when any text will do)."""
        return ""


_WHOLE = re.compile(r"[+-]?[0-9]{1,30}")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# ASCII digits only: str.isdigit() and \d accept '²' or '٣', which int() then refuses.
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d)?")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY, None: 1.0}


def _finite(value: float, name: str, what: str) -> float:
    """A finite float from an int or a float (TOML's ``nan``, ``inf`` and ``1e400`` are not)."""
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be a finite {what}; got {value!r}")
    return number


@dataclass(frozen=True)
class Whole(Kind[int]):
    low: int
    high: int
    metavar: ClassVar[str] = "N"

    def parse(self, value: object, name: str) -> int:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a whole number, not a boolean")
        if isinstance(value, int):
            number = value
        elif isinstance(value, str) and _WHOLE.fullmatch(value.strip()):
            number = int(value.strip())
        else:
            raise ConfigError(f"{name} must be a whole number; got {value!r}")
        if not self.low <= number <= self.high:
            raise ConfigError(f"{name} must be between {self.low} and {self.high}; got {value!r}")
        return number

    def allowed(self) -> str:
        return f"{self.low} to {self.high}"


@dataclass(frozen=True)
class Number(Kind[float]):
    low: float
    high: float
    metavar: ClassVar[str] = "X"

    def parse(self, value: object, name: str) -> float:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a number, not a boolean")
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = float(value.strip())
        if not isinstance(value, int | float):
            raise ConfigError(f"{name} must be a number; got {value!r}")
        number = _finite(value, name, "number")
        if not self.low <= number <= self.high:
            raise ConfigError(
                f"{name} must be between {self.low:g} and {self.high:g}; got {value!r}"
            )
        return number

    def show(self, value: float) -> str:
        return f"{value:g}"

    def allowed(self) -> str:
        return f"{self.low:g} to {self.high:g}"


def format_duration(seconds: float) -> str:
    """``seconds`` in the largest unit that writes it exactly: 604800 -> ``7d``, 0.25 -> ``250ms``."""
    for unit, size in (("d", DAY), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    if seconds and (seconds * 1000) % 1 == 0:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class Duration(Kind[float]):
    """Seconds, from a number or a string like ``250ms``, ``30s``, ``5m``, ``7d``."""

    high: float = LONGEST_RETENTION
    #: Whether zero is refused (an interval or a timeout of zero would spin or never wait).
    positive: bool = False
    #: The shortest value taken (0: none but ``positive``).
    low: float = 0.0
    metavar: ClassVar[str] = "DURATION"

    def parse(self, value: object, name: str) -> float:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a duration, not a boolean")
        if isinstance(value, int | float):
            seconds = _finite(value, name, "duration")
        elif isinstance(value, str) and (match := _DURATION.fullmatch(value.strip())):
            seconds = _finite(float(match.group(1)) * _UNITS[match.group(2)], name, "duration")
        else:
            raise ConfigError(
                f"{name} must be a duration such as 30, '30s', '5m' or '7d'; got {value!r}"
            )
        if seconds < 0:
            raise ConfigError(f"{name} must not be negative")
        if self.positive and seconds == 0:
            raise ConfigError(f"{name} must be greater than zero")
        if seconds < self.low:
            raise ConfigError(f"{name} must be at least {format_duration(self.low)}; got {value!r}")
        if seconds > self.high:
            raise ConfigError(f"{name} must be at most {format_duration(self.high)}; got {value!r}")
        return seconds

    def show(self, value: float) -> str:
        return format_duration(value)

    def allowed(self) -> str:
        if self.low:
            return f"{format_duration(self.low)} to {format_duration(self.high)}"
        if self.positive:
            return f"more than 0, at most {format_duration(self.high)}"
        return f"0 to {format_duration(self.high)}"


@dataclass(frozen=True)
class Boolean(Kind[bool]):
    metavar: ClassVar[str] = "true|false"

    def parse(self, value: object, name: str) -> bool:
        if isinstance(value, bool):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be true or false; got {value!r}")
        return parse_bool(value, name)

    def show(self, value: bool) -> str:
        return "true" if value else "false"

    def allowed(self) -> str:
        return "true or false"


@dataclass(frozen=True)
class Text(Kind[str]):
    """Printable text of at most ``longest`` characters."""

    longest: int
    metavar: ClassVar[str] = "TEXT"

    def parse(self, value: object, name: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{name} must be a non-empty string; got {value!r}")
        if not value.isprintable() or len(value) > self.longest:
            raise ConfigError(
                f"{name} must be printable text of at most {self.longest} characters; got {value!r}"
            )
        return value

    def allowed(self) -> str:
        return f"text, at most {self.longest} characters"


@dataclass(frozen=True)
class Identifier(Kind[str]):
    """A schema or table name (the stores quote it into SQL)."""

    what: str
    metavar: ClassVar[str] = "NAME"

    def parse(self, value: object, name: str) -> str:
        from outboxer.stores.base import check_identifier  # the stores' own rule

        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string; got {value!r}")
        try:
            return check_identifier(self.what, value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None

    def allowed(self) -> str:
        return "letters, digits, _"


@dataclass(frozen=True)
class Choice(Kind[str]):
    """One of a few words (``log`` or ``wal``)."""

    choices: tuple[str, ...]
    metavar: ClassVar[str] = "WORD"

    def parse(self, value: object, name: str) -> str:
        if not isinstance(value, str) or value.strip() not in self.choices:
            raise ConfigError(f"{name} must be one of {', '.join(self.choices)}; got {value!r:.60}")
        return value.strip()

    def allowed(self) -> str:
        return " or ".join(self.choices)


def check_url(url: str, name: str) -> None:
    """ConfigError unless every host of ``url`` has no port or a port from 0 to 65535.

    The drivers parse ports late (``urlsplit(url).port`` raises ValueError, asyncpg
    ``int()``), so a typo would surface as a traceback, or a relay retrying for ever.
    Comma-separated hosts (libpq, Kafka) are checked one by one.
    """
    try:
        netloc = urlsplit(url).netloc
    except ValueError as exc:
        raise ConfigError(f"{name} is not a valid URL ({exc}): {redact_url(url)!r}") from None
    if split_unencoded_userinfo(url) is not None:
        # Left alone, the driver would read part of the password as a host or port and echo it.
        raise ConfigError(
            f"{name}: the password in {redact_url(url)!r} holds a '/', '?' or '#': "
            "percent-encode it (%2F, %3F, %23)"
        )
    for host in netloc.rpartition("@")[2].split(","):
        if host.startswith("["):
            closing = host.find("]")
            port = host[closing + 1 :].removeprefix(":") if closing >= 0 else "?"
        else:
            port = host.rpartition(":")[2] if ":" in host else ""
        if port and not (
            port.isascii() and port.isdigit() and len(port) <= 5 and int(port) <= 65535
        ):
            # Without a user part, a long "port" that is no number may be a password whose
            # "@host" was left out: redact_url masks it, and so does this message.
            visible = (
                "@" in netloc or host.startswith("[") or port.isdigit() or len(port) <= LONGEST_PORT
            )
            shown = f" {port!r}" if visible else ""
            raise ConfigError(
                f"{name}: the port{shown} in {redact_url(url)!r} is not a number from 0 to 65535"
            )


@dataclass(frozen=True)
class Url(Kind[str]):
    example: str
    metavar: ClassVar[str] = "URL"

    def parse(self, value: object, name: str) -> str:
        if not isinstance(value, str) or "://" not in value:
            # redact_text finds URLs by their "://": a mistyped one needs its own masking.
            shown = (
                repr(redact_malformed_url(value))
                if isinstance(value, str)
                else redact_text(repr(value))
            )
            raise ConfigError(f"{name} must be a URL such as {self.example}; got {shown}")
        check_url(value, name)
        return value

    def allowed(self) -> str:
        return f"a URL such as {self.example}"


#: The name of the one database of a relay given one ``db`` (the ``database`` label of its
#: metrics), and of the API's single-database answers.
DEFAULT_DATABASE = "default"
_DATABASE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,62}")
#: ``NAME=URL``: a name cannot hold ``:`` or ``/``, so a URL never reads as one.
_NAMED_URL = re.compile(r"([A-Za-z_][A-Za-z0-9_-]{0,62})=(.*)", re.DOTALL)


def check_database_name(value: object, name: str) -> str:
    """A database's name: it labels metrics and log lines, and ``--database`` picks it."""
    if not isinstance(value, str) or not _DATABASE_NAME.fullmatch(value):
        raise ConfigError(
            f"{name}: a database name starts with a letter or _ and holds at most 63 letters, "
            f"digits, _ and -; got {redact_text(repr(value))}"
        )
    return value


@dataclass(frozen=True)
class DatabaseName(Kind[str]):
    metavar: ClassVar[str] = "NAME"

    def parse(self, value: object, name: str) -> str:
        return check_database_name(value, name)

    def allowed(self) -> str:
        return "letters, digits, _, -"


@dataclass(frozen=True)
class DatabaseUrl(Url):
    """A database URL; ``NAME=URL`` is for the repeated ``--db`` flag (see load_settings)."""

    def parse(self, value: object, name: str) -> str:
        if isinstance(value, str) and _NAMED_URL.fullmatch(value):
            raise ConfigError(
                f"{name}: NAME=URL names a database of the repeated --db flag; here give the "
                f"URL alone, or name databases in [databases.NAME] tables of the file"
            )
        return super().parse(value, name)


def split_named_url(text: str) -> tuple[str | None, str]:
    """``NAME=URL`` -> (NAME, URL); a plain URL -> (None, URL)."""
    match = _NAMED_URL.fullmatch(text)
    return (match.group(1), match.group(2)) if match else (None, text)


def _comma_separated(value: object, name: str, what: str) -> list[str]:
    """The texts of ``a,b``, of a TOML array of strings or of a repeated flag (a list)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{name} must be {what}; got {value!r}")
    return [text.strip() for item in items for text in item.split(",") if text.strip()]


@dataclass(frozen=True)
class TextList(Kind[tuple[str, ...]]):
    """Several texts: comma-separated, a TOML array of strings, or a repeated flag."""

    metavar: ClassVar[str] = "TEXT"

    def parse(self, value: object, name: str) -> tuple[str, ...]:
        texts = _comma_separated(value, name, "a list of strings (or a,b,c)")
        if not texts:
            raise ConfigError(f"{name} must name at least one")
        return tuple(texts)

    def show(self, value: tuple[str, ...]) -> str:
        return ",".join(value)

    def allowed(self) -> str:
        return "one or more, comma-separated"


#: A DNS name (or, with a leading dot, a domain and every name under it): what a Host
#: field may name.
_HOST_NAME = re.compile(
    r"\.?[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


class HostNames(TextList):
    """Host names, lower-cased; ``.example.com`` names the domain and each name under it."""

    metavar: ClassVar[str] = "NAME"

    def parse(self, value: object, name: str) -> tuple[str, ...]:
        names = super().parse(value, name)
        for host in names:
            if len(host) > 254 or not _HOST_NAME.fullmatch(host):
                raise ConfigError(
                    f"{name}: {printable(host[:100])!r} is no host name (letters, digits, '-'"
                    " and '.'; a leading '.' for a domain and the names under it)"
                )
        return tuple(host.lower().rstrip(".") for host in names)

    def allowed(self) -> str:
        return "host names, comma-separated"


class MaskedPairs(dict[str, Any]):
    """Named options (``--option sasl_password=…``) whose repr() masks the secret ones: the
    settings dataclass that holds them prints them in its own repr."""

    def __repr__(self) -> str:
        return repr({name: _shown_option(name, value) for name, value in self.items()})


@dataclass(frozen=True)
class Pairs(Kind[dict[str, Any]]):
    """Named values: a TOML table, or ``NAME=VALUE`` texts (comma-separated or repeated)."""

    metavar: ClassVar[str] = "NAME=VALUE"

    def parse(self, value: object, name: str) -> dict[str, Any]:
        pairs = MaskedPairs()
        if isinstance(value, Mapping):
            pairs.update((str(key), item) for key, item in value.items())
        else:
            for text in _comma_separated(value, name, "a table or NAME=VALUE texts"):
                key, sep, item = text.partition("=")
                if not sep or not key.strip():
                    raise ConfigError(f"{name} needs NAME=VALUE, got {redact_text(repr(text))}")
                pairs[key.strip()] = item.strip()
        for key, item in pairs.items():
            _register_option_secrets(key, item)
        return pairs

    def show(self, value: dict[str, Any]) -> str:
        return ",".join(f"{key}={item}" for key, item in value.items())

    def allowed(self) -> str:
        return "NAME=VALUE, comma-separated"


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
    if not sep or not host or not _WHOLE.fullmatch(port_text) or not 0 <= int(port_text) <= 65535:
        raise ConfigError(
            f"{name} must be HOST:PORT, such as 127.0.0.1:8080 or 0.0.0.0:8080; got {value!r}"
        )
    return host, int(port_text)


@dataclass(frozen=True)
class HttpAddress(Kind[str]):
    metavar: ClassVar[str] = "HOST:PORT"

    def parse(self, value: object, name: str) -> str:
        parse_http_address(value, name)
        return str(value).strip()

    def allowed(self) -> str:
        return "HOST:PORT, [::1]:PORT"


@dataclass(frozen=True)
class Secret(Kind[str]):
    """A token: never echoed in errors, long enough not to be guessed."""

    shortest: int = 16
    metavar: ClassVar[str] = "TOKEN"

    def parse(self, value: object, name: str) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string")
        if not value.strip():
            # Set but empty is a mistake (a secret that failed to mount), not "no token".
            raise ConfigError(
                f"{name} is set but empty: give a token of at least {self.shortest} "
                "characters, or unset it"
            )
        if value != value.strip():
            raise ConfigError(f"{name} must not start or end with white space")
        if len(value) < self.shortest:
            raise ConfigError(
                f"{name} is too short ({len(value)} characters): a token needs at least "
                f"{self.shortest}"
            )
        return value

    def allowed(self) -> str:
        return f"at least {self.shortest} characters"


def parse_duration(value: object, name: str) -> float:
    """Seconds from a number or a string like ``250ms``, ``30s``, ``5m``, ``7d``."""
    return Duration().parse(value, name)


def duration_option(value: object, name: str, low: float, high: float) -> float:
    """A broker's or receiver's duration option (URL query, ``--option``, settings file) in the
    settings' syntax (``30``, ``250ms``, ``5m``): finite, within ``low`` to ``high`` seconds."""
    return Duration(high=high, positive=low > 0, low=low).parse(value, name)


def whole_seconds_option(value: object, name: str, low: int, high: int) -> int:
    """A duration option that the protocol carries in whole seconds (MQTT's keepalive and
    session expiry): ``90``, ``90s``, ``5m``; ``1.5s`` is refused rather than rounded."""
    seconds = duration_option(value, name, low, high)
    if seconds != int(seconds):
        raise ConfigError(f"{name} must be whole seconds; got {value!r}")
    return int(seconds)


def int_option(value: object, name: str, low: int, high: int) -> int:
    return Whole(low, high).parse(value, name)


def float_option(value: object, name: str, low: float, high: float) -> float:
    return Number(low, high).parse(value, name)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host``; a name other than localhost counts as public."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ----- declarations -------------------------------------------------------------------------

_DECLARATION = "outboxer.setting"


@dataclass(frozen=True)
class Declaration:
    """One setting, as :func:`setting` declared it on a field."""

    kind: Kind[Any]
    help: str
    #: The commands whose flags include it ("relay", "schema apply", …); every command reads
    #: it from the environment and the file.
    commands: tuple[str, ...]
    name: str = ""
    default: Any = None
    #: The default as the help shows it, when the value is computed (``host:pid:random``).
    default_text: str | None = None
    #: A flag without a value (``--exit-when-idle``).
    switch: bool = False
    #: Kept out of reprs; an empty environment variable is an error, not "unset".
    secret: bool = False
    #: A flag given several times, its values a list (``--topic a --topic b``).
    repeatable: bool = False
    #: The flag and the variable when the name alone would be vague (``--consumer-name``).
    flag_name: str | None = None
    env_name: str | None = None
    #: A ``[databases.NAME]`` table of the file may give it for its database alone.
    per_database: bool = False

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return self.env_name or ENV_PREFIX + self.name.upper()

    @property
    def key(self) -> str:
        """Its key in ``outboxer.toml``."""
        return self.name

    @property
    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        return "" if self.default is None else self.kind.show(self.default)

    def help_text(self) -> str:
        """The CLI's help: meaning, values, the real default, the environment variable."""
        details = [self.kind.allowed()] if self.kind.allowed() else []
        if self.shown_default:
            details.append(f"default {self.shown_default}")
        details.append(f"env {self.env}")
        return f"{self.help} ({'; '.join(details)})"


def setting(
    default: Any = None,
    *,
    kind: Kind[Any],
    help: str,
    commands: Sequence[str],
    default_factory: Any = None,
    default_text: str | None = None,
    switch: bool = False,
    secret: bool = False,
    repeatable: bool = False,
    flag: str | None = None,
    env: str | None = None,
    per_database: bool = False,
) -> Any:
    """A dataclass field that declares a setting (see the module's docstring)."""
    declared = Declaration(
        kind,
        help,
        tuple(commands),
        default_text=default_text,
        switch=switch,
        secret=secret,
        repeatable=repeatable,
        flag_name=flag,
        env_name=env,
        per_database=per_database,
    )
    metadata = {_DECLARATION: declared}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata, repr=not secret)
    return field(default=default, metadata=metadata, repr=not secret)


@functools.cache
def declarations(cls: type) -> tuple[Declaration, ...]:
    """The settings ``cls`` declares, in field order, each with its name and default."""
    result = []
    for item in dataclasses.fields(cls):
        declared = item.metadata.get(_DECLARATION)
        if isinstance(declared, Declaration):
            default = None if item.default is dataclasses.MISSING else item.default
            result.append(dataclasses.replace(declared, name=item.name, default=default))
    return tuple(result)


def add_flags(
    parser: argparse.ArgumentParser, cls: type, command: str, *, leave_out: Iterable[str] = ()
) -> None:
    """The flags of the settings of ``cls`` that ``command`` takes, but those named in
    ``leave_out``; unset flags are None."""
    left_out = frozenset(leave_out)
    for declared in declarations(cls):
        if command not in declared.commands or declared.name in left_out:
            continue
        help_text = declared.help_text().replace("%", "%%")
        if declared.switch:
            parser.add_argument(
                declared.flag, dest=declared.name, action="store_const", const=True, help=help_text
            )
        else:
            parser.add_argument(
                declared.flag,
                dest=declared.name,
                metavar=declared.kind.metavar,
                action="append" if declared.repeatable else "store",
                help=help_text,
            )


def flags_from_args(args: argparse.Namespace, cls: type) -> dict[str, object]:
    """The settings of ``cls`` given as flags (argparse's None: not given)."""
    return {
        declared.name: getattr(args, declared.name)
        for declared in declarations(cls)
        if getattr(args, declared.name, None) is not None
    }


def declared_values(
    cls: type,
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    file_values: Mapping[str, object],
    origin: str | None,
) -> dict[str, Any]:
    """Each setting of ``cls`` from the strongest source that gives it, parsed.

    An empty environment variable is an error naming it: a deploy template's
    ``OUTBOXER_LOCK_TIMEOUT=${LOCK_TIMEOUT}`` with the value missing must not quietly run
    with the default. A secret's kind words its own error.
    """
    known = {declared.name: declared for declared in declarations(cls)}
    given = {name: value for name, value in flags.items() if value is not None}
    if unknown := sorted(set(given) - set(known)):
        raise ConfigError(f"unknown settings {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for name, declared in known.items():
        from_env = environ.get(declared.env)
        if name in given:
            raw, source = given[name], declared.flag
        elif from_env is not None:
            if not from_env.strip() and not declared.secret:
                raise ConfigError(
                    f"{declared.env} is set but empty: unset it for the default, or give a value"
                )
            raw, source = from_env, declared.env
        elif declared.key in file_values:
            raw, source = file_values[declared.key], f"{origin}: {declared.key}"
        else:
            continue
        values[name] = declared.kind.parse(raw, source)
    return values


def _commands_text(commands: Iterable[str]) -> str:
    names = set(commands)
    if names == set(TABLE_COMMANDS):
        return "all but demo"
    if names == set(STREAM_COMMANDS):
        return "stream-relay and its subcommands"
    return ", ".join(sorted(names))


def settings_table(cls: type | None = None) -> str:
    """The README's table of settings (Markdown), from the declarations."""
    rows = [
        "| setting (TOML) | flag | environment | default | values | commands | meaning |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for declared in declarations(cls or Settings):
        cells = (
            f"`{declared.key}`",
            f"`{declared.flag}`",
            f"`{declared.env}`",
            declared.shown_default,
            declared.kind.allowed(),
            _commands_text(declared.commands),
            declared.help + (" (per database too)" if declared.per_database else ""),
        )
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


# ----- the settings -------------------------------------------------------------------------

#: ``outboxer stream-relay`` (log mode and the WAL outbox) and its subcommands.
STREAM_RELAY = "stream-relay"
STREAM_LETTERS = (
    "stream-relay dead-letters list",
    "stream-relay dead-letters replay",
    "stream-relay dead-letters purge",
)
STREAM_COMMANDS = (STREAM_RELAY, "stream-relay status", *STREAM_LETTERS)
#: The commands that publish a stream's messages: the relay, and its dead letters' replay.
STREAM_PUBLISHING = (STREAM_RELAY, "stream-relay dead-letters replay")

#: The commands that work on the outbox table: they take --db, --schema and --table.
TABLE_COMMANDS = (
    "relay",
    "serve",
    "schema apply",
    "schema sql",
    "schema migrate-partitioned",
    "status",
    "cleanup",
    "messages",
    "requeue",
    "purge",
    "replay",
    "enqueue",
    "consume",
    "dead-letters list",
    "dead-letters replay",
    "dead-letters purge",
    "keys rotate",
    "keys usage",
    "claim-check sweep",
    *STREAM_COMMANDS,
)
RELAY = ("relay",)
#: The commands that encrypt or decrypt payloads, and those that reach the claim-check store.
#: `consume` and `dead-letters replay` undo what these protect before the handler.
#: `replay` (and `serve`, whose POST /messages/replay is the same) re-protects each copy.
ENCRYPTING = (
    "enqueue",
    "keys rotate",
    "relay",
    "consume",
    "dead-letters replay",
    "replay",
    "serve",
    *STREAM_PUBLISHING,
)
CLAIM_CHECKING = (
    "enqueue",
    "replay",
    "serve",
    "keys rotate",
    "claim-check sweep",
    "cleanup",
    "relay",
    "consume",
    "dead-letters replay",
    "dead-letters purge",  # releases the holds of the purged dead letters' objects
)
RETENTION = ("relay", "cleanup")
#: The commands that make or keep the partitions of a partitioned outbox.
PARTITIONING = ("relay", "cleanup", "schema apply", "schema migrate-partitioned")
HTTP = ("relay", "serve", "consume")
#: The relay's settings that `outboxer consume` shares (outboxer.consume_cli has its own).
RELAY_AND_CONSUMER = ("relay", "consume")
#: Retry settings shared by the relay, the consumer and the stream relay.
RETRYING = (*RELAY_AND_CONSUMER, STREAM_RELAY)


def default_relay_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


#: The shortest interval or timeout taken: below a millisecond a poll spins a core and a
#: timeout fires before any round trip could answer ("0.001ms" is a typo, not a wish).
SHORTEST_INTERVAL = 0.001
#: The shortest lease: a batch must be claimed, published and settled (or renewed) within
#: it, or another relay recovers its rows while they are still being published.
SHORTEST_LEASE = 0.5


def _interval(
    help: str,
    default: float,
    commands: Sequence[str] = RELAY,
    *,
    per_database: bool = False,
    low: float = SHORTEST_INTERVAL,
) -> Any:
    return setting(
        default,
        kind=Duration(LONGEST_INTERVAL, positive=True, low=low),
        help=help,
        commands=commands,
        per_database=per_database,
    )


def _retention(help: str, default: float, low: float = 0.0) -> Any:
    return setting(
        default,
        kind=Duration(LONGEST_RETENTION, low=low),
        help=help,
        commands=RETENTION,
        per_database=True,
    )


#: Tables of the settings file that other commands read with :func:`file_table`
#: (``outboxer consume``'s ``[consumer]``, declared in outboxer.consume_cli);
#: ``load_settings`` lets them pass.
OTHER_COMMANDS_TABLES = frozenset({"consumer", "stream_relay"})

#: Publisher keywords the relay passes itself: a destination's ``routes`` and the
#: ``publish_timeout`` setting. They (and ``url``, the broker) are no destination options.
PASSED_BY_THE_RELAY = frozenset({"routes", "publish_timeout"})


def _shown_option(name: str, value: Any) -> Any:
    """A destination option's value for repr(): secret names masked at any depth (Kafka's
    ``config = { "sasl.password" = … }``), URLs redacted."""
    if is_secret_option(name):
        return MASK
    if isinstance(value, Mapping):
        return {key: _shown_option(str(key), item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_shown_option(name, item) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def _register_option_secrets(name: str, value: Any) -> None:
    """Register what ``_shown_option`` hides, so a library's error echoing it is masked too."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            _register_option_secrets(str(key), item)
    elif isinstance(value, list | tuple):
        for item in value:
            _register_option_secrets(name, item)
    elif isinstance(value, str):
        if is_secret_option(name):
            register_secret(value)
        elif "://" in value:
            register_url_secrets(value)


@dataclass(frozen=True)
class DestinationSettings:
    """Where one destination's copies go."""

    name: str
    broker: str
    #: ``full``: every envelope field; ``stripped``: what an outside consumer needs (see README).
    envelope: str = "full"
    routes: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    #: Encrypted rows: ``decrypt`` publishes the plaintext, ``forward`` the ciphertext
    #: (outboxer.payload_relay).
    payload: Literal["decrypt", "forward"] = "decrypt"

    def __repr__(self) -> str:
        options = {name: _shown_option(name, value) for name, value in self.options.items()}
        return (
            f"DestinationSettings(name={self.name!r}, broker={redact_url(self.broker)!r}, "
            f"envelope={self.envelope!r}, routes={dict(self.routes)!r}, options={options!r}, "
            f"payload={self.payload!r})"
        )

    def __post_init__(self) -> None:
        register_url_secrets(self.broker)
        for name, value in self.options.items():
            _register_option_secrets(name, value)
        if problem := destination_name_problem(self.name):
            # A relay of a name no writer can use would wait for ever (and on MySQL, whose
            # collation pads with spaces, 'orders ' would claim the rows of 'orders').
            raise ConfigError(f"destination {self.name!r:.80}: {problem}")
        if self.envelope not in ("full", "stripped"):
            raise ConfigError(f"destination {self.name!r}: envelope must be 'full' or 'stripped'")
        if self.payload not in ("decrypt", "forward"):
            raise ConfigError(
                f"destination {self.name!r}: payload must be 'decrypt' or 'forward'; "
                f"got {self.payload!r}"
            )
        if "://" not in self.broker:
            raise ConfigError(
                f"destination {self.name!r}: broker must be a URL such as amqp://host/; "
                f"got {redact_url(self.broker)!r}"
            )
        check_url(self.broker, f"destination {self.name!r}: broker")
        if misplaced := sorted(set(self.options) & (PASSED_BY_THE_RELAY | {"url"})):
            raise ConfigError(
                f"destination {self.name!r}: {', '.join(misplaced)} cannot be an option "
                "(routes and broker are keys of the destination, publish_timeout a setting)"
            )


@dataclass(frozen=True)
class DatabaseSettings:
    """One of the databases a relay serves (``[databases.NAME]``, or a repeated ``--db``).

    Its relay takes the process's settings, with ``overrides`` (the settings declared
    ``per_database``: schema, table, batch_size, …) and, when given, ``destinations``
    in place of the process's destinations.
    """

    name: str
    url: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    #: Its own destinations (``[databases.NAME.destinations.X]``); None: the process's.
    destinations: Mapping[str, DestinationSettings] | None = None

    def __post_init__(self) -> None:
        check_database_name(self.name, "database name")
        DatabaseUrl("postgresql://host/db").parse(self.url, f"database {self.name!r}: url")
        register_url_secrets(self.url)
        allowed = {declared.name: declared for declared in declarations(Settings)}
        for key, value in self.overrides.items():
            declared = allowed.get(key)
            if declared is None or not declared.per_database:
                raise ConfigError(
                    f"database {self.name!r}: {key} is not a setting of one database; "
                    f"those are {', '.join(sorted(per_database_settings()))}"
                )
            declared.kind.parse(value, f"database {self.name!r}: {key}")

    def __repr__(self) -> str:
        return (
            f"DatabaseSettings(name={self.name!r}, url={redact_url(self.url)!r}, "
            f"overrides={dict(self.overrides)!r}, destinations={self.destinations!r})"
        )


#: Database URL schemes by family: the drivers' variants of one server's URLs.
_URL_FAMILIES = {"postgres": "postgresql", "mariadb": "mysql"}
_DEFAULT_PORTS = {"postgresql": "5432", "mysql": "3306"}


def _hosts_and_ports(hosts: str, default_port: str) -> tuple[tuple[str, str], ...]:
    """``h1:5432,[::1]`` -> ``(("::1", "5432"), ("h1", "5432"))``: lower-cased, default port
    filled in, sorted (libpq tries a host list in order, but it is one cluster either way)."""
    pairs = []
    for host in hosts.split(","):
        if host.startswith("[") and "]" in host:
            name, _, rest = host[1:].partition("]")
            port = rest.removeprefix(":")
        elif ":" in host:
            name, _, port = host.rpartition(":")
        else:
            name, port = host, ""
        pairs.append((unquote(name).lower(), port or default_port))
    return tuple(sorted(pairs))


@dataclass(frozen=True)
class OutboxTarget:
    """Where an outbox table is, compared by meaning (see :func:`outbox_target`)."""

    family: str
    #: (host, port) pairs; a SQLite file's absolute path alone.
    hosts: tuple[tuple[str, str], ...]
    database: str
    #: ``schema.table`` on PostgreSQL, the table alone elsewhere.
    table: str

    def __str__(self) -> str:
        if self.family == "sqlite":
            return f"table {self.table} of SQLite file {self.database}"
        hosts = ",".join(
            f"[{host}]:{port}" if ":" in host and not host.startswith("unix:") else f"{host}:{port}"
            for host, port in self.hosts
        )
        hosts = hosts or "the default host"
        return f"table {self.table} of {self.family} database {self.database!r} on {hosts}"


def outbox_target(url: str, schema: str, table: str) -> OutboxTarget | None:
    """What a database URL, its schema and its table name on the server, compared by
    meaning, not by text: the scheme's family (``postgres://`` and ``postgresql+asyncpg://``
    are one), the hosts lower-cased with their default ports, the database, and the table
    (with its schema on PostgreSQL; MySQL and SQLite have none). Users, passwords and
    connection options (``application_name``, TLS, timeouts) play no part. None for a URL
    no outbox can share (``sqlite:///:memory:``) or of a scheme outboxer does not know.

    Host names are not resolved (a configuration is checked without the network):
    ``localhost`` and ``127.0.0.1``, or two names of one server, count as different servers.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower().partition("+")[0]
    family = _URL_FAMILIES.get(scheme, scheme)
    query = dict(parse_qsl(parts.query))
    netloc = parts.netloc.rpartition("@")[2]
    if family == "sqlite":
        path = url.split("://", 1)[1].removeprefix("/").split("?", 1)[0]
        if not path or path == ":memory:" or path.startswith("file:"):
            return None
        return OutboxTarget(family, (), os.path.normpath(os.path.abspath(unquote(path))), table)
    if family == "postgresql":
        # asyncpg's reading: the URL's own parts win, query parameters fill the gaps.
        hosts = netloc or query.get("host", "")
        if ":" not in netloc.rpartition("]")[2] and "port" in query:
            hosts = ",".join(f"{host}:{query['port']}" for host in hosts.split(","))
        database = unquote(parts.path.lstrip("/")) or query.get("dbname") or query.get("database")
        # Without one, the server's database is the user's name.
        user = unquote(parts.username or "") or query.get("user", "")
        return OutboxTarget(
            family,
            _hosts_and_ports(hosts, _DEFAULT_PORTS[family]),
            database or user,
            f"{schema}.{table}",
        )
    if family == "mysql":
        hosts = f"unix:{query['unix_socket']}" if "unix_socket" in query else netloc or "localhost"
        return OutboxTarget(
            family,
            _hosts_and_ports(hosts, _DEFAULT_PORTS[family]),
            unquote(parts.path.lstrip("/")),
            table,
        )
    return None


def check_distinct_outboxes(databases: Mapping[str, DatabaseSettings], settings: Settings) -> None:
    """ConfigError when two of a relay's databases are one outbox table (see outbox_target):
    two relays on one table, with every count of /metrics and /status twice."""
    seen: dict[OutboxTarget, str] = {}
    for name, database in databases.items():
        schema = database.overrides.get("schema", settings.schema)
        table = database.overrides.get("table", settings.table)
        target = outbox_target(database.url, schema, table)
        if target is None:
            continue
        if target in seen:
            raise ConfigError(
                f"databases {seen[target]!r} and {name!r} are the same outbox "
                f"({target}): list it once, or give one of them its own "
                "table or schema (host names are compared as written, not resolved)"
            )
        seen[target] = name


def per_database_settings() -> frozenset[str]:
    """The settings a ``[databases.NAME]`` table may give (besides url and destinations)."""
    return frozenset(d.name for d in declarations(Settings) if d.per_database)


@dataclass(frozen=True)
class Settings:
    """Every setting of the relay and the CLI, each declared once with its default."""

    db: str | None = setting(
        kind=DatabaseUrl("postgresql://host/db or sqlite:///file.db"),
        help="database URL; `relay`: repeat it (`--db URL --db URL`, or `--db NAME=URL`) to "
        "serve several databases in one process (the variable: the same, separated by spaces)",
        commands=TABLE_COMMANDS,
        repeatable=True,
    )
    #: Several databases by name, from ``[databases.NAME]`` tables of the file or a repeated
    #: ``--db``; empty when one ``db`` is given. See :meth:`database_settings`.
    databases: Mapping[str, DatabaseSettings] = field(default_factory=dict)
    database: str | None = setting(
        kind=DatabaseName(),
        help="the database this command works on when several are configured "
        "(`[databases.NAME]`, or db1, db2, … for a repeated `--db`); with one, the name "
        "metrics and logs give it",
        commands=TABLE_COMMANDS,
        default_text=DEFAULT_DATABASE,
    )
    #: The ``default`` destination's broker; it joins ``destinations`` as ``default``.
    broker: str | None = setting(
        kind=Url("amqp://host/"),
        help="broker URL of the `default` destination (`consume`: the broker to consume from)",
        commands=(*RELAY_AND_CONSUMER, *STREAM_PUBLISHING),
    )
    schema: str = setting(
        "outboxer",
        kind=Identifier("schema"),
        help="schema of the outbox table",
        commands=TABLE_COMMANDS,
        per_database=True,
    )
    table: str = setting(
        "outbox",
        kind=Identifier("table"),
        help="outbox table name",
        commands=TABLE_COMMANDS,
        per_database=True,
    )
    #: Destinations by name, from ``[destinations.NAME]`` tables of the file (and ``broker``).
    destinations: Mapping[str, DestinationSettings] = field(default_factory=dict)
    batch_size: int = setting(
        500, kind=Whole(1, 10_000), help="rows claimed per batch", commands=RELAY, per_database=True
    )
    #: 64 MiB: with `concurrency` loops, the relay holds up to that many claims of payloads
    #: at once; batch_size rows of large payloads (500 x 20 MB) got it killed for memory.
    claim_max_bytes: int = setting(
        64 * 1024 * 1024,
        kind=Whole(1, 1 << 40),
        default_text="67108864 (64 MiB)",
        help="payload bytes a claim takes at most: it stops taking rows once those it took "
        "reach this (at least one row: a larger payload is claimed alone)",
        commands=RELAY,
        per_database=True,
    )
    lock_timeout: float = _interval(
        "lease of a claimed batch, renewed while it is published: a relay that dies or stalls loses its rows after this",
        60.0,
        per_database=True,
        low=SHORTEST_LEASE,
    )
    max_attempts: int = setting(
        10,
        kind=Whole(1, 1_000_000),
        help="attempts before ABANDONED (`consume`, `stream-relay`: before a dead letter)",
        commands=RETRYING,
        per_database=True,
    )
    poll_interval: float = _interval(
        "fallback poll when no NOTIFY comes; a NOTIFY wakes the relay at once",
        1.0,
        per_database=True,
    )
    wake_on_commit_below: float = setting(
        300.0,
        kind=Number(0.0, 1_000_000.0),
        help="PostgreSQL: while the relay claims fewer messages/s than this, each commit "
        "wakes it (NOTIFY); above, it polls every few ms and writers skip the NOTIFY, "
        "which makes notifying commits wait for each other (0: always poll after work)",
        commands=RELAY,
        per_database=True,
    )
    #: 3 ms, not the 5 ms of old: at 1,000 commits/s, consumer p50 3.8 against 5.7 ms for
    #: 1.19 x the relay's CPU per message (bench/paced_relay.py --base-setting
    #: busy_poll_interval=5ms); 4 ms gave 4.7 ms for 1.09 x. Even a relay with no guarantees
    #: on the same drivers spends over 100 us of CPU a message at either poll
    #: (bench/floor_relay.py): latency is what the poll can still buy.
    busy_poll_interval: float = setting(
        0.003,
        kind=Duration(1.0, positive=True, low=SHORTEST_INTERVAL),
        help="PostgreSQL: at or above `wake_on_commit_below`, how soon after a claim that found "
        "work the relay looks again: shorter publishes sooner, in smaller batches, at more "
        "CPU per message (at 1,000 commits/s, 5ms: consumer p50 5.7 ms at 0.84 times the CPU "
        "of 3ms, p50 3.8 ms; bench/README.md)",
        commands=RELAY,
        per_database=True,
    )
    backoff_base: float = _interval("delay after the first failure", 1.0, RETRYING)
    backoff_multiplier: float = setting(
        2.0,
        kind=Number(1.0, 1000.0),
        help="growth of the delay per failure",
        commands=RETRYING,
    )
    backoff_max: float = _interval(
        "cap of the delay: jitter never exceeds it, and it caps a webhook's `Retry-After` too",
        300.0,
        RETRYING,
    )
    backoff_jitter: float = setting(
        0.25,
        kind=Number(0.0, 0.99),
        help="± fraction of random spread",
        commands=RETRYING,
    )
    published_retention: float = _retention("keep PUBLISHED rows this long", 7 * DAY)
    abandoned_retention: float = _retention("keep ABANDONED rows this long", 30 * DAY)
    #: At least an hour: below that (0 was taken) the cleanup deleted the entries of messages
    #: just applied, and the redelivery the inbox exists for (a crash between COMMIT and ack,
    #: seen again after the broker's ack_wait, claim_idle or session timeout) applied them
    #: twice. An hour is a floor, not a recommendation (docs/design/consumer.md: what the inbox remembers).
    inbox_retention: float = _retention(
        "keep inbox entries this long: longer than any redelivery can come late (a "
        "consumer's outage included); a message redelivered later is applied again",
        30 * DAY,
        low=3600.0,
    )
    cleanup_interval: float = _interval(
        "time between retention runs inside the relay", 300.0, per_database=True
    )
    cleanup_batch: int = setting(
        1000,
        kind=Whole(1, 1_000_000),
        help="rows deleted per retention statement",
        commands=RETENTION,
        per_database=True,
    )
    partitioned: bool = setting(
        False,
        kind=Boolean(),
        help="create the outbox table range-partitioned by time, retention dropping whole "
        "partitions (PostgreSQL; a new table: `schema migrate-partitioned` moves one)",
        commands=("schema apply", "schema sql"),
        switch=True,
    )
    partition_interval: float = setting(
        DAY,
        kind=Duration(LONGEST_INTERVAL, positive=True, low=3600.0),
        help="time range of each partition of a partitioned outbox, when it is created "
        "(later partitions keep the newest one's)",
        commands=("schema apply", "schema migrate-partitioned"),
    )
    partitions_ahead: int = setting(
        3,
        kind=Whole(1, 1000),
        help="how many partition ranges past now a partitioned outbox's partitions reach "
        "(made by the relay's cleanup and `outboxer cleanup`)",
        commands=PARTITIONING,
    )
    concurrency: int = setting(
        4,
        kind=Whole(1, 64),
        help="claim-publish-settle loops per destination",
        commands=RELAY,
        per_database=True,
    )
    publish_timeout: float = _interval(
        "how long to wait for broker confirms and connects", 30.0, (*RELAY, *STREAM_PUBLISHING)
    )
    shutdown_timeout: float = _interval(
        "how long a stopping relay lets its batches in flight finish; then it cuts them "
        "short, records what the broker answered and gives the rest back (a second SIGTERM "
        "or Ctrl-C does so at once)",
        20.0,
    )
    abandoned_blocks_key: bool = setting(
        False,
        kind=Boolean(),
        help="whether an ABANDONED message (`consume`, `stream-relay`: a dead letter) holds "
        "back the later messages of its key",
        commands=(*RELAY_AND_CONSUMER, "dead-letters replay", *STREAM_PUBLISHING),
        per_database=True,
    )
    exit_when_idle: bool = setting(
        False,
        kind=Boolean(),
        help="publish what is due (`consume`: apply what the broker holds), then exit",
        commands=RETRYING,
        switch=True,
    )
    relay_id: str = setting(
        kind=Text(200),  # MySQL's locked_by holds 255 characters
        help="name of this relay in `locked_by`",
        commands=RELAY,
        default_factory=default_relay_id,
        default_text="host:pid:random",
    )
    http: str | None = setting(
        kind=HttpAddress(),
        help="where the HTTP API (health, metrics, status, requeue, purge, replay, dashboard) "
        "listens",
        commands=(*HTTP, STREAM_RELAY),
        default_text="off",
    )
    http_allowed_hosts: tuple[str, ...] | None = setting(
        kind=HostNames(),
        help="names the HTTP API answers for (a request's Host) besides IP addresses and "
        "loopback names, `.example.com` for a domain and its names: a DNS-rebinding page "
        "sends its own name (unset: any name, on a loopback address loopback names only)",
        commands=(*HTTP, STREAM_RELAY),
        default_text="any (loopback: loopback names)",
    )
    http_token: str | None = setting(
        kind=Secret(16),
        help="bearer token the API's POST endpoints require; prefer the variable, flags show in `ps`",
        commands=HTTP,
        secret=True,
    )
    # ----- payload protection (outboxer.crypto, outboxer.claimcheck) -----
    encryption_keys: str | None = setting(
        kind=Secret(16),
        help="encryption keys as id=base64key,id=base64key (`outboxer keys generate` makes "
        "one); no flag: keys shown in `ps` are no secret",
        commands=(),
        secret=True,
    )
    encryption_key_file: str | None = setting(
        kind=Text(4096),
        help="TOML file of encryption keys ([keys] id = base64key, optional current = id), "
        "instead of encryption_keys",
        commands=(*ENCRYPTING, "keys usage"),
    )
    encryption_current_key: str | None = setting(
        kind=Text(64),
        help="id of the key new encryptions use; default the last key listed",
        commands=(*ENCRYPTING, "keys usage"),
    )
    subject_keys: str | None = setting(
        kind=Text(4096),
        help="directory of the per-subject secrets (crypto-shredding); shared by every "
        "writer and reader",
        commands=(*ENCRYPTING, "keys shred"),
    )
    claim_check_store: str | None = setting(
        kind=Url("file:///var/lib/outboxer/claims or s3://bucket/prefix?region=eu-west-1"),
        help="object store for payloads over claim_check_threshold",
        commands=CLAIM_CHECKING,
    )
    claim_check_threshold: int = setting(
        256 * 1024,
        kind=Whole(0, 2**31),
        help="payloads larger than this many bytes (after encryption) go to the claim-check store",
        commands=("enqueue",),
    )
    claim_check_put_timeout: float = setting(
        30.0,
        kind=Duration(LONGEST_INTERVAL, positive=True, low=SHORTEST_INTERVAL),
        help="a claim-check put not answered within this long fails: the enqueue (its "
        "transaction is the caller's to roll back), or `keys rotate`, which stops, or a "
        "replay, which rolls back",
        commands=("enqueue", "keys rotate", "replay", "serve"),
    )
    claim_check_read_timeout: float = setting(
        30.0,
        kind=Duration(LONGEST_INTERVAL, positive=True, low=SHORTEST_INTERVAL),
        help="`consume` fails a message retryably when the claim-check store has not "
        "returned its payload within this long (a store that hangs: a dead NFS mount); the "
        "sweep gives up a store call after it; `keys rotate` stops on a read not answered "
        "by then, and leaves objects it could not delete by then to the sweep; a replay "
        "rolls back; `dead-letters purge` leaves holds not released by then",
        commands=(
            "consume",
            "claim-check sweep",
            "cleanup",
            "relay",
            "keys rotate",
            "replay",
            "serve",
            "dead-letters purge",
        ),
    )
    claim_check_sweep_grace: float = setting(
        3600.0,
        kind=Duration(LONGEST_RETENTION),
        help="the sweep deletes unreferenced objects older than this: longer than any "
        "transaction that enqueues",
        commands=("claim-check sweep", "cleanup", "relay"),
    )
    rotation_batch: int = setting(
        500,
        kind=Whole(1, 100_000),
        help="rows re-encrypted per transaction by `keys rotate`",
        commands=("keys rotate",),
    )

    def __post_init__(self) -> None:
        # Settings built in Python pass the same checks as flags, variables and files.
        for declared in declarations(Settings):
            value = getattr(self, declared.name)
            if value is not None:
                object.__setattr__(self, declared.name, declared.kind.parse(value, declared.name))
        register_url_secrets(self.db)
        register_url_secrets(self.claim_check_store)
        register_secret(self.http_token)
        register_secret(self.encryption_keys)
        if self.broker is not None:
            destinations = dict(self.destinations)
            base = destinations.get(DEFAULT_DESTINATION)
            destinations[DEFAULT_DESTINATION] = (
                dataclasses.replace(base, broker=self.broker)
                if base
                else DestinationSettings(DEFAULT_DESTINATION, self.broker)
            )
            object.__setattr__(self, "destinations", destinations)
        if self.backoff_base > self.backoff_max:
            # Backoff's own message names its fields (base, cap), not the settings.
            raise ConfigError(
                f"backoff_base ({format_duration(self.backoff_base)}) must be at most "
                f"backoff_max ({format_duration(self.backoff_max)}): lower backoff_base or "
                "raise backoff_max"
            )
        self.backoff  # validates the combination (cap >= base, …)  # noqa: B018
        if self.databases:
            if self.db is not None:
                raise ConfigError(
                    "give one database (db) or several (databases), not both: "
                    f"db {redact_url(self.db)!r} and databases {', '.join(self.databases)}"
                )
            for name, database in self.databases.items():
                if name != database.name:
                    raise ConfigError(f"database {database.name!r} is filed as {name!r}")
            check_distinct_outboxes(self.databases, self)
            if self.database is not None and self.database not in self.databases:
                raise ConfigError(
                    f"--database {self.database!r} is none of the databases configured: "
                    f"{', '.join(self.databases)}"
                )

    def __repr__(self) -> str:
        """Every field, with the URLs' secrets masked and no token."""
        shown = []
        for item in dataclasses.fields(self):
            if not item.repr:
                continue
            value = getattr(self, item.name)
            if item.name in ("db", "broker", "claim_check_store") and value is not None:
                value = redact_url(value)
            shown.append(f"{item.name}={value!r}")
        return f"Settings({', '.join(shown)})"

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
        if self.databases:
            raise ConfigError(
                f"this command works on one database, and {len(self.databases)} are "
                f"configured ({', '.join(self.databases)}): choose one with --database NAME "
                f"(env {ENV_PREFIX}DATABASE)"
            )
        if not self.db:
            raise ConfigError("no database: pass --db URL or set OUTBOXER_DB")
        return self.db

    @property
    def database_name(self) -> str:
        """This (one) database's name: ``database``, else ``default``."""
        return self.database or DEFAULT_DATABASE

    @property
    def several_databases(self) -> bool:
        """Whether databases are named (``databases``): status, /health and /status then
        answer per database, even for one."""
        return bool(self.databases)

    def database_settings(self) -> dict[str, Settings]:
        """The settings of each database, by name: one database's settings each (no
        ``databases``, its ``db`` and overrides in place), or ``{name: self}`` for one db."""
        if not self.databases:
            return {self.database_name: self}
        return {name: self.for_database(name) for name in self.databases}

    def for_database(self, name: str) -> Settings:
        """The settings of the database ``name``: the process's, with its url, overrides and
        destinations in place."""
        if not self.databases:
            if name != self.database_name:
                raise ConfigError(
                    f"no database {name!r}: the one configured is {self.database_name}"
                )
            return self
        database = self.databases.get(name)
        if database is None:
            raise ConfigError(f"no database {name!r}; configured: {', '.join(self.databases)}")
        changes: dict[str, Any] = {**database.overrides, "db": database.url, "database": name}
        if database.destinations is not None:
            changes.update(destinations=database.destinations, broker=None)
        return dataclasses.replace(self, databases={}, **changes)


# ----- the file -----------------------------------------------------------------------------


def toml_type(value: object) -> str:
    """How TOML calls the type of ``value``, for error messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, datetime.date | datetime.time):
        return "a date or time"
    return type(value).__name__


def read_config_file(
    config_file: str | os.PathLike[str] | None, environ: Mapping[str, str]
) -> tuple[dict[str, Any], str | None]:
    """The settings table of the file (``--config``, ``OUTBOXER_CONFIG`` or ``./outboxer.toml``)
    and its path; ({}, None) when there is none. Every problem is a ConfigError."""
    variable = ENV_PREFIX + "CONFIG"
    if not config_file and variable in environ and not environ[variable].strip():
        # As every OUTBOXER_* variable: empty is a template's missing value, not "no file".
        raise ConfigError(f"{variable} is set but empty: unset it, or name a settings file")
    path = config_file or environ.get(variable) or None
    if path is None:
        if not Path(DEFAULT_CONFIG_FILE).is_file():
            return {}, None
        path = DEFAULT_CONFIG_FILE
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#x})"
        ) from None
    except ValueError:  # a NUL or a lone surrogate: no file system can name such a file
        raise ConfigError(f"config file name {str(path)!r} is not a usable path") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    table = document.get("outboxer", document)
    if not isinstance(table, dict):
        raise ConfigError(
            f"{path}: outboxer must be a table ([outboxer]) of settings, not {toml_type(table)}"
        )
    return table, str(path)


def file_table(file_values: Mapping[str, object], name: str, origin: str | None) -> dict[str, Any]:
    """The ``[name]`` table of the file's settings ({} when absent), for another command's
    settings (``[consumer]``); ConfigError when ``name`` is there but no table."""
    table = file_values.get(name, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"{origin}: {name} must be a table ([{name}]), not {toml_type(table)}")
    return dict(table)


def _destinations(raw: object, origin: str | None) -> dict[str, DestinationSettings]:
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{origin}: destinations must be a table of named destinations "
            f"([destinations.NAME]), not {toml_type(raw)}"
        )
    result = {}
    for name, spec in raw.items():
        where = f"{origin}: destination {name!r}"
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where} must be a table with a broker URL, not {toml_type(spec)}")
        if "broker" not in spec:
            raise ConfigError(f"{where} needs a broker URL")
        if unknown := sorted(set(spec) - {"broker", "envelope", "routes", "options", "payload"}):
            raise ConfigError(
                f"{where} has unknown keys {unknown}; "
                "known: broker, envelope, routes, options, payload"
            )
        broker, envelope = spec["broker"], spec.get("envelope", "full")
        routes, options = spec.get("routes", {}), spec.get("options", {})
        if not isinstance(broker, str):
            raise ConfigError(f"{where}: broker must be a URL string, not {toml_type(broker)}")
        if not isinstance(envelope, str):
            raise ConfigError(f"{where}: envelope must be 'full' or 'stripped'")
        if not isinstance(routes, Mapping) or not all(isinstance(v, str) for v in routes.values()):
            raise ConfigError(f"{where}: routes must map topics to names (strings)")
        if not isinstance(options, Mapping):
            raise ConfigError(f"{where}: options must be a table, not {toml_type(options)}")
        payload = spec.get("payload", "decrypt")
        result[name] = DestinationSettings(
            name, broker, envelope, dict(routes), dict(options), payload
        )
    return result


parse_destinations = _destinations  # public: outboxer.contrib.django reads OUTBOXER's


def _database_flags(values: object, source: str = "--db") -> dict[str, str] | str | None:
    """The ``--db`` flags: one URL (str), several databases by name, or None (not given).

    ``--db NAME=URL`` names its database; a plain ``--db URL`` among several is named by its
    place, ``db1``, ``db2``, … ``source`` names where they came from in errors.
    """
    if values is None:
        return None
    texts = [values] if isinstance(values, str) else values
    if not isinstance(texts, list | tuple) or not all(isinstance(t, str) for t in texts):
        raise ConfigError(f"{source} must be a URL or NAME=URL; got {redact_text(repr(values))}")
    if not texts:
        return None
    named = [split_named_url(text) for text in texts]
    if len(named) == 1 and named[0][0] is None:
        return named[0][1]
    urls: dict[str, str] = {}
    for place, (name, url) in enumerate(named, start=1):
        name = name or f"db{place}"
        if name in urls:
            raise ConfigError(f"{source}: two databases are named {name!r}")
        urls[name] = DatabaseUrl("postgresql://host/db").parse(url, f"{source} {name}")
    return urls


def _environment_databases(
    environ: Mapping[str, str],
) -> tuple[dict[str, str] | None, Mapping[str, str]]:
    """Databases named by the database variable (``OUTBOXER_DB``), as a repeated ``--db``
    names them: several ``NAME=URL`` (or plain URLs, named ``db1``, ``db2``, … by place)
    separated by white space, which a URL never holds unencoded; or one ``NAME=URL``.
    Returns them (None when the variable holds one plain URL, or nothing) and the
    environment without the variable, which then must not be read as one URL."""
    variable = _db_variable()
    entries = environ.get(variable, "").split()
    if not entries or (len(entries) == 1 and split_named_url(entries[0])[0] is None):
        return None, environ
    urls = _database_flags(entries, variable)
    assert isinstance(urls, dict)  # several entries, or one named: never a single URL
    return urls, _without_db_variable(environ)


def _db_variable() -> str:
    return next(d.env for d in declarations(Settings) if d.name == "db")


def _without_db_variable(environ: Mapping[str, str]) -> Mapping[str, str]:
    variable = _db_variable()
    return {key: value for key, value in environ.items() if key != variable}


def _databases(
    raw: object, origin: str | None, urls: Mapping[str, str] | None
) -> dict[str, DatabaseSettings]:
    """The ``[databases.NAME]`` tables; with ``urls`` (from ``--db``), the databases those
    name, each with its table's overrides if the file has one."""
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{origin}: databases must be a table of named databases "
            f"([databases.NAME] with a url), not {toml_type(raw)}"
        )
    known = {"url", "destinations", *sorted(per_database_settings())}
    declared = {d.name: d for d in declarations(Settings)}
    tables: dict[str, DatabaseSettings] = {}
    for name, spec in raw.items():
        where = f"{origin}: database {name!r}"
        check_database_name(name, where)
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where} must be a table with a url, not {toml_type(spec)}")
        if unknown := sorted(set(spec) - known):
            raise ConfigError(f"{where} has unknown keys {unknown}; known: {sorted(known)}")
        if urls is not None and name not in urls:
            continue  # the --db flags name the databases
        url = urls[name] if urls is not None else spec.get("url")
        if url is None:
            raise ConfigError(f"{where} needs a url (or pass --db {name}=URL)")
        overrides = {
            key: declared[key].kind.parse(value, f"{where}: {key}")
            for key, value in spec.items()
            if key not in ("url", "destinations")
        }
        destinations = (
            _destinations(spec["destinations"], where) if "destinations" in spec else None
        )
        tables[name] = DatabaseSettings(
            name, Url("postgresql://host/db").parse(url, f"{where}: url"), overrides, destinations
        )
    if urls is None:
        return tables
    # In the flags' order; a database no table names takes the process's settings.
    return {name: tables.get(name) or DatabaseSettings(name, url) for name, url in urls.items()}


def load_settings(
    flags: Mapping[str, object] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> Settings:
    """Merge the three sources; a value given in a stronger source wins.

    ``flags`` maps setting names (``batch_size``, ``broker``, …) to values or their text;
    None means not given.
    """
    environ = os.environ if environ is None else environ
    file_values, path = read_config_file(config_file, environ)
    known = {declared.key for declared in declarations(Settings)} | {"destinations", "databases"}
    known |= OTHER_COMMANDS_TABLES
    if unknown := sorted(set(file_values) - known):
        raise ConfigError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
    if "db" in file_values and "databases" in file_values:
        raise ConfigError(
            f"{path}: give db (one database) or [databases.NAME] tables (several), not both"
        )
    given = dict(flags or {})
    db_flags = _database_flags(given.pop("db", None))
    if db_flags is None:
        db_flags, environ = _environment_databases(environ)
    else:
        environ = _without_db_variable(environ)  # the flags name the database(s)
    if isinstance(db_flags, str):
        given["db"] = db_flags
    values = declared_values(Settings, given, environ, file_values, path)
    destinations = _destinations(file_values.get("destinations", {}), path)
    # The strongest source that names databases decides which: several --db flags, else
    # one --db, else OUTBOXER_DB (databases by name, or one URL), else the file's db or
    # its [databases.NAME] tables.
    databases: dict[str, DatabaseSettings] = {}
    if isinstance(db_flags, dict):
        values.pop("db", None)
        databases = _databases(file_values.get("databases", {}), path, db_flags)
    elif "db" not in values and "databases" in file_values:
        databases = _databases(file_values["databases"], path, None)
    settings = Settings(destinations=destinations, databases=databases, **values)
    if settings.databases and settings.database is not None:
        # One database picked (--database NAME): every command sees that one alone.
        return settings.for_database(settings.database)
    return settings


# ----- outboxer stream-relay ----------------------------------------------------------------


@dataclass(frozen=True)
class StreamSettings:
    """The settings of ``outboxer stream-relay`` of its own (the file's ``[stream_relay]``
    table); it shares ``db``, ``broker``, ``schema``, ``table``, ``max_attempts``,
    ``backoff_*``, ``abandoned_blocks_key``, ``publish_timeout``, ``exit_when_idle``,
    ``http`` and the payload protection settings with the relay. Their variables are
    ``OUTBOXER_STREAM_<NAME>``: ``batch_size`` and ``poll_interval`` mean something else
    for the table relay."""

    mode: str | None = setting(
        kind=Choice(("log", "wal")),
        help="the outbox mode the stream is in: log (a log reader) or wal (a replication slot)",
        commands=STREAM_COMMANDS,
        env="OUTBOXER_STREAM_MODE",
    )
    destination: str | None = setting(
        kind=Text(63),
        help="the stream: a log reader's name, or the destination whose slot is "
        "`<slot_prefix>_<destination>`",
        commands=STREAM_COMMANDS,
        env="OUTBOXER_STREAM_DESTINATION",
        default_text="default (`status`, `dead-letters list`: every one)",
    )
    slot_prefix: str | None = setting(
        kind=Text(63),
        help="wal: slot names are `<slot_prefix>_<destination>`",
        commands=STREAM_COMMANDS,
        env="OUTBOXER_STREAM_SLOT_PREFIX",
        default_text="outboxer_SCHEMA_TABLE",
    )
    apply_schema: bool = setting(
        False,
        kind=Boolean(),
        help="create or upgrade the stream's tables first (log: the log's too; wal: the "
        "publication)",
        commands=(STREAM_RELAY,),
        env="OUTBOXER_STREAM_APPLY_SCHEMA",
        switch=True,
    )
    create_slot: bool = setting(
        False,
        kind=Boolean(),
        help="wal: create the destination's slot (and the stream's tables) if missing",
        commands=(STREAM_RELAY,),
        env="OUTBOXER_STREAM_CREATE_SLOT",
        switch=True,
    )
    retention_days: int | None = setting(
        kind=Whole(0, 36500),
        help="log: drop the daily partitions older than this, once read by every reader",
        commands=(STREAM_RELAY,),
        env="OUTBOXER_STREAM_RETENTION_DAYS",
        default_text="keep all",
    )
    batch_size: int = setting(
        500,
        kind=Whole(1, 10_000),
        help="entries read (and published) per round",
        commands=(STREAM_RELAY,),
        env="OUTBOXER_STREAM_BATCH_SIZE",
    )
    poll_interval: float = setting(
        0.2,
        kind=Duration(LONGEST_INTERVAL, positive=True, low=SHORTEST_INTERVAL),
        help="wait after a read that found nothing",
        commands=(STREAM_RELAY,),
        env="OUTBOXER_STREAM_POLL_INTERVAL",
    )
    probe_interval: float = setting(
        10.0,
        kind=Duration(LONGEST_INTERVAL, positive=True, low=SHORTEST_INTERVAL),
        help="with --http: how often the relay counts its backlog for /metrics (WAL: by "
        "decoding up to 100,000 changes of its slot)",
        commands=(STREAM_RELAY,),
        env="OUTBOXER_STREAM_PROBE_INTERVAL",
    )

    def __post_init__(self) -> None:
        for declared in declarations(StreamSettings):
            value = getattr(self, declared.name)
            if value is not None:
                object.__setattr__(self, declared.name, declared.kind.parse(value, declared.name))
        if self.retention_days is not None and self.mode == "wal":
            raise ConfigError("retention_days is for mode log (a slot keeps no partitions)")
        if self.create_slot and self.mode == "log":
            raise ConfigError("create_slot is for mode wal (a log reader needs no slot)")

    def require_mode(self) -> str:
        if self.mode is None:
            raise ConfigError(
                "no mode: pass --mode log or --mode wal, set OUTBOXER_STREAM_MODE, or "
                "[stream_relay] mode"
            )
        return self.mode


def load_stream_settings(
    flags: Mapping[str, object],
    stream_flags: Mapping[str, object],
    *,
    environ: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> tuple[Settings, StreamSettings]:
    """The shared settings (``load_settings``) and the stream relay's own (``[stream_relay]``)."""
    environ = os.environ if environ is None else environ
    settings = load_settings(flags, environ=environ, config_file=config_file)
    file_values, origin = read_config_file(config_file, environ)
    table = file_table(file_values, "stream_relay", origin)
    known = {declared.key for declared in declarations(StreamSettings)}
    if unknown := sorted(set(table) - known):
        raise ConfigError(
            f"{origin} [stream_relay]: unknown settings {unknown}; known: {sorted(known)}"
        )
    values = declared_values(
        StreamSettings, stream_flags, environ, table, f"{origin} [stream_relay]"
    )
    return settings, StreamSettings(**values)
