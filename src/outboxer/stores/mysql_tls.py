"""TLS options of a MySQL URL, as the ``ssl`` argument (an SSLContext) that PyMySQL and
aiomysql both take.

``mysql://app@db.example/orders?ssl_ca=/etc/ssl/db-ca.pem&ssl_cert=…&ssl_key=…&ssl_mode=…``

``ssl_mode`` takes the MySQL client's names (``--ssl-mode``), case-insensitive:

* ``disabled``: no TLS, even where the server offers it (PyMySQL 1.2 tries TLS whenever it
  is given no TLS argument: ``ssl_disabled`` is passed);
* ``preferred``: TLS, the server's certificate unchecked, when the server's greeting offers
  it; plaintext, without a refusal, when it does not (the MySQL client's default, and what
  a Django project's ``PREFERRED`` means): on aiomysql and PyMySQL alike (see
  :func:`_settle_preferred`);
* ``required``: TLS, the server's certificate unchecked;
* ``verify_ca``: TLS, the certificate signed by ``ssl_ca`` (or a system CA);
* ``verify_identity``: as ``verify_ca``, and issued to the URL's host.

Without ``ssl_mode``: ``verify_identity`` when ``ssl_ca`` is given, else ``required`` when a
client certificate is (PyMySQL's own defaults for its ``ssl`` dict). A file that cannot be
read, or a mode with options it contradicts, is a ConfigError when the URL is parsed, not a
failure at the first connect.

Every mode but ``disabled`` and ``preferred`` refuses a connection that is not encrypted (a
server with TLS off, or something in between that strips the TLS capability from the
server's greeting):
aiomysql, and PyMySQL before 1.2, would carry on in plaintext. The refusal comes on the
server's greeting, before the login goes out (it names the user and, with
``mysql_clear_password``, which a man in the middle can ask for, carries the password
itself): PyMySQL connections through :func:`connect_pymysql`, aiomysql's through the hook
:func:`hook_aiomysql` installs (aiomysql's pool makes its connections itself, with no
connection class to choose); the store checks each connection it takes again
(:func:`refuse_plaintext`). As with the MySQL client, a Unix socket counts as secure: it
does not leave the host.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from typing import Any

from outboxer.errors import ConfigError, InsecureConnectionError

#: pymysql.constants.CLIENT.SSL: the server's greeting offers TLS.
_CLIENT_SSL = 1 << 11


class _TLSContext(ssl.SSLContext):
    """The context of one URL, knowing its ``ssl_mode`` for the refusal's message."""

    ssl_mode: str


#: The URL query options this module reads.
SSL_OPTIONS = ("ssl_mode", "ssl_ca", "ssl_cert", "ssl_key")
SSL_MODES = ("disabled", "preferred", "required", "verify_ca", "verify_identity")
#: The modes that check no certificate (a CA given with them would be ignored).
_UNVERIFIED = ("preferred", "required")


def ssl_args(options: Mapping[str, str]) -> dict[str, Any]:
    """The PyMySQL ``connect`` arguments for the URL's ``ssl_*`` options: ``{"ssl": context}``,
    ``{"ssl_disabled": True}`` for ``ssl_mode=disabled`` (aiomysql, which takes no such
    argument, uses TLS only when given a context), or none without any option."""
    given = {name: value for name, value in options.items() if name in SSL_OPTIONS}
    if not given:
        return {}
    ca, cert, key = given.get("ssl_ca"), given.get("ssl_cert"), given.get("ssl_key")
    mode = given.get("ssl_mode", "verify_identity" if ca else "required").lower()
    if mode not in SSL_MODES:
        raise ConfigError(
            f"MySQL URL option ssl_mode={given['ssl_mode']!r}; known: {', '.join(SSL_MODES)}"
        )
    if mode == "disabled":
        if ca or cert or key:
            raise ConfigError(
                "MySQL URL option ssl_mode=disabled contradicts ssl_ca/ssl_cert/ssl_key"
            )
        # Not {}: PyMySQL 1.2 would try TLS as soon as the greeting offers it (its own
        # PREFERRED default), or take ssl-* from a read_default_file.
        return {"ssl_disabled": True}
    if key and not cert:
        raise ConfigError("MySQL URL option ssl_key needs ssl_cert (the client certificate)")
    if ca and mode in _UNVERIFIED:
        # The MySQL client ignores the CA in these modes too; refused rather than silently
        # skipping the verification the CA was given for.
        raise ConfigError(
            f"MySQL URL option ssl_ca with ssl_mode={mode}: the CA would not be checked; "
            "use ssl_mode=verify_ca or verify_identity"
        )
    context = _TLSContext(ssl.PROTOCOL_TLS_CLIENT)
    context.ssl_mode = mode
    if mode in _UNVERIFIED:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.check_hostname = mode == "verify_identity"
        if ca:  # the one trust anchor, as with the MySQL client: not the system's as well
            _load(lambda: context.load_verify_locations(cafile=ca), "ssl_ca", ca)
        else:
            context.load_default_certs()
    if cert:
        paths = f"{cert}, {key}" if key else cert
        # An empty passphrase: an encrypted key fails here, instead of OpenSSL asking for
        # the passphrase on the terminal (a service has none; it would hang).
        _load(lambda: context.load_cert_chain(cert, key, password=""), "ssl_cert/ssl_key", paths)
    return {"ssl": context}


def _load(load: Callable[[], object], option: str, path: str) -> None:
    try:
        load()
    except (OSError, ssl.SSLError) as exc:  # FileNotFoundError, a file that is no PEM …
        raise ConfigError(f"MySQL URL option {option}: cannot load {path!r}: {exc}") from exc


def refuse_plaintext(args: Mapping[str, Any], conn: Any) -> None:
    """InsecureConnectionError if ``args`` (``mysql_connect_args``) ask for TLS and ``conn``,
    a PyMySQL or aiomysql connection past the server's greeting, is not encrypted. No round
    trip: both drivers negotiate TLS exactly when they were given a context and the
    greeting's capability flags offer it."""
    context = args.get("ssl")
    if not isinstance(context, _TLSContext) or context.ssl_mode == "preferred" or conn.unix_socket:
        return
    if conn.server_capabilities & _CLIENT_SSL:
        return
    raise InsecureConnectionError(
        f"MySQL server {conn.host}:{conn.port} does not offer TLS, and ssl_mode="
        f"{context.ssl_mode} refuses an unencrypted connection (TLS is off on the server, "
        "or something in between removed it)"
    )


def _settle_preferred(context: object, conn: Any) -> bool:
    """For ``ssl_mode=preferred``, past the server's greeting and before the login: ask for
    TLS (CLIENT_SSL in the login's flags) exactly when the greeting offers it. Both drivers
    set CLIENT_SSL in ``client_flag`` when given a context, whatever the server offers:
    aiomysql then logs in in plaintext with the flag set (a server with TLS on, its
    CLIENT_SSL stripped on the way, takes that as "TLS follows" and fails the handshake),
    PyMySQL 1.2 refuses ("SSL is required") and earlier releases log in as aiomysql does.
    Returns whether TLS is to be used (true for the other modes), for PyMySQL's ``ssl``
    switch. A per-connection attribute test, no round trip."""
    if not isinstance(context, _TLSContext) or context.ssl_mode != "preferred":
        return True
    offered = bool(conn.server_capabilities & _CLIENT_SSL)
    flags = conn.client_flag
    conn.client_flag = flags | _CLIENT_SSL if offered else flags & ~_CLIENT_SSL
    return offered


def connect_pymysql(args: Mapping[str, Any]) -> Any:
    """``pymysql.connect(**args)``, refusing an unencrypted connection (see
    :func:`refuse_plaintext`) before the credentials go out when ``args`` ask for TLS."""
    import pymysql

    if not isinstance(args.get("ssl"), _TLSContext):
        return pymysql.connect(**args)
    conn = _pymysql_class()(**args, defer_connect=True)
    conn.refuse_plaintext_args = args
    conn.connect()
    try:
        # Again after the login, in case a PyMySQL release no longer calls the hook.
        refuse_plaintext(args, conn)
    except BaseException:
        conn.close()
        raise
    return conn


_PYMYSQL_CLASS: Any = None


def _pymysql_class() -> Any:
    """A PyMySQL Connection that checks the greeting before sending the login: the check
    cannot go after ``connect`` only, as the login may carry the password itself (a server,
    or a man in the middle, can ask for ``mysql_clear_password``)."""
    global _PYMYSQL_CLASS
    if _PYMYSQL_CLASS is None:
        from pymysql.connections import Connection

        class _Connection(Connection):  # type: ignore[misc]
            refuse_plaintext_args: Mapping[str, Any] = {}

            def _request_authentication(self) -> None:
                # PyMySQL negotiates TLS only while ``ssl`` is true: set at each connect, as
                # a reconnect (ping(reconnect=True)) goes through the same object.
                self.ssl = _settle_preferred(self.refuse_plaintext_args.get("ssl"), self)
                refuse_plaintext(self.refuse_plaintext_args, self)
                super()._request_authentication()

        _PYMYSQL_CLASS = _Connection
    return _PYMYSQL_CLASS


_AIOMYSQL_HOOKED = False


def hook_aiomysql() -> None:
    """Make aiomysql refuse an unencrypted connection before it sends the login, as
    :func:`connect_pymysql` does for PyMySQL (for ``ssl_mode=preferred``: ask for TLS only
    when the greeting offers it, see :func:`_settle_preferred`). aiomysql's pool creates its
    connections with ``aiomysql.connection.Connection`` itself, so the check goes into that class's
    ``_request_authentication`` (the step right after the greeting is read); it acts only on
    the connections given an outboxer context (a URL with TLS options); every other
    aiomysql connection in the process is left as it was. Idempotent."""
    global _AIOMYSQL_HOOKED
    if _AIOMYSQL_HOOKED:
        return
    from aiomysql.connection import Connection

    authenticate = Connection._request_authentication

    async def _request_authentication(self: Any) -> None:
        _settle_preferred(self._ssl_context, self)
        refuse_plaintext({"ssl": self._ssl_context}, self)
        await authenticate(self)

    Connection._request_authentication = _request_authentication
    _AIOMYSQL_HOOKED = True
