"""The TLS files named in a PostgreSQL URL (libpq's ``sslrootcert``, ``sslcert``, ``sslkey``,
``sslcrl``), checked when the store is made.

asyncpg and psycopg read them at each connect; asyncpg's error for a missing one names
neither the file nor the option ("[Errno 2] No such file or directory"), and the relay took
it for an outage, retried for ever. Only readability is checked here: the drivers parse the
files, and libpq's own checks (a key readable by others …) stay theirs.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

from outboxer.errors import ConfigError

PG_TLS_FILES = ("sslrootcert", "sslcert", "sslkey", "sslcrl")


def check_tls_files(url: str) -> None:
    """ConfigError naming the option and the path when a TLS file of ``url`` cannot be read."""
    for name, path in parse_qsl(urlsplit(url).query):
        # "system": the system's CA store (libpq 16, asyncpg), no file.
        if name not in PG_TLS_FILES or not path or (name == "sslrootcert" and path == "system"):
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:  # missing, a directory, no permission
            reason = exc.strerror or type(exc).__name__
            raise ConfigError(
                f"PostgreSQL URL option {name}: cannot read {path!r}: {reason}"
            ) from None
