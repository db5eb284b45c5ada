"""``ssl_mode=preferred`` in a MySQL URL (the MySQL client's default: TLS when the server
offers it, plaintext otherwise, the certificate unchecked), and Django's ``PREFERRED``,
which outboxer mapped to ``required``: a project whose development server has TLS off
saw its relay and consumers refused (InsecureConnectionError) while Django connected."""

from __future__ import annotations

import ssl

import pytest

from outboxer.errors import ConfigError
from outboxer.stores.mysql import mysql_connect_args

URL = "mysql://app@db.example:3306/orders"


@pytest.mark.parametrize("mode", ["preferred", "PREFERRED"])
def test_preferred_is_a_known_mode_with_an_unverified_context(mode: str) -> None:
    made = mysql_connect_args(f"{URL}?ssl_mode={mode}")["ssl"]
    assert isinstance(made, ssl.SSLContext)
    assert (made.verify_mode, made.check_hostname) == (ssl.CERT_NONE, False)


def test_preferred_with_a_ca_is_refused_as_required_is() -> None:
    # The MySQL client checks no certificate in PREFERRED: the CA would be silently ignored.
    with pytest.raises(ConfigError, match="the CA would not be checked"):
        mysql_connect_args(f"{URL}?ssl_mode=preferred&ssl_ca=/etc/ssl/db-ca.pem")


def test_an_unknown_mode_names_preferred_among_the_known() -> None:
    with pytest.raises(ConfigError, match="known: disabled, preferred, required"):
        mysql_connect_args(f"{URL}?ssl_mode=sometimes")


def test_django_preferred_stays_preferred() -> None:
    pytest.importorskip("django")
    from outboxer.contrib.django.conf import mysql_query

    query = mysql_query("default", {"ssl_mode": "PREFERRED"})
    assert query["ssl_mode"].lower() == "preferred", query
