"""TLS options of a MySQL URL, as the ``ssl`` argument (an SSLContext) that PyMySQL and
aiomysql both take.

``mysql://app@db.example/orders?ssl_ca=/etc/ssl/db-ca.pem&ssl_cert=…&ssl_key=…&ssl_mode=…``

``ssl_mode`` takes the MySQL client's names (``--ssl-mode``), case-insensitive:

* ``disabled``: no TLS (as without any of these options);
* ``required``: TLS, the server's certificate unchecked;
* ``verify_ca``: TLS, the certificate signed by ``ssl_ca`` (or a system CA);
* ``verify_identity``: as ``verify_ca``, and issued to the URL's host.

Without ``ssl_mode``: ``verify_identity`` when ``ssl_ca`` is given, else ``required`` when a
client certificate is (PyMySQL's own defaults for its ``ssl`` dict). A file that cannot be
read, or a mode with options it contradicts, is a ConfigError when the URL is parsed, not a
failure at the first connect. Neither driver refuses a server without TLS support: TLS is
only as required as the server enforces (``REQUIRE SSL`` on the account).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from typing import Any

from outboxer.errors import ConfigError

#: The URL query options this module reads.
SSL_OPTIONS = ("ssl_mode", "ssl_ca", "ssl_cert", "ssl_key")
SSL_MODES = ("disabled", "required", "verify_ca", "verify_identity")


def ssl_args(options: Mapping[str, str]) -> dict[str, Any]:
    """The ``connect`` arguments for the URL's ``ssl_*`` options: ``{"ssl": context}``, or
    none (no option, or ``ssl_mode=disabled``)."""
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
        return {}
    if key and not cert:
        raise ConfigError("MySQL URL option ssl_key needs ssl_cert (the client certificate)")
    if ca and mode == "required":
        # The MySQL client ignores the CA in this mode too; refused rather than silently
        # skipping the verification the CA was given for.
        raise ConfigError(
            "MySQL URL option ssl_ca with ssl_mode=required: the CA would not be checked; "
            "use ssl_mode=verify_ca or verify_identity"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if mode == "required":
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
        _load(lambda: context.load_cert_chain(cert, key), "ssl_cert/ssl_key", paths)
    return {"ssl": context}


def _load(load: Callable[[], object], option: str, path: str) -> None:
    try:
        load()
    except (OSError, ssl.SSLError) as exc:  # FileNotFoundError, a file that is no PEM …
        raise ConfigError(f"MySQL URL option {option}: cannot load {path!r}: {exc}") from exc
