"""The TLS files of a broker URL (MQTT, NATS): ``cafile``, ``certfile`` and ``keyfile``, as
aio-pika names them for ``amqps://``.

* ``cafile``: the CA certificates (PEM) the broker's certificate must chain to, in place of
  the system's (a private CA); the broker's host name is checked either way;
* ``certfile``, ``keyfile``: a client certificate (PEM), for brokers that authenticate
  clients by certificate; ``keyfile`` may be left out when ``certfile`` holds the key too.

The files are loaded when the URL is read: a path that cannot be read, or a file that is no
certificate or key, is a ConfigError naming the option, not an outage at every connect. An
encrypted key is refused rather than prompting for its passphrase on the terminal.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping

from outboxer.errors import ConfigError

#: The URL query options (and keywords) this module reads.
TLS_FILE_OPTIONS = ("cafile", "certfile", "keyfile")


def tls_files(options: Mapping[str, str], given: Mapping[str, str | None]) -> dict[str, str]:
    """The TLS file options set, each from its keyword in ``given`` or else the URL's
    ``options`` (a keyword wins, as for the other options); empty values are unset."""
    files: dict[str, str] = {}
    for name in TLS_FILE_OPTIONS:
        value = given.get(name)
        if value is None:
            value = options.get(name)
        if value:
            files[name] = value
    return files


def client_context(
    broker: str,
    files: Mapping[str, str],
    *,
    names: tuple[str, str, str] = TLS_FILE_OPTIONS,
    password: str | None = None,
) -> ssl.SSLContext:
    """A client context that verifies the broker's certificate and host name: against
    ``cafile`` only when given, else the system's CA certificates. ``names``: the options
    as the broker's URL spells them (Redis: ``ssl_ca_certs`` …), for the messages;
    ``password``: the key's passphrase, where the URL can give one."""
    cafile, certfile, keyfile = (files.get(name) for name in TLS_FILE_OPTIONS)
    ca_name, cert_name, key_name = names
    if keyfile and not certfile:
        raise ConfigError(f"{broker} option {key_name} needs {cert_name} (the certificate)")
    try:
        context = ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:  # FileNotFoundError, a file that is no PEM …
        raise ConfigError(f"{broker} option {ca_name}: cannot load {cafile!r}: {exc}") from exc
    if certfile:
        try:
            # Never None: an encrypted key without its passphrase fails here, instead of
            # OpenSSL asking for it on the terminal (a service has none; it would hang).
            context.load_cert_chain(certfile, keyfile, password=password or "")
        except (OSError, ssl.SSLError) as exc:
            paths = f"{certfile!r}, {keyfile!r}" if keyfile else repr(certfile)
            encrypted = "" if password else " (an encrypted key is not supported)"
            raise ConfigError(
                f"{broker} option {cert_name}/{key_name}: cannot load {paths}{encrypted}: {exc}"
            ) from exc
    return context
