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
def queries(dialect: str, file: str = "queries.sql") -> dict[str, str]:
    """All named blocks of ``sql/<dialect>/queries.sql`` (or of another file there)."""
    text = resources.files("outboxer.stores").joinpath("sql", dialect, file).read_text("utf-8")
    parts = _BLOCK.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def admin_queries(dialect: str) -> dict[str, str]:
    """The blocks of ``sql/<dialect>/admin.sql``, its ``filter`` block put in for ``{filter}``
    (so every operation matches rows by one and the same condition)."""
    blocks = queries(dialect, "admin.sql")
    condition = "(" + strip_comments(blocks["filter"]) + ")"
    return {
        name: sql.replace("{filter}", condition) for name, sql in blocks.items() if name != "filter"
    }


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


@functools.cache
def migrations(dialect: str, layout: str | None = None) -> tuple[Migration, ...]:
    """The migration chain of ``dialect``, or of one of its table layouts.

    A layout (``sql/<dialect>/<layout>/``) runs the dialect's chain with its own files in
    place of those of the same version; a file of the layout that holds no statement (only
    comments saying why) drops that version from the layout's chain: it is neither run nor
    recorded. Migrations added to the dialect later join every layout's chain unless the
    layout replaces them.
    """
    chain = {m.version: m for m in _read_migrations(dialect, "migrations")}
    if layout is not None:
        for replacement in _read_migrations(dialect, layout):
            if statements(replacement.sql):
                chain[replacement.version] = replacement
            else:
                chain.pop(replacement.version, None)
    return tuple(sorted(chain.values(), key=lambda m: m.version))


def _read_migrations(dialect: str, folder_name: str) -> list[Migration]:
    folder = resources.files("outboxer.stores").joinpath("sql", dialect, folder_name)
    if not folder.is_dir():  # a mode without tables of its own (the WAL outbox)
        return []
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append(
                Migration(version, entry.name.removesuffix(".sql"), entry.read_text("utf-8"))
            )
    return found


#: ``CREATE TABLE IF NOT EXISTS {token} (``: a table that a migration takes over if it exists
#: (one inbox and one dead-letter table per schema, shared by every outbox table in it).
_ADOPTED = re.compile(r"CREATE\s+TABLE\s+IF\s+NOT\s+EXISTS\s+\{(\w+)\}\s*\(", re.IGNORECASE)
#: Lines of a CREATE TABLE's body that declare no column.
_NOT_A_COLUMN = frozenset({"PRIMARY", "KEY", "INDEX", "UNIQUE", "CONSTRAINT", "CHECK", "FOREIGN"})


def adopted_tables(script: str) -> dict[str, tuple[str, ...]]:
    """The tables ``script`` creates only if missing (by token), with the columns it gives
    them: a table that exists under that name must have them all, or it is someone else's.

    Reads the migrations' own layout: one column or constraint per line, constraints in
    upper case, the body closed by a line starting with ``)``."""
    found: dict[str, tuple[str, ...]] = {}
    text = strip_comments(script)
    for match in _ADOPTED.finditer(text):
        columns: list[str] = []
        for line in text[match.end() :].splitlines()[1:]:
            line = line.strip()
            if line.startswith(")"):
                break
            word = line.split(None, 1)[0] if line else ""
            # Constraints are written in upper case, columns in lower case or quoted (`key`).
            if word and word not in _NOT_A_COLUMN:
                columns.append(word.strip('`"').lower())
        found[match.group(1)] = tuple(columns)
    return found


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_mysql(name: str) -> str:
    """MySQL quotes names with backquotes (double quotes only under ANSI_QUOTES)."""
    return "`" + name.replace("`", "``") + "`"


def table_name(dialect: str, schema: str, name: str) -> str:
    """A table as the SQL of ``dialect`` names it: schema-qualified in PostgreSQL only.

    SQLite has no schemas and MySQL's schemas are databases: there the table lives in the
    database the connection uses, and the schema setting plays no part.
    """
    if dialect == "sqlite":
        return quote_ident(name)
    if dialect == "mysql":
        return quote_mysql(name)
    return f"{quote_ident(schema)}.{quote_ident(name)}"


def strip_comments(sql: str) -> str:
    """Drop whole-line ``--`` comments: they document the SQL files, the server needs none.

    PyMySQL and aiomysql turn ``executemany`` of an INSERT into one multi-row statement
    only when the statement starts with INSERT.
    """
    return "\n".join(
        line for line in sql.splitlines() if not line.lstrip().startswith("--")
    ).strip()


def statements(script: str) -> list[str]:
    """Split a migration into statements (our migrations hold no ';' inside literals)."""
    return [part.strip() for part in strip_comments(script).split(";") if part.strip()]


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
