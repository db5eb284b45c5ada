"""SQL lives in ``sql/<dialect>/`` as files with named blocks, loaded once per dialect.

A block starts with a line ``-- name: NAME``. Parameters are written ``:name`` and
converted to each driver's style; ``{outbox}``-style tokens become quoted names.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources

_BLOCK = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
# ``:name`` but not the second colon of ``::type`` casts, nor times like 12:30.
_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


@functools.cache
def queries(dialect: str) -> dict[str, str]:
    """All named blocks of ``sql/<dialect>/queries.sql``."""
    text = resources.files("outboxer.stores").joinpath("sql", dialect, "queries.sql").read_text("utf-8")
    parts = _BLOCK.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


@functools.cache
def migrations(dialect: str) -> tuple[Migration, ...]:
    folder = resources.files("outboxer.stores").joinpath("sql", dialect, "migrations")
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append(Migration(version, entry.name.removesuffix(".sql"), entry.read_text("utf-8")))
    return tuple(sorted(found, key=lambda m: m.version))


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def render(sql: str, tokens: dict[str, str]) -> str:
    for token, value in tokens.items():
        sql = sql.replace("{" + token + "}", value)
    return sql


def to_pyformat(sql: str) -> str:
    """``:name`` -> ``%(name)s`` (psycopg, PyMySQL); literal ``%`` doubled."""
    return _PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))


def to_numbered(sql: str) -> tuple[str, tuple[str, ...]]:
    """``:name`` -> ``$1`` (asyncpg); returns the parameter names in ``$n`` order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PARAM.sub(number, sql), tuple(names)


def params_of(sql: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_PARAM.findall(sql)))
